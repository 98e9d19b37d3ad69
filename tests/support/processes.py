"""Start real server processes for tests and wait (bounded) until they are healthy."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.servers import free_port

SUPPORT = Path(__file__).parent


@contextmanager
def server_process(argv: Sequence[str], log: Path, *, timeout_s: float = 45.0) -> Iterator[str]:
    """Run ``argv + ["--port", N]``; yields the base URL once ``/health`` answers.

    The port is found free here and bound by the server later: another process can take
    it in between, so a server that exits because its address is in use gets another one.
    """
    deadline = time.monotonic() + timeout_s
    for attempt in range(3):
        port = free_port()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT
            )
        base = f"http://127.0.0.1:{port}"
        try:
            healthy = False
            with httpx.Client(timeout=1.0) as http:
                while not healthy and proc.poll() is None and time.monotonic() < deadline:
                    try:
                        healthy = http.get(f"{base}/health").status_code == 200
                    except httpx.HTTPError:
                        time.sleep(0.1)
            if not healthy:
                output = log.read_text()
                if proc.poll() is not None and "in use" in output and attempt < 2:
                    continue  # its port was taken meanwhile: another one
                raise RuntimeError(f"server {argv} did not start:\n{output}")
            yield base
            return
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    raise AssertionError("unreachable")


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def openenv_echo_argv() -> list[str]:
    return [sys.executable, str(SUPPORT / "openenv_echo_server.py")]


def envport_argv(env: str) -> list[str]:
    return [sys.executable, "-m", "envport.server", env]
