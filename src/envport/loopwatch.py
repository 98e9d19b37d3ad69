"""A watchdog for the server's event loop: an ``async`` environment method that blocks.

Every session of a server shares one event loop. An environment whose ``async def``
step runs blocking code (``time.sleep``, a busy loop, a socket read without ``await``)
stops that loop: no other session is served, and no call deadline can fire, since the
deadline's timer runs on the stopped loop too. A thread outside the loop watches a
heartbeat the loop writes every ``interval_s``:

* **Warn.** A stall longer than ``warn_s`` is logged once, with the stack it is stuck in.
* **Interrupt.** When the stuck code is an environment call (it runs inside
  :meth:`envport.session.Session._guard`) and that call is past its deadline, the
  watchdog raises :class:`LoopStalled` inside it. When the loop runs on the main thread
  (``envport serve``), it does so from a signal handler, so a blocking sleep or read is
  woken too; elsewhere it sets an asynchronous exception, which lands at the stuck code's
  next bytecode (a busy loop; a sleep only once it returns). The session answers with a
  timeout error and discards that environment, as for any call past its deadline; every
  other session goes on.
* **Exit.** When the loop is still stuck ``exit_after_s`` after that deadline (code that
  swallows the exception, C code that never returns to Python), or that long into a stall
  outside any environment call, the process logs the stack and exits with status
  :data:`EXIT_STALLED`, so whatever supervises it (the rollout controller's pool,
  systemd, Kubernetes) replaces it instead of it hanging forever. Only a loop on the main
  thread does this: a server in a thread of someone else's process never exits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

log = logging.getLogger("envport.server")

#: The exit status of a server that stayed stalled (``EX_SOFTWARE``).
EXIT_STALLED = 70

#: The signal that wakes a stalled main thread (its handler raises :class:`LoopStalled`).
INTERRUPT_SIGNAL = signal.SIGUSR2


class LoopStalled(BaseException):
    """Raised inside an environment call that blocked the event loop past its deadline.

    A :class:`BaseException`, so that an environment's own ``except Exception`` does not
    swallow it; :meth:`Session._guard` turns it into
    :class:`~envport.errors.EnvTimeoutError`.
    """


def _guard_code() -> Any:
    from envport.session import Session

    return Session._guard.__code__


class LoopWatchdog:
    """Watches the running loop from a daemon thread; ``start()`` on the loop, ``stop()``.

    ``stats()`` counts stalls, interrupts and the longest stall.
    """

    def __init__(
        self,
        *,
        warn_s: float = 1.0,
        exit_after_s: float | None = 60.0,
        interval_s: float = 0.1,
    ) -> None:
        self.warn_s = warn_s
        self.exit_after_s = exit_after_s
        self.interval_s = interval_s
        self.stalls = 0
        self.interrupts = 0
        self.longest_stall_s = 0.0
        self._beat = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_thread = 0
        self._on_main = False
        self._old_handler: Any = None
        self._guard = _guard_code()
        # The stall being handled: the beat it started after, and the environment call
        # an interrupt was aimed at.
        self._stall_beat: float | None = None
        self._target: FrameType | None = None

    # --- lifecycle (call on the loop's thread) -----------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._on_main = threading.current_thread() is threading.main_thread()
        if self._on_main:
            self._old_handler = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        self._beat = time.monotonic()
        self._handle = self._loop.call_later(self.interval_s, self._tick)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="envport-loop-watchdog")
        self._thread.daemon = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._on_main:
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(INTERRUPT_SIGNAL, self._old_handler or signal.SIG_DFL)

    def stats(self) -> dict[str, Any]:
        return {
            "loop_stalls": self.stalls,
            "loop_stall_interrupts": self.interrupts,
            "longest_loop_stall_s": round(self.longest_stall_s, 3),
        }

    def _tick(self) -> None:
        self._beat = time.monotonic()
        assert self._loop is not None
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    # --- the watching thread -----------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._check(time.monotonic())
            except Exception:  # the watchdog must outlive anything it finds
                log.exception("loop watchdog check failed")

    def _check(self, now: float) -> None:
        beat = self._beat
        stalled = now - beat - self.interval_s  # the beat is due every interval_s
        if stalled < self.warn_s:
            if self._stall_beat is not None:
                self._end_stall()
            return
        frame = sys._current_frames().get(self._loop_thread)
        if self._stall_beat != beat:  # a new stall
            self._end_stall()
            self._stall_beat = beat
            self.stalls += 1
            log.warning(
                "The event loop has been blocked for %.1f s, so no session is served. "
                "An async environment method is probably running blocking code (use a "
                "plain def, which runs on the environment's thread, or await). Stuck "
                "in:\n%s",
                stalled,
                _stack(frame),
            )
        self.longest_stall_s = max(self.longest_stall_s, stalled)
        # An environment call past its deadline is interrupted; the stall must end within
        # exit_after_s of that deadline (of the stall's start, outside any call).
        must_end = beat + self.interval_s
        call = self._stalled_call(frame)
        guard, deadline = call if call is not None else (None, None)
        if guard is not None and deadline is not None:
            must_end = max(must_end, deadline)
            if now >= deadline and self._target is None:
                self._interrupt(guard)
        if self.exit_after_s is not None and self._on_main and now >= must_end + self.exit_after_s:
            log.critical(
                "The event loop has been blocked for %.1f s and could not be freed; exiting "
                "(status %d) so that a supervisor can replace this server. Stuck in:\n%s",
                stalled,
                EXIT_STALLED,
                _stack(frame),
            )
            logging.shutdown()
            os._exit(EXIT_STALLED)

    def _end_stall(self) -> None:
        self._stall_beat = None
        self._target = None

    def _stalled_call(self, frame: FrameType | None) -> tuple[FrameType, float | None] | None:
        """The innermost environment call on the stuck stack, and its deadline."""
        while frame is not None:
            if frame.f_code is self._guard:
                session = frame.f_locals.get("self")
                limit = frame.f_locals.get("limit")
                started = getattr(session, "last_active", None)
                if isinstance(limit, int | float) and isinstance(started, float):
                    return frame, started + limit
                return frame, None
            frame = frame.f_back
        return None

    def _interrupt(self, guard: FrameType) -> None:
        self._target = guard
        self.interrupts += 1
        log.error("Interrupting the stalled environment call: it is past its deadline.")
        if self._on_main:
            signal.pthread_kill(self._loop_thread, INTERRUPT_SIGNAL)
            return
        # The GIL is held from the stack's inspection to here (ctypes.pythonapi keeps it),
        # so the loop's thread is still inside that call: the exception lands there.
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(self._loop_thread), ctypes.py_object(LoopStalled)
        )

    # --- on the loop's (main) thread ---------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Raise :class:`LoopStalled` if the stall aimed at is still going on here."""
        target = self._target
        if target is None or self._stall_beat != self._beat:
            return  # the stall ended before the signal was handled
        while frame is not None:
            if frame is target:
                raise LoopStalled
            frame = frame.f_back


def _stack(frame: FrameType | None) -> str:
    if frame is None:
        return "  (no stack: the loop's thread is gone)"
    return "".join(traceback.format_stack(frame, limit=12))
