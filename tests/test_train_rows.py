"""Token-exact training rows: merging, labelled splits and drops, rewards, export.

Handcrafted traces use the ByteTokenizer and its ChatML-like template, so every id is
known; the last test builds rows from a real multi-turn eval against the scripted
policy server and compares them with what the server returned.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from envport.policy.tokenizer import IM_END, SPECIAL, ByteTokenizer, ParsedToolCall
from envport.policy.tokenizer import render_assistant as render
from envport.rubrics import group_advantages
from envport.trace import Trace, TraceStatus
from envport.trace.model import Choice, ModelCall, SamplingParams, StepRecord, ToolCall
from envport.train import (
    TrainingRow,
    assign_advantages,
    build_all,
    build_rows,
    read_rows_jsonl,
    read_rows_parquet,
    summarise,
    summary_table,
    to_record,
    write_rows_jsonl,
    write_rows_parquet,
)

TOK = ByteTokenizer()
IM_END_ID = SPECIAL[IM_END]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}},
        },
    }
]
Template = Callable[[Sequence[Mapping[str, Any]]], str]


def chatml(messages: Sequence[Mapping[str, Any]]) -> str:
    return TOK.apply_chat_template(messages, TOOLS)


def lps(n: int, seed: int) -> list[float]:
    return [-0.01 * ((seed * 7 + i) % 13 + 1) for i in range(n)]


def rollout(
    turns: Sequence[tuple[str | None, int | None, str | None]],
    *,
    template: Template = chatml,
    reward: float | None = 1.0,
    step_rewards: Sequence[float] | None = None,
    versions: Sequence[int | None] | None = None,
    status: TraceStatus = TraceStatus.COMPLETED,
    group_id: str | None = "g",
    completion_ids: Mapping[int, list[int]] | None = None,
) -> Trace:
    """A tool rollout: each turn is (content, guess or None, tool result or None).

    The client echoes each assistant turn unchanged, the prompt is ``template`` of the
    conversation so far, the completion is the turn rendered + ``<|im_end|>``;
    ``completion_ids`` overrides a turn's sampled ids.
    """
    trace = Trace(group_id=group_id, status=status, reward=reward, env_id="guess-number-v1")
    wire: list[dict[str, Any]] = [
        {"role": "system", "content": "Play."},
        {"role": "user", "content": "Guess a number from 1 to 100."},
    ]
    for m in wire:
        trace.reply(m["role"], m["content"])
    for k, (content, guess, result) in enumerate(turns):
        prompt_ids = TOK.encode(template(wire))
        calls = [] if guess is None else [ParsedToolCall("guess", json.dumps({"number": guess}))]
        ids = [*TOK.encode(render(content, calls)), IM_END_ID]
        if completion_ids and k in completion_ids:
            ids = completion_ids[k]
        call = ModelCall(
            model="m",
            step_index=k,
            sampling=SamplingParams(temperature=0.7),
            prompt_token_ids=prompt_ids,
            choices=[
                Choice(
                    finish_reason="tool_calls" if calls else "stop",
                    completion_token_ids=ids,
                    completion_logprobs=lps(len(ids), k),
                )
            ],
            policy_version=versions[k] if versions else None,
        )
        trace.model_calls.append(call)
        tool_calls = [
            ToolCall(id=f"call{k}", name=c.name, arguments=json.loads(c.arguments)) for c in calls
        ]
        msg = trace.reply("assistant", content, tool_calls=tool_calls, model_call_id=call.id)
        call.choices[0].message_id = msg.id
        wire.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": a}}
                    for c, a in zip(tool_calls, [c.arguments for c in calls], strict=True)
                ],
            }
        )
        if result is not None:
            rew = step_rewards[k] if step_rewards else None
            trace.steps.append(
                StepRecord(
                    index=len(trace.steps), tool_name="guess", tool_call_id=f"call{k}", reward=rew
                )
            )
            trace.reply("tool", result, tool_call_id=f"call{k}")
            wire.append({"role": "tool", "content": result, "tool_call_id": f"call{k}"})
    return trace


THREE_TURNS: list[tuple[str | None, int | None, str | None]] = [
    ("Let me start in the middle.", 50, "higher"),
    (None, 75, "lower"),
    ("The number is 62.", None, None),
]


def sampled(call: ModelCall) -> list[int]:
    ids = call.choices[0].completion_token_ids
    assert ids is not None
    return ids


def assert_token_exact(row: TrainingRow, calls: Sequence[ModelCall]) -> None:
    """Every mask-1 token and logprob is exactly what each call returned, in order."""
    assert row.sampled_ids == [t for c in calls for t in sampled(c)]
    want_lps = [lp for c in calls for lp in c.choices[0].completion_logprobs or []]
    assert row.sampled_logprobs == want_lps
    for call, (start, end) in zip(calls, row.spans, strict=True):
        assert row.completion_ids[start:end] == sampled(call)
        assert row.mask[start:end] == [1] * (end - start)


# --- merging ---------------------------------------------------------------------------


def test_three_turn_tool_rollout_merges_into_one_exact_row() -> None:
    trace = rollout(THREE_TURNS, step_rewards=[0.1, 0.2])
    result = build_rows(trace)
    (row,) = result.rows
    calls = trace.model_calls
    assert result.dropped == []
    assert row.num_turns == 3
    assert row.split_reason is None
    assert row.labels == []
    assert row.prompt_ids == calls[0].prompt_token_ids
    # The whole sequence is the last prompt followed by the last completion.
    assert row.prompt_ids + row.completion_ids == (calls[2].prompt_token_ids or []) + sampled(
        calls[2]
    )
    assert_token_exact(row, calls)
    # Tokens between turns (tool result, next header) are mask 0 with logprob 0.0.
    for (_, end), (start, _) in zip(row.spans, row.spans[1:], strict=False):
        gap = row.completion_ids[end:start]
        assert gap
        assert "<|im_start|>tool\nhigher" in TOK.decode(gap) or "lower" in TOK.decode(gap)
        assert row.mask[end:start] == [0] * len(gap)
        assert row.logprobs is not None
        assert row.logprobs[end:start] == [0.0] * len(gap)
    assert sum(row.mask) == sum(len(sampled(c)) for c in calls)
    assert row.reward == 1.0
    assert row.reward_index == len(row.completion_ids) - 1
    assert row.temperatures == [0.7, 0.7, 0.7]
    assert row.group_id == "g"
    assert (row.trace_id, row.rollout_id) == (trace.trace_id, trace.rollout_id)
    assert result.counts["rows"] == 1
    assert result.counts["calls"] == 3


def test_step_rewards_sit_on_each_steps_last_sampled_token() -> None:
    trace = rollout(THREE_TURNS, step_rewards=[0.1, -0.2], reward=1.0)
    (row,) = build_rows(trace).rows
    # Step k was caused by call k: its reward is on that call's last token (<|im_end|>).
    assert row.step_rewards == [(row.spans[0][1] - 1, 0.1), (row.spans[1][1] - 1, -0.2)]
    for index, _ in row.step_rewards:
        assert row.completion_ids[index] == IM_END_ID
        assert row.mask[index] == 1
    dense = row.token_rewards()
    assert dense[row.spans[0][1] - 1] == 0.1
    assert dense[row.spans[1][1] - 1] == -0.2
    assert dense[-1] == 1.0
    assert sum(dense) == pytest.approx(0.9)
    assert row.token_rewards(steps=False) == [0.0] * (len(dense) - 1) + [1.0]


# --- labelled splits ---------------------------------------------------------------------


def _strip_think(text: str | None) -> str | None:
    return re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL) if text else text


def stripping_template(keep_last: bool) -> Template:
    """A template that drops earlier reasoning (as Qwen3-style templates do)."""

    def template(messages: Sequence[Mapping[str, Any]]) -> str:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and not (keep_last and i == last):
                m = {**m, "content": _strip_think(m.get("content"))}
            out.append(m)
        return chatml(out)

    def safe(messages: Sequence[Mapping[str, Any]]) -> str:
        if not any(m["role"] == "assistant" for m in messages):
            return chatml(messages)
        return template(messages)

    return safe


REASONING_TURNS: list[tuple[str | None, int | None, str | None]] = [
    ("<think>middle first</think>Start at 50.", 50, "higher"),
    ("<think>upper half</think>Now 75.", 75, "lower"),
    ("The number is 62.", None, None),
]


def test_template_stripping_earlier_reasoning_splits_as_rewritten_history() -> None:
    # Turn 3's prompt strips turn 1's reasoning: the break lies in turn 2's prompt region.
    trace = rollout(REASONING_TURNS, template=stripping_template(keep_last=True))
    result = build_rows(trace)
    first, second = result.rows
    assert [r.split_reason for r in result.rows] == ["template_rewrote_history"] * 2
    assert (first.fragment, second.fragment, first.num_fragments) == (0, 1, 2)
    assert first.num_turns == 2
    assert second.num_turns == 1
    assert second.prompt_ids == trace.model_calls[2].prompt_token_ids
    assert_token_exact(first, trace.model_calls[:2])
    assert_token_exact(second, trace.model_calls[2:])
    assert result.counts["template_rewrote_history"] == 1
    assert first.reward == second.reward == 1.0  # each fragment carries the run's reward


def test_stripping_the_last_turn_needs_a_tokenizer_to_be_told_from_drift() -> None:
    # Every prompt strips all earlier reasoning: the break is inside the last completion.
    trace = rollout(REASONING_TURNS, template=stripping_template(keep_last=False))
    with_text = build_rows(trace, tokenizer=TOK)
    assert [r.split_reason for r in with_text.rows] == ["template_rewrote_history"] * 3
    assert with_text.counts["template_rewrote_history"] == 2
    # Without one, only the position is known: inside the completion reads as drift.
    by_position = build_rows(trace)
    assert by_position.rows[1].split_reason == "retokenization_drift"


def test_same_text_different_ids_at_the_boundary_is_retokenization_drift() -> None:
    # The model spelled "<|im_end|>" out in bytes; the template re-encodes it as one id.
    spelled = list(b"I guess 50.<|im_end|>")
    trace = rollout(
        [("I guess 50.", None, None), ("Still 50.", None, None)],
        completion_ids={0: spelled},
        template=lambda ms: chatml([m for m in ms if m["role"] != "tool"]),
    )
    for tokenizer in (TOK, None):
        result = build_rows(trace, tokenizer=tokenizer)
        assert [r.split_reason for r in result.rows] == ["retokenization_drift"] * 2
        assert_token_exact(result.rows[0], trace.model_calls[:1])
        assert_token_exact(result.rows[1], trace.model_calls[1:])


def test_missing_token_ids_skip_the_call_and_label_the_split() -> None:
    trace = rollout(THREE_TURNS)
    trace.model_calls[1].choices[0].completion_token_ids = None
    trace.model_calls[1].choices[0].completion_logprobs = None
    result = build_rows(trace)
    assert [r.split_reason for r in result.rows] == ["missing_token_ids"] * 2
    assert [r.num_turns for r in result.rows] == [1, 1]
    assert result.dropped == [(trace.trace_id, "missing_token_ids")]
    assert_token_exact(result.rows[0], trace.model_calls[:1])
    assert_token_exact(result.rows[1], trace.model_calls[2:])

    no_prompt = rollout(THREE_TURNS)
    no_prompt.model_calls[2].prompt_token_ids = None
    (row,) = build_rows(no_prompt).rows
    assert row.num_turns == 2
    assert row.split_reason == "missing_token_ids"  # its tail is gone: still labelled
    assert row.labels == ["missing_token_ids"]

    none_usable = rollout(THREE_TURNS)
    for call in none_usable.model_calls:
        call.choices = []
    result = build_rows(none_usable)
    assert result.rows == []
    assert result.dropped[-1] == (none_usable.trace_id, "no_usable_calls")
    assert result.counts["missing_token_ids"] == 3


def test_a_failed_call_the_agent_retried_leaves_the_row_whole() -> None:
    """A call that failed (an error, nothing generated) and was tried again: the row is
    the same one exact row as without it, not split at the failure."""
    from envport.trace import ErrorKind, ModelCall, TraceError

    trace = rollout(THREE_TURNS)
    failed = ModelCall(
        model="m",
        error=TraceError(kind=ErrorKind.MODEL_PROVIDER, message="HTTP 503"),
    )
    trace.model_calls.insert(1, failed)
    result = build_rows(trace)
    (row,) = result.rows
    assert row.split_reason is None
    assert row.num_turns == 3
    assert result.dropped == []
    assert_token_exact(row, [c for c in trace.model_calls if c is not failed])


def test_mismatched_logprob_lengths_are_refused_not_misaligned() -> None:
    trace = rollout(THREE_TURNS)
    good = trace.model_calls[1].choices[0]
    ids = good.completion_token_ids or []
    # The Choice model refuses this, so it can only come from outside validation.
    trace.model_calls[1].choices[0] = Choice.model_construct(
        index=0,
        finish_reason="tool_calls",
        completion_token_ids=ids,
        completion_logprobs=lps(len(ids) - 3, 1),
        message_id=good.message_id,
        top_logprobs=None,
    )
    result = build_rows(trace)
    assert [r.split_reason for r in result.rows] == ["logprob_mismatch"] * 2
    assert result.dropped == [(trace.trace_id, "logprob_mismatch")]
    for row in result.rows:
        assert row.logprobs is not None
        assert len(row.logprobs) == len(row.completion_ids)
    assert_token_exact(result.rows[0], trace.model_calls[:1])
    assert_token_exact(result.rows[1], trace.model_calls[2:])


def test_absent_logprobs_keep_the_tokens_and_say_so() -> None:
    trace = rollout(THREE_TURNS)
    trace.model_calls[0].choices[0].completion_logprobs = None
    result = build_rows(trace)
    (row,) = result.rows
    assert row.logprobs is None
    assert row.sampled_ids == [t for c in trace.model_calls for t in sampled(c)]
    assert "missing_logprobs" in row.labels
    assert result.counts["missing_logprobs"] == 1


def test_a_row_that_sampled_nothing_is_dropped_with_its_label() -> None:
    """An empty completion used to make a row with no token to train or reward
    (reward_index -1); an empty turn inside a merged row is harmless and stays."""
    empty = rollout([("x", None, None)], completion_ids={0: []})
    result = build_rows(empty)
    assert result.rows == []
    assert result.dropped == [(empty.trace_id, "no_sampled_tokens")]
    assert result.counts["no_sampled_tokens"] == 1
    inside = rollout(THREE_TURNS, completion_ids={1: []})
    (row,) = build_rows(inside).rows
    assert row.num_turns == 3


def test_an_empty_last_completion_leaves_no_unsampled_tail() -> None:
    """The last call sampled nothing: its prompt's new ids (the tool result, the next
    turn's header) used to end the row, so the reward sat on a header token the policy
    never sampled (and TRL saw a completion not ending in EOS: "clipped"). The row now
    ends on the last token sampled, without that call."""
    trace = rollout(THREE_TURNS, completion_ids={2: []})
    c0, c1, _ = trace.model_calls
    (row,) = build_rows(trace).rows
    assert row.mask[-1] == 1
    assert row.completion_ids[-1] == IM_END_ID
    assert row.prompt_ids + row.completion_ids == [*(c1.prompt_token_ids or []), *sampled(c1)]
    assert_token_exact(row, [c0, c1])
    assert row.call_ids == [c0.id, c1.id]
    assert row.metadata["finish_reasons"] == ["tool_calls", "tool_calls"]
    assert row.token_rewards()[row.reward_index] == 1.0
    assert row.mask[row.reward_index] == 1


def continued_with_choice_1(call: ModelCall) -> None:
    """Make ``call`` (the rollout's last) have two choices, the one its message came from
    second; the first stopped on length."""
    alt = [*TOK.encode("The number is 99."), IM_END_ID]
    call.choices = [
        Choice(
            index=0,
            finish_reason="length",
            completion_token_ids=alt,
            completion_logprobs=lps(len(alt), 6),
        ),
        call.choices[0].model_copy(update={"index": 1}),  # its message is the last one
    ]


def test_a_call_with_several_choices_trains_the_one_the_rollout_went_on_with() -> None:
    """n > 1: the harness went on with choice 1. Choice 0 (never continued) used to be
    the row's tokens, trained with the rollout's reward, and the next call split off
    as retokenization_drift; the choice taken was never trained on."""
    trace = rollout(THREE_TURNS)
    c0, c1, c2 = trace.model_calls
    other = [*TOK.encode("Some other answer."), IM_END_ID]
    taken = c0.choices[0].model_copy(update={"index": 1})
    c0.choices = [
        Choice(
            index=0,
            finish_reason="stop",
            completion_token_ids=other,
            completion_logprobs=lps(len(other), 5),
        ),
        taken,
    ]
    result = build_rows(trace)
    (row,) = result.rows
    assert row.split_reason is None
    assert row.num_turns == 3
    assert row.sampled_ids == [*(taken.completion_token_ids or []), *sampled(c1), *sampled(c2)]
    assert row.prompt_ids + row.completion_ids == [*(c2.prompt_token_ids or []), *sampled(c2)]
    assert row.metadata["finish_reasons"] == ["tool_calls", "tool_calls", "stop"]
    assert result.counts["unused_choices"] == 1
    assert result.counts["retokenization_drift"] == 0

    # The last call: no later prompt tells; the conversation's last branch does.
    final = sampled(c2)
    continued_with_choice_1(c2)
    (row,) = build_rows(trace).rows
    assert row.completion_ids[row.spans[-1][0] :] == final
    assert row.metadata["finish_reasons"][-1] == "stop"
    assert not row.truncated


def retry_of(call: ModelCall, ids: list[int]) -> ModelCall:
    """The same prompt sent again, answered with ``ids``."""
    return ModelCall(
        model="m",
        prompt_token_ids=list(call.prompt_token_ids or []),
        choices=[
            Choice(
                finish_reason="stop", completion_token_ids=ids, completion_logprobs=lps(len(ids), 9)
            )
        ],
    )


def test_a_retried_prompt_abandons_the_reply_and_keeps_one_row() -> None:
    """The harness re-sent a prompt: that used to split as retokenization_drift with
    both replies trained on and both carrying the reward. Now the abandoned reply is
    dropped (labelled retried_prompt) and the row goes on from the branch point."""
    trace = rollout(THREE_TURNS[:1])
    first = trace.model_calls[0]
    retry = retry_of(first, [*TOK.encode("again"), IM_END_ID])
    trace.model_calls.append(retry)
    result = build_rows(trace)
    (row,) = result.rows
    assert row.prompt_ids == first.prompt_token_ids
    assert_token_exact(row, [retry])
    assert row.split_reason is None
    assert row.labels == ["retried_prompt"]
    assert result.dropped == [(trace.trace_id, "retried_prompt")]
    assert result.counts["retried_prompt"] == 1
    assert result.counts["retokenization_drift"] == 0

    # A branch from an earlier turn: the first turn stays, the second is abandoned, the
    # third (re-asked from the second's prompt) follows the first in one row.
    trace = rollout(THREE_TURNS)
    c0, c1, _ = trace.model_calls
    branch = retry_of(c1, [*TOK.encode("other"), IM_END_ID])
    trace.model_calls[2] = branch
    result = build_rows(trace)
    (row,) = result.rows
    assert row.num_turns == 2
    assert row.call_ids == [c0.id, branch.id]
    assert_token_exact(row, [c0, branch])
    assert row.prompt_ids + row.completion_ids == [
        *(branch.prompt_token_ids or []),
        *sampled(branch),
    ]
    assert "retried_prompt" in row.labels
    assert result.dropped == [(trace.trace_id, "retried_prompt")]


def test_finish_reason_length_ends_the_row() -> None:
    trace = rollout(THREE_TURNS)
    trace.model_calls[1].choices[0].finish_reason = "length"
    result = build_rows(trace)
    first, second = result.rows
    assert first.truncated
    assert not second.truncated
    assert first.split_reason == second.split_reason == "truncated"
    assert first.metadata["truncated_by"] == "finish_reason_length"
    assert_token_exact(first, trace.model_calls[:2])  # the cut call's tokens are kept
    assert_token_exact(second, trace.model_calls[2:])

    last = rollout(THREE_TURNS)
    last.model_calls[2].choices[0].finish_reason = "length"
    (row,) = build_rows(last).rows
    assert row.truncated
    assert row.split_reason is None  # nothing was split off
    assert row.labels == ["truncated"]

    # The same, then a call that failed (nothing generated): still nothing split off.
    from envport.trace import ErrorKind, ModelCall, TraceError

    failed = ModelCall(model="m", error=TraceError(kind=ErrorKind.MODEL_PROVIDER, message="503"))
    last.model_calls.append(failed)
    (row,) = build_rows(last).rows
    assert row.split_reason is None


def test_rows_over_max_length_are_cut_or_dropped() -> None:
    trace = rollout(THREE_TURNS, step_rewards=[0.1, 0.2])
    (whole,) = build_rows(trace).rows
    limit = len(whole.prompt_ids) + whole.spans[1][1] + 5  # five tokens into the gap
    result = build_rows(trace, max_length=limit)
    (row,) = result.rows
    assert row.truncated
    assert row.labels == ["truncated"]
    assert row.metadata["truncated_by"] == "max_length"
    assert len(row) <= limit
    assert row.mask[-1] == 1  # ends on a sampled token, where the reward goes
    assert row.num_turns == 2
    assert_token_exact(row, trace.model_calls[:2])
    assert row.step_rewards == whole.step_rewards  # both still inside
    assert result.counts["truncated"] == 1

    result = build_rows(trace, max_length=len(whole.prompt_ids))
    assert result.rows == []
    assert result.dropped == [(trace.trace_id, "over_max_length")]


@pytest.mark.parametrize(
    "status",
    [TraceStatus.FAILED, TraceStatus.CANCELLED, TraceStatus.RUNNING, TraceStatus.PENDING],
)
def test_failed_and_partial_rollouts_never_produce_rows(status: TraceStatus) -> None:
    trace = rollout(THREE_TURNS[:2], status=status, reward=None)
    result = build_rows(trace)
    assert result.rows == []
    assert result.dropped == [(trace.trace_id, "failed_rollout")]
    assert result.counts["failed_rollout"] == 1


def test_completed_trace_without_model_calls_is_dropped() -> None:
    trace = Trace(status=TraceStatus.COMPLETED, reward=0.0)
    assert build_rows(trace).dropped == [(trace.trace_id, "no_model_calls")]


def test_staleness_filter() -> None:
    trace = rollout(THREE_TURNS, versions=[3, 4, 5])
    (row,) = build_rows(trace, max_staleness=3, current_policy_version=6).rows
    assert row.policy_versions == [3, 4, 5]
    result = build_rows(trace, max_staleness=2, current_policy_version=6)
    assert result.rows == []
    assert result.dropped == [(trace.trace_id, "stale")]
    assert build_rows(trace).rows  # no filter asked for: kept

    unknown = rollout(THREE_TURNS)
    result = build_rows(unknown, max_staleness=2, current_policy_version=6)
    assert result.dropped == [(unknown.trace_id, "unknown_policy_version")]
    unknown.policy_version = "6"  # the trace's version stands in for the calls'
    assert build_rows(unknown, max_staleness=0, current_policy_version=6).rows

    with pytest.raises(ValueError, match="current_policy_version"):
        build_rows(trace, max_staleness=1)


# --- many traces: advantages, summary, export ----------------------------------------------


def batch() -> list[Trace]:
    traces = [rollout(THREE_TURNS, reward=r, group_id="g1") for r in (1.0, 0.0, 1.0)]
    split = rollout(REASONING_TURNS, template=stripping_template(True), reward=0.5, group_id="g2")
    other = rollout(THREE_TURNS[:2], reward=0.0, group_id="g2")
    failed = rollout(THREE_TURNS, status=TraceStatus.FAILED, reward=None)
    return [*traces, split, other, failed]


def test_group_advantages_count_each_rollout_once() -> None:
    traces = batch()
    built = build_all(traces)
    rows = assign_advantages(built.rows)
    by_trace = {t.trace_id: t for t in traces}
    want_g1 = group_advantages([1.0, 0.0, 1.0])
    assert [r.advantage for r in rows[:3]] == pytest.approx(want_g1)
    # The split rollout's two fragments share one advantage; its group has two rollouts.
    want_g2 = group_advantages([0.5, 0.0])
    split_rows = [r for r in rows if by_trace[r.trace_id].reward == 0.5]
    assert len(split_rows) == 2
    assert [r.advantage for r in split_rows] == pytest.approx([want_g2[0]] * 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_reward_is_unscored_and_labelled_not_a_crash(bad: float) -> None:
    """A NaN reward used to reach statistics.stdev and crash assign_advantages
    ("'float' object has no attribute 'numerator'"); infinity made others' NaN."""
    scored = [rollout(THREE_TURNS, reward=r) for r in (1.0, 0.0, 1.0)]
    poisoned = rollout(THREE_TURNS, reward=bad, step_rewards=[bad, 0.25])
    built = build_all([*scored, poisoned])
    rows = assign_advantages(built.rows)
    assert rows[3].reward is None
    assert "non_finite_reward" in rows[3].labels
    assert rows[3].step_rewards == [(rows[3].spans[1][1] - 1, 0.25)]  # the finite one
    assert built.counts["non_finite_reward"] == 2  # the run's reward and one step's
    assert [r.advantage for r in rows] == pytest.approx([*group_advantages([1.0, 0.0, 1.0]), None])
    # Rows that carry one anyway (made by hand) are unscored by the advantages too.
    by_hand = [r.model_copy(update={"reward": bad}) if i == 3 else r for i, r in enumerate(rows)]
    assert [r.advantage for r in assign_advantages(by_hand)][3] is None


def test_summary_counts_every_label() -> None:
    built = build_all(batch())
    counts = summarise([built])
    assert counts["traces"] == 6
    assert counts["rows"] == 6
    assert counts["failed_rollout"] == 1
    assert counts["template_rewrote_history"] == 1
    assert list(counts)[:3] == ["traces", "rows", "calls"]
    out = io.StringIO()
    Console(file=out, width=120).print(summary_table(counts))
    text = out.getvalue()
    assert "template_rewrote_history" in text
    assert "failed_rollout" in text


def test_export_round_trips_and_shapes(tmp_path: Path) -> None:
    traces = batch()
    traces[0].model_calls[0].policy_version = 7
    rows = assign_advantages(build_all(traces).rows)
    assert write_rows_jsonl(rows, tmp_path / "rows.jsonl") == len(rows)
    assert list(read_rows_jsonl(tmp_path / "rows.jsonl")) == rows
    assert write_rows_parquet(rows, tmp_path / "rows.parquet") == len(rows)
    assert list(read_rows_parquet(tmp_path / "rows.parquet")) == rows

    row = rows[3]
    prime = to_record(row, "prime-rl")
    assert set(prime) == {
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "completion_logprobs",
        "completion_temperatures",
        "env_name",
        "advantage",
        "reward",
    }
    assert prime["completion_mask"] == [bool(m) for m in row.mask]
    assert prime["completion_temperatures"] == [0.7] * len(row.completion_ids)
    assert not any(prime["prompt_mask"])
    art = to_record(row, "art")
    assert art["token_ids"] == row.prompt_ids + row.completion_ids
    assert art["prompt_length"] == len(row.prompt_ids)
    sampled_lps = [lp for lp, m in zip(art["logprobs"], art["assistant_mask"], strict=True) if m]
    assert sampled_lps == row.sampled_logprobs
    for shape in ("prime-rl", "art"):
        path = tmp_path / f"{shape}.parquet"
        assert write_rows_parquet(rows, path, shape=shape) == len(rows)
        write_rows_jsonl(rows, tmp_path / f"{shape}.jsonl", shape=shape)

    no_lps = row.model_copy(update={"logprobs": None})
    with pytest.raises(ValueError, match="completion_logprobs"):
        to_record(no_lps, "prime-rl")


# --- end to end: rows against the model server's own record ---------------------------------


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    from envport.policy import create_policy_app
    from envport.serving import serve_in_thread

    with serve_in_thread(create_policy_app()) as url:
        yield url + "/v1"


async def test_real_multi_turn_eval_rows_match_the_server(model_url: str, tmp_path: Path) -> None:
    from envport.evaluate import EvalConfig, Evaluator
    from envport.harness import AgentConfig, ChatModel
    from envport.tasks import load
    from envport.trace import AsyncTraceStore, SQLiteTraceStore

    tasks = list(load("builtin:guess-number").head(4))
    model = ChatModel(model_url, "scripted")
    try:
        async with AsyncTraceStore(SQLiteTraceStore(tmp_path / "t.db")) as store:
            evaluator = Evaluator(model, store, EvalConfig(agent=AgentConfig(max_turns=12)))
            summary = await evaluator.run(tasks, run_id="rows")
            traces = await store.query(run_id=summary.run_id)
    finally:
        await model.aclose()
    assert summary.failed == 0
    multi_turn = 0
    for trace in traces:
        result = build_rows(trace, tokenizer=TOK)
        (row,) = result.rows  # the template keeps the prefix property: one merged row
        assert result.dropped == []
        calls = trace.model_calls
        multi_turn += len(calls) > 1
        assert row.num_turns == len(calls)
        # The server's own record: the raw response bodies the gateway kept.
        served = [c.response["choices"][0] for c in calls if c.response]
        assert len(served) == len(calls)
        assert row.sampled_ids == [t for s in served for t in s["token_ids"]]
        assert row.sampled_logprobs == [
            item["logprob"] for s in served for item in s["logprobs"]["content"]
        ]
        assert row.prompt_ids == calls[0].response["prompt_token_ids"]  # type: ignore[index]
        last = calls[-1].response or {}
        assert row.prompt_ids + row.completion_ids == (
            last["prompt_token_ids"] + last["choices"][0]["token_ids"]
        )
        steps = [s for s in trace.steps if s.reward is not None]
        assert len(row.step_rewards) == len(steps)
        assert all(row.mask[i] == 1 for i, _ in row.step_rewards)
        assert row.reward == trace.reward == 1.0
    assert multi_turn >= 3


def test_exports_follow_the_choice_taken_and_count_greedy_calls_at_temperature_one() -> None:
    """ART's turn carries the finish reason of the choice the rollout went on with (not
    choice 0's), and prime-rl's per-token temperature of a greedy call is 1.0, as
    envport's own trainer takes it (a trainer divides the logits by it)."""
    from envport.train import art_trajectory_groups, to_record

    trace = rollout(THREE_TURNS)
    _, c1, c2 = trace.model_calls
    c1.sampling = SamplingParams(temperature=0.0)
    continued_with_choice_1(c2)
    (row,) = build_rows(trace).rows
    temps = to_record(row, "prime-rl")["completion_temperatures"]
    assert len(temps) == len(row.completion_ids)
    (lo, hi) = row.spans[1]
    assert temps[lo:hi] == [1.0] * (hi - lo)
    assert temps[: row.spans[0][1]] == [0.7] * row.spans[0][1]
    (group,) = art_trajectory_groups([trace])
    (trajectory,) = group["trajectories"]
    turns = [m for m in trajectory["messages_and_choices"] if "finish_reason" in m]
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "tool_calls", "stop"]
