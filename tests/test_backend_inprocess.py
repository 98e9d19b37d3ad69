"""The in-process backend builds each environment with its launch's options."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from envport.client import EnvClient
from envport.client.transports import InProcessTransport
from envport.envs.echo import EchoEnv
from envport.errors import EnvportError
from envport.rollout import Controller, ControllerConfig, InProcessBackend, RolloutSpec
from envport.rollout.backends.base import BackendError, EnvLaunch
from envport.tasks import Task
from envport.trace import AsyncTraceStore, SQLiteTraceStore, StepRecord, Trace, TraceStatus


async def steps_until_done(env: EnvClient, limit: int = 10) -> int:
    await env.reset()
    for n in range(1, limit + 1):
        result = await env.step({"message": "hi"})
        if result.done or result.truncated:
            return n
    return limit


async def test_launch_options_reach_the_environment() -> None:
    backend = InProcessBackend()
    capped = await backend.start(EnvLaunch(env_id="echo-v1", options={"max_steps": 2}))
    plain = await backend.start(EnvLaunch(env_id="echo-v1"))
    async with capped.client() as env:
        assert await steps_until_done(env) == 2
    async with plain.client() as env:
        assert await steps_until_done(env) == 10  # no cap without the option
    await backend.aclose()


async def test_options_with_a_factory_and_a_bad_option() -> None:
    async with EnvClient(InProcessTransport(EchoEnv, options={"max_steps": 3})) as env:
        assert await steps_until_done(env) == 3
    backend = InProcessBackend()
    bad = await backend.start(EnvLaunch(env_id="echo-v1", options={"max_stepz": 1}))
    with pytest.raises(EnvportError, match="max_stepz"):
        async with bad.client() as env:
            await env.reset()
    await backend.aclose()


async def test_options_for_an_environment_served_elsewhere_are_refused() -> None:
    backend = InProcessBackend(urls={"echo-v1": "http://127.0.0.1:1"})
    with pytest.raises(BackendError, match=r"served at http://127\.0\.0\.1:1.*max_steps"):
        await backend.start(EnvLaunch(env_id="echo-v1", options={"max_steps": 2}))
    served = await backend.start(EnvLaunch(env_id="echo-v1"))  # without options: fine
    assert served.url == "http://127.0.0.1:1"


class UntilDone:
    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        await env.reset()
        while True:
            result = await env.step({"message": "m"})
            trace.steps.append(StepRecord(index=len(trace.steps), action={"message": "m"}))
            if result.done or result.truncated or len(trace.steps) >= 10:
                return


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[AsyncTraceStore]:
    async with AsyncTraceStore(SQLiteTraceStore(tmp_path / "t.db")) as s:
        yield s


async def test_controller_env_options_apply_in_process(store: AsyncTraceStore) -> None:
    config = ControllerConfig(env_options={"echo-v1": {"max_steps": 4}})
    ctl = Controller(store, InProcessBackend(), UntilDone(), config, run_id="r")
    summary = await ctl.run([RolloutSpec(Task(id="t", prompt="go", env_id="echo-v1"))])
    assert summary.succeeded == 1
    (trace,) = await store.query(rollout_id="r/t/0")
    assert trace.status is TraceStatus.COMPLETED
    assert len(trace.steps) == 4
