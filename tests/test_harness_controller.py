"""A CLI agent (SubprocessHarness) as the rollout controller's harness: its output lines
are heartbeats, a silent one is cut, its process tree never outlives the attempt."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from envport.deadlines import stage_deadline
from envport.harness.subprocess import ModelEndpoint, SubprocessHarness
from envport.rollout import Controller, ControllerConfig, InProcessBackend, RolloutSpec
from envport.rollout.controller import Harness
from envport.tasks import Resources, Task, Timeouts
from envport.trace import AsyncTraceStore, SQLiteTraceStore, Trace, TraceStatus
from tests.support.processes import alive

#: Records its pid and a child's, prints ``lines`` progress lines ``every`` seconds
#: apart, then exits 0, exits 3, or hangs silently, as ``then`` says.
AGENT = """
import os, pathlib, subprocess, sys, time
pids, lines, every, then = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
pathlib.Path(pids).write_text(f"{os.getpid()} {child.pid}")
print("base_url", os.environ.get("OPENAI_BASE_URL"), flush=True)
for i in range(lines):
    time.sleep(every)
    print(f"step {i}", file=sys.stderr if i % 2 else sys.stdout, flush=True)
if then == "crash":
    sys.exit(3)
if then == "hang":
    time.sleep(300)
child.kill()
"""


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[AsyncTraceStore]:
    async with AsyncTraceStore(SQLiteTraceStore(tmp_path / "t.db")) as s:
        yield s


def agent(
    tmp_path: Path, lines: int, every: float, then: str, *, timeout_s: float = 60.0
) -> tuple[SubprocessHarness, Path]:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    pids = tmp_path / f"pids-{then}"
    command = [sys.executable, str(script), str(pids), str(lines), str(every), then]
    return SubprocessHarness(command, name="cli", timeout_s=timeout_s), pids


def pids_of(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


TASK = Task(id="t", prompt="do it", env_id="echo-v1")


async def run_one(
    store: AsyncTraceStore,
    harness: Harness,
    *,
    hang_timeout_s: float,
    agent_timeout_s: float = 300.0,
    task: Task = TASK,
) -> Trace:
    cfg = ControllerConfig(
        max_attempts=2,
        health_interval_s=0.2,
        hang_timeout_s=hang_timeout_s,
        agent_timeout_s=agent_timeout_s,
    )
    ctl = Controller(store, InProcessBackend(), harness, cfg, run_id="r")
    await ctl.run([RolloutSpec(task)])
    (trace,) = await store.query(rollout_id="r/t/0")
    return trace


async def test_output_lines_keep_a_slow_cli_agent_alive(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    # Five quiet stretches of 0.6 s, 3 s in all: far past the 2 s hang timeout, but
    # every stretch ends with a line, so the agent is never taken for hung.
    harness, pids = agent(tmp_path, lines=5, every=0.6, then="exit")
    endpoint = ModelEndpoint(base_url="http://gateway.invalid/rollouts/x/v1", api_key="k")
    trace = await run_one(store, harness.for_controller(endpoint), hang_timeout_s=2.0)
    assert trace.status is TraceStatus.COMPLETED, trace.errors
    record = trace.metadata["harness"]
    assert record["exit_code"] == 0
    assert "base_url http://gateway.invalid/rollouts/x/v1" in record["stdout_tail"]
    assert "step 3" in record["stderr_tail"]
    assert trace.harness == "cli"
    assert not any(alive(pid) for pid in pids_of(pids))


async def test_silent_cli_agent_is_cut_as_hung_and_its_tree_killed(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    harness, pids = agent(tmp_path, lines=1, every=0.0, then="hang")
    trace = await run_one(store, harness.for_controller(), hang_timeout_s=1.0)
    assert trace.status is TraceStatus.FAILED
    assert trace.reward is None
    (error,) = trace.errors
    assert error.kind.value == "harness"
    assert "no heartbeat from the harness" in error.message
    assert trace.stop_reason == "hang"
    assert isinstance(store.store, SQLiteTraceStore)
    (attempt,) = store.store.attempts(rollout_id="r/t/0")  # a harness fault: no retry
    assert attempt.error_kind == "harness"
    leader, child = pids_of(pids)
    assert not alive(leader)
    assert not alive(child)
    # What the agent said before it was cut is on the trace.
    record = trace.metadata["harness"]
    assert (record["cancelled"], record["timed_out"], record["exit_code"]) == (True, False, -9)
    assert record["stdout_tail"] == "base_url None\nstep 0\n"
    assert record["argv"][-1] == "hang"


async def test_cli_agent_deadline_is_a_harness_failure(
    store: AsyncTraceStore, tmp_path: Path
) -> None:
    # Chatty but endless: the harness's own deadline (not hang detection) ends it.
    harness, pids = agent(tmp_path, lines=10_000, every=0.1, then="exit", timeout_s=1.0)
    trace = await run_one(store, harness.for_controller(), hang_timeout_s=5.0)
    assert trace.status is TraceStatus.FAILED
    assert trace.stop_reason == "timeout"
    assert [e.kind.value for e in trace.errors] == ["harness"]
    assert "deadline" in trace.errors[0].message
    assert not any(alive(pid) for pid in pids_of(pids))


async def test_cli_agent_crash_is_a_harness_failure(store: AsyncTraceStore, tmp_path: Path) -> None:
    harness, _ = agent(tmp_path, lines=1, every=0.0, then="crash")
    trace = await run_one(store, harness.for_controller(), hang_timeout_s=5.0)
    assert trace.status is TraceStatus.FAILED
    (error,) = trace.errors
    assert error.kind.value == "harness"
    assert "exited 3" in error.message


async def test_endpoint_is_made_per_rollout(store: AsyncTraceStore, tmp_path: Path) -> None:
    seen: list[str] = []

    async def endpoint_for(task: Task, trace: Trace) -> ModelEndpoint:
        seen.append(trace.rollout_id)
        return ModelEndpoint(
            base_url=f"http://gw.invalid/rollouts/{trace.rollout_id}/v1", api_key="k"
        )

    harness, _ = agent(tmp_path, lines=0, every=0.0, then="exit")
    trace = await run_one(store, harness.for_controller(endpoint_for), hang_timeout_s=5.0)
    assert trace.status is TraceStatus.COMPLETED, trace.errors
    assert seen == ["r/t/0"]
    assert "rollouts/r/t/0/v1" in trace.metadata["harness"]["stdout_tail"]


@pytest.mark.parametrize("known_from", ["controller", "task"])
async def test_harness_deadline_ends_the_agent_before_the_controllers(
    store: AsyncTraceStore, tmp_path: Path, known_from: str
) -> None:
    # Chatty and endless, under a 6 s agent stage and a 60 s harness deadline: the
    # harness stops it 2.5 s before the stage ends (kill grace 0.5 s + 2 s) and records
    # a timeout with its output, instead of being cancelled by the controller.
    harness, pids = agent(tmp_path, lines=10_000, every=0.1, then="exit", timeout_s=60.0)
    harness.kill_grace_s = 0.5
    cli: Harness = harness.for_controller()
    # The stage's end from the controller's own agent stage (stage_deadline), or, without
    # it, from the task's declared agent timeout.
    task = TASK if known_from == "controller" else with_agent_timeout(6.0)
    trace = await run_one(store, cli, hang_timeout_s=30.0, agent_timeout_s=6.0, task=task)
    assert trace.status is TraceStatus.FAILED
    assert trace.stop_reason == "timeout"
    (error,) = trace.errors
    assert (error.kind.value, error.where, error.type) == ("harness", "cli", "Timeout")
    assert "ran past its 3.5 s deadline" in error.message
    record = trace.metadata["harness"]
    assert (record["timed_out"], record["cancelled"], record["exit_code"]) == (True, False, -15)
    assert "step 10" in record["stdout_tail"]
    assert not any(alive(pid) for pid in pids_of(pids))


def with_agent_timeout(seconds: float) -> Task:
    return TASK.model_copy(update={"resources": Resources(timeouts=Timeouts(agent=seconds))})


def test_controller_harness_timeout_fits_inside_the_stage() -> None:
    harness = SubprocessHarness(["agent"], timeout_s=100.0, kill_grace_s=5.0)
    cli = harness.for_controller()
    now = time.monotonic()
    assert cli.timeout_for(TASK, now) == 100.0  # no stage deadline known
    assert cli.timeout_for(with_agent_timeout(500.0), now) == 100.0  # its own is shorter
    assert 42.9 < cli.timeout_for(with_agent_timeout(50.0), now) <= 43.0  # 7 s before
    assert 4.9 < cli.timeout_for(with_agent_timeout(10.0), now) <= 5.0  # at most half
    token = stage_deadline.set(time.monotonic() + 30.0)  # the controller's word wins
    try:
        assert 22.9 < cli.timeout_for(with_agent_timeout(50.0), now) <= 23.0
    finally:
        stage_deadline.reset(token)
