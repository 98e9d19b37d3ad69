"""One live environment behind a transport: the unit a server hands out.

A :class:`Session` owns one environment instance. It serialises calls (strict
request/response order per session), enforces a per-call deadline, and knows whether it
is attached to a connection, so the reaper never takes a session someone is using.

A call that times out poisons the environment: whatever it was doing may still be
running (a thread cannot be killed), so the session abandons that instance, closes it in
the background, and the next ``reset`` starts on a fresh one. Until then, ``step`` and
``state`` say so clearly.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import secrets
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from envport.coro import resume
from envport.deadlines import declared_timeout, extended
from envport.env import Env
from envport.errors import (
    EnvClosedError,
    EnvFactoryError,
    EnvNotResetError,
    EnvportError,
    EnvTimeoutError,
)
from envport.loopwatch import LoopStalled
from envport.types import State, StepResult

T = TypeVar("T")
EnvFactory = Callable[[], Env[Any, Any]]


class _Turns:
    """A FIFO mutex whose uncontended acquire is a flag, not a coroutine.

    ``asyncio.Lock`` costs about a microsecond per ``async with`` even when free, and a
    session's calls are almost never contended (one client, one frame in flight). Use::

        if turns.busy:
            await turns.wait()
        else:
            turns.busy = True
        try:
            ...
        finally:
            turns.release()
    """

    __slots__ = ("_waiters", "busy")

    def __init__(self) -> None:
        self.busy = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def wait(self) -> None:
        """Wait for the turn (call only while ``busy``); on return the caller holds it."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed the turn just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        """Hand the turn to the longest waiter (it stays ``busy``), or free it."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.busy = False


@contextlib.contextmanager
def building_env() -> Iterator[None]:
    """What building an environment raises (resolving its class, its constructor), other
    than an envport error, becomes :class:`~envport.errors.EnvFactoryError` naming it."""
    try:
        yield
    except EnvportError:
        raise
    except Exception as exc:
        raise EnvFactoryError(
            f"Could not create the environment: {type(exc).__name__}: {exc}"
        ) from exc


def build_env(factory: EnvFactory) -> Env[Any, Any]:
    """One environment from ``factory`` (its failures as :func:`building_env` says)."""
    with building_env():
        return factory()


class SessionStatus(enum.Enum):
    ACTIVE = "active"
    POISONED = "poisoned"  # a call timed out; the next reset replaces the environment
    CLOSED = "closed"


class Session:
    """A live environment with an id, a secret token, a lock and a deadline per call.

    ``token`` controls the session (reset, step, state, close, resume); ``tools_token``
    only calls its tools over MCP: the one to hand an agent.
    """

    def __init__(self, factory: EnvFactory, *, call_timeout_s: float | None = 30.0) -> None:
        self.id = uuid.uuid4().hex
        self.token = secrets.token_urlsafe(24)
        self.tools_token = secrets.token_urlsafe(24)
        self.factory = factory
        self.env = build_env(factory)
        self.call_timeout_s = call_timeout_s
        self.status = SessionStatus.ACTIVE
        self.created_at = time.monotonic()
        self.last_active = self.created_at
        self.call_started = self.created_at  # when the latest call began (its deadline's start)
        self.attached = 0  # open connections using this session
        self.detached_at: float | None = None
        # (frame id, reply); reply None while the frame runs (server.dispatch._once)
        self.last_reply: tuple[Any, dict[str, Any] | None] | None = None
        self.reply_waiters: list[tuple[Any, asyncio.Future[dict[str, Any]]]] = []
        self._turns = _Turns()
        self._abandoned: set[asyncio.Task[None]] = set()

    # --- the contract, guarded ---------------------------------------------------------

    async def reset(self, **kwargs: Any) -> StepResult[Any]:
        await self._take_turn()
        try:
            self._check_open()
            if self.status is SessionStatus.POISONED:
                self.env = build_env(self.factory)
                self.status = SessionStatus.ACTIVE
            return await self._guard("reset", self.env.reset(**kwargs))
        finally:
            self._turns.release()

    async def step(self, action: Any) -> StepResult[Any]:
        await self._take_turn()
        try:
            self._check_usable()
            return await self._guard("step", self.env.step(action), declared_timeout(action))
        finally:
            self._turns.release()

    async def state(self) -> State:
        await self._take_turn()
        try:
            self._check_usable()
            return await self._guard("state", self.env.state())
        finally:
            self._turns.release()

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        await self._take_turn()
        try:
            self._check_usable()
            self.env.step_count += 1
            declared = declared_timeout(arguments)
            return await self._guard("call_tool", self.env.call_tool(name, arguments), declared)
        finally:
            self._turns.release()

    async def close(self) -> None:
        if self.status is SessionStatus.CLOSED:
            return
        self.status = SessionStatus.CLOSED
        await self._take_turn()
        try:
            await self._close_env(self.env)
        finally:
            self._turns.release()
        if self._abandoned:
            await asyncio.gather(*self._abandoned, return_exceptions=True)

    # --- bookkeeping -------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A call is running (or waiting for its turn): not idle, whatever its age."""
        return self._turns.busy

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def attach(self) -> None:
        self.attached += 1
        self.detached_at = None
        self.touch()

    def detach(self) -> None:
        self.attached = max(0, self.attached - 1)
        if self.attached == 0:
            self.detached_at = time.monotonic()

    @property
    def closed(self) -> bool:
        return self.status is SessionStatus.CLOSED

    async def _take_turn(self) -> None:
        """Wait until no other call of this session runs (calls run one at a time, FIFO)."""
        turns = self._turns
        if turns.busy:
            await turns.wait()
        else:
            turns.busy = True

    def _check_open(self) -> None:
        if self.status is SessionStatus.CLOSED:
            raise EnvClosedError(f"Session {self.id} is closed.")

    def _check_usable(self) -> None:
        self._check_open()
        if self.status is SessionStatus.POISONED:
            raise EnvNotResetError(
                f"Session {self.id}: the previous call timed out and its environment was "
                "discarded; call reset() to start a fresh one."
            )

    async def _guard(
        self, what: str, call: Coroutine[Any, Any, T], declared: float | None = None
    ) -> T:
        """Run ``call`` under the session's call deadline, or longer when the call
        ``declared`` it may take longer (:mod:`envport.deadlines`)."""
        self.call_started = self.last_active = time.monotonic()
        limit = extended(self.call_timeout_s, declared)
        try:
            # Run the call eagerly: most steps of a fast environment finish without ever
            # suspending, and those need no deadline (arming and cancelling a timer is a
            # third of the server's Python time per step). A call that suspends goes on
            # under the deadline from where it stopped.
            try:
                pending = call.send(None)
            except StopIteration as done:
                result: T = done.value
                return result
            # ``asyncio.timeout`` runs the call in this task; ``wait_for`` (3.11) would wrap
            # it in a new Task per call: two more event-loop hops.
            async with asyncio.timeout(limit):
                return await resume(call, pending)
        except TimeoutError:
            self._poison()
            raise EnvTimeoutError(
                f"{what} did not finish within {limit:g} s; the environment "
                "was discarded. Call reset() to continue on a fresh one.",
                timeout_s=limit,
            ) from None
        except LoopStalled:  # it blocked the loop past its deadline (envport.loopwatch)
            self._poison()
            raise EnvTimeoutError(
                f"{what} ran for {time.monotonic() - self.call_started:.1f} s, past its "
                f"{limit:g} s deadline, blocking the server's event loop: an async "
                "environment method ran blocking code (make it a plain def, which runs on "
                "the environment's thread, or await its I/O). The environment was "
                "discarded. Call reset() to continue on a fresh one.",
                timeout_s=limit,
            ) from None
        finally:
            self.last_active = time.monotonic()

    def _poison(self) -> None:
        self.status = SessionStatus.POISONED
        task = asyncio.get_running_loop().create_task(self._close_env(self.env))
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)

    @staticmethod
    async def _close_env(env: Env[Any, Any]) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10.0):
                await env.close()
