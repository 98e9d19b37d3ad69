"""The Kubernetes backend through the official client, against the in-test API server.

``tests/support/fake_kube.py`` speaks the Kubernetes REST shapes (pods, jobs, label
selectors, ``Status`` errors, Job controller, deadlines, TTL) and runs each pod's
container as a local ``python -m envport.server`` subprocess on its own loopback IP, so
every instance here is a real envport server reached over a real socket. The last test
runs against a real cluster when a kubeconfig and an image are given.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from envport.errors import EnvportError
from envport.rollout.backends.base import (
    BackendError,
    BackendUnavailableError,
    EnvLaunch,
    Limits,
)
from envport.serving import free_port

pytest.importorskip("kubernetes")

from envport.rollout.backends.kubernetes import (
    DEFAULT_TEMPLATE,
    INSTANCE_LABEL,
    KubernetesBackend,
)
from tests.support.backends import echo
from tests.support.fake_kube import FakeKube

PORT = free_port()  # every pod serves on this port, each on its own IP


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeKube, str]]:
    fake = FakeKube(tmp_path_factory.mktemp("kube"), namespaces=("default", "rl"))
    with fake.running() as url:
        yield fake, url
        leaked = [p.args for p in fake.processes() if p.poll() is None]
        assert not leaked, f"pods still running after the tests: {leaked}"


@pytest.fixture
async def backend(kube: tuple[FakeKube, str]) -> AsyncIterator[KubernetesBackend]:
    async with KubernetesBackend(host=kube[1], namespace="rl", port=PORT) as b:
        yield b  # type: ignore[misc]


def _job_pods(fake: FakeKube, name: str) -> list[dict[str, object]]:
    return [p for p in fake.pods.values() if p["metadata"]["labels"].get(INSTANCE_LABEL) == name]


async def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


async def test_job_start_step_stop(kube: tuple[FakeKube, str]) -> None:
    fake, url = kube
    async with KubernetesBackend(
        host=url, namespace="rl", port=PORT, active_deadline_s=600, ttl_after_finished_s=30
    ) as backend:
        inst = await backend.start(
            EnvLaunch(
                env_id="echo-v1",
                sessions=3,
                labels={"run": "r-basic", "pool": "p1"},
                limits=Limits(cpus=0.5, memory_mb=256, disk_mb=512),
            )
        )
        assert inst.backend == "kubernetes"
        assert inst.url == f"http://{inst.meta['pod_ip']}:{PORT}"
        assert await echo(inst, "over the pod network") == "over the pod network"
        assert await backend.healthy(inst)

        job = fake.jobs[("rl", inst.instance_id)]
        labels = {"app": "envport", INSTANCE_LABEL: inst.instance_id}
        labels |= {"envport/run": "r-basic", "envport/pool": "p1"}
        assert job["metadata"]["labels"] == labels
        assert job["spec"]["template"]["metadata"]["labels"] == labels
        assert job["metadata"]["annotations"]["envport/env-id"] == "echo-v1"
        assert job["spec"]["activeDeadlineSeconds"] == 600
        assert job["spec"]["ttlSecondsAfterFinished"] == 30
        assert job["spec"]["backoffLimit"] == 0
        (container,) = job["spec"]["template"]["spec"]["containers"]
        wanted = {"cpu": "500m", "memory": "256Mi", "ephemeral-storage": "512Mi"}
        assert container["resources"] == {"requests": wanted, "limits": wanted}
        assert container["args"][-2:] == ["--max-sessions", "3"]
        (pod,) = _job_pods(fake, inst.instance_id)
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "Job"

        await backend.stop(inst)
        assert ("rl", inst.instance_id) not in fake.jobs
        assert _job_pods(fake, inst.instance_id) == []  # Background propagation took them
        method, path, _, body = fake.requests[-1]
        assert (method, body) == ("DELETE", {"propagationPolicy": "Background"})
        assert path.endswith(f"/jobs/{inst.instance_id}")
        assert not await backend.healthy(inst)
        await backend.stop(inst)  # idempotent: 404 is "already gone"


async def test_environment_options_reach_the_pods_server(backend: KubernetesBackend) -> None:
    launch = EnvLaunch(env_id="echo-v1", options={"max_steps": 1})
    assert backend.manifest(launch, "x")["spec"]["template"]["spec"]["containers"][0]["args"][
        -2:
    ] == ["--env-options", '{"max_steps": 1}']
    inst = await backend.start(launch)
    try:
        async with inst.client() as env:
            await env.reset()
            result = await env.step({"message": "one"})
            assert result.truncated  # max_steps=1 reached: the option was applied
    finally:
        await backend.stop(inst)


async def test_pod_workload(kube: tuple[FakeKube, str]) -> None:
    fake, url = kube
    async with KubernetesBackend(
        host=url, namespace="rl", port=PORT, workload="pod", active_deadline_s=900
    ) as backend:
        inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-pod"}))
        pod = fake.pods[("rl", inst.instance_id)]
        assert pod["kind"] == "Pod"
        assert pod["spec"]["activeDeadlineSeconds"] == 900
        assert "ownerReferences" not in pod["metadata"]
        assert inst.meta["kind"] == "Pod"
        assert await echo(inst, "bare pod") == "bare pod"
        (listed,) = await backend.list({"run": "r-pod"})
        assert listed.meta["kind"] == "Pod"
    assert ("rl", inst.instance_id) not in fake.pods  # aclose stopped it


async def test_readopt_after_controller_restart(kube: tuple[FakeKube, str]) -> None:
    fake, url = kube
    first = KubernetesBackend(host=url, namespace="rl", port=PORT)
    a, b = await asyncio.gather(
        first.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-adopt", "pool": "a"})),
        first.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-other"})),
    )
    # The controller "restarts": a new backend object with no memory of the first.
    async with KubernetesBackend(host=url, namespace="rl", port=PORT) as restarted:
        (adopted,) = await restarted.list({"run": "r-adopt"})
        assert adopted.instance_id == a.instance_id
        assert (adopted.url, adopted.env_id, adopted.labels) == (a.url, "echo-v1", a.labels)
        assert adopted.started_at is not None
        assert {i.instance_id for i in await restarted.list()} >= {a.instance_id, b.instance_id}
        assert await restarted.list({"run": "r-adopt", "pool": "b"}) == []
        assert await echo(adopted, "adopted") == "adopted"
        await restarted.stop(adopted)
        assert await restarted.list({"run": "r-adopt"}) == []
    await first.aclose()  # a is already gone (404 is fine); b is deleted
    assert ("rl", b.instance_id) not in fake.jobs
    assert _job_pods(fake, b.instance_id) == []


async def test_aclose_deletes_an_instance_whose_stop_was_cancelled(
    kube: tuple[FakeKube, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop cancelled before its delete was sent (the controller exits while the call
    waits for a worker thread): the backend still owns the Job, and aclose deletes it."""
    fake, url = kube
    backend = KubernetesBackend(host=url, namespace="rl", port=PORT)
    inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-cancel"}))
    delete = backend._delete
    waiting = asyncio.Event()

    async def slow_delete(name: str, kind: str) -> None:
        waiting.set()
        await asyncio.sleep(30)
        await delete(name, kind)

    monkeypatch.setattr(backend, "_delete", slow_delete)
    try:
        stop = asyncio.create_task(backend.stop(inst))
        await waiting.wait()
        stop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stop
        monkeypatch.setattr(backend, "_delete", delete)
        await backend.aclose()
        assert ("rl", inst.instance_id) not in fake.jobs
    finally:
        if ("rl", inst.instance_id) in fake.jobs:  # the assertion failed: clean up
            async with KubernetesBackend(host=url, namespace="rl", port=PORT) as other:
                await other.stop(inst)


async def test_failed_start_reports_the_pods_log_and_leaves_nothing(
    backend: KubernetesBackend, kube: tuple[FakeKube, str]
) -> None:
    fake, _ = kube
    before = set(fake.jobs)
    # An environment the pod cannot load is the environment's own error (as in-process,
    # not retried), read back from the pod's termination message.
    with pytest.raises(EnvportError, match=r"^Unknown environment 'no-such-env-v1'") as info:
        await backend.start(EnvLaunch(env_id="no-such-env-v1"))
    assert not isinstance(info.value, BackendError)
    assert "Registered: " in str(info.value)
    # So is a constructor that raises.
    with pytest.raises(EnvportError, match=r"high must be a positive integer") as info:
        await backend.start(EnvLaunch(env_id="guess-number-v1", options={"high": 0}))
    assert not isinstance(info.value, BackendError)
    assert set(fake.jobs) == before


async def test_a_server_that_crashes_at_start_is_reported_with_its_log(
    kube: tuple[FakeKube, str],
) -> None:
    fake, url = kube
    before = set(fake.jobs)
    crashing = DEFAULT_TEMPLATE.read_text().replace(
        '["python", "-m", "envport.server", "${env_id}"]',
        '["python", "-c", "import sys; sys.exit(\'out of disk, for instance\')", "${env_id}"]',
    )
    async with KubernetesBackend(host=url, namespace="rl", port=PORT, template=crashing) as b:
        with pytest.raises(BackendError, match=r"exited 1 \(Error\)[\s\S]*out of disk"):
            await b.start(EnvLaunch(env_id="echo-v1"))
        assert await b.list() == []
    assert set(fake.jobs) == before  # nothing left behind


async def test_a_start_cancelled_while_its_create_is_in_flight_leaves_no_job(
    backend: KubernetesBackend, kube: tuple[FakeKube, str]
) -> None:
    """Cancelled while the API is still answering the create (the Job already exists on
    the server): the start waits for that answer, then deletes the Job."""
    fake, _ = kube
    before = set(fake.jobs)
    fake.create_delay_s = 1.0
    try:
        start = asyncio.create_task(backend.start(EnvLaunch(env_id="echo-v1")))
        await _until(lambda: set(fake.jobs) != before)  # created; its answer still to come
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
    finally:
        fake.create_delay_s = 0.0
    await _until(lambda: set(fake.jobs) == before)


async def test_deadline_while_starting_is_reported(kube: tuple[FakeKube, str]) -> None:
    fake, url = kube
    async with KubernetesBackend(host=url, namespace="rl", port=PORT, active_deadline_s=1) as b:
        before = set(fake.jobs)
        fake.probes_fail = True  # never ready: the Job's deadline ends the start
        try:
            with pytest.raises(BackendError, match="failed: DeadlineExceeded"):
                await b.start(EnvLaunch(env_id="echo-v1", start_timeout_s=30))
        finally:
            fake.probes_fail = False
        assert set(fake.jobs) == before


async def test_crashed_pod_is_unhealthy_and_ttl_reaps_its_job(kube: tuple[FakeKube, str]) -> None:
    fake, url = kube
    async with KubernetesBackend(
        host=url, namespace="rl", port=PORT, ttl_after_finished_s=1
    ) as backend:
        inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-crash"}))
        assert await backend.healthy(inst)
        fake.crash("rl", inst.meta["pod"])
        deadline = time.monotonic() + 20
        while await backend.healthy(inst):
            assert time.monotonic() < deadline, "a crashed pod stayed healthy"
            await asyncio.sleep(0.1)
        # The cluster marks the pod failed on its own schedule (its kubelet saw the
        # exit); from then on it is no longer listed as a live instance.
        while await backend.list({"run": "r-crash"}):
            assert time.monotonic() < deadline, "a crashed pod is still listed"
            await asyncio.sleep(0.1)
        # The Job failed; the cluster (here the fake's TTL controller) deletes it.
        await _until(lambda: ("rl", inst.instance_id) not in fake.jobs)
        await backend.stop(inst)  # nothing left to delete: still fine


async def test_api_errors_become_backend_errors(
    backend: KubernetesBackend, kube: tuple[FakeKube, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url = kube
    # 409: a name that is already taken.
    monkeypatch.setattr(backend, "_new_name", lambda: "envport-taken")
    taken = await backend.start(EnvLaunch(env_id="echo-v1"))
    with pytest.raises(BackendError, match=r"AlreadyExists \(409\).*already exists"):
        await backend.start(EnvLaunch(env_id="echo-v1"))
    await backend.stop(taken)
    monkeypatch.undo()
    # 422: the API server rejects the manifest, and says which field.
    bad = DEFAULT_TEMPLATE.read_text().replace("restartPolicy: Never", "restartPolicy: Always")
    async with KubernetesBackend(host=url, namespace="rl", port=PORT, template=bad) as b:
        with pytest.raises(BackendError, match=r"Invalid \(422\).*restartPolicy"):
            await b.start(EnvLaunch(env_id="echo-v1"))
    # 404: no such namespace.
    async with KubernetesBackend(host=url, namespace="missing", port=PORT) as b:
        with pytest.raises(BackendError, match=r'NotFound \(404\).*namespaces "missing"'):
            await b.start(EnvLaunch(env_id="echo-v1"))
        assert not await b.healthy(taken)
    # No API server at all.
    async with KubernetesBackend(host=f"http://127.0.0.1:{free_port()}", port=PORT) as b:
        b._client().configuration.retries = 0
        with pytest.raises(BackendUnavailableError, match="cannot reach the Kubernetes API"):
            await b.list()
    assert not [j for j in fake.jobs if j[1] == "envport-taken"]


async def test_bad_launches_are_refused_before_any_request(
    backend: KubernetesBackend, kube: tuple[FakeKube, str]
) -> None:
    fake, url = kube
    sent = len(fake.requests)
    with pytest.raises(BackendError, match="not a valid Kubernetes label"):
        await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "has space"}))
    with pytest.raises(BackendError, match="no per-pod pid limit"):
        await backend.start(EnvLaunch(env_id="echo-v1", limits=Limits(pids=64)))
    async with KubernetesBackend(host=url, template="kind: Service\n") as b:
        with pytest.raises(BackendError, match="one Job or one Pod"):
            await b.start(EnvLaunch(env_id="echo-v1"))
    async with KubernetesBackend(host=url, template="name: ${nope}\n") as b:
        with pytest.raises(BackendError, match="template is not usable"):
            await b.start(EnvLaunch(env_id="echo-v1"))
    with pytest.raises(ValueError, match="workload"):
        KubernetesBackend(workload="deployment")  # type: ignore[arg-type]
    assert len(fake.requests) == sent


def _kubeconfig() -> Path | None:
    path = Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
    return path if path.is_file() else None


@pytest.mark.kubernetes
@pytest.mark.skipif(
    _kubeconfig() is None or "ENVPORT_K8S_IMAGE" not in os.environ,
    reason="needs a real cluster: a kubeconfig (KUBECONFIG or ~/.kube/config), "
    "ENVPORT_K8S_IMAGE (an image with envport installed) and a pod network this "
    "process can reach; ENVPORT_K8S_NAMESPACE picks the namespace (default 'default')",
)
@pytest.mark.timeout(300)
async def test_real_cluster_round_trip() -> None:
    async with KubernetesBackend(
        kubeconfig=_kubeconfig(),
        namespace=os.environ.get("ENVPORT_K8S_NAMESPACE", "default"),
        image=os.environ["ENVPORT_K8S_IMAGE"],
        active_deadline_s=600,
        ttl_after_finished_s=60,
    ) as backend:
        inst = await backend.start(
            EnvLaunch(env_id="echo-v1", labels={"run": "envport-e2e"}, start_timeout_s=240)
        )
        assert await backend.healthy(inst)
        assert await echo(inst, "real cluster") == "real cluster"
        async with KubernetesBackend(
            kubeconfig=_kubeconfig(), namespace=backend.namespace
        ) as restarted:
            (listed,) = await restarted.list({"run": "envport-e2e"})
            assert listed.instance_id == inst.instance_id
            await restarted.stop(listed)
        assert await backend.list({"run": "envport-e2e"}) == []
