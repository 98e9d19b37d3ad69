"""The MCP endpoint against the official SDK's own client, over a real socket; and the
JSON-RPC handler behind OpenEnv's WebSocket ``mcp`` frame."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
import uvicorn
from mcp.client.client import Client
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from starlette.applications import Starlette
from starlette.routing import Route

import envport
from envport.envs.echo import EchoEnv
from envport.errors import ForbiddenError
from envport.mcp.jsonrpc import handle_jsonrpc
from envport.mcp.server import MCPEndpoint
from envport.server.sessions import ServerConfig, SessionManager
from envport.session import Session
from envport.tools import tool


def message_schema(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "message": {"type": "string", "title": "Message", "description": description}
        },
        "required": ["message"],
        "additionalProperties": False,
    }


ECHO_SCHEMA = message_schema("The text to echo.")
REVERSE_SCHEMA = message_schema("The text to reverse.")


def echo_factory() -> envport.Env[Any, Any]:
    return envport.make("echo-v1")


@dataclass
class Served:
    url: str
    manager: SessionManager
    endpoint: MCPEndpoint


@asynccontextmanager
async def serve(
    config: ServerConfig | None = None,
    factory: Callable[[], envport.Env[Any, Any]] = echo_factory,
) -> AsyncIterator[Served]:
    """The endpoint on a real uvicorn server at 127.0.0.1:<ephemeral port>."""
    manager = SessionManager(factory, config or ServerConfig())
    endpoint = MCPEndpoint(manager, name="echo-v1")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with endpoint.running():
            yield
        await manager.close_all()

    app = Starlette(
        routes=[Route("/mcp", endpoint.asgi, methods=["GET", "POST", "DELETE"])],
        lifespan=lifespan,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", ws="none", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn exited before it started")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield Served(f"http://127.0.0.1:{port}/mcp", manager, endpoint)
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def mcp_session(
    url: str, headers: dict[str, str] | None = None
) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def eventually(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll ``predicate``: the SDK ends a session in a server task after the DELETE reply."""
    for _ in range(int(within_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition still false after {within_s} s")


# --- Streamable HTTP endpoint ----------------------------------------------------------


async def test_initialize_list_and_call_tools() -> None:
    async with serve() as srv, mcp_session(srv.url) as session:
        init = session.initialize_result
        assert init is not None
        assert init.server_info.name == "echo-v1"
        assert init.capabilities.tools is not None
        await session.send_ping()

        listed = await session.list_tools()
        tools = {t.name: t for t in listed.tools}
        assert set(tools) == {"echo", "reverse"}
        assert tools["echo"].description == "Echo a message back."
        assert tools["echo"].input_schema == ECHO_SCHEMA
        assert tools["reverse"].input_schema == REVERSE_SCHEMA

        result = await session.call_tool("echo", {"message": "hello"})
        assert not result.is_error
        assert [(c.type, c.text) for c in result.content] == [("text", "hello")]  # type: ignore[union-attr]
        assert result.structured_content == {"result": "hello"}

        result = await session.call_tool("reverse", {"message": "abc"})
        assert result.content[0].text == "cba"  # type: ignore[union-attr]


async def test_unknown_tool_is_a_protocol_error_naming_the_tools() -> None:
    async with serve() as srv, mcp_session(srv.url) as session:
        with pytest.raises(MCPError) as info:
            await session.call_tool("nope", {})
        assert info.value.code == -32602
        assert "Unknown tool 'nope'" in info.value.message
        assert "echo, reverse" in info.value.message


async def test_bad_arguments_are_a_tool_error_the_model_can_read() -> None:
    async with serve() as srv, mcp_session(srv.url) as session:
        result = await session.call_tool("echo", {"msg": "hi"})
        assert result.is_error
        assert result.structured_content is None
        text = result.content[0].text  # type: ignore[union-attr]
        assert "Invalid arguments for tool 'echo'" in text
        assert "message: Field required" in text

        result = await session.call_tool("echo", {"message": 3})
        assert result.is_error
        assert "message: Input should be a valid string" in result.content[0].text  # type: ignore[union-attr]

        # The session is still usable after the errors.
        result = await session.call_tool("echo", {"message": "ok"})
        assert not result.is_error


async def test_each_mcp_session_gets_its_own_envport_session_released_on_close() -> None:
    async with serve() as srv:
        assert srv.manager.active == 0
        async with mcp_session(srv.url) as one, mcp_session(srv.url) as two:
            assert srv.manager.active == 0  # created on first use, not on initialize
            await one.call_tool("echo", {"message": "a"})
            await two.call_tool("echo", {"message": "b"})
            await one.call_tool("echo", {"message": "c"})
            assert srv.manager.active == 2
            sessions = list(srv.manager.sessions.values())
            assert sorted(s.env.step_count for s in sessions) == [1, 2]
            assert all(s.env.episode_id is not None for s in sessions)  # reset once
            assert all(s.attached == 1 for s in sessions)  # the reaper leaves them alone
        # Closing the client sends DELETE; the SDK ends the session, envport's follows.
        await eventually(lambda: srv.manager.active == 0)
        assert all(s.closed for s in sessions)


async def test_shutdown_releases_sessions_left_open() -> None:
    async with serve() as srv:
        async with (
            streamable_http_client(srv.url, terminate_on_close=False) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            await session.call_tool("echo", {"message": "a"})
        # The client left without DELETE: the MCP session, and its envport one, live on.
        assert srv.manager.active == 1
        owned = next(iter(srv.manager.sessions.values()))
        assert not owned.closed
    assert owned.closed
    assert srv.manager.active == 0


async def test_header_binds_an_existing_envport_session() -> None:
    async with serve() as srv:
        trainer = await srv.manager.create()
        await trainer.reset()
        headers = {"X-Envport-Session": trainer.token}
        async with mcp_session(srv.url, headers) as session:
            listed = await session.list_tools()
            assert {t.name for t in listed.tools} == {"echo", "reverse"}
            await session.call_tool("echo", {"message": "x"})
            await session.call_tool("reverse", {"message": "y"})
            assert srv.manager.active == 1  # no session of its own
            assert trainer.env.step_count == 2
        await asyncio.sleep(0.05)
        assert not trainer.closed  # the endpoint never closes a shared session
        assert srv.manager.active == 1


async def test_the_tools_only_token_calls_tools_on_the_session_and_nothing_else() -> None:
    async with serve() as srv:
        trainer = await srv.manager.create()
        await trainer.reset()
        headers = {"X-Envport-Session": trainer.tools_token}
        async with mcp_session(srv.url, headers) as session:
            listed = await session.list_tools()
            assert {t.name for t in listed.tools} == {"echo", "reverse"}
            await session.call_tool("echo", {"message": "x"})
            assert trainer.env.step_count == 1
            assert srv.manager.active == 1
        with pytest.raises(ForbiddenError):  # what every control route looks tokens up by
            srv.manager.by_token(trainer.tools_token)
        await srv.manager.close(trainer)
        async with mcp_session(srv.url, headers) as session:  # closed: the token is gone
            with pytest.raises(MCPError) as info:
                await session.call_tool("echo", {"message": "x"})
            assert "No live session for that token" in info.value.message


async def test_unknown_session_header_is_a_clear_error() -> None:
    async with serve() as srv, mcp_session(srv.url, {"X-Envport-Session": "bogus"}) as session:
        with pytest.raises(MCPError) as info:
            await session.call_tool("echo", {"message": "x"})
        assert info.value.code == -32600
        assert "No live session for that token" in info.value.message
        assert srv.manager.active == 0


async def test_capacity_error_says_when_to_retry() -> None:
    config = ServerConfig(max_sessions=1, queue_timeout_s=0)
    async with serve(config) as srv, mcp_session(srv.url) as one, mcp_session(srv.url) as two:
        await one.call_tool("echo", {"message": "a"})
        with pytest.raises(MCPError) as info:
            await two.call_tool("echo", {"message": "b"})
        assert "at capacity" in info.value.message
        assert info.value.data["retry_after_s"] >= 1


async def test_auto_mode_client_falls_back_to_a_stateful_session() -> None:
    async with serve() as srv, Client(srv.url) as client:
        assert client.session.initialize_result is not None  # handshake, not discover
        result = await client.call_tool("echo", {"message": "hi"})
        assert result.content[0].text == "hi"  # type: ignore[union-attr]
        assert srv.manager.active == 1


async def test_an_endless_chunked_body_is_refused_without_being_read_whole() -> None:
    """A plain JSON-RPC POST with no Content-Length (chunked) is counted as it arrives and
    refused once over ``max_frame_bytes``, not read whole first: the client gets its 413
    while still sending (what it got to send is what the socket buffers held)."""
    async with serve(ServerConfig(max_frame_bytes=64 * 1024)) as srv:
        url = httpx2.URL(srv.url)
        reader, writer = await asyncio.open_connection(url.host, url.port)
        writer.write(
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        response = asyncio.create_task(reader.read(1024))
        chunk, sent, most = b" " * 65536, 0, 64 * 2**20
        try:
            while not response.done() and sent < most:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                sent += len(chunk)
        except ConnectionError:
            pass  # the server answered and closed: the answer is waiting
        if not response.done():
            writer.write(b"0\r\n\r\n")
        head = await asyncio.wait_for(response, 30)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
        assert sent < most // 2, f"the server read {sent} bytes before refusing them"

        async with httpx2.AsyncClient() as http:  # and it goes on serving
            response2 = await http.post(srv.url, json=rpc("tools/list"))
        assert {t["name"] for t in response2.json()["result"]["tools"]} == {"echo", "reverse"}


async def test_not_running_answers_503() -> None:
    manager = SessionManager(echo_factory, ServerConfig())
    endpoint = MCPEndpoint(manager, name="echo-v1")
    app = Starlette(routes=[Route("/mcp", endpoint.asgi, methods=["POST"])])
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.post("/mcp", json={})
    assert response.status_code == 503
    assert "not running" in response.json()["message"]


async def test_with_host_checks_on_a_plain_post_goes_through_the_sdk_s_checks() -> None:
    """An embedder that sets TransportSecuritySettings keeps the SDK's Host/Origin checks
    for every POST: the plain JSON-RPC shortcut is off, and a request from a host not
    allowed is refused, not answered."""
    from mcp.server.transport_security import TransportSecuritySettings

    manager = SessionManager(echo_factory, ServerConfig())
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=["good.example"]
    )
    endpoint = MCPEndpoint(manager, name="echo-v1", security=security)
    app = Starlette(routes=[Route("/mcp", endpoint.asgi, methods=["POST"])])
    request = {"jsonrpc": "2.0", "method": "tools/list", "id": 1}
    async with endpoint.running():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://evil.example") as http:
            response = await http.post("/mcp", json=request)
    assert response.status_code >= 400
    assert "result" not in response.text
    await manager.close_all()


class MeasuringEnv(EchoEnv):
    """Tools whose results JSON has no form for: what a metric or a file read returns."""

    @tool
    async def measure(self) -> dict[str, Any]:
        """Measure: no samples yet, so the mean is NaN and the best is -inf."""
        return {"mean": math.nan, "best": -math.inf, "n": 0}

    @tool
    async def raw(self) -> Any:
        """The raw bytes of a file that is not UTF-8."""
        return b"\xff\xfe"


async def test_a_tool_result_json_cannot_write_is_sent_as_its_text_shows_it() -> None:
    """NaN, infinities and bytes in a tool's result: every path answers with valid JSON,
    ``null`` for the non-finite numbers, as the text block already shows them."""
    expected = {"mean": None, "best": None, "n": 0}
    async with serve(factory=MeasuringEnv) as srv:
        async with mcp_session(srv.url) as session:
            result = await session.call_tool("measure", {})
            assert not result.is_error
            assert result.structured_content == expected
            assert json.loads(result.content[0].text) == expected  # type: ignore[union-attr]
            raw = await session.call_tool("raw", {})
            assert not raw.is_error
            assert raw.structured_content == {"result": str(b"\xff\xfe")}

        # OpenEnv's plain JSON-RPC POST, on a one-request environment.
        async with httpx2.AsyncClient() as http:
            for name, value in [("measure", expected), ("raw", str(b"\xff\xfe"))]:
                request = rpc("tools/call", {"name": name, "arguments": {}})
                response = await http.post(srv.url, json=request)
                assert response.status_code == 200, response.text
                reply = response.json()["result"]
                assert reply["isError"] is False
                assert reply["data"] == value
                assert json.loads(reply["content"][0]["text"]) == value


# --- JSON-RPC over the WebSocket ``mcp`` frame -----------------------------------------


@pytest.fixture
async def session() -> AsyncIterator[Session]:
    s = Session(echo_factory)
    await s.reset()
    yield s
    await s.close()


def rpc(method: str, params: Any = None, id: Any = 1) -> dict[str, Any]:
    request: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": id}
    if params is not None:
        request["params"] = params
    return request


async def test_jsonrpc_initialize_ping_and_list(session: Session) -> None:
    reply = await handle_jsonrpc(session, rpc("initialize", {"protocolVersion": "2025-03-26"}))
    assert reply["jsonrpc"] == "2.0"
    assert reply["id"] == 1
    assert reply["result"]["protocolVersion"] == "2025-03-26"
    assert reply["result"]["capabilities"] == {"tools": {"listChanged": False}}
    assert reply["result"]["serverInfo"]["name"] == "envport"

    unknown = await handle_jsonrpc(session, rpc("initialize", {"protocolVersion": "1999-01-01"}))
    assert unknown["result"]["protocolVersion"] == "2025-06-18"

    assert await handle_jsonrpc(session, rpc("ping", id="p")) == {
        "jsonrpc": "2.0",
        "id": "p",
        "result": {},
    }
    note = await handle_jsonrpc(session, {"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert note == {"jsonrpc": "2.0", "id": None, "result": {}}

    listed = await handle_jsonrpc(session, rpc("tools/list"))
    tools = {t["name"]: t for t in listed["result"]["tools"]}
    assert set(tools) == {"echo", "reverse"}
    assert tools["echo"]["inputSchema"] == ECHO_SCHEMA
    assert tools["echo"]["description"] == "Echo a message back."


async def test_jsonrpc_tools_call(session: Session) -> None:
    reply = await handle_jsonrpc(
        session, rpc("tools/call", {"name": "reverse", "arguments": {"message": "abc"}}, id=7)
    )
    assert reply == {
        "jsonrpc": "2.0",
        "id": 7,
        "result": {
            "content": [{"type": "text", "text": "cba"}],
            "isError": False,
            "structuredContent": {"result": "cba"},
            "data": "cba",
        },
    }
    assert session.env.step_count == 1

    bad = await handle_jsonrpc(session, rpc("tools/call", {"name": "echo", "arguments": {}}))
    assert bad["result"]["isError"] is True
    assert "message: Field required" in bad["result"]["content"][0]["text"]
    assert bad["result"]["data"] is None


@pytest.mark.parametrize(
    ("request_", "code", "fragment"),
    [
        ("{not json", -32700, "Parse error"),
        (b"[1, 2]", -32600, "expected a JSON object, got list"),
        (42, -32600, "expected a JSON object, got int"),
        ({"method": "ping", "id": 1}, -32600, '"jsonrpc" must be "2.0"'),
        ({"jsonrpc": "1.0", "method": "ping", "id": 1}, -32600, '"jsonrpc" must be "2.0"'),
        ({"jsonrpc": "2.0", "id": 1}, -32600, '"method" must be a non-empty string'),
        ({"jsonrpc": "2.0", "method": 5, "id": 1}, -32600, '"method" must be'),
        ({"jsonrpc": "2.0", "method": "ping", "id": [1]}, -32600, '"id" must be'),
        ({"jsonrpc": "2.0", "method": "ping", "id": True}, -32600, '"id" must be'),
        ({"jsonrpc": "2.0", "method": "ping", "params": [1], "id": 1}, -32600, '"params"'),
        (rpc("resources/list"), -32601, "Method not found: resources/list"),
        (rpc("tools/call", {"arguments": {}}), -32602, "Missing 'name'"),
        (rpc("tools/call", {"name": "echo", "arguments": [1]}), -32602, "must be an object"),
        (rpc("tools/call", {"name": "nope"}), -32602, "Unknown tool 'nope'"),
    ],
)
async def test_jsonrpc_errors(session: Session, request_: Any, code: int, fragment: str) -> None:
    reply = await handle_jsonrpc(session, request_)
    assert reply["jsonrpc"] == "2.0"
    assert "result" not in reply
    assert reply["error"]["code"] == code
    assert fragment in reply["error"]["message"]
    assert set(reply["error"]) == {"code", "message", "data"}
    request_id = request_.get("id") if isinstance(request_, dict) else None
    if isinstance(request_id, int | str) and not isinstance(request_id, bool):
        assert reply["id"] == request_id
    else:
        assert reply["id"] is None


async def test_jsonrpc_accepts_json_text_and_survives_a_closed_session(session: Session) -> None:
    reply = await handle_jsonrpc(session, json.dumps(rpc("ping", id=3)))
    assert reply == {"jsonrpc": "2.0", "id": 3, "result": {}}

    await session.close()
    reply = await handle_jsonrpc(session, rpc("tools/call", {"name": "echo", "arguments": {}}))
    assert reply["error"]["code"] == -32603
    assert "closed" in reply["error"]["message"]
    assert reply["error"]["data"]["code"] == "SESSION_CLOSED"


async def test_sessionless_protocol_gets_a_one_request_environment() -> None:
    async with serve() as srv, Client(srv.url, mode="2026-07-28") as client:
        result = await client.call_tool("echo", {"message": "hi"})
        assert result.content[0].text == "hi"  # type: ignore[union-attr]
        listed = await client.list_tools()
        assert {t.name for t in listed.tools} == {"echo", "reverse"}
        await eventually(lambda: srv.manager.active == 0)
