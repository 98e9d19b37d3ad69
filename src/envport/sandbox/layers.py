"""The workspace's layers: a read-only base, frozen snapshot layers, a writable top.

**Decision (overlayfs, upper on tmpfs).** A sandbox's workspace is an overlay mount::

    upper   tmpfs of ``disk_mb`` (the writable layer; its size is the disk quota)
    lower   frozen layers, newest first (each a tmpfs holding one snapshot's changes)
    lower   the task's directory (``SandboxConfig.workspace``), never written

* **reset / restore** mount a fresh, empty upper over the snapshot's layers: a handful of
  system calls, O(1) whatever the workspace's size, nothing copied.
* **snapshot** copies the upper (only what the sandbox changed since its last restore)
  into a new frozen layer; when nothing changed it is free. The live overlay is left
  alone, so nothing the shell holds open is disturbed. (Freezing the upper in place
  would be O(1) too, but a process still writing through the old mount would then
  change a layer other sandboxes read.)
* **fork** is one snapshot, then each child mounts its own empty upper over the same
  layers: the parent's 50 MB stays shared, read-only, and each child pays O(1).

Frozen layers are reference-counted by the sandboxes that may use them and unmounted
(freeing their memory at once) when the last one closes. An unmounted tmpfs frees all
it held, so removing a layer costs the same whatever it holds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path

from envport.procs import owner_tag
from envport.sandbox import mounts

#: More lower layers than this and a snapshot flattens the stack into one layer.
MAX_LAYERS = 24
_lock = threading.Lock()
_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # Linux's; not in Python's list


class Layer:
    """One frozen, read-only layer (a tmpfs at ``path``; the files are in ``data``)."""

    def __init__(self, path: Path, *, tmpfs: bool) -> None:
        self.path = path
        self.tmpfs = tmpfs
        self.refs = 0

    @property
    def data(self) -> Path:
        return self.path / "data"

    @classmethod
    def create(cls, runtime: Path, *, size_bytes: int, tmpfs: bool = True) -> Layer:
        path = runtime / f"L{owner_tag()}-{secrets.token_hex(4)}"
        path.mkdir(mode=0o700)
        if tmpfs:
            try:
                mounts.mount_tmpfs(path, size_bytes=size_bytes, name="envport-layer")
            except OSError:
                path.rmdir()
                raise
        (path / "data").mkdir()
        return cls(path, tmpfs=tmpfs)

    def hold(self) -> None:
        with _lock:
            self.refs += 1

    def release(self) -> None:
        with _lock:
            self.refs -= 1
            last = self.refs <= 0
        if last:
            self.destroy()

    def destroy(self) -> None:
        if self.tmpfs:
            mounts.unmount_all(self.path)
            try:
                self.path.rmdir()
            except OSError:
                shutil.rmtree(self.path, ignore_errors=True)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def copy_tree(src: Path, dst: Path) -> None:
    """Copy the tree under ``src`` into the existing directory ``dst``, in this process
    (no ``cp`` to start: a snapshot of a few changed files takes well under a
    millisecond). Keeps what overlayfs needs in a layer: modes, owners, timestamps,
    extended attributes (``trusted.overlay.opaque`` marks a directory that hides the ones
    below), symlinks, and device nodes (a 0:0 character device is a *whiteout*: a file
    deleted above a lower layer). Hard links become separate copies.

    ``src`` may change while it is copied (a live sandbox's upper layer: its agent can
    swap any entry for a symlink to a host path at any moment, and this runs as root on
    the host). So it is read through descriptors only: each entry is opened with
    ``O_NOFOLLOW`` in its directory's descriptor and copied as what it is once open
    (``fstat``), and a symlink's target is only ever read, never followed. Nothing
    outside ``src`` is read, whatever is swapped meanwhile; an entry gone meanwhile is
    left out."""
    root = os.open(src, _DIR_FLAGS)
    try:
        _copy_attrs_of(root, None, dst, os.fstat(root))
        # Depth first, one descriptor per directory on the way down.
        stack: list[tuple[int, str, list[str]]] = [(root, str(dst), _names(root))]
        while stack:
            fd, there, names = stack[-1]
            if not names:
                stack.pop()
                if fd != root:
                    os.close(fd)
                continue
            name = names.pop()
            sub = _copy_entry_at(fd, name, os.path.join(there, name))
            if sub is not None:
                stack.append((sub, os.path.join(there, name), _names(sub)))
    finally:
        for fd, _, _ in stack:
            if fd != root:
                os.close(fd)
        os.close(root)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _names(dir_fd: int) -> list[str]:
    with os.scandir(dir_fd) as entries:
        return [entry.name for entry in entries]


def _copy_entry_at(dir_fd: int, name: str, target: str) -> int | None:
    """Copy entry ``name`` of directory ``dir_fd`` to ``target``; for a directory, make it
    and return its open descriptor (its entries are the caller's to copy)."""
    for _ in range(3):  # an entry swapped between its stat and its open: look again
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # gone meanwhile
        mode = st.st_mode
        if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
            try:
                fd = os.open(name, _DIR_FLAGS if stat.S_ISDIR(mode) else _FILE_FLAGS,
                             dir_fd=dir_fd)  # fmt: skip
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
                    continue  # now a symlink, a file, a fifo: copy what it is now
                raise
            st = os.fstat(fd)
            if stat.S_IFMT(st.st_mode) != stat.S_IFMT(mode):
                os.close(fd)
                continue
            if stat.S_ISDIR(mode):
                try:
                    os.mkdir(target)
                    _copy_attrs_of(fd, None, target, st)
                except BaseException:
                    os.close(fd)
                    raise
                return fd
            try:
                _copy_data(fd, target, st.st_size)
                _copy_attrs_of(fd, None, target, st)
            finally:
                os.close(fd)
            return None
        if stat.S_ISLNK(mode):
            try:
                os.symlink(os.readlink(name, dir_fd=dir_fd), target)
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # no longer a symlink
                    continue
                if exc.errno == errno.ENOENT:
                    return None
                raise
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            os.mknod(target, mode, st.st_rdev)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(target, stat.S_IMODE(mode))
        else:
            return None  # sockets mean nothing in a copy
        # Not opened (a symlink, a device, a fifo): its attributes are read through the
        # directory's descriptor (/proc/self/fd/N is that directory, whatever its path
        # is now), the entry itself not followed.
        _copy_attrs_of(None, f"/proc/self/fd/{dir_fd}/{name}", target, st)
        return None
    raise OSError(errno.EAGAIN, "an entry kept changing while it was copied", name)


def _copy_attrs_of(fd: int | None, path: str | None, dst: str | Path, st: os.stat_result) -> None:
    """:func:`_copy_attrs` from an open descriptor (``fd``), or from ``path`` not
    followed (an entry named through a directory's descriptor)."""
    if fd is not None:
        source: int | str = fd
    else:
        assert path is not None
        source = path
    follow = fd is not None
    with contextlib.suppress(FileNotFoundError):
        for key in os.listxattr(source, follow_symlinks=follow):
            with contextlib.suppress(OSError):
                os.setxattr(dst, key, os.getxattr(source, key, follow_symlinks=follow),
                            follow_symlinks=False)  # fmt: skip
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_data(fd: int, dst: str, size: int) -> None:
    with open(dst, "wb") as fout:
        _copy_sparse_fds(fd, fout.fileno(), size)


def copy_sparse(src: str, dst: str, size: int) -> None:
    """Copy a regular file's data, keeping its holes (``SEEK_DATA``/``SEEK_HOLE``, then
    ``copy_file_range`` per data extent): a ``truncate -s 100G`` file costs its sandbox
    nothing, and must cost its snapshot nothing either (``shutil.copyfile`` writes every
    zero). Where the file system cannot say where its holes are, a plain copy."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        _copy_sparse_fds(fin.fileno(), fout.fileno(), size)


def _copy_sparse_fds(i: int, o: int, size: int) -> None:
    """:func:`copy_sparse` between open descriptors."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(i, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            if exc.errno != errno.EINVAL:
                raise
            start = pos  # no SEEK_DATA here: copy the rest
            end = size
        else:
            end = os.lseek(i, start, os.SEEK_HOLE)
        while start < end:
            done = _copy_range(i, o, start, end - start)
            if done == 0:
                break
            start += done
        pos = end
    os.ftruncate(o, size)


def _copy_range(i: int, o: int, offset: int, count: int) -> int:
    try:
        return os.copy_file_range(i, o, count, offset, offset)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    data = os.pread(i, min(count, 1 << 20), offset)
    os.pwrite(o, data, offset)
    return len(data)


def _copy_attrs(src: str | Path, dst: str | Path, st: os.stat_result | None = None) -> None:
    """:func:`_copy_attrs_of` an entry named by path (not followed): for layers no sandbox
    writes any more (:func:`squash`)."""
    _copy_attrs_of(None, str(src), dst, st or os.lstat(src))


_OPAQUE = "trusted.overlay.opaque"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def squash(layers: list[Path], dst: Path) -> None:
    """Merge overlay layers (``layers`` newest first) into the empty directory ``dst`` as
    one layer that means the same over whatever lies below them: applied oldest first, a
    whiteout replaces what is there (and stays, for the layers below), an opaque directory
    replaces the directory, a plain one merges into it, anything else replaces the entry.
    What lies below (the task's files) is not copied: flattening a stack of snapshots
    costs what the snapshots hold, whatever the size of the task's repository."""
    for layer in reversed(layers):
        _copy_attrs(layer, dst)
        stack = [(str(layer), str(dst))]
        while stack:
            here, there = stack.pop()
            with os.scandir(here) as entries:
                for entry in entries:
                    target = os.path.join(there, entry.name)
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        opaque = _has_opaque(entry.path)
                        if opaque or not (os.path.isdir(target) and not os.path.islink(target)):
                            _remove(target)
                            os.mkdir(target)
                        _copy_attrs(entry.path, target, st)
                        stack.append((entry.path, target))
                        continue
                    _remove(target)
                    copy_tree_entry(entry.path, target, st)


def _has_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def copy_tree_entry(src: str, target: str, st: os.stat_result) -> None:
    """Copy one non-directory entry (file, symlink, device or whiteout, fifo)."""
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), target)
    elif stat.S_ISREG(st.st_mode):
        copy_sparse(src, target, st.st_size)
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        os.mknod(target, st.st_mode, st.st_rdev)
    elif stat.S_ISFIFO(st.st_mode):
        os.mkfifo(target, stat.S_IMODE(st.st_mode))
    else:
        return  # sockets mean nothing in a copy
    _copy_attrs(src, target, st)


def fingerprint(path: Path) -> frozenset[tuple[str, int, int, int, int]] | None:
    """What identifies the tree under ``path`` as unchanged: each entry's relative path,
    inode, size, and change and modification times (ns). ``None`` when an entry changed
    within the file system clock's current tick (tmpfs stamps times with a coarse clock):
    a change made later in the same tick could then leave the same times behind."""
    now = time.clock_gettime_ns(_REALTIME_COARSE)
    found: list[tuple[str, int, int, int, int]] = []
    stack = [str(path)]
    while stack:
        here = stack.pop()
        st = os.lstat(here)
        if max(st.st_ctime_ns, st.st_mtime_ns) >= now:
            return None
        found.append((here, st.st_ino, st.st_size, st.st_ctime_ns, st.st_mtime_ns))
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(here) as entries:
                stack.extend(entry.path for entry in entries)
    return frozenset(found)


def is_empty(path: Path) -> bool:
    with os.scandir(path) as entries:
        return next(entries, None) is None
