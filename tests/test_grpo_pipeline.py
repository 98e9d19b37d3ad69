"""GRPO end to end: controller → gateway → tiny model server and a served environment.

The exactness test is the point of the whole path: every training row's sampled tokens
and logprobs are exactly what the model server sampled (its own record), stamped with
the policy version that sampled them, across a weight swap.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from envport.cli import app
from envport.cli_train import plot_rewards, plot_timeline
from envport.policy.torch_policy import TinyConfig, TinyTransformer, TorchPolicy
from envport.trace import SQLiteTraceStore, TraceStatus
from envport.train import build_rows
from envport.train.pipeline import (
    PipelineConfig,
    RolloutCollector,
    WarmStartConfig,
    addition_tasks,
    run_pipeline,
    serve_stack,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = TinyConfig(d_model=32, n_layers=1, n_heads=2, max_len=80, seed=4)
PNG = b"\x89PNG\r\n\x1a\n"


def test_tasks_ask_what_the_environment_asks() -> None:
    from envport.envs.arithmetic import ArithmeticEnv

    tasks = addition_tasks()
    assert len(tasks) == 81  # every a + b with one-digit a, b
    for task in tasks[:5]:
        env = ArithmeticEnv()
        first = asyncio.run(env.reset(seed=task.seed, difficulty="easy"))
        assert first.observation.question == task.prompt
        assert str(first.observation.question).startswith("What is ")


async def test_rows_hold_exactly_what_the_model_server_sampled(tmp_path: Path) -> None:
    policy = TorchPolicy(TinyTransformer(SMALL), max_new_tokens=4, seed=1)
    tasks = addition_tasks(3)
    with serve_stack(policy, tmp_path / "traces.db") as stack:
        async with RolloutCollector(stack, policy, run_id="exact", max_tokens=4) as collector:
            first = await collector.collect(tasks[:2], 3, 0)
            swapped = TinyTransformer(SMALL.model_copy(update={"seed": 5})).state_dict()
            await collector.publish(swapped, 1)
            second = await collector.collect(tasks[1:], 3, 1)
    traces = first + second
    assert len(traces) == 12
    assert all(t.status is TraceStatus.COMPLETED for t in traces)
    assert all(t.metadata["recorded_by"] == "envport.gateway" for t in traces)
    assert {t.group_id for t in first} == {f"exact-it000/{t.id}" for t in tasks[:2]}
    rows = [row for t in traces for row in build_rows(t).rows]
    assert len(rows) == 12
    sampled = Counter(
        (tuple(r.prompt_ids), tuple(r.sampled_ids), tuple(r.sampled_logprobs or ()), v)
        for r in rows
        for v in r.policy_versions
    )
    recorded = Counter(
        (s.prompt_ids, s.token_ids, s.logprobs, s.policy_version) for s in policy.records()
    )
    assert sampled == recorded  # token for token, logprob for logprob, version for version
    assert sorted(v for _, _, _, v in recorded.elements()) == [0] * 6 + [1] * 6
    # every rollout is also in the controller's store, once
    store = SQLiteTraceStore(tmp_path / "rollouts.db")
    try:
        assert store.count(run_id="exact") == 12
    finally:
        store.close()


def _tiny_config(**update: object) -> PipelineConfig:
    base = PipelineConfig(
        iterations=2,
        prompts=2,
        group_size=2,
        max_tokens=4,
        concurrency=8,
        model=SMALL,
        warmstart=WarmStartConfig(steps=2, batch=4),
    )
    return base.model_copy(update=update)


def test_pipeline_trains_with_overlap_and_writes_its_plots(tmp_path: Path) -> None:
    tasks = addition_tasks(4)
    seen: list[int] = []
    result, warm = asyncio.run(
        run_pipeline(
            _tiny_config(),
            tmp_path,
            tasks=tasks,
            on_iteration=lambda it: seen.append(it.policy_version),
        )
    )
    assert not warm.cached
    assert list(tmp_path.glob("warmstart-*.pt"))
    assert seen == [1, 2]
    assert [it.rollouts for it in result.iterations] == [4, 4]
    assert all(it.rows + it.failed == 4 for it in result.iterations)
    kinds = Counter((s.lane, s.kind) for s in result.spans)
    assert kinds == {("producer", "collect"): 2, ("trainer", "wait"): 2, ("trainer", "update"): 2}
    assert 0.0 <= result.idle_fraction <= 1.0
    assert result.wall_s >= result.wait_s
    # the served policy ended at the trainer's last version, and the store has every trace
    store = SQLiteTraceStore(tmp_path / "traces.db")
    try:
        assert store.count() == 8
    finally:
        store.close()
    serial, warm2 = asyncio.run(
        run_pipeline(_tiny_config(iterations=1, overlap=False), tmp_path, tasks=tasks)
    )
    assert warm2.cached
    assert torch.equal(next(iter(warm2.state_dict.values())), next(iter(warm.state_dict.values())))
    assert len(serial.iterations) == 1
    reward = plot_rewards(result, tmp_path / "reward.png")
    timeline = plot_timeline({"overlap": result, "no overlap": serial}, tmp_path / "tl.png")
    assert reward.read_bytes().startswith(PNG)
    assert timeline.read_bytes().startswith(PNG)


def test_train_demo_command_runs_and_reports(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "train-demo",
            "--iterations",
            "1",
            "--compare-iterations",
            "0",
            "--prompts",
            "1",
            "--group-size",
            "2",
            "--warmstart-steps",
            "1",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "trainer idle time" in result.output
    assert "warm start" in result.output
    for name in ("reward.png", "timeline.png", "results.json"):
        assert (tmp_path / name).exists()


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--group-size", "1"], "--group-size"),
        (["--prompts", "0"], "--prompts"),
        (["--iterations", "0"], "--iterations"),
        (["--warmstart-steps", "-1"], "--warmstart-steps"),
        (["--compare-iterations", "-1"], "--compare-iterations"),
    ],
)
def test_train_demo_refuses_bad_options_in_one_line_before_starting(
    tmp_path: Path, args: list[str], option: str
) -> None:
    """--group-size 1 (etc.) used to print the banner and then a raw pydantic
    ValidationError traceback."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train-demo", *args, "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.startswith("error: invalid train-demo option: " + option)
    assert result.output.count("\n") == 1
    assert "envport train-demo" not in result.output  # no banner
    assert "Traceback" not in result.output
    assert not out.exists()
