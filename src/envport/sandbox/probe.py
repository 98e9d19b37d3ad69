"""What isolation this machine offers a sandbox, and why not where it does not.

A sandbox needs four things: ``bwrap`` (Debian package ``bubblewrap``; the PyPI
package of that name is unrelated), the right to mount (tmpfs and overlayfs, in the
controller's own mount namespace: root, or a user namespace where it is root), new
namespaces for the sandbox, and cgroup v1 memory/pids/cpu groups for its
limits. :func:`probe` tries each for real, once per process, and says which failed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from envport.sandbox import mounts
from envport.sandbox.cgroups import probe_cgroups


@dataclasses.dataclass(frozen=True)
class Isolation:
    """The result of :func:`probe`: ``isolated`` if every part works, else ``problems``."""

    bwrap: str | None
    problems: tuple[str, ...] = ()

    @property
    def isolated(self) -> bool:
        return self.bwrap is not None and not self.problems

    def explain(self) -> str:
        return "; ".join(self.problems) or "isolation available"


_lock = threading.Lock()
_cached: Isolation | None = None


def probe(*, refresh: bool = False) -> Isolation:
    """Try bwrap, mounts and cgroups here (cached; ``refresh`` tries again)."""
    global _cached
    with _lock:
        if _cached is None or refresh:
            _cached = _probe()
        return _cached


def _probe() -> Isolation:
    problems: list[str] = []
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        problems.append(
            "bubblewrap (`bwrap`) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        )
    with tempfile.TemporaryDirectory(prefix="envport-sandbox-probe-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        try:
            mounts.mount_tmpfs(root, size_bytes=1 << 20, name="envport-probe")
        except OSError as exc:
            problems.append(
                f"cannot mount a tmpfs ({exc.strerror}): sandboxes need CAP_SYS_ADMIN "
                "(run as root, or inside a user namespace where this process is root)"
            )
            return Isolation(None, tuple(problems))
        try:
            for name in ("lower", "upper", "work", "ws"):
                (root / name).mkdir()
            try:
                mounts.mount_overlay(root / "ws", [root / "lower"], root / "upper", root / "work")
            except OSError as exc:
                problems.append(f"cannot mount overlayfs ({exc.strerror})")
            if bwrap is not None:
                argv = [bwrap, "--unshare-all", "--die-with-parent", "--cap-drop", "ALL",
                        "--ro-bind", "/usr", "/usr", *_merged_usr_args(), "--proc", "/proc",
                        "--dev", "/dev", "/usr/bin/true"]  # fmt: skip
                try:
                    done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
                    if done.returncode != 0:
                        detail = done.stderr.decode("utf-8", "replace").strip()
                        problems.append(
                            f"`{bwrap}` cannot create namespaces ({detail or done.returncode});"
                            " user namespaces may be disabled here"
                        )
                except (OSError, subprocess.TimeoutExpired) as exc:
                    problems.append(f"`{bwrap}` could not run ({exc})")
        finally:
            mounts.unmount_all(root)
    cgroup_problem = probe_cgroups()
    if cgroup_problem is not None:
        problems.append(cgroup_problem)
    return Isolation(bwrap if not problems else None, tuple(problems))


def _merged_usr_args() -> list[str]:
    args: list[str] = []
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return args
