"""``SandboxBackend``: real envport servers inside real sandboxes, on Unix sockets.

The client reaches each server over ``unix:/proc/<pid>/root/tmp/…`` (the sandbox has its
own network namespace); stopping an instance removes its sandbox entirely.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from envport.client.client import EnvClient
from envport.errors import ConnectionLostError, EnvportError, UnknownEnvError
from envport.rollout.backends.base import BackendError, EnvLaunch, Limits
from envport.rollout.backends.local import last_words
from envport.rollout.backends.sandbox import SandboxBackend
from envport.sandbox import SandboxConfig, probe
from envport.sandbox.cgroups import own_cgroups
from envport.sandbox.mounts import mounted_under
from tests.support.backends import echo

ISOLATION = probe()
pytestmark = pytest.mark.skipif(
    not ISOLATION.isolated, reason=f"no sandbox isolation here: {ISOLATION.explain()}"
)


@pytest.fixture(autouse=True)
def nothing_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("ENVPORT_SANDBOX_DIR", str(tmp_path / "rt"))
    yield
    assert mounted_under(tmp_path) == [], "mounts left behind"
    assert not [p for d in own_cgroups().values() for p in d.glob(f"envport-{os.getpid()}-*")]


async def test_an_instance_serves_over_a_unix_socket_and_stops_cleanly() -> None:
    async with SandboxBackend() as backend:
        launch = EnvLaunch(
            env_id="echo-v1", labels={"run": "r1"}, limits=Limits(memory_mb=512, pids=64)
        )
        instance = await backend.start(launch)
        assert instance.url is not None
        assert instance.url.startswith("unix:/")
        assert "/proc/" not in instance.url
        assert instance.start_latency_s is not None
        assert await backend.healthy(instance)
        assert await echo(instance, "hi") == "hi"
        # The launch's limits are the instance's cgroup's.
        groups = {c: list(d.glob(f"envport-{os.getpid()}-*")) for c, d in own_cgroups().items()}
        (memory,) = groups["memory"]
        assert int((memory / "memory.limit_in_bytes").read_text()) == 512 * 1024 * 1024
        (pids,) = groups["pids"]
        assert (pids / "pids.max").read_text().strip() == "64"
        assert await backend.list({"run": "r1"}) == [instance]
        assert await backend.list({"run": "other"}) == []
        await backend.stop(instance)
        await backend.stop(instance)  # idempotent
        assert not await backend.healthy(instance)
        assert await backend.list() == []
        with pytest.raises(ConnectionLostError, match="Cannot connect"):
            async with EnvClient.connect(instance.url):
                pass


async def test_a_symlink_planted_in_the_sandbox_cannot_redirect_the_controller(
    tmp_path: Path,
) -> None:
    """The socket the controller connects to is its own, outside the sandbox: a symlink
    the sandbox plants where the socket used to be (its /tmp, reached from the host
    through /proc/<init>/root) leads nowhere."""
    decoy_path = str(tmp_path / "host.sock")
    with socket.socket(socket.AF_UNIX) as decoy:
        decoy.bind(decoy_path)
        decoy.listen(4)
        decoy.setblocking(False)
        async with SandboxBackend() as backend:
            instance = await backend.start(EnvLaunch(env_id="echo-v1"))
            sb = backend._sandboxes[instance.instance_id]
            planted = await sb.exec(
                f"rm -f /tmp/envport-env.sock; ln -s {decoy_path} /tmp/envport-env.sock; "
                f"ln -s {decoy_path} /tmp/x.sock; echo ok"
            )
            assert planted.stdout == "ok\n"
            assert instance.url is not None
            assert not instance.url.startswith(f"unix:/proc/{sb.init_pid}/root")
            assert await backend.healthy(instance)
            assert await echo(instance, "hi") == "hi"
            listening = await sb.exec("ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c socket")
            assert listening.stdout.strip() != "0"  # the server has it; the shell does not:
            shell_fds = await sb.exec("ls -l /proc/$$/fd | grep -c socket")
            assert shell_fds.stdout.strip() == "0"
        with pytest.raises(BlockingIOError):
            decoy.accept()  # nothing ever connected to the host's socket


async def test_a_server_that_cannot_start_is_reported_and_removed() -> None:
    # A WebSocket implementation uvicorn does not know: the server dies starting up.
    base = SandboxConfig(env={"ENVPORT_WS_IMPL": "no-such-ws"})
    async with SandboxBackend(base=base) as backend:
        with pytest.raises(BackendError, match="exited before it was ready") as crashed:
            await backend.start(EnvLaunch(env_id="echo-v1", start_timeout_s=30))
        first, *rest = str(crashed.value).splitlines()
        assert first.endswith(last_words("\n".join(rest)))  # the exception it died of
        assert "no-such-ws" in first
        assert "RuntimeWarning" not in str(crashed.value)  # one module run once, by -m
        assert await backend.list() == []


async def test_an_environment_that_cannot_be_built_is_its_error_not_a_crash() -> None:
    async with SandboxBackend() as backend:
        with pytest.raises(UnknownEnvError, match=r"^Unknown environment 'nope-v1'"):
            await backend.start(EnvLaunch(env_id="nope-v1"))  # refused before any sandbox
        cannot_load = r"^Cannot load environment 'no_such_module:Env'"
        with pytest.raises(EnvportError, match=cannot_load) as e:
            await backend.start(EnvLaunch(env_id="no_such_module:Env", start_timeout_s=30))
        assert not isinstance(e.value, BackendError)  # the environment's: not retried
        assert "\n" not in str(e.value)
        assert await backend.list() == []
