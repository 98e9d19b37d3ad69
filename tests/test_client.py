"""EnvClient over every transport, its sync facade, and both clients against both servers."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import httpx
import orjson
import pytest
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from envport.client import EnvClient
from envport.client.transports import WebSocketTransport, _ws_url
from envport.errors import (
    ActionValidationError,
    ConnectionLostError,
    EnvNotResetError,
    NoReplyError,
    PayloadTooLargeError,
    ProtocolError,
    ToolError,
)
from envport.server import ServerConfig, create_app
from envport.serving import free_port, serve_in_thread
from tests.support.faulty_envs import FaultyEnv
from tests.support.servers import run_env_server

Transport = Literal["ws", "http", "inprocess"]


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    with run_env_server("echo-v1", mcp=False) as (url, _):
        yield url


def make_client(kind: Transport, url: str) -> EnvClient:
    if kind == "inprocess":
        return EnvClient.connect("echo-v1")
    return EnvClient.connect(url, transport=kind)


@pytest.mark.parametrize("kind", ["ws", "http", "inprocess"])
async def test_same_episode_on_every_transport(kind: Transport, echo_url: str) -> None:
    async with make_client(kind, echo_url) as env:
        first = await env.reset(seed=5)
        assert first.observation["echoed_message"] == "Echo environment ready!"
        rewards = []
        for msg in ["a", "abcd", "x" * 20]:
            result = await env.step({"message": msg})
            assert result.observation["echoed_message"] == msg
            rewards.append(result.reward)
        assert rewards == pytest.approx([0.1, 0.4, 1.0])
        state = await env.state()
        assert state["step_count"] == 3
        tools = await env.list_tools()
        assert [t["name"] for t in tools] == ["echo", "reverse"]
        assert await env.call_tool("reverse", {"message": "envport"}) == "tropvne"
        with pytest.raises(ToolError) as tool_err:
            await env.call_tool("missing")
        assert tool_err.value.kind == "tool_not_found"
        with pytest.raises(ActionValidationError) as bad:
            await env.step({"msg": "typo"})
        assert "message" in str(bad.value)
        assert (await env.state())["step_count"] == 6  # tool actions are steps too


@pytest.mark.parametrize("kind", ["ws", "http", "inprocess"])
async def test_errors_map_to_the_exception_tree(kind: Transport, echo_url: str) -> None:
    async with make_client(kind, echo_url) as env:
        with pytest.raises(EnvNotResetError):
            await env.step({"message": "too early"})


def test_sync_facade(echo_url: str) -> None:
    with EnvClient.connect(echo_url).sync() as env:
        env.reset(seed=1)
        result = env.step({"message": "sync"})
        assert result.observation["echoed_message"] == "sync"
        assert env.state()["step_count"] == 1
        assert env.call_tool("echo", {"message": "m"}) == "m"


async def test_openenv_client_against_envport_server(echo_url: str) -> None:
    async with GenericEnvClient(base_url=echo_url) as env:
        result = await env.reset(seed=2)
        assert result.observation["echoed_message"] == "Echo environment ready!"
        for i in range(1, 6):
            result = await env.step({"message": "z" * i})
            assert result.observation["message_length"] == i
            assert result.done is False
        state = await env.state()
        assert state["step_count"] == 5
        tools = await env.step({"type": "list_tools"})
        assert {t["name"] for t in tools.observation["tools"]} == {"echo", "reverse"}
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            await env.step({"wrong": 1})


def test_openenv_sync_client_against_envport_server(echo_url: str) -> None:
    with GenericEnvClient(base_url=echo_url).sync() as env:
        env.reset()
        assert env.step({"message": "hi"}).reward == pytest.approx(0.2)
        assert env.state()["step_count"] == 1


async def test_envport_client_against_openenv_server(openenv_echo_url: str) -> None:
    async with EnvClient.connect(openenv_echo_url) as env:
        assert env.transport.extended is False  # type: ignore[attr-defined]
        result = await env.reset(seed=3)
        assert result.observation["echoed_message"] == "Echo environment ready!"
        for msg in ["one", "three"]:
            result = await env.step({"message": msg})
            assert result.observation["echoed_message"] == msg
        assert (await env.state())["step_count"] == 2
        with pytest.raises(ActionValidationError, match="Invalid message"):
            await env.step({"wrong": 1})  # OpenEnv's error frame, mapped to our tree
        assert (await env.step({"message": "still"})).observation["echoed_message"] == "still"


async def test_resume_after_dropped_connection(echo_url: str) -> None:
    async with EnvClient.connect(echo_url) as env:
        await env.reset()
        await env.step({"message": "before"})
        await env.transport.drop_connection()  # type: ignore[attr-defined]
        result = await env.step({"message": "after"})
        assert result.observation["echoed_message"] == "after"
        assert (await env.state())["step_count"] == 2


async def test_late_reply_is_never_taken_for_the_next() -> None:
    with run_env_server(FaultyEnv, ServerConfig(call_timeout_s=10), mcp=False) as (url, _):
        async with EnvClient.connect(url) as env:
            await env.reset()
            # (only now: a loaded machine can take 0.3 s to answer the reset)
            env.transport.timeout_s = 0.3  # type: ignore[attr-defined]
            with pytest.raises(NoReplyError) as timeout:  # this side's limit, not the server's
                await env.step({"message": "sleep:1.0"})
            assert timeout.value.code == "TIMEOUT"
            env.transport.timeout_s = 5  # type: ignore[attr-defined]
            # The late observation for "sleep:1.0" arrives first and must be skipped.
            state = await env.state()
            assert state["step_count"] == 1
            result = await env.step({"message": "next"})
            assert result.observation["echoed_message"] == "next"


async def test_an_id_less_error_owed_to_an_abandoned_request_is_not_taken_for_the_next() -> None:
    """The server answers a frame too large to parse with an error without an id. When
    that frame was abandoned (a client-side timeout), its error must not be taken for the
    next request's reply: the server answers in order, so it is the abandoned one's."""
    config = ServerConfig(call_timeout_s=10, max_frame_bytes=65536)
    with run_env_server(FaultyEnv, config, mcp=False) as (url, _):
        async with EnvClient.connect(url) as env:
            await env.reset()
            transport = env.transport
            assert isinstance(transport, WebSocketTransport)
            transport.timeout_s = 0.3
            transport.server_max_frame_bytes = None  # send what the server will refuse
            with pytest.raises(NoReplyError):  # the server is busy for a second
                await env.step({"message": "sleep:1.0"})
            with pytest.raises(NoReplyError):  # queued behind it: abandoned too
                await env.step({"message": "x" * 100_000})
            transport.timeout_s = 10
            result = await env.step({"message": "next"})  # not the big one's error
            assert result.observation["echoed_message"] == "next"
            # With nothing abandoned, an id-less error is this request's.
            with pytest.raises(PayloadTooLargeError):
                await env.step({"message": "x" * 100_000})
            assert (await env.state())["step_count"] == 2


async def test_frames_over_a_limit_are_payload_too_large_never_resent() -> None:
    """A frame over the server's limit (its hello says it) is refused before it is sent;
    one the server closes the connection for (1009), or a reply over this client's own
    limit (it closes with 1009), is PayloadTooLargeError at once, not a dropped
    connection resumed and resent; the next request resumes the session."""
    config = ServerConfig(max_frame_bytes=65536)
    with run_env_server("echo-v1", config, mcp=False) as (url, _):
        # (a 30,000-character echo's reply is some 150 bytes over: too big for this side)
        transport = WebSocketTransport(url, max_frame_bytes=30_100)
        async with EnvClient(transport) as env:
            await env.reset()
            session = transport.session_id
            assert transport.server_max_frame_bytes == 65536
            resumes = 0
            resume = transport._resume

            async def counted() -> None:
                nonlocal resumes
                resumes += 1
                await resume()

            transport._resume = counted  # type: ignore[method-assign]
            with pytest.raises(PayloadTooLargeError, match="not sent"):
                await env.step({"message": "x" * 100_000})
            assert resumes == 0
            transport.server_max_frame_bytes = None  # as a client that does not know it
            with pytest.raises(PayloadTooLargeError, match="too large for it"):  # 2x: 1009
                await env.step({"message": "x" * 200_000})
            assert resumes == 0
            assert (await env.state())["step_count"] == 0  # resumed, same session
            assert resumes == 1
            with pytest.raises(PayloadTooLargeError, match="reply exceeded"):
                await env.step({"message": "y" * 30_000})  # its echo is too big for us
            assert resumes == 1
            assert (await env.state())["step_count"] == 1  # the step took effect
            assert resumes == 2
            assert transport.session_id == session


@asynccontextmanager
async def server_that_stops_reading() -> AsyncIterator[str]:
    """A WebSocket server (raw socket) that answers ``hello`` as OpenEnv does, then never
    reads again: a large frame sent to it waits for the socket buffers forever."""
    guid = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        key = re.search(r"(?i)sec-websocket-key: *(\S+)", head)
        assert key is not None
        accept = base64.b64encode(hashlib.sha1((key[1] + guid).encode()).digest()).decode()
        writer.write(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n".encode()
        )
        _, b1 = await reader.readexactly(2)  # the hello: a small masked text frame
        await reader.readexactly(4 + (b1 & 0x7F))
        error = orjson.dumps({"type": "error", "data": {"message": "?", "code": "UNKNOWN_TYPE"}})
        writer.write(bytes((0x81, len(error))) + error)
        await asyncio.Event().wait()  # and never read again

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for writer in writers:
                writer.transport.abort()


async def test_the_call_limit_covers_sending_to_a_server_that_stopped_reading() -> None:
    async with server_that_stops_reading() as url:
        transport = WebSocketTransport(url, timeout_s=1)
        env = EnvClient(transport)
        await transport.open()
        assert not transport.extended
        call = env.step({"message": "x" * 32 * 2**20})  # more than the socket buffers hold
        with pytest.raises(NoReplyError, match="could not be sent within 1 s"):
            await asyncio.wait_for(call, 60)  # (a bound for the test; it hung for good)
        assert transport._ws is None  # a frame cut off mid-send: the connection is dropped
        await env.close()


async def test_close_while_a_call_is_in_flight_raises_nothing_and_ends_the_call() -> None:
    with run_env_server(FaultyEnv, mcp=False) as (url, _):
        env = EnvClient.connect(url)
        await env.__aenter__()
        await env.reset()
        call = asyncio.create_task(env.step({"message": "sleep:1.0"}))
        for _ in range(1000):  # until the step is under way
            if env.transport._lock.locked():  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        await env.close()  # never websockets' "concurrent recv" RuntimeError
        with pytest.raises(ConnectionLostError, match="closed"):
            await asyncio.wait_for(call, 10)
        assert env.transport._ws is None  # type: ignore[attr-defined]


def test_sync_close_ends_its_thread_even_if_close_raises() -> None:
    class FailingClose(CannedTransport):
        async def close(self) -> None:
            raise RuntimeError("close failed")

    before = threading.active_count()
    client = EnvClient(FailingClose()).sync()
    client.open()
    assert threading.active_count() == before + 1
    with pytest.raises(RuntimeError, match="close failed"):
        client.close()
    assert threading.active_count() == before


@pytest.mark.parametrize("extended", [True, False], ids=["envport", "openenv"])
async def test_a_malformed_server_frame_is_a_protocol_error_and_the_client_goes_on(
    extended: bool,
) -> None:
    """A reply that is not JSON, or not an object, raises ProtocolError (never orjson's or
    an AttributeError); the next request is answered as usual."""

    async def handle(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                frame = orjson.loads(raw)
                if frame["type"] == "hello":
                    if extended:
                        info = {"session_id": "s1", "token": "t1"}
                        reply = {"type": "hello", "id": frame["id"], "data": info}
                    else:
                        reply = {"type": "error", "data": {"message": "?", "code": "UNKNOWN_TYPE"}}
                    await ws.send(orjson.dumps(reply).decode())
                    continue
                message = frame["data"]["message"]
                if message in ("not json{", "[1, 2]", '"text"'):
                    await ws.send(message)
                    continue
                data = {"observation": {"echoed_message": message}}
                await ws.send(
                    orjson.dumps({"type": "observation", "id": frame.get("id"), "data": data})
                )

    async with serve(handle, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with EnvClient.connect(f"http://127.0.0.1:{port}") as env:
            assert env.transport.extended is extended  # type: ignore[attr-defined]
            for bad in ("not json{", "[1, 2]", '"text"'):
                with pytest.raises(ProtocolError, match="not a JSON object"):
                    await env.step({"message": bad})
                assert (await env.step({"message": "ok"})).observation["echoed_message"] == "ok"
            with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
                await env.step({"message": "x", "n": 2**70})  # (orjson: 64-bit integers)
            with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
                await env.step({"message": "x", "s": {1, 2}})


class CannedTransport:
    """A transport that answers every request with the next of ``replies``."""

    def __init__(self, *replies: Any) -> None:
        self.replies = list(replies)

    async def open(self) -> None:
        pass

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = self.replies.pop(0)
        return reply

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "reply",
    [
        {"type": "state", "data": {"step_count": 1}},
        {"type": "pong", "data": {}},
        {"type": "observation", "data": [1, 2]},
        {"type": "observation", "data": {"observation": "not a dict"}},
    ],
    ids=["state", "pong", "list data", "bad observation"],
)
async def test_a_reply_of_the_wrong_type_or_shape_is_a_protocol_error(reply: Any) -> None:
    env = EnvClient(CannedTransport(reply, reply))
    with pytest.raises(ProtocolError):
        await env.reset()
    with pytest.raises(ProtocolError):
        await env.step({"message": "x"})


async def test_state_wants_a_state_reply() -> None:
    env = EnvClient(CannedTransport({"type": "observation", "data": {}}, {"type": "state"}))
    with pytest.raises(ProtocolError, match="'observation'"):
        await env.state()
    with pytest.raises(ProtocolError, match="not a JSON object"):
        await env.state()


async def test_an_id_less_frame_that_is_not_an_error_is_never_a_reply() -> None:
    """An envport-protocol server's unsolicited frame without an id (here a ``pong``
    sent before each reply) is skipped, not taken for the request's reply."""

    async def handle(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                frame = orjson.loads(raw)
                if frame["type"] == "hello":
                    info = {"session_id": "s1", "token": "t1"}
                    await ws.send(orjson.dumps({"type": "hello", "id": frame["id"], "data": info}))
                    continue
                await ws.send(orjson.dumps({"type": "pong", "data": {}}))
                data = {"observation": {"echoed_message": frame["data"]["message"]}}
                reply = {"type": "observation", "id": frame["id"], "data": data}
                await ws.send(orjson.dumps(reply))

    async with serve(handle, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with EnvClient.connect(f"http://127.0.0.1:{port}") as env:
            for message in ("a", "b"):
                result = await env.step({"message": message})
                assert result.observation["echoed_message"] == message


async def test_many_concurrent_clients(echo_url: str) -> None:
    async def episode(i: int) -> int:
        async with EnvClient.connect(echo_url) as env:
            await env.reset(seed=i)
            for _ in range(i % 5 + 1):
                await env.step({"message": str(i)})
            return int((await env.state())["step_count"])

    counts = await asyncio.gather(*(episode(i) for i in range(50)))
    assert counts == [i % 5 + 1 for i in range(50)]


# --- connection faults and cancellation (WebSocket transport) -------------------------------


@asynccontextmanager
async def tcp_server(answer: bytes | None) -> AsyncIterator[str]:
    """A real socket that reads the request, writes ``answer`` (if any) and hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if answer is not None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


NOT_WEBSOCKET = {
    "closes at once": None,
    "plain HTTP 200": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    "not HTTP at all": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
}


@pytest.mark.parametrize("answer", list(NOT_WEBSOCKET), ids=list(NOT_WEBSOCKET))
async def test_failed_handshake_is_connection_lost_naming_the_url(answer: str) -> None:
    async with tcp_server(NOT_WEBSOCKET[answer]) as url:
        client = EnvClient.connect(url)
        with pytest.raises(
            ConnectionLostError, match=r"Cannot connect to ws://127\.0\.0\.1:\d+/ws"
        ):
            await client.transport.open()
        with pytest.raises(ConnectionLostError, match="Cannot connect"):
            await client.reset()  # and again on the next call, never a websockets error


async def test_connection_refused_is_connection_lost() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionLostError, match=re.escape(_ws_url(url))):
        async with EnvClient.connect(url):
            pass


async def test_failed_resume_handshake_is_connection_lost(echo_url: str) -> None:
    async with EnvClient.connect(echo_url) as env, tcp_server(None) as closer:
        transport = env.transport
        assert isinstance(transport, WebSocketTransport)
        transport.resume_attempts = 2
        await env.reset()
        transport.url = _ws_url(closer)  # the server is now something that hangs up
        await transport.drop_connection()
        with pytest.raises(ConnectionLostError, match="Could not resume session on ws://"):
            await env.step({"message": "lost"})


async def test_resume_refused_after_server_restart_is_session_lost_then_a_fresh_session() -> None:
    """The server restarted (or the resume grace ran out): the resume ``hello`` gets
    SESSION_NOT_FOUND. The request says the session is gone, the refused connection is
    closed (none is leaked per call), and the next request opens a fresh session."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = ServerConfig()

    def server() -> contextlib.AbstractContextManager[str]:
        app = create_app("echo-v1", config, mcp=False, host="127.0.0.1")
        return serve_in_thread(app, port=port, config=config)

    env = EnvClient.connect(url)
    transport = env.transport
    assert isinstance(transport, WebSocketTransport)
    with server():
        await transport.open()
        await env.reset()
        await env.step({"message": "a"})
        old_session = transport.session_id
    with server():
        for attempt in range(2):
            if attempt:
                await transport.drop_connection()
                transport.token = "expired"  # as if the resume grace had run out
            with pytest.raises(ConnectionLostError, match="session is gone"):
                await env.step({"message": "b"})
            assert transport._ws is None  # the refused connection was closed, not kept
            assert not transport._resuming
            with pytest.raises(EnvNotResetError):  # a fresh session: the episode is lost
                await env.step({"message": "c"})
            assert transport.session_id not in (None, old_session)
        result = await env.reset()
        assert result.observation["echoed_message"] == "Echo environment ready!"
        assert (await env.step({"message": "d"})).observation["echoed_message"] == "d"
        assert (await env.state())["step_count"] == 1
        await env.close()


class ScriptedServer:
    """A WebSocket server speaking the frame protocol, with or without envport's ``hello``.

    It never answers a step whose message is ``"hold"`` until the next frame arrives;
    then it answers the held one first (a late reply) and the new one after it. A
    ``hello`` that resumes waits for ``resume_gate``. A step on a connection that never
    said ``hello`` gets the error a fresh session would give: the episode is lost.
    """

    def __init__(self, *, extended: bool) -> None:
        self.extended = extended
        self.received: list[dict[str, Any]] = []
        self.got_frame = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()
        self.got_resume = asyncio.Event()
        self.resume_gate = asyncio.Event()
        self.resume_gate.set()

    async def handle(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._serve(ws)

    async def _serve(self, ws: ServerConnection) -> None:
        held: list[dict[str, Any]] = []
        said_hello = False
        async for raw in ws:
            frame = orjson.loads(raw)
            self.received.append(frame)
            self.got_frame.set()
            if frame["type"] == "hello":
                if frame["data"].get("resume"):
                    self.got_resume.set()
                    await self.resume_gate.wait()
                said_hello = True
                if self.extended:
                    info = {"session_id": "s1", "token": "t1"}
                    await ws.send(orjson.dumps({"type": "hello", "id": frame["id"], "data": info}))
                else:
                    error = {"message": "Unknown type: hello", "code": "UNKNOWN_TYPE"}
                    await ws.send(orjson.dumps({"type": "error", "data": error}))
                continue
            if frame["type"] == "close":
                await ws.send(orjson.dumps({"type": "closed"}))
                continue
            if self.extended and not said_hello:
                lost = {"message": "Call reset() before step().", "code": "NOT_RESET"}
                await ws.send(orjson.dumps({"type": "error", "id": frame["id"], "data": lost}))
                continue
            message = (frame.get("data") or {}).get("message")
            if message == "hold":
                held.append(frame)
                continue
            await self.release.wait()
            for f in [*held, frame]:
                data = {"observation": {"echoed_message": f["data"]["message"]}}
                reply: dict[str, Any] = {"type": "observation", "data": data}
                if self.extended:
                    reply["id"] = f["id"]
                await ws.send(orjson.dumps(reply))
            held.clear()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        async with serve(self.handle, "127.0.0.1", 0) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("extended", [True, False], ids=["envport", "openenv"])
async def test_cancelled_request_ends_and_its_late_reply_is_skipped(extended: bool) -> None:
    script = ScriptedServer(extended=extended)
    async with script.serving() as url, EnvClient.connect(url) as env:
        assert env.transport.extended is extended  # type: ignore[attr-defined]
        script.got_frame.clear()
        held = asyncio.create_task(env.step({"message": "hold"}))
        await script.got_frame.wait()
        held.cancel()
        done, _ = await asyncio.wait({held}, timeout=5)
        assert done
        assert held.cancelled()
        # The held step's reply arrives before this one's and must not be taken for it.
        result = await env.step({"message": "next"})
        assert result.observation["echoed_message"] == "next"
        assert (await env.step({"message": "again"})).observation["echoed_message"] == "again"


async def test_cancellation_is_never_swallowed_when_the_reply_lands() -> None:
    """Cancel at every scheduling point around the reply's arrival: a request whose
    cancel() was accepted always ends cancelled (never returns, never keeps reading)."""
    script = ScriptedServer(extended=True)
    async with script.serving() as url, EnvClient.connect(url) as env:
        for yields in range(12):
            script.release.clear()
            script.got_frame.clear()
            call = asyncio.create_task(env.step({"message": f"m{yields}"}))
            await script.got_frame.wait()
            script.release.set()  # the server writes the reply now
            for _ in range(yields):
                await asyncio.sleep(0)
            accepted = call.cancel()
            done, _ = await asyncio.wait({call}, timeout=5)
            assert done
            if accepted:
                assert call.cancelled(), f"cancellation swallowed after {yields} yields"
            result = await env.step({"message": "after"})
            assert result.observation["echoed_message"] == "after"


async def test_request_cancelled_mid_resume_resumes_on_the_next() -> None:
    """Cancelled while the resume ``hello`` is unanswered: the next request must resume
    again, never speak on the half-open connection (a fresh session, episode lost)."""
    script = ScriptedServer(extended=True)
    async with script.serving() as url, EnvClient.connect(url) as env:
        assert (await env.step({"message": "a"})).observation["echoed_message"] == "a"
        script.resume_gate.clear()
        await env.transport.drop_connection()  # type: ignore[attr-defined]
        call = asyncio.create_task(env.step({"message": "b"}))
        await script.got_resume.wait()
        call.cancel()
        done, _ = await asyncio.wait({call}, timeout=5)
        assert done
        assert call.cancelled()
        script.resume_gate.set()
        assert (await env.step({"message": "c"})).observation["echoed_message"] == "c"


async def test_cancel_during_resume_keeps_the_session(echo_url: str) -> None:
    """Cancel a request at every point of its reconnect: the next request resumes the
    same session (never a fresh one that silently lost the episode)."""
    async with EnvClient.connect(echo_url) as env:
        transport = env.transport
        assert isinstance(transport, WebSocketTransport)
        session = transport.session_id
        await env.reset()
        steps = 0
        for yields in range(40):
            await transport.drop_connection()
            call = asyncio.create_task(env.step({"message": "x"}))
            for _ in range(yields):
                await asyncio.sleep(0)
            call.cancel()
            done, _ = await asyncio.wait({call}, timeout=5)
            assert done
            result = await env.step({"message": "y"})
            assert result.observation["echoed_message"] == "y"
            count = (await env.state())["step_count"]
            assert count in (steps + 1, steps + 2)  # the cancelled step may have landed
            steps = count
        assert transport.session_id == session


async def test_openenv_style_plain_jsonrpc_on_envports_mcp_route() -> None:
    """OpenEnv's clients POST JSON-RPC to /mcp with no handshake and read a JSON answer:
    envport answers them the same way (result ``data`` holding the raw value), on a
    fresh environment, or on the session ``X-Envport-Session`` names (its tools token)."""
    request = {
        "jsonrpc": "2.0",
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "x"}},
        "id": 7,
    }
    with run_env_server("echo-v1") as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as http:
            reply = (await http.post("/mcp", json=request)).json()
            assert reply["id"] == 7
            assert reply["result"]["data"] == "x"
            listed = await http.post(
                "/mcp", json={"jsonrpc": "2.0", "method": "tools/list", "id": 1}
            )
            assert {t["name"] for t in listed.json()["result"]["tools"]} == {"echo", "reverse"}
            assert app.state.manager.active == 0  # each on a throwaway environment
            created = (await http.post("/sessions")).json()
            control = {"X-Envport-Session": created["token"]}
            await http.post("/reset", json={}, headers=control)
            agent = {"X-Envport-Session": created["tools_token"]}
            reply = (await http.post("/mcp", json=request, headers=agent)).json()
            assert reply["result"]["data"] == "x"
            state = (await http.get("/state", headers=control)).json()
            assert state["step_count"] == 1  # the session's own environment stepped
            as_json = {"content-type": "application/json"}
            bad = (await http.post("/mcp", content=b"{nope", headers=as_json)).json()
            assert bad["error"]["code"] == -32700
            unknown = await http.post("/mcp", json=request, headers={"X-Envport-Session": "x"})
            assert unknown.json()["error"]["code"] == -32603
