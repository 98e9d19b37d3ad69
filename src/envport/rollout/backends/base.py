"""The contract every environment backend implements.

A backend starts environment *instances* (a server that hosts one or more sessions of
one environment type), says whether they are healthy, stops them, and lists the live
ones it owns so that a restarted controller can re-adopt them. The controller never
cares where an instance runs: it connects with :meth:`EnvInstance.client`.

Backends: in-process, local process, local sandbox, Ray, Kubernetes.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from envport.client import EnvClient


class BackendError(RuntimeError):
    """A backend could not do what was asked (start, stop, list); says which and why."""


class BackendUnavailableError(BackendError):
    """The backend cannot run on this machine (no namespaces, no cluster, no Ray)."""


class Limits(BaseModel):
    """What one instance may use; ``None`` leaves it to the backend's default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: float | None = Field(default=None, gt=0)
    memory_mb: int | None = Field(default=None, gt=0)
    pids: int | None = Field(default=None, gt=0)
    disk_mb: int | None = Field(default=None, gt=0)


class EnvLaunch(BaseModel):
    """What to start: an environment id (registry id or ``module:Class``) and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env_id: str
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the environment."
    )
    sessions: int = Field(1, ge=1, description="Concurrent sessions one instance hosts.")
    limits: Limits = Field(default_factory=Limits)
    labels: dict[str, str] = Field(
        default_factory=dict, description="Owner labels (run id, pool); used to re-adopt."
    )
    start_timeout_s: float = Field(60.0, gt=0)
    network: bool = Field(False, description="Sandboxed backends: allow network access.")
    workspace_roots: tuple[str, ...] = Field(
        (),
        description="Host directories the tasks name in reset options (a Harbor task's "
        "task_dir): given to an environment that takes workspace_roots (sandbox-v1, "
        "shell-v1), which refuses any other.",
    )

    def env_kwargs(self) -> dict[str, Any]:
        """The environment's keyword arguments: ``options``, and ``workspace_roots`` when
        there are any (added to those the options grant)."""
        if not self.workspace_roots:
            return dict(self.options)
        roots = [*self.options.get("workspace_roots", ()), *self.workspace_roots]
        return {**self.options, "workspace_roots": roots}


class EnvInstance(BaseModel):
    """A started instance: where it is and how to reach it."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str
    backend: str
    env_id: str
    url: str | None = Field(
        None, description="Server base URL (http://host:port); None means in-process."
    )
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    start_latency_s: float | None = None
    meta: dict[str, Any] = Field(
        default_factory=dict, description="Backend-specific (pid, pod name, actor id)."
    )

    def client(self, *, timeout_s: float = 60.0) -> EnvClient:
        """A client (not yet opened) for one session on this instance."""
        return EnvClient.connect(self.url or self.env_id, timeout_s=timeout_s)


class Backend(abc.ABC):
    """Starts, watches, stops and lists environment instances."""

    name: ClassVar[str]

    @abc.abstractmethod
    async def start(self, launch: EnvLaunch) -> EnvInstance:
        """Start one instance; return once it accepts sessions (or raise, leaving nothing
        behind: :class:`BackendError` naming the cause, or the environment's own
        :class:`~envport.errors.EnvportError` when it cannot be built, such as an
        unknown id, which the controller classifies ``environment`` and does not retry)."""

    @abc.abstractmethod
    async def healthy(self, instance: EnvInstance) -> bool:
        """Whether the instance is alive and answering; never raises."""

    @abc.abstractmethod
    async def stop(self, instance: EnvInstance) -> None:
        """Stop it and release everything it held; idempotent."""

    @abc.abstractmethod
    async def list(self, labels: Mapping[str, str] | None = None) -> list[EnvInstance]:
        """Live instances this backend owns whose labels include ``labels``."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop every instance this backend object started."""

    def outstanding(self) -> int:
        """Instances this object started and has not stopped yet, as far as it tracks
        them (0 if it does not): what a shutdown in progress still has to stop."""
        return 0

    def kill_now(self) -> int:
        """Last resort, synchronous: kill every instance this object started and has not
        stopped, without waiting for anything (a forced exit: the third Ctrl-C). Returns
        how many it killed. Backends whose instances die with this process anyway, or
        that cannot kill without a network round trip, kill nothing here."""
        return 0

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
