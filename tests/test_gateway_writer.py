"""The gateway's background trace writer: batched, off the event loop, nothing lost.

Real SQLite files throughout; "durable" is checked by reopening the file.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from envport.gateway.writer import TraceWriter
from envport.trace import SQLiteTraceStore, Trace, TraceStoreError


def _traces(n: int, prefix: str = "t") -> list[Trace]:
    return [Trace(trace_id=f"{prefix}{i}", rollout_id=f"r{i}", run_id="run") for i in range(n)]


def _stored_ids(path: Path) -> set[str]:
    with SQLiteTraceStore(path) as store:
        return {t.trace_id for t in store.query(run_id="run")}


class _SlowStore(SQLiteTraceStore):
    """A real SQLite store whose writes wait for ``gate``: lets a queue build up."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.batch_sizes: list[int] = []

    def put_many(self, traces: Iterable[Trace]) -> int:
        items = list(traces)
        self.gate.wait(10)
        self.batch_sizes.append(len(items))
        return super().put_many(items)


async def test_put_returns_once_the_trace_is_durable(tmp_path: Path) -> None:
    store = SQLiteTraceStore(tmp_path / "t.db")
    writer = TraceWriter(store)
    [trace] = _traces(1)
    await writer.put(trace)
    assert _stored_ids(tmp_path / "t.db") == {"t0"}  # another connection sees it
    await writer.aclose()
    store.close()


async def test_concurrent_puts_share_transactions(tmp_path: Path) -> None:
    store = _SlowStore(tmp_path / "t.db")
    writer = TraceWriter(store, max_batch=64)
    traces = _traces(100)
    puts = [asyncio.ensure_future(writer.put(t)) for t in traces]
    await asyncio.sleep(0.05)  # the first write is held; the rest queue behind it
    assert writer.pending > 0
    store.gate.set()
    await asyncio.gather(*puts)
    await writer.aclose()
    assert sum(store.batch_sizes) == 100
    assert len(store.batch_sizes) < 100  # batched, not one transaction per trace
    assert max(store.batch_sizes) <= 64
    assert writer.written == 100
    assert _stored_ids(tmp_path / "t.db") == {t.trace_id for t in traces}
    store.close()


async def test_aclose_writes_everything_still_queued(tmp_path: Path) -> None:
    store = _SlowStore(tmp_path / "t.db")
    writer = TraceWriter(store, max_batch=8)
    traces = _traces(50)
    futures = [writer.submit(t) for t in traces]  # nobody waits on these
    closing = asyncio.ensure_future(writer.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done()  # shutdown waits for the queue
    store.gate.set()
    await closing
    assert all(f.done() and f.exception() is None for f in futures)
    assert writer.pending == 0
    store.close()
    assert _stored_ids(tmp_path / "t.db") == {t.trace_id for t in traces}


async def test_a_cancelled_put_is_still_written(tmp_path: Path) -> None:
    store = _SlowStore(tmp_path / "t.db")
    writer = TraceWriter(store)
    [trace] = _traces(1)
    put = asyncio.ensure_future(writer.put(trace))
    await asyncio.sleep(0.02)
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    store.gate.set()
    await writer.aclose()
    store.close()
    assert _stored_ids(tmp_path / "t.db") == {"t0"}


async def test_after_close_traces_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    store = SQLiteTraceStore(tmp_path / "t.db")
    writer = TraceWriter(store)
    await writer.aclose()
    await writer.aclose()  # idempotent
    [trace] = _traces(1)
    with pytest.raises(TraceStoreError, match=r"writer is closed.*not stored"):
        await writer.put(trace)
    store.close()


async def test_a_failed_write_fails_its_puts_and_the_writer_goes_on(tmp_path: Path) -> None:
    broken = SQLiteTraceStore(tmp_path / "broken.db")
    broken.close()  # every write now fails
    writer = TraceWriter(broken)
    with pytest.raises(TraceStoreError, match="closed"):
        await writer.put(_traces(1)[0])
    good = SQLiteTraceStore(tmp_path / "good.db")
    writer.store = good  # the writer itself is not stuck after a failure
    await writer.put(_traces(1, "g")[0])
    await writer.aclose()
    good.close()
    with SQLiteTraceStore(tmp_path / "good.db") as again:
        assert [t.trace_id for t in again.query(run_id="run")] == ["g0"]


def test_max_batch_must_be_positive(tmp_path: Path) -> None:
    with SQLiteTraceStore(tmp_path / "t.db") as store, pytest.raises(ValueError, match="max_batch"):
        TraceWriter(store, max_batch=0)


async def test_after_write_runs_in_the_worker_thread_once_the_batch_is_stored(
    tmp_path: Path,
) -> None:
    store = SQLiteTraceStore(tmp_path / "t.db")
    seen: list[tuple[list[str], set[str], bool]] = []

    def after(traces: list[Trace]) -> None:
        stored = _stored_ids(tmp_path / "t.db")  # already durable when it runs
        seen.append(([t.rollout_id for t in traces], stored, threading.current_thread() is main))

    main = threading.current_thread()
    writer = TraceWriter(store, after_write=after)
    await asyncio.gather(*(writer.put(t) for t in _traces(5)))
    await writer.aclose()
    store.close()
    assert sorted(r for ids, _, _ in seen for r in ids) == [f"r{i}" for i in range(5)]
    assert all(stored >= {f"t{ids[0][1:]}"} for ids, stored, _ in seen)
    assert not any(on_loop for _, _, on_loop in seen)


async def test_a_failing_after_write_fails_the_puts_of_its_batch(tmp_path: Path) -> None:
    store = SQLiteTraceStore(tmp_path / "t.db")

    def after(traces: list[Trace]) -> None:
        raise TraceStoreError("registry is gone")

    writer = TraceWriter(store, after_write=after)
    [trace] = _traces(1)
    with pytest.raises(TraceStoreError, match="registry is gone"):
        await writer.put(trace)
    await writer.aclose()
    store.close()
    assert _stored_ids(tmp_path / "t.db") == {"t0"}  # the trace itself was stored
