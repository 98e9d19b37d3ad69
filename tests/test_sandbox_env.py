"""``sandbox-v1``: a task's repository in a real sandbox, driven as an environment.

Reset goes back to the task's initial state without a new sandbox; a rubric's
``test_command`` runs the task's tests inside through a real client and server; trainers
fork an episode at step k. Isolated tests skip (with the reason) without isolation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envport.check import check_env
from envport.client.client import EnvClient
from envport.envs.sandbox_env import SandboxEnv
from envport.errors import ActionValidationError, EnvExecutionError, ToolError
from envport.registry import make, registered
from envport.rubrics import ClientHandle, ScoringContext, from_specs
from envport.sandbox import Isolation, probe
from envport.sandbox import sandbox as sandbox_mod
from envport.sandbox.cgroups import own_cgroups
from envport.sandbox.mounts import mounted_under
from envport.tasks.task import RubricSpec, Task
from tests.support.servers import run_env_server
from tests.test_sandbox import FORGE_BUILTIN, FORGE_PRINTF

ISOLATION = probe()
needs_isolation = pytest.mark.skipif(
    not ISOLATION.isolated, reason=f"no sandbox isolation here: {ISOLATION.explain()}"
)


@pytest.fixture(autouse=True)
def nothing_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Sandboxes go to this test's own runtime dir; afterwards nothing is left there:
    no mount, no directory, no cgroup."""
    runtime = tmp_path / "rt"
    monkeypatch.setenv("ENVPORT_SANDBOX_DIR", str(runtime))
    yield
    assert mounted_under(tmp_path) == [], "mounts left behind"
    assert not runtime.exists() or list(runtime.iterdir()) == [], "files left behind"
    assert not [p for d in own_cgroups().values() for p in d.glob(f"envport-{os.getpid()}-*")]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "test_calc.py").write_text(
        "from calc import add\nassert add(2, 3) == 5, 'add is wrong'\nprint('ok')\n"
    )
    return root


async def run(env: SandboxEnv, command: str, **kw: Any) -> dict[str, Any]:
    result = await env.call_tool("run", {"command": command, **kw})
    assert isinstance(result, dict)
    return result


def test_sandbox_env_is_registered() -> None:
    assert "sandbox-v1" in registered()
    assert isinstance(make("sandbox-v1"), SandboxEnv)


@needs_isolation
async def test_reset_restores_the_task_without_a_new_sandbox(repo: Path) -> None:
    async with SandboxEnv(workspace_roots=[repo]) as env:
        first = await env.reset(workspace=str(repo), files={"notes.txt": "task notes\n"})
        assert first.observation.isolated
        assert "/workspace" in first.observation.message
        await run(env, "cd /tmp && export X=1")
        assert (await run(env, "pwd; echo $X"))["stdout"] == "/tmp\n1\n"
        await env.call_tool("write_file", {"path": "calc.py", "content": "broken"})
        await run(env, "rm /workspace/notes.txt /workspace/test_calc.py")
        sandbox, pids = env.sandbox, env.sandbox.process_ids() if env.sandbox else []
        await env.reset(workspace=str(repo), files={"notes.txt": "task notes\n"})
        assert env.sandbox is sandbox
        assert sandbox is not None
        assert sandbox.process_ids() == pids, sandbox.reset_restarted  # nothing restarted
        assert sandbox.reset_restarted is None
        again = await run(env, "pwd; echo ${X:-unset}; cat notes.txt; ls")
        assert (
            again["stdout"] == "/workspace\nunset\ntask notes\ncalc.py\nnotes.txt\ntest_calc.py\n"
        )
        assert (
            await env.call_tool("read_file", {"path": "calc.py"}) == (repo / "calc.py").read_text()
        )
        await env.reset(workspace=str(repo))  # another task: another sandbox
        assert env.sandbox is not sandbox
        assert (await run(env, "ls"))["stdout"] == "calc.py\ntest_calc.py\n"


@needs_isolation
async def test_tools_and_their_errors(repo: Path) -> None:
    async with SandboxEnv(workspace=str(repo), max_steps=50) as env:
        await env.reset()
        listing = await env.call_tool("list_dir", {"path": "."})
        assert [e["name"] for e in listing] == ["calc.py", "test_calc.py"]
        with pytest.raises(ToolError, match="outside the workspace") as refused:
            await env.call_tool("read_file", {"path": "/etc/passwd"})
        assert refused.value.kind == "invalid_args"
        with pytest.raises(ToolError, match="no such file"):
            await env.call_tool("read_file", {"path": "missing"})
        with pytest.raises(ToolError, match="timeout_s"):
            await env.call_tool("run", {"command": "true", "timeout_s": 0})
        step = await env.step({"command": "sleep 5", "timeout_s": 0.2})
        assert step.observation.timed_out
        assert step.observation.exit_code == 124
        state = await env.state()
        assert state.model_dump()["commands_run"] == 1
        with pytest.raises(ActionValidationError, match="Allowed: workspace, files, max_steps"):
            await env.reset(image="ubuntu")


@needs_isolation
async def test_fork_branches_an_episode_at_step_k(repo: Path) -> None:
    async with SandboxEnv(workspace=str(repo)) as env:
        await env.reset()
        await env.step({"command": "mkdir w && cd w && export BRANCH=root && echo 0 > n"})
        children = await env.fork(2)
        try:
            for i, child in enumerate(children):
                assert child.step_count == env.step_count == 1
                assert child.episode_id != env.episode_id
                got = await run(child, f"pwd; echo $BRANCH; echo {i} > n; cat n")
                assert got["stdout"] == f"/workspace/w\nroot\n{i}\n"
            assert (await run(env, "cat n"))["stdout"] == "0\n"
            snap = await env.snapshot()
            await run(env, "echo 9 > n")
            await env.restore(snap)
            assert (await run(env, "cat n"))["stdout"] == "0\n"
            await children[0].reset()  # a child resets to the task, in its own sandbox
            assert (await run(children[0], "ls"))["stdout"] == "calc.py\ntest_calc.py\n"
        finally:
            for child in children:
                await child.close()


@needs_isolation
async def test_a_rubric_runs_the_tests_inside_through_a_real_server(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENVPORT_WORKSPACE_ROOTS", str(repo))  # the operator grants it
    task = Task(
        id="calc",
        prompt="fix add",
        env_id="sandbox-v1",
        rubric=(RubricSpec(type="test_command", params={"command": "python3 test_calc.py"}),),
    )
    rubric = from_specs(task.rubric)
    with run_env_server("sandbox-v1") as (url, _app):
        async with EnvClient.connect(url) as client:
            await client.reset(workspace=str(repo))
            failing = await rubric.score(ScoringContext(task=task, env=ClientHandle(client)))
            assert failing.total == 0.0
            await client.call_tool(
                "write_file", {"path": "calc.py", "content": "def add(a, b):\n    return a + b\n"}
            )
            passing = await rubric.score(ScoringContext(task=task, env=ClientHandle(client)))
            assert passing.total == 1.0
            await client.reset(workspace=str(repo))  # back to the broken task
            again = await rubric.score(ScoringContext(task=task, env=ClientHandle(client)))
            assert again.total == 0.0
            for forge in (FORGE_PRINTF, FORGE_BUILTIN):  # the agent rigs its shell
                await client.call_tool("run", {"command": forge})
                rigged = await rubric.score(ScoringContext(task=task, env=ClientHandle(client)))
                assert rigged.total == 0.0, forge


@needs_isolation
async def test_checker_passes() -> None:
    report = await check_env("sandbox-v1")
    assert report.ok, report.results


async def test_without_isolation_reset_says_why(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = Isolation(None, ("bubblewrap (`bwrap`) is not installed",))
    monkeypatch.setattr(sandbox_mod, "probe", lambda: missing)
    async with SandboxEnv(workspace=str(repo)) as env:
        with pytest.raises(EnvExecutionError, match=r"not installed.*allow_unisolated=True"):
            await env.reset()
    async with SandboxEnv(workspace=str(repo), allow_unisolated=True) as env:
        result = await env.reset()
        assert not result.observation.isolated
        assert (await run(env, "cat calc.py"))["exit_code"] == 0


# --- which host directories a client may name ------------------------------------------


async def test_workspace_outside_the_granted_roots_is_refused(tmp_path: Path, repo: Path) -> None:
    """A client cannot mount a host directory the operator did not grant: not /etc, not
    one reached through a symlink or ``..`` from a granted root. Nothing is started."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (repo / "escape").symlink_to(secret)
    env = SandboxEnv(workspace_roots=[repo])
    for value in ("/etc", str(secret), str(repo / "escape"), f"{repo}/../secret"):
        with pytest.raises(ActionValidationError, match="workspace_roots") as refused:
            await env.reset(workspace=value)
        assert f"refuses workspace {value!r}" in str(refused.value)
        assert str(repo) in str(refused.value)  # the allowed roots, named
    assert env.sandbox is None
    # Nothing granted: only the constructor's own workspace may be named.
    own = SandboxEnv(workspace=str(repo))
    with pytest.raises(ActionValidationError, match=r"workspace_roots: " + str(repo)):
        await own.reset(workspace=str(secret))


def test_a_server_refuses_an_ungranted_workspace_as_a_validation_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ENVPORT_WORKSPACE_ROOTS", raising=False)
    with run_env_server("sandbox-v1") as (url, _app):
        import httpx

        reply = httpx.post(f"{url}/reset", json={"workspace": "/root"})
    assert reply.status_code == 422
    assert reply.json()["error"]["code"] == "VALIDATION_ERROR"
    assert "refuses workspace '/root'" in reply.text
