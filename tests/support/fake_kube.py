"""An in-test Kubernetes API server that speaks the real REST shapes, with a toy kubelet.

This machine has no cluster, so the Kubernetes backend is tested against this: a real
HTTP server (Starlette on uvicorn, on a real socket) that the official ``kubernetes``
client talks to unchanged. It implements what the backend uses, as the API server does:

- ``POST/GET/DELETE /api/v1/namespaces/{ns}/pods[/{name}]`` and
  ``/apis/batch/v1/namespaces/{ns}/jobs[/{name}]``, lists with ``labelSelector``
  (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``);
- ``Status`` error objects with the real ``kind``/``apiVersion``/``reason``/``code``:
  404 ``NotFound`` (object or namespace), 409 ``AlreadyExists``, 422 ``Invalid`` (names
  and container names must be RFC 1123, labels must be valid, a Job's pods must have
  ``restartPolicy`` Never or OnFailure) with ``details.causes``;
- a Job controller: one pod per Job, named ``<job>-<5 chars>``, with the Job's pod
  template, ``job-name``/``controller-uid`` labels and an owner reference; the Job's
  ``status`` (active/failed/succeeded, ``Complete``/``Failed`` conditions);
  ``activeDeadlineSeconds`` (pods killed, ``DeadlineExceeded``), and
  ``ttlSecondsAfterFinished`` (the finished Job and its pods are deleted);
- deletion honours ``propagationPolicy``; as in the real API, deleting a Job without one
  *orphans* its pods.

The kubelet part is a toy, and the one place where this is not Kubernetes: a pod's
container runs as a **local subprocess** (``python`` in its command means this
interpreter), with the container's ``env`` (``value`` and ``fieldRef`` to
``status.podIP``/``metadata.name``/``metadata.namespace``) and ``$(VAR)`` expansion in
``command``/``args``. Each pod gets its own loopback address (``127.0.0.2``,
``127.0.0.3``, ...) as its ``podIP``, so pods can share a container port as they do in
a cluster. Phases go Pending → Running → Succeeded/Failed; the ``Ready`` condition
follows the container's ``readinessProbe`` (``httpGet``); a failed container's
``terminated.message`` is its log tail (``FallbackToLogsOnError``). Images, nodes,
scheduling, restarts and watches are not modelled.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import re
import signal
import string
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from envport.serving import serve_in_thread

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_error(
    code: int, reason: str, message: str, details: dict[str, Any] | None = None
) -> JSONResponse:
    """A ``Status`` object as the API server sends it for a failed request."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return JSONResponse(body, status_code=code)


class _ApiError(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


def _valid_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and not _DNS_SUBDOMAIN.match(prefix):
        return False
    return bool(name) and len(name) <= 63 and bool(_LABEL_VALUE.match(name))


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class _Container:
    """One pod's container: a local subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log
        self.started = time.monotonic()
        self.last_probe = 0.0

    def stop(self, grace_s: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def tail(self, limit: int = 2048) -> str:
        try:
            return self.log.read_bytes()[-limit:].decode(errors="replace")
        except OSError:
            return ""


class FakeKube:
    """The API server's state plus the toy kubelet and controllers; see module docstring."""

    def __init__(self, log_dir: Path, *, namespaces: tuple[str, ...] = ("default",)) -> None:
        self.log_dir = log_dir
        self.namespaces = set(namespaces)
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self._containers: dict[tuple[str, str], _Container] = {}
        self._job_times: dict[tuple[str, str], dict[str, float]] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._next_ip = 2
        self._rv = 1000
        # For tests: readiness probes fail (a server that never answers), so a start
        # meets its deadline however fast this machine starts the real process.
        self.probes_fail = False
        # For tests: seconds a create takes to answer (it is stored first, as on a slow
        # API server), so a client can be cancelled while its create is in flight.
        self.create_delay_s = 0.0

    # --- serving ------------------------------------------------------------------------

    @contextmanager
    def running(self) -> Iterator[str]:
        """Serve the API and run the kubelet; yields the API URL. Kills every container."""
        loop = threading.Thread(target=self._kubelet, name="fake-kubelet", daemon=True)
        loop.start()
        try:
            with serve_in_thread(self.app()) as url:
                yield url
        finally:
            self._stopping.set()
            loop.join(10)
            with self._lock:
                for container in self._containers.values():
                    container.stop(2)
                self._containers.clear()

    def app(self) -> Starlette:
        core = "/api/v1/namespaces/{ns}/pods"
        batch = "/apis/batch/v1/namespaces/{ns}/jobs"
        return Starlette(
            routes=[
                Route(core, self._collection("pods"), methods=["GET", "POST"]),
                Route(core + "/{name}", self._item("pods"), methods=["GET", "DELETE"]),
                Route(batch, self._collection("jobs"), methods=["GET", "POST"]),
                Route(batch + "/{name}", self._item("jobs"), methods=["GET", "DELETE"]),
            ]
        )

    def _store(self, resource: str) -> dict[tuple[str, str], dict[str, Any]]:
        return self.pods if resource == "pods" else self.jobs

    def _collection(self, resource: str) -> Any:
        async def endpoint(request: Request) -> JSONResponse:
            ns = request.path_params["ns"]
            body = await request.json() if request.method == "POST" else None
            self.requests.append(
                (request.method, request.url.path, dict(request.query_params), body)
            )
            try:
                self._check_namespace(ns)
                if request.method == "POST":
                    created = self._create(resource, ns, body)
                    if self.create_delay_s:
                        await asyncio.sleep(self.create_delay_s)
                    return JSONResponse(created, status_code=201)
                return JSONResponse(
                    self._list(resource, ns, request.query_params.get("labelSelector", ""))
                )
            except _ApiError as exc:
                return exc.response

        return endpoint

    def _item(self, resource: str) -> Any:
        async def endpoint(request: Request) -> JSONResponse:
            ns, name = request.path_params["ns"], request.path_params["name"]
            raw = await request.body()
            body = json.loads(raw) if raw else None
            self.requests.append(
                (request.method, request.url.path, dict(request.query_params), body)
            )
            try:
                self._check_namespace(ns)
                obj = self._get(resource, ns, name)
                if request.method == "GET":
                    return JSONResponse(obj)
                policy = request.query_params.get("propagationPolicy") or (body or {}).get(
                    "propagationPolicy"
                )
                return JSONResponse(self._delete(resource, ns, name, policy))
            except _ApiError as exc:
                return exc.response

        return endpoint

    # --- API semantics ------------------------------------------------------------------

    def _check_namespace(self, ns: str) -> None:
        if ns not in self.namespaces:
            raise _ApiError(
                status_error(
                    404,
                    "NotFound",
                    f'namespaces "{ns}" not found',
                    {"name": ns, "kind": "namespaces"},
                )
            )

    def _get(self, resource: str, ns: str, name: str) -> dict[str, Any]:
        with self._lock:
            obj = self._store(resource).get((ns, name))
            if obj is None:
                group = {"group": "batch"} if resource == "jobs" else {}
                kind = f"{resource}.batch" if resource == "jobs" else resource
                raise _ApiError(
                    status_error(
                        404,
                        "NotFound",
                        f'{kind} "{name}" not found',
                        {"name": name, **group, "kind": resource},
                    )
                )
            return copy.deepcopy(obj)

    def _list(self, resource: str, ns: str, selector: str) -> dict[str, Any]:
        with self._lock:
            items = [
                copy.deepcopy(o)
                for (o_ns, _), o in sorted(self._store(resource).items())
                if o_ns == ns and _matches(o["metadata"].get("labels") or {}, selector)
            ]
            self._rv += 1
            return {
                "kind": "PodList" if resource == "pods" else "JobList",
                "apiVersion": "v1" if resource == "pods" else "batch/v1",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def _invalid(self, kind: str, name: str, field: str, value: Any, why: str) -> _ApiError:
        group = "batch" if kind == "Job" else ""
        qualified = f"{kind}.batch" if group else kind
        message = (
            f'{qualified} "{name}" is invalid: {field}: Invalid value: {json.dumps(value)}: {why}'
        )
        details: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "causes": [
                {
                    "reason": "FieldValueInvalid",
                    "message": f"Invalid value: {json.dumps(value)}: {why}",
                    "field": field,
                }
            ],
        }
        if group:
            details["group"] = group
        return _ApiError(status_error(422, "Invalid", message, details))

    def _validate_pod_spec(self, kind: str, name: str, spec: Any, path: str) -> None:
        containers = spec.get("containers") if isinstance(spec, dict) else None
        if not containers:
            raise self._invalid(kind, name, f"{path}.containers", [], "Required value")
        for i, c in enumerate(containers):
            cname = c.get("name", "")
            if not _DNS_LABEL.match(cname):
                raise self._invalid(
                    kind,
                    name,
                    f"{path}.containers[{i}].name",
                    cname,
                    "a lowercase RFC 1123 label must consist of lower case alphanumeric "
                    "characters or '-', and must start and end with an alphanumeric character",
                )
            if not c.get("image"):
                raise self._invalid(
                    kind, name, f"{path}.containers[{i}].image", "", "Required value"
                )

    def _validate_meta(self, kind: str, meta: dict[str, Any], path: str) -> None:
        name = meta.get("name", "")
        if not _DNS_SUBDOMAIN.match(name):
            raise self._invalid(
                kind,
                name,
                f"{path}.name",
                name,
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                "characters, '-' or '.'",
            )
        for key, value in (meta.get("labels") or {}).items():
            if not _valid_label_key(key) or not _LABEL_VALUE.match(str(value)):
                raise self._invalid(
                    kind,
                    name,
                    f"{path}.labels",
                    value,
                    "a valid label must be an empty string or consist of alphanumeric "
                    "characters, '-', '_' or '.', and must start and end with an "
                    "alphanumeric character",
                )

    def _create(self, resource: str, ns: str, body: Any) -> dict[str, Any]:
        kind = "Pod" if resource == "pods" else "Job"
        if not isinstance(body, dict) or body.get("kind") != kind:
            raise _ApiError(
                status_error(400, "BadRequest", f"the body of the request was not a {kind}")
            )
        meta = body.setdefault("metadata", {})
        name = meta.get("name", "")
        self._validate_meta(kind, meta, "metadata")
        if kind == "Pod":
            self._validate_pod_spec(kind, name, body.get("spec"), "spec")
        else:
            template = (body.get("spec") or {}).get("template") or {}
            self._validate_pod_spec(kind, name, template.get("spec"), "spec.template.spec")
            policy = template["spec"].get("restartPolicy")
            if policy not in ("Never", "OnFailure"):
                raise self._invalid(
                    kind,
                    name,
                    "spec.template.spec.restartPolicy",
                    policy,
                    'supported values: "OnFailure", "Never"',
                )
        with self._lock:
            store = self._store(resource)
            if (ns, name) in store:
                group = "batch" if kind == "Job" else ""
                qualified = f"{resource}.batch" if group else resource
                raise _ApiError(
                    status_error(
                        409,
                        "AlreadyExists",
                        f'{qualified} "{name}" already exists',
                        {"name": name, "kind": resource, **({"group": group} if group else {})},
                    )
                )
            self._rv += 1
            meta.update(
                namespace=ns,
                uid=str(uuid.uuid4()),
                resourceVersion=str(self._rv),
                creationTimestamp=_now(),
            )
            if kind == "Pod":
                body["status"] = {"phase": "Pending", "conditions": []}
            else:
                body["status"] = {"active": 0, "startTime": _now()}
                self._job_times[(ns, name)] = {"start": time.monotonic()}
            store[(ns, name)] = body
            return copy.deepcopy(body)

    def _delete(self, resource: str, ns: str, name: str, policy: str | None) -> dict[str, Any]:
        with self._lock:
            obj = self._store(resource).pop((ns, name))
            if resource == "pods":
                self._kill(ns, name)
                obj["metadata"]["deletionTimestamp"] = _now()
                return obj
            self._job_times.pop((ns, name), None)
            uid = obj["metadata"]["uid"]
            for key, pod in list(self.pods.items()):
                owners = pod["metadata"].get("ownerReferences") or []
                if any(o["uid"] == uid for o in owners):
                    if policy in ("Background", "Foreground"):
                        self.pods.pop(key)
                        self._kill(*key)
                    else:  # the batch/v1 API's default for Jobs: orphan the pods
                        pod["metadata"]["ownerReferences"] = [o for o in owners if o["uid"] != uid]
            return {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {"name": name, "group": "batch", "kind": "jobs", "uid": uid},
            }

    # --- kubelet and controllers ----------------------------------------------------------

    def _kill(self, ns: str, name: str) -> None:
        container = self._containers.pop((ns, name), None)
        if container is not None:
            container.stop(2)

    def _kubelet(self) -> None:
        while not self._stopping.wait(0.05):
            with self._lock:
                self._run_jobs()
                for key, pod in list(self.pods.items()):
                    self._sync_pod(key, pod)

    def _run_jobs(self) -> None:
        for key, job in list(self.jobs.items()):
            ns, name = key
            times = self._job_times[key]
            spec, status = job["spec"], job["status"]
            pods = [
                (k, p)
                for k, p in self.pods.items()
                if k[0] == ns
                and any(
                    o["uid"] == job["metadata"]["uid"]
                    for o in p["metadata"].get("ownerReferences") or []
                )
            ]
            finished = "finished" in times
            if (
                not pods
                and not finished
                and not status.get("failed")
                and not status.get("succeeded")
            ):
                self._spawn_job_pod(job)
                continue
            deadline = spec.get("activeDeadlineSeconds")
            if (
                not finished
                and deadline is not None
                and time.monotonic() - times["start"] > deadline
            ):
                for k, _ in pods:
                    self.pods.pop(k)
                    self._kill(*k)
                status.update(active=0, failed=status.get("failed", 0) + len(pods))
                self._finish(
                    job,
                    "Failed",
                    "DeadlineExceeded",
                    "Job was active longer than specified deadline",
                )
                continue
            if not finished:
                phases = [p["status"]["phase"] for _, p in pods]
                status["active"] = sum(ph in ("Pending", "Running") for ph in phases)
                status["ready"] = sum(_is_ready(p) for _, p in pods)
                if "Failed" in phases:
                    status["failed"] = phases.count("Failed")
                    self._finish(
                        job,
                        "Failed",
                        "BackoffLimitExceeded",
                        "Job has reached the specified backoff limit",
                    )
                elif "Succeeded" in phases:
                    status["succeeded"] = phases.count("Succeeded")
                    self._finish(job, "Complete", None, None)
            ttl = spec.get("ttlSecondsAfterFinished")
            if (
                "finished" in times
                and ttl is not None
                and time.monotonic() - times["finished"] >= ttl
            ):
                self._delete("jobs", ns, name, "Background")

    def _finish(
        self, job: dict[str, Any], kind: str, reason: str | None, message: str | None
    ) -> None:
        key = (job["metadata"]["namespace"], job["metadata"]["name"])
        self._job_times[key]["finished"] = time.monotonic()
        condition: dict[str, Any] = {
            "type": kind,
            "status": "True",
            "lastProbeTime": _now(),
            "lastTransitionTime": _now(),
        }
        if reason:
            condition.update(reason=reason, message=message)
        job["status"]["conditions"] = [condition]
        if kind == "Complete":
            job["status"]["completionTime"] = _now()

    def _spawn_job_pod(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        template = copy.deepcopy(job["spec"]["template"])
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        name = f"{meta['name']}-{suffix}"
        pod_meta = template.setdefault("metadata", {})
        pod_meta["labels"] = {
            **(pod_meta.get("labels") or {}),
            "job-name": meta["name"],
            "batch.kubernetes.io/job-name": meta["name"],
            "controller-uid": meta["uid"],
            "batch.kubernetes.io/controller-uid": meta["uid"],
        }
        pod_meta.update(
            name=name,
            namespace=meta["namespace"],
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            ownerReferences=[
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": pod_meta,
            "spec": template["spec"],
            "status": {"phase": "Pending", "conditions": []},
        }
        self.pods[(meta["namespace"], name)] = pod
        job["status"]["active"] = 1

    def _sync_pod(self, key: tuple[str, str], pod: dict[str, Any]) -> None:
        status = pod["status"]
        if status["phase"] == "Pending" and key not in self._containers:
            self._start_container(key, pod)
            return
        container = self._containers.get(key)
        if container is None or status["phase"] != "Running":
            return
        spec = pod["spec"]
        deadline = spec.get("activeDeadlineSeconds")
        if deadline is not None and time.monotonic() - container.started > deadline:
            self._kill(*key)
            status.update(
                phase="Failed",
                reason="DeadlineExceeded",
                message="Pod was active on the node longer than the specified deadline",
            )
            self._set_ready(pod, False)
            return
        code = container.proc.poll()
        if code is not None:
            self._containers.pop(key)
            failed = code != 0
            c_spec = spec["containers"][0]
            message = (
                container.tail()
                if failed and c_spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
                else None
            )
            status["phase"] = "Failed" if failed else "Succeeded"
            status["containerStatuses"] = [
                _container_status(
                    c_spec,
                    ready=False,
                    state={
                        "terminated": {
                            "exitCode": code,
                            "reason": "Error" if failed else "Completed",
                            "message": message,
                            "startedAt": status.get("startTime"),
                            "finishedAt": _now(),
                        }
                    },
                )
            ]
            self._set_ready(pod, False)
            return
        probe = (spec["containers"][0].get("readinessProbe") or {}).get("httpGet")
        period = (spec["containers"][0].get("readinessProbe") or {}).get("periodSeconds", 10)
        if probe is None:
            self._set_ready(pod, True)
        elif not _is_ready(pod) or time.monotonic() - container.last_probe >= period:
            container.last_probe = time.monotonic()
            try:
                url = f"http://{status['podIP']}:{probe['port']}{probe.get('path', '/')}"
                ok = not self.probes_fail and httpx.get(url, timeout=0.5).status_code < 400
            except httpx.HTTPError:
                ok = False
            self._set_ready(pod, ok)

    def _start_container(self, key: tuple[str, str], pod: dict[str, Any]) -> None:
        ns, name = key
        ip = f"127.0.{self._next_ip // 254}.{self._next_ip % 254 + 1}"
        self._next_ip += 1
        spec = pod["spec"]
        c_spec = spec["containers"][0]
        fields = {"status.podIP": ip, "metadata.name": name, "metadata.namespace": ns}
        env: dict[str, str] = {}
        for var in c_spec.get("env") or []:
            if "value" in var:
                env[var["name"]] = _expand(str(var["value"]), env)
            else:
                ref = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
                env[var["name"]] = fields.get(ref, "")
        argv = [_expand(a, env) for a in (c_spec.get("command") or []) + (c_spec.get("args") or [])]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        log = self.log_dir / f"{ns}-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
            )
        self._containers[key] = _Container(proc, log)
        pod["spec"]["nodeName"] = "fake-node"
        pod["status"].update(
            phase="Running",
            podIP=ip,
            podIPs=[{"ip": ip}],
            hostIP="127.0.0.1",
            startTime=_now(),
            containerStatuses=[
                _container_status(c_spec, ready=False, state={"running": {"startedAt": _now()}})
            ],
        )
        self._set_ready(pod, False)

    def _set_ready(self, pod: dict[str, Any], ready: bool) -> None:
        value = "True" if ready else "False"
        conditions = [
            c
            for c in pod["status"].get("conditions") or []
            if c["type"] not in ("Ready", "ContainersReady")
        ]
        for ctype in ("Ready", "ContainersReady"):
            conditions.append(
                {
                    "type": ctype,
                    "status": value,
                    "lastTransitionTime": _now(),
                    "lastProbeTime": None,
                }
            )
        pod["status"]["conditions"] = conditions
        for cs in pod["status"].get("containerStatuses") or []:
            if "running" in cs["state"]:
                cs["ready"] = ready

    # --- for tests ----------------------------------------------------------------------

    def crash(self, ns: str, pod_name: str) -> None:
        """SIGKILL a pod's container, as an OOM kill or a node problem would."""
        with self._lock:
            container = self._containers.get((ns, pod_name))
        if container is not None:
            container.proc.kill()
            container.proc.wait(10)

    def processes(self) -> list[subprocess.Popen[bytes]]:
        with self._lock:
            return [c.proc for c in self._containers.values()]


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod["status"].get("conditions") or []
    )


def _expand(text: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _container_status(
    c_spec: dict[str, Any], *, ready: bool, state: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": c_spec["name"],
        "image": c_spec["image"],
        "imageID": f"fake://{c_spec['image']}",
        "containerID": f"fake://{uuid.uuid4().hex}",
        "ready": ready,
        "started": "running" in state,
        "restartCount": 0,
        "state": state,
    }
