"""`envport run` as a user runs it: a real controller process, SIGKILLed and restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from envport.trace import SQLiteTraceStore, TraceStatus
from envport.train.rows import build_rows
from tests.support.cli import CLI_ENV, ENVPORT, completed, envport_cli, kill_midway, run_args
from tests.support.processes import alive

FAULTY = "tests.support.faulty_envs:FaultyEnv"
STUBBORN = "tests.support.faulty_envs:StubbornEnv"
RUN_A = ["--run-id", "a", "--json"]


def _args(tasks: Path, db: Path, *extra: str) -> list[str]:
    return run_args(str(tasks), db, "kr", "--backend", "local", "--max-turns", "1", *extra)


@pytest.mark.timeout(150)
def test_controller_killed_midway_and_restarted_runs_each_rollout_once(tmp_path: Path) -> None:
    n = 14
    tasks = tmp_path / "tasks.jsonl"
    # The scripted stand-in echoes the prompt, so each rollout is one 0.25 s env step.
    rows = [{"id": f"t{i:02d}", "prompt": "sleep:0.25", "env_id": FAULTY} for i in range(n)]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = tmp_path / "runs" / "t.db"
    state_dir = tmp_path / "runs" / "instances"

    kill_midway(_args(tasks, db), db, "kr", cwd=tmp_path)
    done_before = completed(db, "kr")
    assert done_before < n, "killed too late to test a restart"
    orphans = [json.loads(p.read_text())["meta"]["pid"] for p in state_dir.glob("*.json")]
    assert orphans, "the killed controller's environment servers outlive it, to be re-adopted"

    second = envport_cli(*_args(tasks, db, "--resume", "--json"), cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["rollouts"] == n
    assert summary["succeeded"] == n
    assert summary["skipped"] >= done_before
    assert summary["adopted"] == len(orphans)

    with SQLiteTraceStore(db) as store:
        traces = store.query(run_id="kr")
        ids = [t.rollout_id for t in traces]
        assert sorted(ids) == sorted(f"kr/t{i:02d}/0" for i in range(n))  # each exactly once
        assert all(t.status is TraceStatus.COMPLETED for t in traces)
        assert {r.state for r in store.rollouts(run_id="kr")} == {"succeeded"}
        abandoned = [a for a in store.attempts(run_id="kr") if a.state == "abandoned"]
        assert all(a.reason == "controller_restart" for a in abandoned)
        assert summary["abandoned"] == len(abandoned)
    training = [t.rollout_id for t in traces for _ in build_rows(t).rows]
    assert len(training) == n
    assert len(set(training)) == n  # no rollout twice in the training data
    assert list(state_dir.iterdir()) == []  # adopted servers stopped at the end
    for pid in orphans:
        cmdline = Path(f"/proc/{pid}/cmdline")
        assert not cmdline.exists() or b"envport" not in cmdline.read_bytes()


def test_run_refuses_to_mix_runs_and_bad_input(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ok = envport_cli("run", "builtin:arithmetic", "--limit", "2", "--store", str(db), *RUN_A)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["succeeded"] == 2
    again = envport_cli("run", "builtin:arithmetic", "--store", str(db), "--run-id", "a")
    assert again.returncode == 2
    assert "--resume" in again.stderr
    no_id = envport_cli("run", "builtin:arithmetic", "--resume", "--store", str(db), timeout=60)
    assert no_id.returncode == 2
    assert "--resume needs --run-id" in no_id.stderr
    remote = envport_cli(
        "run",
        "builtin:arithmetic",
        "--backend",
        "ray",
        "--allow-unisolated",
        "--store",
        str(db),
        timeout=60,
    )
    assert remote.returncode == 2
    assert "local backends only" in remote.stderr
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "b", "prompt": "2+2"}\n{bad\n')
    malformed = envport_cli("run", str(tasks), "--store", str(db), "--run-id", "m", timeout=60)
    assert malformed.returncode == 2
    assert "tasks.jsonl:2: invalid JSON" in malformed.stderr
    with SQLiteTraceStore(db) as store:
        assert store.count(run_id="a") == 2  # nothing run twice
        assert store.count(run_id="m") == 0  # nothing of the malformed file ran


def test_ctrl_c_stops_every_server_and_says_how_to_resume(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    # Steps far longer than the wait for the servers: on a loaded machine the run must not
    # be able to finish (exit 0) before the Ctrl-C lands. Ctrl-C cuts the sleeps short.
    rows = [{"id": f"t{i}", "prompt": "sleep:60", "env_id": FAULTY} for i in range(4)]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = tmp_path / "runs" / "t.db"
    state_dir = tmp_path / "runs" / "instances"
    proc = subprocess.Popen(
        [ENVPORT, *_args(tasks, db)],
        cwd=tmp_path,
        env=CLI_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(state_dir.glob("*.json"))) < 2:  # both servers up, steps sleeping
            assert proc.poll() is None
            assert time.monotonic() < deadline, "no environment server started"
            time.sleep(0.05)
        pids = [json.loads(p.read_text())["meta"]["pid"] for p in state_dir.glob("*.json")]
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert b"--run-id kr --resume" in stderr
    assert list(state_dir.iterdir()) == []
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline")
        assert not cmdline.exists() or b"envport" not in cmdline.read_bytes()
    with SQLiteTraceStore(db) as store:
        assert store.count(run_id="kr", status="completed") == 0
        assert {r.state for r in store.rollouts(run_id="kr")} <= {"pending"}


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(stat[2]) == pgid and stat[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, f"the controller exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextmanager
def _stubborn_run(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path, int]]:
    """``envport run`` of one StubbornEnv rollout on the local backend, its step sleeping;
    yields (controller, its stderr file, the env's marks dir, the server's process group).
    Whatever the test did, every process of that group is SIGKILLed at the end."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t0", "prompt": "sleep:60", "env_id": STUBBORN}) + "\n")
    db = tmp_path / "runs" / "t.db"
    state_dir = tmp_path / "runs" / "instances"
    marks = tmp_path / "marks"
    marks.mkdir()
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [ENVPORT, *_args(tasks, db)],
            cwd=tmp_path,
            env={**CLI_ENV, "STUBBORN_DIR": str(marks)},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    pgids: set[int] = set()
    try:
        _wait_for("a server", lambda: bool(list(state_dir.glob("*.json"))), proc)
        records = list(state_dir.glob("*.json"))
        assert len(records) == 1
        pgids.add(pgid := json.loads(records[0].read_text())["meta"]["pid"])
        # Its session's environment (with its helper) was built; the step is under way.
        _wait_for("a session", lambda: len(list(marks.glob("child-*"))) >= 2, proc)
        time.sleep(0.5)
        yield proc, stderr, marks, pgid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [p for g in pgids for p in _group(g)]:
            os.kill(pid, signal.SIGKILL)


def _second_ctrl_c_as_cleanup_stops_the_server(proc: subprocess.Popen[bytes], marks: Path) -> None:
    proc.send_signal(signal.SIGINT)
    # Cleanup has reached the server: its group got SIGTERM, and it is still stopping.
    _wait_for("the server's stop", (marks / "sigterm").exists, proc)
    proc.send_signal(signal.SIGINT)


def _assert_nothing_left(tmp_path: Path, marks: Path, pgid: int) -> None:
    """Once the controller has exited, nothing it started runs: not the server (which
    was still closing its environment), nor the helper that ignored SIGTERM."""
    assert _group(pgid) == [], "environment processes outlived the controller"
    children = [int(p.name.removeprefix("child-")) for p in marks.glob("child-*")]
    assert children
    assert not any(alive(pid) for pid in children)
    assert list((tmp_path / "runs" / "instances").iterdir()) == []


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_does_not_cut_the_stop_of_environments_short(tmp_path: Path) -> None:
    with _stubborn_run(tmp_path) as (proc, stderr, marks, pgid):
        _second_ctrl_c_as_cleanup_stops_the_server(proc, marks)
        assert proc.wait(timeout=60) == 130
        _assert_nothing_left(tmp_path, marks, pgid)
        text = stderr.read_text()
        assert "still stopping 1 environment; press Ctrl-C again to force" in text
        assert "--run-id kr --resume" in text


@pytest.mark.timeout(120)
def test_a_third_ctrl_c_forces_the_exit_and_kills_every_environment(tmp_path: Path) -> None:
    with _stubborn_run(tmp_path) as (proc, stderr, marks, pgid):
        _second_ctrl_c_as_cleanup_stops_the_server(proc, marks)

        def answered() -> bool:  # (asyncio's own handling instead stops the server again)
            terms = (marks / "sigterm").read_text().count("SIGTERM")
            return b"again" in stderr.read_bytes() or terms > 2

        _wait_for("the second Ctrl-C's answer", answered, proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        _assert_nothing_left(tmp_path, marks, pgid)
        text = stderr.read_text()
        assert "forced: killed 1 environment process group(s)" in text
        assert "--run-id kr --resume" in text


def test_the_live_display_counts_rollouts_by_state_and_env_start_latency() -> None:
    import io

    from rich.console import Console

    from envport.cli_rollout import LiveCounts
    from envport.rollout import RolloutEvent, RolloutState
    from envport.trace import Trace, TraceStatus

    live = LiveCounts(total=5, env_start=[0.4, 0.2])
    events = [
        RolloutEvent(rollout_id="a", state=RolloutState.RUNNING, attempt=1, env_start_s=0.2),
        RolloutEvent(rollout_id="b", state=RolloutState.RUNNING, attempt=2, env_start_s=0.4),
        RolloutEvent(
            rollout_id="c",
            state=RolloutState.SUCCEEDED,
            attempt=1,
            trace=Trace(status=TraceStatus.COMPLETED, reward=1.0),
        ),
        RolloutEvent(rollout_id="d", state=RolloutState.FAILED, attempt=3),
    ]
    for event in events:
        live.update(event)
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(live)
    text = console.export_text()
    for shown in (
        "2/5 done",
        "1 running",
        "1 retrying",
        "1 succeeded",
        "1 failed",
        "1 pending",
        "p50 0.20 s · p99 0.40 s · 2 attempts waited for a new instance",
    ):
        assert shown in text, text


async def test_the_live_line_and_the_summary_show_one_env_start_figure(tmp_path: Path) -> None:
    """The same start samples: the same percentiles, and a count that says what it is."""
    import io

    from rich.console import Console

    from envport.cli_rollout import LiveCounts, summary_table
    from envport.rollout import Controller, InProcessBackend
    from envport.trace import AsyncTraceStore

    def shown(renderable: object) -> str:
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(renderable)
        return console.export_text()

    async with AsyncTraceStore(SQLiteTraceStore(tmp_path / "t.db")) as store:
        ctl = Controller(store, InProcessBackend(), run_id="r")
        ctl.env_start_s.extend([8.49, 8.07])  # two cold starts, in the order they came
        live = shown(LiveCounts(total=2, env_start=ctl.env_start_s))
        summary = shown(summary_table(ctl.summary([], wall_s=1.0), None))
    figure = "p50 8.07 s · p99 8.49 s · 2 attempts waited for a new instance"
    assert f"env start: {figure}" in live, live
    assert figure in summary, summary
