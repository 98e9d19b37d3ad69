"""The sandbox backend: each instance is an envport server inside an :mod:`envport.sandbox`.

The server (``python -m envport.rollout.backends.instance ENV --uds PATH``, the local
backend's server on a Unix socket) lives in a sandbox with its own network namespace, so
it cannot listen where the controller could reach it over TCP (and nothing else can reach
it either: Ray-style "listens on all interfaces" does not apply). It serves on a Unix
socket the controller binds and listens on *outside* the sandbox, in a private directory
of its own (``envport-env-<pid>-…/envport-env.sock`` in the temp directory; a later run
sweeps those of dead controllers), and hands to the
sandbox's first shell as an inherited descriptor (``--fd N``; the shell closes its copy
once the server has it). The instance's URL is ``unix:<that path>``, which
:class:`~envport.client.EnvClient` speaks WebSocket over. (It used to be a socket in the
sandbox's ``/tmp`` reached through ``/proc/<init>/root/tmp``: a symlink planted there was
followed against the host's root, so the controller could be sent to any host socket.)
The launch's limits become the sandbox's cgroup limits;
``network=True`` shares the host's network.

The sandbox binds the controller's Python (its prefix, the virtual environment, and
envport's source directory, put on the server's ``PYTHONPATH`` when it lies outside
them) read-only, so the server runs the same code. Instances do not outlive the
controller (a sandbox dies with its parent), so :meth:`list` reports the live instances
this backend object started.

As with the local backend, an environment that cannot be built is the environment's
error, not retried (an id the registry does not know is refused before any sandbox is
made), and a server that crashes while starting is a :class:`BackendError` that starts
with the exception it died of.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import socket as socketlib
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx

import envport
from envport.procs import owner_alive, owner_tag, parse_owner
from envport.rollout.backends.base import (
    Backend,
    BackendError,
    BackendUnavailableError,
    EnvInstance,
    EnvLaunch,
)
from envport.rollout.backends.local import INSTANCE_MODULE, check_env_id, start_failure
from envport.sandbox import Sandbox, SandboxConfig, SandboxError, SandboxUnavailableError

SOCKET_NAME = "envport-env.sock"
SOCKET_DIR_PREFIX = "envport-env-"
LOG_NAME = "envport-env.log"
ERROR_NAME = "envport-env.error"


def python_binds() -> dict[str, Path]:
    """Read-only binds that let the sandbox run this interpreter with envport importable."""
    paths = {Path(sys.base_prefix), Path(sys.prefix), Path(envport.__file__).parent.parent}
    binds: dict[str, Path] = {}
    for path in sorted(p.resolve() for p in paths):
        if str(path).startswith(("/usr", "/etc")) or str(path) == "/":
            continue
        if any(path.is_relative_to(Path(done)) for done in binds):
            continue
        binds[str(path)] = path
    return binds


def source_path() -> str | None:
    """envport's source directory when the interpreter's own paths may not lead to it (a
    source tree on ``PYTHONPATH``, an editable install's other checkout): the server in
    the sandbox imports envport from there, the same code as this process."""
    root = Path(envport.__file__).resolve().parent.parent
    prefixes = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    return None if any(root.is_relative_to(p) for p in prefixes) else str(root)


class SandboxBackend(Backend):
    """Environment servers in local sandboxes, reached over Unix sockets."""

    name: ClassVar[str] = "sandbox"

    def __init__(self, *, base: SandboxConfig | None = None, stop_grace_s: float = 2.0) -> None:
        self.base = base or SandboxConfig()
        self.stop_grace_s = stop_grace_s
        self._sandboxes: dict[str, Sandbox] = {}
        self._instances: dict[str, EnvInstance] = {}

    def _config(self, launch: EnvLaunch) -> SandboxConfig:
        limits = launch.limits
        update: dict[str, Any] = {
            "network": launch.network,
            "keep_background": True,
            "ro_binds": {**python_binds(), **self.base.ro_binds},
        }
        for field in ("cpus", "memory_mb", "pids"):
            value = getattr(limits, field)
            if value is not None:
                update[field] = value
        if limits.disk_mb is not None:
            update["disk_mb"] = limits.disk_mb
        return SandboxConfig(**{**self.base.model_dump(), **update})

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        check_env_id(launch.env_id)
        instance_id = f"sandbox-{uuid.uuid4().hex[:12]}"
        t0 = time.perf_counter()
        # 0700, the controller's; named after it, so a later run sweeps it up if it dies
        where = Path(tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{owner_tag()}-"))
        _sweep_socket_dirs()
        path = str(where / SOCKET_NAME)
        listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(128)
            sb = await Sandbox.create(self._config(launch), pass_fds=(listener.fileno(),))
        except SandboxUnavailableError as exc:
            shutil.rmtree(where, ignore_errors=True)
            raise BackendUnavailableError(f"the sandbox backend cannot run here: {exc}") from exc
        except SandboxError as exc:
            shutil.rmtree(where, ignore_errors=True)
            raise BackendError(f"could not start a sandbox for {launch.env_id!r}: {exc}") from exc
        except BaseException:
            shutil.rmtree(where, ignore_errors=True)
            raise
        finally:
            fd = listener.detach()  # the number the sandbox's shell has it under
            os.close(fd)
        try:
            init = sb.init_pid
            if init is None:
                raise BackendUnavailableError(
                    "the sandbox backend needs isolated sandboxes (their own network "
                    "namespace); this one runs unisolated"
                )
            socket = path
            argv = [sys.executable, "-m", INSTANCE_MODULE, launch.env_id]
            argv += ["--fd", str(fd), "--error-file", f"/tmp/{ERROR_NAME}"]
            argv += ["--sessions", str(launch.sessions)]
            argv += ["--options", json.dumps(launch.env_kwargs()), "--instance-id", instance_id]
            command = shlex.join(argv)
            if (source := source_path()) is not None:
                command = f"PYTHONPATH={shlex.quote(source)}${{PYTHONPATH:+:$PYTHONPATH}} {command}"
            # The server keeps the listening socket; the shell (and so every later
            # command) does not.
            started = await sb.exec(f"{command} > /tmp/{LOG_NAME} 2>&1 & exec {fd}>&-")
            if started.exit_code != 0:
                raise BackendError(f"could not launch the server: {started.stderr.strip()}")
            instance = EnvInstance(
                instance_id=instance_id,
                backend=self.name,
                env_id=launch.env_id,
                url=f"unix:{socket}",
                labels=dict(launch.labels),
                meta={"sandbox_id": sb.id, "init_pid": init, "socket": socket},
            )
            await self._wait_ready(sb, instance, launch.start_timeout_s)
        except BaseException:
            await sb.close()
            shutil.rmtree(where, ignore_errors=True)
            raise
        instance.start_latency_s = time.perf_counter() - t0
        self._sandboxes[instance_id] = sb
        self._instances[instance_id] = instance
        return instance

    async def _wait_ready(self, sb: Sandbox, instance: EnvInstance, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not await _health(instance):
            if (sb.stats()["pids"] or 0) <= 2:  # the server process is gone
                log = await sb.exec(f"tail -c 2000 /tmp/{LOG_NAME}")
                reported = await sb.exec(f"cat /tmp/{ERROR_NAME} 2>/dev/null")
                raise start_failure(instance.env_id, log.stdout, reported=reported.stdout)
            if time.monotonic() > deadline:
                raise BackendError(
                    f"environment server for {instance.env_id!r} did not answer /health "
                    f"within {timeout_s:g} s"
                )
            await asyncio.sleep(0.05)

    async def healthy(self, instance: EnvInstance) -> bool:
        sb = self._sandboxes.get(instance.instance_id)
        if sb is None or sb.status.value == "closed":
            return False
        return await _health(instance)

    async def stop(self, instance: EnvInstance) -> None:
        sb = self._sandboxes.pop(instance.instance_id, None)
        self._instances.pop(instance.instance_id, None)
        if sb is not None:
            await sb.close()  # kills the whole sandbox: server, children, mounts, cgroups
        socket = instance.meta.get("socket")
        if isinstance(socket, str) and Path(socket).name == SOCKET_NAME:
            shutil.rmtree(Path(socket).parent, ignore_errors=True)

    async def list(self, labels: Mapping[str, str] | None = None) -> list[EnvInstance]:
        want = dict(labels or {})
        return [
            instance
            for instance in self._instances.values()
            if all(instance.labels.get(k) == v for k, v in want.items())
        ]

    async def aclose(self) -> None:
        for instance in list(self._instances.values()):
            await self.stop(instance)

    def outstanding(self) -> int:
        return len(self._instances)


_swept_sockets = False


def _sweep_socket_dirs() -> None:
    """Remove the socket directories of controllers that died (SIGKILL), once a process."""
    global _swept_sockets
    if _swept_sockets:
        return
    _swept_sockets = True
    for entry in Path(tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}*"):
        owner = parse_owner(entry.name[len(SOCKET_DIR_PREFIX) :])
        if owner is not None and not owner_alive(*owner):
            shutil.rmtree(entry, ignore_errors=True)


async def _health(instance: EnvInstance) -> bool:
    """``GET /health`` over the instance's Unix socket; never raises."""
    socket = str(instance.meta.get("socket", ""))
    with contextlib.suppress(httpx.HTTPError, OSError):
        transport = httpx.AsyncHTTPTransport(uds=socket)
        async with httpx.AsyncClient(transport=transport, timeout=2.0) as client:
            reply = await client.get("http://localhost/health")
            return reply.status_code == 200
    return False
