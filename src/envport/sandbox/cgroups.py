"""Per-sandbox control groups (cgroup v1): memory, CPU and PID limits and kill-all.

This machine's kernel offers its memory and cpu controllers only through cgroup v1 (the
v2 hierarchy has neither), so this module speaks v1: one directory per sandbox in each
controller's hierarchy, **nested under the controller's own cgroup** (read from
``/proc/self/cgroup``), so a sandbox can never get more than its controller has.

v1 has no ``cgroup.kill``; :meth:`CgroupSet.kill_all` does its job: SIGKILL every member
but the ones spared, re-read the member list, repeat until only those are left. The pids
limit bounds what a fork bomb can start between two rounds, so this converges in a few
rounds. (Freezing the group first, with the freezer controller, would stop the race
outright, but moving a process into one more v1 hierarchy costs milliseconds per start:
every ``cgroup.procs`` write waits for an RCU grace period. The sandbox joins only the
controllers it uses: pids always, memory and cpu when limited.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The controllers a sandbox uses, and what each is for.
CONTROLLERS = {
    "memory": "memory_mb",
    "pids": "pids",
    "cpu": "cpus",
}
CPU_PERIOD_US = 100_000


def own_cgroups() -> dict[str, Path]:
    """Controller -> this process's cgroup directory, for the v1 controllers mounted."""
    found: dict[str, Path] = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                if name in CONTROLLERS:
                    directory = CGROUP_ROOT / name / path.lstrip("/")
                    if (directory / "cgroup.procs").is_file():
                        found[name] = directory
    return found


def probe_cgroups() -> str | None:
    """``None`` if a sandbox cgroup can be made in every controller here, else why not."""
    try:
        parents = own_cgroups()
    except OSError as exc:
        return f"cannot read /proc/self/cgroup ({exc})"
    missing = sorted(set(CONTROLLERS) - set(parents))
    if missing:
        return (
            f"cgroup v1 controller(s) {', '.join(missing)} are not mounted under "
            f"{CGROUP_ROOT} (limits need memory, pids and cpu)"
        )
    name = f"envport-probe-{os.getpid()}"
    for controller, parent in parents.items():
        try:
            (parent / name).mkdir()
            (parent / name).rmdir()
        except OSError as exc:
            return f"cannot create a {controller} cgroup under {parent} ({exc.strerror})"
    return None


@dataclasses.dataclass
class CgroupSet:
    """One sandbox's cgroup in each controller."""

    dirs: dict[str, Path]

    @classmethod
    def create(
        cls,
        name: str,
        *,
        memory_mb: int | None = None,
        pids: int | None = None,
        cpus: float | None = None,
    ) -> CgroupSet:
        """Make the groups and set the limits; on any failure remove what was made."""
        made: dict[str, Path] = {}
        group = cls(made)
        wanted = ["pids"] + ["memory"] * (memory_mb is not None) + ["cpu"] * (cpus is not None)
        try:
            parents = own_cgroups()
            missing = sorted(set(wanted) - set(parents))
            if missing:
                raise OSError(f"cgroup controller(s) {', '.join(missing)} are not available")
            for controller in wanted:
                directory = parents[controller] / name
                directory.mkdir()
                made[controller] = directory
            if memory_mb is not None:
                limit = str(memory_mb * 1024 * 1024)
                _write(made["memory"] / "memory.limit_in_bytes", limit)
                memsw = made["memory"] / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # no swapping around the limit either
                    _write(memsw, limit)
            if pids is not None:
                _write(made["pids"] / "pids.max", str(pids))
            if cpus is not None:
                _write(made["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(made["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(cpus * CPU_PERIOD_US))))
        except BaseException:
            group.remove()
            raise
        return group

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and so everything it starts later) into every group."""
        for directory in self.dirs.values():
            _write(directory / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        directory = self.dirs.get("pids") or next(iter(self.dirs.values()), None)
        if directory is None:
            return []
        try:
            text = (directory / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def oom_kills(self) -> int:
        """How many processes the kernel has OOM-killed in this group so far."""
        directory = self.dirs.get("memory")
        if directory is None:
            return 0
        with contextlib.suppress(OSError):
            for line in (directory / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def memory_bytes(self) -> int:
        directory = self.dirs.get("memory")
        if directory is None:
            return 0
        try:
            return int((directory / "memory.usage_in_bytes").read_text())
        except (OSError, ValueError):
            return 0

    def kill_all(self, *, spare: Iterable[int] = (), timeout_s: float = 5.0) -> bool:
        """SIGKILL every member but ``spare``; ``True`` once only ``spare`` are left."""
        keep = set(spare)
        deadline = time.monotonic() + timeout_s
        while True:
            victims = [p for p in self.pids() if p not in keep]
            if not victims:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def remove(self, *, timeout_s: float = 5.0) -> None:
        """Kill every member and remove the groups (idempotent). Raises ``OSError`` only
        if a group still has members after ``timeout_s``."""
        self.kill_all(timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        for controller in list(self.dirs):
            directory = self.dirs[controller]
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: killed members not yet fully gone
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.001)
            del self.dirs[controller]


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
