"""envport's WebSocket frame loop (envport.server.fastws) byte by byte, over a raw socket.

The OpenEnv-level behaviour is covered in test_server.py (through the same fast path, the
default); here are the RFC 6455 rules the frame loop enforces itself: masking, reserved
bits, fragmentation, control frames, size limits, invalid UTF-8, the closing handshake,
keepalive pings, back-pressure, shutdown, and the fallback to the ASGI path.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from websockets.sync.client import connect

from envport.envs.echo import EchoAction, EchoEnv, EchoObservation
from envport.server import ServerConfig, create_app, uvicorn_config
from envport.server.fastws import EnvportWebSocketProtocol
from envport.serving import listening_socket
from envport.types import StepResult

CONT, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


@contextmanager
def ws_server(
    config: ServerConfig | None = None, env: Any = "echo-v1", **uv: Any
) -> Iterator[uvicorn.Server]:
    """``env`` on uvicorn with envport's settings (``uv`` overrides uvicorn.Config fields)."""
    config = config or ServerConfig(max_frame_bytes=4096)
    sock = listening_socket()  # bound now, so no other process can take the port meanwhile
    port = sock.getsockname()[1]
    uv_config = uvicorn_config(
        create_app(env, config, mcp=False), host="127.0.0.1", port=port, config=config
    )
    for key, value in uv.items():
        setattr(uv_config, key, value)
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive(), "server did not start"
        assert time.monotonic() < deadline, "server did not start in time"
        time.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


class RawWS:
    """A WebSocket client that sends exactly the bytes a test asks for."""

    def __init__(self, server: uvicorn.Server, extra_headers: str = "") -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.config.port), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                "GET /ws HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra_headers}\r\n"
            ).encode()
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._read()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        self.handshake = head.decode("latin-1")

    def _read(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("server closed the TCP connection")
        return data

    @staticmethod
    def frame(
        opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, rsv: int = 0
    ) -> bytes:
        b0 = (0x80 if fin else 0) | rsv | opcode
        n = len(payload)
        m = 0x80 if mask else 0
        if n < 126:
            head = bytes((b0, m | n))
        elif n < 65536:
            head = struct.pack("!BBH", b0, m | 126, n)
        else:
            head = struct.pack("!BBQ", b0, m | 127, n)
        if not mask:
            return head + payload
        key = os.urandom(4)
        return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))

    def send(self, opcode: int, payload: bytes, **kw: Any) -> None:
        self.sock.sendall(self.frame(opcode, payload, **kw))

    def send_json(self, obj: dict[str, Any]) -> None:
        self.send(TEXT, json.dumps(obj).encode())

    def recv(self) -> tuple[int, bytes]:
        while True:
            if len(self.buf) >= 2:
                n, pos = self.buf[1] & 0x7F, 2
                if n == 126 and len(self.buf) >= 4:
                    n, pos = struct.unpack("!H", self.buf[2:4])[0], 4
                elif n == 127 and len(self.buf) >= 10:
                    n, pos = struct.unpack("!Q", self.buf[2:10])[0], 10
                if n < 126 or pos > 2:
                    if self.buf[1] & 0x80:
                        raise AssertionError("a server frame must not be masked")
                    if len(self.buf) >= pos + n:
                        opcode, payload = self.buf[0] & 0x0F, self.buf[pos : pos + n]
                        self.buf = self.buf[pos + n :]
                        return opcode, payload
            self.buf += self._read()

    def recv_json(self) -> dict[str, Any]:
        opcode, payload = self.recv()
        assert opcode == TEXT, (opcode, payload)
        reply: dict[str, Any] = json.loads(payload)
        return reply

    def expect_close(self, code: int) -> None:
        opcode, payload = self.recv()
        assert opcode == CLOSE, (opcode, payload)
        assert struct.unpack("!H", payload[:2])[0] == code
        self.wait_eof()  # the server then drops the TCP connection

    def wait_eof(self) -> None:
        """Read until the server closes TCP (a socket timeout fails the test)."""
        try:
            while True:
                self.buf += self._read()
        except EOFError:
            return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def server() -> Iterator[uvicorn.Server]:
    with ws_server() as server:
        yield server


@pytest.fixture
def ws(server: uvicorn.Server) -> Iterator[RawWS]:
    client = RawWS(server)
    yield client
    client.close()


def _fast_connections(server: uvicorn.Server) -> list[EnvportWebSocketProtocol]:
    return [
        c
        for c in server.server_state.connections
        if isinstance(c, EnvportWebSocketProtocol) and c.fast is not None
    ]


def test_the_endpoint_serves_frames_on_the_fast_path(server: uvicorn.Server, ws: RawWS) -> None:
    ws.send_json({"type": "reset"})
    assert ws.recv_json()["type"] == "observation"
    assert len(_fast_connections(server)) >= 1
    ws.send_json({"type": "step", "data": {"message": "hi"}})
    assert ws.recv_json()["data"]["observation"]["echoed_message"] == "hi"


def test_fragmented_message_with_a_ping_in_between(ws: RawWS) -> None:
    ws.send_json({"type": "reset"})
    ws.recv_json()
    body = json.dumps({"type": "step", "data": {"message": "in three parts"}}).encode()
    ws.send(TEXT, body[:10], fin=False)
    ws.send(PING, b"are you there")
    ws.send(CONT, body[10:20], fin=False)
    ws.send(CONT, body[20:])
    assert ws.recv() == (PONG, b"are you there")
    assert ws.recv_json()["data"]["observation"]["echoed_message"] == "in three parts"


def test_frames_pipelined_in_one_write_and_split_byte_by_byte(ws: RawWS) -> None:
    frames = b"".join(
        RawWS.frame(TEXT, json.dumps(f).encode())
        for f in [
            {"type": "reset"},
            {"type": "step", "data": {"message": "one"}},
            {"type": "step", "data": {"message": "two"}},
        ]
    )
    ws.sock.sendall(frames)
    assert ws.recv_json()["type"] == "observation"
    assert ws.recv_json()["data"]["observation"]["echoed_message"] == "one"
    assert ws.recv_json()["data"]["observation"]["echoed_message"] == "two"
    ws.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for byte in RawWS.frame(TEXT, json.dumps({"type": "step", "data": {"message": "3"}}).encode()):
        ws.sock.sendall(bytes((byte,)))
    assert ws.recv_json()["data"]["observation"]["echoed_message"] == "3"


def test_binary_frames_and_a_medium_frame_with_a_16_bit_length(ws: RawWS) -> None:
    ws.send(BINARY, json.dumps({"type": "reset"}).encode())
    assert ws.recv_json()["type"] == "observation"
    ws.send_json({"type": "step", "data": {"message": "m" * 1000}})
    assert ws.recv_json()["data"]["observation"]["echoed_message"] == "m" * 1000


def test_frames_past_the_app_limit_get_an_error_and_the_session_survives(ws: RawWS) -> None:
    ws.send_json({"type": "reset"})
    ws.recv_json()
    ws.send_json({"type": "step", "data": {"message": "x" * 5000}})  # > 4096, < 2 x 4096
    assert ws.recv_json()["data"]["code"] == "PAYLOAD_TOO_LARGE"
    ws.send_json({"type": "step", "data": {"message": "after"}})
    assert ws.recv_json()["data"]["observation"]["echoed_message"] == "after"


@pytest.mark.parametrize(
    ("frames", "code", "why"),
    [
        ([RawWS.frame(TEXT, b'{"type":"reset"}', mask=False)], 1002, "unmasked client frame"),
        ([RawWS.frame(TEXT, b'{"type":"reset"}', rsv=0x40)], 1002, "reserved bit set"),
        ([RawWS.frame(CONT, b"{}")], 1002, "continuation without a first fragment"),
        (
            [RawWS.frame(TEXT, b"{", fin=False), RawWS.frame(TEXT, b"}")],
            1002,
            "a new message inside a fragmented one",
        ),
        ([RawWS.frame(PING, b"p" * 126)], 1002, "control frame over 125 bytes"),
        ([RawWS.frame(PING, b"p", fin=False)], 1002, "fragmented control frame"),
        ([RawWS.frame(0x3, b"{}")], 1002, "reserved opcode"),
        ([RawWS.frame(TEXT, b'{"m": "\xff\xfe"}')], 1007, "invalid UTF-8 in a text frame"),
        ([RawWS.frame(TEXT, b"x" * 9000)], 1009, "frame over twice the frame limit"),
        (
            [RawWS.frame(TEXT, b"x" * 5000, fin=False), RawWS.frame(CONT, b"x" * 5000)],
            1009,
            "fragments adding up to over the limit",
        ),
        ([RawWS.frame(CLOSE, b"\x03")], 1002, "close frame with a 1-byte body"),
    ],
)
def test_protocol_violations_close_with_the_right_code(
    server: uvicorn.Server, frames: list[bytes], code: int, why: str
) -> None:
    ws = RawWS(server)
    try:
        ws.send_json({"type": "reset"})
        ws.recv_json()
        ws.sock.sendall(b"".join(frames))
        ws.expect_close(code)
    finally:
        ws.close()
    # the server is unaffected
    other = RawWS(server)
    other.send_json({"type": "reset"})
    assert other.recv_json()["type"] == "observation"
    other.close()


def test_client_close_is_echoed_and_its_session_ends(server: uvicorn.Server, ws: RawWS) -> None:
    ws.send_json({"type": "reset"})
    ws.recv_json()
    manager = server.config.app.state.manager
    before = len(manager.sessions)
    ws.send(CLOSE, struct.pack("!H", 1001) + b"bye")
    ws.expect_close(1001)
    deadline = time.monotonic() + 30
    while len(manager.sessions) >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(manager.sessions) == before - 1


def test_openenv_close_frame_then_a_clean_close(ws: RawWS) -> None:
    ws.send_json({"type": "reset"})
    ws.recv_json()
    ws.send_json({"type": "close"})
    assert ws.recv_json()["type"] == "closed"
    opcode, payload = ws.recv()
    assert (opcode, payload[:2]) == (CLOSE, struct.pack("!H", 1000))
    ws.send(CLOSE, payload[:2])  # our echo completes the handshake
    ws.wait_eof()


def test_a_client_that_does_not_read_is_paused_and_loses_nothing(ws: RawWS) -> None:
    ws.send_json({"type": "reset"})
    ws.recv_json()
    n = 3000
    frames = [
        RawWS.frame(TEXT, json.dumps({"type": "step", "data": {"message": f"s{i}"}}).encode())
        for i in range(n)
    ]
    sender = threading.Thread(target=ws.sock.sendall, args=(b"".join(frames),))
    sender.start()
    time.sleep(0.3)  # the server fills the socket buffers, then stops reading
    got = [ws.recv_json()["data"]["observation"]["echoed_message"] for _ in range(n)]
    sender.join(10)
    assert got == [f"s{i}" for i in range(n)]


def test_keepalive_pings_and_a_silent_peer_is_dropped() -> None:
    # The answered ping must be answered within ws_ping_timeout, by this thread while the
    # server's shares the GIL: 0.3 s was tripped on a loaded machine.
    with ws_server(ws_ping_interval=0.1, ws_ping_timeout=1.0) as server:
        ws = RawWS(server)
        ws.send_json({"type": "reset"})
        # The first ping is due 0.1 s after the handshake: on a slow machine it can come
        # before the reset's reply. Answer every ping up to that reply.
        answered = False
        opcode, payload = ws.recv()
        while opcode == PING:
            ws.send(PONG, payload)
            answered = True
            opcode, payload = ws.recv()
        assert (opcode, json.loads(payload)["type"]) == (TEXT, "observation")
        if not answered:
            opcode, payload = ws.recv()
            assert opcode == PING
            ws.send(PONG, payload)  # answered: the connection stays
        opcode, payload = ws.recv()
        assert opcode == PING  # the next ping; this one goes unanswered
        ws.expect_close(1011)
        ws.close()


def test_server_shutdown_closes_with_1012() -> None:
    with ws_server() as server:
        ws = RawWS(server)
        ws.send_json({"type": "reset"})
        ws.recv_json()
        server.should_exit = True
        ws.expect_close(1012)
        ws.close()


def test_permessage_deflate_stays_on_the_asgi_path() -> None:
    with ws_server(ws_per_message_deflate=True) as server:
        port = server.config.port
        with connect(f"ws://127.0.0.1:{port}/ws", compression="deflate") as client:
            client.send(json.dumps({"type": "reset"}))
            assert json.loads(client.recv(timeout=10))["type"] == "observation"
            client.send(json.dumps({"type": "step", "data": {"message": "zip"}}))
            reply = json.loads(client.recv(timeout=10))
            assert reply["data"]["observation"]["echoed_message"] == "zip"
            assert _fast_connections(server) == []


# --- answers begun in the read callback (FastWebSocket._answer_eagerly) -------------------


class TaskProbeEnv(EchoEnv):
    """An echo whose steps show what they run as, and can wait or cancel themselves.

    ``wait:S`` sleeps S seconds first; ``cancel-self`` cancels the current task and
    catches the cancellation at its next await; ``timeout`` uses ``asyncio.timeout``
    around a step that never suspends.
    """

    async def on_step(self, action: EchoAction) -> StepResult[EchoObservation]:
        task = asyncio.current_task()
        text = action.message
        if text.startswith("wait:"):
            await asyncio.sleep(float(text[5:]))
            text = f"waited, same task: {asyncio.current_task() is task}"
        elif text == "cancel-self":
            assert task is not None
            task.cancel()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                task.uncancel()
                text = "cancelled inside the step"
            else:
                text = "the cancellation went elsewhere"
        elif text == "timeout":
            async with asyncio.timeout(5):  # noqa: ASYNC100 - entering it needs a task
                text = "timeout scope entered and left"
        else:
            text = f"{text} (in a task: {task is not None})"
        return StepResult(observation=EchoObservation(echoed_message=text))


@pytest.fixture(scope="module")
def probe_server() -> Iterator[uvicorn.Server]:
    with ws_server(env=TaskProbeEnv) as server:
        yield server


@pytest.fixture
def probe(probe_server: uvicorn.Server) -> Iterator[RawWS]:
    """A connection to TaskProbeEnv, reset."""
    client = RawWS(probe_server)
    client.send_json({"type": "reset"})
    assert client.recv_json()["type"] == "observation"
    yield client
    client.close()


def _echo(ws: RawWS) -> str:
    reply = ws.recv_json()
    assert reply["type"] == "observation", reply
    text: str = reply["data"]["observation"]["echoed_message"]
    return text


def test_a_step_answered_in_the_read_callback_runs_as_the_connection_task(probe: RawWS) -> None:
    probe.send_json({"type": "step", "data": {"message": "plain"}})
    assert _echo(probe) == "plain (in a task: True)"
    probe.send_json({"type": "step", "data": {"message": "timeout"}})
    assert _echo(probe) == "timeout scope entered and left"


def test_a_step_that_waits_goes_on_in_the_task_and_later_frames_keep_their_order(
    probe: RawWS,
) -> None:
    # Three frames in one write: the first begins at once and then waits; the other two
    # arrive while it waits and are answered after it, in order.
    probe.sock.sendall(
        b"".join(
            RawWS.frame(TEXT, json.dumps({"type": "step", "data": {"message": m}}).encode())
            for m in ("wait:0.05", "second", "third")
        )
    )
    assert _echo(probe) == "waited, same task: True"
    assert _echo(probe) == "second (in a task: True)"
    assert _echo(probe) == "third (in a task: True)"
    probe.send_json({"type": "state"})
    assert probe.recv_json()["data"]["step_count"] == 3


def test_a_cancellation_aimed_at_a_step_begun_in_the_read_callback_lands_inside_it(
    probe: RawWS,
) -> None:
    probe.send_json({"type": "step", "data": {"message": "cancel-self"}})
    assert _echo(probe) == "cancelled inside the step"
    probe.send_json({"type": "step", "data": {"message": "after"}})  # the connection lives on
    assert _echo(probe) == "after (in a task: True)"
