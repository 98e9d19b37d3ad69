"""Whole runs end to end: taskset -> built-in agent -> model server -> env -> rubric -> store."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envport.evaluate import EvalConfig, Evaluator, pass_at_k
from envport.harness import AgentConfig, ChatModel
from envport.policy import create_policy_app
from envport.serving import free_port, serve_in_thread
from envport.tasks import Task, load
from envport.trace import AsyncTraceStore, SQLiteTraceStore, Trace, TraceStatus
from tests.support.cli import CLI_ENV, envport_cli

WIDE = {**CLI_ENV, "COLUMNS": "220"}


@pytest.fixture(scope="module")
def policy_app() -> Any:
    return create_policy_app(faults=True)


@pytest.fixture(scope="module")
def model_url(policy_app: Any) -> Iterator[str]:
    with serve_in_thread(policy_app) as url:
        yield url + "/v1"


#: The model client's retry waits, made tiny.
FAST_RETRIES = {"backoff_s": 0.001, "max_backoff_s": 0.01}


async def run(
    tasks: list[Task], url: str, db: Path, chat: dict[str, Any] | None = None, **config: Any
) -> tuple[Any, list[Any]]:
    model = ChatModel(url, "scripted", **(chat or {}))
    try:
        async with AsyncTraceStore(SQLiteTraceStore(db)) as store:
            evaluator = Evaluator(model, store, EvalConfig(**config))
            summary = await evaluator.run(tasks, run_id=config.get("run_id_", "r1"))
            traces = await store.query(run_id=summary.run_id)
    finally:
        await model.aclose()
    return summary, traces


async def test_arithmetic_run_records_token_exact_calls(model_url: str, tmp_path: Path) -> None:
    tasks = list(load("builtin:arithmetic"))
    summary, traces = await run(tasks, model_url, tmp_path / "t.db", concurrency=8)
    assert summary.rollouts == 48
    assert summary.completed == 48
    assert summary.failed == 0
    assert summary.mean_reward is not None
    assert 0.6 < summary.mean_reward < 0.95
    for trace in traces:
        assert trace.status is TraceStatus.COMPLETED
        assert trace.reward in (0.0, 1.0)
        assert trace.stop_reason == "terminated"
        (call,) = trace.model_calls
        choice = call.choices[0]
        assert call.prompt_token_ids
        assert choice.completion_token_ids
        assert choice.completion_logprobs is not None
        assert len(choice.completion_logprobs) == len(choice.completion_token_ids)
        assert [m.role for m in trace.messages] == ["user", "assistant"]
        assert trace.messages[1].parent_id == trace.messages[0].id
        # The env's step reward and the rubric's reward are kept apart.
        assert trace.steps[0].reward == trace.reward
        assert {r.name for r in trace.rewards} >= {"env_reward"}


async def test_tool_env_over_real_env_servers(model_url: str, tmp_path: Path) -> None:
    from envport.cli_runs import env_servers

    tasks = list(load("builtin:guess-number").head(3)) + list(load("builtin:sql").head(2))
    with env_servers({"guess-number-v1", "sql-db-v1"}) as urls:
        summary, traces = await run(
            tasks, model_url, tmp_path / "t.db", env_urls=urls, agent=AgentConfig(max_turns=12)
        )
    assert summary.failed == 0, [t.errors for t in traces]
    assert summary.mean_reward == 1.0
    for trace in traces:
        tool_steps = [s for s in trace.steps if s.tool_name]
        assert tool_steps, "the agent acted through tools"
        ids = {tc.id for m in trace.messages for tc in m.tool_calls}
        assert all(s.tool_call_id in ids for s in tool_steps)
        assert [m for m in trace.messages if m.role == "tool"]
        # The model reads a tool's plain value (the CallToolResult's data), not its wrapper.
        replies = {m.tool_call_id: m.content for m in trace.messages if m.role == "tool"}
        for step in tool_steps:
            if step.observation.get("error") is None:
                value = step.observation["result"]["data"]
                shown = value if isinstance(value, str) else json.dumps(value, default=str)
                assert replies[step.tool_call_id] == shown


async def test_model_endpoint_down_is_a_classified_failure(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    tasks = list(load("builtin:arithmetic").head(3))
    summary, traces = await run(tasks, url, tmp_path / "t.db", chat=FAST_RETRIES)
    assert summary.failed == 3
    assert summary.completed == 0
    assert summary.errors_by_kind == {"model_provider": 3}
    assert all(t.reward is None for t in traces)  # never scored as 0
    for trace in traces:  # retried to the client's limit first
        (call,) = trace.model_calls
        assert call.metadata["retries"] == 3
        assert call.error is not None
        assert call.error.retryable


@pytest.mark.parametrize("fault", ["garbage", "500", "cut-stream"])
async def test_model_garbage_and_errors(
    fault: str, policy_app: Any, model_url: str, tmp_path: Path
) -> None:
    tasks = list(load("builtin:arithmetic").head(4))
    # A failure the client retries fails the rollout once it has been retried 3 times.
    retried = fault != "garbage"
    policy_app.state.faults.push(fault, times=4 if retried else 1)
    summary, traces = await run(
        tasks, model_url, tmp_path / "t.db", chat=FAST_RETRIES, concurrency=1
    )
    assert summary.failed == 1
    assert summary.completed == 3
    (bad,) = [t for t in traces if t.status is TraceStatus.FAILED]
    assert bad.errors[0].kind.value == "model_provider"
    assert bad.errors[0].where == "agent"
    # The failed call itself is on the trace: its request, and what came back.
    failed = bad.model_calls[-1]
    assert failed.error is not None
    assert failed.error.kind.value == "model_provider"
    assert failed.request is not None
    assert failed.request["messages"]
    assert failed.choices == []
    assert failed.metadata.get("retries") == (3 if retried else None)
    if fault == "500":
        assert failed.metadata["status"] == 500
        assert "Injected fault" in failed.metadata["body"]
    elif fault == "garbage":
        assert failed.metadata["body"]  # the unusable answer, kept
    from rich.console import Console

    from envport.report import transcript

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(transcript(bad))
    assert "model call failed" in console.export_text()


async def test_a_rate_limited_call_is_retried_and_the_rollout_completes(
    policy_app: Any, model_url: str, tmp_path: Path
) -> None:
    tasks = list(load("builtin:arithmetic").head(1))
    policy_app.state.faults.push("429", times=2)
    summary, traces = await run(tasks, model_url, tmp_path / "t.db", chat=FAST_RETRIES)
    assert summary.completed == 1
    (trace,) = traces
    (call,) = trace.model_calls
    assert call.error is None
    assert call.metadata["retries"] == 2
    assert all("HTTP 429" in e for e in call.metadata["retry_errors"])


async def test_unknown_env_and_crashing_env_do_not_stop_the_batch(
    model_url: str, tmp_path: Path
) -> None:
    good = list(load("builtin:arithmetic").head(2))
    unknown = Task(id="unknown-env", prompt="hi", env_id="no-such-env-v1")
    crash = Task(id="crash", prompt="crash", env_id="tests.support.faulty_envs:FaultyEnv")
    summary, traces = await run([*good, unknown, crash], model_url, tmp_path / "t.db")
    assert summary.completed == 2
    assert summary.failed == 2
    by_task = {t.task_id: t for t in traces}
    assert by_task["unknown-env"].errors[0].kind.value == "environment"
    assert "no-such-env-v1" in by_task["unknown-env"].errors[0].message
    crashed = by_task["crash"].errors[0]
    assert crashed.kind.value == "environment"
    assert "boom" in crashed.message
    assert summary.errors_by_kind == {"environment": 2}


async def test_a_rubric_that_cannot_be_built_fails_the_task_before_its_agent_runs(
    model_url: str, tmp_path: Path
) -> None:
    task = Task(
        id="bad-rubric",
        prompt="What is 1 + 1?",
        env_id="arithmetic-v1",
        seed=0,
        rubric=[{"type": "no_such_rubric"}],
    )
    summary, traces = await run([task], model_url, tmp_path / "t.db")
    assert summary.failed == 1
    (trace,) = traces
    assert trace.errors[0].kind.value == "task"
    assert "no_such_rubric" in trace.errors[0].message
    assert trace.reward is None
    assert trace.model_calls == []  # the agent never ran


async def test_a_rubric_raising_while_it_scores_is_a_rubric_error_never_zero(
    model_url: str, tmp_path: Path
) -> None:
    """A rubric that builds fine and raises when it scores (not a bad spec): the run
    is a failed trace of kind ``rubric`` with no reward, and the batch goes on."""
    from envport.rubrics import register

    @register("raises_when_scoring", replace=True)
    def _factory() -> Any:
        def score(completion: str) -> float:
            raise RuntimeError(f"the scorer broke on {completion[:20]!r}")

        return score

    good = list(load("builtin:arithmetic").head(2))
    broken = Task.model_validate(
        {
            **good[0].model_dump(),
            "id": "broken-rubric",
            "rubric": [{"type": "raises_when_scoring"}],
        }
    )
    summary, traces = await run([*good, broken], model_url, tmp_path / "t.db")
    assert (summary.completed, summary.failed) == (2, 1)
    (trace,) = [t for t in traces if t.task_id == "broken-rubric"]
    assert trace.status is TraceStatus.FAILED
    assert trace.errors[0].kind.value == "rubric"
    assert "the scorer broke" in trace.errors[0].message
    assert trace.reward is None
    assert trace.model_calls  # the run itself happened; only its scoring failed
    assert summary.errors_by_kind == {"rubric": 1}


async def test_resume_finishes_without_redoing(model_url: str, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    tasks = list(load("builtin:arithmetic").head(6))
    await run(tasks[:4], model_url, db, rollouts=2)  # "interrupted" after 4 tasks
    # A rollout that was in flight when the controller died:
    store = SQLiteTraceStore(db)
    from envport.evaluate import rollout_id
    from envport.trace import Trace

    stale = Trace(
        run_id="r1",
        task_id=tasks[4].id,
        rollout_id=rollout_id("r1", tasks[4], 0),
        status=TraceStatus.RUNNING,
    )
    store.put(stale)
    before = {t.trace_id for t in store.query(run_id="r1")}
    store.close()
    model = ChatModel(model_url, "scripted")
    async with AsyncTraceStore(SQLiteTraceStore(db)) as astore:
        summary = await Evaluator(model, astore, EvalConfig(rollouts=2)).run(
            tasks, run_id="r1", resume=True
        )
        traces = await astore.query(run_id="r1")
    await model.aclose()
    assert summary.skipped == 8
    assert summary.rollouts == 12
    assert len({t.rollout_id for t in traces}) == 12  # none twice
    assert stale.trace_id not in {t.trace_id for t in traces}
    assert before - {stale.trace_id} <= {t.trace_id for t in traces}  # kept, not redone


@pytest.mark.parametrize("rollouts", [1, 2])
async def test_progress_total_counts_every_trace_it_reports_malformed_lines_included(
    model_url: str, tmp_path: Path, rollouts: int
) -> None:
    """3 good tasks and 3 malformed lines: ``on_start`` announces exactly the traces
    ``on_done`` then reports (a malformed line once, whatever the rollouts), first."""
    good = [
        t.model_dump(mode="json", exclude_none=True, exclude={"source", "root"})
        for t in load("builtin:arithmetic").head(3)
    ]
    lines = [json.dumps(good[0]), "{not json", json.dumps(good[1]), "[]", "{}"]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join([*lines, json.dumps(good[2])]) + "\n")
    invalid: list[Any] = []
    tasks = list(load(str(path), invalid=invalid))
    assert (len(tasks), len(invalid)) == (3, 3)
    seen: list[str] = []
    model = ChatModel(model_url, "scripted")
    try:
        async with AsyncTraceStore(SQLiteTraceStore(tmp_path / "t.db")) as store:
            evaluator = Evaluator(model, store, EvalConfig(rollouts=rollouts))
            for resume in (False, True):
                seen.clear()
                await evaluator.run(
                    tasks,
                    run_id="p",
                    resume=resume,
                    invalid=invalid,
                    on_start=lambda n: seen.append(f"start {n}"),
                    on_done=lambda trace: seen.append("done"),
                )
                total = 3 * rollouts + 3 if not resume else 0  # resumed: all already final
                assert seen == [f"start {total}"] + ["done"] * total
    finally:
        await model.aclose()


def test_unscored_runs_count_in_neither_the_mean_nor_pass_at_k() -> None:
    from envport.evaluate import summarise
    from envport.trace import Trace

    def done(task_id: str, reward: float | None) -> Trace:
        return Trace(task_id=task_id, status=TraceStatus.COMPLETED, reward=reward)

    summary = summarise(
        "r", [done("a", 1.0), done("a", None), done("b", None), done("b", None)], tasks=2
    )
    assert summary.completed == 4
    assert summary.mean_reward == 1.0
    assert summary.pass_at_k == {1: 1.0}  # only task a's scored run; b has none
    nothing = summarise("r", [done("b", None)], tasks=1)
    assert (nothing.mean_reward, nothing.pass_at_k) == (None, {})


def test_pass_at_k_counts_the_agent_s_own_failures_as_tries_that_did_not_pass() -> None:
    """Task a: 1 solved, 3 agent timeouts; task b: 4 infrastructure failures. pass@1 is
    1/4 for a (not 1.0 from its one completed run) and b is no try of the agent's."""
    from envport.evaluate import summarise
    from envport.trace import ErrorKind, Trace, TraceError

    def failed(task_id: str, kind: ErrorKind) -> Trace:
        error = TraceError(kind=kind, message="agent exceeded its deadline", where="agent")
        return Trace(task_id=task_id, status=TraceStatus.FAILED, errors=[error])

    traces = [
        Trace(task_id="a", status=TraceStatus.COMPLETED, reward=1.0),
        *(failed("a", ErrorKind.HARNESS) for _ in range(3)),
        *(failed("b", ErrorKind.INFRASTRUCTURE) for _ in range(4)),
    ]
    summary = summarise("r", traces, tasks=2)
    assert summary.mean_reward == 1.0  # over scored rollouts only
    assert summary.pass_at_k[1] == pytest.approx(0.25)
    assert summary.pass_at_k[4] == 1.0
    assert set(summary.pass_at_k) == {1, 4}


def test_the_progress_line_shows_the_summary_s_mean_reward() -> None:
    from envport.evaluate import summarise
    from envport.report import EvalProgress
    from envport.trace import Trace

    def done(reward: float | None) -> Trace:
        return Trace(task_id="a", status=TraceStatus.COMPLETED, reward=reward)

    unscored = [done(None), done(None), Trace(task_id="b", status=TraceStatus.FAILED)]
    mixed = [*unscored, done(1.0), done(0.0), done(1.0)]
    for traces, shown in ((unscored, "mean reward —"), (mixed, "mean reward 0.667")):
        tally = EvalProgress()
        for trace in traces:
            tally.add(trace)
        assert tally.mean_reward == summarise("r", traces, tasks=2).mean_reward
        assert tally.markup().endswith(shown)
    assert tally.markup().startswith("[green]5 ok[/] [red]1 failed[/]")


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_cli_eval_and_traces(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    done = envport_cli(
        "eval",
        "builtin:arithmetic",
        *("--limit", "5", "-k", "2", "--store", str(db), "--run-id", "cli", "--json"),
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["rollouts"] == 10
    assert summary["completed"] == 10
    assert set(summary["pass_at_k"]) == {"1", "2"}
    listed = envport_cli(
        "traces", "list", "--store", str(db), "--run", "cli", env=WIDE, timeout=60, check=True
    )
    assert "arithmetic-000" in listed.stdout
    trace_id = SQLiteTraceStore(db).query(run_id="cli", limit=1)[0].trace_id
    shown = envport_cli(
        "traces", "show", trace_id, "--store", str(db), env=WIDE, timeout=60, check=True
    )
    assert "completion ids [" in shown.stdout
    assert "logprobs [" in shown.stdout
    assert "What is" in shown.stdout
    every = envport_cli(
        "traces",
        "show",
        trace_id,
        "--tokens",
        "--store",
        str(db),
        env=WIDE,
        timeout=60,
        check=True,
    )
    call = SQLiteTraceStore(db).get(trace_id).model_calls[0]
    assert call.prompt_token_ids is not None
    start = "prompt ids [" + ", ".join(map(str, call.prompt_token_ids[:4]))
    assert start in every.stdout  # the prompt's ids themselves, not only their count
    assert start not in shown.stdout
    assert "choice 0 logprobs [" in every.stdout
    out = tmp_path / "export.jsonl"
    envport_cli("traces", "export", str(out), "--store", str(db), timeout=60, check=True)
    assert len(out.read_text().splitlines()) == 10
    bad = envport_cli("eval", str(tmp_path / "missing.jsonl"), "--store", str(db), timeout=60)
    assert bad.returncode == 2
    assert "missing.jsonl" in bad.stderr
    # Mistakes get one clear line, not a traceback.
    for args, says in [
        (("eval", "builtin:arithmetic", "--limit", "1", "--run-id", "cli"), "already has"),
        (("traces", "list", "--status", "bogus"), "bogus"),
        (("traces", "export", str(tmp_path / "out.txt")), ".jsonl or .parquet"),
    ]:
        bad = envport_cli(*args, "--store", str(db), env=WIDE, timeout=60)
        assert bad.returncode == 2, bad.stderr
        assert says in bad.stderr
        assert "Traceback" not in bad.stderr
    prefixed = envport_cli("eval", "hf:nowhere/tasks.jsonl", "--store", str(db), timeout=60)
    assert prefixed.returncode == 2, prefixed.stderr  # not a local file: no lenient loading
    assert "Traceback" not in prefixed.stderr
    # The newest traces, listed newest last.
    newest = SQLiteTraceStore(db).query(run_id="cli", limit=1, descending=True)[0]
    listed = envport_cli(
        "traces", "list", "--store", str(db), "--limit", "1", env=WIDE, timeout=60, check=True
    )
    assert newest.trace_id[:8] in listed.stdout


def test_cli_eval_records_malformed_task_lines_and_unservable_envs_as_failed_runs(
    tmp_path: Path,
) -> None:
    """A JSONL file with bad lines, and a task naming an unknown environment, under
    --serve-envs: each bad line becomes a failed trace of kind 'task' naming its line,
    the unknown environment fails its own task, and the good tasks run."""
    good = [
        t.model_dump(mode="json", exclude_none=True, exclude={"source", "root"})
        for t in load("builtin:arithmetic").head(2)
    ]
    lines = [
        json.dumps(good[0]),
        "{not json",
        json.dumps({"id": "extra", "prompt": "hi", "colour": "red"}),
        json.dumps(good[0]),  # the same id again
        json.dumps({"id": "nowhere", "prompt": "hi", "env_id": "no-such-env-v1"}),
        json.dumps(good[1]),
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    db = tmp_path / "runs.db"
    done = envport_cli(
        "eval",
        str(tasks),
        "--serve-envs",
        "--store",
        str(db),
        "--run-id",
        "m",
        "--json",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["tasks"] == 6
    assert summary["rollouts"] == 6
    assert summary["completed"] == 2
    assert summary["failed"] == 4
    assert summary["errors_by_kind"] == {"task": 3, "environment": 1}
    by_task = {t.task_id: t for t in SQLiteTraceStore(db).query(run_id="m", limit=None)}
    assert by_task["tasks.jsonl:2"].errors[0].kind.value == "task"
    assert "tasks.jsonl:2: invalid JSON" in by_task["tasks.jsonl:2"].errors[0].message
    assert "colour" in by_task["tasks.jsonl:3"].errors[0].message
    assert "duplicate id" in by_task["tasks.jsonl:4"].errors[0].message
    assert by_task["tasks.jsonl:4"].metadata["field"] == "id"
    assert by_task["nowhere"].errors[0].kind.value == "environment"
    assert by_task[good[1]["id"]].status is TraceStatus.COMPLETED
    # Resumed, nothing is recorded twice.
    again = envport_cli(
        "eval",
        str(tasks),
        "--store",
        str(db),
        "--run-id",
        "m",
        "--resume",
        "--json",
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["rollouts"] == 6


def test_cli_eval_refuses_a_used_run_id_before_starting_anything(tmp_path: Path) -> None:
    """A --run-id that has traces, without --resume: one error line, and no stand-in model
    server started, no progress bar drawn."""
    db = tmp_path / "runs.db"
    with SQLiteTraceStore(db) as store:
        store.put(Trace(run_id="R1", task_id="t", status=TraceStatus.COMPLETED))
    args = ("builtin:arithmetic", "--limit", "1", "--store", str(db), "--run-id", "R1")
    result = envport_cli("eval", *args, env=WIDE, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""  # neither "No --model given: using …" nor "eval ━━━"
    assert result.stderr.strip() == (
        f"error: run 'R1' already has 1 traces in {db}; finish it with --resume or choose "
        "another --run-id"
    )


CWD_MODULE = '''
from envport.envs.echo import EchoEnv


class Parrot(EchoEnv):
    """Echo under another name."""
'''


@pytest.mark.parametrize(
    "command",
    [
        ("eval", "--serve-envs"),
        ("eval", "--in-process"),
        ("run", "--backend", "inprocess"),
        ("run", "--backend", "local"),
    ],
    ids=" ".join,
)
def test_cli_runs_import_a_module_env_from_the_current_directory(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    """Tasks whose env_id is `mymodule:Parrot`, run from the directory holding mymodule.py
    (not on PYTHONPATH): every command finds the environment."""
    (tmp_path / "mymodule.py").write_text(CWD_MODULE)
    task = {"id": "p", "prompt": "say hi", "env_id": "mymodule:Parrot"}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(task) + "\n")
    verb, *options = command
    result = envport_cli(
        verb, "tasks.jsonl", *options, "--store", "runs.db", "--json", cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["errors_by_kind"] == {}, result.stderr
    assert summary["completed" if verb == "eval" else "succeeded"] == 1
    assert "not serving" not in result.stderr


def test_cli_eval_harbor_task_dir(tmp_path: Path) -> None:
    """A Harbor task directory runs through `envport eval`, scored by its tests/test.sh."""
    task = tmp_path / "make-hello"
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    # The scripted stand-in echoes its prompt, so this instruction is also the solution.
    (task / "instruction.md").write_text("echo hello > /workspace/hello.txt\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n')
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        "if grep -q hello /workspace/hello.txt; then echo 1; else echo 0; fi"
        " > /logs/verifier/reward.txt\n"
    )
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    db = tmp_path / "h.db"
    done = envport_cli("eval", str(task), "--store", str(db), "--max-turns", "1", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["completed"] == 1, SQLiteTraceStore(db).query()[0].errors
    assert summary["mean_reward"] == 1.0


@pytest.mark.parametrize(
    ("config", "stop", "calls"),
    [
        (AgentConfig(max_turns=2), "max_turns", 2),
        (AgentConfig(max_total_tokens=1), "token_budget", 1),
    ],
    ids=["max-turns", "token-budget"],
)
async def test_the_agent_stops_on_each_of_its_limits(
    model_url: str, config: AgentConfig, stop: str, calls: int
) -> None:
    """A guessing game that takes many turns: each limit ends the episode where it says,
    and the trace says why."""
    from envport.client import EnvClient
    from envport.harness import ToolCallingAgent
    from envport.trace import Trace

    task = Task(
        id="guess",
        prompt="Guess my number between 1 and 1000.",
        env_id="guess-number-v1",
        seed=3,
        env_options={"high": 1000, "max_steps": 50},
    )
    model = ChatModel(model_url, "scripted")
    trace = Trace(task_id=task.id)
    try:
        async with EnvClient.connect("guess-number-v1") as env:
            await ToolCallingAgent(model, config).run(task, env, trace)
    finally:
        await model.aclose()
    assert trace.stop_reason == stop
    assert len(trace.model_calls) == calls
    assert len(trace.steps) == calls
