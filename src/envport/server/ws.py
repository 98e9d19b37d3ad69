"""The ``/ws`` endpoint: OpenEnv's WebSocket protocol, one frame in, one frame out.

Frames are answered strictly in order. A connection that never sends ``hello`` is an
OpenEnv client: its session closes with the connection. After ``hello`` the sessions it
owns survive a dropped connection for ``resume_grace_s`` so the client can reattach.
A session that cannot be admitted (server full and the wait queue full or timed out)
gets OpenEnv's ``CAPACITY_REACHED`` frame, then a normal close (code 1000).
"""

from __future__ import annotations

from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from envport.errors import CapacityError, EnvportError
from envport.protocol.codec import decode_frame, encode, error_frame
from envport.server.dispatch import Connection, handle_frame
from envport.server.sessions import SessionManager


async def websocket_endpoint(websocket: WebSocket) -> None:
    manager: SessionManager = websocket.app.state.manager
    max_bytes = manager.config.max_frame_bytes
    await websocket.accept()
    conn = Connection(manager)
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            raw: str | bytes | None = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            reply = await _answer(conn, raw, max_bytes)
            await websocket.send_text(encode(reply).decode())
            if _is_capacity_error(reply) and conn.primary is None:
                await websocket.close(code=1000)
                return
            if conn.closing:
                await conn.release(keep_for_resume=False)
                await websocket.close(code=1000)
                return
    except WebSocketDisconnect:
        pass
    finally:
        await conn.release(keep_for_resume=conn.extended and not conn.closing)


async def _answer(conn: Connection, raw: str | bytes, max_bytes: int) -> dict[str, Any]:
    try:
        frame = decode_frame(raw, max_bytes)
    except EnvportError as exc:
        return error_frame(exc)
    return await handle_frame(conn, frame)


def _is_capacity_error(reply: dict[str, Any]) -> bool:
    return reply.get("type") == "error" and reply["data"].get("code") == CapacityError.code
