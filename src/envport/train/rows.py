"""Token-exact training rows from traces: token in, token out.

A :class:`TrainingRow` is what a trainer consumes: ``prompt_ids`` and, after them,
``completion_ids`` with a ``mask`` (1 = sampled by the policy, 0 = environment, tool
or template tokens the policy did not sample) and the sampler's ``logprobs`` aligned
one to one. Nothing is re-tokenized: every id comes from a :class:`ModelCall` as the
model server returned it.

**Merging.** The model calls of one rollout merge into a single row while each call's
``prompt_token_ids`` start exactly with the row so far (the previous prompt + everything
after it). The ids the new prompt adds beyond that (a tool result, the next turn's
header) become mask-0 completion tokens; the call's own completion follows with mask 1.
This holds for a chat template with the prefix property (see
:mod:`envport.policy.tokenizer`) when the client echoes history unchanged. Of a call
with several choices (``n > 1``) the row takes the one the rollout went on with: the one
the next call's prompt continues, else the one whose message is on the conversation's
last branch, else choice 0; the others are counted as ``unused_choices``. A row ends on
its last sampled token: a last call that sampled nothing leaves the row, and so do the
ids its prompt added.

**Splits are labelled, never silent.** When a call cannot extend the row, the row ends
and the next usable call starts a fresh row (a *fragment*). Each fragment's
``split_reason`` says why (for the first fragment: why it ended; for the others: why
they began). The labels:

``template_rewrote_history``
    the new prompt changes the history's *text*: it diverges inside the previous
    prompt, or (with a ``tokenizer``) its text no longer starts with the row's text,
    e.g. a template that strips earlier reasoning.
``retokenization_drift``
    the same text came back as different token ids (with a ``tokenizer``: the texts
    agree), or, without a tokenizer, the divergence lies in the previous completion or
    at its boundary. Telling drift from a rewrite inside the last completion needs the
    ``tokenizer``; without one the position decides.
``truncated``
    a call finished with ``finish_reason == "length"`` (its tokens are kept; the row
    ends there), or a row longer than ``max_length`` was cut (``truncated_by`` in the
    metadata tells which).
``missing_token_ids``
    a call lacks prompt or completion ids (or has no choice): it cannot be used.
``logprob_mismatch``
    a call's logprobs and completion ids differ in length: the call is not used,
    rather than guessing which logprob belongs to which token.

Not a split: ``retried_prompt``, a call whose prompt is a strict prefix of the row so
far (the harness re-sent an earlier prompt: a retry, or a branch from an earlier
point). The replies after that point were abandoned: each is dropped (``dropped``
lists it with this reason), the row is cut back to the calls before it and goes on
with the new call, and the row is labelled ``retried_prompt``. Nothing the policy's
later turns did not build on is trained on, and the rollout stays one row.

Whole traces and rows are dropped with a reason: ``failed_rollout`` (status is not
``completed``: failed, cancelled, or still pending/running), ``no_model_calls``,
``no_usable_calls`` (every call was unusable), ``no_sampled_tokens`` (a row whose calls
sampled nothing, e.g. an empty completion), ``over_max_length`` (nothing sampled
survives the cut), ``stale`` (the row's oldest call is more than ``max_staleness``
policy versions behind), ``unknown_policy_version`` (a staleness filter was asked
for, but the row's version is unknown). Counts of every label land in
:attr:`RowsResult.counts`; :func:`summarise` adds them up over many traces.

**Rewards.** ``reward`` is the run's reward (``Trace.reward``), meant for the last
completion token (:attr:`TrainingRow.reward_index`); every fragment of a rollout
carries it, because it scores the whole rollout. A NaN or infinite reward makes the row
unscored (``reward`` None, labelled ``non_finite_reward``; a step's is left out).
``step_rewards`` places each :class:`StepRecord` reward on the last sampled token of the
model call that caused the step (found through the tool call id, else the timing, else
``step_index``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from envport.trace.model import Choice, ModelCall, Trace, TraceStatus

# --- labels -----------------------------------------------------------------------------

TEMPLATE_REWROTE_HISTORY: Final = "template_rewrote_history"
RETOKENIZATION_DRIFT: Final = "retokenization_drift"
TRUNCATED: Final = "truncated"
MISSING_TOKEN_IDS: Final = "missing_token_ids"
LOGPROB_MISMATCH: Final = "logprob_mismatch"
FAILED_ROLLOUT: Final = "failed_rollout"
NO_MODEL_CALLS: Final = "no_model_calls"
NO_USABLE_CALLS: Final = "no_usable_calls"
OVER_MAX_LENGTH: Final = "over_max_length"
STALE: Final = "stale"
UNKNOWN_POLICY_VERSION: Final = "unknown_policy_version"
NO_SAMPLED_TOKENS: Final = "no_sampled_tokens"
#: A call re-sent a prompt that is a strict prefix of the row so far (a retry, or a
#: branch from an earlier point): the replies after that point were abandoned. They are
#: dropped (each listed with this reason) and the row goes on from the branch point; the
#: row is labelled with it.
RETRIED_PROMPT: Final = "retried_prompt"
#: Informational labels (no data lost): a call without logprobs (the row's logprobs
#: become ``None``), extra choices of an ``n > 1`` call, a step reward with no call.
MISSING_LOGPROBS: Final = "missing_logprobs"
UNUSED_CHOICES: Final = "unused_choices"
UNPLACED_STEP_REWARD: Final = "unplaced_step_reward"
#: A NaN or infinite reward (the run's or a step's): the row is kept as unscored
#: (``reward`` None) or the step reward is left out, rather than poisoning advantages.
NON_FINITE_REWARD: Final = "non_finite_reward"

SPLIT_REASONS: Final = (
    TEMPLATE_REWROTE_HISTORY,
    RETOKENIZATION_DRIFT,
    TRUNCATED,
    MISSING_TOKEN_IDS,
    LOGPROB_MISMATCH,
)
DROP_REASONS: Final = (
    FAILED_ROLLOUT,
    NO_MODEL_CALLS,
    NO_USABLE_CALLS,
    OVER_MAX_LENGTH,
    STALE,
    UNKNOWN_POLICY_VERSION,
    NO_SAMPLED_TOKENS,
    RETRIED_PROMPT,
    MISSING_TOKEN_IDS,
    LOGPROB_MISMATCH,
)


class Decoder(Protocol):
    """Anything that turns token ids back into text (a Hugging Face tokenizer, ByteTokenizer)."""

    def decode(self, ids: list[int], /) -> str: ...


# --- the row ----------------------------------------------------------------------------


class TrainingRow(BaseModel):
    """One training sequence: a prompt, then completion tokens with a loss mask."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    prompt_ids: list[int]
    completion_ids: list[int] = Field(
        description="Everything after the prompt: sampled tokens and the env/tool/template "
        "tokens between turns."
    )
    mask: list[int] = Field(description="1 = sampled by the policy, 0 = not; per completion id.")
    logprobs: list[float] | None = Field(
        description="Sampler logprob per completion id (0.0 where mask is 0); None when a "
        "merged call recorded none."
    )
    reward: float | None = Field(description="The run's reward, for the last completion token.")
    step_rewards: list[tuple[int, float]] = Field(
        default_factory=list,
        description="(completion index, reward): each step's reward on the last sampled token "
        "of the call that caused it. Several at one index add up.",
    )
    advantage: float | None = Field(default=None, description="Set by assign_advantages().")
    group_id: str | None = None
    trace_id: str
    rollout_id: str
    policy_versions: list[int | str | None] = Field(description="Per merged call, in order.")
    num_turns: int = Field(ge=0, description="Model calls merged into this row.")
    call_ids: list[str] = Field(default_factory=list)
    spans: list[tuple[int, int]] = Field(
        default_factory=list,
        description="Per merged call: [start, end) of its sampled tokens in completion_ids.",
    )
    temperatures: list[float | None] = Field(
        default_factory=list, description="Per merged call: the sampling temperature sent."
    )
    split_reason: str | None = Field(
        default=None, description="Why this row is a fragment of its rollout; None if whole."
    )
    fragment: int = Field(default=0, ge=0, description="Index among the rollout's rows.")
    num_fragments: int = Field(default=1, ge=1)
    truncated: bool = False
    labels: list[str] = Field(default_factory=list, description="Every label that applies.")
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> TrainingRow:
        n = len(self.completion_ids)
        if len(self.mask) != n:
            raise ValueError(f"mask has {len(self.mask)} entries for {n} completion ids")
        if any(m not in (0, 1) for m in self.mask):
            raise ValueError("mask entries must be 0 or 1")
        if self.logprobs is not None and len(self.logprobs) != n:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {n} completion ids")
        for index, _ in self.step_rewards:
            if not 0 <= index < n:
                raise ValueError(f"step reward index {index} is outside the completion (0..{n})")
        return self

    @property
    def reward_index(self) -> int:
        """Completion index the run's reward belongs on: the last token."""
        return len(self.completion_ids) - 1

    @property
    def sampled_ids(self) -> list[int]:
        """The mask-1 tokens, in order: exactly what the policy sampled."""
        return [t for t, m in zip(self.completion_ids, self.mask, strict=True) if m]

    @property
    def sampled_logprobs(self) -> list[float] | None:
        if self.logprobs is None:
            return None
        return [lp for lp, m in zip(self.logprobs, self.mask, strict=True) if m]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def token_rewards(self, *, run: bool = True, steps: bool = True) -> list[float]:
        """A dense reward per completion token: the run's reward on the last token and/or
        each step reward on its token; 0.0 elsewhere."""
        out = [0.0] * len(self.completion_ids)
        if steps:
            for index, value in self.step_rewards:
                out[index] += value
        if run and self.reward is not None and out:
            out[-1] += self.reward
        return out


@dataclass
class RowsResult:
    """What :func:`build_rows` made of one trace."""

    rows: list[TrainingRow] = field(default_factory=list)
    #: ``(trace_id, reason)`` for each thing that did not become training data: a whole
    #: trace, a row, or one unusable model call.
    dropped: list[tuple[str, str]] = field(default_factory=list)
    #: Occurrences per label, plus ``traces``, ``rows`` and ``calls`` (calls in rows).
    counts: Counter[str] = field(default_factory=Counter)


# --- building ---------------------------------------------------------------------------


@dataclass
class _Open:
    """A row being built."""

    prompt_ids: list[int]
    split_reason: str | None
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    calls: list[ModelCall] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)  # of each call's choice
    spans: list[tuple[int, int]] = field(default_factory=list)
    last_prompt_len: int = 0
    ended_by: str | None = None  # why the rollout's next call is not in this row
    truncated: bool = False
    retried: bool = False  # replies were abandoned by a retry (RETRIED_PROMPT)

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add(self, call: ModelCall, gap: list[int], choice: Choice) -> None:
        ids = choice.completion_token_ids or []
        lps: Sequence[float | None] = choice.completion_logprobs or [None] * len(ids)
        self.completion_ids += gap
        self.mask += [0] * len(gap)
        self.logprobs += [0.0] * len(gap)
        start = len(self.completion_ids)
        self.completion_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(lps)
        self.spans.append((start, len(self.completion_ids)))
        self.calls.append(call)
        self.finish_reasons.append(choice.finish_reason)
        self.last_prompt_len = len(call.prompt_token_ids or [])

    def rewind(self, length: int) -> list[ModelCall]:
        """Cut the row back to the calls whose sampled tokens all lie within its first
        ``length`` ids (prompt included); the calls cut off are returned."""
        keep = 0
        while keep < len(self.spans) and len(self.prompt_ids) + self.spans[keep][1] <= length:
            keep += 1
        abandoned = self.calls[keep:]
        end = self.spans[keep - 1][1] if keep else 0
        del self.completion_ids[end:], self.mask[end:], self.logprobs[end:]
        del self.calls[keep:], self.spans[keep:], self.finish_reasons[keep:]
        if self.calls:
            self.last_prompt_len = len(self.calls[-1].prompt_token_ids or [])
        self.retried = True
        return abandoned

    def trim(self) -> None:
        """Drop the mask-0 ids after the last sampled one: a row ends on a sampled token,
        where its reward goes. An empty last completion leaves its prompt's new ids (a
        tool result, the next turn's header) there, which nothing samples or follows;
        that call, which added nothing to train on, leaves the row with them."""
        end = len(self.mask)
        while end and not self.mask[end - 1]:
            end -= 1
        if end in (0, len(self.mask)):  # nothing sampled (dropped later), or nothing to drop
            return
        del self.completion_ids[end:], self.mask[end:], self.logprobs[end:]
        keep = sum(1 for start, _ in self.spans if start <= end)
        del self.calls[keep:], self.spans[keep:], self.finish_reasons[keep:]


def _continued(trace: Trace) -> dict[str, Choice]:
    """``call id -> the choice the rollout went on with``, for every call with a choice.

    A call with one choice gives it. Of several (``n > 1``: the harness picked one), it
    is the one whose tokens the next call's prompt continues (that prompt starts with
    this call's prompt and the choice's ids; the longest such choice), else the one
    whose message is on the conversation's last branch, else choice 0.
    """
    calls = [c for c in trace.model_calls if c.choices]
    on_path: set[str] | None = None  # the last branch's messages, found when needed
    out: dict[str, Choice] = {}
    for i, call in enumerate(calls):
        out[call.id] = call.choices[0]
        if len(call.choices) == 1:
            continue
        prompt = call.prompt_token_ids or []
        after = next((c.prompt_token_ids for c in calls[i + 1 :] if c.prompt_token_ids), None)
        if prompt and after:
            extends = [
                c
                for c in call.choices
                if c.completion_token_ids is not None
                and after[: len(prompt) + len(c.completion_token_ids)]
                == prompt + c.completion_token_ids
            ]
            if extends:
                out[call.id] = max(extends, key=lambda c: len(c.completion_token_ids or ()))
                continue
        if on_path is None:
            leaves = trace.leaves()
            on_path = {m.id for m in trace.path(leaves[-1].id)} if leaves else set()
        kept = next((c for c in call.choices if c.message_id and c.message_id in on_path), None)
        if kept is not None:
            out[call.id] = kept
    return out


def _usable(call: ModelCall, choice: Choice | None) -> tuple[Choice | None, str | None]:
    """``choice`` (the one the rollout went on with) if it can be trained on, else the
    reason it cannot."""
    if choice is None or not call.prompt_token_ids:
        return None, MISSING_TOKEN_IDS
    if choice.completion_token_ids is None:
        return None, MISSING_TOKEN_IDS
    lps = choice.completion_logprobs
    if lps is not None and len(lps) != len(choice.completion_token_ids):
        return None, LOGPROB_MISMATCH
    return choice, None


def _divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """First index where ``a`` and ``b`` differ (the shorter length if one prefixes the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _classify(row: _Open, prompt: list[int], tokenizer: Decoder | None) -> str:
    """Why ``prompt`` does not extend ``row``: a rewritten history or re-tokenization."""
    sequence = row.sequence
    if tokenizer is not None:
        if tokenizer.decode(list(prompt)).startswith(tokenizer.decode(sequence)):
            return RETOKENIZATION_DRIFT
        return TEMPLATE_REWROTE_HISTORY
    if _divergence(sequence, prompt) < row.last_prompt_len:
        return TEMPLATE_REWROTE_HISTORY
    return RETOKENIZATION_DRIFT


def _as_int(version: int | str | None) -> int | None:
    if isinstance(version, int):
        return version
    if isinstance(version, str):
        try:
            return int(version)
        except ValueError:
            return None
    return None


def _step_calls(trace: Trace) -> dict[int, str]:
    """``step index -> model call id`` for every step with a reward whose call is known."""
    by_tool_call: dict[str, str] = {}
    message_call = {m.id: m.model_call_id for m in trace.messages if m.model_call_id}
    for call in trace.model_calls:
        for choice in call.choices:
            if choice.message_id:
                message_call.setdefault(choice.message_id, call.id)
    for message in trace.messages:
        owner = message_call.get(message.id)
        if owner:
            for tc in message.tool_calls:
                by_tool_call[tc.id] = owner
    out: dict[int, str] = {}
    for step in trace.steps:
        if step.reward is None:
            continue
        owner = by_tool_call.get(step.tool_call_id) if step.tool_call_id else None
        if owner is None and step.started_at is not None:
            at = step.started_at
            before = [
                (c.started_at, c.id)
                for c in trace.model_calls
                if c.started_at and c.started_at <= at
            ]
            if before:
                owner = max(before)[1]
        if owner is None:
            owner = next((c.id for c in trace.model_calls if c.step_index == step.index), None)
        if owner is not None:
            out[step.index] = owner
    return out


def build_rows(
    trace: Trace,
    *,
    max_length: int | None = None,
    max_staleness: int | None = None,
    current_policy_version: int | None = None,
    tokenizer: Decoder | None = None,
) -> RowsResult:
    """Training rows of one trace, with everything not used dropped and labelled.

    ``max_length`` caps ``len(prompt_ids) + len(completion_ids)``: a longer row is cut
    (labelled ``truncated``) or, if nothing sampled would survive, dropped
    (``over_max_length``). ``max_staleness`` (with ``current_policy_version``) drops
    rows whose oldest call's policy version is more than that many versions behind.
    ``tokenizer`` (anything with ``decode``) lets a prefix break be classified by text:
    same text means ``retokenization_drift``, changed text ``template_rewrote_history``.
    """
    if max_staleness is not None and current_policy_version is None:
        raise ValueError("max_staleness needs current_policy_version (the trainer's version)")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    result = RowsResult()
    result.counts["traces"] += 1
    tid = trace.trace_id
    if trace.status is not TraceStatus.COMPLETED:
        result.dropped.append((tid, FAILED_ROLLOUT))
        result.counts[FAILED_ROLLOUT] += 1
        return result
    if not trace.model_calls:
        result.dropped.append((tid, NO_MODEL_CALLS))
        result.counts[NO_MODEL_CALLS] += 1
        return result

    fragments: list[_Open] = []
    current: _Open | None = None
    pending: str | None = None  # why the next fragment starts
    retried = False  # the next fragment replaces one a retry abandoned whole
    continued = _continued(trace)
    for call in trace.model_calls:
        if call.error is not None and not call.choices:
            continue  # a call that failed (its error is recorded): nothing was generated
        choice, problem = _usable(call, continued.get(call.id))
        if choice is None:
            assert problem is not None
            result.dropped.append((tid, problem))
            result.counts[problem] += 1
            if current is not None:
                current.ended_by = current.ended_by or problem
                current = None
            pending = pending or problem
            continue
        if len(call.choices) > 1:
            result.counts[UNUSED_CHOICES] += len(call.choices) - 1
        prompt = list(call.prompt_token_ids or [])
        if current is not None:
            sequence = current.sequence
            if prompt[: len(sequence)] == sequence:
                current.add(call, prompt[len(sequence) :], choice)
            elif len(prompt) < len(sequence) and sequence[: len(prompt)] == prompt:
                # A retry or a branch: the replies past the prompt were abandoned.
                for _ in current.rewind(len(prompt)):
                    result.dropped.append((tid, RETRIED_PROMPT))
                    result.counts[RETRIED_PROMPT] += 1
                if current.calls:
                    current.add(call, prompt[len(current.sequence) :], choice)
                else:  # nothing of the row is left: the new call starts it again
                    fragments.remove(current)
                    pending, retried = current.split_reason, True
                    current = None
            else:
                reason = _classify(current, prompt, tokenizer)
                result.counts[reason] += 1
                current.ended_by = reason
                current = None
                pending = reason
        if current is None:
            current = _Open(prompt_ids=prompt, split_reason=pending, retried=retried)
            pending, retried = None, False
            current.add(call, [], choice)
            fragments.append(current)
        if choice.finish_reason == "length":
            result.counts[TRUNCATED] += 1
            current.truncated = True
            current.ended_by = TRUNCATED
            current = None
            pending = TRUNCATED
    last = fragments[-1] if fragments else None
    generated = [c for c in trace.model_calls if c.choices]  # failed calls made nothing
    if last is not None and generated and last.calls[-1] is generated[-1] and last.truncated:
        last.ended_by = None  # the truncated call was the rollout's last: nothing split off

    if not fragments:
        result.dropped.append((tid, NO_USABLE_CALLS))
        result.counts[NO_USABLE_CALLS] += 1
        return result

    if trace.reward is not None and not math.isfinite(trace.reward):
        result.counts[NON_FINITE_REWARD] += 1
    rows = [_finish(trace, f, i, len(fragments)) for i, f in enumerate(fragments)]
    _place_step_rewards(trace, rows, result)
    for row in rows:
        if not any(row.mask):  # e.g. an empty completion: nothing to train, no reward spot
            result.dropped.append((tid, NO_SAMPLED_TOKENS))
            result.counts[NO_SAMPLED_TOKENS] += 1
            continue
        kept = _filter(row, result, max_length, max_staleness, current_policy_version, trace)
        if kept is not None:
            result.rows.append(kept)
            result.counts["rows"] += 1
            result.counts["calls"] += kept.num_turns
            if kept.logprobs is None:
                result.counts[MISSING_LOGPROBS] += 1
    return result


def _finish(trace: Trace, f: _Open, index: int, total: int) -> TrainingRow:
    f.trim()
    # A fragment is labelled with why it began and why it ended; the first one's
    # split_reason is why it ended (a lost tail makes even a lone row a fragment).
    split_reason = f.split_reason if index > 0 else f.ended_by
    labels = list(dict.fromkeys(r for r in (f.split_reason, f.ended_by) if r is not None))
    if f.truncated and TRUNCATED not in labels:
        labels.append(TRUNCATED)
    if f.retried:
        labels.append(RETRIED_PROMPT)
    truncated = f.truncated
    logprobs: list[float] | None = None
    if all(lp is not None for lp in f.logprobs):
        logprobs = [lp for lp in f.logprobs if lp is not None]
    else:
        labels.append(MISSING_LOGPROBS)
    reward = trace.reward
    if reward is not None and not math.isfinite(reward):
        labels.append(NON_FINITE_REWARD)
        reward = None
    metadata: dict[str, Any] = {
        "task_id": trace.task_id,
        "run_id": trace.run_id,
        "env_id": trace.env_id,
        "attempt": trace.attempt,
        "finish_reasons": list(f.finish_reasons),
    }
    if truncated:
        metadata["truncated_by"] = "finish_reason_length"
    return TrainingRow(
        prompt_ids=f.prompt_ids,
        completion_ids=f.completion_ids,
        mask=f.mask,
        logprobs=logprobs,
        reward=reward,
        group_id=trace.group_id,
        trace_id=trace.trace_id,
        rollout_id=trace.rollout_id,
        policy_versions=[
            c.policy_version if c.policy_version is not None else trace.policy_version
            for c in f.calls
        ],
        num_turns=len(f.calls),
        call_ids=[c.id for c in f.calls],
        spans=f.spans,
        temperatures=[c.sampling.temperature for c in f.calls],
        split_reason=split_reason,
        fragment=index,
        num_fragments=total,
        truncated=truncated,
        labels=labels,
        metadata=metadata,
    )


def _place_step_rewards(trace: Trace, rows: list[TrainingRow], result: RowsResult) -> None:
    where: dict[str, tuple[TrainingRow, int]] = {}
    for row in rows:
        for call_id, (start, end) in zip(row.call_ids, row.spans, strict=True):
            where[call_id] = (row, max(end - 1, start - 1, 0))
    owners = _step_calls(trace)
    for step in sorted(trace.steps, key=lambda s: s.index):
        if step.reward is None:
            continue
        if not math.isfinite(step.reward):
            result.counts[NON_FINITE_REWARD] += 1
            continue
        owner = owners.get(step.index)
        spot = where.get(owner) if owner is not None else None
        if spot is None or not spot[0].completion_ids:
            result.counts[UNPLACED_STEP_REWARD] += 1
            continue
        spot[0].step_rewards.append((spot[1], float(step.reward)))


def _filter(
    row: TrainingRow,
    result: RowsResult,
    max_length: int | None,
    max_staleness: int | None,
    current: int | None,
    trace: Trace,
) -> TrainingRow | None:
    tid = row.trace_id
    if max_staleness is not None and current is not None:
        versions = [_as_int(v) for v in row.policy_versions]
        known = [v for v in versions if v is not None]
        if not known or len(known) != len(versions):
            result.dropped.append((tid, UNKNOWN_POLICY_VERSION))
            result.counts[UNKNOWN_POLICY_VERSION] += 1
            return None
        if current - min(known) > max_staleness:
            result.dropped.append((tid, STALE))
            result.counts[STALE] += 1
            return None
    if max_length is not None and len(row) > max_length:
        cut = _cut(row, max_length)
        if cut is None:
            result.dropped.append((tid, OVER_MAX_LENGTH))
            result.counts[OVER_MAX_LENGTH] += 1
            return None
        result.counts[TRUNCATED] += 1
        return cut
    return row


def _cut(row: TrainingRow, max_length: int) -> TrainingRow | None:
    """``row`` cut to ``max_length`` tokens, ending on a sampled token; None if none is left."""
    keep = max_length - len(row.prompt_ids)
    mask = row.mask[: max(keep, 0)]
    while mask and not mask[-1]:
        mask.pop()
    keep = len(mask)
    if not any(mask):
        return None
    spans = [(s, min(e, keep)) for s, e in row.spans if s < keep]
    n = len(spans)
    labels = row.labels if TRUNCATED in row.labels else [*row.labels, TRUNCATED]
    return row.model_copy(
        update={
            "completion_ids": row.completion_ids[:keep],
            "mask": mask,
            "logprobs": None if row.logprobs is None else row.logprobs[:keep],
            "step_rewards": [(i, r) for i, r in row.step_rewards if i < keep],
            "spans": spans,
            "call_ids": row.call_ids[:n],
            "policy_versions": row.policy_versions[:n],
            "temperatures": row.temperatures[:n],
            "num_turns": n,
            "truncated": True,
            "labels": labels,
            "metadata": {
                **row.metadata,
                "truncated_by": "max_length",
                "finish_reasons": row.metadata.get("finish_reasons", [])[:n],
            },
        }
    )


# --- many traces ------------------------------------------------------------------------


def build_all(
    traces: Iterable[Trace],
    *,
    max_length: int | None = None,
    max_staleness: int | None = None,
    current_policy_version: int | None = None,
    tokenizer: Decoder | None = None,
) -> RowsResult:
    """:func:`build_rows` over many traces, merged into one result."""
    out = RowsResult()
    for trace in traces:
        one = build_rows(
            trace,
            max_length=max_length,
            max_staleness=max_staleness,
            current_policy_version=current_policy_version,
            tokenizer=tokenizer,
        )
        out.rows += one.rows
        out.dropped += one.dropped
        out.counts.update(one.counts)
    return out


def summarise(results: Iterable[RowsResult]) -> dict[str, int]:
    """Counts by label over ``results``, plus ``traces``, ``rows`` and ``calls``."""
    total: Counter[str] = Counter()
    for result in results:
        total.update(result.counts)
    head = [k for k in ("traces", "rows", "calls") if k in total]
    rest = sorted(k for k in total if k not in head)
    return {k: total[k] for k in [*head, *rest]}


_KIND = {
    **{r: "split" for r in SPLIT_REASONS},
    **{r: "dropped" for r in DROP_REASONS if r not in SPLIT_REASONS},
    MISSING_LOGPROBS: "note",
    UNUSED_CHOICES: "note",
    UNPLACED_STEP_REWARD: "note",
    NON_FINITE_REWARD: "note",
}


def summary_table(counts: dict[str, int], *, title: str = "training rows") -> Any:
    """A rich ``Table`` of :func:`summarise`'s counts: label, what it means, count."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("label")
    table.add_column("kind")
    table.add_column("count", justify="right")
    for label, n in counts.items():
        table.add_row(label, _KIND.get(label, "total"), str(n))
    return table
