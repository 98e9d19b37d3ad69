"""A Linux sandbox: a persistent shell in its own namespaces, on an overlay workspace.

::

    controller (this process, its mount namespace)
    └── <runtime>/S<id>/       tmpfs of disk_mb, a *shared* mount (the only one, but for
        │                      the overlay, that a sandbox adds to the controller)
        ├── root/              the sandbox's "/" (read-only inside)
        │   ├── usr, etc       bound read-only from the host (+ merged-/usr links)
        │   └── <workdir>      the overlay workspace, mounted by the controller
        └── u<N>/              the overlay's upper and work dirs
    bwrap (own mount, PID, network, IPC, UTS, cgroup namespaces; no capabilities; no
    │      user namespaces of its own: .confine)
    ├── /proc                  its own; /proc/sys read-only, kcore & co masked (.procfs)
    ├── /tmp                   bwrap's own tmpfs of tmp_mb (inside the sandbox only)
    ├── /dev                   bwrap's device nodes, read-only; /dev/shm a small tmpfs
    └── bash                   the persistent shell, driven over pipes (see .session)

**Why mounts are made outside.** bubblewrap binds ``root/`` as the sandbox's ``/``; in
the sandbox's mount namespace that bind is a *slave* of the controller's shared mount,
so mounts the controller makes or removes under ``root/`` appear inside at once. Reset,
restore and snapshot are therefore plain ``mount(2)`` calls here (:mod:`.mounts`),
without entering the sandbox, and the shell simply ``cd``\\ s into the new tree.

**Why so few mounts.** Every new mount namespace starts as a copy of the controller's,
so each mount a live sandbox keeps in the controller's namespace makes every later
start slower (measured: bwrap's start went from 20 to 44 ms with 800 mounts present).
A sandbox therefore keeps two there: its state tmpfs (root skeleton, upper layers: the
disk quota is its size) and the overlay; ``/tmp`` is bwrap's own tmpfs, inside, and is
emptied on reset through ``/proc/<init>/root/tmp``. Likewise only a minimal root is bound
(``/usr``, ``/etc``): binding the host's whole ``/`` would copy every other sandbox's
mounts into each new one (mounts grow N²).

**Limits.** Memory, PIDs and CPU are cgroup v1 groups per sandbox (:mod:`.cgroups`); the
sandbox's init joins them before it starts anything (bwrap waits on ``--block-fd``
until the controller has moved it). The workspace's disk quota is its upper tmpfs's
size; ``/tmp``'s is its tmpfs's. No network unless ``network=True``: the sandbox has
its own network namespace with only a loopback.

**Commands.** One ``exec`` at a time per sandbox. On timeout every process of the
command is killed (all members of the sandbox's cgroup but the shell: a command that
``setsid``\\ s away is caught too) and the shell stays; if the shell itself is what hangs
(a busy builtin loop) or dies (``exit``, the OOM killer), the sandbox's processes are
restarted on the same workspace and the result says ``shell_restarted``. By default
processes a command leaves in the background are killed when it returns
(``keep_background=False``): a fork bomb or a leaked server cannot outlive its step.

**Fork** copies the workspace (one snapshot, then each child's own empty upper over the
same frozen layers, see :mod:`.layers`) and the shell's state (captured with builtins and
replayed, see :mod:`.session`): cwd, variables, functions, aliases, options. Running
processes and ``/tmp`` are not copied.

**Without isolation** (no bwrap, no right to mount, no cgroups: see :func:`.probe`),
:meth:`Sandbox.create` raises :class:`SandboxUnavailableError` saying why, unless the
config says ``allow_unisolated=True``: then the shell is a plain local bash in a
directory copied from the workspace, without limits, and ``isolated`` is ``False``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import errno
import functools
import json
import os
import posixpath
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envport.procs import owner_alive, owner_tag, parse_owner
from envport.sandbox import mounts
from envport.sandbox.beneath import open_beneath
from envport.sandbox.cgroups import CgroupSet, own_cgroups
from envport.sandbox.config import (
    TIMEOUT_EXIT_CODE,
    ExecResult,
    SandboxClosedError,
    SandboxConfig,
    SandboxError,
    SandboxFailure,
    SandboxPathError,
    SandboxUnavailableError,
)
from envport.sandbox.confine import confinement_args
from envport.sandbox.layers import MAX_LAYERS, Layer, copy_tree, fingerprint, is_empty, squash
from envport.sandbox.probe import probe
from envport.sandbox.procfs import proc_hardening_args

if TYPE_CHECKING:
    from envport.sandbox.pool import SandboxPool
from envport.sandbox.session import (
    CAPTURE_SCRIPT,
    OPTIONS_SCRIPT,
    ShellDied,
    ShellProcess,
    clean_script,
    close_fds,
    eval_line,
    replay_script,
)

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Seconds a timed-out command's shell gets, once the command's processes are killed,
#: to report back before the shell itself is deemed hung and restarted.
KILL_GRACE_S = 1.0
#: Seconds a sandbox may take to start (namespaces set up, the shell answering).
START_TIMEOUT_S = 30.0
#: The most a sandbox's /dev/shm holds (MB); never more than its /tmp.
SHM_MB = 64
MAX_READ_BYTES = 1024 * 1024
MAX_LIST_ENTRIES = 1000
_MERGED_USR = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_INTERNAL_CAP = 16 * 1024 * 1024
_MB = 1024 * 1024
#: A fresh shell's options (isolated -> OPTIONS_SCRIPT output), learned once per process.
_FRESH_OPTIONS: dict[bool, str] = {}


class SandboxStatus(enum.Enum):
    READY = "ready"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """A saved workspace: frozen layers (newest first), over the task's files if ``base``.

    Restorable by the sandbox that took it and by its forks, until all are closed.
    """

    id: str
    layers: tuple[Layer, ...]
    base: bool = True


def default_runtime_dir() -> Path:
    """``$ENVPORT_SANDBOX_DIR``, else ``envport-sandbox`` in the temp directory."""
    configured = os.environ.get("ENVPORT_SANDBOX_DIR")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "envport-sandbox"


_swept: set[Path] = set()


def cleanup_stale(runtime: Path | None = None) -> list[str]:
    """Remove what sandboxes of dead processes left in ``runtime`` (mounts, directories,
    cgroups): a controller killed with SIGKILL cannot clean up after itself. Entries are
    named after their owner's pid (``S<pid>-<id>``, ``L<pid>-<id>``, cgroup
    ``envport-<pid>-<id>``); only those whose pid is gone are touched. Returns their
    names. Run once per process and runtime directory by :meth:`Sandbox.create`."""
    runtime = runtime or default_runtime_dir()
    removed: list[str] = []
    entries = list(runtime.iterdir()) if runtime.is_dir() else []
    for entry in entries:
        owner = parse_owner(entry.name[1:])
        if entry.name[:1] not in "SL" or owner is None or owner_alive(*owner):
            continue
        with contextlib.suppress(OSError):
            mounts.unmount_all(entry)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    for directory in own_cgroups().values():
        for group in directory.glob("envport-*"):
            owner = parse_owner(group.name[len("envport-") :])
            if owner is not None and not owner_alive(*owner):
                with contextlib.suppress(OSError):
                    CgroupSet({"any": group}).remove(timeout_s=1.0)
                    removed.append(group.name)
    return removed


@dataclasses.dataclass
class _Resources:
    """Everything a sandbox holds on the host; :meth:`teardown` releases it all, once."""

    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    shell: ShellProcess | None = None
    init_pid: int | None = None
    cgroup: CgroupSet | None = None
    layers: set[Layer] = dataclasses.field(default_factory=set)
    mounted: bool = False

    def stop_processes(self) -> None:
        if self.shell is not None:
            self.shell.close()
            self.shell = None
        proc, self.proc = self.proc, None
        if proc is not None:
            if self.init_pid is not None:
                # The sandbox's init: its death kills the whole PID namespace, and bwrap's
                # monitor reaps it and exits (killing the monitor first would orphan it).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.init_pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2.0)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # unisolated: the shell's group
            if proc.poll() is None:
                # Still there: a start cancelled before bwrap reported its init (so no
                # init to kill), bwrap waiting on its block fd. --die-with-parent takes
                # the sandbox down with it.
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        self.init_pid = None

    def teardown(self) -> None:
        """Release everything, each step even if an earlier one failed; then raise the
        first failure, if any."""
        errors: list[BaseException] = []

        def attempt(step: Callable[[], object]) -> None:
            try:
                step()
            except Exception as exc:
                errors.append(exc)

        attempt(self.stop_processes)
        if self.cgroup is not None:
            attempt(self.cgroup.remove)
            self.cgroup = None
        if self.mounted:
            attempt(lambda: mounts.unmount_all(self.dir))
        attempt(lambda: shutil.rmtree(self.dir, ignore_errors=True))
        layers, self.layers = self.layers, set()
        for layer in layers:
            attempt(layer.release)
        with contextlib.suppress(OSError):
            self.dir.parent.rmdir()  # the runtime directory, once nothing is left in it
        if errors:
            raise errors[0]


class Sandbox:
    """An isolated bash with a workspace; create with ``await Sandbox.create(config)``.

    Use as ``async with await Sandbox.create(cfg) as sb:`` or close it with
    :meth:`close` (idempotent; leaves no process, mount, cgroup or directory).
    """

    def __init__(self, config: SandboxConfig, *, isolated: bool, bwrap: str | None) -> None:
        self.config = config
        self.id = f"{owner_tag()}-{secrets.token_hex(4)}"
        self.isolated = isolated
        self.status = SandboxStatus.READY
        self._bwrap = bwrap
        self._runtime = config.runtime_dir or default_runtime_dir()
        self._res = _Resources(self._runtime / f"S{self.id}")
        self._finalizer = weakref.finalize(self, _Resources.teardown, self._res)
        self._lock = asyncio.Lock()
        self._gen = 0
        self._upper: Path | None = None
        self._stale: list[Path] = []
        self._chain: Snapshot = Snapshot("initial", ())
        self.initial: Snapshot = self._chain
        self._held: dict[str, Snapshot] = {}
        self._shell_pid: int | None = None
        #: (upper, its fingerprint, the snapshot taken of it): a repeat is free.
        self._last_snapshot: tuple[Path, frozenset[Any], Snapshot] | None = None
        self._pass_fds: tuple[int, ...] = ()
        self._shell_limits: str | None = None
        self._shell_std: set[str] = set()  # what the shell's fds 0-2 were at its start
        #: Why the last reset restarted the sandbox's processes instead of cleaning the
        #: shell in place (``None``: in place).
        self.reset_restarted: str | None = None
        self.restarts = 0
        #: The pool this sandbox came from; its forks come from there too.
        self.pool: SandboxPool | None = None

    # --- creation ----------------------------------------------------------------------

    @classmethod
    async def create(
        cls, config: SandboxConfig | None = None, *, pass_fds: tuple[int, ...] = (), **fields: Any
    ) -> Sandbox:
        """Start a sandbox (``fields`` build a :class:`SandboxConfig` if none is given).

        ``pass_fds``: descriptors the first shell inherits, under the same numbers (a
        listening socket the controller made outside); a restarted shell does not get
        them, and the first command should hand them on and close them in the shell."""
        config = config or SandboxConfig(**fields)
        isolation = await asyncio.to_thread(probe)
        runtime = config.runtime_dir or default_runtime_dir()
        if runtime not in _swept:
            _swept.add(runtime)
            await asyncio.to_thread(cleanup_stale, runtime)
        if not isolation.isolated and not config.allow_unisolated:
            raise SandboxUnavailableError(
                f"cannot isolate a sandbox on this machine: {isolation.explain()}. Fix that, "
                "or pass allow_unisolated=True to run commands as plain local processes "
                "(no namespaces, no limits, no network isolation).",
                problems=list(isolation.problems),
            )
        return await cls._start(
            config, isolation.isolated, isolation.bwrap, None, None, pass_fds=pass_fds
        )

    @classmethod
    async def _start(
        cls,
        config: SandboxConfig,
        isolated: bool,
        bwrap: str | None,
        parent: Sandbox | None,
        snapshot: Snapshot | None,
        *,
        pass_fds: tuple[int, ...] = (),
    ) -> Sandbox:
        sb = cls(config, isolated=isolated, bwrap=bwrap)
        sb._pass_fds = pass_fds
        try:
            sb._res.dir.mkdir(mode=0o700, parents=True)
            if parent is not None:
                sb.initial = parent.initial
                for snap in [parent.initial, *parent._held.values()]:
                    sb._hold(snap)
            start = snapshot or sb.initial
            sb._hold(start)
            if isolated:
                sb._make_root()
                sb._res.cgroup = CgroupSet.create(
                    f"envport-{sb.id}",
                    memory_mb=config.memory_mb,
                    pids=config.pids,
                    cpus=config.cpus,
                )
            await asyncio.to_thread(sb._mount_workspace, start)
            await sb._start_shell()
        except BaseException:
            sb._finalizer()
            raise
        return sb

    async def _rebind(
        self, config: SandboxConfig, parent: Sandbox | None, snapshot: Snapshot | None
    ) -> None:
        """Give a pre-started sandbox its task: ``config`` (the same shape, maybe another
        workspace), the parent's snapshots, and ``snapshot``'s workspace (default: the
        task's initial one). A few mounts and one shell round trip."""
        self.config = config
        if parent is not None:
            self.initial = parent.initial
            for snap in [parent.initial, *parent._held.values()]:
                self._hold(snap)
        start = snapshot or self.initial
        self._hold(start)
        if self.isolated:
            (self._res.dir / "empty").mkdir(exist_ok=True)
            self._swap_workspace(start)
        else:
            await asyncio.to_thread(self._copy_dir_workspace, start)
        self._chain = start
        await self._internal(f"cd -- {shlex.quote(self._shell_cwd())}")
        self._drop_stale()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        mode = "isolated" if self.isolated else "UNISOLATED"
        return f"<Sandbox {self.id} {mode} {self.status.value}>"

    # --- paths -------------------------------------------------------------------------

    @property
    def workdir(self) -> str:
        return self.config.workdir

    @property
    def host_workdir(self) -> Path:
        """Where the workspace is on the host (the live merged view)."""
        if self.isolated:
            return self._res.dir / "root" / self.workdir.lstrip("/")
        return self._res.dir / "ws"

    @property
    def _base(self) -> Path:
        return self.config.workspace or self._res.dir / "empty"

    # --- commands ----------------------------------------------------------------------

    async def exec(
        self, command: str, timeout_s: float | None = None, *, fresh_shell: bool = False
    ) -> ExecResult:
        """Run ``command`` in the shell (``cd``/variables persist); never raises for what
        the command does: its failure, timeout or death are in the result.

        ``fresh_shell=True`` first replaces the sandbox's processes with a new shell in
        the workdir (as a shell restart does: the workspace is kept; cwd, variables,
        functions, background processes and ``/tmp`` are not), so nothing an earlier
        command did to the shell (a ``printf`` function, a trap, a disabled builtin, a
        process watching it) can change how this one runs or what it reports. Graders use
        it: the persistent shell is the agent's and cannot be trusted to report a test's
        exit status. It costs a sandbox start (tens of ms)."""
        self._check_open()
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        if not limit > 0:
            raise SandboxError(f"timeout_s must be positive, got {timeout_s!r}")
        async with self._lock:
            self._check_open()
            if fresh_shell:
                await self._restart_shell(count=False)
            return await self._exec(command, limit)

    async def _exec(self, command: str, timeout_s: float) -> ExecResult:
        shell = self._res.shell
        assert shell is not None
        started = time.perf_counter()
        ooms = self._res.cgroup.oom_kills() if self._res.cgroup else 0
        try:
            t_out, t_err, out, err = shell.send(eval_line(command))
        except ShellDied:
            await self._restart_shell()
            return await self._exec(command, timeout_s)
        tasks = {t_out, t_err}
        timed_out = False
        _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        if pending:
            timed_out = True
            deadline = time.monotonic() + KILL_GRACE_S
            while pending and time.monotonic() < deadline:  # what follows may start more
                await self._kill_strays()
                _done, pending = await asyncio.wait(pending, timeout=0.05)
        status: int | None = None
        if not pending and not any(t.exception() for t in tasks):
            status = int(t_out.result() or b"-1")
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        notes: list[str] = []
        restarted = False
        if status is None:  # the shell died, or hung past the grace
            code = -1 if timed_out else await asyncio.to_thread(self._shell_exit_status)
            restarted = True
            await self._restart_shell()
            if timed_out:
                notes.append("the shell did not come back after the command was killed")
            else:
                status = code
                notes.append(f"the shell exited (status {code})")
            notes.append("a fresh shell was started in the workdir: files are kept, cwd and "
                         "variables are not")  # fmt: skip
        elif not self.config.keep_background and await self._kill_strays():
            # Reap the killed jobs now, so bash's "Killed" notices go nowhere instead of
            # into the next command's stderr.
            await self._internal("wait 2>/dev/null")
        oom = bool(self._res.cgroup and self._res.cgroup.oom_kills() > ooms)
        if oom:
            notes.insert(0, f"killed: out of memory (limit {self.config.memory_mb} MB)")
        if timed_out:
            notes.insert(0, f"killed after its {timeout_s:g} s timeout")
            status = TIMEOUT_EXIT_CODE
        stderr = err.text()
        for note in notes:
            stderr += (
                "\n" if stderr and not stderr.endswith("\n") else ""
            ) + f"[envport: {note}]\n"
        stdout = out.text()
        for cap in (out, err):
            if cap.dropped:
                where = "stdout" if cap is out else "stderr"
                stderr += f"[envport: {cap.dropped} more bytes of {where} dropped]\n"
        assert status is not None
        return ExecResult(
            exit_code=status,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            truncated=bool(out.dropped or err.dropped),
            oom_killed=oom,
            shell_restarted=restarted,
            duration_s=time.perf_counter() - started,
        )

    # --- files -------------------------------------------------------------------------

    def host_path(self, path: str) -> Path:
        """Where sandbox path ``path`` (absolute, or relative to the workdir) is on the
        host; :class:`SandboxPathError` unless it lies in the workspace.

        Only a check, as of now: the sandbox may swap a component for a symlink the next
        moment. The file methods below open through :func:`.beneath.open_beneath`."""
        rel = self._workspace_rel(path)
        root = self.host_workdir
        target = root / rel
        if not target.resolve().is_relative_to(root.resolve()):
            raise self._escapes(path)
        return target

    def _workspace_rel(self, path: str) -> str:
        """``path`` relative to the workdir (``""`` for the workdir itself), lexically."""
        if not path:
            raise SandboxPathError("empty path")
        full = path if path.startswith("/") else posixpath.join(self.workdir, path)
        norm = "/" + posixpath.normpath(full).lstrip("/")
        if norm != self.workdir and not norm.startswith(self.workdir + "/"):
            raise SandboxPathError(
                f"{path!r} is outside the workspace {self.workdir}; the file tools reach only "
                "the workspace (run a shell command for anything else)"
            )
        return norm[len(self.workdir) :].lstrip("/")

    def _escapes(self, path: str) -> SandboxPathError:
        return SandboxPathError(
            f"{path!r} leads (through a symlink) outside the workspace {self.workdir}"
        )

    def _open(self, path: str, flags: int, mode: int = 0o666, *, rel: str | None = None) -> int:
        """A descriptor of workspace path ``path`` (or of ``rel``, relative to the workdir,
        on the way to it), opened as root on the host but never outside the workspace,
        whatever the sandbox swaps meanwhile (:mod:`.beneath`): symlinks are followed only
        while they stay in it (else :class:`SandboxPathError`). ``FileNotFoundError`` if a
        component is missing (or not a directory)."""
        if rel is None:
            try:
                self.host_path(path)  # a plain escape, named plainly; a swap after is the open's
            except SandboxPathError:
                raise
            except OSError:
                pass  # the path changing under the check: the open decides
            rel = self._workspace_rel(path)
        root = os.open(self.host_workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return open_beneath(root, rel, flags, mode)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.ELOOP):
                raise self._escapes(path) from None
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise FileNotFoundError(f"{path}: no such file in the sandbox") from None
            raise
        finally:
            os.close(root)

    async def read_file(self, path: str, *, max_bytes: int = MAX_READ_BYTES) -> str:
        """A text file's content (``FileNotFoundError`` if missing)."""
        return (await self.read_bytes(path, max_bytes=max_bytes)).decode("utf-8", "replace")

    async def read_bytes(self, path: str, *, max_bytes: int = MAX_READ_BYTES) -> bytes:
        self._check_open()

        def read() -> bytes:
            # O_NONBLOCK: a fifo swapped in must not hang the reading thread
            fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise SandboxError(f"cannot read {path!r}: not a regular file")
                if st.st_size > max_bytes:
                    raise SandboxError(
                        f"{path!r} is {st.st_size} bytes, over the {max_bytes}-byte read "
                        "limit; read part of it with exec(), e.g. `head -c 10000 FILE`"
                    )
                chunks, left = [], max_bytes + 1  # a file still growing: no more than that
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    chunks.append(chunk)
                    left -= len(chunk)
                return b"".join(chunks)[:max_bytes]
            finally:
                os.close(fd)

        return await asyncio.to_thread(read)

    async def write_file(self, path: str, content: str | bytes, *, mode: int | None = None) -> int:
        """Write a file (parents created); returns the bytes written."""
        self._check_open()
        rel = self._workspace_rel(path)
        data = content.encode("utf-8") if isinstance(content, str) else content

        def write() -> None:
            try:
                self._make_dirs(path, posixpath.dirname(rel))
                fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK
                                | os.O_NOCTTY)  # fmt: skip
            except FileNotFoundError:  # a component is a file
                raise SandboxError(f"cannot write {path!r}: a parent is not a directory") from None
            except IsADirectoryError:
                raise SandboxError(f"cannot write {path!r}: it is a directory") from None
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # a fifo without a reader
                    raise SandboxError(f"cannot write {path!r}: not a regular file") from None
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise SandboxError(f"cannot write {path!r}: not a regular file")
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    if mode is not None:
                        os.fchmod(fd, mode)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)  # no partial file left behind
                    raise
            finally:
                os.close(fd)

        try:
            await asyncio.to_thread(write)
        except SandboxError:
            raise
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise SandboxError(
                    f"cannot write {path!r}: the workspace is full (disk_mb={self.config.disk_mb})"
                ) from exc
            raise SandboxError(f"cannot write {path!r}: {exc.strerror or exc}") from exc
        return len(data)

    def _make_dirs(self, path: str, parent: str) -> None:
        """``mkdir -p`` of workspace directory ``parent`` (relative), each directory made
        in its parent as opened beneath the workspace."""
        parts = [p for p in parent.split("/") if p]
        for i in range(len(parts)):
            here = "/".join(parts[: i + 1])
            try:
                os.close(self._open(path, os.O_PATH | os.O_DIRECTORY, rel=here))
                continue
            except FileNotFoundError:
                pass
            up = self._open(path, os.O_PATH | os.O_DIRECTORY, rel="/".join(parts[:i]))
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(parts[i], 0o777, dir_fd=up)
            finally:
                os.close(up)

    async def list_dir(self, path: str = ".") -> list[dict[str, Any]]:
        """Entries of a directory: name, type (file, dir, symlink, other) and size."""
        self._check_open()
        try:
            fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise SandboxError(f"cannot list {path!r}: not a directory") from None
        except NotADirectoryError:
            raise SandboxError(f"cannot list {path!r}: not a directory") from None
        try:
            with os.scandir(fd) as found:  # names and lstat relative to fd: no path
                listed = sorted(found, key=lambda e: e.name)[:MAX_LIST_ENTRIES]
            entries = []
            for entry in listed:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone meanwhile
                kind = ("symlink" if stat.S_ISLNK(st.st_mode) else "dir"
                        if stat.S_ISDIR(st.st_mode) else "file"
                        if stat.S_ISREG(st.st_mode) else "other")  # fmt: skip
                size = st.st_size if kind == "file" else None
                entries.append({"name": entry.name, "type": kind, "size": size})
            return entries
        finally:
            os.close(fd)

    # --- snapshot, restore, reset, fork ------------------------------------------------

    async def snapshot(self) -> Snapshot:
        """Save the workspace's current state; restore it later with :meth:`restore`."""
        self._check_open()
        async with self._lock:
            self._check_open()
            return await self._snapshot()

    async def _snapshot(self) -> Snapshot:
        try:
            return await self._take_snapshot()
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise SandboxError(
                    f"cannot snapshot sandbox {self.id}: no room for the copy ({exc})"
                ) from exc
            raise SandboxFailure(f"cannot snapshot sandbox {self.id}: {exc}") from exc

    async def _take_snapshot(self) -> Snapshot:
        sid = secrets.token_hex(6)
        if not self.isolated:
            layer = Layer.create(self._runtime, size_bytes=0, tmpfs=False)
            try:
                await asyncio.to_thread(copy_tree, self.host_workdir, layer.data)
            except BaseException:
                layer.destroy()
                raise
            snap = Snapshot(sid, (layer,), base=False)
            self._hold(snap)
            return snap
        assert self._upper is not None
        upper = self._upper / "upper"
        if is_empty(upper):
            snap = Snapshot(sid, self._chain.layers, self._chain.base)
            self._hold(snap)
            return snap
        # Nothing changed since the last snapshot of this upper: that one still holds.
        print_ = await asyncio.to_thread(fingerprint, upper)
        last = self._last_snapshot
        if print_ is not None and last is not None and last[0] == self._upper and last[1] == print_:
            return last[2]
        chain = self._chain.layers
        if len(chain) + 1 > MAX_LAYERS:
            # Flatten the snapshot layers (never the task's files under them) into one.
            size = sum(_used_bytes(layer.path) for layer in chain if layer.tmpfs) + _MB
            merged = Layer.create(self._runtime, size_bytes=size)
            try:
                await asyncio.to_thread(squash, [layer.data for layer in chain], merged.data)
            except BaseException:
                merged.destroy()
                raise
            merged.hold()  # this sandbox's, until it closes, like every layer it made
            self._res.layers.add(merged)
            chain = (merged,)
        # The upper holds at most disk_mb (holes are kept): so does its copy.
        layer = Layer.create(self._runtime, size_bytes=self.config.disk_mb * _MB + _MB)
        try:
            await asyncio.to_thread(copy_tree, upper, layer.data)
        except BaseException:
            layer.destroy()
            raise
        snap = Snapshot(sid, (layer, *chain), self._chain.base)
        self._hold(snap)
        if print_ is not None:
            self._last_snapshot = (self._upper, print_, snap)
        return snap

    async def restore(self, snapshot: Snapshot | str) -> None:
        """Put the workspace back to ``snapshot`` (a :class:`Snapshot` or its id). The shell
        keeps running and its variables; it moves to the same directory in the restored
        tree (or the workdir if that is gone); background processes are killed."""
        self._check_open()
        snap = self._find(snapshot)
        async with self._lock:
            self._check_open()
            await self._restore(snap)
            await self._internal(f'cd -- "$PWD" 2>/dev/null || cd -- {shlex.quote(self.workdir)}')
            self._drop_stale()

    async def _restore(self, snap: Snapshot) -> None:
        await self._kill_strays()
        if self.isolated:
            self._swap_workspace(snap)
        else:
            await asyncio.to_thread(self._copy_dir_workspace, snap)
        self._chain = snap

    async def reset(self, snapshot: Snapshot | str | None = None) -> None:
        """Back to the task's initial state: the initial workspace (or ``snapshot``'s), an
        empty ``/tmp`` and ``/dev/shm``, a fresh shell (its initial variables, in the
        workdir).

        Nothing else restarts when the shell can be cleaned in place with builtins
        (variables and functions unset; options, aliases, traps back to a fresh shell's;
        disabled builtins enabled again). Where it cannot (a read-only variable, a
        function named after a builtin, a descriptor the shell holds open, a changed
        ``ulimit``, System V IPC objects), the sandbox's processes are restarted (as a
        shell restart, tens of ms), so none of that reaches the next episode."""
        self._check_open()
        target = self.initial if snapshot is None else self._find(snapshot)
        async with self._lock:
            self._check_open()
            await self._restore(target)
            if self.isolated:
                self._clear_tmp()
            script = None
            # One round trip: the shell's state, then what else an episode may leave.
            leftovers_script = _LEFTOVERS_SCRIPT if self.isolated else _DISABLED_SCRIPT
            _, out = await self._internal(
                f"{CAPTURE_SCRIPT}; printf '\\n%s\\n' {_LEFTOVERS}; {leftovers_script}"
            )
            captured, found, leftovers = out.rpartition(f"\n{_LEFTOVERS}\n")
            # After a raw internal line: the copy of its input bash keeps while an eval'd
            # command's stdin is redirected is closed by now.
            dirty = self._shell_dirty() if found else "no leftovers report"
            if dirty is not None and dirty.startswith("open descriptors"):
                # bash may not have undone a redirection's copy of a descriptor yet (seen
                # once in four runs of a loaded machine); a descriptor the episode
                # opened itself is still there after one more raw line
                await self._internal(":")
                dirty = self._shell_dirty()
            self.reset_restarted = dirty
            if dirty is None:
                options = _FRESH_OPTIONS.get(self.isolated)
                ipc = any(line.startswith("ipc") for line in leftovers.splitlines())
                traps = any(name != "EXIT" for name in _TRAP_LINE.findall(leftovers))
                shadows = _shadows_builtins(captured)
                if options is None or shadows or ipc or traps:
                    self.reset_restarted = (
                        "a function named after a builtin" if shadows
                        else "System V IPC objects" if ipc
                        else "traps set" if traps
                        else "no fresh shell's options known"
                    )  # fmt: skip
                else:
                    try:
                        script = clean_script(
                            captured, self._shell_env(), options, self._shell_cwd()
                        )
                    except ValueError:  # not what CAPTURE_SCRIPT prints
                        self.reset_restarted = "a state report it could not read"
                    disabled = [line.split()[-1] for line in leftovers.splitlines()
                                if line.startswith("enable -n ")]  # fmt: skip
                    if script is not None and disabled:
                        script = f"enable -- {' '.join(map(shlex.quote, disabled))}\n{script}"
            if script is not None:  # builtins only: no process started
                await self._internal(script)
                # ... by the controller. The agent's shell ran the capture (an alias under
                # expand_aliases, a PS4 under xtrace may start processes there); its
                # state is a fresh shell's now, so what is left is killed for good.
                if await self._kill_strays():
                    await self._internal("wait 2>/dev/null")
            else:
                await self._restart_shell(count=False)
            self._drop_stale()

    async def fork(self, n: int = 1) -> list[Sandbox]:
        """``n`` new sandboxes that continue from this one's current state: the workspace,
        and the shell's cwd, variables, functions, aliases and options. Running processes
        and ``/tmp`` are not copied. Each child is independent and must be closed."""
        self._check_open()
        if n < 1:
            raise SandboxError(f"fork needs n >= 1, got {n}")
        async with self._lock:
            self._check_open()
            _, captured = await self._internal(CAPTURE_SCRIPT)
            state = replay_script(captured)
            snap = await self._snapshot()
        results = await asyncio.gather(
            *(self._fork_one(snap, state) for _ in range(n)), return_exceptions=True
        )
        children = [r for r in results if isinstance(r, Sandbox)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for child in children:
                await child.close()
            raise SandboxFailure(f"fork failed: {failed[0]}") from failed[0]
        return children

    async def _fork_one(self, snap: Snapshot, state: str) -> Sandbox:
        if self.pool is not None and self.pool.serves(self.config):
            child = await self.pool.take(self.config, parent=self, snapshot=snap)
        else:
            child = await Sandbox._start(self.config, self.isolated, self._bwrap, self, snap)
        try:
            await child._internal(state)
        except BaseException:
            await child.close()
            raise
        return child

    async def shell_state(self) -> str:
        """The shell's state as bash source (what :meth:`fork` replays into children)."""
        self._check_open()
        async with self._lock:
            self._check_open()
            _, captured = await self._internal(CAPTURE_SCRIPT)
        return replay_script(captured)

    # --- lifecycle ---------------------------------------------------------------------

    async def close(self) -> None:
        """Kill every process, remove cgroups, mounts and files (idempotent)."""
        if self.status is SandboxStatus.CLOSED:
            return
        self.status = SandboxStatus.CLOSED
        self._finalizer()

    def stats(self) -> dict[str, Any]:
        """Live figures: processes, memory charged to the sandbox's cgroup, and the
        bytes its tmpfs file systems hold (workspace changes, /tmp, the root skeleton)."""
        cgroup = self._res.cgroup
        tmpfs: dict[str, int | None] = {"workspace_bytes": None, "tmp_bytes": None}
        tmp = self._sandbox_tmp()
        if self.isolated and tmp is not None:
            with contextlib.suppress(OSError):
                tmpfs = {
                    "workspace_bytes": _used_bytes(self._res.dir),
                    "tmp_bytes": _used_bytes(tmp),
                }
        return {
            **tmpfs,
            "pids": len(cgroup.pids()) if cgroup else None,
            "memory_bytes": cgroup.memory_bytes() if cgroup else None,
            "oom_kills": cgroup.oom_kills() if cgroup else None,
            "restarts": self.restarts,
            "isolated": self.isolated,
        }

    @property
    def init_pid(self) -> int | None:
        """Host pid of the sandbox's init: ``/proc/<it>/root`` is the sandbox's ``/``
        as the host reaches it (``None`` when unisolated)."""
        return self._res.init_pid

    def process_ids(self) -> list[int]:
        """Host pids of the sandbox's processes (bwrap's monitor included)."""
        proc = self._res.proc
        pids = [proc.pid] if proc is not None else []
        if self._res.cgroup is not None:
            pids += self._res.cgroup.pids()
        elif self._shell_pid is not None:
            pids += [self._shell_pid, *_descendants(self._shell_pid)]
        return sorted(set(pids))

    # --- internals: workspace ----------------------------------------------------------

    def _hold(self, snap: Snapshot) -> None:
        if snap.id != "initial" and snap.id not in self._held:
            self._held[snap.id] = snap
        for layer in snap.layers:
            if layer not in self._res.layers:
                layer.hold()
                self._res.layers.add(layer)

    def _find(self, snapshot: Snapshot | str) -> Snapshot:
        sid = snapshot if isinstance(snapshot, str) else snapshot.id
        if sid == "initial":
            return self.initial
        found = self._held.get(sid)
        if found is None:
            known = ", ".join(sorted(self._held)) or "(none)"
            raise SandboxError(
                f"unknown snapshot {sid!r} for sandbox {self.id}; it can restore: initial, {known}"
            )
        return found

    def _make_root(self) -> None:
        state = self._res.dir
        self._res.mounted = True
        mounts.mount_tmpfs(state, size_bytes=self.config.disk_mb * _MB + _MB, mode="0700",
                           name="envport-sandbox")  # fmt: skip
        mounts.make_shared(state)
        root = state / "root"
        root.mkdir(mode=0o755)
        for name in ("usr", "etc", "proc", "dev", "tmp"):
            (root / name).mkdir()
        for name in _MERGED_USR:
            if os.path.islink(name):
                (root / name.lstrip("/")).symlink_to(os.readlink(name))
            elif os.path.isdir(name):
                (root / name.lstrip("/")).mkdir()
        for inside in self.config.ro_binds:
            (root / inside.lstrip("/")).mkdir(parents=True, exist_ok=True)
        self.host_workdir.mkdir(parents=True, exist_ok=True)

    def _sandbox_tmp(self) -> Path | None:
        """The sandbox's /tmp (bwrap's own tmpfs), reached through its init's root."""
        init = self._res.init_pid
        return None if init is None else Path(f"/proc/{init}/root/tmp")

    def _clear_tmp(self) -> None:
        tmp = self._sandbox_tmp()
        if tmp is None:
            return
        for path in (tmp, tmp.parent / "dev" / "shm"):
            _empty_dir(path)

    def _shell_dirty(self) -> str | None:
        """Why the shell cannot be cleaned in place, seen from outside it: descriptors
        it holds beyond 0-2 (``exec 7>file``), resource limits it changed (a hard
        ``ulimit`` cannot be raised back without privileges). ``None`` if neither."""
        pid = self._shell_pid
        if pid is None:
            return None
        try:
            fds = _extra_fds(pid, self._shell_std)
            limits = _limits_of(pid)
        except OSError:
            return "the shell is gone"
        if fds:
            return f"open descriptors {fds}"
        if self._shell_limits is not None and limits != self._shell_limits:
            return "changed resource limits"
        return None

    def _drop_stale(self) -> None:
        """Delete the upper layers that restores replaced (the shell has left them)."""
        stale, self._stale = self._stale, []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)

    def _mount_workspace(self, snap: Snapshot) -> None:
        if self.config.workspace is None:
            (self._res.dir / "empty").mkdir(exist_ok=True)
        if self.isolated:
            self._swap_workspace(snap)
        else:
            self.host_workdir.mkdir()
            self._copy_dir_workspace(snap)
        self._chain = snap

    def _swap_workspace(self, snap: Snapshot) -> None:
        """A fresh empty upper over ``snap``'s layers, replacing the mounted overlay (the
        old upper is deleted by :meth:`_drop_stale` once the shell has left it)."""
        self._gen += 1
        upper = self._res.dir / f"u{self._gen}"
        upper.mkdir(mode=0o700)
        (upper / "upper").mkdir(mode=0o755)
        (upper / "work").mkdir()
        target = self.host_workdir
        old = self._upper
        if old is not None:
            mounts.umount(target)
            self._stale.append(old)
        lowers = [layer.data for layer in snap.layers] + ([self._base] if snap.base else [])
        mounts.mount_overlay(target, lowers, upper / "upper", upper / "work")
        self._upper = upper

    def _copy_dir_workspace(self, snap: Snapshot) -> None:
        """Unisolated: the workspace directory becomes a copy of ``snap``."""
        target = self.host_workdir
        for entry in list(target.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        source = snap.layers[0].data if snap.layers else self._base
        copy_tree(source, target)

    # --- internals: processes ----------------------------------------------------------

    def _shell_env(self) -> dict[str, str]:
        env = {
            "PATH": SANDBOX_PATH if self.isolated else os.environ.get("PATH", SANDBOX_PATH),
            "HOME": self._shell_cwd(),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "ENVPORT_WORKSPACE": self._shell_cwd(),
            # An agent that edits a module and reruns its tests within one second, with
            # a same-sized fix, would otherwise import the stale .pyc (its source stamp
            # is mtime seconds + size); no __pycache__ in snapshots and forks either.
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        if not self.isolated:
            env["ENVPORT_UNISOLATED"] = "1"
        return {**env, **self.config.env}

    def _shell_cwd(self) -> str:
        return self.workdir if self.isolated else str(self.host_workdir)

    def _bwrap_argv(self, info_fd: int, block_fd: int) -> list[str]:
        assert self._bwrap is not None
        cfg = self.config
        args = [self._bwrap, "--die-with-parent", *confinement_args(self._bwrap),
                "--hostname", "sandbox"]  # fmt: skip
        if cfg.network:
            args.append("--share-net")
        args.append("--clearenv")
        for key, value in self._shell_env().items():
            args += ["--setenv", key, value]
        args += ["--bind", str(self._res.dir / "root"), "/"]
        args += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        for name in _MERGED_USR:
            if not os.path.islink(name) and os.path.isdir(name):
                args += ["--ro-bind", name, name]
        args += ["--proc", "/proc", *proc_hardening_args()]
        # /dev: bwrap's tmpfs of device nodes, read-only (it was writable and unlimited);
        # /dev/shm: its own tmpfs, as big as /tmp at most, emptied on reset.
        args += ["--dev", "/dev", "--size", str(min(cfg.tmp_mb, SHM_MB) * _MB)]
        args += ["--perms", "1777", "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        args += ["--size", str(cfg.tmp_mb * _MB), "--perms", "1777", "--tmpfs", "/tmp"]
        # After /tmp: a bind under /tmp (a venv in a CI checkout there) must land on the
        # sandbox's tmpfs, not be hidden by it.
        for inside, host in cfg.ro_binds.items():
            args += ["--ro-bind", str(host), inside]
        args += ["--remount-ro", "/"]
        args += ["--chdir", self.workdir, "--info-fd", str(info_fd), "--block-fd", str(block_fd)]
        return [*args, *_default_signals(), *_SHELL]

    async def _start_shell(self) -> None:
        cap = self.config.max_output_bytes
        extra, self._pass_fds = self._pass_fds, ()  # the first shell's only
        if not self.isolated:
            proc = _spawn(
                [*_default_signals(), *_SHELL],
                cwd=self.host_workdir,
                env=self._shell_env(),
                start_new_session=True,
                pass_fds=extra,
            )
            self._res.proc = proc
            self._shell_pid = proc.pid
        else:
            r_info, w_info = os.pipe()
            r_block, w_block = os.pipe()
            try:
                proc = _spawn(
                    self._bwrap_argv(w_info, r_block),
                    pass_fds=(w_info, r_block, *extra),
                )
                self._res.proc = proc
                close_fds(w_info, r_block)
                w_info = r_block = -1
                try:
                    async with asyncio.timeout(START_TIMEOUT_S):
                        info = await _read_json_fd(r_info)
                except TimeoutError:
                    raise SandboxFailure(
                        f"bwrap did not set up the sandbox within {START_TIMEOUT_S:g} s"
                    ) from None
                if info is None:
                    raise SandboxFailure(f"bwrap could not start the sandbox: {_stderr_of(proc)}")
                init = int(info["child-pid"])
                self._res.init_pid = init
                assert self._res.cgroup is not None
                try:
                    self._res.cgroup.add(init)
                except OSError as exc:  # bwrap gave up setting up (a bind it cannot make)
                    raise SandboxFailure(
                        f"bwrap could not start the sandbox: {_stderr_of(proc) or exc}"
                    ) from exc
                os.write(w_block, b"1")
            finally:
                close_fds(*(fd for fd in (r_info, w_info, r_block, w_block) if fd >= 0))
        shell = ShellProcess(proc, cap=cap)
        self._res.shell = shell
        await shell.attach()
        try:
            await shell.run_internal(":", timeout_s=START_TIMEOUT_S)
        except ShellDied as exc:
            detail = (str(exc) or _stderr_of(proc)) if self.isolated else ""
            if detail:  # bwrap failed setting up after its init had started
                raise SandboxFailure(f"bwrap could not start the sandbox: {detail}") from exc
            raise SandboxFailure(f"the sandbox's shell did not start: {exc!r}") from exc
        except TimeoutError as exc:
            raise SandboxFailure(f"the sandbox's shell did not start: {exc!r}") from exc
        if self.isolated:
            assert self._res.init_pid is not None
            children = _children(self._res.init_pid)
            if not children:
                raise SandboxFailure("the sandbox's shell is not running under its init")
            self._shell_pid = children[0]
        if self._shell_pid is not None:
            self._shell_limits = _limits_of(self._shell_pid)
            self._shell_std = _std_pipes(self._shell_pid)
        if self.isolated not in _FRESH_OPTIONS:
            _FRESH_OPTIONS[self.isolated] = (await shell.run_internal(OPTIONS_SCRIPT))[1]

    async def _restart_shell(self, *, count: bool = True) -> None:
        self._check_open()
        if count:
            self.restarts += 1
        self._res.stop_processes()
        if self._res.cgroup is not None:
            await asyncio.to_thread(self._res.cgroup.kill_all)
        await self._start_shell()

    def _shell_exit_status(self) -> int:
        proc = self._res.proc
        if proc is None:
            return -1
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return -1
        return 128 - code if code < 0 else code

    async def _internal(self, script: str) -> tuple[int, str]:
        shell = self._res.shell
        assert shell is not None
        try:
            return await shell.run_internal(script, cap=_INTERNAL_CAP)
        except (ShellDied, TimeoutError):
            await self._restart_shell()
            raise SandboxFailure("the sandbox's shell died; it was restarted") from None

    async def _kill_strays(self) -> bool:
        """Kill every process in the sandbox but its init and shell; whether any was."""
        spare = {p for p in (self._res.init_pid, self._shell_pid) if p is not None}
        cgroup = self._res.cgroup
        if cgroup is not None:
            if any(p not in spare for p in cgroup.pids()):
                await asyncio.to_thread(cgroup.kill_all, spare=spare)
                return True
        elif self._shell_pid is not None:
            strays = _descendants(self._shell_pid)
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return bool(strays)
        return False

    def _check_open(self) -> None:
        if self.status is SandboxStatus.CLOSED:
            raise SandboxClosedError(f"sandbox {self.id} is closed")


async def _read_json_fd(fd: int) -> dict[str, Any] | None:
    """bwrap's ``--info-fd`` JSON (``None`` if it closed the pipe without any)."""
    loop = asyncio.get_running_loop()
    data = b""
    while b"}" not in data:
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _set_once, ready)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    parsed: dict[str, Any] = json.loads(data)
    return parsed


def _stderr_of(proc: subprocess.Popen[bytes]) -> str:
    """What a bwrap that failed to set up said (it exits at once after saying it)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    if proc.poll() is None or proc.stderr is None:
        return ""
    return proc.stderr.read().decode("utf-8", "replace").strip()


_LEFTOVERS = "__ENVPORT_LEFTOVERS__"
#: Disabled builtins (``enable -n NAME`` lines) and traps (``trap -p``: a ``CHLD``,
#: ``DEBUG`` or ``ERR`` trap runs the agent's code whenever the controller's own lines
#: run or a process ends, even between steps; cleaned in place, what it started would
#: reach the next episode, so a shell with any trap but ``EXIT`` is restarted instead).
_DISABLED_SCRIPT = "enable -n; trap -p"
#: The last line of each ``trap -p`` entry (bash quotes the body, so each ends so).
_TRAP_LINE = re.compile(r"' (\S+)$", re.M)
#: ... and an ``ipc`` line per kind of System V IPC object the sandbox has (builtins only).
_LEFTOVERS_SCRIPT = (
    "enable -n; trap -p; for __k in shm msg sem; do { read -r _; read -r __l; } "
    '< /proc/sysvipc/$__k && [ -n "$__l" ] && printf \'ipc %s\\n\' "$__k"; done; unset -v __k __l'
)
_BUILTINS = frozenset(
    [
        ".",
        ":",
        "[",
        "alias",
        "bg",
        "bind",
        "break",
        "builtin",
        "caller",
        "cd",
        "command",
        "compgen",
        "complete",
        "compopt",
        "continue",
        "declare",
        "dirs",
        "disown",
        "echo",
        "enable",
        "eval",
        "exec",
        "exit",
        "export",
        "false",
        "fc",
        "fg",
        "getopts",
        "hash",
        "help",
        "history",
        "jobs",
        "kill",
        "let",
        "local",
        "logout",
        "mapfile",
        "popd",
        "printf",
        "pushd",
        "pwd",
        "read",
        "readarray",
        "readonly",
        "return",
        "set",
        "shift",
        "shopt",
        "source",
        "suspend",
        "test",
        "times",
        "trap",
        "true",
        "type",
        "typeset",
        "ulimit",
        "umask",
        "unalias",
        "unset",
        "wait",
    ]
)
_FUNCTION_LINE = re.compile(r"^(\S+) \(\) $", re.M)


def _shadows_builtins(captured: str) -> bool:
    """Whether the captured state defines a function named after a builtin (``unset``,
    ``printf``, ``builtin``...): cleaning in place would call the agent's function."""
    return any(name in _BUILTINS for name in _FUNCTION_LINE.findall(captured))


def _std_pipes(pid: int) -> set[str]:
    """What ``pid``'s descriptors 0-2 are (``pipe:[N]``); empty if it is gone."""
    try:
        return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)}
    except OSError:
        return set()


def _extra_fds(pid: int, started_with: set[str]) -> list[int]:
    """Descriptors ``pid`` (a shell) holds beyond its stdin, stdout and stderr, now or as
    it started: bash's own copies of them are not (its input pipe, moved to fd 10 or so;
    the stdout it saves around ``printf ... >&2``, which it may not have put back yet when
    the marker that line prints has already arrived)."""
    where = f"/proc/{pid}/fd"
    std = {os.readlink(f"{where}/{fd}") for fd in (0, 1, 2)} | started_with
    extra = []
    for name in os.listdir(where):
        with contextlib.suppress(FileNotFoundError):
            if int(name) > 2 and os.readlink(f"{where}/{name}") not in std:
                extra.append(int(name))
    return sorted(extra)


def _limits_of(pid: int) -> str | None:
    """``/proc/<pid>/limits`` (a procfs read: never blocks)."""
    try:
        with open(f"/proc/{pid}/limits", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _empty_dir(path: Path) -> None:
    """Delete what ``path`` holds (not following symlinks); ignores what is gone."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _used_bytes(path: Path) -> int:
    """Bytes a (tmpfs) file system holds."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_SHELL = ["bash", "--noprofile", "--norc"]


# What Popen resets for every child anyway (restore_signals), and what cannot be caught.
_RESTORED = {"SIGPIPE", "SIGXFZ", "SIGXFSZ", "SIGKILL", "SIGSTOP"}


def _default_signals() -> list[str]:
    """``env --default-signal`` when this process ignores a signal its children would
    inherit ignored (SIGHUP under ``nohup``; bash cannot undo a signal ignored on entry,
    and the sandbox's shell must start as a fresh one): an exec more per start, paid
    only then. Spawning stays a plain vfork (no ``preexec_fn``)."""
    for sig in signal.valid_signals():
        if (
            isinstance(sig, signal.Signals)
            and sig.name not in _RESTORED
            and signal.getsignal(sig) is signal.SIG_IGN
        ):
            return _env_default_signal()
    return []


@functools.cache
def _env_default_signal() -> list[str]:
    """The prefix, where coreutils' ``env`` has ``--default-signal`` (8.31+)."""
    try:
        done = subprocess.run(
            ["env", "--default-signal", "true"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["env", "--default-signal"] if done.returncode == 0 else []


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` with three pipes. Synchronous on purpose: ``Popen`` uses vfork here
    (no ``preexec_fn``), so it returns in about a millisecond, and it must run on the
    event loop's thread: bwrap's ``--die-with-parent`` fires when the *thread* that
    started it ends, so a worker thread would kill the sandbox when it exits."""
    pipe = subprocess.PIPE
    return subprocess.Popen(argv, stdin=pipe, stdout=pipe, stderr=pipe, **kwargs)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in _children(stack.pop()):
            found.append(child)
            stack.append(child)
    return found
