"""What every trainer adapter shares: rollouts in, one token-exact row per rollout out.

* :class:`RolloutRunner` runs one envport rollout of a :class:`~envport.tasks.Task` with
  the built-in agent (through :class:`~envport.evaluate.Evaluator`, so failures are
  classified and the rubric scores the run) and turns its trace into rows with
  :func:`~envport.train.build_rows`.
* :func:`pick_row`: trainers take one sequence per rollout. A rollout that merged
  into one row gives that row; a rollout that split (see :mod:`envport.train.rows`)
  gives one of its fragments, chosen by ``fragment`` (``"last"`` holds the final answer),
  and the others are counted as ``unused_fragments``. Fragments are never glued back
  together: that would put tokens the policy never saw in that order under mask 1.
* :class:`TokenChatModel`: a :class:`~envport.harness.ChatModel` whose backend is a
  trainer's token-in/token-out engine (verl's server manager, SkyRL's inference client).
  The prompt is rendered with the trainer's own tokenizer and chat template, the reply
  is decoded and its tool calls parsed, and the call is recorded with the exact ids the
  engine saw and sampled, so :func:`~envport.train.build_rows` can merge or split it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypeVar

from envport.gateway.capture import sampling_from
from envport.harness.agent import AgentConfig
from envport.harness.model import ChatModel, ModelProviderError
from envport.policy.tokenizer import ByteTokenizer
from envport.tasks import Task
from envport.trace import AsyncTraceStore, SQLiteTraceStore, Trace, TraceStore
from envport.trace.model import Choice, ModelCall, Usage
from envport.train.rows import Decoder, RowsResult, TrainingRow, build_rows

Fragment = Literal["last", "first", "longest"]
FRAGMENTS: tuple[Fragment, ...] = ("last", "first", "longest")

#: Count label: fragments of a split rollout that were not handed to the trainer.
UNUSED_FRAGMENTS = "unused_fragments"
#: Count label: rollouts that gave no row at all (failed, or no usable model call).
NO_ROW = "no_row"

_T = TypeVar("_T")


def pick_row(result: RowsResult, fragment: Fragment = "last") -> TrainingRow | None:
    """The one row of a rollout a trainer gets; ``None`` when the rollout gave none."""
    if fragment not in FRAGMENTS:
        raise ValueError(f"fragment must be one of {', '.join(FRAGMENTS)}, not {fragment!r}")
    if not result.rows:
        return None
    if fragment == "first":
        return result.rows[0]
    if fragment == "longest":
        return max(result.rows, key=lambda r: (sum(r.mask), r.fragment))
    return result.rows[-1]


@dataclass
class Rollout:
    """One rollout as an adapter hands it on: the trace, its rows, the row chosen."""

    trace: Trace
    result: RowsResult
    row: TrainingRow | None

    @property
    def dropped_reasons(self) -> list[str]:
        return [reason for _, reason in self.result.dropped]


@dataclass
class RolloutStats:
    """Counts over the rollouts an adapter ran (labels from :mod:`envport.train.rows`)."""

    counts: Counter[str] = field(default_factory=Counter)

    def add(self, rollout: Rollout) -> None:
        self.counts.update(rollout.result.counts)
        self.counts["rollouts"] += 1
        if rollout.row is None:
            self.counts[NO_ROW] += 1
        else:
            self.counts[UNUSED_FRAGMENTS] += len(rollout.result.rows) - 1


def run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion from synchronous code, even under a running loop.

    Trainers call their hooks synchronously, sometimes from a thread that already runs an
    event loop (notebooks); then the coroutine runs on a fresh loop in a worker thread.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=target, name="envport-rollouts")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    value: _T = box["value"]
    return value


class RolloutRunner:
    """Runs rollouts of tasks with the built-in agent and turns each into rows.

    ``env_urls`` maps an env id to a server URL; other envs run in-process. ``store``
    keeps every trace (an in-memory SQLite store by default). ``tokenizer`` lets
    :func:`build_rows` tell re-tokenization drift from a rewritten history.
    """

    def __init__(
        self,
        *,
        env_urls: dict[str, str] | None = None,
        agent: AgentConfig | None = None,
        store: TraceStore | None = None,
        fragment: Fragment = "last",
        max_length: int | None = None,
        tokenizer: Decoder | None = None,
    ) -> None:
        if fragment not in FRAGMENTS:
            raise ValueError(f"fragment must be one of {', '.join(FRAGMENTS)}, not {fragment!r}")
        self.env_urls = dict(env_urls or {})
        self.agent = agent or AgentConfig()
        self.store = store if store is not None else SQLiteTraceStore(":memory:")
        self.fragment: Fragment = fragment
        self.max_length = max_length
        self.tokenizer = tokenizer
        self.stats = RolloutStats()

    async def run(
        self,
        model: ChatModel,
        task: Task,
        index: int,
        run_id: str,
        *,
        group_id: str | None = None,
    ) -> Rollout:
        from envport.evaluate import EvalConfig, Evaluator

        config = EvalConfig(env_urls=self.env_urls, agent=self.agent)
        evaluator = Evaluator(model, AsyncTraceStore(self.store), config)
        trace = await evaluator.run_one(task, index, run_id)
        if group_id is not None and trace.group_id != group_id:
            trace.group_id = group_id
            await AsyncTraceStore(self.store).put(trace)
        result = build_rows(trace, max_length=self.max_length, tokenizer=self.tokenizer)
        rollout = Rollout(trace=trace, result=result, row=pick_row(result, self.fragment))
        self.stats.add(rollout)
        return rollout


# --- a chat model over a token-in/token-out engine ----------------------------------------


@dataclass(frozen=True)
class Generated:
    """What a token engine returned for one prompt."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    #: ``"stop"`` (ended on an end-of-turn token), ``"length"`` (ran out of tokens), or the
    #: engine's own word; ``None`` lets :class:`TokenChatModel` infer it.
    finish_reason: str | None = None


#: ``generate(prompt_ids, sampling) -> Generated``: the trainer's engine, token in, token out.
GenerateFn = Callable[[list[int], dict[str, Any]], Awaitable[Generated]]


class ChatTokenizer(Protocol):
    """A Hugging Face tokenizer, or envport's :class:`~envport.policy.ByteTokenizer`."""

    def decode(self, ids: list[int], /) -> str: ...


_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and ``(name, raw JSON arguments)`` of Hermes/Qwen-style ``<tool_call>`` blocks.

    Works for both layouts in use: ``<tool_call>{...}</tool_call>`` (envport's template)
    and ``<tool_call>\\n{...}\\n</tool_call>`` (Qwen 2.5/3). A block that is not a JSON
    object with a string ``name`` leaves the whole text as content (no call is guessed).
    """
    blocks = list(_TOOL_CALL_RE.finditer(text))
    if not blocks:
        return text, []
    calls: list[tuple[str, str]] = []
    for block in blocks:
        try:
            obj = json.loads(block.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        calls.append((obj["name"], args if isinstance(args, str) else json.dumps(args)))
    content = text[: blocks[0].start()].rstrip("\n")
    return (content or None), calls


def render_prompt(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[int]:
    """Prompt ids for ``messages`` with the tokenizer's own chat template."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tools or None))
    text = tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=True,
        tokenize=False,
    )
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def _end_texts(tokenizer: Any) -> list[str]:
    ends = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"]
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos:
        ends.insert(0, eos)
    return ends


class TokenChatModel(ChatModel):
    """A :class:`ChatModel` that renders, generates with ``generate``, and parses itself.

    ``tokenizer`` must be the tokenizer of the model behind ``generate`` (the trainer's);
    its chat template renders every turn's prompt from the conversation so far. The
    reply's text is decoded from the sampled ids only to find content and tool calls: the
    ids themselves go into the trace untouched.
    """

    def __init__(
        self,
        generate: GenerateFn,
        tokenizer: Any,
        *,
        model: str = "trainer-policy",
        sampling: dict[str, Any] | None = None,
        api: str = "tokens",
    ) -> None:
        # No HTTP client: the engine is called directly (ChatModel's transport is unused).
        self.base_url = ""
        self.model = model
        self.sampling = dict(sampling or {})
        self.request_token_data = True
        self._owns_client = False
        self._generate = generate
        self.tokenizer = tokenizer
        self.api = api

    async def aclose(self) -> None:
        return None

    def _finish_reason(self, ids: list[int], given: str | None, has_calls: bool) -> str:
        if given in ("stop", "length", "tool_calls"):
            return "tool_calls" if given == "stop" and has_calls else given
        limit = self.sampling.get("max_tokens") or self.sampling.get("max_new_tokens")
        text = self.tokenizer.decode(ids[-1:]) if ids else ""
        ended = any(text == end for end in _end_texts(self.tokenizer))
        if not ended and limit is not None and len(ids) >= int(limit):
            return "length"
        return "tool_calls" if has_calls else "stop"

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[ModelCall, dict[str, Any]]:
        prompt_ids = render_prompt(self.tokenizer, messages, tools)
        started = datetime.now(UTC)
        t0 = time.perf_counter()
        try:
            out = await self._generate(prompt_ids, dict(self.sampling))
        except Exception as exc:
            raise ModelProviderError(
                f"the trainer's engine failed: {type(exc).__name__}: {exc}", retryable=True
            ) from exc
        latency = time.perf_counter() - t0
        ids = [int(t) for t in out.token_ids]
        logprobs = None if out.logprobs is None else [float(x) for x in out.logprobs]
        if logprobs is not None and len(logprobs) != len(ids):
            raise ModelProviderError(
                f"the trainer's engine returned {len(logprobs)} logprobs for {len(ids)} tokens; "
                "they must align one to one"
            )
        text = self.tokenizer.decode(ids)
        for end in _end_texts(self.tokenizer):
            if text.endswith(end):
                text = text[: -len(end)]
                break
        content, calls = parse_tool_calls(text) if tools else (text, [])
        wire_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:16]}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for name, args in calls
        ]
        finish = self._finish_reason(ids, out.finish_reason, bool(calls))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if wire_calls:
            message["tool_calls"] = wire_calls
        call = ModelCall(
            model=self.model,
            api=self.api,
            sampling=sampling_from(self.sampling, "chat"),  # OpenAI's forms: stop as a string
            request={"messages": messages, "tools": tools, "sampling": self.sampling},
            response={"message": message, "finish_reason": finish},
            choices=[
                Choice(finish_reason=finish, completion_token_ids=ids, completion_logprobs=logprobs)
            ],
            prompt_token_ids=prompt_ids,
            usage=Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(ids),
                total_tokens=len(prompt_ids) + len(ids),
            ),
            metadata={
                "token_ids": "present",
                "logprobs": "missing" if logprobs is None else "present",
            },
            started_at=started,
            latency_s=latency,
        )
        return call, message
