"""``shell-v1``: a workspace and a shell, with Harbor's paths; where Harbor tasks run.

Each ``reset`` builds a fresh directory tree the environment owns (removed by
``close()``, or by a finaliser if the instance is dropped)::

    <tmp>/envport-shell-XXXX/
      workspace/   seen inside as the workdir (default /workspace), read-write
      logs/        seen as /logs (with logs/verifier and logs/agent), read-write
      tests/       seen as /tests, read-only: a Harbor task's tests/
      tmp/         seen as /tmp: private to this environment, kept across commands

Reset options: ``task_dir`` (a Harbor task directory: ``environment/`` minus its Docker
files is copied into the workspace, ``tests/`` becomes /tests), ``files`` (workspace path
-> text, or ``{"content", "executable"}``, for JSONL tasks; written after ``task_dir``),
``workdir`` (the workspace's path inside, default ``/workspace``) and ``max_steps``. Any
other option is an error that lists these. ``allow_unisolated`` is not one: running a
client's commands outside any sandbox is the operator's choice (the constructor's
argument, or ``ENVPORT_ALLOW_UNISOLATED``), never a client's.

``task_dir`` is a host directory a client names, so it must lie (symlinks and ``..``
resolved) in one of the constructor's ``workspace_roots``, the directories the server's
operator grants (default: those in ``$ENVPORT_WORKSPACE_ROOTS``, ``os.pathsep``-separated,
else none); anything else is an :class:`~envport.errors.ActionValidationError` naming the
option and the allowed roots. The rollout controller grants the task directories of the
tasks it runs to the instances it starts (:attr:`EnvLaunch.workspace_roots
<envport.rollout.backends.base.EnvLaunch.workspace_roots>`).

Tools: ``run`` (``bash -c`` in the workdir), ``read_file``, ``write_file``, ``list_dir``
and ``submit`` (ends the episode). A plain action ``{"command": ...}`` runs a command
too. The episode ends only by ``submit`` or, as a truncation, after ``max_steps`` steps;
commands still run afterwards, so a rubric can score the finished workspace.

**Isolation.** Every command runs in its own bubblewrap (``bwrap``) sandbox: all
namespaces unshared (no network: a fresh loopback only), ``/`` (a bare root),
``/usr`` and ``/etc`` read-only,
``/proc`` and ``/dev`` fresh, the four directories above bound in, an empty environment
but for ``PATH``/``HOME``/``LANG``, killed with its parent, no capabilities and no user
namespaces of its own (:mod:`envport.sandbox.confine`, shared with the sandboxes). So
Harbor's absolute paths
(``/tests/test.sh``, ``/logs/verifier/reward.txt``) mean exactly what they mean in
Harbor's container, and nothing a command does reaches the host outside those
directories. **Decision:** one ``bwrap`` per command, no persistent shell: simple, and a
killed command leaves nothing behind (the sandbox's pid namespace dies with it). Shell
state (``cd``, variables) does not carry over between commands; files do. A persistent
session, snapshots and fork belong to the sandbox layer (``envport.sandbox``).

Without a working ``bwrap`` (not installed, or its self-test fails, e.g. no user
namespaces), ``reset`` refuses with the fix, unless ``allow_unisolated=True`` (or
``ENVPORT_ALLOW_UNISOLATED=1``): then commands run as plain subprocesses in the host
workspace directory, with the host paths in ``ENVPORT_WORKSPACE``, ``ENVPORT_LOGS_DIR``
and ``ENVPORT_TESTS_DIR``, and every observation says ``isolated: false``. Absolute
paths like ``/logs`` then mean the host's.

``read_file``/``write_file``/``list_dir`` take paths as the sandbox sees them (relative
ones against the workdir) and reach only the workdir, ``/logs`` and ``/tests``
(read-only); ``..`` and symlinks that leave those are refused.

**Limits, and what this environment does not hide.** Commands get no memory, process or
disk limits of their own: the rollout controller's local backend puts the whole server
in a cgroup with the task's ``memory_mb``/``pids``/``cpus``; run ``envport serve
shell-v1`` by hand and the host's limits are all there are. ``/tmp``, the workspace and
``/logs`` are directories on the host's disk (use ``sandbox-v1`` for a disk quota).
``/tests`` is visible to the agent's commands for the whole episode, not only to the
verifier after it (Harbor copies them in afterwards): an agent can read what its tests
check.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import os
import posixpath
import shutil
import signal
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from envport.env import AnyAction, Env
from envport.errors import ActionValidationError, EnvExecutionError, ToolError
from envport.procs import CommandOutput, OutputTail
from envport.sandbox.confine import confinement_args
from envport.sandbox.procfs import proc_hardening_args
from envport.tools import tool
from envport.types import Action, Observation, StepResult

#: How ``write_file``'s ``content`` is encoded: text, or base64 for any bytes.
FileEncoding = Literal["utf-8", "base64"]


def file_bytes(content: str, encoding: FileEncoding) -> bytes:
    """``write_file``'s ``content`` as the bytes to write (bad base64: ``invalid_args``)."""
    if encoding == "base64":
        try:
            return base64.b64decode(content, validate=True)
        except binascii.Error as exc:
            raise ToolError(f"content is not valid base64: {exc}.", kind="invalid_args") from exc
    return content.encode("utf-8")


#: Bytes of stdout and of stderr kept per command; the rest is counted and dropped.
MAX_OUTPUT_BYTES = 64 * 1024
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 3600.0
#: Largest file ``read_file`` returns.
MAX_READ_BYTES = 1024 * 1024
MAX_LIST_ENTRIES = 1000
#: Exit status reported for a command killed at its timeout (as GNU ``timeout`` does).
TIMEOUT_EXIT_CODE = 124
LOGS_MOUNT = "/logs"
TESTS_MOUNT = "/tests"
DEFAULT_WORKDIR = "/workspace"
#: Paths the sandbox itself provides; the workdir may not be or lie under one of them.
_SYSTEM_PATHS = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev",
    "/tmp", LOGS_MOUNT, TESTS_MOUNT,
)  # fmt: skip
_DOCKER_FILES = frozenset(
    {"Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore"}
)
_OPTIONS = ("task_dir", "files", "workdir", "max_steps")
#: Host directories (``os.pathsep``-separated) that clients may name in a reset, for an
#: environment constructed without ``workspace_roots``.
WORKSPACE_ROOTS_ENV = "ENVPORT_WORKSPACE_ROOTS"
_SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_INSTALL_HINT = (
    "Install it (Debian/Ubuntu: `apt-get install bubblewrap`), or pass allow_unisolated=True "
    "(or set ENVPORT_ALLOW_UNISOLATED=1) to run commands unisolated on this machine."
)


# --- the sandbox -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workspace:
    """The directories of one episode on the host, and where the sandbox sees them."""

    root: Path
    workdir: str = DEFAULT_WORKDIR

    @property
    def host_workdir(self) -> Path:
        return self.root / "workspace"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tests(self) -> Path:
        return self.root / "tests"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def create(self) -> None:
        for path in (self.host_workdir, self.logs / "verifier", self.logs / "agent"):
            path.mkdir(parents=True, exist_ok=True)
        self.tests.mkdir(exist_ok=True)
        self.tmp.mkdir(exist_ok=True)

    def mounts(self) -> dict[str, Path]:
        """Sandbox path -> host directory, for every path the file tools may reach."""
        return {self.workdir: self.host_workdir, LOGS_MOUNT: self.logs, TESTS_MOUNT: self.tests}

    def host_path(self, path: str, *, write: bool = False) -> Path:
        """Where sandbox path ``path`` lives on the host; ``PermissionError`` if nowhere."""
        if not path:
            raise PermissionError("empty path")
        full = path if path.startswith("/") else posixpath.join(self.workdir, path)
        norm = "/" + posixpath.normpath(full).lstrip("/")
        reachable = ", ".join(self.mounts())
        for mount, host in self.mounts().items():
            if norm != mount and not norm.startswith(mount + "/"):
                continue
            if write and mount == TESTS_MOUNT:
                raise PermissionError(f"{path!r} is under {TESTS_MOUNT}, which is read-only")
            target = host / norm[len(mount) :].lstrip("/")
            if not target.resolve().is_relative_to(host.resolve()):
                raise PermissionError(
                    f"{path!r} leads (through a symlink) outside {mount}; the file tools "
                    f"reach only {reachable} (use run() for anything else)"
                )
            return target
        raise PermissionError(
            f"{path!r} is outside the environment's files; the file tools reach only "
            f"{reachable} (use run() for anything else)"
        )


def _system_binds() -> list[str]:
    """bwrap arguments that show the host's /usr, its merged-/usr links, and /etc."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return [*args, "--ro-bind", "/etc", "/etc"]


def bwrap_argv(bwrap: str, ws: Workspace, command: str) -> list[str]:
    """The command line that runs ``command`` with bash inside ``ws``'s sandbox."""
    env = {
        "PATH": _SANDBOX_PATH,
        "HOME": ws.workdir,
        "LANG": "C.UTF-8",
        "ENVPORT_WORKSPACE": ws.workdir,
        "ENVPORT_LOGS_DIR": LOGS_MOUNT,
        "ENVPORT_TESTS_DIR": TESTS_MOUNT,
    }
    args = [bwrap, "--die-with-parent", *confinement_args(bwrap), "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    args += _system_binds()
    args += ["--proc", "/proc", *proc_hardening_args(), "--dev", "/dev"]
    args += ["--bind", str(ws.tmp), "/tmp"]
    args += ["--bind", str(ws.host_workdir), ws.workdir, "--bind", str(ws.logs), LOGS_MOUNT]
    args += ["--ro-bind", str(ws.tests), TESTS_MOUNT, "--remount-ro", "/", "--chdir", ws.workdir]
    return [*args, "bash", "-c", command]


def unisolated_env(ws: Workspace) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", _SANDBOX_PATH),
        "HOME": str(ws.host_workdir),
        "LANG": "C.UTF-8",
        "ENVPORT_WORKSPACE": str(ws.host_workdir),
        "ENVPORT_LOGS_DIR": str(ws.logs),
        "ENVPORT_TESTS_DIR": str(ws.tests),
        "ENVPORT_UNISOLATED": "1",
    }


@dataclasses.dataclass(frozen=True)
class BwrapProbe:
    """Whether bubblewrap works here: its path, or why not."""

    path: str | None
    problem: str | None = None


_probe_lock = threading.Lock()
_probe: BwrapProbe | None = None


def probe_bwrap() -> BwrapProbe:
    """Find ``bwrap`` and run one sandboxed command with the real flags (once per process)."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _run_probe()
        return _probe


def _run_probe() -> BwrapProbe:
    path = shutil.which("bwrap")
    if path is None:
        return BwrapProbe(None, "bubblewrap (`bwrap`) is not installed (not found on PATH)")
    with tempfile.TemporaryDirectory(prefix="envport-bwrap-probe-") as root:
        ws = Workspace(Path(root))
        ws.create()
        argv = bwrap_argv(path, ws, f"test -w {ws.workdir} && test -d {TESTS_MOUNT}")
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return BwrapProbe(None, f"`{path}` could not run its self-test: {exc}")
    if done.returncode != 0:
        detail = done.stderr.decode("utf-8", "replace").strip() or f"exit {done.returncode}"
        return BwrapProbe(
            None,
            f"`{path}` failed its self-test ({detail}); user namespaces may be disabled here",
        )
    return BwrapProbe(path)


# --- running one command -----------------------------------------------------------------


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _text(capture: OutputTail) -> str:
    text = capture.buffer.decode("utf-8", "replace")
    if capture.dropped:
        text += _note(text, f"{capture.dropped} more bytes of output dropped")
    return text


def _note(text: str, note: str) -> str:
    """``note`` marked as envport's, on a line of its own after ``text``."""
    return ("\n" if text and not text.endswith("\n") else "") + f"[envport: {note}]\n"


async def run_command(
    argv: list[str], *, cwd: Path, env: dict[str, str] | None, timeout_s: float, cap: int
) -> dict[str, Any]:
    """Run ``argv`` in its own process group; kill the group at ``timeout_s``.

    The group is killed after the command ends too, so no background child outlives it;
    pipes still held by an escaped process are given up after a short grace.
    """
    loop = asyncio.get_running_loop()
    transport, output = await loop.subprocess_exec(
        lambda: CommandOutput(cap, head=True),
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await output.exited.wait()  # its own exit: a process it left may hold pipes
        except TimeoutError:
            timed_out = True
    finally:
        _kill_group(transport.get_pid())
        await asyncio.shield(output.exited.wait())
        with contextlib.suppress(TimeoutError):  # what is left in the pipes, briefly
            async with asyncio.timeout(2.0):
                await asyncio.shield(output.pipes_closed.wait())
        transport.close()
    out, err = output.stdout, output.stderr
    code = transport.get_returncode()
    assert code is not None
    stderr = _text(err)
    if timed_out:
        code = TIMEOUT_EXIT_CODE
        stderr += _note(stderr, f"killed after its {timeout_s:g} s timeout")
    elif code < 0:
        code = 128 - code  # killed by a signal, reported as a shell would
    return {
        "exit_code": code,
        "stdout": _text(out),
        "stderr": stderr,
        "timed_out": timed_out,
        "truncated": bool(out.dropped or err.dropped),
    }


# --- the environment ---------------------------------------------------------------------


class ShellAction(Action):
    """Run one bash command in the workspace."""

    command: str = Field(description="A bash command, run with `bash -c` in the workdir.")
    timeout_s: float = Field(
        default=DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S, description="Seconds before kill."
    )


class ShellObservation(Observation):
    exit_code: int | None = Field(default=None, description="The command's exit status.")
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = Field(default=False, description="True if output was cut at the cap.")
    workdir: str = DEFAULT_WORKDIR
    isolated: bool = Field(default=True, description="False if commands run unsandboxed.")
    message: str = ""


class ShellEnv(Env[ShellAction, ShellObservation]):
    """A workspace with a bash shell, laid out as Harbor's task container.

    Tools: ``run`` (a command; exit code, stdout, stderr), ``read_file``, ``write_file``,
    ``list_dir`` and ``submit`` (ends the episode). A plain action ``{"command": ...}``
    runs a command too. Reset options: ``task_dir`` (a Harbor task directory),
    ``files`` (path -> content), ``workdir`` (default /workspace), ``max_steps``,
    ``allow_unisolated``. Commands run in a bubblewrap sandbox without network.
    """

    action_type = ShellAction
    observation_type = ShellObservation
    check_actions: ClassVar[list[dict[str, Any]]] = [{"command": "echo hello"}]
    version = "1"

    def __init__(
        self,
        max_steps: int | None = None,
        allow_unisolated: bool | None = None,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        workspace_roots: Iterable[str | os.PathLike[str]] | None = None,
    ) -> None:
        super().__init__()
        if max_steps is not None and max_steps < 1:
            raise ValueError("max_steps must be at least 1.")
        if max_output_bytes < 1:
            raise ValueError("max_output_bytes must be positive.")
        self.default_max_steps = max_steps
        self.default_allow_unisolated = allow_unisolated
        self.max_output_bytes = max_output_bytes
        self.workspace_roots = allowed_roots(workspace_roots)
        self.max_steps: int | None = max_steps
        self.workspace: Workspace | None = None
        self.bwrap: str | None = None
        self.isolation_problem: str | None = None
        self.task_dir: str | None = None
        self.submitted = False
        self.answer: str | None = None
        self.commands_run = 0
        self._cleanup: weakref.finalize[Any, Any] | None = None

    @property
    def isolated(self) -> bool:
        return self.bwrap is not None

    # --- lifecycle ---------------------------------------------------------------------

    def on_reset(self, seed: int | None, **options: Any) -> StepResult[ShellObservation]:
        if "allow_unisolated" in options:
            raise ActionValidationError(
                "allow_unisolated is not a reset option: whether commands may run outside a "
                "sandbox is decided where the server starts (ShellEnv(allow_unisolated=True) "
                "or ENVPORT_ALLOW_UNISOLATED=1), not by a client."
            )
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ActionValidationError(
                f"Unknown reset option(s) for shell-v1: {', '.join(unknown)}. "
                f"Allowed: {', '.join(_OPTIONS)}."
            )
        workdir = _check_workdir(options.get("workdir", DEFAULT_WORKDIR))
        max_steps = options.get("max_steps", self.default_max_steps)
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ActionValidationError(f"max_steps must be a positive integer, got {max_steps!r}.")
        task_dir = check_host_dir(
            "shell-v1", "task_dir", options.get("task_dir"), self.workspace_roots
        )
        files = check_files(options.get("files"))
        self._choose_isolation()

        self._remove_workspace()
        ws = Workspace(Path(tempfile.mkdtemp(prefix="envport-shell-")), workdir)
        self._cleanup = weakref.finalize(self, shutil.rmtree, ws.root, True)
        self.workspace = ws
        ws.create()
        if task_dir is not None:
            _copy_task_dir(task_dir, ws)
        for rel, (content, executable) in files.items():
            target = ws.host_path(rel, write=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
            if executable:
                target.chmod(0o755)
        self.task_dir = None if task_dir is None else str(task_dir)
        self.max_steps = max_steps
        self.submitted = False
        self.answer = None
        self.commands_run = 0

        where = "a bubblewrap sandbox without network" if self.isolated else "UNISOLATED"
        message = (
            f"A bash workspace at {workdir} ({where}). Tools: run, read_file, write_file, "
            "list_dir, submit; or send {'command': ...}. Call submit() when done."
        )
        if not self.isolated:
            message += (
                f" WARNING: commands run unisolated on the host ({self.isolation_problem}); "
                "absolute paths such as /logs are the host's; use $ENVPORT_WORKSPACE, "
                "$ENVPORT_LOGS_DIR and $ENVPORT_TESTS_DIR."
            )
        return StepResult(observation=self._observation(message=message), info=self._info())

    async def on_step(self, action: ShellAction) -> StepResult[ShellObservation]:
        result = await self._run(action.command, action.timeout_s)
        obs = self._observation(**result)
        return StepResult(observation=obs, info=self._info())

    async def step(self, action: ShellAction | AnyAction | dict[str, Any]) -> StepResult[Any]:
        """:meth:`Env.step`, plus: ``submit`` through ``call_tool`` ends the episode, and
        every kind of step counts toward ``max_steps`` (then the result is truncated)."""
        result = await super().step(action)
        if self.submitted and not result.done:
            result = result.model_copy(update={"terminated": True})
        elif self.max_steps is not None and self.step_count >= self.max_steps and not result.done:
            result = result.model_copy(update={"truncated": True})
        return result

    def on_close(self) -> None:
        self._remove_workspace()
        self.workspace = None

    def extra_state(self) -> dict[str, Any]:
        return {
            "workdir": self.workspace.workdir if self.workspace else None,
            "isolated": self.isolated,
            "task_dir": self.task_dir,
            "submitted": self.submitted,
            "answer": self.answer,
            "commands_run": self.commands_run,
        }

    # --- tools -------------------------------------------------------------------------

    @tool
    async def run(self, command: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        """Run a bash command in the workspace; returns exit_code, stdout, stderr, timed_out.

        Args:
            command: The command line, run with `bash -c` in the working directory.
            timeout_s: Seconds before the command (and everything it started) is killed.
        """
        return await self._run(command, timeout_s)

    @tool
    def read_file(self, path: str) -> str:
        """Read a text file (relative to the workdir, or under the workdir, /logs, /tests).

        Args:
            path: The file's path as commands see it.
        """
        target = self._path(path)
        if not target.is_file():
            if target.is_dir():
                why = "it is a directory"
            elif target.exists():
                why = "not a regular file"
            else:
                why = "no such file"
            raise ToolError(f"Cannot read {path!r}: {why}.", kind="execution_error")
        size = target.stat().st_size
        if size > MAX_READ_BYTES:
            raise ToolError(
                f"{path!r} is {size} bytes, over read_file's {MAX_READ_BYTES}-byte limit; "
                "read part of it with run(), e.g. `head -c 10000 FILE`.",
                kind="execution_error",
            )
        return target.read_text(encoding="utf-8", errors="replace")

    @tool
    def write_file(
        self, path: str, content: str, encoding: FileEncoding = "utf-8"
    ) -> dict[str, Any]:
        """Write a file, creating parent directories (not under /tests: read-only).

        Args:
            path: The file's path as commands see it.
            content: The full new content.
            encoding: "utf-8" (text, the default) or "base64" (any bytes).
        """
        target = self._path(path, write=True)
        if target.is_dir():
            raise ToolError(f"Cannot write {path!r}: it is a directory.", kind="execution_error")
        data = file_bytes(content, encoding)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return {"path": path, "bytes": len(data)}

    @tool
    def list_dir(self, path: str = ".") -> list[dict[str, Any]]:
        """List a directory: each entry's name, type (file, dir, symlink) and size.

        Args:
            path: The directory as commands see it; defaults to the working directory.
        """
        target = self._path(path)
        if not target.is_dir():
            raise ToolError(f"Cannot list {path!r}: not a directory.", kind="execution_error")
        entries = []
        for entry in sorted(target.iterdir())[:MAX_LIST_ENTRIES]:
            kind = "symlink" if entry.is_symlink() else "dir" if entry.is_dir() else "file"
            size = entry.lstat().st_size if kind == "file" else None
            entries.append({"name": entry.name, "type": kind, "size": size})
        return entries

    @tool
    def submit(self, answer: str = "") -> dict[str, Any]:
        """Say the task is done; ends the episode.

        Args:
            answer: An optional final answer or summary.
        """
        self._require_workspace()
        self.submitted = True
        self.answer = answer
        return {"submitted": True, "answer": answer}

    # --- internals ---------------------------------------------------------------------

    def _choose_isolation(self) -> None:
        allow = self.default_allow_unisolated
        if allow is None:
            allow = os.environ.get("ENVPORT_ALLOW_UNISOLATED", "") in ("1", "true", "yes")
        if not isinstance(allow, bool):
            raise ActionValidationError(f"allow_unisolated must be true or false, got {allow!r}.")
        probe = probe_bwrap()
        if probe.path is None and not allow:
            raise EnvExecutionError(
                f"shell-v1 runs every command in a bubblewrap sandbox, but {probe.problem}. "
                + _INSTALL_HINT
            )
        self.bwrap = probe.path
        self.isolation_problem = probe.problem

    def _require_workspace(self) -> Workspace:
        if self.workspace is None:
            raise ToolError("No workspace yet; call reset() first.", kind="execution_error")
        return self.workspace

    def _path(self, path: str, *, write: bool = False) -> Path:
        ws = self._require_workspace()
        try:
            return ws.host_path(path, write=write)
        except PermissionError as exc:
            raise ToolError(f"Refused: {exc}.", kind="invalid_args") from exc

    async def _run(self, command: str, timeout_s: float) -> dict[str, Any]:
        ws = self._require_workspace()
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ToolError(
                f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}.",
                kind="invalid_args",
            )
        self.commands_run += 1
        if self.bwrap is not None:
            argv, env = bwrap_argv(self.bwrap, ws, command), None
        else:
            argv, env = ["bash", "-c", command], unisolated_env(ws)
        try:
            return await run_command(
                argv,
                cwd=ws.host_workdir,
                env=env,
                timeout_s=timeout_s,
                cap=self.max_output_bytes,
            )
        except OSError as exc:
            raise ToolError(f"Could not start the command: {exc}", kind="execution_error") from exc

    def _observation(self, **fields: Any) -> ShellObservation:
        workdir = self.workspace.workdir if self.workspace else DEFAULT_WORKDIR
        return ShellObservation(workdir=workdir, isolated=self.isolated, **fields)

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"isolated": self.isolated}
        if not self.isolated:
            info["isolation_problem"] = self.isolation_problem
        return info

    def _remove_workspace(self) -> None:
        if self._cleanup is not None:
            self._cleanup()  # removes the directory; runs at most once
            self._cleanup = None


def _check_workdir(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ActionValidationError(f"workdir must be an absolute path, got {value!r}.")
    norm = "/" + posixpath.normpath(value).lstrip("/")
    clash = [p for p in _SYSTEM_PATHS if norm == p or norm.startswith(p + "/")]
    if norm == "/" or clash:
        raise ActionValidationError(
            f"workdir {value!r} would hide the sandbox's own {clash[0] if clash else '/'}; "
            f"choose another (default {DEFAULT_WORKDIR})."
        )
    return norm


def allowed_roots(given: Iterable[str | os.PathLike[str]] | None) -> tuple[Path, ...]:
    """The host directories clients may name in a reset, symlinks resolved: ``given``
    (the constructor's ``workspace_roots``), else those in ``$ENVPORT_WORKSPACE_ROOTS``
    (separated by ``os.pathsep``), else none."""
    if given is None:
        given = [p for p in os.environ.get(WORKSPACE_ROOTS_ENV, "").split(os.pathsep) if p]
    return tuple(Path(os.path.realpath(p)) for p in given)


def check_host_dir(env_id: str, option: str, value: Any, roots: Sequence[Path]) -> Path | None:
    """Reset option ``option``, a host directory, resolved (symlinks and ``..``); refused
    (:class:`ActionValidationError`) unless it lies in one of ``roots``.

    **Decision.** Whoever reaches the server sends reset options; only its operator says
    which host directories they may name (``workspace_roots``). Containment is checked
    before existence, so a refusal says nothing about what the host holds."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise ActionValidationError(f"{option} must be a path, got {value!r}.")
    path = Path(os.path.realpath(value))
    if not any(path.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots) or "none"
        raise ActionValidationError(
            f"{env_id} refuses {option} {str(value)!r}: it is not in a directory this "
            f"environment lets clients name (workspace_roots: {allowed}). The server's "
            f"operator grants more with workspace_roots=[...] or ${WORKSPACE_ROOTS_ENV}."
        )
    if not path.is_dir():
        raise ActionValidationError(f"{option} {str(value)!r} is not a directory.")
    return path


def check_files(value: Any) -> dict[str, tuple[str, bool]]:
    """The ``files`` reset option: relative path -> (text, executable), validated."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ActionValidationError("files must map paths to text (or {content, executable}).")
    files: dict[str, tuple[str, bool]] = {}
    for path, spec in value.items():
        if isinstance(spec, str):
            files[str(path)] = (spec, False)
        elif isinstance(spec, dict) and isinstance(spec.get("content"), str):
            files[str(path)] = (spec["content"], bool(spec.get("executable", False)))
        else:
            raise ActionValidationError(
                f"files[{path!r}] must be text or {{'content': text, 'executable': bool}}, "
                f"got {spec!r:.100}."
            )
        norm = posixpath.normpath(str(path))
        if str(path).startswith("/") or norm == ".." or norm.startswith("../"):
            raise ActionValidationError(
                f"files path {path!r} must be relative and stay in the workspace."
            )
    return files


def _copy_task_dir(task_dir: Path, ws: Workspace) -> None:
    """``environment/`` (minus Docker files) into the workspace; ``tests/`` to /tests."""
    env_dir = task_dir / "environment"
    if env_dir.is_dir():
        for entry in env_dir.iterdir():
            if entry.name in _DOCKER_FILES:
                continue
            target = ws.host_workdir / entry.name
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, target, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(entry, target, follow_symlinks=False)
    tests = task_dir / "tests"
    if tests.is_dir():
        shutil.copytree(tests, ws.tests, symlinks=True, dirs_exist_ok=True)
