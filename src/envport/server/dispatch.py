"""What each client frame does, independent of the transport that carried it.

A :class:`Connection` is the server's view of one client: the sessions it owns, whether
it opted into envport's extensions (``hello``), and its primary session, which is the
one OpenEnv's frames act on. :func:`handle_frame` turns one decoded frame into one reply
frame; it never raises for a client mistake, it answers with an error frame instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from envport.errors import (
    ActionValidationError,
    EnvExecutionError,
    ProtocolError,
    SessionNotFoundError,
)
from envport.protocol.codec import error_frame
from envport.server.sessions import SessionManager
from envport.session import Session

PROTOCOL = "envport/1"


class Connection:
    """One client connection and the sessions it owns."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self.extended = False
        self.primary: Session | None = None
        self.owned: dict[str, Session] = {}
        self.closing = False

    async def primary_session(self) -> Session:
        if self.primary is None or self.primary.closed:
            self.primary = await self._new_session()
        return self.primary

    async def _new_session(self) -> Session:
        session = await self.manager.create()
        session.attach()
        self.owned[session.id] = session
        return session

    def adopt(self, session: Session) -> None:
        if session.id not in self.owned:
            session.attach()
            self.owned[session.id] = session

    async def release(self, *, keep_for_resume: bool) -> None:
        """The connection ended: detach (resumable) or close every owned session."""
        owned, self.owned, self.primary = list(self.owned.values()), {}, None
        for session in owned:
            session.detach()
            if keep_for_resume:
                self.manager.resumable.add(session.id)
            else:
                await self.manager.close(session)

    def find(self, item: dict[str, Any]) -> Session:
        """The session a batch item names, by id (owned here) or by token."""
        token = item.get("token")
        if isinstance(token, str):
            return self.manager.by_token(token)
        session_id = item.get("session_id")
        if isinstance(session_id, str) and session_id in self.owned:
            return self.owned[session_id]
        if session_id is None and self.primary is not None:
            return self.primary
        raise SessionNotFoundError(
            f"Session {session_id!r} is not owned by this connection; pass its token."
        )


def _with_id(reply: dict[str, Any], frame_id: Any) -> dict[str, Any]:
    if frame_id is not None:
        reply["id"] = frame_id
    return reply


#: Frames about the connection itself; every other frame acts on a session.
_CONNECTION_FRAMES = frozenset({"hello", "open", "batch", "ping", "close"})


async def handle_frame(conn: Connection, frame: dict[str, Any]) -> dict[str, Any]:
    """Answer one decoded client frame (see :mod:`envport.protocol`)."""
    frame_id = frame.get("id")
    kind = frame["type"]
    data = frame.get("data")
    try:
        if kind in _CONNECTION_FRAMES:
            reply = await _connection_frame(conn, kind, data)
        else:  # reset / step / state / mcp / schema: the hot path, inline
            session = conn.primary
            if session is None or session.closed:
                session = await conn.primary_session()
            if conn.extended and frame_id is not None:
                reply = await _once(session, frame_id, kind, data)
            elif kind == "step" and data is not None:  # run_op's step, one frame less
                result = await session.step(data)
                reply = {"type": "observation", "data": result.to_wire(extended=conn.extended)}
            else:
                reply = await run_op(session, kind, data, extended=conn.extended)
    except Exception as exc:  # an envport error, or an env bug: an answer either way
        return error_frame(exc, frame_id)
    return _with_id(reply, frame_id)


async def _once(session: Session, frame_id: Any, kind: str, data: Any) -> dict[str, Any]:
    """Run a frame of an extended client, applied once however often it is resent.

    A client that resumed after a dropped connection resends its last frame with the
    same id. If that frame's reply is known, it is the answer; if the frame is still
    running (the connection dropped during a slow step), the resend waits for it. Error
    replies count as replies: the resend of a step that failed does not step again.
    (No future per frame: a waiter is made only for a resend that has to wait.)"""
    cached = session.last_reply
    if cached is not None and cached[0] == frame_id:
        known = cached[1]
        if known is None:  # still running
            waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            session.reply_waiters.append((frame_id, waiter))
            known = await asyncio.shield(waiter)
        return dict(known)
    session.last_reply = (frame_id, None)
    try:
        reply = await run_op(session, kind, data, extended=True)
    except Exception as exc:  # an envport error, or an env bug: an answer either way
        reply = error_frame(exc)
    except BaseException:
        # Cancelled (the server is shutting down): its outcome is unknown; a resend is
        # told so rather than stepping again.
        unknown = EnvExecutionError("The request was interrupted; its outcome is unknown.")
        _settle(session, frame_id, error_frame(unknown))
        raise
    _settle(session, frame_id, reply)
    return reply


def _settle(session: Session, frame_id: Any, reply: dict[str, Any]) -> None:
    """Frame ``frame_id`` is answered: cache its reply, wake resends waiting for it."""
    if session.last_reply is not None and session.last_reply[0] == frame_id:
        session.last_reply = (frame_id, reply)
    if session.reply_waiters:
        waiting, session.reply_waiters = session.reply_waiters, []
        for waited_id, waiter in waiting:
            if waited_id != frame_id:
                session.reply_waiters.append((waited_id, waiter))
            elif not waiter.done():
                waiter.set_result(reply)


async def _connection_frame(conn: Connection, kind: str, data: Any) -> dict[str, Any]:
    if kind == "hello":
        return await _hello(conn, data if isinstance(data, dict) else {})
    if kind == "open":
        session = await conn._new_session()
        return {"type": "session", "data": _session_info(conn, session)}
    if kind == "batch":
        return await _batch(conn, data)
    if kind == "ping":
        return {"type": "pong", "data": conn.manager.stats()}
    conn.closing = True  # "close", the last of _CONNECTION_FRAMES
    return {"type": "closed", "data": {}}


async def run_op(session: Session, kind: str, data: Any, *, extended: bool) -> dict[str, Any]:
    """reset / step / state / mcp against one session; the reply frame."""
    if kind == "reset":
        options = data if data is not None else {}
        if not isinstance(options, dict):
            raise ActionValidationError("reset options must be a JSON object.")
        result = await session.reset(**options)
        return {"type": "observation", "data": result.to_wire(extended=extended)}
    if kind == "step":
        if data is None:
            raise ActionValidationError("A step frame needs 'data': the action object.")
        result = await session.step(data)
        return {"type": "observation", "data": result.to_wire(extended=extended)}
    if kind == "state":
        state = await session.state()
        return {"type": "state", "data": state.model_dump(mode="json")}
    if kind == "schema":
        env = session.env
        return {
            "type": "schema",
            "data": {**env.schemas(), "tools": [t.model_dump() for t in env.tool_specs()]},
        }
    if kind == "mcp":
        from envport.mcp.jsonrpc import handle_jsonrpc

        return {"type": "mcp", "data": await handle_jsonrpc(session, data)}
    raise ProtocolError(f"Unknown message type: {kind!r}.")


def _session_info(conn: Connection, session: Session, resumed: bool = False) -> dict[str, Any]:
    return {
        "protocol": PROTOCOL,
        "session_id": session.id,
        "token": session.token,
        "tools_token": session.tools_token,
        "resumed": resumed,
        "resume_grace_s": conn.manager.config.resume_grace_s,
        "max_frame_bytes": conn.manager.config.max_frame_bytes,
    }


async def _hello(conn: Connection, data: dict[str, Any]) -> dict[str, Any]:
    conn.extended = True
    token = data.get("resume")
    if isinstance(token, str):
        session = conn.manager.by_token(token)
        conn.adopt(session)
        conn.primary = session
        return {"type": "hello", "data": _session_info(conn, session, resumed=True)}
    session = await conn.primary_session()
    return {"type": "hello", "data": _session_info(conn, session)}


async def _batch(conn: Connection, data: Any) -> dict[str, Any]:
    if not isinstance(data, list):
        raise ProtocolError("A batch frame's 'data' must be a list of operations.")
    limit = conn.manager.config.max_batch
    if len(data) > limit:
        raise ProtocolError(f"A batch holds at most {limit} operations, got {len(data)}.")

    async def one(item: Any) -> dict[str, Any]:
        if not isinstance(item, dict):
            return error_frame(ProtocolError("Each batch operation must be an object."))
        try:
            session = conn.find(item)
            kind = item.get("type")
            if kind not in ("reset", "step", "state"):
                raise ProtocolError(f"Batch operations are reset/step/state, not {kind!r}.")
            reply = await run_op(session, kind, item.get("data"), extended=True)
            reply["session_id"] = session.id
        except Exception as exc:  # an envport error, or an env bug: an answer either way
            reply = error_frame(exc)
            reply["session_id"] = item.get("session_id")
        return reply

    replies = await asyncio.gather(*(one(item) for item in data))
    return {"type": "batch", "data": list(replies)}
