"""OpenEnv's MCP sessions over plain HTTP ``/mcp`` (``openenv/session/create``, tools
named by ``params.session_id``, ``openenv/session/close``): what ``MCPToolClient``'s
production mode speaks, here with OpenEnv's own client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openenv.core.mcp_client import MCPToolClient
from websockets.asyncio.client import connect

from envport.server import ServerConfig
from tests.support.servers import run_env_server


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    with run_env_server("echo-v1") as (url, app):
        yield url, app


def rpc(method: str, params: dict[str, Any] | None = None, id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params or {}}


async def post(url: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        reply: dict[str, Any] = (await http.post("/mcp", json=body, headers=headers)).json()
    return reply


async def test_openenv_mcp_tool_client_production_mode(served: tuple[str, Any]) -> None:
    url, app = served
    manager = app.state.manager
    before = manager.active
    client = MCPToolClient(base_url=url)
    client.use_production_mode = True
    try:
        tools = await client.list_tools()
        assert {t.name for t in tools} == {"echo", "reverse"}
        assert await client.call_tool("echo", message="hi") == "hi"
        assert await client.call_tool("reverse", message="abc") == "cba"
        assert manager.active == before + 1  # one session, held across the requests
        session_id = client._production_session_id
        assert session_id is not None
        session = manager.for_tools(session_id)
        assert session.env.step_count == 2  # both calls on the same environment
    finally:
        await client.close()
    assert manager.active == before  # openenv/session/close ended it
    assert session.closed


async def test_session_methods_shapes_and_errors(served: tuple[str, Any]) -> None:
    url, _app = served
    created = await post(url, rpc("openenv/session/create", id=5))
    assert created["id"] == 5
    session_id = created["result"]["session_id"]
    assert isinstance(session_id, str)
    assert session_id
    listed = await post(url, rpc("tools/list", {"session_id": session_id}))
    assert {t["name"] for t in listed["result"]["tools"]} == {"echo", "reverse"}
    call = {"name": "echo", "arguments": {"message": "x"}, "session_id": session_id}
    assert (await post(url, rpc("tools/call", call)))["result"]["data"] == "x"

    unknown = await post(url, rpc("tools/call", {**call, "session_id": "nope"}))
    assert unknown["error"]["code"] == -32602
    assert "Unknown session_id" in unknown["error"]["message"]
    missing = await post(url, rpc("openenv/session/close"))
    assert missing["error"]["code"] == -32602
    assert (await post(url, rpc("openenv/session/close", {"session_id": "nope"})))["error"][
        "code"
    ] == -32602

    closed = await post(url, rpc("openenv/session/close", {"session_id": session_id}, id=9))
    assert closed == {
        "jsonrpc": "2.0",
        "id": 9,
        "result": {"session_id": session_id, "closed": True},
    }
    again = await post(url, rpc("tools/call", call))
    assert again["error"]["code"] == -32602  # gone


async def test_a_session_made_elsewhere_is_usable_not_closable(served: tuple[str, Any]) -> None:
    url, app = served
    async with httpx.AsyncClient(base_url=url) as http:
        made = (await http.post("/sessions")).json()
        await http.post("/reset", json={}, headers={"X-Envport-Session": made["token"]})
    call = {"name": "echo", "arguments": {"message": "y"}, "session_id": made["tools_token"]}
    assert (await post(url, rpc("tools/call", call)))["result"]["data"] == "y"
    refused = await post(url, rpc("openenv/session/close", {"session_id": made["tools_token"]}))
    assert refused["error"]["code"] == -32600
    assert not app.state.manager.get(made["session_id"]).closed


async def test_idle_openenv_sessions_are_reaped_used_ones_kept() -> None:
    # Used every 0.3 s (plus a request to a server thread that a loaded machine slows),
    # for longer than the idle timeout, which must not trip in between: 1 s, not 0.6 s.
    config = ServerConfig(idle_timeout_s=1.0, reap_interval_s=0.05)
    with run_env_server("echo-v1", config) as (url, app):
        session_id = (await post(url, rpc("openenv/session/create")))["result"]["session_id"]
        call = {"name": "echo", "arguments": {"message": "z"}, "session_id": session_id}
        for _ in range(4):  # 1.2 s in all, used every 0.3 s
            await asyncio.sleep(0.3)
            assert (await post(url, rpc("tools/call", call)))["result"]["data"] == "z"
        listed = await post(url, rpc("tools/list", {"session_id": session_id}))
        assert "result" in listed
        for _ in range(300):  # then idle: reaped (by the server's thread) within 30 s
            if app.state.manager.active == 0:
                break
            await asyncio.sleep(0.1)
        assert app.state.manager.active == 0
        assert (await post(url, rpc("tools/call", call)))["error"]["code"] == -32602


async def test_session_methods_on_a_websocket_mcp_frame(served: tuple[str, Any]) -> None:
    url, _ = served
    async with connect(url.replace("http://", "ws://") + "/ws") as ws:
        await ws.send(json.dumps({"type": "reset"}))
        await ws.recv()
        await ws.send(json.dumps({"type": "mcp", "data": rpc("openenv/session/create")}))
        created = json.loads(await ws.recv())["data"]
        session_id = created["result"]["session_id"]
        # the id works on /mcp: it names this connection's session
        call = {"name": "echo", "arguments": {"message": "w"}, "session_id": session_id}
        assert (await post(url, rpc("tools/call", call)))["result"]["data"] == "w"
        close = rpc("openenv/session/close", {"session_id": session_id})
        await ws.send(json.dumps({"type": "mcp", "data": close}))
        assert json.loads(await ws.recv())["data"]["error"]["code"] == -32600
