"""`envport run builtin:coding --backend sandbox` as a newcomer runs it.

A real scripted model server process, a real controller process whose environment
servers live in real sandboxes; the controller is SIGKILLed mid-batch and restarted with
``--resume``. Every rollout ends up in the store exactly once, scored by the task's own
tests run inside the sandbox, and nothing the killed controller made is left behind.
Also: the backends that need a cluster fail fast with a message that says what to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from envport.policy.base import SamplingParams
from envport.policy.scripted import ScriptedPolicy
from envport.sandbox import probe
from envport.sandbox.cgroups import own_cgroups
from envport.sandbox.mounts import mounted_under
from envport.serving import free_port
from envport.tasks import load
from envport.trace import SQLiteTraceStore, Trace, TraceStatus
from tests.support.cli import CLI_ENV, completed, envport_cli, kill_midway, run_args

ISOLATION = probe()
needs_sandbox = pytest.mark.skipif(
    not ISOLATION.isolated, reason=f"no sandbox isolation here: {ISOLATION.explain()}"
)


@pytest.fixture
def model_url() -> Iterator[str]:
    """``python -m envport.policy.server``: the scripted stand-in, in its own process."""
    port = free_port()
    argv = [sys.executable, "-m", "envport.policy.server", "--port", str(port)]
    server = subprocess.Popen(argv, env=CLI_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "the scripted model server did not start"
            try:
                if httpx.get(f"{url}/models", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stderr is not None:
            server.stderr.close()


def _args(db: Path, model: str, *extra: str) -> list[str]:
    return run_args("builtin:coding", db, "code", "--backend", "sandbox", "--model", model, *extra)


def _processes_under(path: Path) -> list[str]:
    """Command lines of live processes that mention ``path`` (sandboxes, servers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def _leftover_cgroups(*pids: int) -> list[Path]:
    return [
        group
        for directory in own_cgroups().values()
        for pid in pids
        for group in directory.glob(f"envport-{pid}-*")
    ]


def _written_fix(trace: Trace) -> str | None:
    """The content the agent wrote with ``write_file``, if it did."""
    for message in trace.messages:
        for call in message.tool_calls:
            if call.name == "write_file":
                return str(call.arguments.get("content", ""))
    return None


@needs_sandbox
@pytest.mark.timeout(150)
def test_sandboxed_coding_batch_killed_midway_and_resumed_runs_each_rollout_once(
    tmp_path: Path, model_url: str
) -> None:
    tasks = {t.id: t for t in load("builtin:coding")}
    n = len(tasks)
    runtime = tmp_path / "rt"
    env = {**CLI_ENV, "ENVPORT_SANDBOX_DIR": str(runtime)}
    db = tmp_path / "runs" / "t.db"

    first = kill_midway(_args(db, model_url), db, "code", env=env)
    done_before = completed(db, "code")
    assert done_before < n, "killed too late to test a restart"
    # The killed controller's sandboxes died with it; their mounts and cgroups did not.
    deadline = time.monotonic() + 10
    while _processes_under(runtime) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_under(runtime) == []
    assert mounted_under(runtime), "expected the killed controller's sandbox mounts"

    second = envport_cli(*_args(db, model_url, "--resume", "--json"), env=env)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["rollouts"] == n
    assert summary["succeeded"] == n
    assert summary["skipped"] >= done_before

    with SQLiteTraceStore(db) as store:
        traces = store.query(run_id="code")
        assert sorted(t.rollout_id for t in traces) == sorted(f"code/{i}/0" for i in tasks)
        assert all(t.status is TraceStatus.COMPLETED for t in traces)
        assert {r.state for r in store.rollouts(run_id="code")} == {"succeeded"}
    for trace in traces:
        task = tasks[str(trace.task_id)]
        fix = _written_fix(trace)
        assert fix is not None, f"{trace.task_id}: the agent wrote no fix"
        # The reward is what the task's tests said inside the sandbox: 1 for a real fix.
        assert trace.reward == (1.0 if task.answer in fix else 0.0), trace.task_id
    assert {t.reward for t in traces} == {0.0, 1.0}  # p_correct 0.8: some fixes fail

    assert _processes_under(runtime) == []
    assert mounted_under(tmp_path) == [], "mounts left behind"
    assert _leftover_cgroups(first.pid) == [], "the killed controller's cgroups are left"
    sockets = list(Path(tempfile.gettempdir()).glob(f"envport-env-{first.pid}-*"))
    assert sockets == [], "the killed controller's socket directories are left"
    assert not runtime.exists() or list(runtime.iterdir()) == []


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return envport_cli("run", "builtin:arithmetic", "--limit", "1", *args, env=env, timeout=60)


def test_ray_backend_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    db = tmp_path / "t.db"
    result = _run("--backend", "ray", "--ray-address", nobody, "--store", str(db))
    assert result.returncode == 2
    text = " ".join(result.stderr.split())
    assert f"no Ray cluster answers at {nobody}" in text
    assert "ray start --head" in text
    assert not db.exists() or _count(db) == 0

    bad = _run("--backend", "ray", "--ray-address", "nowhere", "--store", str(db))
    assert bad.returncode == 2
    assert "expected HOST:PORT" in " ".join(bad.stderr.split())


def test_kubernetes_backend_without_a_kubeconfig_says_so(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    env = {**CLI_ENV, "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none.yaml")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    missing = _run("--backend", "kubernetes", "--store", str(db), env=env)
    assert missing.returncode == 2
    assert f"--kubeconfig {tmp_path / 'none.yaml'}: no such file" in " ".join(
        missing.stderr.split()
    )

    env.pop("KUBECONFIG")
    none = _run("--backend", "kubernetes", "--store", str(db), env=env)
    assert none.returncode == 2
    text = " ".join(none.stderr.split())
    assert "--backend kubernetes: no Kubernetes cluster configured" in text
    assert "Pass --kubeconfig PATH" in text
    assert _count(db) == 0


def test_sandbox_backend_help_names_every_backend() -> None:
    result = envport_cli("run", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for word in ("inprocess", "local", "sandbox", "ray", "kubernetes", "--allow-unisolated"):
        assert word in text
    assert "--ray-address" in text
    assert "--kubeconfig" in text


def _count(db: Path) -> int:
    if not db.exists():
        return 0
    with SQLiteTraceStore(db) as store:
        return store.count()


def _bin_without_bwrap(tmp_path: Path) -> str:
    """A PATH with every command of this machine but ``bwrap``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        folder = Path(directory)
        if not folder.is_dir():
            continue
        for tool in folder.iterdir():
            link = bin_dir / tool.name
            if tool.name != "bwrap" and not link.exists() and os.access(tool, os.X_OK):
                link.symlink_to(tool)
    return str(bin_dir)


def test_sandbox_backend_without_bwrap_says_so_and_how_to_fall_back(tmp_path: Path) -> None:
    env = {**CLI_ENV, "PATH": _bin_without_bwrap(tmp_path)}
    db = tmp_path / "t.db"
    argv = ["builtin:coding", "--limit", "2", "--backend", "sandbox", "--store", str(db)]
    refused = envport_cli("run", *argv, env=env, timeout=60)
    assert refused.returncode == 2
    text = " ".join(refused.stderr.split())
    assert "--backend sandbox cannot isolate environments here" in text
    assert "bubblewrap (`bwrap`) is not installed" in text
    assert "--allow-unisolated" in text
    assert _count(db) == 0

    fallback = envport_cli(
        "run",
        *argv,
        "--allow-unisolated",
        "--json",
        env={**env, "ENVPORT_SANDBOX_DIR": str(tmp_path / "rt")},
        timeout=90,
    )
    assert fallback.returncode == 0, fallback.stderr
    assert "running environments as local processes" in " ".join(fallback.stderr.split())
    summary = json.loads(fallback.stdout)
    assert summary["succeeded"] == 2
    with SQLiteTraceStore(db) as store:
        traces = store.query()
    assert len(traces) == 2
    assert all(t.reward in (0.0, 1.0) for t in traces)  # the tests ran, unisolated


#: Runs each repository's test script (argv: dirs) in one interpreter; prints exit codes.
_RUN_TESTS = """
import contextlib, io, json, sys
codes = []
for repo, script, module in zip(*[iter(sys.argv[1:])] * 3):
    sys.path.insert(0, repo)
    sys.modules.pop(module, None)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(open(f"{repo}/{script}").read(), script, "exec"), {})
        code = 0
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:  # what python3 would print as a traceback, exit 1
        code = 1
        out.write(f"{type(exc).__name__}: {exc}")
    sys.path.remove(repo)
    codes.append([code, out.getvalue()])
print(json.dumps(codes))
"""


def _test_codes(repos: list[tuple[Path, str, str]]) -> list[tuple[int, str]]:
    argv = [sys.executable, "-c", _RUN_TESTS]
    for repo, script, module in repos:
        argv += [str(repo), script, module]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [(int(code), out) for code, out in json.loads(done.stdout)]


def test_builtin_coding_tasks_fail_as_shipped_and_pass_when_fixed(tmp_path: Path) -> None:
    tasks = list(load("builtin:coding"))
    assert 8 <= len(tasks) <= 16
    assert [t.id for t in tasks] == [t.id for t in load("builtin:coding")]  # deterministic
    assert len({t.metadata["file"] for t in tasks}) == len(tasks)
    shipped, fixed = [], []
    for task in tasks:
        assert task.env_id == "sandbox-v1"
        (rubric,) = task.rubric
        assert rubric.type == "test_command"
        script = rubric.params["command"].removeprefix("python3 ")
        module = task.metadata["file"]
        bad = task.prompt.split("the code `")[1].split("`")[0]  # type: ignore[union-attr]
        for where, fix in ((shipped, False), (fixed, True)):
            repo = tmp_path / ("fixed" if fix else "shipped") / task.id
            repo.mkdir(parents=True)
            for rel, content in task.env_options["files"].items():
                (repo / rel).write_text(content)
            code = (repo / module).read_text()
            assert code.count(bad) == 1
            if fix:
                (repo / module).write_text(code.replace(bad, task.answer))
            where.append((repo, script, module.removesuffix(".py")))
    for task, (code, out) in zip(tasks, _test_codes(shipped), strict=True):
        assert code == 1, task.id
        assert "FAIL" in out or "Error" in out
    for task, (code, out) in zip(tasks, _test_codes(fixed), strict=True):
        assert code == 0, (task.id, out)
        assert "checks passed" in out


SANDBOX_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("run", "read_file", "write_file", "list_dir")
]


async def _play(policy: ScriptedPolicy, prompt: str, file_text: str, exit_code: int) -> list[Any]:
    """Drive the policy through a fix: answer each tool call as sandbox-v1 would."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    turns: list[Any] = []
    for _ in range(5):
        gen = await policy.generate(messages, SANDBOX_TOOLS, SamplingParams(temperature=0))
        turns.append(gen)
        if not gen.tool_calls:
            break
        call = gen.tool_calls[0]
        messages.append(
            {
                "role": "assistant",
                "content": gen.text,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            }
        )
        result = {
            "read_file": file_text,
            "write_file": json.dumps({"path": "add.py", "bytes": 1}),
            "run": json.dumps({"exit_code": exit_code, "stdout": "", "stderr": ""}),
        }[call.name]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return turns


async def test_scripted_policy_fixes_by_the_review_note_then_runs_the_tests() -> None:
    task = next(t for t in load("builtin:coding") if t.metadata["file"] == "add.py")
    prompt = str(task.prompt)
    buggy = task.env_options["files"]["add.py"]
    turns = await _play(ScriptedPolicy(p_correct=1.0), prompt, buggy, 0)
    calls = [(c.name, json.loads(c.arguments)) for t in turns for c in t.tool_calls]
    assert calls == [
        ("read_file", {"path": "add.py"}),
        ("write_file", {"path": "add.py", "content": buggy.replace("a - b", "a + b")}),
        ("run", {"command": "python3 test_add.py"}),
    ]
    assert turns[-1].text.startswith("# Fixed add.py")  # a no-op if run as a command

    failed = await _play(ScriptedPolicy(p_correct=0.0), prompt, buggy, 1)
    written = [json.loads(c.arguments) for t in failed for c in t.tool_calls]
    assert written[1]["content"] == buggy  # a failed fix: written back unchanged
    assert "still fails (exit 1)" in failed[-1].text

    # Without the sandbox tools, or for a path outside the workspace, the rule stays off.
    plain = await ScriptedPolicy().generate(
        [{"role": "user", "content": prompt}], None, SamplingParams(temperature=0)
    )
    assert not plain.tool_calls
    outside = prompt.replace("`add.py`", "`/etc/passwd`")
    escaped = await ScriptedPolicy().generate(
        [{"role": "user", "content": outside}], SANDBOX_TOOLS, SamplingParams(temperature=0)
    )
    assert not escaped.tool_calls
