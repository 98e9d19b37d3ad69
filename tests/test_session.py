"""Session: calls run eagerly, and the deadline covers whatever part of a call suspends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from envport.errors import EnvExecutionError, EnvNotResetError, EnvTimeoutError
from envport.session import Session, _Turns
from tests.support.faulty_envs import FaultyEnv, SyncBlockingEnv


async def _ready(factory: Any, timeout_s: float = 5.0) -> Session:
    session = Session(factory, call_timeout_s=timeout_s)
    await session.reset()
    return session


async def test_a_call_that_never_suspends_returns_its_result() -> None:
    session = await _ready(FaultyEnv)
    result = await session.step({"message": "now"})
    assert result.observation.echoed_message == "now"
    assert (await session.state()).step_count == 1


async def test_a_call_that_suspends_finishes_under_the_deadline() -> None:
    session = await _ready(FaultyEnv)
    result = await session.step({"message": "sleep:0.02"})
    assert result.observation.echoed_message == "sleep:0.02"
    # a sync env always suspends (its hooks run in a worker thread)
    sync = await _ready(SyncBlockingEnv)
    assert (await sync.step({"message": "t"})).observation.echoed_message == "t"


async def test_a_suspended_call_past_the_deadline_times_out_and_poisons() -> None:
    session = await _ready(FaultyEnv, timeout_s=0.2)
    with pytest.raises(EnvTimeoutError, match=r"within 0\.2 s"):
        await session.step({"message": "hang"})
    with pytest.raises(EnvNotResetError):
        await session.step({"message": "again"})
    await session.reset()  # a fresh environment
    assert (await session.step({"message": "ok"})).observation.echoed_message == "ok"
    await session.close()


async def test_errors_before_and_after_a_suspension_propagate() -> None:
    session = await _ready(FaultyEnv)
    with pytest.raises(EnvExecutionError, match="boom"):
        await session.step({"message": "crash"})

    class LateCrash(FaultyEnv):
        async def on_step(self, action: Any) -> Any:
            await asyncio.sleep(0)
            raise RuntimeError("late boom")

    late = await _ready(LateCrash)
    with pytest.raises(EnvExecutionError, match="late boom"):
        await late.step({"message": "x"})


async def test_cancelling_the_caller_cancels_the_suspended_call() -> None:
    seen: list[str] = []

    class Watched(FaultyEnv):
        async def on_step(self, action: Any) -> Any:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            finally:
                seen.append("finally")

    session = await _ready(Watched)
    task = asyncio.create_task(session.step({"message": "x"}))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "finally"]
    # the lock was released: the session still answers
    assert (await session.state()).step_count >= 0


async def test_a_cancelled_call_whose_cleanup_suspends_is_driven_to_its_end() -> None:
    cleaned: list[bool] = []

    class Stubborn(FaultyEnv):
        async def on_step(self, action: Any) -> Any:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(0.01)  # cleanup that suspends again
                cleaned.append(True)
                raise
            return None

    session = await _ready(Stubborn)
    task = asyncio.create_task(session.step({"message": "x"}))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


async def test_concurrent_calls_of_one_session_run_one_at_a_time_in_arrival_order() -> None:
    session = await _ready(FaultyEnv)
    order: list[str] = []

    async def step(message: str) -> None:
        result = await session.step({"message": message})
        order.append(result.observation.echoed_message)

    # The first suspends while holding the turn; the others queue behind it, FIFO.
    await asyncio.gather(step("sleep:0.05"), step("b"), step("c"), step("sleep:0.01"), step("e"))
    assert order == ["sleep:0.05", "b", "c", "sleep:0.01", "e"]
    assert (await session.state()).step_count == 5


async def test_a_caller_cancelled_while_waiting_for_its_turn_leaves_the_queue() -> None:
    session = await _ready(FaultyEnv)
    first = asyncio.create_task(session.step({"message": "sleep:0.05"}))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(session.step({"message": "never"}))
    last = asyncio.create_task(session.step({"message": "last"}))
    await asyncio.sleep(0.01)
    waiting.cancel()
    assert (await first).observation.echoed_message == "sleep:0.05"
    assert (await last).observation.echoed_message == "last"
    assert waiting.cancelled()
    assert (await session.state()).step_count == 2  # the cancelled call never ran


async def test_a_caller_cancelled_just_as_it_is_handed_the_turn_passes_it_on() -> None:
    turns = _Turns()
    turns.busy = True  # someone holds the turn
    handed = asyncio.create_task(turns.wait())
    next_in_line = asyncio.create_task(turns.wait())
    await asyncio.sleep(0)  # both wait
    turns.release()  # hands the turn to `handed`...
    handed.cancel()  # ...which is cancelled before it runs
    await next_in_line  # so it goes on to the next waiter
    assert handed.cancelled()
    assert turns.busy
    turns.release()
    assert not turns.busy


async def test_a_queued_creation_that_fails_passes_its_slot_to_the_next_in_line() -> None:
    """Two requests wait for the one slot; the first one woken fails to make its
    environment (an envport error from the factory): the second still gets the slot,
    instead of waiting out its queue timeout."""
    import envport
    from envport.errors import EnvFactoryError
    from envport.server.sessions import ServerConfig, SessionManager

    made = 0

    def factory() -> Any:
        nonlocal made
        made += 1
        if made == 2:
            raise EnvFactoryError("the second environment cannot be made")
        return envport.make("echo-v1")

    manager = SessionManager(factory, ServerConfig(max_sessions=1, queue_timeout_s=5))
    first = await manager.create()
    failing = asyncio.create_task(manager.create())
    waiting = asyncio.create_task(manager.create())
    await asyncio.sleep(0.05)
    await manager.close(first)  # the slot frees: the first waiter fails to use it
    with pytest.raises(EnvFactoryError):
        await failing
    second = await asyncio.wait_for(waiting, 2)  # woken at once, not after 5 s
    assert manager.active == 1
    await manager.close(second)


async def test_a_session_with_a_call_running_is_never_reaped_as_idle() -> None:
    """A long command (a declared timeout_s) outlives the idle timeout on an unattached
    session: it is not reaped while it runs, and is once it is idle for long enough."""
    import time

    from envport.server.sessions import ServerConfig, SessionManager
    from tests.support.faulty_envs import LongCommandEnv

    manager = SessionManager(LongCommandEnv, ServerConfig(idle_timeout_s=0.2))
    session = await manager.create()
    await session.reset()
    running = asyncio.create_task(session.step({"command": "sleep:0.6", "timeout_s": 5}))
    await asyncio.sleep(0.4)
    assert manager.expired() == []  # idle for 0.4 s by the clock, but busy
    await running
    assert manager.expired(time.monotonic() + 1) == [session]
    await manager.close(session)
