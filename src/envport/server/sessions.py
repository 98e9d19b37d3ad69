"""Session bookkeeping for one server process: capacity, the wait queue, the reaper.

Admission: at most ``max_sessions`` live sessions. A request beyond that waits in a
bounded FIFO queue (``max_queue`` waiters, each at most ``queue_timeout_s``); when the
queue is full or the wait runs out it gets :class:`~envport.errors.CapacityError` with a
``retry_after_s`` hint.

Reaping: a session is reaped only when nothing holds it: no open connection attached
*and* idle for ``idle_timeout_s`` (HTTP sessions), or detached for longer than
``resume_grace_s`` (WebSocket sessions whose client may resume). A session with an open
connection is never reaped, however long its environment takes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from typing import Any

from pydantic import BaseModel, Field, field_validator

from envport.errors import (
    CapacityError,
    EnvportError,
    ForbiddenError,
    SessionNotFoundError,
)
from envport.session import EnvFactory, Session

#: A web origin as a browser sends it, or with ``*`` for any port (``origin_allowed``).
_ORIGIN = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<host>\[[0-9a-f:.]+\]|[a-z0-9._-]+)"
    r"(?::(?P<port>[0-9]{1,5}|\*))?",
    re.IGNORECASE,
)
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def web_origin(value: str) -> str:
    """``value`` as a browser's ``Origin`` header spells it (scheme and host in lower
    case, no default port), or ``ValueError`` naming the form when it cannot be one."""
    match = _ORIGIN.fullmatch(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a web origin: use scheme://host[:port], or scheme://host:* "
            "for any port (e.g. https://ui.example, http://localhost:*)"
        )
    scheme, host, port = match["scheme"].lower(), match["host"].lower(), match["port"]
    if port is None or port == _DEFAULT_PORTS.get(scheme):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


class ServerConfig(BaseModel):
    """Limits of one server process. Every field is a ``envport serve`` option."""

    max_sessions: int = Field(4096, ge=1, description="Live sessions at once.")
    max_queue: int = Field(1024, ge=0, description="Requests that may wait for a free slot.")
    queue_timeout_s: float = Field(10.0, ge=0, description="Longest wait for a free slot.")
    call_timeout_s: float | None = Field(30.0, gt=0, description="Deadline of one env call.")
    idle_timeout_s: float = Field(600.0, gt=0, description="Reap unattached idle sessions.")
    resume_grace_s: float = Field(30.0, ge=0, description="How long a dropped WS may resume.")
    max_frame_bytes: int = Field(16 * 2**20, ge=1024, description="Largest frame or body.")
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Close an HTTP connection whose request has not fully arrived this long "
        "after it began (or after the connection opened): a client trickling bytes, or "
        "sending none, does not hold a connection forever.",
    )
    mcp_max_sessions: int = Field(
        10_000,
        ge=1,
        description="Live MCP (Streamable HTTP) sessions at once on /mcp. At the limit, "
        "a new one replaces the oldest that has not yet used a tool (its ID then answers "
        "404); only when every one has is a new one refused (503).",
    )
    reap_interval_s: float = Field(1.0, gt=0)
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Web origins (scheme://host[:port], or scheme://host:* for any port) "
        "whose browser requests and WebSocket handshakes are accepted; a request with any "
        "other Origin header is refused (403). Clients that are not browsers send none. "
        "Stored as browsers send them: scheme and host in lower case, no default port; "
        "any other value is refused.",
    )
    max_batch: int = Field(4096, ge=1, description="Most operations in one batch frame.")
    stall_warn_s: float | None = Field(
        1.0, gt=0, description="Log an event-loop stall longer than this (None: no watchdog)."
    )
    stall_exit_s: float | None = Field(
        60.0,
        gt=0,
        description="Exit (status 70) when an environment call interrupted for blocking "
        "the loop still holds it this long past its deadline, or (status 1) when no Python "
        "thread has run for this long, at least 5 s (C code holding the GIL); None: never. "
        "Only a server on the main thread.",
    )

    @field_validator("allowed_origins")
    @classmethod
    def _web_origins(cls, values: list[str]) -> list[str]:
        # A value no browser sends ("localhost", a path, a trailing slash) never matches.
        return [web_origin(value) for value in values]


class SessionManager:
    """Creates, finds, counts and reaps sessions. Run :meth:`reaper` in a task group."""

    def __init__(self, factory: EnvFactory, config: ServerConfig) -> None:
        self.factory = factory
        self.config = config
        self.sessions: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._by_tools_token: dict[str, Session] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._reaping: set[asyncio.Future[None]] = set()  # closes of reaped sessions
        #: ids of sessions a WebSocket kept for resuming when it dropped: they expire by
        #: ``resume_grace_s`` once nothing holds them, however they are used meanwhile.
        self.resumable: set[str] = set()
        self.reaped = 0

    @property
    def active(self) -> int:
        return len(self.sessions)

    async def create(self) -> Session:
        """A new session, waiting in the bounded queue if the server is full."""
        if self.active >= self.config.max_sessions:
            await self._wait_for_slot()
        try:
            session = Session(self.factory, call_timeout_s=self.config.call_timeout_s)
        except EnvportError:  # the constructor's failure is an EnvFactoryError (build_env)
            self._release_slot()  # the slot it was woken for goes to the next in line
            raise
        self.sessions[session.id] = session
        self._by_token[session.token] = session
        self._by_tools_token[session.tools_token] = session
        return session

    async def _wait_for_slot(self) -> None:
        cfg = self.config
        if len(self._waiters) >= cfg.max_queue or cfg.queue_timeout_s == 0:
            raise CapacityError(self.active, cfg.max_sessions, self._retry_hint())
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(cfg.queue_timeout_s):  # wait_for (3.11) may drop a cancel
                await asyncio.shield(waiter)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # woken just as it gave up: wake the next in line
            if isinstance(exc, TimeoutError):
                raise CapacityError(self.active, cfg.max_sessions, self._retry_hint()) from None
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            if not waiter.done():
                waiter.cancel()
        if self.active >= cfg.max_sessions:  # a slot was taken by someone not queued
            await self._wait_for_slot()

    def _retry_hint(self) -> float:
        return max(1.0, round(self.config.queue_timeout_s / 2, 1))

    def _release_slot(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(
                f"No live session {session_id!r}: it was closed, reaped, or never existed."
            )
        return session

    def by_token(self, token: str) -> Session:
        """The session ``token`` controls; a tools-only token is refused (403)."""
        session = self._by_token.get(token)
        if session is None:
            if token in self._by_tools_token:
                raise ForbiddenError(
                    "That is a tools-only session token: it calls the session's tools over "
                    "MCP (/mcp) and cannot reset, step, read, resume or close the session."
                )
            raise SessionNotFoundError(
                "No live session for that token: it was closed, reaped after "
                f"{self.config.idle_timeout_s:g} s unused (an HTTP session), or its "
                f"connection dropped more than {self.config.resume_grace_s:g} s ago "
                "(a WebSocket session)."
            )
        return session

    def for_tools(self, token: str) -> Session:
        """The session whose tools ``token`` may call: its tools-only token or its
        control token."""
        session = self._by_tools_token.get(token)
        return session if session is not None else self.by_token(token)

    def _forget(self, session: Session) -> bool:
        """Take ``session`` out of the tables (no token finds it any more) and free its
        slot, without awaiting anything; ``False`` if it was already gone."""
        if self.sessions.pop(session.id, None) is None:
            return False
        self._by_token.pop(session.token, None)
        self._by_tools_token.pop(session.tools_token, None)
        self.resumable.discard(session.id)
        self._release_slot()
        return True

    async def close(self, session: Session) -> None:
        if self._forget(session):
            await session.close()

    async def close_all(self) -> None:
        await asyncio.gather(*(self.close(s) for s in list(self.sessions.values())))
        if self._reaping:  # closes a reaper pass started (it may have been cancelled)
            await asyncio.gather(*self._reaping, return_exceptions=True)

    def expired(self, now: float | None = None) -> list[Session]:
        """Sessions nothing holds that have outlived their idle or grace period."""
        now = time.monotonic() if now is None else now
        out = []
        for s in self.sessions.values():
            if s.attached or s.busy:  # held, or a call still running (a long command)
                continue
            if (
                s.detached_at is not None and now - s.detached_at > self.config.resume_grace_s
            ) or now - s.last_active > self.config.idle_timeout_s:
                out.append(s)
        return out

    async def reap(self, now: float | None = None) -> int:
        """Reap the sessions expired at this moment; returns how many.

        Every expired session is taken out of the tables at once, before anything is
        awaited, so none can be found (by its token), attached or used once it is
        judged expired; their environments are then closed concurrently, so one slow
        teardown neither delays the others nor leaves them findable meanwhile.
        """
        doomed = [s for s in self.expired(now) if self._forget(s)]
        if not doomed:
            return 0
        self.reaped += len(doomed)
        closes = [asyncio.ensure_future(s.close()) for s in doomed]
        self._reaping.update(closes)
        for task in closes:
            task.add_done_callback(self._reaping.discard)
        # shielded: a reaper cancelled at shutdown leaves the closes running, and
        # close_all() waits for them.
        await asyncio.shield(asyncio.gather(*closes, return_exceptions=True))
        return len(doomed)

    async def reaper(self) -> None:
        """Reap expired sessions forever; cancel to stop."""
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            await self.reap()

    def stats(self) -> dict[str, Any]:
        return {
            "active_sessions": self.active,
            "max_sessions": self.config.max_sessions,
            "queued": len(self._waiters),
            "attached": sum(1 for s in self.sessions.values() if s.attached),
            "reaped": self.reaped,
        }
