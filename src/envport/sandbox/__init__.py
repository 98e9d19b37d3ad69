"""Local Linux sandboxes: an isolated persistent shell on an overlay workspace, with
snapshot, reset and fork, and no Docker (see :mod:`envport.sandbox.sandbox`).

::

    async with await Sandbox.create(SandboxConfig(workspace="repo/")) as sb:
        result = await sb.exec("pytest -q")
        snap = await sb.snapshot()
        children = await sb.fork(4)
"""

from envport.sandbox.config import (
    ExecResult,
    SandboxClosedError,
    SandboxConfig,
    SandboxError,
    SandboxFailure,
    SandboxPathError,
    SandboxUnavailableError,
)
from envport.sandbox.pool import SandboxPool
from envport.sandbox.probe import Isolation, probe
from envport.sandbox.sandbox import Sandbox, SandboxStatus, Snapshot, cleanup_stale

__all__ = [
    "ExecResult",
    "Isolation",
    "Sandbox",
    "SandboxClosedError",
    "SandboxConfig",
    "SandboxError",
    "SandboxFailure",
    "SandboxPathError",
    "SandboxPool",
    "SandboxStatus",
    "SandboxUnavailableError",
    "Snapshot",
    "cleanup_stale",
    "probe",
]
