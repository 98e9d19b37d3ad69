"""``envport-tiny``: a small decoder-only transformer in PyTorch, served like a vLLM engine.

The model (:class:`TinyTransformer`) reads and writes the ids of
:class:`~envport.policy.tokenizer.ByteTokenizer`, so nothing is downloaded: bytes are the
vocabulary and the chat template is envport's own. :class:`TorchPolicy` implements the
:class:`~envport.policy.base.Policy` contract: it renders the conversation, samples a
completion (temperature, top-p, ``max_tokens``, stop strings, a seed) and reports the
token ids with the **sampler's own logprobs**, taken from the same forward pass that
chose each token: ``log_softmax(logits / T)`` for ``T > 0`` (before top-p truncation),
the raw ``log_softmax(logits)`` for greedy decoding. At ``T == 1`` and ``top_p == 1``
these are the model's logprobs, which is what a policy-gradient ratio needs.

**Hot-swapped weights, with a version.** The weights being served are one immutable
pair ``(module, version)``. :meth:`TorchPolicy.load_state_dict` builds a new module and
replaces the pair in one assignment, under a lock; a generation reads the pair once when
it starts, so a request in flight finishes on the weights it started with and is stamped
with *their* version, and the next request sees the new ones. Put the gateway's
pause/drain around a swap (see :mod:`envport.train.pipeline`) and the version the
gateway stamps on a call is the version that sampled it.

**The server's own record.** Every sample is kept (bounded) as a :class:`SampleRecord`:
prompt ids, completion ids, logprobs, the version and the sampling settings. Tests use
it to prove that training rows hold exactly what was sampled.

:func:`create_torch_policy_app` serves the policy with envport's OpenAI-compatible
server plus ``GET /policy/version``, ``POST /policy/weights`` (a ``torch.save`` state
dict, ``?version=N``) and ``GET /policy/samples``.
"""

from __future__ import annotations

import copy
import io
import itertools
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from envport.policy.base import FinishReason, Generation, Message, SamplingParams, Tool, ToolCall
from envport.policy.tokenizer import ByteTokenizer, parse_assistant

TINY_MODEL_NAME = "envport-tiny"

# --- the model --------------------------------------------------------------------------------


class TinyConfig(BaseModel):
    """Shape of a :class:`TinyTransformer`; the defaults build ~0.1M parameters (124,992)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(ByteTokenizer.vocab_size, ge=2)
    d_model: int = Field(64, ge=8)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    max_len: int = Field(128, ge=8, description="Context length (prompt + completion).")
    seed: int = Field(0, description="Seed of the initial weights.")


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyTransformer(nn.Module):
    """A GPT-style decoder: token + learned position embeddings, pre-norm blocks, tied head.

    Right-padded batches need no attention mask: attention is causal, so real tokens
    never see the padding after them.
    """

    def __init__(self, config: TinyConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TinyConfig()
        if config.d_model % config.n_heads:
            raise ValueError(
                f"d_model ({config.d_model}) must be a multiple of n_heads ({config.n_heads})"
            )
        gen = torch.Generator().manual_seed(config.seed)
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(
            _Block(config.d_model, config.n_heads) for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        with torch.no_grad():
            for name, p in self.named_parameters():  # all from ``seed``: reproducible
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                elif name.endswith("bias"):
                    p.zero_()

    def forward(self, ids: Tensor) -> Tensor:
        """Logits ``[batch, time, vocab]`` for ids ``[batch, time]``."""
        t = ids.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_len {self.config.max_len}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.norm(x) @ self.tok.weight.T
        return logits


# --- sampling ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleRecord:
    """What the policy sampled for one request (the server's own record)."""

    sample_id: int
    policy_version: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    temperature: float
    top_p: float
    finish_reason: FinishReason


@dataclass(frozen=True)
class _Weights:
    module: TinyTransformer
    version: int


def _filter_top_p(probs: Tensor, top_p: float) -> Tensor:
    if top_p >= 1.0:
        return probs
    ordered, index = torch.sort(probs, descending=True)
    keep = torch.cumsum(ordered, dim=-1) - ordered < top_p
    keep[0] = True
    out = torch.zeros_like(probs)
    out[index[keep]] = ordered[keep]
    return out / out.sum()


class TorchPolicy:
    """A :class:`TinyTransformer` behind the :class:`~envport.policy.base.Policy` contract.

    ``max_new_tokens`` caps a completion when the request sets no ``max_tokens``;
    ``workers`` bounds how many generations run at once (threads; torch releases the GIL);
    ``keep_records`` bounds the sample record.
    """

    def __init__(
        self,
        model: TinyTransformer | None = None,
        *,
        version: int = 0,
        name: str = TINY_MODEL_NAME,
        max_new_tokens: int = 32,
        workers: int = 2,
        keep_records: int = 100_000,
        seed: int = 0,
    ) -> None:
        module = model if model is not None else TinyTransformer()
        module.eval()
        self._name = name
        self._tokenizer = ByteTokenizer()
        self._weights = _Weights(module, version)
        self._swap_lock = threading.Lock()
        self._record_lock = threading.Lock()
        self._records: deque[SampleRecord] = deque(maxlen=keep_records)
        self._ids = itertools.count()
        self._rng = torch.Generator().manual_seed(seed)
        self._rng_lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(workers)
        self.max_new_tokens = max_new_tokens

    # --- the Policy contract --------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._weights.module.config.max_len

    @property
    def vocab_size(self) -> int:
        """Ids the model embeds (0..vocab_size - 1); the server refuses others with a 400."""
        return self._weights.module.config.vocab_size

    async def generate(
        self, messages: Sequence[Message], tools: Sequence[Tool] | None, sampling: SamplingParams
    ) -> Generation:
        text = self._tokenizer.apply_chat_template(messages, tools)
        ids = self._tokenizer.encode(text)
        return await anyio.to_thread.run_sync(
            self.sample, ids, sampling, True, limiter=self._limiter
        )

    async def complete(self, prompt: str | Sequence[int], sampling: SamplingParams) -> Generation:
        ids = self._tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await anyio.to_thread.run_sync(
            self.sample, ids, sampling, False, limiter=self._limiter
        )

    # --- weights --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._weights.version

    @property
    def config(self) -> TinyConfig:
        return self._weights.module.config

    def state_dict(self) -> dict[str, Tensor]:
        """A copy of the served weights."""
        return {k: v.detach().clone() for k, v in self._weights.module.state_dict().items()}

    def module_copy(self) -> TinyTransformer:
        """A trainable copy of the served module (e.g. for a trainer)."""
        module = copy.deepcopy(self._weights.module)
        module.train()
        return module

    def load_state_dict(self, state_dict: Mapping[str, Tensor], *, version: int) -> None:
        """Serve ``state_dict`` as ``version`` from the next request on.

        Requests in flight finish on the weights they started with. Raises ``ValueError``
        (and keeps serving the old weights) if the keys or shapes do not fit the model,
        or if ``version`` is older than the one served.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"policy version must be an int, not {version!r}")
        with self._swap_lock:
            current = self._weights
            if version < current.version:
                raise ValueError(
                    f"policy version {version} is older than the served version "
                    f"{current.version}; versions only move forward"
                )
            module = copy.deepcopy(current.module)
            try:
                module.load_state_dict(dict(state_dict), strict=True)
            except RuntimeError as exc:
                raise ValueError(f"these weights do not fit {self._name}: {exc}") from exc
            module.eval()
            self._weights = _Weights(module, version)

    # --- the record -----------------------------------------------------------------------

    def records(self) -> list[SampleRecord]:
        with self._record_lock:
            return list(self._records)

    def clear_records(self) -> None:
        with self._record_lock:
            self._records.clear()

    # --- sampling -------------------------------------------------------------------------

    def sample(self, prompt_ids: Sequence[int], sampling: SamplingParams, chat: bool) -> Generation:
        """One completion of ``prompt_ids`` (blocking; :meth:`generate` runs it in a thread)."""
        weights = self._weights  # read once: this request's weights and version
        model, tok = weights.module, self._tokenizer
        limit = model.config.max_len
        budget = sampling.max_tokens if sampling.max_tokens is not None else self.max_new_tokens
        budget = min(budget, max(0, limit - len(prompt_ids)))
        for t in prompt_ids:
            if not 0 <= t < model.config.vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary")
        gen = self._generator(sampling)
        ids = list(prompt_ids)
        out: list[int] = []
        logprobs: list[float] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        finish: FinishReason = "length"
        stop_reason: str | int | None = None
        stops = {tok.im_end_id, tok.eos_token_id}
        with torch.no_grad():
            while len(out) < budget:
                logits = model(torch.tensor([ids]))[0, -1].float()
                token, logp = self._pick(logits, sampling, gen)
                if sampling.top_logprobs:
                    values, index = torch.topk(logp, sampling.top_logprobs)
                    tops.append(tuple(zip(index.tolist(), values.tolist(), strict=True)))
                out.append(token)
                logprobs.append(float(logp[token]))
                ids.append(token)
                if token in stops:
                    finish = "stop"
                    break
                hit = self._stop_string(out, sampling.stop)
                if hit is not None:
                    finish, stop_reason = "stop", hit
                    break
        body = tok.decode([t for t in out if t not in stops])
        if stop_reason is not None:  # the stop string's tokens stay in ``out``, as in vLLM
            at = body.find(str(stop_reason))
            keep = sampling.include_stop_str_in_output
            body = body[: at + len(str(stop_reason))] if keep else body[:at]
        calls: tuple[ToolCall, ...] = ()
        text: str | None = body
        if chat and finish == "stop" and stop_reason is None:
            content, parsed = parse_assistant(body)
            if parsed and sampling.tool_choice != "none":
                text = content
                calls = tuple(
                    ToolCall(f"call_{next(self._ids)}", c.name, c.arguments) for c in parsed
                )
                finish = "tool_calls"
        prompt_lps: tuple[float | None, ...] = ()
        prompt_tops: tuple[tuple[tuple[int, float], ...] | None, ...] = ()
        if sampling.prompt_logprobs is not None and prompt_ids:
            prompt_lps, prompt_tops = self._prompt_logprobs(
                model, list(prompt_ids), sampling.prompt_logprobs
            )
        record = SampleRecord(
            sample_id=next(self._ids),
            policy_version=weights.version,
            prompt_ids=tuple(prompt_ids),
            token_ids=tuple(out),
            logprobs=tuple(logprobs),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            finish_reason=finish,
        )
        with self._record_lock:
            self._records.append(record)
        return Generation(
            text=text,
            tool_calls=calls,
            finish_reason=finish,
            prompt_token_ids=tuple(prompt_ids),
            token_ids=tuple(out),
            logprobs=tuple(logprobs),
            top_logprobs=tuple(tops),
            stop_reason=stop_reason,
            metadata={"policy_version": weights.version, "sample_id": record.sample_id},
            prompt_logprobs=prompt_lps,
            prompt_top_logprobs=prompt_tops,
        )

    @staticmethod
    def _prompt_logprobs(
        model: TinyTransformer, prompt_ids: list[int], k: int
    ) -> tuple[tuple[float | None, ...], tuple[tuple[tuple[int, float], ...] | None, ...]]:
        """The model's (untempered) logprob of each prompt token given those before it."""
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt_ids]))[0, :-1].float(), dim=-1)
        nxt = torch.tensor(prompt_ids[1:], dtype=torch.long)
        chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
        tops: list[tuple[tuple[int, float], ...] | None] = [None]
        for row in logp:
            if k:
                values, index = torch.topk(row, k)
                tops.append(tuple(zip(index.tolist(), values.tolist(), strict=True)))
            else:
                tops.append(())
        return (None, *chosen), tuple(tops)

    def _generator(self, sampling: SamplingParams) -> torch.Generator | None:
        if sampling.seed is None:
            return None
        return torch.Generator().manual_seed(sampling.seed * 1_000_003 + sampling.sample_index)

    def _pick(
        self, logits: Tensor, sampling: SamplingParams, gen: torch.Generator | None
    ) -> tuple[int, Tensor]:
        if sampling.temperature <= 0:
            logp = torch.log_softmax(logits, dim=-1)
            return int(torch.argmax(logp)), logp
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        probs = _filter_top_p(logp.exp(), sampling.top_p)
        if gen is None:
            with self._rng_lock:
                token = int(torch.multinomial(probs, 1, generator=self._rng))
        else:
            token = int(torch.multinomial(probs, 1, generator=gen))
        return token, logp

    def _stop_string(self, out: list[int], stops: Sequence[str]) -> str | None:
        if not stops:
            return None
        text = self._tokenizer.decode(out)
        for stop in stops:
            if stop and stop in text:
                return stop
        return None


# --- weights over the wire --------------------------------------------------------------------


def dump_state_dict(state_dict: Mapping[str, Tensor]) -> bytes:
    """``torch.save`` bytes of a state dict (what ``POST /policy/weights`` takes)."""
    buf = io.BytesIO()
    torch.save(dict(state_dict), buf)
    return buf.getvalue()


def load_state_dict_bytes(data: bytes) -> dict[str, Tensor]:
    """The inverse of :func:`dump_state_dict`; tensors only (``weights_only``)."""
    obj = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError("the body is not a state dict (a mapping of names to tensors)")
    return obj


def create_torch_policy_app(policy: TorchPolicy) -> Any:
    """envport's OpenAI-compatible server for ``policy``, plus the weight routes.

    ``GET /policy/version`` → ``{"model", "policy_version"}``;
    ``POST /policy/weights?version=N`` with a :func:`dump_state_dict` body swaps weights
    (400 with an OpenAI-shaped error if they do not fit or ``N`` is missing or older);
    ``GET /policy/samples?since=ID`` → the sample record (``sample_id >= since``).
    """
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from envport.policy.server import APIError, create_policy_app

    app = create_policy_app(policy)

    async def version(request: Request) -> Response:
        return JSONResponse({"model": policy.name, "policy_version": policy.version})

    async def weights(request: Request) -> Response:
        raw = request.query_params.get("version")
        try:
            new_version = int(raw) if raw is not None else None
        except ValueError:
            new_version = None
        if new_version is None:
            return APIError(
                "POST /policy/weights needs ?version=N (an integer).",
                param="version",
                code="missing_version",
            ).response()
        body = await request.body()
        try:
            state = await anyio.to_thread.run_sync(load_state_dict_bytes, body)
            await anyio.to_thread.run_sync(
                lambda: policy.load_state_dict(state, version=new_version)
            )
        except Exception as exc:
            return APIError(str(exc), param="body", code="invalid_weights").response()
        return JSONResponse({"model": policy.name, "policy_version": policy.version})

    async def samples(request: Request) -> Response:
        try:
            since = int(request.query_params.get("since", "0"))
        except ValueError:
            return APIError("since must be an integer", param="since").response()
        rows = [
            {
                "sample_id": r.sample_id,
                "policy_version": r.policy_version,
                "prompt_ids": list(r.prompt_ids),
                "token_ids": list(r.token_ids),
                "logprobs": list(r.logprobs),
                "finish_reason": r.finish_reason,
            }
            for r in policy.records()
            if r.sample_id >= since
        ]
        return JSONResponse({"samples": rows})

    app.add_route("/policy/version", version, methods=["GET"])
    app.add_route("/policy/weights", weights, methods=["POST"])
    app.add_route("/policy/samples", samples, methods=["GET"])
    return app
