"""Ray backend: each environment instance is a named Ray actor that hosts an envport server.

::

    backend = RayBackend(address="10.0.0.1:6379", placement="spread")
    inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "r1"}))
    async with inst.client() as env:         # WebSocket straight to the actor's node
        await env.reset()

One actor, one server: the actor's process runs uvicorn in a thread, bound to its node's
IP (never ``0.0.0.0``; Ray's own daemons listen on every interface whatever they are
told, the environment server does not) on a free port, and returns its URL. Steps never
go through Ray: the controller talks WebSocket to the node directly, so Ray only places,
watches and reaps.

Design choices:

- **Placement is Ray's.** ``placement="spread"`` is Ray's ``SPREAD`` strategy (instances
  go to different nodes while they can), ``"pack"`` its ``DEFAULT`` (fill a node first).
  ``resources`` (custom node resources) and ``node_labels`` (Ray's ``label_selector``)
  restrict which nodes qualify. ``Limits.cpus``/``memory_mb`` are reserved as Ray
  logical resources; ``pids``/``disk_mb`` cannot be enforced by Ray and are refused.
- **The actor carries its own record** (env id, labels, URL, node): :meth:`list` finds
  live actors by name prefix in the namespace and asks each one, so a restarted
  controller re-adopts what is running without any side store. Actors are detached by
  default so that they outlive the driver that started them.
- **No silent restarts** (``max_restarts=0``): when a node dies its instances are gone,
  :meth:`healthy` says so, and the controller decides what to start instead.
- Ray's client calls block; they run in a worker thread, and object refs are awaited
  through their futures, so the event loop never stalls on Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

import httpx

from envport.errors import from_wire
from envport.rollout.backends.base import (
    Backend,
    BackendError,
    BackendUnavailableError,
    EnvInstance,
    EnvLaunch,
    Limits,
)

Placement = Literal["spread", "pack"]

_STRATEGY: dict[str, str] = {"spread": "SPREAD", "pack": "DEFAULT"}


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendUnavailableError(
            "the Ray backend needs Ray: pip install 'envport[ray]'"
        ) from exc
    return ray


class _EnvServerActor:
    """Runs in the Ray worker: one envport server on the node's IP, in a thread."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._record = dict(record)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def serve(
        self,
        env_id: str,
        options: dict[str, Any],
        sessions: int,
        bind_host: str | None,
        startup_timeout_s: float,
    ) -> dict[str, Any]:
        """Start the server; the record with its URL, or ``{"error": ...}``.

        Errors come back as text: envport's exceptions carry keyword state that Ray's
        exception pickling cannot rebuild on the driver.
        """
        from envport.errors import EnvportError

        try:
            return self._serve(env_id, options, sessions, bind_host, startup_timeout_s)
        except EnvportError as exc:  # the environment could not be built: its own error
            return {"env_error": exc.to_wire()}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _serve(
        self,
        env_id: str,
        options: dict[str, Any],
        sessions: int,
        bind_host: str | None,
        startup_timeout_s: float,
    ) -> dict[str, Any]:
        import uvicorn

        from envport.rollout.backends.instance import instance_app
        from envport.server import uvicorn_config
        from envport.serving import listening_socket

        ray = _ray()
        ctx = ray.get_runtime_context()
        node_id: str = ctx.get_node_id()
        node_ip = next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id),
            ray.util.get_node_ip_address(),
        )
        host = bind_host or node_ip
        app, config = instance_app(env_id, sessions, options, host=host)
        # Bound here and handed to uvicorn, so no other process takes the port meanwhile.
        sock = listening_socket(host)
        port = int(sock.getsockname()[1])
        self._server = uvicorn.Server(uvicorn_config(app, host=host, port=port, config=config))
        self._thread = threading.Thread(
            target=self._server.run, args=([sock],), name="envport-ray", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                raise RuntimeError(f"the envport server on {host}:{port} did not start")
            time.sleep(0.01)
        url_host = node_ip if host in ("0.0.0.0", "::") else host
        self._record.update(
            url=f"http://{url_host}:{port}",
            node_id=node_id,
            node_ip=node_ip,
            actor_id=ctx.get_actor_id(),
            pid=os.getpid(),
        )
        return self._record

    def describe(self) -> dict[str, Any]:
        return self._record

    def ping(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)


class RayBackend(Backend):
    """Environment instances as named Ray actors, placed across the cluster's nodes."""

    name: ClassVar[str] = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        namespace: str = "envport",
        placement: Placement = "spread",
        resources: Mapping[str, float] | None = None,
        node_labels: Mapping[str, str] | None = None,
        default_cpus: float = 0.1,
        detached: bool = True,
        bind_host: str | None = None,
        name_prefix: str = "envport-env-",
        runtime_env: Mapping[str, Any] | None = None,
        call_timeout_s: float = 10.0,
    ) -> None:
        if placement not in _STRATEGY:
            raise ValueError(f"placement must be 'spread' or 'pack', not {placement!r}")
        if default_cpus <= 0:
            raise ValueError(f"default_cpus must be > 0, not {default_cpus}")
        self.address = address
        self.namespace = namespace
        self.placement = placement
        self.resources = dict(resources or {})
        self.node_labels = dict(node_labels or {})
        self.default_cpus = default_cpus
        self.detached = detached
        self.bind_host = bind_host
        self.name_prefix = name_prefix
        self.runtime_env = dict(runtime_env) if runtime_env else None
        self.call_timeout_s = call_timeout_s
        self._handles: dict[str, Any] = {}
        self._started: set[str] = set()
        self._owns_ray = False
        self._connected = False
        self._actor_cls: Any = None
        self._connect_lock = asyncio.Lock()

    # --- connection ---------------------------------------------------------------------

    async def _connect(self) -> Any:
        ray = _ray()
        async with self._connect_lock:
            if not self._connected:
                await asyncio.to_thread(self._connect_sync, ray)
                self._connected = True
        return ray

    def _connect_sync(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        try:
            ray.init(
                address=self.address,
                namespace=self.namespace,
                log_to_driver=False,
                logging_level="warning",
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = self.address or "auto"
            raise BackendUnavailableError(f"cannot connect to Ray at {where}: {exc}") from exc
        self._owns_ray = True

    # --- the contract -------------------------------------------------------------------

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        ray = await self._connect()
        options = self._actor_options(launch.limits)
        name = f"{self.name_prefix}{uuid.uuid4().hex[:12]}"
        record = {
            "instance_id": name,
            "env_id": launch.env_id,
            "labels": dict(launch.labels),
            "namespace": self.namespace,
            "started_at": datetime.now(UTC).isoformat(),
        }
        began = time.monotonic()
        if self._actor_cls is None:
            self._actor_cls = ray.remote(_EnvServerActor)
        actor_cls = self._actor_cls

        def create() -> Any:
            return actor_cls.options(name=name, **options).remote(record)

        created = asyncio.ensure_future(asyncio.to_thread(create))
        try:
            # Shielded: cancelled while Ray creates the (detached, named) actor in its
            # thread, the actor still comes to be; it is waited for, then killed.
            handle = await asyncio.shield(created)
        except (ValueError, TypeError) as exc:
            raise BackendError(f"Ray refused the actor options for {name}: {exc}") from exc
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                self._handles[name] = await created
            await asyncio.shield(self._kill(name))
            raise
        self._handles[name] = handle
        ref = handle.serve.remote(
            launch.env_id,
            launch.env_kwargs(),
            launch.sessions,
            self.bind_host,
            launch.start_timeout_s,
        )
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
            # that lands as the awaited call completes (here: the instance would live on).
            async with asyncio.timeout(launch.start_timeout_s):
                described = await asyncio.wrap_future(ref.future())
        except asyncio.CancelledError:
            await asyncio.shield(self._kill(name))  # leave nothing behind
            raise
        except TimeoutError:
            await self._kill(name)
            raise BackendError(
                f"{launch.env_id!r} did not start on Ray within {launch.start_timeout_s:g}s; "
                f"is there a live node with {self._requirements(options)}?"
            ) from None
        except Exception as exc:
            await self._kill(name)
            raise BackendError(
                f"{launch.env_id!r} failed to start on Ray: {_ray_cause(ray, exc)}"
            ) from exc
        if "env_error" in described:  # the environment's error, as in-process: not retried
            await self._kill(name)
            raise from_wire(described["env_error"])
        if "error" in described:
            await self._kill(name)
            raise BackendError(f"{launch.env_id!r} failed to start on Ray: {described['error']}")
        self._started.add(name)
        return self._instance(described, start_latency_s=time.monotonic() - began)

    async def healthy(self, instance: EnvInstance) -> bool:
        if instance.url is None:
            return False
        try:
            async with httpx.AsyncClient(timeout=self.call_timeout_s) as http:
                response = await http.get(f"{instance.url}/health")
            if response.status_code != 200:
                return False
            handle = await self._handle(instance.instance_id)
            if handle is None:
                return False
            async with asyncio.timeout(self.call_timeout_s):
                alive = await asyncio.wrap_future(handle.ping.remote().future())
            return bool(alive)
        except Exception:
            return False

    async def stop(self, instance: EnvInstance) -> None:
        # Forgotten once killed, not before: a stop cancelled midway (the controller
        # exits during the shutdown call) leaves the actor for aclose to kill.
        await self._connect()
        handle = await self._handle(instance.instance_id)
        if handle is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.call_timeout_s):
                    await asyncio.wrap_future(handle.shutdown.remote().future())
            await self._kill(instance.instance_id)
        self._started.discard(instance.instance_id)

    async def list(self, labels: Mapping[str, str] | None = None) -> list[EnvInstance]:
        ray = await self._connect()
        wanted = dict(labels or {})

        def names() -> list[str]:
            found = ray.util.list_named_actors(all_namespaces=True)
            return [
                a["name"]
                for a in found
                if a["namespace"] == self.namespace and a["name"].startswith(self.name_prefix)
            ]

        async def describe(name: str) -> dict[str, Any] | None:
            handle = await self._handle(name)
            if handle is None:
                return None
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    record: dict[str, Any] = await asyncio.wrap_future(
                        handle.describe.remote().future()
                    )
            except Exception:
                return None  # dead, dying or unreachable: not a live instance
            return record if record.get("url") else None

        records = await asyncio.gather(*(describe(n) for n in await asyncio.to_thread(names)))
        return [
            self._instance(r)
            for r in records
            if r is not None and wanted.items() <= r.get("labels", {}).items()
        ]

    async def aclose(self) -> None:
        failed: list[str] = []
        if self._connected:
            names = sorted(self._started)  # each forgotten as it is killed
            results = await asyncio.gather(
                *(
                    self.stop(EnvInstance(instance_id=n, backend=self.name, env_id=""))
                    for n in names
                ),
                return_exceptions=True,
            )
            failed = [f"{n}: {r}" for n, r in zip(names, results, strict=True) if r]
        if self._owns_ray:
            await asyncio.to_thread(_ray().shutdown)
            self._owns_ray = False
            self._connected = False
        if failed:
            raise BackendError("could not stop every instance: " + "; ".join(failed))

    # --- helpers ------------------------------------------------------------------------

    def _actor_options(self, limits: Limits) -> dict[str, Any]:
        refused = [f for f in ("pids", "disk_mb") if getattr(limits, f) is not None]
        if refused:
            raise BackendError(
                f"the Ray backend cannot enforce {' or '.join(refused)} limits; "
                "use a sandbox or the Kubernetes backend for them"
            )
        options: dict[str, Any] = {
            "namespace": self.namespace,
            "num_cpus": limits.cpus or self.default_cpus,
            "max_restarts": 0,
            "scheduling_strategy": _STRATEGY[self.placement],
        }
        if limits.memory_mb is not None:
            options["memory"] = limits.memory_mb * 2**20
        if self.detached:
            options["lifetime"] = "detached"
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.node_labels:
            options["label_selector"] = dict(self.node_labels)
        if self.runtime_env:
            options["runtime_env"] = dict(self.runtime_env)
        return options

    @staticmethod
    def _requirements(options: Mapping[str, Any]) -> str:
        wanted = {"CPU": options["num_cpus"], **options.get("resources", {})}
        if "memory" in options:
            wanted["memory"] = options["memory"]
        text = f"resources {wanted}"
        if "label_selector" in options:
            text += f" and labels {options['label_selector']}"
        return text

    async def _handle(self, name: str) -> Any:
        """The actor's handle, or None when no live actor has that name."""
        if name in self._handles:
            return self._handles[name]
        ray = await self._connect()

        def lookup() -> Any:
            try:
                return ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return None

        handle = await asyncio.to_thread(lookup)
        if handle is not None:
            self._handles[name] = handle
        return handle

    async def _kill(self, name: str) -> None:
        """Kill the actor and wait (bounded) until Ray has released its name."""
        ray = _ray()
        handle = self._handles.pop(name, None)

        def kill() -> None:
            if handle is not None:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
            deadline = time.monotonic() + self.call_timeout_s
            while time.monotonic() < deadline:
                try:
                    other = ray.get_actor(name, namespace=self.namespace)
                except ValueError:
                    return
                if handle is None:
                    with contextlib.suppress(Exception):
                        ray.kill(other, no_restart=True)
                time.sleep(0.05)

        await asyncio.to_thread(kill)

    def _instance(
        self, record: Mapping[str, Any], *, start_latency_s: float | None = None
    ) -> EnvInstance:
        return EnvInstance(
            instance_id=record["instance_id"],
            backend=self.name,
            env_id=record["env_id"],
            url=record["url"],
            labels=dict(record.get("labels", {})),
            started_at=datetime.fromisoformat(record["started_at"]),
            start_latency_s=start_latency_s,
            meta={
                "actor_name": record["instance_id"],
                "actor_id": record.get("actor_id"),
                "namespace": record.get("namespace"),
                "node_id": record.get("node_id"),
                "node_ip": record.get("node_ip"),
                "pid": record.get("pid"),
            },
        )


def _ray_cause(ray: Any, exc: BaseException) -> str:
    """The environment's own error inside a Ray task error, else Ray's message."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if cause is not None:
            return f"{type(cause).__name__}: {cause}"
    if isinstance(exc, ray.exceptions.RayActorError):
        return f"the actor died before its server started ({exc})"
    return f"{type(exc).__name__}: {exc}"
