"""The ``/ws`` endpoint: OpenEnv's WebSocket protocol, one frame in, one frame out.

Frames are answered strictly in order. A connection that never sends ``hello`` is an
OpenEnv client: its session closes with the connection. After ``hello`` the sessions it
owns survive a dropped connection for ``resume_grace_s`` so the client can reattach.
A session that cannot be admitted (server full and the wait queue full or timed out)
gets OpenEnv's ``CAPACITY_REACHED`` frame, then a normal close (code 1000).

This is the hot path of the server. On uvicorn with envport's WebSocket protocol
(:mod:`envport.server.fastws`, the default of ``envport serve``) the endpoint takes the
accepted connection's frames off the ASGI path and reads and writes them itself (a frame
reaching an idle connection is answered in the socket's read callback); on any
other ASGI server it speaks the ``websocket.*`` messages (:class:`AsgiChannel`), not
through Starlette's ``WebSocket`` wrapper, whose state checks cost a few microseconds per
frame. Replies are text frames, as OpenEnv's server sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import orjson
from starlette.types import Receive, Scope, Send

from envport.errors import CapacityError, ProtocolError
from envport.protocol.codec import decode_frame, encode, error_frame
from envport.server.dispatch import Connection, handle_frame
from envport.server.fastws import FastWebSocket, fast_websocket
from envport.server.sessions import SessionManager

_log = logging.getLogger("envport.server")


class WebSocketEndpoint:
    """ASGI app for ``/ws`` (Starlette's ``WebSocketRoute`` mounts an instance as is)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        manager: SessionManager = scope["app"].state.manager
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        fast = fast_websocket(scope)
        if fast is None:
            await serve_connection(manager, AsgiChannel(receive, send))
            return
        # A task of its own, the one frames are answered as (FastWebSocket.run: in the
        # socket's read callback while it is idle, in the task when an answer waits), not
        # under the dozen frames of ASGI middleware and routing this app is called through.
        await asyncio.ensure_future(serve_connection(manager, fast))


class Channel(Protocol):
    """One accepted WebSocket, as the frame loop sees it."""

    async def receive(self) -> str | bytes | None:
        """The next message, ``None`` once the connection ended."""

    async def send(self, payload: bytes) -> None:
        """Send one text frame (raises ``OSError`` if the peer is gone)."""

    async def close(self, code: int = 1000) -> None:
        """Start the closing handshake."""


class AsgiChannel:
    """A WebSocket through ASGI's ``websocket.*`` messages (any ASGI server)."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send

    async def receive(self) -> str | bytes | None:
        message = await self._receive()
        if message["type"] != "websocket.receive":  # websocket.disconnect
            return None
        raw: str | bytes | None = message.get("text")
        return raw if raw is not None else message.get("bytes") or b""

    async def send(self, payload: bytes) -> None:
        await self._send({"type": "websocket.send", "text": payload.decode()})

    async def close(self, code: int = 1000) -> None:
        await self._send({"type": "websocket.close", "code": code})


async def serve_connection(manager: SessionManager, channel: Channel | FastWebSocket) -> None:
    """Answer frames on one accepted WebSocket until it closes."""
    conn = Connection(manager)
    max_bytes = manager.config.max_frame_bytes

    async def answer(raw: str | bytes) -> bool:
        """Answer one frame; ``False`` when the connection is to end."""
        try:
            frame = decode_frame(raw, max_bytes)
        except ProtocolError as exc:
            reply = error_frame(exc, exc.frame_id)  # the id, when the frame parsed
        except Exception as exc:  # a bug in decoding: answer it, keep the connection
            _log.exception("Decoding a WebSocket frame failed unexpectedly")
            reply = error_frame(exc)  # EXECUTION_ERROR naming it
        else:
            reply = await handle_frame(conn, frame)
        await channel.send(encode(reply))
        if (
            reply["type"] == "error"
            and reply["data"].get("code") == CapacityError.code
            and conn.primary is None
        ):
            await channel.close(1000)
            return False
        if conn.closing:
            await conn.release(keep_for_resume=False)
            await channel.close(1000)
            return False
        return True

    try:
        if isinstance(channel, FastWebSocket):
            await channel.run(answer)
        else:
            while (raw := await channel.receive()) is not None and await answer(raw):
                pass
    except OSError:  # the peer vanished while we were sending (uvicorn: ClientDisconnected)
        # A ``close`` frame it sent while an earlier frame still ran (a client that gave
        # up waiting for that one, then closed) may wait unread: the client ended the
        # session, so it is closed, not kept for a resume that never comes.
        if conn.extended and not conn.closing:
            conn.closing = any(_is_close(raw) for raw in await _unread(channel))
    finally:
        await conn.release(keep_for_resume=conn.extended and not conn.closing)


async def _unread(channel: Channel | FastWebSocket) -> list[str | bytes]:
    """The frames a vanished peer sent that were not answered."""
    if isinstance(channel, FastWebSocket):
        return channel.unread()
    unread: list[str | bytes] = []
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):  # the ASGI server's queue, then its disconnect
            while (raw := await channel.receive()) is not None:
                unread.append(raw)
    return unread


def _is_close(raw: str | bytes) -> bool:
    try:
        frame = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(frame, dict) and frame.get("type") == "close"


websocket_endpoint = WebSocketEndpoint()
