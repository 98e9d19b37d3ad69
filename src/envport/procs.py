"""Process helpers shared across envport (controller leases, sandbox runtime dirs).

A pid alone does not name a process for long: pids are reused (``pid_max`` is 32768 on
many machines). Things named after their owner (a controller's id, a sandbox's runtime
directory and cgroup) carry the owner's start time too (:func:`owner_tag`), so a new
process that happens to get the same pid is not taken for the owner.
"""

from __future__ import annotations

import functools
import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (``/proc/PID/stat`` field 22);
    None when it cannot be read (no such process, no procfs)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # the name may hold spaces and ')'
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def owner_tag(pid: int | None = None) -> str:
    """``PID-tSTART`` for a process (this one by default), or ``PID`` without procfs: the
    owner part of names that :func:`owner_alive` checks."""
    return _tag(os.getpid() if pid is None else pid)


@functools.lru_cache(maxsize=64)
def _tag(pid: int) -> str:
    """(A pid's start time never changes while it lives: read procfs once per pid.)"""
    start = start_time(pid)
    return f"{pid}" if start is None else f"{pid}-t{start}"


def parse_owner(text: str) -> tuple[int, int | None] | None:
    """(pid, start time or None) from the start of ``PID-tSTART-…`` or ``PID-…`` (the
    older form, a pid alone), else None."""
    parts = text.split("-")
    if not parts[0].isdigit():
        return None
    start = None
    if len(parts) > 1 and parts[1][:1] == "t" and parts[1][1:].isdigit():
        start = int(parts[1][1:])
    return int(parts[0]), start


def owner_alive(pid: int, start: int | None) -> bool:
    """Whether the owner still runs: its pid exists and, when its start time is known,
    the process with that pid started then (not a later one given the same pid)."""
    if not pid_alive(pid):
        return False
    if start is None:
        return True
    now = start_time(pid)
    return now is None or now == start
