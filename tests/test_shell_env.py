"""``shell-v1``: a sandboxed bash workspace with Harbor's paths.

Most tests run real commands in real bubblewrap sandboxes; they are skipped (with the
reason) only where ``bwrap`` is not installed. The unisolated fallback and the error
without ``bwrap`` are tested everywhere, by replacing the probe.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import socket
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from envport.check import check_env
from envport.client.client import EnvClient
from envport.envs import shell
from envport.envs.shell import MAX_OUTPUT_BYTES, BwrapProbe, ShellEnv, run_command
from envport.errors import ActionValidationError, EnvExecutionError, ToolError
from envport.harness.agent import reset_options
from envport.registry import make, registered
from envport.rubrics import ClientHandle, ScoringContext, from_specs
from envport.tasks.harbor import read_harbor_task

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap is not installed (apt-get install bubblewrap); sandbox tests skipped",
)


async def run(env: ShellEnv, command: str, timeout_s: float = 30) -> dict[str, Any]:
    result = await env.call_tool("run", {"command": command, "timeout_s": timeout_s})
    assert isinstance(result, dict)
    return result


def harbor_task(root: Path, *, workdir: str | None = "/app") -> Path:
    """A Harbor task directory with the real layout: the answer is the sum, 3."""
    task = root / "sum-csv"
    (task / "environment" / "data").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Write the sum of data/in.csv's 2nd column to out.txt.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n')
    docker = "FROM python:3.13-slim\n" + (f"WORKDIR {workdir}\n" if workdir else "")
    (task / "environment" / "Dockerfile").write_text(docker + "COPY data data\n")
    (task / "environment" / "data" / "in.csv").write_text("a,1\nb,2\n")
    app = workdir or "/workspace"
    (task / "tests" / "test.sh").write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            mkdir -p /logs/verifier
            if python3 /tests/test_outputs.py; then echo 1 > /logs/verifier/reward.txt
            else echo 0 > /logs/verifier/reward.txt; fi
            """
        )
    )
    (task / "tests" / "test_outputs.py").write_text(
        f"assert open('{app}/out.txt').read().strip() == '3'\n"
    )
    (task / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nawk -F, '{s += $2} END {print s}' data/in.csv > out.txt\n"
    )
    return task


# --- registry and options -------------------------------------------------------------------


def test_shell_is_registered() -> None:
    assert "shell-v1" in registered()
    assert isinstance(make("shell-v1"), ShellEnv)


async def test_unknown_and_bad_options_are_refused_with_the_allowed_ones() -> None:
    async with ShellEnv() as env:
        with pytest.raises(ActionValidationError, match=r"docker_image.*Allowed: task_dir"):
            await env.reset(docker_image="python:3.13")
        with pytest.raises(ActionValidationError, match="would hide the sandbox's own /usr"):
            await env.reset(workdir="/usr/src/app")
        with pytest.raises(ActionValidationError, match="absolute"):
            await env.reset(workdir="app")
        with pytest.raises(ActionValidationError, match="must be relative"):
            await env.reset(files={"../escape.txt": "x"})


async def test_without_bwrap_reset_names_the_tool_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shell, "probe_bwrap", lambda: BwrapProbe(None, "`bwrap` is missing"))
    monkeypatch.delenv("ENVPORT_ALLOW_UNISOLATED", raising=False)
    async with ShellEnv() as env:
        with pytest.raises(EnvExecutionError, match=r"bwrap.*apt-get install bubblewrap"):
            await env.reset()
        # A client cannot choose to run its commands outside the sandbox.
        with pytest.raises(ActionValidationError, match="not a reset option"):
            await env.reset(allow_unisolated=True)
        assert env.workspace is None


async def test_unisolated_fallback_is_opt_in_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shell, "probe_bwrap", lambda: BwrapProbe(None, "`bwrap` is missing"))
    monkeypatch.setenv("ENVPORT_ALLOW_UNISOLATED", "1")
    async with ShellEnv() as env:
        first = await env.reset(files={"hello.txt": "hi"})
        assert first.observation.isolated is False
        assert "UNISOLATED" in first.observation.message
        assert first.info["isolated"] is False
        assert first.info["isolation_problem"] == "`bwrap` is missing"
        assert env.workspace is not None
        host = env.workspace.host_workdir
        out = await run(env, 'cat hello.txt; echo " $PWD $ENVPORT_WORKSPACE $ENVPORT_UNISOLATED"')
        assert out["stdout"] == f"hi {host} {host} 1\n"
        step = await env.step({"command": "true"})
        assert step.observation.isolated is False
        assert (await env.state()).model_dump()["isolated"] is False


# --- commands -------------------------------------------------------------------------------


@needs_bwrap
async def test_commands_run_in_the_workspace_with_status_and_output() -> None:
    async with ShellEnv() as env:
        first = await env.reset()
        assert first.observation.isolated is True
        assert not first.done
        out = await run(env, "pwd; echo to-out; echo to-err >&2; exit 3")
        assert out == {
            "exit_code": 3,
            "stdout": "/workspace\nto-out\n",
            "stderr": "to-err\n",
            "timed_out": False,
            "truncated": False,
        }
        step = await env.step({"command": "echo hi > a.txt && cat /workspace/a.txt"})
        assert (step.observation.exit_code, step.observation.stdout) == (0, "hi\n")
        assert step.reward is None
        assert not step.done
        assert (await run(env, "cat a.txt"))["stdout"] == "hi\n"  # files persist
        env_vars = await run(env, "env | sort")
        assert "PATH=" in env_vars["stdout"]
        assert "PYTEST" not in env_vars["stdout"]  # the host's environment stays out


@needs_bwrap
async def test_timeout_kills_the_command_and_everything_it_started() -> None:
    marker = f"31.{uuid.uuid4().int % 10**6}"  # a unique argument to find the processes by
    async with ShellEnv() as env:
        await env.reset()
        out = await run(env, f"sleep {marker} & sleep {marker}; echo never", timeout_s=0.5)
        assert out["timed_out"] is True
        assert out["exit_code"] == 124
        assert "never" not in out["stdout"]
        assert "killed after its 0.5 s timeout" in out["stderr"]
        for _ in range(50):
            if not _processes_with(marker):
                break
            await asyncio.sleep(0.1)
        assert not _processes_with(marker)
        # A background process is killed when its command ends, too.
        assert (await run(env, f"sleep {marker} & echo started"))["stdout"] == "started\n"
        for _ in range(50):
            if not _processes_with(marker):
                break
            await asyncio.sleep(0.1)
        assert not _processes_with(marker)


def exists(path: str) -> bool:
    return os.path.lexists(path)


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@needs_bwrap
async def test_output_is_capped() -> None:
    async with ShellEnv() as env:
        await env.reset()
        out = await run(env, "head -c 300000 /dev/zero | tr '\\0' a; echo done >&2")
        assert out["exit_code"] == 0
        assert out["truncated"] is True
        assert out["stdout"].startswith("a" * MAX_OUTPUT_BYTES)
        assert f"{300000 - MAX_OUTPUT_BYTES} more bytes of output dropped" in out["stdout"]
        assert out["stderr"] == "done\n"


# --- isolation ------------------------------------------------------------------------------


@needs_bwrap
async def test_network_is_unreachable_inside() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        async with ShellEnv() as env:
            await env.reset()
            code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"
            out = await run(env, f'python3 -c "{code}"')
            assert out["exit_code"] != 0
            assert "Connection refused" in out["stderr"] or "unreachable" in out["stderr"]
            name = await run(
                env, "python3 -c \"import socket; socket.getaddrinfo('pypi.org', 443)\""
            )
            assert name["exit_code"] != 0
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected


@needs_bwrap
async def test_proc_sys_is_read_only_inside() -> None:
    from tests.test_sandbox import PROC_WRITES

    async with ShellEnv() as env:
        await env.reset()
        out = await run(env, PROC_WRITES)
        assert out["stdout"] == "Linux\n", out
        assert "Read-only file system" in out["stderr"]


@needs_bwrap
async def test_commands_have_no_capabilities_and_no_user_namespaces() -> None:
    """bwrap run by root kept every capability (CAP_SYS_ADMIN included) in shell-v1's
    commands: mounting a fresh /proc gave a writable /proc/sys, host root's way in."""
    from tests.test_sandbox import ESCAPES

    async with ShellEnv() as env:
        await env.reset()
        out = await run(env, ESCAPES)
    assert out["stdout"] == "done\n", out


@needs_bwrap
async def test_writes_outside_the_workspace_stay_inside_the_sandbox() -> None:
    name = f"envport-test-{uuid.uuid4().hex}"
    async with ShellEnv() as env, ShellEnv() as other:
        await env.reset()
        await other.reset()
        for target in (f"/etc/{name}", f"/usr/{name}", f"/{name}", f"/tests/{name}"):
            out = await run(env, f"echo x > {target}")
            assert out["exit_code"] != 0, target
            assert not exists(target)
        out = await run(env, f"echo private > /tmp/{name} && cat /tmp/{name}")
        assert out["stdout"] == "private\n"
        assert not exists(f"/tmp/{name}")  # the host's /tmp is not the sandbox's
        assert (await run(env, f"cat /tmp/{name}"))["stdout"] == "private\n"  # kept
        assert (await run(other, f"cat /tmp/{name}"))["exit_code"] != 0  # not shared


@needs_bwrap
async def test_two_environments_do_not_see_each_other() -> None:
    async with ShellEnv() as a, ShellEnv() as b:
        await a.reset()
        await b.reset()
        await a.call_tool("write_file", {"path": "secret.txt", "content": "a's"})
        await run(a, "echo a-log > /logs/agent/a.txt")
        assert (await run(b, "cat secret.txt"))["exit_code"] != 0
        assert (await run(b, "ls /logs/agent"))["stdout"] == ""
        assert (await run(a, "cat secret.txt"))["stdout"] == "a's"
        assert a.workspace is not None
        assert b.workspace is not None
        assert a.workspace.root != b.workspace.root


# --- file tools -----------------------------------------------------------------------------


@needs_bwrap
async def test_file_tools_reach_only_the_workspace_logs_and_tests() -> None:
    async with ShellEnv() as env:
        await env.reset()
        written = await env.call_tool("write_file", {"path": "notes/a.txt", "content": "hé\n"})
        assert written == {"path": "notes/a.txt", "bytes": 4}
        assert (await run(env, "cat /workspace/notes/a.txt"))["stdout"] == "hé\n"
        assert await env.call_tool("read_file", {"path": "/workspace/notes/a.txt"}) == "hé\n"
        assert await env.call_tool("read_file", {"path": "notes/../notes/a.txt"}) == "hé\n"
        await env.call_tool("write_file", {"path": "/logs/agent/log.txt", "content": "ok"})
        assert (await run(env, "cat /logs/agent/log.txt"))["stdout"] == "ok"
        blob = base64.b64encode(bytes([0, 255, 10, 128])).decode()
        binary = {"path": "/logs/agent/b.bin", "content": blob, "encoding": "base64"}
        written = await env.call_tool("write_file", binary)
        assert written == {"path": "/logs/agent/b.bin", "bytes": 4}
        od = await run(env, "od -An -tu1 /logs/agent/b.bin")
        assert od["stdout"].split() == ["0", "255", "10", "128"]
        with pytest.raises(ToolError, match="not valid base64") as bad:
            await env.call_tool("write_file", {**binary, "content": "%%%"})
        assert bad.value.kind == "invalid_args"
        listing = await env.call_tool("list_dir", {})
        assert listing == [{"name": "notes", "type": "dir", "size": None}]
        assert await env.call_tool("list_dir", {"path": "/logs"}) == [
            {"name": "agent", "type": "dir", "size": None},
            {"name": "verifier", "type": "dir", "size": None},
        ]

        await run(env, "ln -s /etc/passwd link && ln -s ../../etc up")
        refused = [
            ("read_file", {"path": "/etc/passwd"}),
            ("read_file", {"path": "../etc/passwd"}),
            ("read_file", {"path": "/workspace/../etc/passwd"}),
            ("read_file", {"path": "link"}),
            ("read_file", {"path": "up/passwd"}),
            ("list_dir", {"path": "/"}),
            ("write_file", {"path": "/etc/x", "content": "x"}),
            ("write_file", {"path": "/tests/test.sh", "content": "echo 1"}),
            ("write_file", {"path": "../x", "content": "x"}),
        ]
        for tool, args in refused:
            with pytest.raises(ToolError, match="Refused") as info:
                await env.call_tool(tool, args)
            assert info.value.kind == "invalid_args", (tool, args)
        with pytest.raises(ToolError, match="no such file"):
            await env.call_tool("read_file", {"path": "/logs/verifier/reward.txt"})


async def test_files_option_places_jsonl_task_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell, "probe_bwrap", lambda: BwrapProbe(None, "not needed here"))
    files = {"src/main.py": "print(1)\n", "run.sh": {"content": "echo ok\n", "executable": True}}
    async with ShellEnv(allow_unisolated=True) as env:
        await env.reset(files=files)
        assert await env.call_tool("read_file", {"path": "src/main.py"}) == "print(1)\n"
        assert env.workspace is not None
        assert os.access(env.workspace.host_workdir / "run.sh", os.X_OK)


# --- episodes and lifecycle -----------------------------------------------------------------


@needs_bwrap
async def test_submit_ends_the_episode_and_max_steps_truncates() -> None:
    async with ShellEnv() as env:
        await env.reset()
        assert not (await env.step({"command": "true"})).done
        done = await env.step(
            {"type": "call_tool", "tool_name": "submit", "arguments": {"answer": "42"}}
        )
        assert done.terminated
        assert not done.truncated
        state = (await env.state()).model_dump()
        assert (state["submitted"], state["answer"]) == (True, "42")
        assert (await run(env, "echo still"))["stdout"] == "still\n"  # a rubric can score

        await env.reset(max_steps=2)
        assert not (await env.step({"command": "true"})).done
        last = await env.step({"type": "call_tool", "tool_name": "list_dir", "arguments": {}})
        assert last.truncated
        assert not last.terminated


@needs_bwrap
async def test_workspace_is_removed_on_reset_and_close() -> None:
    env = ShellEnv()
    await env.reset()
    assert env.workspace is not None
    first = env.workspace.root
    await run(env, "echo x > f.txt")
    await env.reset()
    assert env.workspace is not None
    second = env.workspace.root
    assert not first.exists()
    assert second.exists()
    assert (await run(env, "ls"))["stdout"] == ""  # a fresh workspace
    await env.close()
    assert not second.exists()


@needs_bwrap
async def test_checker_passes() -> None:
    report = await check_env("shell-v1")
    assert report.ok, report.results


# --- Harbor tasks ---------------------------------------------------------------------------


@needs_bwrap
async def test_harbor_task_dir_runs_with_harbor_paths(tmp_path: Path) -> None:
    task = read_harbor_task(harbor_task(tmp_path))
    assert task.env_id == "shell-v1"
    assert task.env_options == {"task_dir": ".", "workdir": "/app"}
    async with ShellEnv(workspace_roots=[tmp_path]) as env:
        await env.reset(**reset_options(task))
        out = await run(env, "pwd; ls; ls /tests; test -x /tests/test.sh || echo not-x")
        assert out["stdout"] == "/app\ndata\ntest.sh\ntest_outputs.py\nnot-x\n"
        assert (await run(env, "touch /tests/x"))["exit_code"] != 0  # read-only

        assert (await run(env, "bash /tests/test.sh"))["exit_code"] == 0
        assert await env.call_tool("read_file", {"path": "/logs/verifier/reward.txt"}) == "0\n"
        solve = (tmp_path / "sum-csv" / "solution" / "solve.sh").read_text()
        assert (await run(env, solve))["exit_code"] == 0
        assert (await run(env, "bash /tests/test.sh"))["exit_code"] == 0
        assert await env.call_tool("read_file", {"path": "/logs/verifier/reward.txt"}) == "1\n"


@needs_bwrap
async def test_harbor_rubric_scores_through_an_env_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task's own test_command rubric, run through the client's run/read_file tools."""
    monkeypatch.setenv("ENVPORT_WORKSPACE_ROOTS", str(tmp_path))
    task = read_harbor_task(harbor_task(tmp_path, workdir=None))
    rubric = from_specs(task.rubric)

    async def score(solve: str | None) -> float | None:
        async with EnvClient.connect(task.env_id or "") as client:
            await client.reset(**reset_options(task))
            if solve is not None:
                await client.step({"command": solve})
            result = await rubric.score(ScoringContext(task=task, env=ClientHandle(client)))
            assert not result.errors, result.errors
            return result.total

    assert await score(None) == 0.0
    assert await score("echo 3 > /workspace/out.txt") == 1.0


async def test_task_dir_outside_the_granted_roots_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client cannot copy a host directory the operator did not grant into its
    workspace, directly or through a symlink; nothing is created."""
    task = harbor_task(tmp_path / "granted")
    elsewhere = harbor_task(tmp_path / "elsewhere")
    (tmp_path / "granted" / "link").symlink_to(elsewhere)
    monkeypatch.delenv("ENVPORT_WORKSPACE_ROOTS", raising=False)
    async with ShellEnv(allow_unisolated=True) as env:
        for value in (str(task), "/etc"):  # nothing granted: nothing may be named
            with pytest.raises(ActionValidationError, match=r"workspace_roots: none"):
                await env.reset(task_dir=value)
    async with ShellEnv(allow_unisolated=True, workspace_roots=[tmp_path / "granted"]) as env:
        for value in (str(elsewhere), str(tmp_path / "granted" / "link")):
            with pytest.raises(ActionValidationError, match=r"refuses task_dir"):
                await env.reset(task_dir=value)
        assert env.workspace is None
        await env.reset(task_dir=str(task))  # granted
        monkeypatch.setenv("ENVPORT_WORKSPACE_ROOTS", str(tmp_path / "elsewhere"))
    async with ShellEnv(allow_unisolated=True) as env:  # the operator's variable
        await env.reset(task_dir=str(elsewhere))


async def test_a_command_that_leaves_a_process_holding_its_output_returns_when_it_exits(
    tmp_path: Path,
) -> None:
    """Unsandboxed (no PID namespace to end with the command), a background process
    holding stdout kept asyncio's wait() (Python 3.11: until every pipe closes) from
    returning, so the command ran into its timeout and was reported as timed out."""
    marker = f"32.{uuid.uuid4().int % 10**6}"
    out = await run_command(
        ["bash", "-c", f"sleep {marker} & echo started"],
        cwd=tmp_path,
        env=None,
        timeout_s=20,
        cap=1000,
    )
    assert out["timed_out"] is False
    assert out["exit_code"] == 0
    assert out["stdout"] == "started\n"
    for _ in range(50):
        if not _processes_with(marker):
            break
        await asyncio.sleep(0.1)
    assert not _processes_with(marker)
