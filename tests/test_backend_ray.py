"""The Ray backend against a real multi-node Ray cluster started by these tests.

The module fixture runs ``ray start --head`` plus a ``ray start --address`` worker node
(each ``--block``, in its own process group; the worker has a custom resource and a
label so placement is observable), all under one temp dir. Teardown kills exactly those
process groups. The last test kills the worker node on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest

from envport.errors import EnvportError
from envport.rollout.backends.base import BackendError, EnvLaunch, Limits
from envport.serving import free_port
from tests.support.backends import echo

ray = pytest.importorskip("ray")

from envport.rollout.backends.ray import RayBackend  # noqa: E402

# Starting two Ray nodes on a loaded two-core machine takes 15-60 s, in the first test's
# setup, and each actor start 2-6 s: the per-test limit is raised for this module only.
pytestmark = pytest.mark.timeout(180)

RAY_ENV = {
    **os.environ,
    "RAY_USAGE_STATS_ENABLED": "0",
    # This cluster's own token, in the environment: nothing read from or written to
    # ~/.ray/auth_token, which other Ray users on the machine may share.
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": uuid.uuid4().hex,
    # Notice a dead node in ~1.5 s instead of ~30 s.
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
    # The worker node starts beside the head and waits up to this long for its GCS.
    "RAY_gcs_server_port_wait_time_s": "120",
}


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    node_id: str = ""

    def kill(self) -> None:
        """SIGKILL the node's process group (``ray start``, raylet, agents); its worker
        processes, actors included, exit as soon as they see their raylet gone."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:  # the leader is gone; its children may not be
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@dataclass
class RayCluster:
    address: str
    temp_dir: Path
    nodes: dict[str, RayNode] = field(default_factory=dict)


def _ray_start(name: str, args: list[str], temp_dir: Path) -> RayNode:
    log = temp_dir / f"{name}.log"
    # Several nodes share this host: every port Ray would otherwise take by default
    # (the agents' 52365, the metrics port, ...) gets a free one.
    ports = [
        f"--{option}={free_port()}"
        for option in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
        )
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args, *ports],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=RAY_ENV,
            start_new_session=True,  # its own process group: teardown kills exactly it
        )
    return RayNode(name, proc, log)


def _wait_started(node: RayNode, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "block forever" not in node.log.read_text(errors="replace"):
        if node.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray node {node.name} did not start:\n{node.log.read_text()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    from ray._raylet import Config  # Ray caches its auth mode; re-read after the change

    with pytest.MonkeyPatch.context() as patch:
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED"):
            patch.setenv(key, RAY_ENV[key])  # the driver (this process) joins with the token
        Config.initialize("")
        try:
            yield from _cluster()
        finally:
            patch.undo()
            Config.initialize("")


def _cluster() -> Iterator[RayCluster]:
    temp_dir = Path(tempfile.mkdtemp(prefix="epr-"))  # short: Ray's socket paths are long
    port = free_port()
    common = ["--num-cpus", "1", "--object-store-memory", str(80 * 2**20), "--disable-usage-stats"]
    found = RayCluster(f"127.0.0.1:{port}", temp_dir)
    try:
        head = _ray_start(
            "head",
            [
                "--head",
                f"--port={port}",
                f"--temp-dir={temp_dir}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                *common,
            ],
            temp_dir,
        )
        found.nodes["head"] = head
        # The worker starts at once, not after the head: it retries the head's GCS until
        # it answers (RAY_gcs_server_port_wait_time_s), so the two start-ups overlap.
        worker = found.nodes["worker"] = _ray_start(
            "worker",
            [
                f"--address={found.address}",
                f"--resources={json.dumps({'worker': 1})}",
                "--labels=envport-role=worker",
                *common,
            ],
            temp_dir,
        )
        _wait_started(head)
        _wait_started(worker)
        ray.init(address=found.address, namespace="envport", log_to_driver=False)
        for info in ray.nodes():
            for node in found.nodes.values():
                marker = "node:__internal_head__" if node.name == "head" else node.name
                if marker in info["Resources"]:
                    node.node_id = info["NodeID"]
        yield found
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(list(found.nodes.values())):
            node.kill()
        subprocess.run(["rm", "-rf", str(temp_dir)], check=False)


@pytest.fixture
async def backend(cluster: RayCluster) -> AsyncIterator[RayBackend]:
    async with RayBackend(cluster.address) as b:
        yield b  # type: ignore[misc]


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


async def test_start_step_stop(backend: RayBackend, cluster: RayCluster) -> None:
    inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-basic"}))
    assert inst.backend == "ray"
    assert inst.url is not None
    assert inst.url.startswith("http://")
    assert inst.meta["node_id"] in {n.node_id for n in cluster.nodes.values()}
    assert inst.start_latency_s is not None
    assert await echo(inst, "hello") == "hello"
    assert await backend.healthy(inst)
    await backend.stop(inst)
    assert not await backend.healthy(inst)
    assert inst.instance_id not in {i.instance_id for i in await backend.list()}
    await backend.stop(inst)  # idempotent


async def test_spread_places_instances_on_several_nodes(backend: RayBackend) -> None:
    insts = [await backend.start(EnvLaunch(env_id="echo-v1")) for _ in range(2)]
    nodes = {i.meta["node_id"] for i in insts}
    assert len(nodes) > 1, f"all instances on one node: {nodes}"
    for inst in insts:
        assert await echo(inst, inst.instance_id) == inst.instance_id


async def test_resources_and_labels_pin_the_node(cluster: RayCluster) -> None:
    worker = cluster.nodes["worker"].node_id
    async with RayBackend(cluster.address, resources={"worker": 0.01}) as by_resource:
        inst = await by_resource.start(EnvLaunch(env_id="echo-v1"))
        assert inst.meta["node_id"] == worker
    async with RayBackend(cluster.address, node_labels={"envport-role": "worker"}) as by_label:
        inst = await by_label.start(EnvLaunch(env_id="echo-v1", options={"max_steps": 1}))
        assert inst.meta["node_id"] == worker
        async with inst.client() as env:
            await env.reset()
            result = await env.step({"message": "x"})
        assert result.truncated  # the launch options reached the environment


async def test_list_filters_by_labels_and_aclose_stops_own(cluster: RayCluster) -> None:
    async with RayBackend(cluster.address) as b:
        a = await b.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-list", "pool": "a"}))
        c = await b.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-list", "pool": "c"}))
        both = {i.instance_id for i in await b.list({"run": "r-list"})}
        assert both == {a.instance_id, c.instance_id}
        only_a = await b.list({"run": "r-list", "pool": "a"})
        assert [i.instance_id for i in only_a] == [a.instance_id]
        assert only_a[0].url == a.url
        assert only_a[0].labels == a.labels
        assert await b.list({"run": "no-such-run"}) == []
    async with RayBackend(cluster.address) as fresh:
        assert await fresh.list({"run": "r-list"}) == []


async def test_readopts_instances_after_controller_restart(
    cluster: RayCluster, tmp_path: Path
) -> None:
    """A separate driver process starts a detached instance and dies without cleanup."""
    script = textwrap.dedent(
        f"""
        import asyncio, json
        from envport.rollout.backends.base import EnvLaunch
        from envport.rollout.backends.ray import RayBackend

        async def main():
            backend = RayBackend({cluster.address!r})
            inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={{"run": "r-adopt"}}))
            print(json.dumps({{"id": inst.instance_id, "url": inst.url}}), flush=True)

        asyncio.run(main())  # exits without aclose(): the controller "crashed"
        """
    )
    driver = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=RAY_ENV, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(driver.communicate(), 90)
    assert driver.returncode == 0, err.decode()
    started = json.loads(out.decode().strip().splitlines()[-1])
    async with RayBackend(cluster.address) as restarted:
        (adopted,) = await restarted.list({"run": "r-adopt"})
        assert adopted.instance_id == started["id"]
        assert adopted.url == started["url"]
        assert await restarted.healthy(adopted)
        assert await echo(adopted, "still here") == "still here"
        await restarted.stop(adopted)
        assert await restarted.list({"run": "r-adopt"}) == []


async def test_bad_launches_raise_clear_errors(backend: RayBackend) -> None:
    # An environment no actor can build is the environment's own error, as in-process
    # (the controller does not retry it), not a backend failure.
    with pytest.raises(EnvportError, match=r"^Unknown environment 'no-such-env-v1'") as e:
        await backend.start(EnvLaunch(env_id="no-such-env-v1"))
    assert not isinstance(e.value, BackendError)
    assert "Registered: " in str(e.value)
    with pytest.raises(BackendError, match="cannot enforce pids"):
        await backend.start(EnvLaunch(env_id="echo-v1", limits=Limits(pids=10)))
    with pytest.raises(ValueError, match="placement"):
        RayBackend(placement="diagonal")  # type: ignore[arg-type]
    assert await backend.list() == []  # nothing left behind by the failures


async def test_unsatisfiable_resources_time_out_and_leave_nothing(cluster: RayCluster) -> None:
    async with RayBackend(cluster.address, resources={"gpu_that_is_not_there": 1}) as b:
        with pytest.raises(BackendError, match=r"did not start.*gpu_that_is_not_there"):
            await b.start(EnvLaunch(env_id="echo-v1", start_timeout_s=2))
        assert await b.list() == []


class _SlowToAnswer:
    """The backend's actor class, whose creation answers a second after the actor exists
    (as on a busy cluster): a start can be cancelled in between."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.created = threading.Event()

    def options(self, **options: Any) -> Any:
        made = self.real.options(**options)
        created = self.created

        class _Remote:
            def remote(self, record: Any) -> Any:
                handle = made.remote(record)
                created.set()
                time.sleep(1.0)
                return handle

        return _Remote()


async def test_a_start_cancelled_while_its_actor_is_created_leaves_no_actor(
    backend: RayBackend,
) -> None:
    from envport.rollout.backends.ray import _EnvServerActor

    def named() -> set[str]:
        return {
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == backend.namespace
        }

    before = await asyncio.to_thread(named)
    slow = _SlowToAnswer(ray.remote(_EnvServerActor))
    backend._actor_cls = slow
    start = asyncio.create_task(backend.start(EnvLaunch(env_id="echo-v1")))
    assert await asyncio.to_thread(slow.created.wait, 30)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert await asyncio.to_thread(named) == before


async def test_aclose_kills_an_actor_whose_stop_was_cancelled(cluster: RayCluster) -> None:
    """A stop cancelled during its shutdown call (the controller exits): the backend still
    owns the actor, and aclose kills it; a detached actor would otherwise live on."""

    def named() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}

    backend = RayBackend(cluster.address)
    inst = await backend.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-cancel"}))
    try:
        stop = asyncio.create_task(backend.stop(inst))
        await asyncio.sleep(0)  # the stop runs up to its shutdown call, and waits there
        assert not stop.done()
        stop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stop
        await backend.aclose()
        assert inst.instance_id not in await asyncio.to_thread(named)
    finally:
        if inst.instance_id in await asyncio.to_thread(named):  # the assertion failed
            async with RayBackend(cluster.address) as other:
                await other.stop(inst)


async def test_worker_node_death(backend: RayBackend, cluster: RayCluster) -> None:
    """Kill a worker node: its instance turns unhealthy, stop cleans up, new starts land on
    a live node. Runs last: it takes the victim node away for good."""
    victim = cluster.nodes["worker"]
    async with RayBackend(cluster.address, resources={"worker": 0.01}) as pinned:
        doomed = await pinned.start(EnvLaunch(env_id="echo-v1", labels={"run": "r-death"}))
        assert doomed.meta["node_id"] == victim.node_id
        assert await pinned.healthy(doomed)
        victim.kill()
        # The actor's worker process outlives its raylet by a moment (it exits when it
        # notices); healthy() must turn False within a few seconds, then stay False.
        deadline = time.monotonic() + 30
        while await pinned.healthy(doomed):
            assert time.monotonic() < deadline, "a dead node's instance stayed healthy"
            await asyncio.sleep(0.2)
        assert not await pinned.healthy(doomed)
        await pinned.stop(doomed)
        assert await pinned.list({"run": "r-death"}) == []
    while victim.node_id in _alive_nodes():
        assert time.monotonic() < deadline, "Ray never noticed the dead node"
        await asyncio.sleep(0.2)
    replacement = await backend.start(EnvLaunch(env_id="echo-v1"))
    assert replacement.meta["node_id"] != victim.node_id
    assert replacement.meta["node_id"] in _alive_nodes()
    assert await backend.healthy(replacement)
