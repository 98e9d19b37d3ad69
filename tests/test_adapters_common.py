"""The pieces every trainer adapter shares, and the verl/SkyRL conversions, without trainers.

The trainers' own code paths are exercised in test_adapters_trainers.py (their venv);
here the conversions' edge cases run in .venv: cut responses and prompts, rollouts
that gave no row, split rollouts, a token engine that misbehaves.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from typing import Any

import pytest

from envport.policy.tokenizer import SPECIAL, ByteTokenizer
from envport.tasks import load
from envport.trace import Trace, TraceStatus
from envport.train import TrainingRow
from envport.train.adapters import (
    Generated,
    Rollout,
    RolloutRunner,
    TokenChatModel,
    parse_tool_calls,
    pick_row,
)
from envport.train.adapters.skyrl import output_lists, skyrl_dataset, stand_in_rewards
from envport.train.adapters.verl import output_fields, task_from_kwargs, verl_dataset
from envport.train.rows import RowsResult

TOK = ByteTokenizer()
IM_END = SPECIAL["<|im_end|>"]


def row(
    n: int = 6,
    *,
    prompt: int = 4,
    split: str | None = None,
    fragment: int = 0,
    logprobs: bool = True,
    step_rewards: list[tuple[int, float]] | None = None,
) -> TrainingRow:
    mask = [1, 1, 0, 0, 1, 1][:n] + [1] * max(0, n - 6)
    return TrainingRow(
        prompt_ids=list(range(100, 100 + prompt)),
        completion_ids=list(range(10, 10 + n)),
        mask=mask,
        logprobs=[-0.25 if m else 0.0 for m in mask] if logprobs else None,
        reward=1.0,
        step_rewards=step_rewards or [],
        trace_id="t",
        rollout_id="r",
        policy_versions=[None, None],
        num_turns=2,
        spans=[(0, 2), (4, n)],
        split_reason=split,
        fragment=fragment,
        num_fragments=2 if split else 1,
        labels=[split] if split else [],
        metadata={"finish_reasons": ["tool_calls", "stop"]},
    )


def rollout(*rows: TrainingRow, status: TraceStatus = TraceStatus.COMPLETED) -> Rollout:
    trace = Trace(status=status, reward=1.0 if rows else None)
    trace.reply("system", "s")
    trace.reply("user", "u")
    result = RowsResult(rows=list(rows), counts=Counter(rows=len(rows)))
    return Rollout(trace=trace, result=result, row=pick_row(result))


# --- picking a row ---------------------------------------------------------------------


def test_pick_row_hands_over_one_fragment_never_a_merge() -> None:
    first, last = row(6, split="retokenization_drift"), row(8, split="retokenization_drift")
    result = RowsResult(rows=[first, last])
    assert pick_row(result) is last
    assert pick_row(result, "first") is first
    assert pick_row(result, "longest") is last
    assert pick_row(RowsResult()) is None
    with pytest.raises(ValueError, match="fragment must be one of"):
        pick_row(result, "merge")  # type: ignore[arg-type]


# --- tool-call parsing ---------------------------------------------------------------------


def test_parse_tool_calls_reads_both_layouts_and_guesses_nothing() -> None:
    qwen = 'Let me try.\n<tool_call>\n{"name": "guess", "arguments": {"number": 5}}\n</tool_call>'
    assert parse_tool_calls(qwen) == ("Let me try.", [("guess", '{"number": 5}')])
    envport = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    assert parse_tool_calls(envport) == (None, [("a", "{}"), ("b", "{}")])
    broken = '<tool_call>{"name": "guess", "arguments": </tool_call>'
    assert parse_tool_calls(broken) == (broken, [])
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(nameless) == (nameless, [])
    assert parse_tool_calls("just text") == ("just text", [])


# --- TokenChatModel ----------------------------------------------------------------------


async def test_token_chat_model_records_exact_ids_and_infers_finish_reasons() -> None:
    answer = TOK.encode('<tool_call>{"name": "guess", "arguments": {"number": 3}}</tool_call>')
    seen: list[list[int]] = []

    async def engine(prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        seen.append(prompt_ids)
        return Generated([*answer, IM_END], [-0.5] * (len(answer) + 1))

    model = TokenChatModel(engine, TOK, sampling={"temperature": 0.5, "stop": "\n\n"})
    messages = [{"role": "user", "content": "go"}]
    tools = [{"type": "function", "function": {"name": "guess", "parameters": {}}}]
    call, message = await model.complete(messages, tools)
    assert seen == [TOK.encode(TOK.apply_chat_template(messages, tools))]
    assert call.prompt_token_ids == seen[0]
    assert call.choices[0].completion_token_ids == [*answer, IM_END]
    assert call.finish_reason == "tool_calls"
    assert call.sampling.temperature == 0.5
    assert call.sampling.stop == ["\n\n"]  # OpenAI's string form, recorded as a list
    assert message["tool_calls"][0]["function"] == {"name": "guess", "arguments": '{"number": 3}'}
    # No end-of-turn token and the token budget spent: the turn was cut.
    cut = TokenChatModel(
        lambda p, s: _const(Generated(answer[:5], None)), TOK, sampling={"max_tokens": 5}
    )
    call, message = await cut.complete(messages, None)
    assert call.finish_reason == "length"
    assert call.choices[0].completion_logprobs is None


async def _const(value: Generated) -> Generated:
    return value


async def test_engine_faults_fail_the_rollout_as_model_provider_errors() -> None:
    from envport.harness.model import ModelProviderError

    async def misaligned(prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        return Generated([1, 2, 3], [-0.1])

    with pytest.raises(ModelProviderError, match="1 logprobs for 3 tokens"):
        await TokenChatModel(misaligned, TOK).complete([{"role": "user", "content": "x"}])

    async def crashing(prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        raise RuntimeError("engine died")

    task = next(iter(load("builtin:guess-number").head(1)))
    runner = RolloutRunner()
    result = await runner.run(TokenChatModel(crashing, TOK), task, 0, "crash")
    assert result.row is None
    assert result.trace.status is TraceStatus.FAILED
    assert result.trace.errors[0].kind == "model_provider"
    assert "engine died" in result.trace.errors[0].message
    assert runner.stats.counts["no_row"] == 1


# --- verl ------------------------------------------------------------------------------


def test_verl_fields_cut_long_responses_and_prompts_and_mask_missing_rows() -> None:
    fields = output_fields(rollout(row(10)), response_length=5)
    assert fields["response_ids"] == [10, 11, 12, 13, 14]
    assert fields["response_mask"] == [1, 1, 0, 0, 1]
    assert len(fields["response_logprobs"]) == 5
    assert "truncated" in fields["extra_fields"]["envport_labels"]
    fields = output_fields(rollout(row(6, prompt=8)), prompt_length=5)
    assert fields["prompt_ids"] == [103, 104, 105, 106, 107]
    assert fields["extra_fields"]["envport_prompt_truncated"] == 3
    split = output_fields(rollout(row(6, split="truncated"), row(6, split="truncated", fragment=1)))
    assert split["extra_fields"]["envport_split_reason"] == "truncated"
    assert split["extra_fields"]["envport_num_fragments"] == 2
    failed = output_fields(rollout(status=TraceStatus.FAILED), pad_id=256)
    assert failed["response_ids"] == [256]
    assert failed["response_mask"] == [0]
    assert failed["reward_score"] == 0.0
    assert failed["extra_fields"]["envport_status"] == "failed"


def test_verl_an_unscored_rollout_is_a_masked_stand_in_with_a_score() -> None:
    """reward_score None on one output made verl 0.9.1 leave rm_scores out of the whole
    batch (_postprocess needs every score); an unscored row trains nothing instead."""
    unscored = row(6)
    unscored.reward = None
    fields = output_fields(rollout(unscored))
    assert fields["reward_score"] == 0.0
    assert fields["response_mask"] == [0] * 6
    assert fields["response_ids"] == unscored.completion_ids
    assert fields["extra_fields"]["envport_status"] == "unscored"


def test_verl_logprobs_are_all_lists_when_asked_and_all_none_when_not() -> None:
    """verl concatenates every output's logprobs when the batch's first has them: a
    stand-in or a row without logprobs must not be None next to rows that have them."""
    batch = [
        rollout(status=TraceStatus.FAILED),
        rollout(row(6, logprobs=False)),
        rollout(row(6)),
    ]
    asked = [output_fields(r, pad_id=256, logprobs=True) for r in batch]
    assert [f["response_logprobs"] for f in asked] == [
        [0.0],
        [0.0] * 6,
        [-0.25, -0.25, 0.0, 0.0, -0.25, -0.25],
    ]
    assert "missing_logprobs" in asked[1]["extra_fields"]["envport_labels"]
    assert "missing_logprobs" not in asked[2]["extra_fields"]["envport_labels"]
    not_asked = [output_fields(r, pad_id=256, logprobs=False) for r in batch]
    assert [f["response_logprobs"] for f in not_asked] == [None, None, None]


def test_verl_dataset_rows_round_trip_their_task() -> None:
    tasks = list(load("builtin:guess-number").head(2))
    rows = verl_dataset(tasks)
    assert [r["agent_name"] for r in rows] == ["envport", "envport"]
    assert rows[1]["prompt"][-1] == {"role": "user", "content": tasks[1].prompt}
    assert task_from_kwargs(rows[1]) == tasks[1]
    assert task_from_kwargs({"extra_info": {"envport_task": tasks[0].model_dump()}}) == tasks[0]
    with pytest.raises(ValueError, match="verl_dataset"):
        task_from_kwargs({"extra_info": {"index": 3}})
    json.dumps(rows)  # plain JSON: what a Parquet writer needs


# --- SkyRL -----------------------------------------------------------------------------


def test_skyrl_lists_align_and_mask_missing_rows() -> None:
    out = output_lists(
        [
            rollout(row(6, step_rewards=[(1, 0.5)])),
            rollout(status=TraceStatus.FAILED),
            rollout(row(10)),
        ],
        max_response_length=8,
        pad_id=256,
    )
    assert [len(r) for r in out["response_ids"]] == [6, 1, 8]
    assert [len(m) for m in out["loss_masks"]] == [6, 1, 8]
    assert out["loss_masks"][1] == [0]
    assert out["rewards"][0] == [0, 0, 0, 0, 0, 1.0]  # the run's reward, on the last token
    assert out["rewards"][1] == [0.0]
    assert out["stop_reasons"] == ["stop", "error", "length"]
    assert [len(lp) for lp in out["rollout_logprobs"]] == [6, 1, 8]
    assert out["rollout_metrics"]["envport/no_row"] == 1
    with_steps = output_lists([rollout(row(6, step_rewards=[(1, 0.5)]))], step_rewards=True)
    assert with_steps["rewards"][0] == [0, 0.5, 0, 0, 0, 1.0]
    without = output_lists([rollout(row(6)), rollout(row(6, logprobs=False))])
    assert without["rollout_logprobs"] is None  # never a ragged mix


def skyrl_grpo(scores: list[float], groups: list[str], eps: float = 1e-6) -> list[float]:
    """skyrl-train 0.3.1's compute_grpo_outcome_advantage: (r - mean) / (std + eps) per
    uid, std the sample standard deviation (torch.std); a lone member: mean 0, std 1."""
    out = []
    for score, group in zip(scores, groups, strict=True):
        members = [x for x, g in zip(scores, groups, strict=True) if g == group]
        if len(members) == 1:
            out.append(score)
        else:
            mean, std = statistics.fmean(members), statistics.stdev(members)
            out.append((score - mean) / (std + eps))
    return out


def grouped(group: str, reward: float | None, *, failed: bool = False) -> Rollout:
    if failed:
        r = rollout(status=TraceStatus.FAILED)
    else:
        scored = row(6)
        scored.reward = reward
        r = rollout(scored)
    r.trace.group_id = group
    return r


@pytest.mark.parametrize(
    ("rewards", "failed"),
    [
        ([1.0, 0.0, None, None], [False, False, True, True]),  # two failed of four
        ([1.0, 0.0, 0.5, None, None, None], [False] * 3 + [True] * 3),  # three
        ([1.0, 0.0, 0.25, None, None], [False, False, False, True, False]),  # + unscored
        ([1.0, 0.0, None, float("nan")], [False, False, True, False]),  # + non-finite
    ],
)
def test_skyrl_stand_ins_leave_the_scored_rollouts_advantages_as_they_were(
    rewards: list[float | None], failed: list[bool]
) -> None:
    """Failed and unscored rollouts are masked and given rewards that keep the group's
    mean and std: under skyrl-train's GRPO formula every scored rollout's advantage is
    the one it would have without them. (The group's mean used to stand in: the std
    shrank and the others' advantages grew, 1.7x with two of four failed.)"""
    rollouts = [grouped("a", r, failed=f) for r, f in zip(rewards, failed, strict=True)]
    out = output_lists(rollouts)
    scores = [sum(r) for r in out["rewards"]]
    advantages = skyrl_grpo(scores, ["a"] * len(scores))
    scored = [i for i, r in enumerate(rewards) if r is not None and r == r]
    alone = skyrl_grpo([scores[i] for i in scored], ["a"] * len(scored))
    assert [advantages[i] for i in scored] == pytest.approx(alone, abs=1e-6)
    # The batch's mean reward (what SkyRL logs) is the scored rollouts' too.
    assert statistics.fmean(scores) == pytest.approx(statistics.fmean(scores[i] for i in scored))
    for i in set(range(len(rewards))) - set(scored):
        assert not any(out["loss_masks"][i])  # no gradient from a stand-in
    unscored = sum(1 for i in set(range(len(rewards))) - set(scored) if not failed[i])
    assert out["rollout_metrics"]["envport/unscored"] == unscored
    assert out["rollout_metrics"]["envport/no_row"] == sum(failed)


def test_skyrl_a_lone_stand_in_keeps_its_group_s_mean_and_signs() -> None:
    """One stand-in cannot keep both mean and std: it keeps the mean (every sign, and
    Dr. GRPO's advantages exactly); the std shrinks by sqrt((k-1)/k)."""
    out = output_lists(
        [
            grouped("a", 1.0),
            grouped("a", 0.0),
            grouped("a", 0.5),
            grouped("a", None, failed=True),
            grouped("b", 0.5),
            grouped("b", None, failed=True),  # one scored sibling: no spread
            grouped("c", None, failed=True),  # no scored sibling
        ]
    )
    assert [r[-1] for r in out["rewards"]] == [1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0]
    scores = [sum(r) for r in out["rewards"]]
    advantages = skyrl_grpo(scores, ["a"] * 4 + ["b"] * 2 + ["c"])
    assert advantages[:3] == pytest.approx(
        [x * math.sqrt(3 / 2) for x in (1.0, -1.0, 0.0)], abs=1e-5
    )
    assert advantages[4] == 0.0
    assert stand_in_rewards([], 2) == [0.0, 0.0]
    assert stand_in_rewards([1.0, 0.0], 0) == []


def test_skyrl_dataset_carries_the_task() -> None:
    (entry,) = skyrl_dataset(load("builtin:guess-number").head(1))
    assert entry["env_class"] == "guess-number-v1"
    assert json.loads(entry["envport_task"])["id"] == entry["uid"]


async def test_skyrl_batch_with_a_repeated_trajectory_id_runs_each_prompt_once() -> None:
    """A dataset holding one task twice gives a batch two prompts with the same
    (instance_id, repetition_id). Each is its own rollout: the rollout id used to be
    built from the repetition id, so the second prompt came back as the first one's trace
    (the controller's exactly-once) or the whole batch failed on a stale state."""
    from types import SimpleNamespace

    from envport.train.adapters.skyrl import _EnvportGenerator

    answer = TOK.encode('<tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call>')
    sessions: list[str] = []

    class Engine:
        async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
            sessions.extend(request["session_ids"])
            return {
                "response_ids": [[*answer, IM_END]],
                "response_logprobs": [[-0.5] * (len(answer) + 1)],
                "stop_reasons": ["stop"],
            }

    (row_,) = skyrl_dataset(load("builtin:guess-number").head(1))
    generator = _EnvportGenerator(Engine(), TOK, agent=None)
    same = SimpleNamespace(instance_id=row_["uid"], repetition_id=0)
    out = await generator.generate(
        {
            "prompts": [row_["prompt"]] * 2,
            "env_classes": [row_["env_class"]] * 2,
            "env_extras": [{"envport_task": row_["envport_task"]}] * 2,
            "trajectory_ids": [same, same],
        }
    )
    traces = [r.trace for r in generator.last_rollouts]
    assert len({t.rollout_id for t in traces}) == 2
    assert len({t.trace_id for t in traces}) == 2
    assert len(set(sessions)) == 2  # both prompts were generated
    assert len(out["response_ids"]) == 2
    assert traces[0].group_id == traces[1].group_id  # still one GRPO group
