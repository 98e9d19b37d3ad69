"""Rollout building blocks: state machines, their store tables, pools, backends."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from envport.errors import EnvportError, UnknownEnvError
from envport.rollout import (
    AttemptState,
    Backend,
    BackendError,
    EnvInstance,
    EnvLaunch,
    EnvPool,
    IllegalTransitionError,
    InProcessBackend,
    LocalProcessBackend,
    PoolClosedError,
    RolloutState,
)
from envport.rollout.backends import Limits
from envport.rollout.backends.local import last_words
from envport.trace import SQLiteTraceStore, Trace, TraceStatus
from envport.trace.store import _MIGRATIONS, RolloutRecord, StaleStateError
from tests.support.backends import echo
from tests.support.cli import pythonpath
from tests.support.processes import alive

ROOT = Path(__file__).resolve().parent.parent

# --- state machines -------------------------------------------------------------------------


def test_rollout_state_machine_allows_the_documented_path_only() -> None:
    path = [
        RolloutState.PENDING,
        RolloutState.STARTING_ENV,
        RolloutState.RUNNING,
        RolloutState.RETRYING,
        RolloutState.STARTING_ENV,
        RolloutState.RUNNING,
        RolloutState.SCORING,
        RolloutState.SUCCEEDED,
    ]
    for old, new in itertools.pairwise(path):
        assert old.check(new) is new
    with pytest.raises(IllegalTransitionError, match="allowed: starting_env"):
        RolloutState.PENDING.check(RolloutState.SUCCEEDED)
    with pytest.raises(IllegalTransitionError, match="none: final"):
        RolloutState.FAILED.check(RolloutState.PENDING)
    assert AttemptState.RUNNING.check(AttemptState.ABANDONED) is AttemptState.ABANDONED
    with pytest.raises(IllegalTransitionError):
        AttemptState.SUCCEEDED.check(AttemptState.FAILED)


# --- store tables ---------------------------------------------------------------------------


def test_store_migrates_a_version_1_file(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY,"
        " description TEXT NOT NULL, applied_at TEXT NOT NULL)"
    )
    for statement in _MIGRATIONS[0][2]:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_migrations VALUES (1, 'runs and traces', 'then')")
    conn.commit()
    conn.close()
    with SQLiteTraceStore(path) as store:
        assert store.schema_version == 2
        store.ensure_rollout(RolloutRecord(rollout_id="r/a/0", run_id="r"))
        assert [r.rollout_id for r in store.rollouts(run_id="r")] == ["r/a/0"]


def test_rollout_rows_compare_and_set_and_one_final_trace(tmp_path: Path) -> None:
    with SQLiteTraceStore(tmp_path / "t.db") as store:
        rec = store.ensure_rollout(RolloutRecord(rollout_id="r/a/0", run_id="r", max_attempts=2))
        again = store.ensure_rollout(RolloutRecord(rollout_id="r/a/0", run_id="r", state="failed"))
        assert again.state == rec.state == "pending"  # an existing row is never overwritten
        store.advance_rollout("r/a/0", expect="pending", state="starting_env", attempts=1)
        with pytest.raises(StaleStateError, match="expected 'pending', but it is 'starting_env'"):
            store.advance_rollout("r/a/0", expect="pending", state="starting_env")
        with pytest.raises(ValueError, match="run_id"):
            store.advance_rollout("r/a/0", expect="starting_env", run_id="other")
        stale = Trace(run_id="r", rollout_id="r/a/0", status=TraceStatus.RUNNING)
        store.put(stale)
        final = Trace(run_id="r", rollout_id="r/a/0", status=TraceStatus.COMPLETED)
        store.finish_rollout("r/a/0", expect="starting_env", trace=final, state="succeeded")
        assert [t.trace_id for t in store.query(run_id="r")] == [final.trace_id]  # stale gone
        assert store.get_rollout("r/a/0").trace_id == final.trace_id
        # A second controller finishing the same rollout is refused; nothing changes.
        store.ensure_rollout(RolloutRecord(rollout_id="r/b/0", run_id="r"))
        twin = Trace(run_id="r", rollout_id="r/a/0", status=TraceStatus.COMPLETED)
        with pytest.raises(StaleStateError):
            store.finish_rollout("r/a/0", expect="scoring", trace=twin, state="succeeded")
        assert store.count(rollout_id="r/a/0") == 1


# --- pools ------------------------------------------------------------------------------------


class CountingBackend(Backend):
    """In-process instances, with start/stop counts, a start delay and a health switch."""

    name: ClassVar[str] = "counting"

    def __init__(self, start_delay_s: float = 0.0) -> None:
        self.inner = InProcessBackend()
        self.start_delay_s = start_delay_s
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.sick: set[str] = set()

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        await asyncio.sleep(self.start_delay_s)
        instance = await self.inner.start(launch)
        self.started.append(instance.instance_id)
        return instance

    async def healthy(self, instance: EnvInstance) -> bool:
        return instance.instance_id not in self.sick

    async def stop(self, instance: EnvInstance) -> None:
        self.stopped.append(instance.instance_id)

    async def list(self, labels: Mapping[str, str] | None = None) -> list[EnvInstance]:
        return await self.inner.list(labels)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_pool_warms_reuses_and_recycles_after_n_episodes() -> None:
    backend = CountingBackend()
    launch = EnvLaunch(env_id="echo-v1")
    async with EnvPool(backend, launch, size=2, max_episodes=2, health_interval_s=0.05) as pool:
        await wait_for(lambda: pool.stats().instances == 2)
        async with pool.lease() as lease:
            assert lease.env_start_s == 0.0  # a warm hit
            async with lease.instance.client() as env:
                await env.reset()
        for _ in range(3):
            async with pool.lease():
                pass
        # 4 episodes over 2 warm instances with max_episodes=2: both retired, refilled.
        await wait_for(lambda: len(backend.stopped) >= 2)
        await wait_for(lambda: pool.stats().instances == 2)
        assert pool.stats().retired >= 2
    assert sorted(backend.stopped) == sorted(backend.started)  # nothing left running


async def test_pool_backpressure_waits_bounded_then_hands_over() -> None:
    backend = CountingBackend()
    pool = EnvPool(backend, EnvLaunch(env_id="echo-v1"), max_instances=1)
    async with pool.lease() as first:
        with pytest.raises(TimeoutError):
            async with pool.lease(timeout_s=0.1):
                pass
        waiter = asyncio.create_task(_lease_once(pool))
        await wait_for(lambda: pool.stats().waiting == 1)
    got = await waiter
    assert got == first.instance.instance_id  # the freed slot went to the waiter
    assert backend.started == [got]
    await pool.aclose()
    with pytest.raises(PoolClosedError):
        async with pool.lease():
            pass


async def _lease_once(pool: EnvPool) -> str:
    async with pool.lease(timeout_s=5) as lease:
        return lease.instance.instance_id


async def test_pool_retires_bad_and_unhealthy_instances() -> None:
    backend = CountingBackend()
    async with EnvPool(backend, EnvLaunch(env_id="echo-v1"), health_interval_s=0.05) as pool:
        async with pool.lease() as lease:
            lease.retire("hung under an attempt")
        bad = lease.instance.instance_id
        await wait_for(lambda: bad in backend.stopped)
        async with pool.lease() as lease:
            pass
        assert lease.instance.instance_id != bad
        backend.sick.add(lease.instance.instance_id)
        await wait_for(lambda: lease.instance.instance_id in backend.stopped)
        assert pool.stats().instances == 0


async def test_pool_lease_cancelled_while_starting_leaks_nothing() -> None:
    backend = CountingBackend(start_delay_s=0.2)
    pool = EnvPool(backend, EnvLaunch(env_id="echo-v1"))
    with pytest.raises(TimeoutError):
        async with pool.lease(timeout_s=0.05):
            pass
    assert pool.stats().starting == 0
    assert backend.started == []
    await pool.aclose()


class SlowStopBackend(CountingBackend):
    """``stop`` is a call that takes a while (a pod delete, an actor kill, a reap); an
    instance counts as stopped only once that call has finished."""

    def __init__(self, stop_s: float = 0.3) -> None:
        super().__init__()
        self.stop_s = stop_s
        self.stopping: set[str] = set()

    async def stop(self, instance: EnvInstance) -> None:
        self.stopping.add(instance.instance_id)
        try:
            await asyncio.sleep(self.stop_s)
        finally:
            self.stopping.discard(instance.instance_id)
        self.stopped.append(instance.instance_id)


async def test_pool_exit_stops_instances_whose_stop_was_cancelled_midway() -> None:
    """The owner exits (Ctrl-C) while the maintainer stops retired instances: those
    stops are cancelled, and aclose stops the instances again, none forgotten."""
    backend = SlowStopBackend()
    async with EnvPool(backend, EnvLaunch(env_id="echo-v1"), health_interval_s=60) as pool:
        for _ in range(3):
            async with pool.lease() as lease:
                lease.retire("done with it")
        await wait_for(lambda: len(backend.stopping) == 3)
    assert len(backend.started) == 3
    assert sorted(backend.stopped) == sorted(backend.started)


class RefusingBackend(CountingBackend):
    """Every start fails at once, as for an environment no server can build."""

    def __init__(self) -> None:
        super().__init__()
        self.tries = 0

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        self.tries += 1
        raise EnvportError(f"Unknown environment {launch.env_id!r}.")


async def test_pool_tries_a_failed_warm_start_again_later_not_at_once() -> None:
    backend = RefusingBackend()
    async with EnvPool(backend, EnvLaunch(env_id="nope-v1"), size=2, health_interval_s=0.1):
        await asyncio.sleep(0.5)
    assert 2 <= backend.tries <= 2 * 8  # a round of 2 every 0.1 s, not a spin


# --- the local-process backend ------------------------------------------------------------------


async def test_local_backend_starts_lists_readopts_and_stops(tmp_path: Path) -> None:
    state = tmp_path / "instances"
    launch = EnvLaunch(env_id="echo-v1", sessions=2, labels={"envport-run": "r1"})
    async with LocalProcessBackend(state, cwd=ROOT) as first:
        instance = await first.start(launch)
        assert instance.url is not None
        assert instance.start_latency_s is not None
        assert await first.healthy(instance)
        assert await echo(instance, "hi") == "hi"
        log = await asyncio.to_thread(Path(instance.meta["log"]).read_text)
        assert [i.instance_id for i in await first.list({"envport-run": "r1"})] == [
            instance.instance_id
        ]
        assert await first.list({"envport-run": "other"}) == []
        # A second backend object (a restarted controller) finds it and can stop it.
        second = LocalProcessBackend(state)
        (adopted,) = await second.list({"envport-run": "r1"})
        assert adopted.url == instance.url
        await second.stop(adopted)
        await second.aclose()
        assert not await first.healthy(instance)
        assert await first.list() == []
    assert list(state.iterdir()) == []
    # The server's module ran once, by -m: no runpy warning about a copy already imported.
    assert "RuntimeWarning" not in log


# Starts up to 100 sleeping children; says how many it got before fork failed.
SPAWN_MANY = (
    'python3 -c "import subprocess\n'
    "procs = []\n"
    "try:\n"
    "    for _ in range(100):\n"
    "        procs.append(subprocess.Popen(['sleep', '30']))\n"
    "except OSError as exc:\n"
    "    print('stopped at', len(procs), exc.errno)\n"
    "else:\n"
    "    print('all', len(procs))\n"
    "for p in procs:\n"
    '    p.kill()"'
)


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root")
async def test_local_backend_enforces_memory_and_pids_with_a_cgroup(tmp_path: Path) -> None:
    """The local backend ignored a launch's limits: a shell-v1 command (a fork bomb, a
    memory hog) had the whole host. The server and all it runs now share a cgroup."""
    limits = Limits(pids=48, memory_mb=512, disk_mb=100)
    launch = EnvLaunch(env_id="shell-v1", limits=limits)
    async with LocalProcessBackend(tmp_path / "instances", cwd=ROOT) as backend:
        instance = await backend.start(launch)
        meta = instance.meta
        assert meta["limits"].startswith("enforced; disk_mb not enforced"), meta
        cgroups = {k: Path(v) for k, v in meta["cgroups"].items()}
        assert (cgroups["pids"] / "pids.max").read_text().strip() == "48"
        memory = (cgroups["memory"] / "memory.limit_in_bytes").read_text().strip()
        assert memory == str(512 * 2**20)
        async with instance.client() as env:
            await env.reset()
            out = await env.call_tool("run", {"command": SPAWN_MANY, "timeout_s": 60})
        assert out["stdout"].startswith("stopped at"), out
        assert out["stdout"].split()[-1] == "11"  # EAGAIN: the pids limit
        await backend.stop(instance)
        assert not any(path.exists() for path in cgroups.values())


async def test_local_backend_starts_without_limits_it_cannot_enforce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from envport.rollout.backends import local

    def no_cgroups(*args: object, **kwargs: object) -> object:
        raise OSError("cgroup controller(s) memory are not available")

    monkeypatch.setattr(local.CgroupSet, "create", no_cgroups)
    launch = EnvLaunch(env_id="echo-v1", limits=Limits(memory_mb=256))
    async with LocalProcessBackend(tmp_path / "instances", cwd=ROOT) as backend:
        instance = await backend.start(launch)
        assert instance.meta["limits"].startswith("not enforced: no cgroup could be made")
        assert await echo(instance, "hi") == "hi"


async def test_local_backend_instance_refuses_a_foreign_host_at_mcp(tmp_path: Path) -> None:
    """An instance server bound on loopback checks /mcp's Host header, as `envport serve`
    does: a web page that rebinds its own name to 127.0.0.1 cannot call its tools."""
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "pwn"}},
    }
    async with LocalProcessBackend(tmp_path / "instances", cwd=ROOT) as backend:
        instance = await backend.start(EnvLaunch(env_id="echo-v1"))
        assert instance.url is not None
        assert instance.url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=instance.url) as http:
            rebound = await http.post("/mcp", json=call, headers={"Host": "evil.example"})
            assert rebound.status_code == 421
            own = await http.post("/mcp", json=call)
            assert own.json()["result"]["data"] == "pwn"


async def test_local_backend_forgets_every_file_of_an_instance_found_dead(
    tmp_path: Path,
) -> None:
    state = tmp_path / "instances"
    state.mkdir()
    done = await asyncio.create_subprocess_exec("true")  # its pid is free once reaped
    await done.wait()
    dead = EnvInstance(
        instance_id="local-dead", backend="local", env_id="echo-v1", meta={"pid": done.pid}
    )
    (state / "local-dead.json").write_text(dead.model_dump_json())
    (state / "local-dead.log").write_text("server log")
    (state / "local-dead.port").write_text("12345")
    async with LocalProcessBackend(state, cwd=ROOT) as backend:
        assert await backend.list() == []
    assert list(state.iterdir()) == []


async def test_local_backend_start_failure_names_the_cause_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    state = tmp_path / "instances"
    async with LocalProcessBackend(state, cwd=ROOT, host="203.0.113.1") as backend:
        # Not an address of this machine: the server dies binding it, with a traceback.
        with pytest.raises(BackendError) as crashed:
            await backend.start(EnvLaunch(env_id="echo-v1"))
        first, *rest = str(crashed.value).splitlines()
        assert first.startswith("environment server for 'echo-v1' exited with code 1")
        assert first.endswith(last_words("\n".join(rest)))  # the exception it died of
        assert "OSError" in first
        assert "Traceback (most recent call last)" in rest[1]  # then the log's tail
        assert "RuntimeWarning" not in str(crashed.value)  # one module run once, by -m
        assert await backend.list() == []
    assert list(state.iterdir()) == []


async def test_local_backend_an_environment_not_built_is_its_error_not_a_crash(
    tmp_path: Path,
) -> None:
    """An unknown id fails before a process starts; a class the server cannot import
    comes back from it: both the environment's one-line error, as in-process."""
    state = tmp_path / "instances"
    async with LocalProcessBackend(state, cwd=ROOT) as backend:
        with pytest.raises(UnknownEnvError, match=r"^Unknown environment 'nope-v1'") as unknown:
            await backend.start(EnvLaunch(env_id="nope-v1"))
        assert "\n" not in str(unknown.value)
        assert list(state.iterdir()) == []  # no process spent on it
        with pytest.raises(EnvportError) as not_built:
            await backend.start(EnvLaunch(env_id="tests.support.no_such_module:Env"))
        assert not isinstance(not_built.value, BackendError)
        assert str(not_built.value).startswith(
            "Cannot load environment 'tests.support.no_such_module:Env': could not import"
        )
        assert "\n" not in str(not_built.value)
        assert await backend.list() == []
    assert list(state.iterdir()) == []


def _stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: a SIGTERM sent before that would be
    taken first (a lower number) and the server would exit while it is being stopped."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(500):
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def _term_pending(pid: int) -> bool:
    """Whether a SIGTERM sent to ``pid``'s group waits for it (it is stopped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone already
        return False
    for line in status.splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def _kill_leftover(pid: int) -> None:
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


async def test_local_backend_aclose_reaps_a_server_whose_stop_was_cancelled(
    tmp_path: Path,
) -> None:
    """A stop cancelled between SIGTERM and the server's exit (the controller exits):
    the backend still knows the server, and aclose reaps it."""
    backend = LocalProcessBackend(tmp_path / "instances", cwd=ROOT, stop_grace_s=2.0)
    instance = await backend.start(EnvLaunch(env_id="echo-v1"))
    pid = int(instance.meta["pid"])
    try:
        _stop_process(pid)  # a server slow to exit: it sees SIGTERM only later
        stop = asyncio.create_task(backend.stop(instance))
        await wait_for(lambda: _term_pending(pid))
        stop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stop
        await backend.aclose()
        assert not alive(pid)
    finally:
        _kill_leftover(pid)


async def test_local_backend_stop_cancelled_while_it_waits_kills_the_group(
    tmp_path: Path,
) -> None:
    """A stop cancelled between SIGTERM and the server's exit (a second Ctrl-C, a loop
    torn down) SIGKILLs the server's group before it gives up: nothing is left for an
    aclose that may never run."""
    backend = LocalProcessBackend(tmp_path / "instances", cwd=ROOT, stop_grace_s=30.0)
    instance = await backend.start(EnvLaunch(env_id="echo-v1"))
    pid = int(instance.meta["pid"])
    try:
        _stop_process(pid)
        stop = asyncio.create_task(backend.stop(instance))
        await wait_for(lambda: _term_pending(pid))
        stop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stop
        await wait_for(lambda: not alive(pid))
        assert backend.outstanding() == 1  # not reaped yet: aclose (or atexit) does it
        await backend.aclose()
        assert backend.outstanding() == 0
    finally:
        _kill_leftover(pid)


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[2])
    except (OSError, IndexError, ValueError):
        return None


async def test_local_backend_stop_and_kill_now_take_the_whole_process_group(
    tmp_path: Path,
) -> None:
    """A server's own children go with it, one that ignores SIGTERM too: after the server
    exited gracefully (stop), or at once (kill_now: synchronous, forgets the records)."""
    state, marks = tmp_path / "instances", tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT), "STUBBORN_DIR": str(marks)}
    backend = LocalProcessBackend(state, cwd=ROOT, env=env, stop_grace_s=30.0)
    launch = EnvLaunch(env_id="tests.support.faulty_envs:StubbornEnv", options={"close_s": 0})
    try:
        servers = [await backend.start(launch) for _ in range(2)]  # each with a helper
        helpers = {_pgid(pid): pid for pid in (int(p.name[6:]) for p in marks.glob("child-*"))}
        first, second = (helpers[int(s.meta["pid"])] for s in servers)
        await backend.stop(servers[0])
        await wait_for(lambda: not alive(first))
        assert (marks / "sigterm").read_text().count("SIGTERM") == 1  # it outlived that
        assert alive(second)
        assert backend.outstanding() == 1
        assert backend.kill_now() == 1
        assert backend.outstanding() == 0
        assert list(state.iterdir()) == []
        await wait_for(lambda: not alive(second) and not alive(int(servers[1].meta["pid"])))
        await backend.aclose()
    finally:
        _kill_servers_in(state)
        for child in marks.glob("child-*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child.name[6:]), signal.SIGKILL)


async def test_pool_exit_mid_stop_leaves_no_local_server(tmp_path: Path) -> None:
    """The pool's owner exits while a retired local server is being stopped: the
    cancelled stop is done again by aclose, and no server process is left."""
    backend = LocalProcessBackend(tmp_path / "instances", cwd=ROOT, stop_grace_s=2.0)
    pids: list[int] = []
    try:
        async with backend:
            async with EnvPool(backend, EnvLaunch(env_id="echo-v1")) as pool:
                async with pool.lease() as lease:
                    pids.append(int(lease.instance.meta["pid"]))
                    _stop_process(pids[0])
                    lease.retire("hung")
                await wait_for(lambda: _term_pending(pids[0]))
            assert not alive(pids[0])  # by the pool's aclose, not the backend's
    finally:
        for pid in pids:
            _kill_leftover(pid)


#: A controller that starts one local instance of an environment that takes argv[3]
#: seconds to build: the tests SIGKILL it while it waits for the server.
_STARTER = """
import asyncio, sys, time
from envport.rollout import EnvLaunch, LocalProcessBackend
launch = EnvLaunch(
    env_id="tests.support.faulty_envs:SlowToBuildEnv",
    options={"build_s": float(sys.argv[3])},
    labels={"envport-run": "r"},
)
asyncio.run(LocalProcessBackend(sys.argv[1], cwd=sys.argv[2]).start(launch))
time.sleep(600)  # killed, never exits (an exit would stop its servers: atexit)
"""


async def _starter_killed_mid_start(state: Path, build_s: float) -> EnvInstance:
    """Run :data:`_STARTER`, SIGKILL it once its server is spawned; that server's record."""
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT)}
    argv = [sys.executable, "-c", _STARTER, str(state), str(ROOT), str(build_s)]
    child = await asyncio.create_subprocess_exec(*argv, env=env)
    try:
        await wait_for(lambda: _only_record(state) is not None, timeout_s=30)
        instance = _only_record(state)
        assert instance is not None
        # Its starter is alive: another process's start in flight, not touched.
        assert await LocalProcessBackend(state).list() == []
        assert alive(int(instance.meta["pid"]))
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
    return instance


async def test_local_backend_stops_a_server_whose_starter_was_killed(tmp_path: Path) -> None:
    """A controller SIGKILLed while its server builds: the server (its own session) lives
    on, and the next list() finds its record, stops it and forgets it."""
    state = tmp_path / "instances"
    state.mkdir()
    try:
        instance = await _starter_killed_mid_start(state, build_s=60)
        pid = int(instance.meta["pid"])
        assert alive(pid)  # orphaned, still building
        assert await LocalProcessBackend(state).list({"envport-run": "r"}) == []
        await wait_for(lambda: not alive(pid))  # gone (its exit may take a moment)
        assert list(state.iterdir()) == []
    finally:
        _kill_servers_in(state)


async def test_local_backend_adopts_a_server_that_became_ready_after_its_starter_died(
    tmp_path: Path,
) -> None:
    state = tmp_path / "instances"
    state.mkdir()
    try:
        instance = await _starter_killed_mid_start(state, build_s=1)
        pid = int(instance.meta["pid"])
        port_file = state / f"{instance.instance_id}.port"
        await wait_for(port_file.exists, timeout_s=60)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        async with LocalProcessBackend(state, cwd=ROOT) as backend:
            await wait_for(lambda: _answers(url), timeout_s=60)
            (adopted,) = await backend.list({"envport-run": "r"})
            assert (adopted.instance_id, adopted.url) == (instance.instance_id, url)
            assert "starting" not in adopted.meta
            assert await backend.healthy(adopted)
            assert await echo(adopted, "adopted") == "adopted"
            (again,) = await backend.list()  # its record is complete now
            assert again.url == url
            await backend.stop(adopted)
        await wait_for(lambda: not alive(pid))  # gone (its exit may take a moment)
        assert list(state.iterdir()) == []
    finally:
        _kill_servers_in(state)


def _kill_servers_in(state: Path) -> None:
    """SIGKILL every server (a process group leader) whose command line names ``state``:
    what a failed test would otherwise leave running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not alive(pid := int(entry.name)):
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if str(state) in cmdline and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)


def _only_record(state: Path) -> EnvInstance | None:
    records = list(state.glob("local-*.json"))
    if not records:
        return None
    (record,) = records
    return EnvInstance.model_validate_json(record.read_text())


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_last_words_are_the_exception_that_ends_the_last_traceback() -> None:
    log = (
        "WARNING: something harmless\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "    main()\n"
        "KeyError: 'a'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 3, in <module>\n'
        "    ^^^^^^\n"
        "envport.errors.EnvFactoryError: it broke: twice\n"
        "  and a second line of its message\n"
    )
    assert last_words(log) == "envport.errors.EnvFactoryError: it broke: twice"
    assert last_words("just one line\n\n") == "just one line"
    uvicorn = (
        "INFO:     Waiting for application startup.\n"
        "ERROR:    Traceback (most recent call last):\n"
        '  File "x.py", line 1, in startup\n'
        "OSError: [Errno 28] No space left on device\n"
        "\n"
        "ERROR:    Application startup failed. Exiting.\n"
    )
    assert last_words(uvicorn) == "OSError: [Errno 28] No space left on device"
    assert last_words("") == "(no output)"


async def test_pool_drops_lost_sessions_and_recycles_after_half_are_lost() -> None:
    backend = CountingBackend()
    pool = EnvPool(backend, EnvLaunch(env_id="echo-v1", sessions=4))
    async with pool.lease() as lease:
        lease.lose_session()  # one hung session on a healthy 4-session instance
    instance = lease.instance.instance_id
    assert pool.stats().instances == 1  # kept
    async with pool.lease() as lease:
        assert lease.instance.instance_id == instance
        lease.lose_session()
    assert pool.stats().instances == 0  # 2 of 4 lost: recycled
    assert pool.stats().retired == 1
    await pool.aclose()
    assert backend.stopped == [instance]


class GatedBackend(CountingBackend):
    """``start`` returns only once ``gate`` is set: a start still running at any moment
    the test picks."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        await self.gate.wait()
        return await super().start(launch)


async def test_an_instance_whose_start_ends_after_the_pool_closed_is_stopped() -> None:
    """A lease (or a warm start) still starting its instance when the pool is closed gets
    PoolClosedError, and the instance it started is stopped, not left running."""
    backend = GatedBackend()
    pool = EnvPool(backend, EnvLaunch(env_id="echo-v1"))
    leasing = asyncio.create_task(_lease_once(pool))
    warming = asyncio.create_task(pool._warm_one())
    await wait_for(lambda: pool.stats().starting == 2)
    await pool.aclose()
    backend.gate.set()
    with pytest.raises(PoolClosedError):
        await leasing
    await warming
    assert len(backend.started) == 2
    assert sorted(backend.stopped) == sorted(backend.started)
