"""Run the ``envport`` console script as a user runs it: a real subprocess of this venv's.

``CLI_ENV`` puts the repository first on ``PYTHONPATH`` (so ``tests.support`` environments
load by import path), keeping an inherited ``PYTHONPATH`` after it (so a checkout run with
``PYTHONPATH=src`` tests its own ``envport``), and widens the terminal so rich does not
wrap what tests look for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envport.trace import SQLiteTraceStore

ROOT = Path(__file__).resolve().parents[2]
ENVPORT = str(Path(sys.executable).parent / "envport")


def pythonpath(*first: str | Path) -> str:
    """``first`` then the inherited ``PYTHONPATH``, as one ``PYTHONPATH`` value."""
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([*(str(p) for p in first), *([inherited] if inherited else [])])


CLI_ENV = {**os.environ, "PYTHONPATH": pythonpath(ROOT), "COLUMNS": "200"}


def envport_cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``envport ARGS...`` to completion, output captured as text."""
    return subprocess.run(
        [ENVPORT, *args],
        env=env or CLI_ENV,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def run_args(source: str, db: Path, run_id: str, *options: str) -> list[str]:
    """``envport run SOURCE`` with two concurrent rollouts into ``db`` under ``run_id``."""
    return ["run", source, "-c", "2", "--store", str(db), "--run-id", run_id, *options]


def completed(db: Path, run_id: str) -> int:
    """Completed traces of ``run_id`` in ``db`` so far (0 before the store exists)."""
    if not db.exists():
        return 0
    with SQLiteTraceStore(db) as store:
        return store.count(run_id=run_id, status="completed")


def kill_midway(
    args: list[str],
    db: Path,
    run_id: str,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    after: int = 3,
    timeout_s: float = 90,
) -> subprocess.Popen[bytes]:
    """Start the controller ``envport ARGS...``; SIGKILL it once ``after`` rollouts have completed.

    Fails the test (with the controller's stderr) if it exits on its own first or makes
    no progress within ``timeout_s``. Returns the reaped process.
    """
    proc = subprocess.Popen(
        [ENVPORT, *args],
        env=env or CLI_ENV,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while completed(db, run_id) < after:
            if proc.poll() is not None:
                stderr = proc.stderr.read().decode() if proc.stderr else ""
                done = completed(db, run_id)
                pytest.fail(f"controller exited {proc.returncode}, {done} done: {stderr}")
            assert time.monotonic() < deadline, "the first controller made no progress"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    return proc
