"""The trace: the full record of one attempt at one task.

One versioned pydantic model, :class:`Trace`, whose JSON Schema is published at
``docs/trace.schema.json``. Its parts, and who writes them:

* **identity** — ``trace_id`` (this record), ``run_id`` (the experiment), ``task_id`` /
  ``task_hash`` / ``taskset`` (what was attempted), ``rollout_id`` + ``attempt`` (one
  rollout may take several attempts; the store keeps the last one's trace, with the
  earlier attempts' errors in ``metadata["previous_attempts"]``), ``group_id``
  (rollouts of one prompt compared together, as in GRPO), ``env_id``, ``policy_version``.
* **messages** — a graph, not a list: every :class:`Message` names its ``parent_id``, so
  branches (several continuations of one prefix) and forks (a trace continued from a
  point in another, see :class:`ForkRef`) fit without copying. ``Trace.path(leaf)``
  gives the linear conversation that led to a message.
* **model_calls** — every call to the model, as the gateway saw it: model, endpoint,
  sampling parameters, request as sent, response as received (all choices), the
  request before a policy rewrote it, usage, latency, TTFT, retries, and the token ids
  and logprobs that training needs (:class:`ModelCall`, :class:`Choice`).
* **steps** — every environment step or tool execution (:class:`StepRecord`) with its
  index, action, observation, per-step reward and terminated/truncated flags.
* **scoring** — named, weighted :class:`Reward` values, their ``reward`` total and
  free-form numeric ``metrics``.
* **failure** — classified :class:`TraceError` records (a failed rollout is data, not a
  crash), the ``status`` and the ``stop_reason``.
* **timings** — seconds spent per stage (``"setup"``, ``"rollout"``, ``"scoring"`` …).

Logprobs may be ``-inf``; JSON has no infinities, so they serialise as the strings
``"-Infinity"``/``"Infinity"``/``"NaN"`` and parse back to floats. Every float field of
the model is typed so (:data:`JSONFloat`, :data:`JSONSeconds`), and the published schema
accepts those strings there. Serialise with ``model_dump_json`` (or
:meth:`Trace.to_json`), not ``json.dumps(model_dump())``.

Free-form JSON fields (``metadata``, ``info``, a step's ``action`` and ``observation``, a
model call's ``request`` and ``response``, tool ``arguments``, a run's ``config``) have no
float type to restore: a non-finite float in them is written as the same string and
reads back as that string (``float("nan")`` in ``metadata`` comes back as ``"NaN"``).
Traces are never refused for it (a failed rollout's data is kept), and what was stored
stays readable; put a non-finite number that must stay a number in ``metrics``.

Text that is not valid Unicode (a lone surrogate, as ``os.fsdecode`` or
``errors="surrogateescape"`` makes of bytes that are not UTF-8: a file name an
environment listed, say) cannot be JSON. :meth:`Trace.to_json`, which the store and the
exports use, writes each such code point as U+FFFD rather than refuse the trace.
"""

from __future__ import annotations

import re
import traceback as tb
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticSerializationError

#: Version of the trace format this code writes. Bump it on any incompatible change
#: and teach :meth:`Trace.model_validate` (via ``_upgrade``) to read the old one.
SCHEMA_VERSION = 1


#: A float that may be infinite or NaN (a logprob of ``-inf``, a NaN metric). JSON has no
#: such numbers, so they travel as the strings below; the published schema says so.
JSONFloat = Annotated[
    float,
    WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": ["-Infinity", "Infinity", "NaN"]}]}),
]


#: Seconds (a latency): ``>= 0``, possibly infinite, which travels as ``"Infinity"``.
JSONSeconds = Annotated[
    float,
    Field(ge=0),
    WithJsonSchema({"anyOf": [{"type": "number", "minimum": 0}, {"const": "Infinity"}]}),
]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _scrub_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (dict keys too) made U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_scrub_surrogates(k): _scrub_surrogates(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub_surrogates(v) for v in value]
    return value


def _new_id() -> str:
    return uuid.uuid4().hex


def _now() -> datetime:
    return datetime.now(UTC)


class _Model(BaseModel):
    """Base of every trace model: strict fields, JSON-safe infinities."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class _OpenModel(BaseModel):
    """Base of models that keep provider-specific fields they do not know."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings")


# --- enums ------------------------------------------------------------------------------


class TraceStatus(StrEnum):
    """Lifecycle of a trace. ``completed``, ``failed`` and ``cancelled`` are final."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (TraceStatus.COMPLETED, TraceStatus.FAILED, TraceStatus.CANCELLED)


class ErrorKind(StrEnum):
    """Where a failure happened. Infrastructure failures are never scored as reward 0."""

    MODEL_PROVIDER = "model_provider"
    HARNESS = "harness"
    ENVIRONMENT = "environment"
    SANDBOX = "sandbox"
    RUBRIC = "rubric"
    INFRASTRUCTURE = "infrastructure"
    TASK = "task"  # the task itself is malformed (a bad line of a task file): never run


Role = Literal["system", "developer", "user", "assistant", "tool"]


# --- messages ---------------------------------------------------------------------------


class ContentPart(_OpenModel):
    """One part of a multi-part message: ``{"type": "text", "text": ...}``, an image, …

    Fields other than ``type`` and ``text`` are kept as the provider sent them.
    """

    type: str = Field(description="Part type: 'text', 'image_url', 'input_audio', …")
    text: str | None = Field(default=None, description="Text of a 'text' part.")


class ToolCall(_Model):
    """A tool call the model asked for, as it appears on an assistant message."""

    id: str = Field(description="Call id; the tool message answering it repeats it.")
    name: str
    arguments: dict[str, Any] = Field(
        default_factory=dict, description="Parsed arguments; empty if they did not parse."
    )
    raw_arguments: str | None = Field(
        default=None,
        description="The arguments string exactly as the model produced it, when it was "
        "not valid JSON (or when byte-exactness matters).",
    )


class Message(_Model):
    """One node of the message graph.

    ``parent_id`` is ``None`` for a root; a message with several children is a branch
    point. A message must come after its parent in ``Trace.messages``.
    """

    id: str = Field(default_factory=_new_id)
    parent_id: str | None = Field(default=None, description="The message this one follows.")
    role: Role
    content: str | list[ContentPart] | None = None
    reasoning: str | None = Field(default=None, description="Reasoning text, when exposed.")
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = Field(
        default=None, description="For role 'tool': the id of the call it answers."
    )
    name: str | None = Field(default=None, description="Tool name, or a participant name.")
    model_call_id: str | None = Field(
        default=None, description="For assistant messages: the ModelCall that produced it."
    )
    created_at: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def text(self) -> str:
        """The text of the content, parts joined; ``""`` when there is none."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class ForkRef(_Model):
    """Where a forked trace branched off: a message (and step) of another trace."""

    trace_id: str
    message_id: str | None = None
    step_index: int | None = Field(default=None, ge=0)
    snapshot_id: str | None = Field(default=None, description="Environment snapshot restored.")


# --- model calls ------------------------------------------------------------------------


class SamplingParams(_OpenModel):
    """Sampling parameters sent with a model call. Provider-specific ones are kept."""

    temperature: JSONFloat | None = None
    top_p: JSONFloat | None = None
    top_k: int | None = None
    min_p: JSONFloat | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: JSONFloat | None = None
    frequency_penalty: JSONFloat | None = None
    repetition_penalty: JSONFloat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class Usage(_OpenModel):
    """Token accounting reported by the provider."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None


class TokenLogprob(_Model):
    """One alternative token and its logprob (an entry of ``top_logprobs``)."""

    token_id: int | None = None
    token: str | None = None
    logprob: JSONFloat


class Choice(_Model):
    """One completion of a model call (``n`` > 1 gives several)."""

    index: int = Field(default=0, ge=0)
    message_id: str | None = Field(
        default=None, description="The assistant message in the graph holding this output."
    )
    finish_reason: str | None = Field(
        default=None, description="As the provider reported it: stop, length, tool_calls, …"
    )
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[JSONFloat] | None = Field(
        default=None, description="Logprob of each completion token under the sampler."
    )
    top_logprobs: list[list[TokenLogprob]] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        ids, lps = self.completion_token_ids, self.completion_logprobs
        if ids is not None and lps is not None and len(ids) != len(lps):
            raise ValueError(
                f"choice {self.index}: {len(ids)} completion_token_ids but "
                f"{len(lps)} completion_logprobs; they must align one to one"
            )
        return self


class ModelCall(_Model):
    """One call to the model, as recorded by the gateway (or the harness)."""

    id: str = Field(default_factory=_new_id)
    step_index: int | None = Field(default=None, ge=0, description="Step (turn) it served.")
    model: str = Field(description="Model name as requested.")
    response_model: str | None = Field(default=None, description="Model name the reply named.")
    provider: str | None = None
    endpoint: str | None = Field(default=None, description="Upstream URL or API path.")
    api: str | None = Field(
        default=None, description="'chat.completions', 'completions', 'responses', 'messages', …"
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    input_message_ids: list[str] = Field(
        default_factory=list, description="Graph messages that formed the prompt, in order."
    )
    request: dict[str, Any] | None = Field(default=None, description="Request body as sent.")
    original_request: dict[str, Any] | None = Field(
        default=None, description="Request before a policy rewrote it; None if unchanged."
    )
    response: dict[str, Any] | None = Field(
        default=None, description="Response as received (all choices; assembled if streamed)."
    )
    choices: list[Choice] = Field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    usage: Usage | None = None
    started_at: datetime | None = None
    latency_s: JSONSeconds | None = None
    ttft_s: JSONSeconds | None = Field(default=None, description="Time to first token (stream).")
    streamed: bool = False
    attempts: int = Field(default=1, ge=1, description="Tries the gateway made (1 = no retry).")
    policy_version: int | str | None = None
    error: TraceError | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def finish_reason(self) -> str | None:
        """Finish reason of the first choice."""
        return self.choices[0].finish_reason if self.choices else None


# --- steps, rewards, errors -------------------------------------------------------------


class StepRecord(_Model):
    """One environment step or tool execution."""

    index: int = Field(ge=0)
    action: Any = Field(default=None, description="The action (or tool arguments) as JSON.")
    observation: Any = Field(default=None, description="The observation (or tool result).")
    tool_name: str | None = None
    tool_call_id: str | None = Field(default=None, description="The ToolCall it executed.")
    reward: JSONFloat | None = None
    terminated: bool = False
    truncated: bool = False
    started_at: datetime | None = None
    latency_s: JSONSeconds | None = None
    error: TraceError | None = None
    info: dict[str, Any] = Field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class Reward(_Model):
    """One named reward component; the trace total is the weighted sum."""

    name: str
    value: JSONFloat
    weight: JSONFloat = 1.0
    step_index: int | None = Field(default=None, ge=0, description="Set for a step reward.")
    reason: str | None = Field(default=None, description="Why (judge rationale, failed test).")


class TraceError(_Model):
    """A classified failure recorded on the trace (data, not an exception)."""

    kind: ErrorKind
    message: str
    where: str | None = Field(default=None, description="Component or stage, e.g. 'gateway'.")
    type: str | None = Field(default=None, description="Exception class name, if any.")
    retryable: bool = False
    step_index: int | None = Field(default=None, ge=0)
    traceback: str | None = None
    at: datetime = Field(default_factory=_now)

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        kind: ErrorKind,
        *,
        where: str | None = None,
        retryable: bool = False,
        step_index: int | None = None,
    ) -> TraceError:
        """Record ``exc`` (message, class name and traceback) as a ``kind`` failure."""
        return cls(
            kind=kind,
            message=str(exc) or type(exc).__name__,
            where=where,
            type=type(exc).__qualname__,
            retryable=retryable,
            step_index=step_index,
            traceback="".join(tb.format_exception(exc)),
        )


ModelCall.model_rebuild()
StepRecord.model_rebuild()


# --- the trace --------------------------------------------------------------------------


class Run(_Model):
    """An experiment: a named group of traces with the configuration that made them."""

    run_id: str = Field(default_factory=_new_id)
    name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=_now)


class Trace(_Model):
    """The full record of one attempt at one task."""

    model_config = ConfigDict(
        extra="forbid",
        ser_json_inf_nan="strings",
        title="Trace",
        json_schema_extra={"$comment": "envport trace; see docs/trace.schema.json"},
    )

    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)
    trace_id: str = Field(default_factory=_new_id)
    run_id: str | None = None
    task_id: str | None = None
    task_hash: str | None = Field(default=None, description="Content hash of the task.")
    taskset: str | None = None
    rollout_id: str = Field(default_factory=_new_id)
    attempt: int = Field(default=1, ge=1, description="1 for the first try of the rollout.")
    group_id: str | None = Field(default=None, description="Rollouts scored as one group.")
    env_id: str | None = None
    harness: str | None = None
    policy_version: int | str | None = None
    forked_from: ForkRef | None = None
    status: TraceStatus = TraceStatus.PENDING
    stop_reason: str | None = Field(
        default=None,
        description="Why the run stopped: 'terminated', 'truncated', 'max_turns', "
        "'timeout', 'no_tool_calls', 'error', 'cancelled', …",
    )
    messages: list[Message] = Field(default_factory=list)
    model_calls: list[ModelCall] = Field(default_factory=list)
    steps: list[StepRecord] = Field(default_factory=list)
    rewards: list[Reward] = Field(default_factory=list)
    reward: JSONFloat | None = Field(
        default=None, description="Total reward; None when not scored (e.g. infra failure)."
    )
    metrics: dict[str, JSONFloat] = Field(default_factory=dict)
    errors: list[TraceError] = Field(default_factory=list)
    timings: dict[str, JSONFloat] = Field(
        default_factory=dict, description="Seconds spent per stage."
    )
    created_at: datetime = Field(default_factory=_now)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v > SCHEMA_VERSION:
            raise ValueError(
                f"trace schema_version {v} is newer than this envport understands "
                f"({SCHEMA_VERSION}); upgrade envport to read it"
            )
        return v

    @model_validator(mode="after")
    def _graph_is_ordered(self) -> Self:
        seen: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.id in seen:
                raise ValueError(f"messages[{i}]: duplicate message id {m.id!r}")
            if m.parent_id is not None and m.parent_id not in seen:
                raise ValueError(
                    f"messages[{i}] ({m.id!r}): parent_id {m.parent_id!r} is not an "
                    "earlier message; parents must come before their children"
                )
            seen.add(m.id)
        return self

    # --- serialisation ---------------------------------------------------------------

    def to_json(self) -> str:
        """The trace as JSON; a lone surrogate anywhere in it is written as U+FFFD."""
        try:
            return self.model_dump_json()
        except PydanticSerializationError:
            data = self.model_dump()
            clean = _scrub_surrogates(data)
            if clean == data:
                raise  # not a surrogate: something in a free-form field is not JSON
            return type(self).model_validate(clean).model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> Trace:
        return cls.model_validate_json(data)

    # --- the message graph -----------------------------------------------------------

    def message(self, message_id: str) -> Message:
        """The message with this id; ``KeyError`` naming it if there is none."""
        for m in self.messages:
            if m.id == message_id:
                return m
        raise KeyError(f"no message {message_id!r} in trace {self.trace_id!r}")

    def children(self, message_id: str | None) -> list[Message]:
        """Messages whose parent is ``message_id`` (``None``: the roots)."""
        return [m for m in self.messages if m.parent_id == message_id]

    def leaves(self) -> list[Message]:
        """Messages nobody follows: the ends of each branch, in order."""
        parents = {m.parent_id for m in self.messages}
        return [m for m in self.messages if m.id not in parents]

    def path(self, message_id: str) -> list[Message]:
        """The conversation from its root down to ``message_id``, inclusive."""
        by_id = {m.id: m for m in self.messages}
        if message_id not in by_id:
            raise KeyError(f"no message {message_id!r} in trace {self.trace_id!r}")
        out: list[Message] = []
        cur: str | None = message_id
        while cur is not None:
            m = by_id[cur]
            out.append(m)
            cur = m.parent_id
        out.reverse()
        return out

    def branches(self) -> Iterator[list[Message]]:
        """Each root-to-leaf conversation, one per leaf."""
        for leaf in self.leaves():
            yield self.path(leaf.id)

    # --- building ---------------------------------------------------------------------

    def append_message(self, message: Message) -> Message:
        """Append ``message``; its parent, if it names one, must already be here."""
        if message.parent_id is not None and all(m.id != message.parent_id for m in self.messages):
            raise ValueError(f"parent_id {message.parent_id!r} is not a message of this trace")
        if any(m.id == message.id for m in self.messages):
            raise ValueError(f"duplicate message id {message.id!r}")
        self.messages.append(message)
        return message

    def reply(
        self, role: Role, content: str | list[ContentPart] | None = None, **fields: Any
    ) -> Message:
        """Append a message whose parent is the last message (a linear conversation)."""
        parent = self.messages[-1].id if self.messages else None
        return self.append_message(Message(role=role, content=content, parent_id=parent, **fields))

    # --- scoring ----------------------------------------------------------------------

    def weighted_reward(self) -> float | None:
        """Weighted sum of the run's named rewards; ``None`` when there are none. Step
        rewards (a ``step_index``) are the steps' own, kept apart from the run's total."""
        run = [r for r in self.rewards if r.step_index is None]
        if not run:
            return None
        return sum(r.weight * r.value for r in run)

    def step_rewards(self) -> list[tuple[int, float]]:
        """``(step index, reward)`` for each step that has one, in step order."""
        return sorted((s.index, s.reward) for s in self.steps if s.reward is not None)
