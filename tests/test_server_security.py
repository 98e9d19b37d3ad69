"""Web pages kept out: Origin allow-list, JSON-only POST bodies, the MCP Host check;
and the clients that are not browsers (envport's, OpenEnv's, the MCP SDK's) unaffected."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from openenv.core.generic_client import GenericEnvClient
from pydantic import ValidationError
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from envport.client import EnvClient
from envport.server import ServerConfig
from envport.server.security import check_json_body, is_json_media_type, origin_allowed
from tests.support.servers import run_env_server

EVIL = "https://evil.example"
STEP = {"action": {"message": "from a web page"}}
TOOL_CALL = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "tools/call",
    "params": {"name": "echo", "arguments": {"message": "pwn"}},
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    with run_env_server("echo-v1") as (url, app):
        yield url, app


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/ws"


# --- Origin ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/step", STEP),
        ("POST", "/reset", {"workspace": "/etc"}),
        ("POST", "/sessions", None),
        ("POST", "/mcp", TOOL_CALL),
        ("GET", "/state", None),
        ("DELETE", "/sessions", None),
    ],
)
async def test_browser_origin_is_refused(
    served: tuple[str, Any], method: str, path: str, body: Any
) -> None:
    url, app = served
    before = app.state.manager.stats()
    async with httpx.AsyncClient(base_url=url) as http:
        # Even as JSON (a page may send that after a preflight the server never answers).
        r = await http.request(method, path, json=body, headers={"Origin": EVIL})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "FORBIDDEN"
    assert EVIL in r.json()["detail"]
    assert app.state.manager.stats()["active_sessions"] == before["active_sessions"]


async def test_browser_origin_websocket_handshake_is_refused(served: tuple[str, Any]) -> None:
    url, _app = served
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(url), origin=EVIL):  # type: ignore[arg-type]
            pass
    assert refused.value.response.status_code == 403
    for origin in ("null", "http://127.0.0.1:8000", "http://localhost:3000"):
        with pytest.raises(InvalidStatus):  # no browser origin is allowed by default
            async with connect(ws_url(url), origin=origin):  # type: ignore[arg-type]
                pass


async def test_allowed_origins_are_accepted() -> None:
    config = ServerConfig(allowed_origins=["https://ui.example", "http://localhost:*"])
    with run_env_server("echo-v1", config) as (url, _):
        for origin in ("https://ui.example", "http://localhost:5173"):
            async with connect(ws_url(url), origin=origin) as ws:  # type: ignore[arg-type]
                await ws.send(json.dumps({"type": "reset"}))
                assert json.loads(await ws.recv())["type"] == "observation"
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/step", json=STEP, headers={"Origin": origin})
                assert r.status_code == 200
        for origin in ("https://ui.example.evil", "http://localhost", "http://localhost:x"):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/step", json=STEP, headers={"Origin": origin})
                assert r.status_code == 403, origin


def test_origin_matching() -> None:
    allowed = ["https://a.example", "http://localhost:*"]
    assert origin_allowed("https://a.example", allowed)
    assert origin_allowed("http://localhost:8000", allowed)
    assert not origin_allowed("https://a.example:443", allowed)
    assert not origin_allowed("http://localhost", allowed)
    assert not origin_allowed("http://localhost:80.evil.example", allowed)
    assert not origin_allowed("null", allowed)
    assert not origin_allowed("https://a.example", [])


@pytest.mark.parametrize(
    "value",
    [
        "localhost",
        "localhost:3000",
        "https://ui.example/",
        "https://ui.example/app",
        "null",
        "https://",
        "http://localhost:",
        "http://localhost:x",
        "*",
        "https://user@ui.example",
    ],
)
def test_server_config_refuses_a_value_no_browser_origin_matches(value: str) -> None:
    """Such a value was accepted and never matched: every browser request was refused."""
    with pytest.raises(ValidationError) as refused:
        ServerConfig(allowed_origins=["https://ok.example", value])
    (error,) = refused.value.errors()
    assert error["loc"] == ("allowed_origins",)
    assert repr(value) in error["msg"]
    assert "scheme://host[:port]" in error["msg"]


def test_server_config_keeps_origins_as_browsers_send_them() -> None:
    config = ServerConfig(
        allowed_origins=[
            "https://ui.example",
            "http://localhost:*",
            "HTTPS://UI.Example:443",
            "http://127.0.0.1:80",
            "http://[::1]:5173",
            "chrome-extension://abcdef",
        ]
    )
    assert config.allowed_origins == [
        "https://ui.example",
        "http://localhost:*",
        "https://ui.example",
        "http://127.0.0.1",
        "http://[::1]:5173",
        "chrome-extension://abcdef",
    ]


# --- JSON bodies ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/step", "/reset", "/sessions"])
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None],
)
async def test_a_body_not_declared_json_is_415(
    served: tuple[str, Any], path: str, content_type: str | None
) -> None:
    url, app = served
    headers = {} if content_type is None else {"content-type": content_type}
    before = app.state.manager.stats()["active_sessions"]
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post(path, content=json.dumps(STEP).encode(), headers=headers)
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "INVALID_JSON"
    assert "application/json" in r.json()["detail"]
    assert app.state.manager.stats()["active_sessions"] == before


@pytest.mark.parametrize("content_type", ["text/plain", None])
async def test_mcp_plain_jsonrpc_not_declared_json_is_415(
    served: tuple[str, Any], content_type: str | None
) -> None:
    url, _ = served
    headers = {} if content_type is None else {"content-type": content_type}
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/mcp", content=json.dumps(TOOL_CALL).encode(), headers=headers)
    assert r.status_code == 415
    assert r.json()["error"]["code"] == -32600


async def test_json_bodies_still_work(served: tuple[str, Any]) -> None:
    url, _ = served
    body = json.dumps(STEP).encode()
    async with httpx.AsyncClient(base_url=url) as http:
        for ctype in ("application/json", "application/json; charset=utf-8", "APPLICATION/JSON"):
            r = await http.post("/step", content=body, headers={"content-type": ctype})
            assert r.status_code == 200, ctype
        r = await http.post("/step", content=body, headers={"content-type": "application/x+json"})
        assert r.status_code == 200
        assert (await http.post("/sessions")).status_code == 201  # no body, no type
        assert (await http.post("/reset")).status_code == 200


def test_json_media_types() -> None:
    assert is_json_media_type("application/json")
    assert is_json_media_type("application/problem+json; charset=utf-8")
    assert not is_json_media_type("text/json+plain")
    assert not is_json_media_type("text/plain")
    assert not is_json_media_type(None)
    check_json_body(None, b"")  # nothing to read
    check_json_body(None, b"  ")
    with pytest.raises(Exception, match="application/json"):
        check_json_body(None, b"{}")
    with pytest.raises(Exception, match="text/plain"):
        check_json_body("text/plain", b"")


# --- MCP Host check (DNS rebinding) ----------------------------------------------------


async def test_mcp_refuses_a_foreign_host_on_a_loopback_server(served: tuple[str, Any]) -> None:
    url, app = served
    before = app.state.manager.active
    async with httpx.AsyncClient(base_url=url) as http:
        rebound = {"Host": "evil.example:8000"}
        r = await http.post("/mcp", json=TOOL_CALL, headers=rebound)  # plain JSON-RPC
        assert r.status_code == 421
        stream = {**rebound, "Accept": "application/json, text/event-stream"}
        r = await http.post("/mcp", json=TOOL_CALL, headers=stream)  # Streamable HTTP
        assert r.status_code == 421
        for host in ("localhost", url.removeprefix("http://")):
            r = await http.post("/mcp", json=TOOL_CALL, headers={"Host": host})
            assert r.json()["result"]["data"] == "pwn", host
    assert app.state.manager.active == before


async def test_mcp_host_check_only_when_bound_to_loopback() -> None:
    from envport.server import create_app
    from envport.server.security import mcp_security

    assert mcp_security("0.0.0.0", []) is None
    loopback = mcp_security("127.0.0.1", ["https://ui.example"])
    assert loopback is not None
    assert loopback.enable_dns_rebinding_protection
    assert loopback.allowed_origins == ["https://ui.example"]
    app = create_app("echo-v1", host="0.0.0.0")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://box:8000") as http:
            r = await http.post("/mcp", json=TOOL_CALL)
            assert r.json()["result"]["data"] == "pwn"


# --- the official clients, unaffected --------------------------------------------------


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_envport_client_unaffected(served: tuple[str, Any], transport: Any) -> None:
    url, _ = served
    async with EnvClient.connect(url, transport=transport) as env:
        await env.reset(seed=1)
        result = await env.step({"message": "ok"})
        assert result.observation["echoed_message"] == "ok"


async def test_openenv_client_unaffected(served: tuple[str, Any]) -> None:
    url, _ = served
    async with GenericEnvClient(base_url=url) as env:
        await env.reset()
        assert (await env.step({"message": "hi"})).observation["echoed_message"] == "hi"


async def test_mcp_sdk_client_unaffected(served: tuple[str, Any]) -> None:
    url, _ = served
    async with (
        httpx2.AsyncClient() as http,
        streamable_http_client(url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        result = await session.call_tool("echo", {"message": "sdk"})
        assert result.structured_content == {"result": "sdk"} or "sdk" in str(result.content)
