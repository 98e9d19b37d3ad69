"""Mount system calls, made directly (``ctypes``), for the sandbox's workspace.

**Decision:** every mount a sandbox needs is made by the controller, in its own mount
namespace, with the ``mount(2)``/``umount2(2)`` system calls: no ``mount`` binary, no
``nsenter``, no helper process. A reset is then a few system calls (about a
millisecond), not a fork and exec. The sandbox sees the changes because its root is a
*slave* of a shared mount the controller owns (see :mod:`envport.sandbox.sandbox`):
a mount the controller makes or removes under that root propagates into the sandbox.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p,
]  # fmt: skip
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _raise(what: str, target: str | os.PathLike[str]) -> None:
    errno = ctypes.get_errno()
    raise OSError(errno, f"{what} {os.fspath(target)!r}: {os.strerror(errno)}")


def mount(
    source: str, target: str | os.PathLike[str], fstype: str | None, flags: int, data: str = ""
) -> None:
    """``mount(2)``; ``OSError`` naming the target on failure."""
    rc = _libc.mount(
        source.encode(),
        os.fsencode(target),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        _raise(f"mount {fstype or 'bind'}", target)


def umount(target: str | os.PathLike[str], *, lazy: bool = True) -> None:
    """``umount2(2)``, detaching lazily by default (busy mounts go when last used)."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0) != 0:
        _raise("umount", target)


def mount_tmpfs(target: Path, *, size_bytes: int, mode: str = "0755", name: str) -> None:
    """A tmpfs of at most ``size_bytes`` (its size is the sandbox's disk quota)."""
    mount(name, target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_bytes},mode={mode}")


def make_shared(target: Path) -> None:
    mount("none", target, None, MS_SHARED)


def mount_overlay(target: Path, lowers: list[Path], upper: Path, work: Path) -> None:
    """An overlay with ``lowers`` (top first) read-only under the writable ``upper``."""
    lowerdir = ":".join(os.fspath(p) for p in lowers)
    mount("envport-workspace", target, "overlay", MS_NOSUID | MS_NODEV,
          f"lowerdir={lowerdir},upperdir={upper},workdir={work}")  # fmt: skip


def mounted_under(prefix: Path) -> list[str]:
    """Mount points at or under ``prefix`` in this namespace, deepest first."""
    root = os.fspath(prefix)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = line.split(" ", 5)[4].replace("\\040", " ")
            if point == root or point.startswith(root + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def unmount_all(prefix: Path) -> None:
    """Detach every mount at or under ``prefix`` (deepest first); ignores ones gone."""
    for point in mounted_under(prefix):
        try:
            umount(point)
        except OSError as exc:
            if exc.errno not in (22, 2):  # EINVAL: not a mount (any more); ENOENT
                raise
