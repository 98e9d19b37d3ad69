"""A watchdog for the server's event loop: an ``async`` environment method that blocks.

Every session of a server shares one event loop. An environment whose ``async def``
step runs blocking code (``time.sleep``, a busy loop, a socket read without ``await``)
stops that loop: no other session is served, and no call deadline can fire, since the
deadline's timer runs on the stopped loop too. A thread outside the loop watches a
heartbeat the loop writes every ``interval_s``:

* **Warn.** A stall longer than ``warn_s`` is logged once, with the stack it is stuck in,
  whatever blocks (an environment's slow constructor too).
* **Interrupt.** When the stuck code is an environment call (it runs inside
  :meth:`envport.session.Session._guard`) past its deadline, the watchdog raises
  :class:`LoopStalled` inside it. When the loop runs on the main thread (``envport
  serve``), it does so from a signal handler, which first checks that the call is still
  the one stuck, and whose signal also wakes a blocking sleep or read. Elsewhere it sets an
  asynchronous exception, right after checking the stuck stack again, which lands at the
  call's next bytecode (a busy loop at once; a sleep when it returns). The session answers
  with a timeout error and discards that environment, as for any call past its deadline;
  every other session goes on, and the next call to block is interrupted in its turn. A
  call with no deadline (``--call-timeout 0``) is only warned about.
* **Exit.** When an interrupted call still holds the loop ``exit_after_s`` after its
  deadline (code that swallows the exception, C code that never returns to Python), the
  process logs the stack and exits with status :data:`EXIT_STALLED`, so whatever
  supervises it (the rollout controller's pool, systemd, Kubernetes) replaces it instead
  of it hanging forever. Only a loop on the main thread does this: a server in a thread of
  someone else's process never exits it.
* **Backstop.** The watchdog is a Python thread, so C code that holds the GIL (a huge
  integer power, a regular expression that backtracks forever) stops it too. Where the
  process may exit, the watchdog thread keeps a timer of :mod:`faulthandler` (a C thread
  that needs no GIL) armed ``exit_after_s`` (at least :data:`BACKSTOP_MIN_S`) ahead,
  moving it on every few seconds. If no Python thread runs for that long, the timer
  dumps every thread's stack to stderr (``Timeout (...)!``) and exits with status 1.
  The timer is the process's one ``faulthandler.dump_traceback_later``: an environment
  must not use that too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
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

#: The shortest time without any Python running after which the backstop exits.
BACKSTOP_MIN_S = 5.0

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


# Watchdogs of loops on the main thread share one handler of INTERRUPT_SIGNAL, installed
# while any of them runs (one server stopping must not leave another without it).
_on_main: set[LoopWatchdog] = set()
_saved_handler: Any = None

# Watchdogs that keep faulthandler's one timer armed (it is cancelled when the last stops).
_backstops: set[LoopWatchdog] = set()
_backstop_lock = threading.Lock()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    for watchdog in list(_on_main):
        watchdog._raise_if_stuck(frame)


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
        self._guard = _guard_code()
        # The stall being handled (the beat it started after), and the environment call
        # last interrupted in it, with the beat the interrupt was decided at.
        self._stall_beat: float | None = None
        self._target: FrameType | None = None
        self._target_beat: float | None = None
        # The GIL-free backstop: whether this watchdog keeps it armed, and since when.
        self._backstop = False
        self._backstop_armed = 0.0

    # --- lifecycle (call on the loop's thread) -----------------------------------------

    def start(self) -> None:
        global _saved_handler
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._on_main = threading.current_thread() is threading.main_thread()
        if self._on_main:
            if not _on_main:
                _saved_handler = signal.signal(INTERRUPT_SIGNAL, _on_signal)
            _on_main.add(self)
        self._beat = time.monotonic()
        self._handle = self._loop.call_later(self.interval_s, self._tick)
        self._stop.clear()
        if self._on_main and self.exit_after_s is not None:
            self._backstop = self._arm_backstop(time.monotonic())
        self._thread = threading.Thread(target=self._watch, name="envport-loop-watchdog")
        self._thread.daemon = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._backstop:
            self._backstop = False
            with _backstop_lock:
                _backstops.discard(self)
                if not _backstops:
                    faulthandler.cancel_dump_traceback_later()
        if self._on_main and self in _on_main:
            _on_main.discard(self)
            if not _on_main:
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(INTERRUPT_SIGNAL, _saved_handler or signal.SIG_DFL)

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
            now = time.monotonic()
            try:
                if self._backstop and now - self._backstop_armed >= self._backstop_step():
                    self._arm_backstop(now)
                self._check(now)
            except Exception:  # the watchdog must outlive anything it finds
                log.exception("loop watchdog check failed")

    def _backstop_step(self) -> float:
        """How often the backstop's timer is moved on (each move starts a C thread)."""
        assert self.exit_after_s is not None
        return min(5.0, self.exit_after_s / 4)

    def _arm_backstop(self, now: float) -> bool:
        """(Re)arm faulthandler's timer to fire once no Python thread has run for
        ``exit_after_s`` (at least BACKSTOP_MIN_S); False where it cannot (stderr has no
        file descriptor)."""
        assert self.exit_after_s is not None
        with _backstop_lock:
            if self._stop.is_set():
                return False
            try:
                timeout = max(self.exit_after_s, BACKSTOP_MIN_S) + self._backstop_step()
                faulthandler.dump_traceback_later(timeout, exit=True, file=sys.stderr)
            except (ValueError, AttributeError, OSError, RuntimeError) as exc:
                log.warning("No GIL-free stall backstop (faulthandler: %s)", exc)
                return False
            _backstops.add(self)
        self._backstop_armed = now
        return True

    def _check(self, now: float) -> None:
        beat = self._beat
        stalled = now - beat - self.interval_s  # the beat is due every interval_s
        if stalled < self.warn_s:  # the loop beats: no call is stuck (forget the last)
            self._stall_beat = self._target = self._target_beat = None
            return
        frame = sys._current_frames().get(self._loop_thread)
        if self._stall_beat != beat:  # a new stall
            self._stall_beat = beat
            self.stalls += 1
            log.warning(
                "The event loop has been blocked for %.1f s, so no session is served: "
                "something runs blocking code on it (an async environment method, or an "
                "environment's constructor; plain def hooks run on the environment's own "
                "thread). Stuck in:\n%s",
                stalled,
                _stack(frame),
            )
        self.longest_stall_s = max(self.longest_stall_s, stalled)
        call = self._stalled_call(frame)
        if call is None:
            return
        stuck, deadline = call
        if deadline is None or now < deadline:
            return  # no deadline (--call-timeout 0), or not yet: only the warning
        if self._target is not stuck:
            self._interrupt(stuck, beat)
        elif self._should_exit(now, deadline):
            log.critical(
                "An environment call has blocked the event loop for %.1f s and did not "
                "let go when interrupted; exiting (status %d) so that a supervisor can "
                "replace this server. Stuck in:\n%s",
                stalled,
                EXIT_STALLED,
                _stack(frame),
            )
            logging.shutdown()
            os._exit(EXIT_STALLED)

    def _should_exit(self, now: float, deadline: float) -> bool:
        """Whether the interrupted call has held the loop ``exit_after_s`` past its
        deadline (only a loop on the main thread exits its process)."""
        return (
            self.exit_after_s is not None and self._on_main and now >= deadline + self.exit_after_s
        )

    def _stalled_call(self, frame: FrameType | None) -> tuple[FrameType, float | None] | None:
        """The innermost environment call on the stuck stack (the frame ``_guard`` runs
        it in: gone from the stack once the call returns, even while ``_guard`` still
        runs), and its deadline."""
        inner: FrameType | None = None
        while frame is not None:
            if frame.f_code is self._guard:
                if inner is None:  # in _guard's own code, not in the call
                    return None
                session = frame.f_locals.get("self")
                limit = frame.f_locals.get("limit")
                started = getattr(session, "call_started", None)
                if isinstance(limit, int | float) and isinstance(started, float):
                    return inner, started + limit
                return inner, None
            inner, frame = frame, frame.f_back
        return None

    def _interrupt(self, stuck: FrameType, beat: float) -> None:
        if self._on_main:
            # The handler raises only if this call is still the one stuck.
            self._target, self._target_beat = stuck, beat
            signal.pthread_kill(self._loop_thread, INTERRUPT_SIGNAL)
        else:
            # Checked again with nothing in between that releases the GIL (no I/O): the
            # loop's thread runs no Python until this thread lets go of the GIL, so the
            # exception lands in the stuck call, unless the GIL's switch interval (5 ms)
            # runs out within these few microseconds.
            if self._beat != beat or not _on_stack(
                sys._current_frames().get(self._loop_thread), stuck
            ):
                return
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._loop_thread), ctypes.py_object(LoopStalled)
            )
            self._target, self._target_beat = stuck, beat
        self.interrupts += 1
        log.error("Interrupting the environment call that blocks the loop past its deadline.")

    # --- on the loop's (main) thread ---------------------------------------------------

    def _raise_if_stuck(self, frame: FrameType | None) -> None:
        """Raise :class:`LoopStalled` if the call aimed at is still stuck, here."""
        target = self._target
        if target is not None and self._target_beat == self._beat and _on_stack(frame, target):
            raise LoopStalled


def _on_stack(frame: FrameType | None, target: FrameType) -> bool:
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


def _stack(frame: FrameType | None) -> str:
    if frame is None:
        return "  (no stack: the loop's thread is gone)"
    return "".join(traceback.format_stack(frame, limit=12))
