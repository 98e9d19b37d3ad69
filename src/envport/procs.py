"""Process helpers shared across envport (controller leases, sandbox runtime dirs, the
output and exit of a command run on the host).

A pid alone does not name a process for long: pids are reused (``pid_max`` is 32768 on
many machines). Things named after their owner (a controller's id, a sandbox's runtime
directory and cgroup) carry the owner's start time too (:func:`owner_tag`), so a new
process that happens to get the same pid is not taken for the owner.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable


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


class OutputTail:
    """The last ``limit`` bytes written to a stream: memory stays bounded whatever a
    command prints, and what comes last (a test run's summary, a traceback) is kept.
    ``head=True`` keeps the first ``limit`` bytes instead (an agent's command: what it
    printed first)."""

    def __init__(self, limit: int, *, head: bool = False) -> None:
        self.limit = limit
        self.head = head
        self.buffer = bytearray()
        self.dropped = 0  # bytes cut (from the front; with ``head``, from the end)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def feed(self, data: bytes) -> None:
        if self.head:
            room = max(self.limit - len(self.buffer), 0)
            self.buffer += data[:room]
            self.dropped += len(data) - min(room, len(data))
            return
        self.buffer += data
        excess = len(self.buffer) - self.limit
        if excess > 0:
            del self.buffer[:excess]
            self.dropped += excess

    def text(self, *, note: bool = False) -> str:
        """The tail as text (invalid UTF-8 as U+FFFD; a character the cut split is left
        out whole); with ``note``, a cut tail starts with a line saying how much went."""
        start = 0
        if self.dropped and not self.head:
            while start < min(len(self.buffer), 3) and 0x80 <= self.buffer[start] < 0xC0:
                start += 1
        text = self.buffer[start:].decode("utf-8", "replace")
        if note and self.dropped:
            text = f"[envport: {self.dropped + start} earlier bytes of output dropped]\n{text}"
        return text


class CommandOutput(asyncio.SubprocessProtocol):
    """A command's output tails, and its exit heard as the process's own: asyncio's
    ``Process.wait`` (Python 3.11) waits for every pipe to close too, which a process the
    command left running (a server started with ``&``) may hold for ever.

    ``on_line`` is called for each chunk of output that ends a line (a heartbeat)."""

    def __init__(
        self, limit: int, on_line: Callable[[], None] | None = None, *, head: bool = False
    ) -> None:
        self.on_line = on_line
        self.stdout = OutputTail(limit, head=head)
        self.stderr = OutputTail(limit, head=head)
        self.exited = asyncio.Event()
        self.pipes_closed = asyncio.Event()
        self._open = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        chunk = data.encode() if isinstance(data, str) else data
        (self.stdout if fd == 1 else self.stderr).feed(chunk)
        if self.on_line is not None and (b"\n" in chunk or b"\r" in chunk):
            self.on_line()

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open:
            self.pipes_closed.set()

    def process_exited(self) -> None:
        self.exited.set()
