"""The trace writer: finished rollouts' traces go to the store in batches, in the background.

Model calls never touch the store; a rollout's trace is written when it is finished.
:meth:`TraceWriter.put` queues the trace and waits until it is durable, so ``POST
/admin/rollouts/{id}/finish`` still answers only once its trace is stored; finishes
that arrive together share one transaction (``put_many``) run in a worker thread,
so the event loop that relays model calls never waits on SQLite.

Nothing is lost on shutdown: :meth:`TraceWriter.aclose` (the gateway's lifespan calls
it) writes everything still queued before it returns; a trace submitted after that is
refused with :class:`~envport.trace.TraceStoreError`. A failed write fails the
``put`` of every trace in its batch, with the store's error.

``after_write`` runs in the same worker thread right after each batch is stored, and
a ``put`` resolves only once it returned: the gateway deletes the finished rollouts'
restart registrations there, in one transaction per batch, so that SQLite write (which
may wait for the store's own transaction on the same file) never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from envport.trace.errors import TraceStoreError
from envport.trace.model import Trace
from envport.trace.store import TraceStore


class TraceWriter:
    """Writes traces to ``store`` in batches of at most ``max_batch``, off the event loop.

    The background task runs only while there is something to write; it belongs to the
    writer, and :meth:`aclose` awaits it.
    """

    def __init__(
        self,
        store: TraceStore,
        *,
        max_batch: int = 256,
        after_write: Callable[[list[Trace]], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, not {max_batch}")
        self.store = store
        self.max_batch = max_batch
        self.after_write = after_write
        self.batches = 0
        self.written = 0
        self._queue: list[tuple[Trace, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Traces queued and not yet written."""
        return len(self._queue)

    def submit(self, trace: Trace) -> asyncio.Future[None]:
        """Queue ``trace``; the future resolves once it is durable (or fails with why)."""
        if self._closed:
            raise TraceStoreError(
                f"The trace writer is closed; trace {trace.trace_id!r} of rollout "
                f"{trace.rollout_id!r} was not stored."
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self._queue.append((trace, future))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return future

    async def put(self, trace: Trace) -> None:
        """Queue ``trace`` and wait until it is stored. If the caller is cancelled, the
        trace is still written."""
        await asyncio.shield(self.submit(trace))

    async def _run(self) -> None:
        while self._queue:
            batch = self._queue[: self.max_batch]
            del self._queue[: self.max_batch]
            traces = [trace for trace, _ in batch]
            try:
                await asyncio.to_thread(self._write, traces)
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.batches += 1
            self.written += len(batch)
            for _, future in batch:
                if not future.done():
                    future.set_result(None)

    def _write(self, traces: list[Trace]) -> None:
        """In the worker thread: store the batch, then run ``after_write`` on it."""
        self.store.put_many(traces)
        if self.after_write is not None:
            self.after_write(traces)

    async def flush(self) -> None:
        """Wait until everything queued so far is written (or failed)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def aclose(self) -> None:
        """Refuse new traces and write every queued one (idempotent)."""
        self._closed = True
        await self.flush()


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark a failed write as seen (its ``put`` may have been cancelled meanwhile)."""
    if not future.cancelled():
        with contextlib.suppress(Exception):
            future.exception()
