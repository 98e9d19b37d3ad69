"""What a policy server serves: the :class:`Policy` contract and its data.

A policy turns a conversation (OpenAI-shaped ``messages`` and ``tools``) into one
:class:`Generation`: the assistant's text and tool calls *and* the token ids and
logprobs behind them, the way a vLLM engine would report them. The HTTP layer
(:mod:`envport.policy.server`) knows nothing about how a policy decides; the scripted
policy, a tiny real transformer, or a proxy to a remote engine all plug in here.

The prompt is tokenized by the policy (its tokenizer is its own business), so
``prompt_token_ids`` travels in the :class:`Generation` too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "tool_calls"]
Message = Mapping[str, Any]
Tool = Mapping[str, Any]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request, for one choice.

    ``sample_index`` is the choice's index when a request asks for ``n`` > 1: a policy
    that samples should make choices differ, and at ``temperature == 0`` they are equal.
    ``tool_choice`` is OpenAI's (``"auto"``, ``"none"``, ``"required"`` or a named tool).
    A stop string ends the completion as in vLLM: its tokens were generated, so they stay
    in ``token_ids``, but the text ends before it unless ``include_stop_str_in_output``.
    ``prompt_logprobs`` (``None``: not wanted) asks for the prompt tokens' logprobs with that
    many alternatives each (the server's ``echo`` with ``logprobs`` needs them).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    sample_index: int = 0
    tool_choice: Any = "auto"
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class ToolCall:
    """One function call the assistant made; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Generation:
    """One sampled completion.

    ``token_ids`` are the completion's ids, including the end-of-turn token when the
    model stopped on it (as vLLM reports them); ``logprobs`` has one entry per id and
    ``top_logprobs`` (when asked for) one list of ``(token_id, logprob)`` per id.
    ``text`` is the message content (``None`` when the turn is only tool calls).
    ``prompt_logprobs`` (only when :attr:`SamplingParams.prompt_logprobs` asked for them)
    has one entry per prompt id, ``None`` for the first, which nothing predicts; likewise
    ``prompt_top_logprobs``.
    """

    text: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    stop_reason: str | int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    prompt_logprobs: tuple[float | None, ...] = ()
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] = ()

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"Generation has {len(self.token_ids)} token ids but "
                f"{len(self.logprobs)} logprobs; give one logprob per token."
            )


@runtime_checkable
class Tokenizer(Protocol):
    """What the server needs of a tokenizer: ids, text, and one token's bytes."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str: ...

    def token_str(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
    ) -> str: ...


@runtime_checkable
class Policy(Protocol):
    """A model behind the OpenAI-compatible server.

    ``generate`` serves ``/v1/chat/completions`` (one call per choice), ``complete``
    serves ``/v1/completions`` (a raw prompt: text or token ids). Both must be safe to
    call concurrently.
    """

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    async def generate(
        self, messages: Sequence[Message], tools: Sequence[Tool] | None, sampling: SamplingParams
    ) -> Generation: ...

    async def complete(
        self, prompt: str | Sequence[int], sampling: SamplingParams
    ) -> Generation: ...
