"""Session: calls run eagerly, and the deadline covers whatever part of a call suspends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from envport.errors import EnvExecutionError, EnvNotResetError, EnvTimeoutError
from envport.session import Session
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
