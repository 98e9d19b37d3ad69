"""What the gateway records: one :class:`~envport.trace.ModelCall` per logical call.

For every call on a rollout the record holds the request **as the agent sent it**, the
request **as forwarded** (they differ only when a trainer-configured
:class:`GatewayPolicy` rewrote it, or when the call was translated from the Anthropic
or Responses API; then ``original_request`` is the agent's and ``request`` the
forwarded one), the response as received with **all** choices (reassembled from the
chunks when streamed: content, tool calls, token ids, logprobs, finish reasons,
usage), the model, sampling parameters, usage, latency, time to first token, the
tries it took, the policy version it ran under, and its error, classified.

Token data comes from vLLM's fields: ``prompt_token_ids`` (top level for chat, on each
choice for completions), ``choices[].token_ids``, and the logprobs blocks
(``logprobs.content[].logprob`` for chat, ``logprobs.token_logprobs`` for completions).
When the upstream sends none, ``metadata["token_ids"]`` / ``metadata["logprobs"]`` say
``"missing"`` instead of ``"present"``; a trainer can then drop or re-tokenise the call.

**Default: forward as-is.** Without a policy the gateway changes nothing: not the model,
not the sampling parameters, not the fields asked for. A ``GatewayPolicy(
request_token_ids=True)`` asks upstream for token ids and logprobs on every call; the
agent then receives them too (extra fields that OpenAI clients ignore), and the trace
keeps both versions of the request.

**Retries by the agent's SDK.** The openai SDK retries 5xx itself and numbers its tries
in ``x-stainless-retry-count``. A retry with the same body on the same rollout replaces
the record of the try it repeats: one logical call, its ``attempts`` the sum of both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import math
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeGuard

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from envport.trace.model import (
    Choice,
    ErrorKind,
    ModelCall,
    Reward,
    SamplingParams,
    TokenLogprob,
    Trace,
    TraceError,
    TraceStatus,
    Usage,
)

# --- the trainer's policy ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GatewayPolicy:
    """Rewrites the trainer may configure. The default rewrites nothing.

    ``request_token_ids``: ask for logprobs and vLLM's ``return_token_ids`` on every call.
    ``stream_usage``: ask for the usage chunk on streams (``stream_options.include_usage``).
    ``overrides``: fields set on every request (e.g. ``{"temperature": 1.0}``), recorded.
    """

    request_token_ids: bool = False
    stream_usage: bool = False
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def apply(self, body: dict[str, Any], api: str) -> dict[str, Any]:
        """``body`` rewritten (a new dict), or ``body`` itself when nothing changes."""
        if not (self.request_token_ids or self.stream_usage or self.overrides):
            return body
        out = dict(body)
        if self.request_token_ids:
            if api == "completions":
                if not isinstance(out.get("logprobs"), int) or isinstance(out["logprobs"], bool):
                    out["logprobs"] = 0
            else:
                out["logprobs"] = True
            out["return_token_ids"] = True
        if self.stream_usage and out.get("stream"):
            options = dict(out.get("stream_options") or {})
            options["include_usage"] = True
            out["stream_options"] = options
        out.update(self.overrides)
        return body if out == body else out


# --- parsing what upstream answered ----------------------------------------------------

_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "stop",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "top_logprobs",
)


def sampling_from(body: Mapping[str, Any], api: str) -> SamplingParams:
    """The sampling parameters of a request; fields that do not validate are skipped."""
    fields: dict[str, Any] = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    if "max_tokens" not in fields and body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    logprobs = body.get("logprobs")
    if api == "completions" and isinstance(logprobs, int) and not isinstance(logprobs, bool):
        fields["logprobs"] = True
        fields["top_logprobs"] = logprobs
    elif isinstance(logprobs, bool):
        fields["logprobs"] = logprobs
    try:
        return SamplingParams(**fields)
    except ValidationError:
        good = {}
        for key, value in fields.items():
            try:
                SamplingParams(**{key: value})
            except ValidationError:
                continue
            good[key] = value
        return SamplingParams(**good)


def _chat_logprobs(block: Mapping[str, Any]) -> tuple[list[float], list[list[TokenLogprob]]]:
    lps: list[float] = []
    tops: list[list[TokenLogprob]] = []
    for item in block.get("content") or ():
        lps.append(float(item["logprob"]))
        tops.append(
            [
                TokenLogprob(token=alt.get("token"), logprob=float(alt["logprob"]))
                for alt in item.get("top_logprobs") or ()
            ]
        )
    return lps, tops


def _legacy_logprobs(block: Mapping[str, Any]) -> tuple[list[float], list[list[TokenLogprob]]]:
    lps = [float(x) for x in block.get("token_logprobs") or ()]
    tops = [
        [TokenLogprob(token=t, logprob=float(lp)) for t, lp in (alts or {}).items()]
        for alts in block.get("top_logprobs") or ()
    ]
    return lps, tops


def parse_choice(raw: Mapping[str, Any]) -> Choice:
    """One choice of a chat or completions response, with its token ids and logprobs."""
    ids = raw.get("token_ids")
    block = raw.get("logprobs")
    lps: list[float] | None = None
    tops: list[list[TokenLogprob]] | None = None
    if isinstance(block, Mapping):
        parse = _chat_logprobs if "content" in block else _legacy_logprobs
        lps, tops = parse(block)
        if not lps:
            lps, tops = None, None
    if ids is not None and lps is not None and len(ids) != len(lps):
        lps, tops = None, None  # cannot align one to one: keep the ids alone
    return Choice(
        index=int(raw.get("index") or 0),
        finish_reason=raw.get("finish_reason"),
        completion_token_ids=[int(t) for t in ids] if ids is not None else None,
        completion_logprobs=lps,
        top_logprobs=tops if tops and any(tops) else None,
    )


def parse_response(
    response: Mapping[str, Any],
) -> tuple[list[Choice], list[int] | None, Usage | None, dict[str, str]]:
    """Choices, prompt token ids, usage, and what token data is present/missing."""
    raw_choices = response.get("choices") or []
    choices = [parse_choice(c) for c in raw_choices if isinstance(c, Mapping)]
    prompt = response.get("prompt_token_ids")
    if prompt is None and raw_choices and isinstance(raw_choices[0], Mapping):
        prompt = raw_choices[0].get("prompt_token_ids")  # /v1/completions: per choice
    usage_raw = response.get("usage")
    usage = None
    if isinstance(usage_raw, Mapping):
        flat = {k: v for k, v in usage_raw.items() if v is not None}
        details = usage_raw.get("prompt_tokens_details")
        if isinstance(details, Mapping) and details.get("cached_tokens") is not None:
            flat["cached_tokens"] = details["cached_tokens"]
        try:
            usage = Usage(**flat)
        except ValidationError:
            usage = None
    present = {
        "token_ids": _presence(
            [c.completion_token_ids is not None for c in choices] + [prompt is not None]
        ),
        "logprobs": _presence([c.completion_logprobs is not None for c in choices]),
    }
    prompt_ids = [int(t) for t in prompt] if isinstance(prompt, list) else None
    return choices, prompt_ids, usage, present


def _presence(flags: list[bool]) -> str:
    if flags and all(flags):
        return "present"
    return "partial" if any(flags) else "missing"


# --- reassembling a stream -------------------------------------------------------------


def _choices(chunk: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A chunk's choices; a malformed list (or entry) is skipped, never raised on."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return []
    return [raw for raw in choices if _is_mapping(raw)]


def _is_mapping(value: object) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)``, a parsed JSON object (a dict) checked first: the
    ABC's check costs several times more, on every chunk of every stream."""
    return type(value) is dict or isinstance(value, Mapping)


def has_output(chunk: Mapping[str, Any]) -> bool:
    """Whether a chat or completions chunk carries output (text, reasoning, tool calls,
    token ids): what :meth:`StreamAssembler.feed` answers, without folding the chunk."""
    for raw in _choices(chunk):
        if raw.get("token_ids") or raw.get("text"):
            return True
        delta = raw.get("delta")
        if _is_mapping(delta) and (
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("tool_calls")
        ):
            return True
    return False


class StreamAssembler:
    """Folds chat or completions chunks back into the response they add up to."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.events = 0

    def feed(self, chunk: Mapping[str, Any]) -> bool:
        """Add one chunk; ``True`` if it carried output (text, tool calls, tokens)."""
        self.events += 1
        for key, value in chunk.items():
            if key == "usage":
                if value is not None:
                    self.top["usage"] = value
            elif key != "choices":
                self.top.setdefault(key, value)
        produced = False
        for raw in _choices(chunk):
            produced |= self._choice(raw)
        return produced

    def _choice(self, raw: Mapping[str, Any]) -> bool:
        index = int(raw.get("index") or 0)
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = {
                "text": [],
                "reasoning": [],
                "tools": {},
                "ids": None,
                "lps": None,
                "role": None,
            }
        produced = False
        # Lists grow in place (a stream may have thousands of one-token chunks: copying
        # what was gathered so far on every chunk would make folding them quadratic).
        ids = raw.get("token_ids")
        if ids is not None:
            produced = bool(ids)
            if state["ids"] is None:
                state["ids"] = []
            state["ids"].extend(ids)
        if raw.get("prompt_token_ids") is not None:
            state.setdefault("prompt_token_ids", list(raw["prompt_token_ids"]))
        block = raw.get("logprobs")
        if isinstance(block, Mapping):
            lps = state["lps"]
            if lps is None:
                lps = state["lps"] = {}
            for key, value in block.items():
                if isinstance(value, list):
                    if key in lps:
                        lps[key].extend(value)
                    else:
                        lps[key] = list(value)
        for key in ("finish_reason", "stop_reason"):
            if raw.get(key) is not None:
                state[key] = raw[key]
        if "text" in raw:  # completions
            if raw["text"]:
                state["text"].append(raw["text"])
                produced = True
            return produced
        delta = raw.get("delta") or {}
        if delta.get("role"):
            state["role"] = delta["role"]
        if delta.get("content"):
            state["text"].append(delta["content"])
            produced = True
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            state["reasoning"].append(reasoning)
            produced = True
        for call in delta.get("tool_calls") or ():
            produced = True
            slot = state["tools"].setdefault(
                int(call.get("index") or 0),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                slot["function"]["arguments"] += fn["arguments"]
        return produced

    def response(self) -> dict[str, Any]:
        """The response the chunks add up to, shaped like a non-streamed one."""
        out = dict(self.top)
        chat = self.api != "completions"
        out["object"] = "chat.completion" if chat else "text_completion"
        out["choices"] = [self._assembled(i, s, chat) for i, s in sorted(self.choices.items())]
        return out

    @staticmethod
    def _assembled(index: int, state: dict[str, Any], chat: bool) -> dict[str, Any]:
        text = "".join(state["text"])
        choice: dict[str, Any] = {"index": index}
        if chat:
            message: dict[str, Any] = {
                "role": state["role"] or "assistant",
                "content": text if state["text"] else None,
            }
            if state["reasoning"]:
                message["reasoning_content"] = "".join(state["reasoning"])
            if state["tools"]:
                message["tool_calls"] = [state["tools"][i] for i in sorted(state["tools"])]
            choice["message"] = message
        else:
            choice["text"] = text
        choice["logprobs"] = state["lps"]
        choice["finish_reason"] = state.get("finish_reason")
        if "stop_reason" in state:
            choice["stop_reason"] = state["stop_reason"]
        if state["ids"] is not None:
            choice["token_ids"] = state["ids"]
        if "prompt_token_ids" in state:
            choice["prompt_token_ids"] = state["prompt_token_ids"]
        return choice


# --- building the record ----------------------------------------------------------------


def model_provider_error(message: str, *, type: str, retryable: bool = False) -> TraceError:
    return TraceError(
        kind=ErrorKind.MODEL_PROVIDER,
        message=message,
        where="gateway",
        type=type,
        retryable=retryable,
    )


class IdSource:
    """Unique 32-hex-digit ids, cheaply: a random prefix drawn once per process (80 bits
    from ``os.urandom``) and a counter. Ids from different processes (a restarted
    gateway, a forked child: the prefix is drawn again after a fork) differ by their
    prefix; within one, by the counter. A ``uuid4`` costs ten times as much, on every
    model call."""

    __slots__ = ("_count", "_prefix")

    def __init__(self) -> None:
        self.reseed()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self._prefix = os.urandom(10).hex()
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):012x}"


new_id = IdSource()


@dataclasses.dataclass
class CallRecord:
    """What the gateway collects while a call runs; :meth:`build` makes the ModelCall.

    Only cheap things happen while the call runs: the raw parsed response (or a stream's
    chunks as upstream sent them, parsed and folded by :meth:`build`), the time of the
    first token, and the
    latency (:meth:`finish`). Building the pydantic record (choices, token ids, logprobs,
    usage) waits until someone reads the rollout (:attr:`Rollout.calls`), off the
    response path.
    """

    api: str
    agent_request: dict[str, Any]
    request: dict[str, Any]
    policy_version: int | str | None
    started_at: datetime = dataclasses.field(default_factory=lambda: datetime.now(UTC))
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    streamed: bool = False
    endpoint: str | None = None
    attempts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    response: dict[str, Any] | None = None
    status: int | None = None
    ttft_s: float | None = None
    error: TraceError | None = None
    call_id: str = dataclasses.field(default_factory=new_id)
    raw_chunks: list[bytes] | None = None  # a stream's chunks (JSON objects), unparsed
    latency_s: float | None = None

    def mark_first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.t0

    def finish(self) -> None:
        """The call ended now (its latency); the record is built later."""
        if self.latency_s is None:
            self.latency_s = time.perf_counter() - self.t0

    def build(self, parse_api: str) -> ModelCall:
        self.finish()
        latency = self.latency_s
        assert latency is not None
        metadata: dict[str, Any] = {"attempt_log": self.attempts}
        if self.response is None and self.raw_chunks:
            # Each chunk was checked to be a JSON object when it was relayed, so the list
            # they make parses as exactly those objects, in one call.
            chunks = orjson.loads(b"[" + b",".join(self.raw_chunks) + b"]")
            assembler = StreamAssembler(parse_api)
            try:
                for chunk in chunks:
                    assembler.feed(chunk)
                self.response = assembler.response()
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                # Chunks that are JSON objects but not the API's shape: kept as they came
                metadata["parse_error"] = f"{type(exc).__name__}: {exc}"
                metadata["stream_chunks"] = chunks
            self.raw_chunks = None
        if self.status is not None:
            metadata["status"] = self.status
        choices: list[Choice] = []
        prompt_ids: list[int] | None = None
        usage: Usage | None = None
        if self.response is not None:
            try:
                choices, prompt_ids, usage, present = parse_response(self.response)
            except (KeyError, TypeError, ValueError, ValidationError) as exc:
                present = {"token_ids": "unparsed", "logprobs": "unparsed"}
                metadata["parse_error"] = f"{type(exc).__name__}: {exc}"
            metadata.update(present)
        elif "parse_error" in metadata:
            metadata.update(token_ids="unparsed", logprobs="unparsed")
        else:
            metadata.update(token_ids="missing", logprobs="missing")
        changed = self.request is not self.agent_request
        model = self.agent_request.get("model")
        return ModelCall(
            id=self.call_id,
            model=model if isinstance(model, str) else "",
            response_model=(self.response or {}).get("model"),
            provider="openai-compatible",
            endpoint=self.endpoint,
            api=self.api,
            sampling=sampling_from(self.request, parse_api),
            request=self.request,
            original_request=self.agent_request if changed else None,
            response=self.response,
            choices=choices,
            prompt_token_ids=prompt_ids,
            usage=usage,
            started_at=self.started_at,
            latency_s=latency,
            ttft_s=min(self.ttft_s, latency) if self.ttft_s is not None else None,
            streamed=self.streamed,
            attempts=max(1, len(self.attempts)),
            policy_version=self.policy_version,
            error=self.error,
            metadata=metadata,
        )


# --- rollouts -----------------------------------------------------------------------------


class RolloutState(StrEnum):
    LIVE = "live"
    FINISHING = "finishing"
    FINISHED = "finished"


class RolloutInfo(BaseModel):
    """What the orchestrator says about a rollout when creating it (copied to its trace)."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    ttl_s: float | None = Field(default=None, gt=0, description="Agent token lifetime.")
    run_id: str | None = None
    task_id: str | None = None
    task_hash: str | None = None
    taskset: str | None = None
    group_id: str | None = None
    attempt: int = Field(default=1, ge=1)
    env_id: str | None = None
    harness: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class FinishRequest(BaseModel):
    """How the orchestrator closes a rollout: its outcome and rewards."""

    model_config = ConfigDict(extra="forbid")

    status: TraceStatus = TraceStatus.COMPLETED
    stop_reason: str | None = None
    #: A reward is a finite number or absent (unscored): NaN or infinity is refused
    #: (400), not stored to break every group's advantages later.
    reward: float | None = Field(default=None, allow_inf_nan=False)
    rewards: list[Reward] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    errors: list[TraceError] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("rewards")
    @classmethod
    def _finite_rewards(cls, rewards: list[Reward]) -> list[Reward]:
        for i, r in enumerate(rewards):
            if not math.isfinite(r.value) or not math.isfinite(r.weight):
                raise ValueError(f"rewards[{i}] ({r.name!r}) must have a finite value and weight")
        return rewards


class RolloutView(BaseModel):
    """A live rollout as ``GET /admin/rollouts/{id}`` shows it."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    rollout_id: str
    state: RolloutState
    created_at: datetime
    expires_at: datetime | None
    in_flight: int
    upstream: str | None
    info: RolloutInfo
    model_calls: list[ModelCall]
    errors: list[TraceError]
    trace_id: str | None = None


BUILD_SLICE_S = 0.001  # the longest :meth:`Rollout.build` runs without a pause


def request_digest(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class Rollout:
    """One rollout's recorded calls and errors, while it is live."""

    def __init__(self, rollout_id: str, info: RolloutInfo, expires_at: float | None) -> None:
        self.rollout_id = rollout_id
        self.info = info
        self.created_at = datetime.now(UTC)
        self.expires_at = expires_at
        self.state = RolloutState.LIVE
        self._calls: list[ModelCall] = []
        self._pending: list[tuple[CallRecord, str, str, int]] = []
        self.errors: list[TraceError] = []
        self.unstored: Trace | None = None  # its trace, built, that the store failed
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._by_request: dict[str, int] = {}

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def add(self, record: CallRecord, parse_api: str, digest: str, client_retry: int) -> None:
        """Note a finished call; it is built and recorded (in order) when next read."""
        record.finish()
        self._pending.append((record, parse_api, digest, client_retry))

    @property
    def calls(self) -> list[ModelCall]:
        """The recorded calls, in order (building those not built yet)."""
        if self._pending:
            pending, self._pending = self._pending, []
            for record, parse_api, digest, client_retry in pending:
                self.record(record.build(parse_api), digest, client_retry)
        return self._calls

    async def build(self, slice_s: float = BUILD_SLICE_S) -> list[ModelCall]:
        """:attr:`calls`, built a slice at a time: after each ``slice_s`` of building,
        the event loop gets a turn, so streams relayed meanwhile wait for at most one
        slice instead of the whole rollout (a streamed call with logprobs takes about
        0.15 ms to build; a rollout can hold hundreds)."""
        while self._pending:
            until = time.perf_counter() + slice_s
            while True:  # at least one record per slice
                record, parse_api, digest, client_retry = self._pending.pop(0)
                self.record(record.build(parse_api), digest, client_retry)
                if not self._pending or time.perf_counter() >= until:
                    break
            if self._pending:
                await asyncio.sleep(0)
        return self._calls

    def record(self, call: ModelCall, digest: str, client_retry: int) -> ModelCall:
        """Append ``call``, or fold it into the call the agent's SDK is retrying."""
        index = self._by_request.get(digest) if client_retry > 0 else None
        if index is not None:
            previous = self._calls[index]
            call.id = previous.id
            call.attempts += previous.attempts
            call.metadata["client_retries"] = client_retry
            call.metadata["attempt_log"] = [
                *previous.metadata.get("attempt_log", []),
                *call.metadata.get("attempt_log", []),
            ]
            if previous.error is not None:
                call.metadata.setdefault("earlier_errors", []).append(
                    previous.error.model_dump(mode="json")
                )
            self._calls[index] = call
        else:
            self._by_request[digest] = len(self._calls)
            self._calls.append(call)
        return call

    def view(self, upstream: str | None) -> RolloutView:
        return RolloutView(
            rollout_id=self.rollout_id,
            state=self.state,
            created_at=self.created_at,
            expires_at=datetime.fromtimestamp(self.expires_at, UTC) if self.expires_at else None,
            in_flight=self.in_flight,
            upstream=upstream,
            info=self.info,
            model_calls=list(self.calls),
            errors=list(self.errors),
        )

    def to_trace(self, finish: FinishRequest) -> Trace:
        versions = [c.policy_version for c in self.calls if c.policy_version is not None]
        metadata = {**self.info.metadata, **finish.metadata, "recorded_by": "envport.gateway"}
        if len(set(map(str, versions))) > 1:
            metadata["policy_versions"] = list(dict.fromkeys(versions))
        errors = [*self.errors, *(c.error for c in self.calls if c.error is not None)]
        reward = finish.reward
        trace = Trace(
            rollout_id=self.rollout_id,
            run_id=self.info.run_id,
            task_id=self.info.task_id,
            task_hash=self.info.task_hash,
            taskset=self.info.taskset,
            group_id=self.info.group_id,
            attempt=self.info.attempt,
            env_id=self.info.env_id,
            harness=self.info.harness,
            policy_version=versions[-1] if versions else None,
            status=finish.status,
            stop_reason=finish.stop_reason,
            model_calls=list(self.calls),
            rewards=finish.rewards,
            metrics=finish.metrics,
            errors=[*errors, *finish.errors],
            started_at=self.created_at,
            finished_at=datetime.now(UTC),
            metadata=metadata,
        )
        trace.reward = reward if reward is not None else trace.weighted_reward()
        if trace.finished_at is not None:
            trace.timings["rollout"] = (trace.finished_at - self.created_at).total_seconds()
        return trace
