"""Pre-started sandboxes, so that ``create`` and ``fork`` skip the start.

Starting a sandbox is mostly the kernel's work: new namespaces, a cgroup migration (an
RCU grace period per controller), bwrap's mounts, a bash exec. None of it depends on
the task, only on the sandbox's *shape* (limits, network, environment, workdir). A
:class:`SandboxPool` keeps ``size`` sandboxes of one shape started and idle; taking one
for a task is then what a reset costs: mount the task's workspace (the overlay over the
task's directory), ``cd`` into it. A background filler (a task the pool owns and awaits
on close) starts replacements. A sandbox taken from the pool belongs to the caller, and
its :meth:`~envport.sandbox.Sandbox.fork` children come from the same pool.

    async with SandboxPool(SandboxConfig(memory_mb=512), size=8) as pool:
        sb = await pool.create(workspace="repo/")     # ~ a reset, not a start
        children = await sb.fork(4)                  # pool sandboxes too
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from envport.sandbox.config import (
    SandboxConfig,
    SandboxError,
    SandboxFailure,
    SandboxUnavailableError,
)
from envport.sandbox.probe import probe
from envport.sandbox.sandbox import Sandbox, Snapshot


class SandboxPool:
    """``size`` idle sandboxes of ``config``'s shape, refilled in the background."""

    def __init__(self, config: SandboxConfig | None = None, *, size: int = 4) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.config = config or SandboxConfig()
        self.size = size
        self._idle: list[Sandbox] = []
        self._filler: asyncio.Task[None] | None = None
        self._closed = False
        self._isolated = False
        self._bwrap: str | None = None
        self.fill_errors: list[BaseException] = []

    async def __aenter__(self) -> SandboxPool:
        isolation = await asyncio.to_thread(probe)
        if not isolation.isolated and not self.config.allow_unisolated:
            raise SandboxUnavailableError(
                f"cannot isolate a sandbox on this machine: {isolation.explain()}",
                problems=list(isolation.problems),
            )
        self._isolated, self._bwrap = isolation.isolated, isolation.bwrap
        # Through create() once: the stale sweep and a first sandbox, started now.
        first = await Sandbox.create(self.config)
        first.pool = self
        self._idle.append(first)
        self._kick()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def idle(self) -> int:
        return len(self._idle)

    def serves(self, config: SandboxConfig) -> bool:
        """Whether ``config`` has this pool's shape (anything may differ but the workspace)."""
        return config.model_copy(update={"workspace": None}) == self.config.model_copy(
            update={"workspace": None}
        )

    async def create(self, workspace: str | Path | None = None) -> Sandbox:
        """A sandbox of the pool's shape on ``workspace`` (default: the config's)."""
        config = self.config
        if workspace is not None:
            config = SandboxConfig(**{**self.config.model_dump(), "workspace": workspace})
        return await self.take(config)

    async def take(
        self,
        config: SandboxConfig,
        *,
        parent: Sandbox | None = None,
        snapshot: Snapshot | None = None,
    ) -> Sandbox:
        """An idle sandbox rebound to ``config``'s task (started now if none is idle)."""
        if self._closed:
            raise SandboxFailure("the sandbox pool is closed")
        if not self.serves(config):
            raise SandboxError("this pool's sandboxes have another shape than the config asks")
        if self._idle:
            sb = self._idle.pop()
        else:
            sb = await Sandbox._start(self.config, self._isolated, self._bwrap, None, None)
            sb.pool = self
        self._kick()
        try:
            await sb._rebind(config, parent, snapshot)
        except BaseException:
            await sb.close()
            raise
        return sb

    def _kick(self) -> None:
        if not self._closed and (self._filler is None or self._filler.done()):
            self._filler = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        while not self._closed and len(self._idle) < self.size:
            try:
                sb = await Sandbox._start(self.config, self._isolated, self._bwrap, None, None)
            except Exception as exc:  # recorded; take() still starts one itself
                self.fill_errors.append(exc)
                return
            sb.pool = self
            if self._closed:
                await sb.close()
                return
            self._idle.append(sb)

    async def aclose(self) -> None:
        """Stop the filler and close every idle sandbox (taken ones are the caller's)."""
        self._closed = True
        if self._filler is not None:
            self._filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filler
        idle, self._idle = self._idle, []
        for sb in idle:
            await sb.close()
