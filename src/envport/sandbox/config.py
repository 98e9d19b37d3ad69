"""What a sandbox is made of (:class:`SandboxConfig`) and what a command returns
(:class:`ExecResult`), plus the sandbox's errors (rooted in :mod:`envport.errors`)::

    EnvportError
    └── SandboxError                   a sandbox could not do what was asked
        ├── SandboxUnavailableError    no isolation here (says why and how to allow unisolated)
        ├── SandboxClosedError         any call after close()
        └── SandboxPathError           a file path outside the workspace (also PermissionError)
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from envport.errors import EnvportError, ErrorCode

DEFAULT_WORKDIR = "/workspace"
#: Bytes of stdout and of stderr kept per command; the rest is counted and dropped.
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
#: Exit status reported for a command killed at its timeout (as GNU ``timeout`` does).
TIMEOUT_EXIT_CODE = 124
#: Paths the sandbox provides itself; the workdir may not be, or lie under, one of them.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
                "/proc", "/dev", "/tmp")  # fmt: skip


class SandboxError(EnvportError):
    """A sandbox could not do what was asked; the message says what and why."""

    code = ErrorCode.EXECUTION_ERROR


class SandboxFailure(SandboxError):
    """The sandbox itself failed (it did not start, its shell died), not the request.

    Its wire form carries ``"failure": "sandbox"``, so a rollout controller on the other
    side of a connection classifies it as a sandbox failure and retries on a fresh one.
    """

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message, failure="sandbox", **details)


class SandboxUnavailableError(SandboxFailure):
    """This machine cannot isolate a sandbox (no bwrap, namespaces, overlayfs, cgroups)."""


class SandboxClosedError(SandboxError):
    code = ErrorCode.SESSION_CLOSED


class SandboxPathError(SandboxError, PermissionError):
    """A file tool was given a path that leaves the workspace."""


class SandboxConfig(BaseModel):
    """One sandbox: its files, limits, network and shell environment.

    ``workspace`` is the task's directory on the host: the read-only lower layer of the
    workspace overlay, shown at ``workdir``; it must not change while sandboxes use it.
    ``None`` starts from an empty workspace. ``ro_binds`` maps more sandbox paths to host
    paths shown read-only (``/usr`` and ``/etc`` always are). ``disk_mb`` bounds what the
    sandbox may write to the workspace (its writable layer is a tmpfs of that size),
    ``tmp_mb`` its private ``/tmp``. ``keep_background`` lets processes a command starts
    in the background outlive it (by default every process a command leaves behind is
    killed when it returns, as one-shot commands would be).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    workspace: Path | None = Field(None, description="Host directory: the task's files.")
    workdir: str = Field(DEFAULT_WORKDIR, description="Where the workspace appears inside.")
    ro_binds: dict[str, Path] = Field(default_factory=dict)
    cpus: float | None = Field(None, gt=0, description="CPU time limit, in cores.")
    memory_mb: int | None = Field(1024, gt=0, description="Memory limit (tmpfs files count).")
    pids: int | None = Field(256, gt=0, description="Most processes at once.")
    disk_mb: int = Field(1024, gt=0, description="Most bytes written to the workspace.")
    tmp_mb: int = Field(256, gt=0, description="Size of the sandbox's private /tmp.")
    network: bool = Field(False, description="Share the host's network (default: none).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra shell variables.")
    timeout_s: float = Field(30.0, gt=0, description="Default command timeout.")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, gt=0)
    keep_background: bool = False
    allow_unisolated: bool = Field(
        False, description="Without isolation here, run as plain local processes instead."
    )
    runtime_dir: Path | None = Field(
        None, description="Host directory for mounts and layers (default: a dir in /tmp)."
    )

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"workdir must be an absolute path, got {value!r}")
        norm = "/" + posixpath.normpath(value).lstrip("/")
        clash = [p for p in SYSTEM_PATHS if norm == p or norm.startswith(p + "/")]
        if norm == "/" or clash:
            raise ValueError(
                f"workdir {value!r} would hide the sandbox's own {clash[0] if clash else '/'}"
            )
        return norm

    @field_validator("workspace")
    @classmethod
    def _check_workspace(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = Path(value).resolve()
        if not path.is_dir():
            raise ValueError(f"workspace {str(value)!r} is not a directory")
        return path

    @field_validator("ro_binds")
    @classmethod
    def _check_binds(cls, value: dict[str, Path]) -> dict[str, Path]:
        for inside, host in value.items():
            if not inside.startswith("/") or inside in ("/", "/proc", "/dev", "/tmp"):
                raise ValueError(f"ro_binds: {inside!r} is not a usable sandbox path")
            if not Path(host).exists():
                raise ValueError(f"ro_binds: host path {str(host)!r} does not exist")
        return value

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key.isidentifier():
                raise ValueError(f"env: {key!r} is not a valid variable name")
        return value


class ExecResult(BaseModel):
    """What one command did. ``exit_code`` is the shell's ``$?`` (124 on timeout, 128+N
    for a signal); ``truncated`` means output was cut at the cap; ``shell_restarted``
    means the shell died (``exit``, killed) or hung and a fresh one was started in the
    workdir: files are kept, shell variables and cwd are not."""

    model_config = ConfigDict(frozen=True)

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = False
    oom_killed: bool = False
    shell_restarted: bool = False
    duration_s: float = 0.0
