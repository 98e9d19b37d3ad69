"""The local-process backend: one envport server process per instance, on loopback.

Each instance is ``python -m envport.rollout.backends.instance ENV --sessions S --port-file
F`` (:mod:`.instance`: an envport server for ``ENV`` built with the launch's options,
hosting ``S`` sessions), started in its own process group so that stopping it takes every
child with it. The server binds port 0 itself and writes the port it got to ``F``, so two
instances (or another program) can never race for a port; it is ready when ``GET
/health`` answers.

An environment id the registry does not know is refused before any process starts
(:func:`check_env_id`); one the server cannot build (a ``module:Class`` that does not
import, a constructor that raises) comes back from it as the environment's own error. Either
is what the in-process backend raises for it: an ``environment`` failure, not retried.
A server that crashes otherwise is a :class:`BackendError` whose first line is the
exception it died of, then the tail of its log.

Each instance has a small JSON file in ``state_dir`` (its :class:`EnvInstance`, pid
included), written as soon as its process is spawned, marked ``starting`` (with the
starting process's pid and start time) until the server is ready. The files outlive the
controller on purpose: a controller killed with SIGKILL leaves its servers running, and
the next one (same ``state_dir``) finds them with :meth:`LocalProcessBackend.list` and
re-adopts or stops them. A server whose starter died before it was ready is re-adopted if
it answers ``/health`` by then, else stopped and forgotten; one still being started by a
live process is left to it. A pid is trusted only if that process's command line still
names the instance id (no pid-reuse accidents).

**Limits.** A launch's ``memory_mb``, ``pids`` and ``cpus`` are enforced with a cgroup
(v1, as the sandboxes' :class:`~envport.sandbox.cgroups.CgroupSet`) that the server joins
as it starts: everything it runs (shell-v1's commands, a harness's tools) counts against
them, and a fork bomb stops at ``pids``. Where no cgroup can be made (not root, no
cgroup v1 controllers) the server runs without them, the instance's ``meta["limits"]``
says why, and a warning is logged once. ``disk_mb`` is never enforced here: use the
sandbox backend for a disk quota. The cgroup goes when the server is stopped.

A controller that *exits* (as opposed to being killed) never leaves a server behind, even
when its cleanup was cut short (a second Ctrl-C, an event loop torn down mid-stop). A stop
is SIGTERM to the server's process group, up to ``stop_grace_s`` for the server to exit,
then SIGKILL to the group, always: a child that ignores SIGTERM goes too. A stop cancelled
while it waits sends that SIGKILL before it gives up. :meth:`LocalProcessBackend.kill_now`
SIGKILLs every group the backend has not stopped yet, synchronously (a forced exit), and
an :mod:`atexit` hook does the same for every server this process spawned and did not
stop, whatever backend object started it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import httpx

from envport.errors import from_wire
from envport.procs import owner_alive, owner_tag, parse_owner
from envport.rollout.backends.base import Backend, BackendError, EnvInstance, EnvLaunch, Limits
from envport.sandbox.cgroups import CgroupSet

_log = logging.getLogger(__name__)

#: The server process's module (:mod:`.instance`; imported by no package ``__init__``).
INSTANCE_MODULE = "envport.rollout.backends.instance"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int, instance_id: str) -> bool:
    return instance_id in _cmdline(pid)


def _tail(path: Path, limit: int | None = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text if limit is None else text[-limit:]


def _read_port(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def check_env_id(env_id: str) -> None:
    """Raise the registry's :class:`~envport.errors.UnknownEnvError` for an id that no
    server could build, before a process is spent on it. ``module:Class`` paths pass:
    the server imports them, and reports what it cannot build (:func:`start_failure`)."""
    from envport.registry import spec

    spec(env_id)


#: A line that starts a traceback, or joins two of them, or a log record (uvicorn's
#: ``ERROR:    Application startup failed. Exiting.``): never the cause itself.
_FRAMING = (
    "Traceback ",
    "During handling of",
    "The above exception",
    *(f"{level}:" for level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
)
#: ``Type: message`` (or a bare ``Type``), as the last line of a traceback reads.
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(:\s|$)")


def last_words(log: str) -> str:
    """The line of a crashed server's log that says why: the exception line that ends its
    last traceback (unindented ``Type: message``), else its last non-blank line."""
    lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line) and not line.startswith(_FRAMING):
            return line
    return lines[-1] if lines else "(no output)"


def start_failure(
    env_id: str, log: str, *, reported: str | None = None, exit_code: int | None = None
) -> Exception:
    """Why an instance's server exited before it was ready.

    ``reported`` is what the server wrote to its error file: the environment could not be
    built, and that error (rebuilt from its wire form) is the environment's, as it would be
    in-process. Otherwise the server crashed: a :class:`BackendError` whose first line
    ends with the exception it died of, followed by the tail of its ``log``.
    """
    if reported:
        try:
            data = json.loads(reported)
        except ValueError:
            data = None
        if isinstance(data, dict):
            return from_wire(data)
    code = f" with code {exit_code}" if exit_code is not None else ""
    return BackendError(
        f"environment server for {env_id!r} exited{code} before it was ready: "
        f"{last_words(log)}\n--- the server's log, last lines ---\n{log}"
    )


def _forget(state_dir: Path, instance_id: str, cgroups: object = None) -> None:
    """Remove an instance's files, and its cgroups (``meta["cgroups"]``) if it had any."""
    for suffix in (".json", ".log", ".port", ".error"):
        (state_dir / f"{instance_id}{suffix}").unlink(missing_ok=True)
    (state_dir / f".{instance_id}.json.tmp").unlink(missing_ok=True)
    if isinstance(cgroups, dict) and cgroups:
        try:
            CgroupSet({str(k): Path(str(v)) for k, v in cgroups.items()}).remove()
        except OSError as exc:
            _log.warning("could not remove the cgroups of %s: %s", instance_id, exc)


def _limit_group(limits: Limits, instance_id: str) -> tuple[CgroupSet | None, str]:
    """The cgroup that enforces ``limits`` (``None`` if it asks for none, or none can be
    made), and what ``meta["limits"]`` says of them."""
    if limits.memory_mb is None and limits.pids is None and limits.cpus is None:
        return None, "none asked" if limits.disk_mb is None else _NO_DISK
    try:
        group = CgroupSet.create(
            f"envport-{instance_id}",
            memory_mb=limits.memory_mb,
            pids=limits.pids,
            cpus=limits.cpus,
        )
    except OSError as exc:
        return None, f"not enforced: no cgroup could be made ({exc})"
    return group, "enforced" if limits.disk_mb is None else f"enforced; {_NO_DISK}"


_NO_DISK = "disk_mb not enforced (the local backend has no disk quota)"


#: ``EnvInstance.meta`` key of a record whose server is not ready yet: the starting
#: process's :func:`~envport.procs.owner_tag`.
STARTING = "starting"


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


#: Servers this process spawned and has not stopped yet: pid (= process group) ->
#: (state dir, instance id, its cgroups). What :func:`_kill_leftovers` kills when the
#: process exits.
_SPAWNED: dict[int, tuple[Path, str, dict[str, str]]] = {}
_SPAWNER = os.getpid()


@atexit.register
def _kill_leftovers() -> None:
    """At interpreter exit: SIGKILL the process group of every server still in
    :data:`_SPAWNED` and forget its files. Nothing stopped them (their stop was cut
    short); without this they would outlive the controller that exits. Not in a forked
    child, whose exit must not take its parent's servers."""
    if os.getpid() != _SPAWNER:
        return
    for pid, (state_dir, instance_id, cgroups) in list(_SPAWNED.items()):
        _kill_group(pid, signal.SIGKILL)
        _forget(state_dir, instance_id, cgroups)
    _SPAWNED.clear()


class LocalProcessBackend(Backend):
    """Environment servers as local processes, tracked in ``state_dir``."""

    name: ClassVar[str] = "local"

    def __init__(
        self,
        state_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        stop_grace_s: float = 5.0,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.env = dict(env) if env is not None else None
        self.cwd = str(cwd) if cwd is not None else None
        self.stop_grace_s = stop_grace_s
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._http = httpx.AsyncClient(timeout=2.0)
        self._warned = False  # about limits that cannot be enforced here

    # --- start --------------------------------------------------------------------------

    def _argv(self, launch: EnvLaunch, instance_id: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            INSTANCE_MODULE,
            launch.env_id,
            "--host",
            self.host,
            "--port-file",
            str(self.state_dir / f"{instance_id}.port"),
            "--error-file",
            str(self.state_dir / f"{instance_id}.error"),
            "--sessions",
            str(launch.sessions),
            "--options",
            json.dumps(launch.env_kwargs()),
            "--instance-id",
            instance_id,
        ]

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        if self.env is None:  # else the servers' environment may register other ids
            check_env_id(launch.env_id)
        instance_id = f"local-{uuid.uuid4().hex[:12]}"
        log_path = self.state_dir / f"{instance_id}.log"
        t0 = time.perf_counter()
        group, enforced = await asyncio.to_thread(_limit_group, launch.limits, instance_id)
        if enforced.startswith("not enforced") and not self._warned:
            self._warned = True
            _log.warning("instance limits %s", enforced)
        cgroups = {} if group is None else {k: str(v) for k, v in group.dirs.items()}
        try:
            with log_path.open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    *self._argv(launch, instance_id),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    env=self.env,
                    cwd=self.cwd,
                )
            if group is not None:  # before it has built the env, let alone run its commands
                group.add(proc.pid)
        except BaseException:
            if group is not None:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(group.remove)
            raise
        self._procs[instance_id] = proc
        _SPAWNED[proc.pid] = (self.state_dir, instance_id, cgroups)
        meta: dict[str, object] = {"pid": proc.pid, "log": str(log_path), "host": self.host}
        meta.update(limits=enforced, cgroups=cgroups)
        instance = EnvInstance(
            instance_id=instance_id,
            backend=self.name,
            env_id=launch.env_id,
            url=None,
            labels=dict(launch.labels),
            meta={**meta, STARTING: owner_tag()},
        )
        try:
            # On disk before the wait: killed while it waits, this process leaves a
            # server that the next list() must be able to find.
            self._write_record(instance)
            await self._wait_ready(instance, proc, launch.start_timeout_s)
            instance.start_latency_s = time.perf_counter() - t0
            del instance.meta[STARTING]
            self._write_record(instance)
        except BaseException:
            await asyncio.shield(self._reap(instance))
            raise
        return instance

    async def _wait_ready(
        self,
        instance: EnvInstance,
        proc: asyncio.subprocess.Process,
        timeout_s: float,
    ) -> None:
        files = self.state_dir / instance.instance_id
        log_path, port_file = files.with_suffix(".log"), files.with_suffix(".port")
        deadline = time.monotonic() + timeout_s
        while True:
            if instance.url is None and (port := _read_port(port_file)) is not None:
                instance.url = f"http://{self.host}:{port}"
            if proc.returncode is not None:
                reported = _tail(files.with_suffix(".error"), limit=None)
                raise start_failure(
                    instance.env_id,
                    _tail(log_path),
                    reported=reported,
                    exit_code=proc.returncode,
                )
            if instance.url is not None and await self._health(instance):
                return
            if time.monotonic() > deadline:
                raise BackendError(
                    f"environment server for {instance.env_id!r} did not answer /health "
                    f"within {timeout_s:g} s (log: {log_path})"
                )
            await asyncio.sleep(0.05)

    async def _health(self, instance: EnvInstance) -> bool:
        try:
            reply = await self._http.get(f"{instance.url}/health")
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    # --- watch, stop, list --------------------------------------------------------------

    async def healthy(self, instance: EnvInstance) -> bool:
        pid = int(instance.meta.get("pid", 0))
        if not pid or not _alive(pid, instance.instance_id):
            return False
        return await self._health(instance)

    def _state_file(self, instance_id: str) -> Path:
        return self.state_dir / f"{instance_id}.json"

    def _write_record(self, instance: EnvInstance) -> None:
        """Write the instance's record whole (a reader never sees half of one)."""
        tmp = self.state_dir / f".{instance.instance_id}.json.tmp"
        tmp.write_text(instance.model_dump_json())
        os.replace(tmp, self._state_file(instance.instance_id))

    async def _reap(self, instance: EnvInstance) -> None:
        """Stop the server's process group, then forget it.

        SIGTERM, up to ``stop_grace_s`` for the server to exit, then SIGKILL to the group
        whether it exited or not (what it started and left behind goes with it). A reap
        cancelled while it waits (a second Ctrl-C, the loop shutting down) sends that
        SIGKILL before it gives up: a stop once begun is never left half done. Forgotten
        only once it is gone: a reap cancelled midway leaves the process in ``_procs`` and
        its record on disk, so :meth:`aclose` (or the next controller) reaps it."""
        pid = int(instance.meta.get("pid", 0))
        proc = self._procs.get(instance.instance_id)
        if pid and (proc is not None or _alive(pid, instance.instance_id)):
            _kill_group(pid, signal.SIGTERM)
            try:
                gone = await self._wait_gone(pid, instance.instance_id, proc, self.stop_grace_s)
                _kill_group(pid, signal.SIGKILL)
                if not gone:
                    await self._wait_gone(pid, instance.instance_id, proc, 5.0)
            except BaseException:
                _kill_group(pid, signal.SIGKILL)
                raise
        self._procs.pop(instance.instance_id, None)
        _SPAWNED.pop(pid, None)
        await asyncio.to_thread(
            _forget, self.state_dir, instance.instance_id, instance.meta.get("cgroups")
        )

    @staticmethod
    async def _wait_gone(
        pid: int, instance_id: str, proc: asyncio.subprocess.Process | None, timeout_s: float
    ) -> bool:
        if proc is not None:
            try:
                async with asyncio.timeout(timeout_s):  # wait_for (3.11) may drop a cancel
                    await proc.wait()
            except TimeoutError:
                return False
            return True
        deadline = time.monotonic() + timeout_s
        while _alive(pid, instance_id):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self, instance: EnvInstance) -> None:
        await self._reap(instance)

    def outstanding(self) -> int:
        return len(self._procs)

    def kill_now(self) -> int:
        """SIGKILL the process group of every server this backend started and has not
        stopped, and forget their records; synchronous, waits for nothing."""
        ids = list(self._procs)
        for instance_id in ids:
            pid = self._procs.pop(instance_id).pid
            _kill_group(pid, signal.SIGKILL)
            cgroups = _SPAWNED.pop(pid, (None, None, None))[2]
            _forget(self.state_dir, instance_id, cgroups)
        return len(ids)

    async def list(self, labels: Mapping[str, str] | None = None) -> list[EnvInstance]:
        want = dict(labels or {})
        found: list[EnvInstance] = []
        for path in sorted(self.state_dir.glob("local-*.json")):
            try:
                instance = EnvInstance.model_validate_json(path.read_text())
            except (OSError, ValueError):
                continue
            pid = int(instance.meta.get("pid", 0))
            if not pid or not _alive(pid, instance.instance_id):
                # died with its controller's machine, or killed: its files go too
                _forget(self.state_dir, instance.instance_id, instance.meta.get("cgroups"))
                continue
            if STARTING in instance.meta and not await self._claim_orphan(instance):
                continue
            if all(instance.labels.get(k) == v for k, v in want.items()):
                found.append(instance)
        return found

    async def _claim_orphan(self, instance: EnvInstance) -> bool:
        """A record of a server that was starting: whether it is now a live instance.

        Its starter still running (this process included), it is that process's start, not
        an instance yet: not listed, not touched. Its starter gone (killed while it
        waited), nothing will finish that start: a server that is ready by now is made an
        instance (its record completed: URL, no ``starting``) and listed; one that is
        not (still building, hung) is stopped and forgotten.
        """
        owner = parse_owner(str(instance.meta[STARTING]))
        if owner is not None and owner_alive(*owner):
            return False
        port = _read_port(self.state_dir / f"{instance.instance_id}.port")
        if port is not None:
            instance.url = f"http://{instance.meta.get('host', self.host)}:{port}"
            if await self._health(instance):
                del instance.meta[STARTING]
                self._write_record(instance)
                return True
        await self._reap(instance)
        return False

    async def aclose(self) -> None:
        ids = list(self._procs)
        instances = []
        for instance_id in ids:
            path = self._state_file(instance_id)
            proc = self._procs[instance_id]
            try:
                instances.append(EnvInstance.model_validate_json(path.read_text()))
            except (OSError, ValueError):
                instances.append(
                    EnvInstance(
                        instance_id=instance_id,
                        backend=self.name,
                        env_id="?",
                        meta={"pid": proc.pid},
                    )
                )
        try:
            await asyncio.gather(*(self._reap(i) for i in instances))
        finally:
            await self._http.aclose()
