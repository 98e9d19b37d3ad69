"""A client cannot make the environment server hold unbounded memory or connections:
bodies are refused as soon as they pass the limit (a chunked one too), and a peer that
floods WebSocket pings without reading the pongs stops being read."""

from __future__ import annotations

import base64
import json
import os
import select
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from envport.server import ServerConfig
from tests.support.servers import run_env_server

LIMIT = 4096


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    with run_env_server("echo-v1", ServerConfig(max_frame_bytes=LIMIT)) as (url, app):
        yield url, app


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(30)  # a failure, not a hang, if the answer never comes
    return sock


def _head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        got = sock.recv(65536)
        if not got:
            break
        data += got
    return data


@pytest.mark.parametrize(
    ("path", "accept"),
    [
        ("/reset", "application/json"),
        ("/step", "application/json"),
        ("/sessions", "application/json"),
        ("/mcp", "application/json"),  # OpenEnv's plain JSON-RPC
    ],
)
def test_a_chunked_body_over_the_limit_is_refused_before_it_ends(
    served: tuple[str, Any], path: str, accept: str
) -> None:
    """A chunked body (no Content-Length) is counted as it arrives: the 413 comes while
    the client is still sending, not after it sent everything (which would be held)."""
    url, _ = served
    with _connect(url) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Accept: {accept}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"[" * 1024
        for _ in range(4 * LIMIT // len(chunk)):  # four times the limit, never ended
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        head = _head(sock)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def _ws_upgrade(url: str) -> socket.socket:
    sock = _connect(url)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert _head(sock).startswith(b"HTTP/1.1 101")
    return sock


def _masked(opcode: int, payload: bytes) -> bytes:
    assert len(payload) < 126
    return bytes((0x80 | opcode, 0x80 | len(payload))) + b"\0\0\0\0" + payload


def test_a_ping_flood_without_reading_the_pongs_stops_being_read(
    served: tuple[str, Any],
) -> None:
    """Each ping is answered with a pong; a peer that never reads them would have the
    server buffer every pong (as many bytes as it sends). Once the pongs back up, the
    server stops reading the peer, and reads on once they drain."""
    url, _ = served
    sock = _ws_upgrade(url)
    try:
        blob = _masked(0x9, b"p" * 125) * 2048
        sock.setblocking(False)
        sent, offset, cap = 0, 0, 512 * 2**20
        while sent < cap:
            _, writable, _ = select.select([], [sock], [], 2.0)
            if not writable:
                break  # the server stopped reading us
            n = sock.send(blob[offset:])
            sent += n
            offset = (offset + n) % len(blob)
        assert sent < cap, "the server read (and buffered pongs for) everything sent"
        # Reading the pongs lets the server read on: a frame sent after them is answered.
        sock.setblocking(True)
        sock.settimeout(30)
        frame = _masked(0x1, json.dumps({"type": "reset"}).encode())
        pending = bytearray(frame)
        received = bytearray()
        while True:
            readable, writable, _ = select.select([sock], [sock] if pending else [], [], 30)
            assert readable or writable, "the connection stalled"
            if writable and pending:
                del pending[: sock.send(pending)]
            if readable:
                got = sock.recv(1 << 20)
                assert got, "the server closed the connection"
                received += got
                if b'"observation"' in received[-4096:]:
                    break
    finally:
        sock.close()


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # a connection that sends nothing
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",  # headers never finished
        b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{",  # a body never finished
    ],
)
def test_a_request_that_never_fully_arrives_is_dropped(sent: bytes) -> None:
    """uvicorn times only the wait between requests: a client that sends nothing, or a
    request it never finishes (slow loris), held its connection forever."""
    config = ServerConfig(request_timeout_s=0.5)
    with run_env_server("echo-v1", config, mcp=False) as (url, _), _connect(url) as sock:
        sock.sendall(sent)
        # The server closes the connection (EOF); without the deadline recv() waits on
        # until the socket's timeout fails the test.
        rest = b""
        while got := sock.recv(65536):
            rest += got
        assert not rest.startswith(b"HTTP/1.1 2"), rest[:200]
        # A request that arrives in time is served as before, on a new connection.
        with _connect(url) as ok:
            ok.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _head(ok).startswith(b"HTTP/1.1 200")


async def test_mcp_json_nested_too_deep_is_a_parse_error(served: tuple[str, Any]) -> None:
    """Python's json raises RecursionError (not ValueError) on deep nesting: it escaped
    as a bare 500 with a traceback in the log, instead of JSON-RPC's parse error."""
    import httpx

    url, _ = served
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post(
            "/mcp", content=b"[" * (LIMIT - 1), headers={"content-type": "application/json"}
        )
    assert r.status_code == 200, r.text[:200]
    assert r.json()["error"]["code"] == -32700
