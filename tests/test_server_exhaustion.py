"""A client cannot make the environment server hold unbounded memory: bodies are
refused as soon as they pass the limit (a chunked one too)."""

from __future__ import annotations

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
