"""`envport run` as a user runs it: a real controller process, SIGKILLed and restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envport.trace import SQLiteTraceStore, TraceStatus
from envport.train.rows import build_rows

ROOT = Path(__file__).resolve().parent.parent
ENVPORT = str(Path(sys.executable).parent / "envport")
FAULTY = "tests.support.faulty_envs:FaultyEnv"
RUN_A = ["--run-id", "a", "--json"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def _argv(tasks: Path, db: Path, *extra: str) -> list[str]:
    return [
        ENVPORT,
        "run",
        str(tasks),
        "--backend",
        "local",
        "-c",
        "2",
        "--max-turns",
        "1",
        "--store",
        str(db),
        "--run-id",
        "kr",
        *extra,
    ]


def _completed(db: Path) -> int:
    if not db.exists():
        return 0
    with SQLiteTraceStore(db) as store:
        return store.count(run_id="kr", status="completed")


@pytest.mark.timeout(150)
def test_controller_killed_midway_and_restarted_runs_each_rollout_once(tmp_path: Path) -> None:
    n = 14
    tasks = tmp_path / "tasks.jsonl"
    # The scripted stand-in echoes the prompt, so each rollout is one 0.25 s env step.
    rows = [{"id": f"t{i:02d}", "prompt": "sleep:0.25", "env_id": FAULTY} for i in range(n)]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = tmp_path / "runs" / "t.db"
    state_dir = tmp_path / "runs" / "instances"

    first = subprocess.Popen(
        _argv(tasks, db), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 90
        while _completed(db) < 3:
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline, "the first controller made no progress"
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        if first.stderr is not None:
            first.stderr.close()
    done_before = _completed(db)
    assert done_before < n, "killed too late to test a restart"
    orphans = [json.loads(p.read_text())["meta"]["pid"] for p in state_dir.glob("*.json")]
    assert orphans, "the killed controller's environment servers outlive it, to be re-adopted"

    second = subprocess.run(
        _argv(tasks, db, "--resume", "--json"),
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
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
    ok = subprocess.run(
        [ENVPORT, "run", "builtin:arithmetic", "--limit", "2", "--store", str(db), *RUN_A],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=ENV,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["succeeded"] == 2
    again = subprocess.run(
        [ENVPORT, "run", "builtin:arithmetic", "--store", str(db), "--run-id", "a"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=ENV,
    )
    assert again.returncode == 2
    assert "--resume" in again.stderr
    no_id = subprocess.run(
        [ENVPORT, "run", "builtin:arithmetic", "--resume", "--store", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=ENV,
    )
    assert no_id.returncode == 2
    assert "--resume needs --run-id" in no_id.stderr
    with SQLiteTraceStore(db) as store:
        assert store.count(run_id="a") == 2  # nothing run twice


def test_ctrl_c_stops_every_server_and_says_how_to_resume(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t{i}", "prompt": "sleep:5", "env_id": FAULTY} for i in range(4)]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = tmp_path / "runs" / "t.db"
    state_dir = tmp_path / "runs" / "instances"
    proc = subprocess.Popen(
        _argv(tasks, db), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
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
