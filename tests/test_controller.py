"""The rollout controller under faults: hangs, dead environments, stuck harnesses, restarts."""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from envport.client import EnvClient
from envport.errors import EnvportError
from envport.rollout import (
    Controller,
    ControllerConfig,
    ControllerConflictError,
    InProcessBackend,
    LocalProcessBackend,
    RolloutEvent,
    RolloutSpec,
    RolloutState,
    heartbeat,
)
from envport.rollout.backends import EnvInstance, EnvLaunch, Limits
from envport.server import ServerConfig
from envport.tasks import Resources, Task
from envport.trace import AsyncTraceStore, SQLiteTraceStore, StepRecord, Trace, TraceStatus
from envport.trace.store import AttemptRecord, RolloutRecord
from envport.train.rows import build_rows
from tests.support.faulty_envs import FaultyEnv
from tests.support.servers import run_env_server

FAULTY = "tests.support.faulty_envs:FaultyEnv"
ROOT = Path(__file__).resolve().parent.parent


def task(task_id: str, actions: list[str], **extra: Any) -> Task:
    return Task(id=task_id, prompt="go", env_id=FAULTY, metadata={"actions": actions}, **extra)


class ScriptHarness:
    """Resets, then steps each of the task's ``actions``; tracks concurrency."""

    name = "script"

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await env.reset()
            for message in task.metadata["actions"]:
                result = await env.step({"message": message})
                trace.steps.append(
                    StepRecord(
                        index=len(trace.steps),
                        action={"message": message},
                        observation=result.observation,
                    )
                )
        finally:
            self.active -= 1


class StuckHarness:
    """Never returns and never makes progress after reset."""

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        await env.reset()
        await asyncio.Event().wait()


class BeatingHarness:
    """Slow, but says it is alive: heartbeat() between quiet stretches."""

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        await env.reset()
        for _ in range(12):  # 1.2 s in all, past the test's 0.8 s hang watchdog
            await asyncio.sleep(0.1)
            heartbeat()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[AsyncTraceStore]:
    async with AsyncTraceStore(SQLiteTraceStore(tmp_path / "t.db")) as s:
        yield s


def db(store: AsyncTraceStore) -> SQLiteTraceStore:
    assert isinstance(store.store, SQLiteTraceStore)
    return store.store


FAST = {"hang_timeout_s": 0.4, "health_interval_s": 0.2, "heartbeat_persist_s": 0.1}


async def test_batch_runs_under_limits_with_persisted_states(store: AsyncTraceStore) -> None:
    harness = ScriptHarness()
    events: list[RolloutEvent] = []
    config = ControllerConfig(concurrency=8, env_concurrency={FAULTY: 2}, **FAST)
    tasks = [task(f"t{i}", ["sleep:0.02", "hi"]) for i in range(5)]
    specs = [RolloutSpec(t, k) for t in tasks for k in range(2)]
    ctl = Controller(store, InProcessBackend(), harness, config, run_id="r", on_event=events.append)
    summary = await ctl.run(specs)
    assert (summary.rollouts, summary.succeeded, summary.failed) == (10, 10, 0)
    assert 1 <= harness.peak <= 2  # the per-environment limit held
    rows = db(store).rollouts(run_id="r")
    assert {r.state for r in rows} == {"succeeded"}
    assert all(r.attempts == 1 and r.trace_id for r in rows)
    assert {a.state for a in db(store).attempts(run_id="r")} == {"succeeded"}
    traces = await store.query(run_id="r")
    assert sorted(t.rollout_id for t in traces) == sorted(r.rollout_id for r in rows)
    one = [e.state for e in events if e.rollout_id == "r/t0/0"]
    assert one == ["pending", "starting_env", "running", "scoring", "succeeded"]


async def test_hanging_environment_is_cut_and_retried_on_a_fresh_instance(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    marker = tmp_path / "hung-once"
    tasks = [task("hangs-once", [f"hang_once:{marker}", "after"]), task("fine", ["hi"])]
    config = ControllerConfig(max_attempts=3, **FAST)
    ctl = Controller(store, InProcessBackend(), ScriptHarness(), config, run_id="r")
    summary = await ctl.run([RolloutSpec(t) for t in tasks])
    assert (summary.succeeded, summary.failed, summary.retried) == (2, 0, 1)
    (trace,) = await store.query(rollout_id="r/hangs-once/0")
    assert trace.status is TraceStatus.COMPLETED
    assert trace.attempt == 2
    (previous,) = trace.metadata["previous_attempts"]
    assert previous["error_kind"] == "infrastructure"
    assert "no heartbeat" in previous["message"]
    first, second = db(store).attempts(rollout_id="r/hangs-once/0")
    assert (first.state, first.error_kind, second.state) == (
        "failed",
        "infrastructure",
        "succeeded",
    )
    assert first.instance_id != second.instance_id  # retried on a fresh instance
    assert len(await store.query(run_id="r")) == 2  # one trace per rollout


async def test_environment_that_always_hangs_fails_unscored(store: AsyncTraceStore) -> None:
    tasks = [task("hangs", ["hang"]), task("fine", ["hi"])]
    config = ControllerConfig(max_attempts=2, **FAST)
    ctl = Controller(store, InProcessBackend(), ScriptHarness(), config, run_id="r")
    summary = await ctl.run([RolloutSpec(t) for t in tasks])
    assert (summary.succeeded, summary.failed) == (1, 1)
    assert summary.errors_by_kind == {"infrastructure": 1}
    (trace,) = await store.query(rollout_id="r/hangs/0")
    assert trace.status is TraceStatus.FAILED
    assert trace.reward is None  # never scored 0
    assert trace.stop_reason == "hang"
    assert [a.state for a in db(store).attempts(rollout_id="r/hangs/0")] == ["failed", "failed"]
    assert db(store).get_rollout("r/hangs/0").error_kind == "infrastructure"
    assert build_rows(trace).rows == []  # excluded from training data


async def test_harness_that_never_returns_fails_without_retry(store: AsyncTraceStore) -> None:
    specs = [
        RolloutSpec(task("stuck", ["x"]), harness=StuckHarness()),
        RolloutSpec(task("fine", ["hi"])),
    ]
    config = ControllerConfig(max_attempts=3, **FAST)
    ctl = Controller(store, InProcessBackend(), ScriptHarness(), config, run_id="r")
    summary = await ctl.run(specs)
    assert (summary.succeeded, summary.failed) == (1, 1)
    (trace,) = await store.query(rollout_id="r/stuck/0")
    (error,) = trace.errors
    assert error.kind.value == "harness"
    assert "no heartbeat from the harness" in error.message
    assert len(db(store).attempts(rollout_id="r/stuck/0")) == 1  # not an infra fault


async def test_heartbeats_keep_a_slow_harness_alive_but_deadlines_hold(
    store: AsyncTraceStore,
) -> None:
    from envport.tasks.task import Resources, Timeouts

    slow = task("slow", [])
    capped = task("capped", [], resources=Resources(timeouts=Timeouts(agent=0.3)))
    # Beats 0.1 s apart keep it alive: the watchdog must not trip on a loop that a loaded
    # machine (or a garbage collection) stalls between two beats, so not 0.3 s.
    config = ControllerConfig(hang_timeout_s=0.8, health_interval_s=0.2)
    ctl = Controller(store, InProcessBackend(), BeatingHarness(), config, run_id="r")
    summary = await ctl.run([RolloutSpec(slow), RolloutSpec(capped)])
    assert (summary.succeeded, summary.failed) == (1, 1)
    (trace,) = await store.query(rollout_id="r/capped/0")
    assert trace.stop_reason == "timeout"
    assert trace.errors[0].message == "agent exceeded its deadline"
    assert trace.errors[0].kind.value == "harness"


def _is_envport(pid: int) -> bool:
    try:
        return b"envport" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def test_restart_requeues_in_flight_rollouts_exactly_once(store: AsyncTraceStore) -> None:
    import socket

    tasks = [task(f"t{i}", ["hi"]) for i in range(3)]
    specs = [RolloutSpec(t) for t in tasks]
    # A first controller finished t0 and died (SIGKILL) while t1 was running.
    await Controller(store, InProcessBackend(), ScriptHarness(), run_id="r").run(specs[:1])
    dead = f"{socket.gethostname()}:{_dead_pid()}:gone"
    s = db(store)
    s.ensure_rollout(RolloutRecord(rollout_id="r/t1/0", run_id="r", task_id="t1", max_attempts=3))
    s.advance_rollout(
        "r/t1/0",
        expect="pending",
        state="running",
        attempts=1,
        controller=dead,
        attempt=AttemptRecord(
            rollout_id="r/t1/0", attempt=1, run_id="r", state="running", controller=dead
        ),
    )
    stale = Trace(run_id="r", task_id="t1", rollout_id="r/t1/0", status=TraceStatus.RUNNING)
    s.put(stale)

    summary = await Controller(store, InProcessBackend(), ScriptHarness(), run_id="r").run(specs)
    assert (summary.rollouts, summary.succeeded, summary.skipped) == (3, 3, 1)
    assert summary.abandoned == 1
    traces = await store.query(run_id="r")
    assert sorted(t.rollout_id for t in traces) == ["r/t0/0", "r/t1/0", "r/t2/0"]
    first, second = s.attempts(rollout_id="r/t1/0")
    assert (first.state, first.reason) == ("abandoned", "controller_restart")
    assert second.state == "succeeded"
    (t1,) = [t for t in traces if t.rollout_id == "r/t1/0"]
    assert s.get_rollout("r/t1/0").trace_id == t1.trace_id != stale.trace_id


async def test_a_live_controller_of_the_same_run_is_refused(store: AsyncTraceStore) -> None:
    import socket

    sleeper = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(30)"
    )
    try:
        from envport.procs import start_time

        start = start_time(sleeper.pid)
        assert start is not None
        owner = f"{socket.gethostname()}:{sleeper.pid}-t{start}:alive"
        s = db(store)
        s.ensure_rollout(RolloutRecord(rollout_id="r/a/0", run_id="r", max_attempts=1))
        s.advance_rollout("r/a/0", expect="pending", state="starting_env", controller=owner)
        with pytest.raises(ControllerConflictError, match=f"pid {sleeper.pid}"):
            async with Controller(store, InProcessBackend(), ScriptHarness(), run_id="r"):
                pass
        assert s.get_rollout("r/a/0").state == "starting_env"  # left alone
        # The same pid, started at another time: a later process that got a dead
        # controller's pid. Not the owner: the run is recovered.
        reused = f"{socket.gethostname()}:{sleeper.pid}-t{start + 1}:gone"
        s.ensure_rollout(RolloutRecord(rollout_id="r/b/0", run_id="r2", max_attempts=1))
        s.advance_rollout("r/b/0", expect="pending", state="starting_env", controller=reused)
        async with Controller(store, InProcessBackend(), ScriptHarness(), run_id="r2"):
            pass
        assert s.get_rollout("r/b/0").state != "starting_env"  # taken back
    finally:
        sleeper.kill()
        await sleeper.wait()


async def test_environment_process_killed_mid_step_is_retried(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    marker = tmp_path / "killed-once"
    tasks = [task("dies-once", [f"die_once:{marker}", "after"]), task("fine", ["hi"])]
    # A server process's reply can take 0.4 s on a loaded machine: FAST's hang watchdog
    # would retry that call too. The death is seen as a dropped connection, not a hang.
    config = ControllerConfig(concurrency=2, max_attempts=3, **{**FAST, "hang_timeout_s": 10.0})
    async with LocalProcessBackend(tmp_path / "instances", cwd=ROOT) as backend:
        ctl = Controller(store, backend, ScriptHarness(), config, run_id="r")
        summary = await ctl.run([RolloutSpec(t) for t in tasks])
    assert (summary.succeeded, summary.failed, summary.retried) == (2, 0, 1)
    first, second = db(store).attempts(rollout_id="r/dies-once/0")
    assert (first.state, first.error_kind) == ("failed", "infrastructure")
    assert second.state == "succeeded"
    assert first.instance_id != second.instance_id
    assert list((tmp_path / "instances").iterdir()) == []  # every server stopped


async def test_a_sandbox_failure_across_the_wire_is_classified_and_retried(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    marker = tmp_path / "sandbox-once"
    tasks = [task("sandbox-once", [f"sandbox_once:{marker}", "after"])]
    # (not FAST's 0.4 s hang watchdog: a server process's slow reply would be retried too)
    config = ControllerConfig(max_attempts=3, **{**FAST, "hang_timeout_s": 10.0})
    async with LocalProcessBackend(tmp_path / "instances", cwd=ROOT) as backend:
        ctl = Controller(store, backend, ScriptHarness(), config, run_id="r")
        summary = await ctl.run([RolloutSpec(t) for t in tasks])
    assert (summary.succeeded, summary.failed, summary.retried) == (1, 0, 1)
    first, second = db(store).attempts(rollout_id="r/sandbox-once/0")
    assert (first.state, first.error_kind, second.state) == ("failed", "sandbox", "succeeded")
    assert "shell died" in (first.error_message or "")
    assert first.instance_id != second.instance_id  # retried on a fresh instance


@pytest.mark.parametrize("backend_name", ["inprocess", "local"])
async def test_an_environment_no_server_can_build_fails_once_as_the_environment_s(
    store: AsyncTraceStore, tmp_path: Path, backend_name: str
) -> None:
    """An unknown id, or a class that does not import: the same one-line environment
    error on every backend, and not retried (a retry would only start a server again)."""
    tasks = [
        Task(id="unknown", prompt="go", env_id="nope-v1"),
        Task(id="no-module", prompt="go", env_id="tests.support.no_such_module:Env"),
    ]
    config = ControllerConfig(max_attempts=3, **FAST)
    async with (
        InProcessBackend()
        if backend_name == "inprocess"
        else LocalProcessBackend(tmp_path / "instances", cwd=ROOT)
    ) as backend:
        ctl = Controller(store, backend, ScriptHarness(), config, run_id="r")
        summary = await ctl.run([RolloutSpec(t) for t in tasks])
    assert (summary.failed, summary.retried, summary.attempts) == (2, 0, 2)
    assert summary.errors_by_kind == {"environment": 2}
    for t in tasks:
        (trace,) = await store.query(rollout_id=f"r/{t.id}/0")
        (error,) = trace.errors
        assert (error.kind.value, error.where) == ("environment", "env_start")
        cause = "Unknown environment" if t.id == "unknown" else "Cannot load environment"
        assert error.message.startswith(f"{cause} {t.env_id!r}")
        assert "\n" not in error.message


async def test_a_call_the_server_cut_at_its_deadline_is_a_hang_and_retried(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    """A server's own call deadline (``--call-timeout``, 30 s by default, shorter than
    the hang watchdog's 60) ends a hung step with TIMEOUT: that is the environment
    hanging (infrastructure, retried), not its answer (``environment``, never retried),
    and the trace says what timed out, not "agent exceeded its deadline"."""
    marker = tmp_path / "hang-once"
    config = ControllerConfig(max_attempts=2, **{**FAST, "hang_timeout_s": 5.0})
    with run_env_server(FaultyEnv, ServerConfig(call_timeout_s=0.5), mcp=False) as (url, _):
        backend = InProcessBackend(urls={FAULTY: url})
        ctl = Controller(store, backend, ScriptHarness(), config, run_id="r")
        summary = await ctl.run([RolloutSpec(task("t", [f"hang_once:{marker}", "after"]))])
    assert (summary.succeeded, summary.retried) == (1, 1)
    first, second = db(store).attempts(rollout_id="r/t/0")
    assert (first.error_kind, second.state) == ("infrastructure", "succeeded")
    assert "did not finish within 0.5 s" in (first.error_message or "")


def test_classify_tells_sandbox_failures_from_bad_requests() -> None:
    from envport.errors import from_wire
    from envport.rollout.controller import classify
    from envport.sandbox import SandboxError, SandboxFailure, SandboxPathError
    from envport.trace import ErrorKind

    assert classify(SandboxFailure("bwrap could not start"), "env_start") is ErrorKind.SANDBOX
    remote = from_wire(SandboxFailure("shell died").to_wire())
    assert classify(remote, "agent") is ErrorKind.SANDBOX
    # the agent's own mistakes inside a sandbox are the environment's answer, not retried
    assert classify(SandboxPathError("outside the workspace"), "agent") is ErrorKind.ENVIRONMENT
    assert classify(SandboxError("not a regular file"), "agent") is ErrorKind.ENVIRONMENT
    assert ErrorKind.SANDBOX in ControllerConfig().retry_on


def test_a_dead_environment_while_scoring_is_infrastructure_and_retried() -> None:
    from envport.errors import (
        ConnectionLostError,
        EnvExecutionError,
        EnvTimeoutError,
        NoReplyError,
    )
    from envport.rollout.backends import BackendError
    from envport.rollout.controller import classify
    from envport.trace import ErrorKind

    lost = ConnectionLostError("the environment's connection dropped")
    assert classify(lost, "scoring") is ErrorKind.INFRASTRUCTURE
    assert classify(BackendError("instance gone"), "scoring") is ErrorKind.INFRASTRUCTURE
    assert classify(NoReplyError("No reply within 60 s"), "agent") is ErrorKind.INFRASTRUCTURE
    assert classify(EnvTimeoutError("step ran past 60 s"), "agent") is ErrorKind.INFRASTRUCTURE
    assert ErrorKind.INFRASTRUCTURE in ControllerConfig().retry_on
    # what the rubric itself raises stays the rubric's
    assert classify(EnvExecutionError("test command failed"), "scoring") is ErrorKind.RUBRIC
    assert classify(ValueError("bad rubric"), "scoring") is ErrorKind.RUBRIC


class GatedHarness(ScriptHarness):
    """Rollouts of ``FAULTY`` wait until a rollout of another type has started."""

    def __init__(self) -> None:
        super().__init__()
        self.other_started = asyncio.Event()

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        if task.env_id != FAULTY:
            self.other_started.set()
            await env.reset()
            return
        await asyncio.wait_for(self.other_started.wait(), 10)
        await super().run(task, env, trace)


async def test_rollouts_waiting_for_a_busy_type_hold_no_global_slot(
    store: AsyncTraceStore,
) -> None:
    """Global concurrency 3, one FAULTY at a time: the two FAULTY rollouts waiting for
    their type leave the other global slots to the echo rollout queued behind them (held
    by them, the first FAULTY rollout would wait for the echo one forever)."""
    config = ControllerConfig(concurrency=3, env_concurrency={FAULTY: 1}, **FAST)
    specs = [RolloutSpec(task(f"f{i}", ["hi"])) for i in range(3)]
    specs.append(RolloutSpec(Task(id="echo", prompt="go", env_id="echo-v1")))
    harness = GatedHarness()
    ctl = Controller(store, InProcessBackend(), harness, config, run_id="r")
    summary = await asyncio.wait_for(ctl.run(specs), 60)
    assert summary.succeeded == 4
    assert harness.peak == 1  # FAULTY's own limit still holds


class UnstoppableBackend(InProcessBackend):
    """Instances whose stop always fails, and whose health check raises."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_calls = 0

    async def stop(self, instance: EnvInstance) -> None:
        self.stop_calls += 1
        await super().stop(instance)
        raise RuntimeError("the backend's API is down")

    async def healthy(self, instance: EnvInstance) -> bool:
        raise RuntimeError("the backend's API is down")


async def test_a_backend_failing_to_stop_or_check_instances_fails_no_rollout(
    store: AsyncTraceStore,
) -> None:
    """Retired instances that cannot be stopped, and health checks that raise, are
    logged and counted: they run in the pool's maintainer, inside the controller's task
    group, and must not cancel the rollouts beside them."""
    backend = UnstoppableBackend()
    config = ControllerConfig(concurrency=2, max_episodes=1, **FAST)
    ctl = Controller(store, backend, ScriptHarness(), config, run_id="r")
    async with ctl:
        summary = await asyncio.wait_for(
            ctl.run([RolloutSpec(task(f"t{i}", ["a", "b"])) for i in range(6)]), 60
        )
        stats = ctl.pools()[FAULTY].stats()
    assert summary.succeeded == 6
    assert backend.stop_calls >= 1
    assert stats.stop_failures >= 1


@pytest.mark.timeout(150)
async def test_cancellation_leaves_no_process_and_resume_finishes(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    state_dir = tmp_path / "instances"
    specs = [RolloutSpec(task(f"t{i}", ["hi"]), harness=StuckHarness()) for i in range(2)]
    running: list[str] = []
    both_running = asyncio.Event()

    def seen(event: RolloutEvent) -> None:
        if event.state is RolloutState.RUNNING:
            running.append(event.rollout_id)
            if len(running) == 2:
                both_running.set()

    config = ControllerConfig(concurrency=2, sessions_per_instance=2, hang_timeout_s=None)
    async with LocalProcessBackend(state_dir, cwd=ROOT) as backend:
        ctl = Controller(store, backend, None, config, run_id="r", on_event=seen)
        job = asyncio.create_task(ctl.run(specs))
        await asyncio.wait_for(both_running.wait(), 60)
        pids = [i.meta["pid"] for i in await backend.list()]
        assert len(pids) == 1  # one server hosts both sessions
        job.cancel()  # Ctrl-C
        with pytest.raises(asyncio.CancelledError):
            await job
        assert await backend.list() == []
    assert not any(_is_envport(pid) for pid in pids)
    assert list(state_dir.iterdir()) == []
    s = db(store)
    # Requeued on the way out (best effort: one whose write did not land before the
    # cancellation finished is requeued by the next controller as a restart).
    assert {r.state for r in s.rollouts(run_id="r")} <= {"pending", "running"}
    assert ("abandoned", "cancelled") in {(a.state, a.reason) for a in s.attempts(run_id="r")}
    # The same run, resumed with a working harness: each rollout once.
    ok = [RolloutSpec(sp.task) for sp in specs]
    summary = await Controller(store, InProcessBackend(), ScriptHarness(), run_id="r").run(ok)
    assert summary.succeeded == 2
    assert len(await store.query(run_id="r")) == 2


async def test_controllers_of_one_run_side_by_side_in_one_process(store: AsyncTraceStore) -> None:
    """Per-rollout controllers (as `Evaluator.run_one` makes them) never requeue each
    other's rollouts."""

    async def one(name: str) -> None:
        ctl = Controller(store, InProcessBackend(), ScriptHarness(), run_id="r")
        summary = await ctl.run([RolloutSpec(task(name, ["sleep:0.05", "hi"]))])
        assert summary.succeeded == 1

    async with asyncio.TaskGroup() as tg:
        for i in range(4):
            tg.create_task(one(f"t{i}"))
    assert {r.state for r in db(store).rollouts(run_id="r")} == {"succeeded"}
    assert {a.state for a in db(store).attempts(run_id="r")} == {"succeeded"}


async def test_a_group_is_part_of_a_rollout_s_identity(store: AsyncTraceStore) -> None:
    """A trainer's GRPO group of a task already run: fresh rollouts, all of its group, not
    the earlier ones under their old group id; the same group again is the same rollouts."""
    harness = ScriptHarness()
    t = task("t", ["hi"])
    config = ControllerConfig(**FAST)
    async with Controller(store, InProcessBackend(), harness, config, run_id="r") as ctl:
        earlier = await ctl.run([RolloutSpec(t, k) for k in range(4)])
        group = await ctl.collect([RolloutSpec(t, k, group_id="step7/g0") for k in range(8)])
        same = await ctl.collect([RolloutSpec(t, k, group_id="step7/g0") for k in range(8)])
        default = await ctl.collect([RolloutSpec(t, 0, group_id="r/t")])  # the run's own
    assert earlier.succeeded == 4
    assert {r.trace.group_id for r in group} == {"step7/g0"}
    assert [r.rollout_id for r in group] == [f"r/t/{k}@step7/g0" for k in range(8)]
    assert not any(r.skipped for r in group)  # run, not the earlier rollouts returned
    assert [r.trace.trace_id for r in same] == [r.trace.trace_id for r in group]
    assert default[0].rollout_id == "r/t/0"
    traces = await store.query(run_id="r", limit=None)
    assert len(traces) == 12  # 4 + 8, each once
    by_group = {g: sum(tr.group_id == g for tr in traces) for g in ("r/t", "step7/g0")}
    assert by_group == {"r/t": 4, "step7/g0": 8}
    # Resumed by a new controller, the group's rollouts are found, not run again.
    again = Controller(store, InProcessBackend(), harness, config, run_id="r")
    async with again:
        resumed = await again.collect([RolloutSpec(t, k, group_id="step7/g0") for k in range(8)])
    assert all(r.skipped for r in resumed)
    assert [r.trace.trace_id for r in resumed] == [r.trace.trace_id for r in group]
    assert len(await store.query(run_id="r", limit=None)) == 12


async def test_a_task_id_with_at_signs_never_spells_another_rollout_s_id(
    store: AsyncTraceStore,
) -> None:
    """Task ``t/0@g`` (rollout 5) and task ``t`` (rollout 0, group ``g/5``) would both
    read ``r/t/0@g/5`` unescaped: the second found the first's trace and never ran."""
    harness = ScriptHarness()
    config = ControllerConfig(**FAST)
    async with Controller(store, InProcessBackend(), harness, config, run_id="r") as ctl:
        first = await ctl.collect([RolloutSpec(task("t/0@g", ["hi"]), 5)])
        second = await ctl.collect([RolloutSpec(task("t", ["hi"]), 0, group_id="g/5")])
    assert first[0].rollout_id == "r/t/0%40g/5"
    assert second[0].rollout_id == "r/t/0@g/5"
    assert not second[0].skipped
    traces = await store.query(run_id="r", limit=None)
    assert sorted(tr.task_id for tr in traces) == ["t", "t/0@g"]  # task ids as given


class RecordingBackend(InProcessBackend):
    """In-process instances, remembering every launch the controller asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[EnvLaunch] = []

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        self.launches.append(launch)
        return await super().start(launch)


async def test_env_type_limits_and_task_resources_reach_the_backend(
    store: AsyncTraceStore,
) -> None:
    backend = RecordingBackend()
    config = ControllerConfig(env_limits={FAULTY: Limits(pids=64, memory_mb=256)}, **FAST)
    plain = task("plain", ["hi"])
    big = task("big", ["hi"], resources=Resources(memory_mb=1024, cpus=2, storage_mb=100))
    summary = await Controller(store, backend, ScriptHarness(), config, run_id="r").run(
        [RolloutSpec(plain), RolloutSpec(big)]
    )
    assert summary.succeeded == 2
    limits = sorted((launch.limits for launch in backend.launches), key=lambda x: x.memory_mb or 0)
    # The env type's limits, and the task's resources on top of them, field by field.
    assert limits == [
        Limits(pids=64, memory_mb=256),
        Limits(pids=64, memory_mb=1024, cpus=2, disk_mb=100),
    ]


async def test_a_task_s_env_start_deadline_is_its_instance_s_start_deadline(
    store: AsyncTraceStore,
) -> None:
    """A task that declares a longer ``env_start`` gets it for the instance's start too,
    not only for its lease (the backend timed the start out at the config's default)."""
    backend = RecordingBackend()
    config = ControllerConfig(env_start_timeout_s=5, **FAST)
    slow = task("slow", ["hi"], resources=Resources(timeouts={"env_start": 90}))
    summary = await Controller(store, backend, ScriptHarness(), config, run_id="r").run(
        [RolloutSpec(task("plain", ["hi"])), RolloutSpec(slow)]
    )
    assert summary.succeeded == 2
    assert sorted(launch.start_timeout_s for launch in backend.launches) == [5, 90]


async def test_env_start_is_one_deadline_for_the_lease_and_the_session_s_opening(
    store: AsyncTraceStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.6 s to start and 0.6 s to open is past a 1 s ``env_start``: each part had the
    whole second to itself before."""
    from envport.client import transports

    class SlowStart(InProcessBackend):
        async def start(self, launch: EnvLaunch) -> EnvInstance:
            await asyncio.sleep(0.6)
            return await super().start(launch)

    opened = transports.InProcessTransport.open

    async def slow_open(self: transports.InProcessTransport) -> None:
        await asyncio.sleep(0.6)
        await opened(self)

    monkeypatch.setattr(transports.InProcessTransport, "open", slow_open)
    config = ControllerConfig(max_attempts=1, **FAST)
    late = task("late", ["hi"], resources=Resources(timeouts={"env_start": 1.0}))
    summary = await Controller(store, SlowStart(), ScriptHarness(), config, run_id="r").run(
        [RolloutSpec(late)]
    )
    assert summary.failed == 1
    (trace,) = await store.query(run_id="r")
    assert trace.errors[0].where == "env_start"
    assert trace.stop_reason == "timeout"


async def test_an_os_error_starting_an_instance_is_retried_as_infrastructure(
    store: AsyncTraceStore,
) -> None:
    """The machine running out of descriptors (or a refused connection) while an instance
    starts is the infrastructure's: the rollout was failed as the harness's, not retried."""

    class OutOfFds(InProcessBackend):
        failed = False

        async def start(self, launch: EnvLaunch) -> EnvInstance:
            if not self.failed:
                self.failed = True
                raise OSError(errno.EMFILE, "Too many open files")
            return await super().start(launch)

    config = ControllerConfig(max_attempts=2, **FAST)
    summary = await Controller(store, OutOfFds(), ScriptHarness(), config, run_id="r").run(
        [RolloutSpec(task("t", ["hi"]))]
    )
    assert summary.succeeded == 1
    assert summary.retried == 1


async def test_two_different_tasks_with_one_id_are_refused_before_either_runs(
    store: AsyncTraceStore,
) -> None:
    """Rollout ids are ``run/task/k``: the second task ``q`` was answered with the
    first's result and never ran, and nothing said so."""
    harness = ScriptHarness()
    first, other = task("q", ["one"]), task("q", ["two"])
    config = ControllerConfig(**FAST)
    async with Controller(store, InProcessBackend(), harness, config, run_id="r") as ctl:
        with pytest.raises(EnvportError, match="two different tasks share the id 'q'"):
            ctl.submit([RolloutSpec(first), RolloutSpec(other)])
        assert await store.query(run_id="r") == []  # nothing started
        (done,) = await ctl.collect([RolloutSpec(first)])
        again = await ctl.collect([RolloutSpec(first), RolloutSpec(first, 1)])  # same task: fine
        with pytest.raises(EnvportError, match="share the id"):
            ctl.submit([RolloutSpec(other)])  # against one already submitted
    assert done.succeeded
    assert again[0].trace.trace_id == done.trace.trace_id


async def test_a_task_whose_rubric_cannot_be_built_never_runs_its_agent(
    store: AsyncTraceStore,
) -> None:
    """A misspelt rubric parameter failed only after the agent's whole run (its model
    calls spent); now the rollout fails at once as the task's error, not retried."""
    harness = ScriptHarness()
    typo = task("typo", ["hi"], rubric=[{"type": "numeric_match", "abs_tolerance": 0.5}])
    config = ControllerConfig(max_attempts=3, **FAST)
    summary = await Controller(store, InProcessBackend(), harness, config, run_id="r").run(
        [RolloutSpec(typo)]
    )
    assert (summary.failed, summary.attempts, harness.peak) == (1, 1, 0)  # agent never ran
    (trace,) = await store.query(run_id="r")
    assert trace.errors[0].kind.value == "task"
    assert "task 'typo': rubric[0]" in trace.errors[0].message
    assert "abs_tolerance" in trace.errors[0].message


async def test_a_rubric_of_metrics_only_completes_unscored_with_its_metrics(
    store: AsyncTraceStore,
) -> None:
    """Every weight 0: no total to make, so the rollout completes unscored (as a task
    with no rubric); it was failed, with no error recorded."""
    metrics = task("m", ["42"], rubric=[{"type": "regex", "pattern": "x", "weight": 0}])
    config = ControllerConfig(**FAST)
    summary = await Controller(store, InProcessBackend(), ScriptHarness(), config, run_id="r").run(
        [RolloutSpec(metrics)]
    )
    assert summary.succeeded == 1
    (trace,) = await store.query(run_id="r")
    assert (trace.status, trace.reward, trace.errors) == (TraceStatus.COMPLETED, None, [])
    assert "regex" in trace.metrics


async def test_a_controller_entered_again_asks_the_store_not_its_old_tasks(
    store: AsyncTraceStore,
) -> None:
    ctl = Controller(
        store, InProcessBackend(), ScriptHarness(), ControllerConfig(**FAST), run_id="r"
    )
    spec = RolloutSpec(task("t", ["hi"]))
    async with ctl:
        (first,) = await ctl.collect([spec])
    async with ctl:
        (again,) = await ctl.collect([spec])
    assert not first.skipped
    assert first.succeeded
    assert again.skipped
    assert again.trace.trace_id == first.trace.trace_id
    assert len(await store.query(run_id="r")) == 1


async def test_exit_waits_for_no_pool_woken_as_it_is_cancelled(store: AsyncTraceStore) -> None:
    """Ctrl-C never hangs on a pool maintainer that is woken (an instance handed back, a
    lease ended) just as the controller cancels it: on Python 3.11 ``asyncio.wait_for``
    drops a cancellation that lands as its awaitable completes, so the maintainer would
    keep running and the controller's task group would wait for it forever."""
    async with Controller(store, InProcessBackend(), ScriptHarness(), run_id="r") as ctl:
        summary = await ctl.run([RolloutSpec(task("t", ["hi"]))])
        pool = ctl.pools()[FAULTY]
        for _ in range(5):
            await asyncio.sleep(0)  # the maintainer settles into its wait
        pool.adopt([])  # wakes it; it is cancelled (controller exit) before it runs
        await asyncio.sleep(0)
    assert summary.succeeded == 1
    assert pool.stats().instances == 0  # closed on the way out


class _FailingSandbox:
    """Stands in for a live sandbox whose shell died, or that refuses a request."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def exec(self, command: str, timeout_s: float | None, *, fresh_shell: bool) -> Any:
        raise self.exc

    async def snapshot(self) -> Any:
        raise self.exc


@pytest.mark.parametrize("dead", [True, False], ids=["sandbox-failed", "request-refused"])
async def test_sandbox_v1_keeps_a_sandbox_failure_a_sandbox_failure(dead: bool) -> None:
    """sandbox-v1 wraps the sandbox's errors for the agent; a failure of the sandbox itself
    keeps its ``failure: sandbox`` detail, so the controller retries it on a fresh one."""
    from envport.envs.sandbox_env import SandboxEnv
    from envport.errors import EnvportError, from_wire
    from envport.rollout.controller import classify
    from envport.sandbox import SandboxError, SandboxFailure
    from envport.trace import ErrorKind

    env = SandboxEnv()
    env.sandbox = _FailingSandbox(  # type: ignore[assignment]
        SandboxFailure("the shell died") if dead else SandboxError("not a regular file")
    )
    for call in (env._run("true", None), env.snapshot()):
        with pytest.raises(EnvportError) as info:
            await call
        remote = from_wire(info.value.to_wire())  # as a controller over a connection sees it
        kind = classify(remote, "agent")
        assert kind is (ErrorKind.SANDBOX if dead else ErrorKind.ENVIRONMENT)


async def test_a_scoring_past_its_deadline_fails_as_the_rubric_s_and_is_not_retried(
    store: AsyncTraceStore,
) -> None:
    """Scoring runs under its own deadline: a rubric still working at it is stopped, the
    run fails as a rubric error (not retried), and the batch goes on."""
    from envport.rubrics import register

    @register("slow_scorer", replace=True)
    def _factory() -> Any:
        async def score() -> float:
            await asyncio.sleep(30)
            return 1.0

        return score

    config = ControllerConfig(scoring_timeout_s=0.5, **FAST)
    slow = task("slow", ["hi"], rubric=[{"type": "slow_scorer"}])
    quick = task("quick", ["hi"])
    ctl = Controller(store, InProcessBackend(), ScriptHarness(), config, run_id="r")
    summary = await asyncio.wait_for(ctl.run([RolloutSpec(slow), RolloutSpec(quick)]), 30)
    assert (summary.succeeded, summary.failed) == (1, 1)
    (trace,) = await store.query(run_id="r", task_id="slow")
    assert trace.errors[0].kind.value == "rubric"
    assert "scoring exceeded its deadline" in trace.errors[0].message
    assert trace.reward is None
    assert db(store).get_rollout("r/slow/0").attempts == 1  # a rubric error: not retried


def test_limits_labels_round_trip_and_are_kubernetes_label_values() -> None:
    import re

    from envport.rollout.controller import limits_label, parse_limits_label

    for limits in (
        Limits(),
        Limits(cpus=0.5),
        Limits(cpus=2, memory_mb=1024, pids=64, disk_mb=100),
        Limits(memory_mb=256),
        Limits(disk_mb=1234567),  # no rounding, no exponent
        Limits(cpus=1e-05),
    ):
        label = limits_label(limits)
        assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", label), label
        assert parse_limits_label(label) == limits
    assert parse_limits_label("") is None
    assert parse_limits_label("x9") is None


async def test_a_restarted_controller_puts_adopted_instances_back_in_their_limits_pool(
    store: AsyncTraceStore,
) -> None:
    """Instances a previous controller of the run started for a task with its own
    resources are adopted into that shape's pool, not the env type's default one."""
    from envport.rollout.controller import LIMITS_LABEL, RUN_LABEL, limits_label

    backend = InProcessBackend()
    big = Limits(pids=64, memory_mb=1024)
    labels = {RUN_LABEL: "r", LIMITS_LABEL: limits_label(big)}
    left = await backend.start(EnvLaunch(env_id=FAULTY, labels=labels, limits=big))
    plain = await backend.start(EnvLaunch(env_id=FAULTY, labels={RUN_LABEL: "r"}))
    config = ControllerConfig(env_limits={FAULTY: Limits(pids=64)}, **FAST)
    task_big = task("big", ["hi"], resources=Resources(memory_mb=1024))
    async with Controller(store, backend, ScriptHarness(), config, run_id="r") as ctl:
        assert ctl.adopted == 2
        pools = ctl.pools()
        shaped = ctl._pool(FAULTY, task_big)
        assert shaped.launch.limits == big
        assert shaped.stats().instances == 1
        assert left.instance_id in shaped._slots
        assert plain.instance_id in pools[FAULTY]._slots  # no label: the default pool
        (result,) = await ctl.collect([RolloutSpec(task_big)])
        assert result.trace.metadata["instance_id"] == left.instance_id  # reused


def test_rollout_ids_with_slashes_in_tasks_and_groups_never_meet() -> None:
    from envport.rollout.controller import rollout_id

    ids = {
        rollout_id("r", Task(id="g0/t", prompt="p"), 0, "step1"),
        rollout_id("r", Task(id="t", prompt="p"), 0, "step1/g0"),
        rollout_id("r", Task(id="gsm8k/12", prompt="p"), 0),
        rollout_id("r", Task(id="12", prompt="p"), 0, "gsm8k"),
        rollout_id("r", Task(id="12", prompt="p"), 0),
    }
    assert len(ids) == 5


class ResetHarness:
    """Resets the environment (with the task's options) and stops: the rubric does the
    rest."""

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        from envport.harness.agent import reset_options

        await env.reset(**reset_options(task))


def _shell_task(
    task_id: str, command: str, *, timeout_s: float | None = None, **extra: Any
) -> Task:
    params: dict[str, Any] = {"command": command}
    if timeout_s is not None:
        params["timeout_s"] = timeout_s
    rubric = [{"type": "test_command", "params": params}]
    return Task(id=task_id, prompt="go", env_id="shell-v1", rubric=rubric, **extra)


SHELL = {"env_options": {"shell-v1": {"allow_unisolated": True}}, **FAST}


async def test_a_test_command_past_its_own_timeout_fails_with_its_own_error(
    store: AsyncTraceStore,
) -> None:
    """The command's own timeout fires, not the scoring stage's deadline (shorter here):
    the error names the command, its timeout and its output so far."""
    config = ControllerConfig(scoring_timeout_s=0.5, **SHELL)
    own = _shell_task("own", "echo started; sleep 30", timeout_s=1.0)
    ctl = Controller(store, InProcessBackend(), ResetHarness(), config, run_id="r")
    summary = await asyncio.wait_for(ctl.run([RolloutSpec(own)]), 60)
    assert summary.failed == 1
    (trace,) = await store.query(run_id="r")
    (error,) = trace.errors
    assert error.kind.value == "rubric"
    assert "ran past its 1 s timeout" in error.message
    assert "started" in error.message  # its output so far
    assert "exceeded its deadline" not in error.message


async def test_a_test_command_without_a_timeout_ends_inside_the_scoring_deadline(
    store: AsyncTraceStore,
) -> None:
    """No timeout declared anywhere: the command gets the stage's time left less a grace,
    so it is still its own timeout that fires."""
    config = ControllerConfig(scoring_timeout_s=4.0, **SHELL)
    ctl = Controller(store, InProcessBackend(), ResetHarness(), config, run_id="r")
    await asyncio.wait_for(ctl.run([RolloutSpec(_shell_task("t", "sleep 30"))]), 60)
    (trace,) = await store.query(run_id="r")
    (error,) = trace.errors
    assert "ran past its" in error.message
    assert "exceeded its deadline" not in error.message


async def test_a_verifier_timeout_longer_than_the_stage_default_is_honoured(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    """A task's scoring timeout (a Harbor verifier's timeout_sec) longer than the scoring
    stage's default: the verifier may use all of it, and past it fails with its own
    error."""
    from envport.tasks import load_harbor

    config = ControllerConfig(scoring_timeout_s=0.5, **SHELL)
    tasks = []
    for name, sleep in (("fits", 1.5), ("overruns", 30)):
        root = _harbor_dir(tmp_path / name, sleep)
        (task_,) = load_harbor(root)
        assert task_.resources.timeouts.scoring == 3.0
        tasks.append(task_)
    ctl = Controller(store, InProcessBackend(), ResetHarness(), config, run_id="r")
    await asyncio.wait_for(ctl.run([RolloutSpec(t) for t in tasks]), 60)
    (fits,) = await store.query(run_id="r", task_id="fits")
    assert fits.errors == []
    assert fits.reward == 1.0
    (overruns,) = await store.query(run_id="r", task_id="overruns")
    (error,) = overruns.errors
    assert "ran past its 3 s timeout" in error.message


def _harbor_dir(task: Path, sleep: float) -> Path:
    """A Harbor task whose verifier (timeout_sec 3) sleeps ``sleep`` s, then passes."""
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "task.toml").write_text('version = "1.0"\n\n[verifier]\ntimeout_sec = 3.0\n')
    (task / "environment" / "Dockerfile").write_text("FROM python:3.13-slim\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text(
        f"#!/bin/bash\nsleep {sleep}\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
    )
    return task


def _harbor_task(root: Path, name: str) -> Task:
    from envport.tasks import read_harbor_task

    (root / name / "tests").mkdir(parents=True)
    (root / name / "environment").mkdir()
    (root / name / "environment" / "given.txt").write_text(f"{name}\n")
    (root / name / "instruction.md").write_text("look\n")
    (root / name / "task.toml").write_text('version = "1.0"\n')
    (root / name / "tests" / "test.sh").write_text("#!/bin/bash\n")
    return read_harbor_task(root / name)


class ReadingHarness:
    """Resets with the task's own options (its task_dir), then reads what it was given."""

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        from envport.harness.agent import reset_options

        await env.reset(**reset_options(task))
        result = await env.step({"command": "cat given.txt"})
        trace.steps.append(StepRecord(index=0, action={}, observation=result.observation))


async def test_harbor_tasks_of_one_dataset_share_one_granted_pool_across_batches(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    """shell-v1 refuses a task_dir outside the folders its instances were granted; the
    controller grants the folder holding its tasks' directories, so batch after batch of
    one dataset run in one warm pool (not a new pool per batch's new directories)."""
    dataset = tmp_path / "dataset"
    first, second = _harbor_task(dataset, "a"), _harbor_task(dataset, "b")
    config = ControllerConfig(concurrency=1, **{**FAST, "hang_timeout_s": 30})
    async with Controller(store, InProcessBackend(), ReadingHarness(), config, run_id="h") as ctl:
        for one in (first, second):
            (result,) = await ctl.collect([RolloutSpec(one, 0)])
            assert result.succeeded, result.trace.errors
            assert one.id.rsplit("/", 1)[-1] in str(result.trace.steps[0].observation)
        assert len([key for key in ctl._pools if key.startswith("shell-v1")]) == 1


class UnstorableHarness(ScriptHarness):
    """Runs its script, then leaves on the trace what the store cannot write: a value that
    is not JSON in the metadata (task ``bad-object``) or a NaN reward (``bad-nan``)."""

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        await super().run(task, env, trace)
        mark = task.id.removeprefix("bad-")
        if mark == "object":
            trace.metadata["score_obj"] = object()
        elif mark == "nan":
            trace.reward = float("nan")


async def test_a_trace_the_store_cannot_write_fails_its_rollout_only(
    store: AsyncTraceStore,
) -> None:
    """A harness that leaves something unstorable on its trace fails that rollout, as the
    harness's, stored with the value's repr; its siblings run on and the run ends."""
    bad = [task("bad-object", ["hi"]), task("bad-nan", ["hi"])]
    fine = [task(f"ok{i}", ["sleep:0.2", "hi"]) for i in range(3)]
    config = ControllerConfig(**FAST)
    ctl = Controller(store, InProcessBackend(), UnstorableHarness(), config, run_id="u")
    summary = await ctl.run([RolloutSpec(t) for t in [*bad, *fine]])
    assert (summary.rollouts, summary.succeeded, summary.failed, summary.retried) == (5, 3, 2, 0)
    states = {r.rollout_id: r.state for r in db(store).rollouts(run_id="u")}
    assert states == {
        "u/bad-object/0": "failed",
        "u/bad-nan/0": "failed",
        **{f"u/ok{i}/0": "succeeded" for i in range(3)},
    }
    for rid in ("u/bad-object/0", "u/bad-nan/0"):
        (stored,) = await store.query(rollout_id=rid)
        assert (stored.status, stored.reward) == (TraceStatus.FAILED, None)
        assert [(e.kind.value, e.where) for e in stored.errors] == [("harness", "store")]
    (meta,) = await store.query(rollout_id="u/bad-object/0")
    assert meta.metadata["score_obj"].startswith("<object object")


class FirstRunStuckHarness(ScriptHarness):
    """Its first run waits forever (beating, so no hang watchdog cuts it); later runs
    play the script."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        self.runs += 1
        if self.runs == 1:
            await env.reset()
            while True:
                heartbeat()
                await asyncio.sleep(0.05)
        await super().run(task, env, trace)


@pytest.mark.parametrize("wait_for_the_end", [True, False])
async def test_rollouts_whose_wait_was_cancelled_run_again_when_submitted_again(
    store: AsyncTraceStore, wait_for_the_end: bool
) -> None:
    """A trainer's wait_for around collect() cancels the rollouts it gathers; collecting
    them again on the same controller runs them (once), not their old CancelledError."""
    specs = [RolloutSpec(task("t", ["hi"]))]
    harness = FirstRunStuckHarness()
    running = asyncio.Event()

    def seen(event: RolloutEvent) -> None:
        if event.state is RolloutState.RUNNING:
            running.set()

    config = ControllerConfig(**FAST)
    async with Controller(
        store, InProcessBackend(), harness, config, run_id="c", on_event=seen
    ) as ctl:
        waiting = asyncio.ensure_future(ctl.collect(specs))
        await asyncio.wait_for(running.wait(), 30)
        waiting.cancel()
        if wait_for_the_end:
            with pytest.raises(asyncio.CancelledError):
                await waiting
        (result,) = await ctl.collect(specs)  # else: while the first is still cancelling
        assert result.succeeded, result.trace.errors
        if not wait_for_the_end:
            with pytest.raises(asyncio.CancelledError):
                await waiting
    assert [(a.state, a.reason) for a in db(store).attempts(rollout_id="c/t/0")] == [
        ("abandoned", "cancelled"),
        ("succeeded", None),
    ]
    assert db(store).get_rollout("c/t/0").state == "succeeded"
    assert len(await store.query(rollout_id="c/t/0")) == 1


class HeldHarness(ScriptHarness):
    """Resets, then beats until ``release`` is set (``started`` says it got there), then
    steps: a rollout in use for as long as the test likes."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        await env.reset()
        self.started.set()
        while not self.release.is_set():
            heartbeat()
            await asyncio.sleep(0.05)
        await env.step({"message": "after"})


async def test_a_controller_of_the_same_run_leaves_a_live_one_s_instances_alone(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    """Two controllers of one run in one process (Evaluator.run_one with a shared
    backend): the second re-adopts none of the first's instances, so its exit stops none
    of them under the first's rollout."""
    config = ControllerConfig(**{**FAST, "hang_timeout_s": 10.0})
    held = HeldHarness()
    async with LocalProcessBackend(tmp_path / "instances", cwd=ROOT) as backend:
        async with Controller(store, backend, held, config, run_id="s") as first:
            (running,) = first.submit([RolloutSpec(task("held", ["hi"]))])
            await asyncio.wait_for(held.started.wait(), 60)
            second = Controller(store, backend, ScriptHarness(), config, run_id="s")
            summary = await second.run([RolloutSpec(task("quick", ["hi"]))])
            assert (summary.succeeded, summary.adopted) == (1, 0)
            held.release.set()
            result = await running
        assert result.succeeded, result.trace.errors
        assert result.attempts == 1
        assert [a.state for a in db(store).attempts(rollout_id="s/held/0")] == ["succeeded"]
    assert list((tmp_path / "instances").iterdir()) == []
