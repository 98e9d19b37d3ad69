"""Kubernetes backend: each environment instance is a Job (or a bare Pod) serving envport.

::

    backend = KubernetesBackend(namespace="rl", image="registry.example/envport:0.1")
    inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "r1"}))
    async with inst.client() as env:          # http://<pod IP>:8000
        await env.reset()

The manifest comes from a YAML template (``k8s_template.yaml`` next to this module by
default): ``string.Template`` fills ``${name}``, ``${image}``, ``${env_id}``, ``${port}``
and ``${sessions}``, then the backend sets what it owns on the parsed object:

- labels ``app=envport``, ``envport/instance=<name>`` and ``envport/<key>=<value>`` for
  each launch label (checked against Kubernetes' label syntax before any request), on
  the Job and on its pod template; the exact launch labels and env id also go in
  annotations, so a restarted controller rebuilds the same :class:`EnvInstance`;
- ``activeDeadlineSeconds`` (the cluster kills an instance its controller forgot) and,
  for Jobs, ``ttlSecondsAfterFinished`` (the cluster deletes it once finished);
- resources from :class:`Limits` (``cpu``, ``memory``, ``ephemeral-storage`` as requests
  and limits). Kubernetes has no per-pod pid limit, so ``Limits.pids`` is refused.

``start`` creates the object and polls its pod until it is Running and Ready (the
template's readiness probe is ``GET /health``); the URL is ``http://<pod IP>:<port>``, so
the controller must reach the pod network (run it in the cluster). A pod that fails
while starting is reported with its termination message (``FallbackToLogsOnError``: the
tail of its log) and deleted. ``stop`` deletes with ``propagationPolicy=Background``
(the API's default for Jobs orphans their pods). ``list`` is a label-selector query.

Every API error is mapped once, here, to :class:`BackendError` carrying the API's own
``Status`` reason and message; an API server that cannot be reached is
:class:`BackendUnavailableError`. The client is the official ``kubernetes`` package; its
calls block, so they run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import string
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import httpx

from envport.errors import env_error_in
from envport.rollout.backends.base import (
    Backend,
    BackendError,
    BackendUnavailableError,
    EnvInstance,
    EnvLaunch,
    Limits,
)

DEFAULT_TEMPLATE = Path(__file__).with_name("k8s_template.yaml")
LABEL_PREFIX = "envport/"
INSTANCE_LABEL = "envport/instance"
ENV_ANNOTATION = "envport/env-id"
LABELS_ANNOTATION = "envport/labels"

_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_T = TypeVar("_T")


def _k8s() -> Any:
    try:
        import kubernetes
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendUnavailableError(
            "the Kubernetes backend needs the client: pip install 'envport[kubernetes]'"
        ) from exc
    return kubernetes


class KubernetesBackend(Backend):
    """Environment instances as Kubernetes Jobs or Pods built from a template."""

    name: ClassVar[str] = "kubernetes"

    def __init__(
        self,
        *,
        namespace: str = "default",
        image: str = "envport:latest",
        template: str | Path | None = None,
        api_client: Any = None,
        host: str | None = None,
        kubeconfig: str | Path | None = None,
        context: str | None = None,
        port: int = 8000,
        workload: Literal["job", "pod"] = "job",
        active_deadline_s: int | None = 6 * 3600,
        ttl_after_finished_s: int | None = 300,
        poll_interval_s: float = 0.25,
        request_timeout_s: float = 10.0,
    ) -> None:
        """``template`` is YAML text or a path; ``api_client`` wins over ``host`` (a plain
        API URL, no auth), which wins over ``kubeconfig``/``context``; with none of them
        the in-cluster config is tried, then ``~/.kube/config``. ``workload="pod"`` runs
        a Job template's pod as a bare Pod (no TTL: nothing deletes a finished bare Pod)."""
        if not 0 < port < 65536:
            raise ValueError(f"port must be 1..65535, not {port}")
        if workload not in ("job", "pod"):
            raise ValueError(f"workload must be 'job' or 'pod', not {workload!r}")
        self.workload = workload
        self.namespace = namespace
        self.image = image
        if template is None:
            self.template = DEFAULT_TEMPLATE.read_text()
        elif isinstance(template, Path):
            self.template = template.read_text()
        else:
            self.template = template
        self.port = port
        self.active_deadline_s = active_deadline_s
        self.ttl_after_finished_s = ttl_after_finished_s
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self._api_client = api_client
        self._owns_client = api_client is None
        self._host = host
        self._kubeconfig = str(kubeconfig) if kubeconfig is not None else None
        self._context = context
        self._started: dict[str, EnvInstance] = {}

    # --- API access ---------------------------------------------------------------------

    def _client(self) -> Any:
        if self._api_client is None:
            k8s = _k8s()
            if self._host is not None:
                configuration = k8s.client.Configuration(host=self._host)
                self._api_client = k8s.client.ApiClient(configuration)
            elif self._kubeconfig is not None or self._context is not None:
                try:
                    self._api_client = k8s.config.new_client_from_config(
                        config_file=self._kubeconfig, context=self._context
                    )
                except (k8s.config.ConfigException, OSError) as exc:
                    raise BackendUnavailableError(
                        f"cannot load kubeconfig {self._kubeconfig or '~/.kube/config'}"
                        f"{f' (context {self._context})' if self._context else ''}: {exc}"
                    ) from exc
            else:
                try:
                    k8s.config.load_incluster_config()
                    self._api_client = k8s.client.ApiClient()
                except k8s.config.ConfigException:
                    try:
                        self._api_client = k8s.config.new_client_from_config()
                    except (k8s.config.ConfigException, OSError) as exc:
                        raise BackendUnavailableError(
                            f"no Kubernetes cluster configured (no in-cluster config, no "
                            f"kubeconfig): {exc}"
                        ) from exc
        return self._api_client

    def _core(self) -> Any:
        return _k8s().client.CoreV1Api(self._client())

    def _batch(self) -> Any:
        return _k8s().client.BatchV1Api(self._client())

    async def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run one blocking API call in a thread; map its errors (see module docstring)."""

        def run() -> _T:
            k8s = _k8s()
            try:
                return fn()
            except k8s.client.exceptions.ApiException as exc:
                raise _api_error(what, exc) from exc
            except BackendError:
                raise
            except Exception as exc:
                if _is_connection_error(exc):
                    host = self._client().configuration.host
                    raise BackendUnavailableError(
                        f"cannot reach the Kubernetes API at {host} to {what}: {exc}"
                    ) from exc
                raise

        return await asyncio.to_thread(run)

    # --- manifests ----------------------------------------------------------------------

    def manifest(self, launch: EnvLaunch, name: str) -> dict[str, Any]:
        """The object :meth:`start` would create for ``launch`` (a Job or a Pod dict)."""
        import yaml

        values = {
            "name": name,
            "image": self.image,
            "env_id": launch.env_id,
            "port": str(self.port),
            "sessions": str(launch.sessions),
        }
        try:
            text = string.Template(self.template).substitute(values)
            obj = yaml.safe_load(text)
        except (KeyError, ValueError, yaml.YAMLError) as exc:
            raise BackendError(f"the Kubernetes template is not usable: {exc}") from exc
        if not isinstance(obj, dict) or obj.get("kind") not in ("Job", "Pod"):
            raise BackendError("the Kubernetes template must be one Job or one Pod manifest")
        if self.workload == "pod" and obj["kind"] == "Job":
            template = obj.get("spec", {}).get("template", {})
            obj = {"apiVersion": "v1", "kind": "Pod", **template}
        labels = {"app": "envport", INSTANCE_LABEL: name, **_launch_labels(launch.labels)}
        annotations = {
            ENV_ANNOTATION: launch.env_id,
            LABELS_ANNOTATION: json.dumps(launch.labels, sort_keys=True),
        }
        pod_spec = _pod_spec(obj)
        for meta in (obj.setdefault("metadata", {}), _pod_meta(obj)):
            meta.setdefault("labels", {}).update(labels)
            meta.setdefault("annotations", {}).update(annotations)
        obj["metadata"]["name"] = name
        obj["metadata"]["namespace"] = self.namespace
        if self.active_deadline_s is not None:
            target = obj["spec"] if obj["kind"] == "Job" else pod_spec
            target["activeDeadlineSeconds"] = self.active_deadline_s
        if obj["kind"] == "Job" and self.ttl_after_finished_s is not None:
            obj["spec"]["ttlSecondsAfterFinished"] = self.ttl_after_finished_s
        if kwargs := launch.env_kwargs():  # the env container's server builds the env
            _env_container(pod_spec).setdefault("args", []).extend(
                ["--env-options", json.dumps(kwargs, sort_keys=True)]
            )
        resources = _resources(launch.limits)
        if resources:
            container = _env_container(pod_spec)
            container.setdefault("resources", {})
            for key in ("requests", "limits"):
                container["resources"].setdefault(key, {}).update(resources)
        return obj

    # --- the contract -------------------------------------------------------------------

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        name = self._new_name()
        obj = self.manifest(launch, name)
        kind = obj["kind"]
        k8s = _k8s()
        began = time.monotonic()
        if kind == "Job":
            body = k8s.client.V1Job.from_dict(obj)
            create = self._call(
                f"create Job {name}",
                lambda: self._batch().create_namespaced_job(self.namespace, body),
            )
        else:
            body = k8s.client.V1Pod.from_dict(obj)
            create = self._call(
                f"create Pod {name}",
                lambda: self._core().create_namespaced_pod(self.namespace, body),
            )
        created = asyncio.ensure_future(create)
        try:
            # Shielded: cancelled while the API call runs in its thread, the create still
            # lands; the cleanup below waits for it, so there is something to delete.
            await asyncio.shield(created)
            pod = await self._wait_ready(name, kind, launch.start_timeout_s)
        except BaseException:
            with contextlib.suppress(BaseException):
                await created
            with contextlib.suppress(BackendError):
                await self._delete(name, kind)
            raise
        inst = self._instance(pod, kind, start_latency_s=time.monotonic() - began)
        self._started[name] = inst
        return inst

    async def healthy(self, instance: EnvInstance) -> bool:
        try:
            pod = await self._pod(instance.instance_id)
            if pod is None or not _ready(pod) or instance.url is None:
                return False
            async with httpx.AsyncClient(timeout=self.request_timeout_s) as http:
                response = await http.get(f"{instance.url}/health")
            return response.status_code == 200
        except Exception:
            return False

    async def stop(self, instance: EnvInstance) -> None:
        # Forgotten once deleted, not before: a stop cancelled (or failed) midway leaves
        # the instance for aclose to delete.
        kind = instance.meta.get("kind", "Job")
        await self._delete(instance.instance_id, kind)
        self._started.pop(instance.instance_id, None)

    async def list(self, labels: Mapping[str, str] | None = None) -> list[EnvInstance]:
        selector = ",".join(
            f"{k}={v}" for k, v in {"app": "envport", **_launch_labels(dict(labels or {}))}.items()
        )
        pods = await self._call(
            "list pods",
            lambda: self._core().list_namespaced_pod(
                self.namespace, label_selector=selector, _request_timeout=self.request_timeout_s
            ),
        )
        found = []
        for pod in pods.items:
            if not _ready(pod) or pod.metadata.deletion_timestamp is not None:
                continue
            owners = pod.metadata.owner_references or []
            kind = "Job" if any(o.kind == "Job" for o in owners) else "Pod"
            found.append(self._instance(pod, kind))
        return sorted(found, key=lambda i: i.started_at)

    async def aclose(self) -> None:
        started = list(self._started.values())  # each forgotten as it is deleted
        try:
            results = await asyncio.gather(*(self.stop(i) for i in started), return_exceptions=True)
        finally:
            if self._owns_client and self._api_client is not None:
                await asyncio.to_thread(self._api_client.close)
                self._api_client = None
        failed = [f"{i.instance_id}: {r}" for i, r in zip(started, results, strict=True) if r]
        if failed:
            raise BackendError("could not stop every instance: " + "; ".join(failed))

    # --- helpers ------------------------------------------------------------------------

    def _new_name(self) -> str:
        return f"envport-{uuid.uuid4().hex[:12]}"

    async def _pod(self, name: str) -> Any:
        """The instance's pod (the Job's pod, or the Pod itself), or None."""
        pods = await self._call(
            f"find the pod of {name}",
            lambda: self._core().list_namespaced_pod(
                self.namespace,
                label_selector=f"{INSTANCE_LABEL}={name}",
                _request_timeout=self.request_timeout_s,
            ),
        )
        live = [p for p in pods.items if p.metadata.deletion_timestamp is None]
        return live[0] if live else None

    async def _wait_ready(self, name: str, kind: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        pod = None
        while True:
            pod = await self._pod(name)
            if pod is None and kind == "Job":
                failed = await self._job_failure(name)
                if failed is not None:
                    raise BackendError(f"Job {name} failed: {failed}")
            if pod is not None:
                phase = pod.status.phase if pod.status else None
                if phase in ("Failed", "Succeeded"):
                    reported = _env_error(pod)
                    if reported is not None:  # the environment's own error: not retried
                        raise reported
                    raise BackendError(f"pod {pod.metadata.name} {_why_ended(pod)}")
                if phase == "Running" and _ready(pod):
                    return pod
            if time.monotonic() > deadline:
                raise BackendError(
                    f"instance {name} was not ready within {timeout_s:g}s; "
                    f"{_pod_summary(pod) if pod is not None else 'no pod was created'}"
                )
            await asyncio.sleep(self.poll_interval_s)

    async def _job_failure(self, name: str) -> str | None:
        """Why the Job failed (its ``Failed`` condition), or None while it has not."""
        job = await self._call(
            f"read Job {name}",
            lambda: self._batch().read_namespaced_job(
                name, self.namespace, _request_timeout=self.request_timeout_s
            ),
        )
        for c in (job.status.conditions if job.status else None) or []:
            if c.type == "Failed" and c.status == "True":
                return f"{c.reason}: {c.message}" if c.message else str(c.reason)
        return None

    async def _delete(self, name: str, kind: str) -> None:
        k8s = _k8s()
        options = k8s.client.V1DeleteOptions(propagation_policy="Background")

        def delete() -> None:
            try:
                if kind == "Job":
                    self._batch().delete_namespaced_job(
                        name,
                        self.namespace,
                        body=options,
                        _request_timeout=self.request_timeout_s,
                    )
                else:
                    self._core().delete_namespaced_pod(
                        name,
                        self.namespace,
                        body=options,
                        _request_timeout=self.request_timeout_s,
                    )
            except k8s.client.exceptions.ApiException as exc:
                if exc.status != 404:  # already gone: stop is idempotent
                    raise

        await self._call(f"delete {kind} {name}", delete)

    def _instance(
        self, pod: Any, kind: str, *, start_latency_s: float | None = None
    ) -> EnvInstance:
        meta = pod.metadata
        annotations = meta.annotations or {}
        name = (meta.labels or {})[INSTANCE_LABEL]
        started = meta.creation_timestamp or datetime.now(UTC)
        return EnvInstance(
            instance_id=name,
            backend=self.name,
            env_id=annotations.get(ENV_ANNOTATION, ""),
            url=f"http://{pod.status.pod_ip}:{self.port}",
            labels=json.loads(annotations.get(LABELS_ANNOTATION, "{}")),
            started_at=started,
            start_latency_s=start_latency_s,
            meta={
                "kind": kind,
                "namespace": meta.namespace or self.namespace,
                "pod": meta.name,
                "pod_ip": pod.status.pod_ip,
                "node": pod.spec.node_name if pod.spec else None,
                "uid": meta.uid,
            },
        )


# --- manifest helpers -------------------------------------------------------------------


def _pod_meta(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Pod":
        pod_meta: dict[str, Any] = obj.setdefault("metadata", {})
        return pod_meta
    meta: dict[str, Any] = (
        obj.setdefault("spec", {}).setdefault("template", {}).setdefault("metadata", {})
    )
    return meta


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Pod":
        spec: dict[str, Any] = obj.setdefault("spec", {})
        return spec
    spec = obj.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
    return spec


def _env_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    for container in pod_spec.get("containers", []):
        if container.get("name") == "env":
            found: dict[str, Any] = container
            return found
    raise BackendError("the Kubernetes template has no container named 'env'")


def _launch_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """Launch labels as Kubernetes labels ``envport/<key>``; invalid ones are refused."""
    out = {}
    for key, value in labels.items():
        if not key or not _LABEL_NAME.match(key) or not _LABEL_NAME.match(value):
            raise BackendError(
                f"label {key!r}={value!r} is not a valid Kubernetes label: keys and values "
                "are at most 63 characters of [A-Za-z0-9._-], starting and ending "
                "alphanumeric"
            )
        out[f"{LABEL_PREFIX}{key}"] = value
    return out


def _resources(limits: Limits) -> dict[str, str]:
    if limits.pids is not None:
        raise BackendError(
            "Kubernetes has no per-pod pid limit (it is a kubelet setting); leave "
            "Limits.pids unset for the Kubernetes backend"
        )
    out = {}
    if limits.cpus is not None:
        out["cpu"] = f"{round(limits.cpus * 1000)}m"
    if limits.memory_mb is not None:
        out["memory"] = f"{limits.memory_mb}Mi"
    if limits.disk_mb is not None:
        out["ephemeral-storage"] = f"{limits.disk_mb}Mi"
    return out


# --- status helpers ---------------------------------------------------------------------


def _ready(pod: Any) -> bool:
    status = pod.status
    if status is None or status.phase != "Running" or not status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def _env_error(pod: Any) -> Exception | None:
    """The environment error the server reported in a container's termination message
    (``python -m envport.server`` could not load its environment), if any."""
    for cs in (pod.status.container_statuses if pod.status else None) or []:
        term = cs.state.terminated if cs.state else None
        if term is not None and term.message:
            found = env_error_in(term.message)
            if found is not None:
                return found
    return None


def _why_ended(pod: Any) -> str:
    status = pod.status
    text = f"ended {status.phase}"
    if status.reason:
        text += f" ({status.reason}{': ' + status.message if status.message else ''})"
    for cs in status.container_statuses or []:
        term = cs.state.terminated if cs.state else None
        if term is not None:
            text += f"; container {cs.name!r} exited {term.exit_code} ({term.reason})"
            if term.message:
                text += f"; its termination message:\n{term.message.strip()}"
    return text


def _pod_summary(pod: Any) -> str:
    status = pod.status
    text = f"pod {pod.metadata.name} is {status.phase if status else 'unknown'}"
    for c in (status.conditions if status else None) or []:
        if c.status != "True" and (c.reason or c.message):
            text += f"; {c.type}: {c.reason or ''} {c.message or ''}".rstrip()
    return text


def _api_error(what: str, exc: Any) -> BackendError:
    """A :class:`BackendError` from an ``ApiException`` and its ``Status`` body."""
    reason, message = exc.reason, ""
    with contextlib.suppress(ValueError, TypeError):
        status = json.loads(exc.body)
        reason = status.get("reason") or reason
        message = status.get("message") or ""
    return BackendError(
        f"Kubernetes could not {what}: {reason} ({exc.status})"
        + (f": {message}" if message else "")
    )


def _is_connection_error(exc: BaseException) -> bool:
    import urllib3

    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, OSError))


__all__ = ["DEFAULT_TEMPLATE", "KubernetesBackend"]
