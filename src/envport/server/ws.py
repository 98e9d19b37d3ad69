"""The ``/ws`` endpoint: OpenEnv's WebSocket protocol, one frame in, one frame out.

Frames are answered strictly in order. A connection that never sends ``hello`` is an
OpenEnv client: its session closes with the connection. After ``hello`` the sessions it
owns survive a dropped connection for ``resume_grace_s`` so the client can reattach.
A session that cannot be admitted (server full and the wait queue full or timed out)
gets OpenEnv's ``CAPACITY_REACHED`` frame, then a normal close (code 1000).

This is the hot path of the server, so the endpoint is a plain ASGI app that speaks
the ``websocket.*`` messages itself rather than through Starlette's ``WebSocket``
wrapper (whose state checks cost a few microseconds per frame). Replies are text
frames, as OpenEnv's server sends them.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Receive, Scope, Send

from envport.errors import CapacityError, EnvportError
from envport.protocol.codec import decode_frame, encode, error_frame
from envport.server.dispatch import Connection, handle_frame
from envport.server.sessions import SessionManager


class WebSocketEndpoint:
    """ASGI app for ``/ws`` (Starlette's ``WebSocketRoute`` mounts an instance as is)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        manager: SessionManager = scope["app"].state.manager
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        await serve_connection(manager, receive, send)


async def serve_connection(manager: SessionManager, receive: Receive, send: Send) -> None:
    """Answer frames on one accepted WebSocket until it closes."""
    max_bytes = manager.config.max_frame_bytes
    conn = Connection(manager)
    try:
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":  # websocket.disconnect
                break
            raw: str | bytes | None = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            reply = await _answer(conn, raw, max_bytes)
            await send({"type": "websocket.send", "text": encode(reply).decode()})
            if _is_capacity_error(reply) and conn.primary is None:
                await send({"type": "websocket.close", "code": 1000})
                return
            if conn.closing:
                await conn.release(keep_for_resume=False)
                await send({"type": "websocket.close", "code": 1000})
                return
    except OSError:  # the peer vanished while we were sending (uvicorn: ClientDisconnected)
        pass
    finally:
        await conn.release(keep_for_resume=conn.extended and not conn.closing)


websocket_endpoint = WebSocketEndpoint()


async def _answer(conn: Connection, raw: str | bytes, max_bytes: int) -> dict[str, Any]:
    try:
        frame = decode_frame(raw, max_bytes)
    except EnvportError as exc:
        return error_frame(exc)
    return await handle_frame(conn, frame)


def _is_capacity_error(reply: dict[str, Any]) -> bool:
    return reply.get("type") == "error" and reply["data"].get("code") == CapacityError.code
