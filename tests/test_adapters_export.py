"""Exports for the trainers that read files: OpenPipe ART's TrajectoryGroup JSON, prime-rl rows.

openpipe-art needs Python 3.12 and prime-rl a CUDA stack, so neither installs in .venv:
the shapes are checked against the fields of their own models, read from their source
(openpipe-art 0.5.23 ``art/trajectories/__init__.py``; prime-rl
``src/prime_rl/transport/types.py``). Set ``ENVPORT_ART_PYTHON`` to a Python that has
``openpipe-art`` to validate the groups with ART's own pydantic models as well.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envport.policy.tokenizer import ByteTokenizer
from envport.serving import free_port, serve_in_thread
from envport.trace import SQLiteTraceStore, Trace
from envport.train import art_trajectory_groups, build_rows, to_record, write_art_jsonl

TOK = ByteTokenizer()

# openpipe-art 0.5.23: the fields of Trajectory, TrajectoryGroup and PydanticException.
ART_TRAJECTORY_FIELDS = {
    "exchanges",
    "messages_and_choices",
    "tools",
    "additional_histories",
    "reward",
    "initial_policy_version",
    "final_policy_version",
    "metrics",
    "metadata",
    "logs",
}
ART_GROUP_FIELDS = {"trajectories", "exceptions", "metadata", "metrics", "logs"}
ART_EXCEPTION_FIELDS = {"type", "message", "traceback"}
# openai's chat Choice: required fields, and the finish reasons its Literal allows.
CHOICE_REQUIRED = {"finish_reason", "index", "message"}
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}
# prime-rl's TrainingSample (msgspec struct the orchestrator sends the trainer).
PRIME_RL_SAMPLE = {
    "prompt_ids": int,
    "prompt_mask": bool,
    "completion_ids": int,
    "completion_mask": bool,
    "completion_logprobs": float,
}


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    from envport.policy import create_policy_app

    with serve_in_thread(create_policy_app()) as url:
        yield url + "/v1"


async def run_eval(url: str, db: Path, run_id: str, n: int = 2) -> list[Trace]:
    from envport.evaluate import EvalConfig, Evaluator
    from envport.harness import AgentConfig, ChatModel
    from envport.tasks import load
    from envport.trace import AsyncTraceStore

    tasks = list(load("builtin:guess-number").head(n))
    model = ChatModel(url, "scripted")
    try:
        store = AsyncTraceStore(SQLiteTraceStore(db))
        config = EvalConfig(rollouts=2, agent=AgentConfig(max_turns=8), max_attempts=1)
        await Evaluator(model, store, config).run(tasks, run_id=run_id)
        return await store.query(run_id=run_id, limit=None)
    finally:
        await model.aclose()


async def test_art_groups_carry_exact_ids_from_the_rows(model_url: str, tmp_path: Path) -> None:
    traces = await run_eval(model_url, tmp_path / "t.db", "art")
    groups = art_trajectory_groups(traces, tokenizer=TOK)
    assert len(groups) == 2  # one per task: its two rollouts are one GRPO group
    for group in groups:
        assert set(group) == ART_GROUP_FIELDS
        assert len(group["trajectories"]) == 2
        assert group["exceptions"] == []
        for trajectory in group["trajectories"]:
            assert set(trajectory) <= ART_TRAJECTORY_FIELDS
            trace = next(t for t in traces if t.trace_id == trajectory["metadata"]["trace_id"])
            (row,) = build_rows(trace, tokenizer=TOK).rows
            assert trajectory["reward"] == trace.reward == 1.0
            assert [t["function"]["name"] for t in trajectory["tools"]] == ["guess"]
            choices = [m for m in trajectory["messages_and_choices"] if "message" in m]
            assert len(choices) == len(trace.model_calls) == row.num_turns
            for choice, call, (start, end) in zip(
                choices, trace.model_calls, row.spans, strict=True
            ):
                assert set(choice) >= CHOICE_REQUIRED
                assert choice["finish_reason"] in FINISH_REASONS
                served = call.response["choices"][0] if call.response else {}
                assert choice["token_ids"] == served["token_ids"] == row.completion_ids[start:end]
                assert choice["prompt_token_ids"] == call.prompt_token_ids
                content = choice["logprobs"]["content"]
                assert [c["token"] for c in content] == [
                    f"token_id:{t}" for t in served["token_ids"]
                ]
                assert [c["logprob"] for c in content] == row.logprobs[start:end]  # type: ignore[index]
            roles = [m.get("role") for m in trajectory["messages_and_choices"] if "role" in m]
            assert roles[:2] == ["system", "user"]
            assert "tool" in roles


def test_failed_rollouts_become_group_exceptions_not_zero_rewards(tmp_path: Path) -> None:
    import asyncio

    dead = f"http://127.0.0.1:{free_port()}/v1"
    traces = asyncio.run(run_eval(dead, tmp_path / "t.db", "dead", n=1))
    (group,) = art_trajectory_groups(traces)
    assert group["trajectories"] == []
    assert len(group["exceptions"]) == 2
    for exc in group["exceptions"]:
        assert set(exc) == ART_EXCEPTION_FIELDS
        assert "dead/guess-number-000" in exc["message"]
    path = tmp_path / "art.jsonl"
    assert write_art_jsonl(traces, path) == 1
    assert json.loads(path.read_text())["exceptions"][0]["type"] == group["exceptions"][0]["type"]


async def test_prime_rl_records_match_training_sample(model_url: str, tmp_path: Path) -> None:
    traces = await run_eval(model_url, tmp_path / "t.db", "prime", n=1)
    for trace in traces:
        (row,) = build_rows(trace, tokenizer=TOK).rows
        record = to_record(row, "prime-rl")
        for name, kind in PRIME_RL_SAMPLE.items():
            assert all(type(v) is kind for v in record[name]), name
        assert record["completion_mask"] == [bool(m) for m in row.mask]
        assert len(record["completion_logprobs"]) == len(record["completion_ids"])
        assert not any(record["prompt_mask"])


@pytest.mark.skipif(
    not os.environ.get("ENVPORT_ART_PYTHON"),
    reason="set ENVPORT_ART_PYTHON to a Python 3.12 with openpipe-art to validate with ART",
)
@pytest.mark.timeout(180)
def test_art_groups_validate_with_arts_own_models(model_url: str, tmp_path: Path) -> None:
    import asyncio

    traces = asyncio.run(run_eval(model_url, tmp_path / "t.db", "artcheck", n=1))
    path = tmp_path / "groups.jsonl"
    write_art_jsonl(traces, path, tokenizer=TOK)
    # As ART's own loader does (art.utils.trajectory_logging._restore_trajectory): each
    # item holding a finish_reason becomes an openai Choice, then ART validates.
    code = (
        "import json, sys\n"
        "from openai.types.chat.chat_completion import Choice\n"
        "from art.trajectories import Trajectory, TrajectoryGroup\n"
        "for line in open(sys.argv[1]):\n"
        "    g = json.loads(line)\n"
        "    ts = []\n"
        "    for t in g.pop('trajectories'):\n"
        "        t['messages_and_choices'] = [Choice.model_validate(m) if 'finish_reason' in m\n"
        "                                     else m for m in t['messages_and_choices']]\n"
        "        ts.append(Trajectory.model_validate(t))\n"
        "    group = TrajectoryGroup(ts, **g)\n"
        "    c = [m for m in group.trajectories[0].messages_and_choices if isinstance(m, Choice)]\n"
        "    print(len(group.trajectories), type(c[0]).__name__, c[0].model_extra['token_ids'])\n"
    )
    out = subprocess.run(
        [os.environ["ENVPORT_ART_PYTHON"], "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    count, kind, _ = out.stdout.split(" ", 2)
    assert (count, kind) == ("2", "Choice")


def test_art_trajectory_of_unusable_calls_keeps_plain_messages() -> None:
    from envport.trace import TraceStatus
    from envport.trace.model import Choice, ModelCall

    trace = Trace(status=TraceStatus.COMPLETED, reward=0.5, group_id="g")
    trace.reply("user", "hi")
    call = ModelCall(model="m", choices=[Choice(finish_reason="stop")])  # no token ids
    trace.model_calls.append(call)
    trace.reply("assistant", "hello", model_call_id=call.id)
    (group,) = art_trajectory_groups([trace])
    (trajectory,) = group["trajectories"]
    choice = trajectory["messages_and_choices"][1]
    assert choice["message"] == {"role": "assistant", "content": "hello"}
    assert "token_ids" not in choice
    assert choice["logprobs"] is None
    assert trajectory["metrics"]["envport_exact_turns"] == 0
    record: dict[str, Any] = trajectory
    assert record["reward"] == 0.5


def test_cli_exports_rows_prime_rl_and_art(model_url: str, tmp_path: Path) -> None:
    import asyncio

    from typer.testing import CliRunner

    from envport.cli import app
    from envport.train import read_rows_jsonl

    db = tmp_path / "t.db"
    traces = asyncio.run(run_eval(model_url, db, "cli", n=1))
    runner = CliRunner()

    def export(fmt: str, name: str) -> Path:
        out = tmp_path / name
        result = runner.invoke(
            app, ["traces", "export", str(out), "--store", str(db), "--format", fmt]
        )
        assert result.exit_code == 0, result.output
        return out

    rows = list(read_rows_jsonl(export("rows", "rows.jsonl")))
    assert len(rows) == len(traces) == 2
    assert {r.trace_id for r in rows} == {t.trace_id for t in traces}
    prime = [json.loads(line) for line in export("prime-rl", "p.jsonl").read_text().splitlines()]
    assert all(set(PRIME_RL_SAMPLE) <= set(rec) for rec in prime)
    (group,) = [json.loads(line) for line in export("art", "a.jsonl").read_text().splitlines()]
    assert len(group["trajectories"]) == 2
    bad = runner.invoke(app, ["traces", "export", str(tmp_path / "x.jsonl"), "--store", str(db),
                              "--format", "verl"])  # fmt: skip
    assert bad.exit_code == 2
    assert "choose one of trace, rows, prime-rl, art" in bad.output
    wrong = runner.invoke(app, ["traces", "export", str(tmp_path / "x.parquet"), "--store",
                                str(db), "--format", "art"])  # fmt: skip
    assert wrong.exit_code == 2
    assert "JSONL" in wrong.output
