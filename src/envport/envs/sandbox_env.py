"""``sandbox-v1``: a task's repository in an :mod:`envport.sandbox` sandbox, as tools.

One sandbox per environment instance, made at the first ``reset`` and kept: a later
``reset`` of the same task puts the workspace back to the task's initial state by
snapshot restore and cleans the shell in place (about a millisecond of mounts and a
builtin or two), it does not start a new sandbox. A reset for a *different* task
(another ``workspace`` or ``files``) replaces the sandbox.

Reset options: ``workspace`` (the task's directory on the host: the read-only base of the
overlay), ``files`` (workspace path -> text, or ``{"content", "executable"}``, written
over it; they are part of the task's initial state), ``max_steps``. Any other option is
an error that lists these. Construction takes the sandbox's limits and defaults
(``memory_mb``, ``pids``, ``cpus``, ``disk_mb``, ``network``, ``timeout_s``,
``allow_unisolated``, ``workdir``, ``workspace``) and ``workspace_roots``.

**Which host directories a client may mount.** Reset options come from whoever reaches
the server; the host directories they may name are the operator's choice. The
``workspace`` option must lie (symlinks and ``..`` resolved) in the constructor's own
``workspace`` or in one of ``workspace_roots`` (default: the directories in
``$ENVPORT_WORKSPACE_ROOTS``, ``os.pathsep``-separated, else none); anything else is an
:class:`~envport.errors.ActionValidationError` naming the option and the allowed roots.
The rollout controller grants its tasks' directories to the instances it starts.

Tools: ``run`` (a command in the persistent shell: exit code, stdout, stderr, timed out;
``cd`` and variables persist between calls; named as ``shell-v1``'s, so a rubric's
``test_command`` runs tests inside through it), ``read_file``, ``write_file``,
``list_dir``. A plain action ``{"command": ...}`` runs a command too. The episode ends
only as a truncation after ``max_steps``.

For trainers (not tools, so an agent cannot call them): :meth:`SandboxEnv.snapshot`,
:meth:`SandboxEnv.restore` and :meth:`SandboxEnv.fork`, which returns ``n`` new
environment instances continuing from this one's state (workspace and shell), each
already reset, with this episode's step count, to branch a trajectory at step k.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from envport.env import Env
from envport.envs.shell import FileEncoding, allowed_roots, check_files, check_host_dir, file_bytes
from envport.errors import ActionValidationError, EnvExecutionError, EnvNotResetError, ToolError
from envport.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxFailure,
    SandboxPathError,
    SandboxUnavailableError,
    Snapshot,
)
from envport.sandbox.config import DEFAULT_WORKDIR
from envport.tools import tool
from envport.types import Action, Observation, StepResult

MAX_TIMEOUT_S = 3600.0
_OPTIONS = ("workspace", "files", "max_steps")


def _failure(exc: SandboxError) -> dict[str, Any]:
    """The detail that tells a controller the sandbox itself failed (retried on a fresh
    one), kept when its error is wrapped for the agent."""
    return {"failure": "sandbox"} if isinstance(exc, SandboxFailure) else {}


class SandboxAction(Action):
    """Run one bash command in the sandbox's persistent shell."""

    command: str = Field(description="A bash command; cd and variables persist.")
    timeout_s: float | None = Field(
        default=None, gt=0, le=MAX_TIMEOUT_S, description="Seconds before kill."
    )


class SandboxObservation(Observation):
    exit_code: int | None = Field(default=None, description="The command's exit status.")
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = Field(default=False, description="True if output was cut at the cap.")
    oom_killed: bool = False
    shell_restarted: bool = Field(
        default=False, description="The shell died or hung and was restarted (state lost)."
    )
    workdir: str = DEFAULT_WORKDIR
    isolated: bool = True
    message: str = ""


class SandboxEnv(Env[SandboxAction, SandboxObservation]):
    """A task's files in an isolated sandbox with a persistent bash shell.

    Tools: ``run``, ``read_file``, ``write_file``, ``list_dir``. Reset options:
    ``workspace`` (the task's directory), ``files`` (path -> content), ``max_steps``.
    No network; memory, process and disk limits. Reset restores the task's initial
    state without restarting the sandbox.
    """

    action_type = SandboxAction
    observation_type = SandboxObservation
    check_actions: ClassVar[list[dict[str, Any]]] = [{"command": "echo hello"}]
    version = "1"

    def __init__(
        self,
        workspace: str | None = None,
        *,
        workdir: str = DEFAULT_WORKDIR,
        max_steps: int | None = None,
        memory_mb: int | None = 1024,
        pids: int | None = 256,
        cpus: float | None = None,
        disk_mb: int = 1024,
        network: bool = False,
        timeout_s: float = 30.0,
        allow_unisolated: bool = False,
        workspace_roots: Iterable[str | os.PathLike[str]] | None = None,
    ) -> None:
        super().__init__()
        if max_steps is not None and max_steps < 1:
            raise ValueError("max_steps must be at least 1.")
        self.default_workspace = workspace
        roots = allowed_roots(workspace_roots)
        own = () if workspace is None else (Path(os.path.realpath(workspace)),)
        self.workspace_roots = (*own, *roots)
        self.default_max_steps = max_steps
        self.max_steps = max_steps
        self.base_config = SandboxConfig(
            workdir=workdir,
            memory_mb=memory_mb,
            pids=pids,
            cpus=cpus,
            disk_mb=disk_mb,
            network=network,
            timeout_s=timeout_s,
            allow_unisolated=allow_unisolated,
        )
        self.sandbox: Sandbox | None = None
        self._task_key: str | None = None
        self._task_start: Snapshot | None = None
        self.commands_run = 0

    # --- lifecycle ---------------------------------------------------------------------

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[SandboxObservation]:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ActionValidationError(
                f"Unknown reset option(s) for sandbox-v1: {', '.join(unknown)}. "
                f"Allowed: {', '.join(_OPTIONS)}."
            )
        max_steps = options.get("max_steps", self.default_max_steps)
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ActionValidationError(f"max_steps must be a positive integer, got {max_steps!r}.")
        workspace: str | Path | None = self.default_workspace
        if "workspace" in options:
            workspace = check_host_dir(
                "sandbox-v1", "workspace", options["workspace"], self.workspace_roots
            )
        files = check_files(options.get("files"))
        key = json.dumps([str(workspace), files], sort_keys=True)
        if self.sandbox is not None and key == self._task_key:
            try:
                await self.sandbox.reset(self._task_start)
            except SandboxError as exc:
                raise EnvExecutionError(
                    f"sandbox-v1 could not reset: {exc}", **_failure(exc)
                ) from exc
        else:
            await self._start(workspace, files, key)
        self.max_steps = max_steps
        self.commands_run = 0
        sb = self._require()
        where = "an isolated sandbox without network" if sb.isolated else "UNISOLATED"
        message = (
            f"A bash shell in {sb.workdir} ({where}); cd and variables persist. Tools: run, "
            "read_file, write_file, list_dir; or send {'command': ...}."
        )
        return StepResult(observation=self._observation(message=message), info=self._info())

    async def _start(self, workspace: Any, files: dict[str, tuple[str, bool]], key: str) -> None:
        config = self.base_config.model_copy(update={"workspace": _workspace_dir(workspace)})
        await self._close_sandbox()
        try:
            sb = await Sandbox.create(config)
        except SandboxUnavailableError as exc:
            raise EnvExecutionError(
                f"sandbox-v1: {exc} (construct with allow_unisolated=True to allow that)"
            ) from exc
        except SandboxError as exc:
            raise EnvExecutionError(
                f"sandbox-v1 could not start its sandbox: {exc}", **_failure(exc)
            ) from exc
        self.sandbox = sb
        for rel, (content, executable) in files.items():
            await sb.write_file(rel, content, mode=0o755 if executable else None)
        self._task_start = await sb.snapshot() if files else None
        self._task_key = key

    async def on_step(self, action: SandboxAction) -> StepResult[SandboxObservation]:
        result = await self._run(action.command, action.timeout_s)
        return StepResult(observation=self._observation(**result), info=self._info())

    async def step(self, action: Any) -> StepResult[Any]:
        """:meth:`Env.step`; every kind of step counts toward ``max_steps``."""
        result = await super().step(action)
        if self.max_steps is not None and self.step_count >= self.max_steps and not result.done:
            result = result.model_copy(update={"truncated": True})
        return result

    async def on_close(self) -> None:
        await self._close_sandbox()

    def extra_state(self) -> dict[str, Any]:
        sb = self.sandbox
        return {
            "workdir": sb.workdir if sb else None,
            "isolated": sb.isolated if sb else None,
            "sandbox_id": sb.id if sb else None,
            "commands_run": self.commands_run,
        }

    # --- for trainers ------------------------------------------------------------------

    async def snapshot(self) -> str:
        """Save the workspace now; returns an id for :meth:`restore`."""
        try:
            return (await self._require().snapshot()).id
        except SandboxError as exc:
            raise EnvExecutionError(
                f"sandbox-v1 could not snapshot: {exc}", **_failure(exc)
            ) from exc

    async def restore(self, snapshot_id: str) -> None:
        """Put the workspace back to a snapshot (the shell keeps its variables)."""
        try:
            await self._require().restore(snapshot_id)
        except SandboxError as exc:
            raise EnvExecutionError(
                f"sandbox-v1 could not restore: {exc}", **_failure(exc)
            ) from exc

    async def fork(self, n: int = 1) -> list[SandboxEnv]:
        """``n`` new environments continuing from this one's current state (workspace and
        shell), each already reset, in this episode at this step count; close each."""
        sb = self._require()
        try:
            children = await sb.fork(n)
        except SandboxError as exc:
            raise EnvExecutionError(f"sandbox-v1 could not fork: {exc}", **_failure(exc)) from exc
        envs = []
        for child in children:
            env = SandboxEnv(self.default_workspace, max_steps=self.default_max_steps)
            env.base_config = self.base_config
            env.workspace_roots = self.workspace_roots
            env.sandbox = child
            env._task_key = self._task_key
            env._task_start = self._task_start
            env.max_steps = self.max_steps
            env.commands_run = self.commands_run
            env.episode_id = uuid.uuid4().hex
            env.step_count = self.step_count
            env.status = self.status
            envs.append(env)
        return envs

    # --- tools -------------------------------------------------------------------------

    @tool
    async def run(
        self, command: str, timeout_s: float | None = None, fresh_shell: bool = False
    ) -> dict[str, Any]:
        """Run a bash command in the sandbox's shell; returns exit_code, stdout, stderr,
        timed_out. cd, variables and functions persist between calls.

        Args:
            command: The command line, run by the persistent bash shell.
            timeout_s: Seconds before the command (and everything it started) is killed.
            fresh_shell: Run it in a new shell instead (files kept; cwd, variables,
                background processes and /tmp are not): how graders run tests.
        """
        return await self._run(command, timeout_s, fresh_shell=fresh_shell)

    @tool
    async def read_file(self, path: str) -> str:
        """Read a text file in the workspace (relative to the workdir, or absolute).

        Args:
            path: The file's path as commands see it.
        """
        try:
            return await self._require_tool().read_file(path)
        except FileNotFoundError as exc:
            raise ToolError(f"Cannot read {path!r}: no such file.", kind="execution_error") from exc
        except SandboxPathError as exc:
            raise ToolError(f"Refused: {exc}.", kind="invalid_args") from exc
        except SandboxError as exc:
            raise ToolError(
                f"Cannot read {path!r}: {exc}.", kind="execution_error", **_failure(exc)
            ) from exc

    @tool
    async def write_file(
        self, path: str, content: str, encoding: FileEncoding = "utf-8"
    ) -> dict[str, Any]:
        """Write a file in the workspace, creating parent directories.

        Args:
            path: The file's path as commands see it.
            content: The full new content.
            encoding: "utf-8" (text, the default) or "base64" (any bytes).
        """
        data = file_bytes(content, encoding)
        try:
            written = await self._require_tool().write_file(path, data)
        except SandboxPathError as exc:
            raise ToolError(f"Refused: {exc}.", kind="invalid_args") from exc
        except SandboxError as exc:
            raise ToolError(
                f"Cannot write {path!r}: {exc}.", kind="execution_error", **_failure(exc)
            ) from exc
        return {"path": path, "bytes": written}

    @tool
    async def list_dir(self, path: str = ".") -> list[dict[str, Any]]:
        """List a workspace directory: each entry's name, type and size.

        Args:
            path: The directory as commands see it; defaults to the working directory.
        """
        try:
            return await self._require_tool().list_dir(path)
        except SandboxPathError as exc:
            raise ToolError(f"Refused: {exc}.", kind="invalid_args") from exc
        except SandboxError as exc:
            raise ToolError(
                f"Cannot list {path!r}: {exc}.", kind="execution_error", **_failure(exc)
            ) from exc

    # --- internals ---------------------------------------------------------------------

    def _require(self) -> Sandbox:
        if self.sandbox is None:
            raise EnvNotResetError("sandbox-v1 has no sandbox yet; call reset() first.")
        return self.sandbox

    def _require_tool(self) -> Sandbox:
        if self.sandbox is None:
            raise ToolError("No sandbox yet; call reset() first.", kind="execution_error")
        return self.sandbox

    async def _run(
        self, command: str, timeout_s: float | None, *, fresh_shell: bool = False
    ) -> dict[str, Any]:
        sb = self._require_tool()
        if timeout_s is not None and not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ToolError(
                f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}.",
                kind="invalid_args",
            )
        self.commands_run += 1
        try:
            result = await sb.exec(command, timeout_s, fresh_shell=fresh_shell)
        except SandboxError as exc:
            raise ToolError(
                f"Could not run the command: {exc}", kind="execution_error", **_failure(exc)
            ) from exc
        return result.model_dump(exclude={"duration_s"})

    def _observation(self, **fields: Any) -> SandboxObservation:
        sb = self.sandbox
        return SandboxObservation(
            workdir=sb.workdir if sb else self.base_config.workdir,
            isolated=sb.isolated if sb else True,
            **fields,
        )

    def _info(self) -> dict[str, Any]:
        return {"isolated": self.sandbox.isolated if self.sandbox else None}

    async def _close_sandbox(self) -> None:
        sb, self.sandbox = self.sandbox, None
        self._task_key = self._task_start = None
        if sb is not None:
            await sb.close()


def _workspace_dir(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str | Path):
        raise ActionValidationError(f"workspace must be a path, got {value!r}.")
    path = Path(value).resolve()
    if not path.is_dir():
        raise ActionValidationError(f"workspace {str(value)!r} is not a directory.")
    return path
