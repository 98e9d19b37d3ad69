"""Opening a path of a sandbox's workspace from the host without ever leaving it.

The workspace is the agent's: while the controller (root) reads or writes one of its
files, a process of the sandbox may swap any component of the path for a symlink to a
host file (``renameat2(RENAME_EXCHANGE)`` in a loop). Checking the path first (resolving
it) and opening it after is a race the agent wins often enough (measured: one
``read_file`` in seven returned the host file). So the open itself is confined:
``openat2(2)`` with ``RESOLVE_BENEATH`` (Linux 5.6+) from a descriptor of the root follows
a symlink only while it stays under that root, and fails with ``EXDEV`` otherwise, in
one system call. Where ``openat2`` is missing the path is walked one component at a
time with ``O_NOFOLLOW``: every symlink is refused (``ELOOP``), even one that stays in.
"""

from __future__ import annotations

import ctypes
import errno
import os

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
#: openat2's number, the same on every architecture (the shared table from 424 on).
_SYS_OPENAT2 = 437
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_have_openat2: bool | None = None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]  # fmt: skip


def _openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                   RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)  # fmt: skip
    while True:
        fd = _libc.syscall(
            _SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(path), ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )  # fmt: skip
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):  # EAGAIN: a rename raced the lookup
            raise OSError(err, os.strerror(err), path)


def _walk(dir_fd: int, path: str, flags: int, mode: int) -> int:
    """No openat2: each component opened with ``O_NOFOLLOW`` (a symlink: ``ELOOP``)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OSError(errno.EXDEV, "'..' in a path opened beneath a directory", path)
    current = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=current)  # fmt: skip
            os.close(current)
            current = nxt
        last = parts[-1] if parts else "."
        return os.open(last, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=current)
    finally:
        os.close(current)


def open_beneath(dir_fd: int, path: str, flags: int, mode: int = 0o666) -> int:
    """``open(path, flags, mode)`` relative to ``dir_fd``, never resolving to anything
    outside it (``OSError`` ``EXDEV``, or ``ELOOP`` without openat2). ``path`` is relative;
    ``""`` is the directory itself."""
    global _have_openat2
    path = path or "."
    if _have_openat2 is not False:
        try:
            fd = _openat2(dir_fd, path, flags, mode)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            _have_openat2 = False
        else:
            _have_openat2 = True
            return fd
    return _walk(dir_fd, path, flags, mode)
