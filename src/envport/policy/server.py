"""An OpenAI-compatible server in front of any :class:`~envport.policy.base.Policy`.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (both with SSE
streaming), ``GET /v1/models``, ``GET /health``.

Responses follow vLLM's format with ``return_token_ids``: ``prompt_token_ids`` at the top
level of a chat response (when streaming, on each choice's opening role chunk, sent
for every choice before any content, with null logprobs as vLLM does; on each choice for
``/v1/completions``, which may batch prompts, and on each choice's first chunk when
streaming, even an empty completion's) and ``token_ids`` on each choice (on each chunk
when streaming; concatenated they are the completion's ids, the end-of-turn token
included). Streamed completions carry the legacy logprobs of each chunk's own tokens.
**Decision:** token ids are always included unless the request says
``"return_token_ids": false``; clients that do not know the fields ignore them, and a
recording gateway wants them without having to ask. Logprobs come in OpenAI's shapes
when asked for (``logprobs: true`` / ``top_logprobs`` for chat, ``logprobs: N`` for
completions). ``/v1/completions`` takes a text, a list of texts, token ids or a list of
token-id lists (each prompt its own ``n`` choices), and ``echo``: the prompt's text comes
before the completion's, and with ``logprobs`` the prompt's tokens come first in them (the
first with ``None``), as vLLM reports them; ``token_ids`` stay the completion's. Unlike
vLLM, echo keeps the prompt text when token ids are returned (vLLM then echoes ``""``).
Any ``model`` name is accepted; responses carry the policy's own name.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with 400 for
malformed JSON and invalid fields (a token-id prompt with an id outside the vocabulary
included, as vLLM does; a prompt that leaves no room in the context, or prompt plus
``max_tokens`` beyond it, with vLLM's messages and code ``context_length_exceeded``),
404/405 for unknown routes, 500 if the policy fails.

Fault injection, for testing what sits in front (gateways, harnesses), is off unless the
app is built with ``faults=True``. Then a request header ``X-Envport-Fault`` (or a fault
queued with ``app.state.faults.push(...)``, which wins) applies to that request:

- ``500`` (any status 400-599): that status with an OpenAI-shaped error body;
- ``garbage``: status 200 with a body that is not JSON (not SSE JSON when streaming);
- ``slow:SECONDS``: wait that long, then answer normally;
- ``cut-stream``: start the response, send part of it, and drop the connection.

``python -m envport.policy.server --port N`` serves the scripted policy on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import json
import logging
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from envport.policy.base import Generation, Policy, SamplingParams, Tokenizer
from envport.policy.tokenizer import render_tool_call

log = logging.getLogger(__name__)

FAULT_HEADER = "x-envport-fault"
_MAX_SLOW_S = 600.0

# --- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status)


def _from_validation(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    missing = first["type"] == "missing"
    message = f"'{param}' is a required property" if missing else f"{param}: {first['msg']}"
    code = "missing_required_parameter" if missing else "invalid_value"
    return APIError(message, param=param, code=code)


# --- faults -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` is ``status``, ``garbage``, ``slow`` or ``cut-stream``."""

    kind: Literal["status", "garbage", "slow", "cut-stream"]
    status: int = 500
    seconds: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        spec = spec.strip().lower()
        if spec.isdigit() and 400 <= int(spec) <= 599:
            return cls("status", status=int(spec))
        if spec == "garbage":
            return cls("garbage")
        if spec in ("cut-stream", "cut"):
            return cls("cut-stream")
        if spec.startswith("slow:"):
            try:
                seconds = float(spec[5:])
            except ValueError:
                seconds = -1.0
            if 0.0 <= seconds <= _MAX_SLOW_S:
                return cls("slow", seconds=seconds)
        raise APIError(
            f"Unknown fault {spec!r}; use a status 400-599, 'garbage', 'slow:SECONDS' "
            f"(at most {_MAX_SLOW_S:g}) or 'cut-stream'.",
            param=FAULT_HEADER,
            code="invalid_fault",
        )


class FaultInjector:
    """Faults for the next requests (queued, first) or per request (the header).

    Thread-safe, so a test can queue faults while the server runs in another thread.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._queue: deque[Fault] = deque()
        self._lock = threading.Lock()

    def push(self, spec: str, times: int = 1) -> None:
        """Apply ``spec`` to each of the next ``times`` POST requests."""
        if not self.enabled:
            raise RuntimeError("Fault injection is off; build the app with faults=True.")
        fault = Fault.parse(spec)
        with self._lock:
            self._queue.extend([fault] * times)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    def take(self, request: Request) -> Fault | None:
        if not self.enabled:
            return None
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        header = request.headers.get(FAULT_HEADER)
        return Fault.parse(header) if header else None


class _CutResponse(Response):
    """Start a response, send the first ``parts`` of it, then drop the connection."""

    def __init__(self, status: int, headers: dict[str, str], parts: list[bytes]) -> None:
        super().__init__(status_code=status)
        # Exactly these headers: Response would add "content-length: 0" for an empty body.
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.parts = parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        for part in self.parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        # Returning without the final body message makes the server close the connection.


def _cut(status: int, media_type: str, body_parts: list[bytes]) -> _CutResponse:
    if media_type == "text/event-stream":
        return _CutResponse(status, {"content-type": media_type}, body_parts[:2])
    body = b"".join(body_parts)
    headers = {"content-type": media_type, "content-length": str(len(body))}
    return _CutResponse(status, headers, [body[: len(body) // 2]])


# --- requests ---------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False


class FunctionDef(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class _Request(_Model):
    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    include_stop_str_in_output: bool = False

    def check(self) -> None:
        """Cross-field rules vLLM refuses with a 400 (its request validators)."""
        options = self.stream_options
        given = options is not None and bool(options.model_fields_set or options.model_extra)
        if given and not self.stream:  # vLLM lets an empty ``{}`` through
            raise APIError(
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
                code="invalid_value",
            )

    @property
    def include_token_ids(self) -> bool:
        return self.return_token_ids is not False

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(
        self,
        index: int,
        *,
        top_logprobs: int,
        tool_choice: Any = "auto",
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=self.max_tokens,
            seed=self.seed,
            stop=stop,
            top_logprobs=top_logprobs,
            sample_index=index,
            tool_choice=tool_choice,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
        )


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                "when using `top_logprobs`, `logprobs` must be set to true.",
                param="top_logprobs",
                code="invalid_value",
            )


class CompletionRequest(_Request):
    """``prompt`` is text, a list of texts, token ids, or a list of token-id lists; each
    prompt of a list is its own group of ``n`` choices (indexes ``prompt * n + i``)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


async def _parse(request: Request, model: type[_Request]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise APIError(f"The request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.", code="invalid_json")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc) from exc
    req.check()
    return req


# --- responses --------------------------------------------------------------------------------


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _logprob_entry(tok: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": tok.token_str(token_id),
        "logprob": logprob,
        "bytes": list(tok.token_bytes(token_id)),
    }


def _chat_logprobs(
    tok: Tokenizer, gen: Generation, start: int, stop: int, top: int
) -> dict[str, Any]:
    content = []
    for i in range(start, stop):
        entry = _logprob_entry(tok, gen.token_ids[i], gen.logprobs[i])
        alts = gen.top_logprobs[i][:top] if top and gen.top_logprobs else ()
        entry["top_logprobs"] = [_logprob_entry(tok, t, lp) for t, lp in alts]
        content.append(entry)
    return {"content": content}


def _tool_calls_json(gen: Generation) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in gen.tool_calls
    ]


@dataclasses.dataclass(frozen=True)
class _Segment:
    """A stretch of a completion's tokens and the delta it streams as."""

    start: int
    stop: int
    delta: dict[str, Any]


def _segments(tok: Tokenizer, gen: Generation, chunk_tokens: int = 4) -> list[_Segment]:
    """Cut a generation into stream deltas; the token ranges cover every id exactly once.

    Content streams a few tokens at a time (an incremental UTF-8 decoder keeps
    multi-byte characters whole); each tool call streams as a header (id, name) and its
    arguments; whatever is left (the end-of-turn token) rides on the final chunk.
    """
    ids = gen.token_ids
    segments: list[_Segment] = []
    pos = 0
    content = gen.text or ""
    content_ids = tok.encode(content)
    if content and tuple(content_ids) == ids[: len(content_ids)]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for start in range(0, len(content_ids), chunk_tokens):
            stop = min(start + chunk_tokens, len(content_ids))
            data = b"".join(tok.token_bytes(t) for t in content_ids[start:stop])
            text = decoder.decode(data, final=stop == len(content_ids))
            segments.append(_Segment(start, stop, {"content": text}))
        pos = len(content_ids)
    elif content:
        segments.append(_Segment(0, 0, {"content": content}))
    for index, call in enumerate(gen.tool_calls):
        header = {"index": index, "id": call.id, "type": "function"}
        header["function"] = {"name": call.name, "arguments": ""}
        segments.append(_Segment(pos, pos, {"tool_calls": [header]}))
        sep = "\n" if (index > 0 or content) else ""
        call_ids = tok.encode(sep + render_tool_call(call.name, call.arguments))
        stop = pos + len(call_ids) if tuple(call_ids) == ids[pos : pos + len(call_ids)] else pos
        args = {"index": index, "function": {"arguments": call.arguments}}
        segments.append(_Segment(pos, stop, {"tool_calls": [args]}))
        pos = stop
    return segments


class _Handler:
    """The route handlers of one app: one policy, one fault injector."""

    def __init__(self, policy: Policy, faults: FaultInjector) -> None:
        self.policy = policy
        self.faults = faults
        self.counts: Counter[str] = Counter()

    # --- shared ---------------------------------------------------------------------------

    async def _generate(self, calls: Iterable[Any]) -> list[Generation]:
        try:
            return [await call() for call in calls]
        except APIError:
            raise
        except Exception as exc:
            log.exception("policy %s failed", self.policy.name)
            raise APIError(
                f"The policy failed: {type(exc).__name__}: {exc}",
                status=500,
                type="server_error",
                code="policy_error",
            ) from exc

    def _check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> None:
        """Refuse a request that cannot fit the context, in vLLM's words, before generating.

        A prompt must leave room for one token; with ``max_tokens``, prompt plus
        ``max_tokens`` must fit (vLLM refuses rather than silently generating fewer).
        """
        limit = self.policy.max_model_len
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the "
                "input messages.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{prompt_len} input tokens ({max_tokens} > {limit} - {prompt_len}).",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def _check_generated(
        self, gens: Sequence[Generation], max_tokens: int | None, param: str
    ) -> None:
        """The same check on the prompt ids a policy reports (it tokenizes the prompt)."""
        for gen in gens:
            self._check_length(len(gen.prompt_token_ids), max_tokens, param)

    def _vocab_size(self) -> int | None:
        size = getattr(self.policy, "vocab_size", None)
        if size is None:
            size = getattr(self.policy.tokenizer, "vocab_size", None)
        return size if isinstance(size, int) else None

    def _check_token_ids(self, prompts: Sequence[str | list[int]]) -> None:
        """A token-id prompt with an id outside the vocabulary is the client's error (400).

        vLLM refuses it before generating ("Token id N is out of vocabulary"); without this
        check the policy would fail mid-generation and the client would see a 500 it retries.
        """
        size = self._vocab_size()
        for prompt in prompts:
            if isinstance(prompt, str):
                continue
            bad = next((t for t in prompt if t < 0 or (size is not None and t >= size)), None)
            if bad is not None:
                limit = f" (this model's ids are 0..{size - 1})" if size is not None else ""
                raise APIError(
                    f"Token id {bad} is out of vocabulary{limit}.",
                    param="prompt",
                    code="invalid_value",
                )

    async def _fault(self, request: Request) -> Fault | None:
        fault = self.faults.take(request)
        if fault is not None and fault.kind == "slow":
            await anyio.sleep(fault.seconds)
        return fault

    def _finish(self, fault: Fault | None, body: Response, parts: list[bytes]) -> Response:
        if fault is None or fault.kind == "slow":
            return body
        media = body.media_type or "application/json"
        if fault.kind == "garbage":
            if media == "text/event-stream":
                return Response(b"data: {this is not json\n\n" + _DONE, media_type=media)
            return Response(b"<html>this is not json", media_type="application/json")
        return _cut(200, media, parts)

    def _meta(self, prefix: str) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.policy.name,
        }

    # --- routes ---------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        self.counts["chat"] += 1
        try:
            fault = await self._fault(request)
            if fault is not None and fault.kind == "status":
                raise _injected(fault)
            req: ChatRequest = await _parse(request, ChatRequest)
            if req.max_completion_tokens is not None and req.max_tokens is None:
                req.max_tokens = req.max_completion_tokens
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            top = (req.top_logprobs or 0) if req.logprobs else 0
            choice = req.tool_choice or "auto"
            tok = self.policy.tokenizer
            prompt_ids = tok.encode(tok.apply_chat_template(messages, tools))
            self._check_length(len(prompt_ids), req.max_tokens, "messages")
            gens = await self._generate(
                (
                    lambda i=i: self.policy.generate(
                        messages, tools, req.sampling(i, top_logprobs=top, tool_choice=choice)
                    )
                )
                for i in range(req.n)
            )
            self._check_generated(gens, req.max_tokens, "messages")
        except APIError as exc:
            return exc.response()
        meta = self._meta("chatcmpl")
        if req.stream:
            parts = list(self._chat_stream(req, gens, meta, top))
            return self._finish(fault, _stream_response(parts), parts)
        body = self._chat_body(req, gens, meta, top)
        encoded = json.dumps(body, ensure_ascii=False).encode("utf-8")
        return self._finish(fault, _json_response(encoded), [encoded])

    def _chat_body(
        self, req: ChatRequest, gens: list[Generation], meta: dict[str, Any], top: int
    ) -> dict[str, Any]:
        tok = self.policy.tokenizer
        choices = []
        for index, gen in enumerate(gens):
            choice: dict[str, Any] = {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": gen.text,
                    "tool_calls": _tool_calls_json(gen),
                },
                "logprobs": _chat_logprobs(tok, gen, 0, len(gen.token_ids), top)
                if req.logprobs
                else None,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
            }
            if req.include_token_ids:
                choice["token_ids"] = list(gen.token_ids)
            choices.append(choice)
        body: dict[str, Any] = {
            **meta,
            "object": "chat.completion",
            "choices": choices,
            "usage": _usage(len(gens[0].prompt_token_ids), sum(len(g.token_ids) for g in gens)),
            "system_fingerprint": self.policy.name,
        }
        if req.include_token_ids:
            body["prompt_token_ids"] = list(gens[0].prompt_token_ids)
        return body

    def _chat_stream(
        self, req: ChatRequest, gens: list[Generation], meta: dict[str, Any], top: int
    ) -> Iterable[bytes]:
        tok = self.policy.tokenizer
        base = {**meta, "object": "chat.completion.chunk", "system_fingerprint": self.policy.name}

        def chunk(
            index: int,
            delta: dict[str, Any],
            gen: Generation,
            start: int,
            stop: int,
            finish: str | None = None,
        ) -> dict[str, Any]:
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": _chat_logprobs(tok, gen, start, stop, top) if req.logprobs else None,
                "finish_reason": finish,
            }
            if finish is not None:
                choice["stop_reason"] = gen.stop_reason
            if req.include_token_ids:
                choice["token_ids"] = list(gen.token_ids[start:stop])
            return {**base, "choices": [choice]}

        # As vLLM does: first a role chunk for every choice (no logprobs, no token ids, the
        # prompt's ids on each), then each choice's content.
        for index, gen in enumerate(gens):
            role = {"index": index, "delta": {"role": "assistant", "content": ""}}
            first = {**base, "choices": [{**role, "logprobs": None, "finish_reason": None}]}
            if req.include_token_ids:
                first["prompt_token_ids"] = list(gen.prompt_token_ids)
            yield _sse(first)
        for index, gen in enumerate(gens):
            pos = 0
            for seg in _segments(tok, gen):
                yield _sse(chunk(index, seg.delta, gen, seg.start, seg.stop))
                pos = seg.stop
            yield _sse(chunk(index, {}, gen, pos, len(gen.token_ids), gen.finish_reason))
        if req.include_usage_chunk:
            usage = _usage(len(gens[0].prompt_token_ids), sum(len(g.token_ids) for g in gens))
            yield _sse({**base, "choices": [], "usage": usage})
        yield _DONE

    async def completions(self, request: Request) -> Response:
        self.counts["completions"] += 1
        try:
            fault = await self._fault(request)
            if fault is not None and fault.kind == "status":
                raise _injected(fault)
            req: CompletionRequest = await _parse(request, CompletionRequest)
            prompts = _prompts(req.prompt)
            self._check_token_ids(prompts)
            tok = self.policy.tokenizer
            for p in prompts:
                n_ids = len(tok.encode(p)) if isinstance(p, str) else len(p)
                self._check_length(n_ids, req.max_tokens, "prompt")
            top = req.logprobs or 0
            # echo with logprobs also reports the prompt tokens' logprobs, as vLLM does
            want_prompt = req.logprobs if req.echo and req.logprobs is not None else None
            gens = await self._generate(
                (
                    lambda p=p, i=i: self.policy.complete(
                        p, req.sampling(i, top_logprobs=top, prompt_logprobs=want_prompt)
                    )
                )
                for p in prompts
                for i in range(req.n)
            )
            self._check_generated(gens, req.max_tokens, "prompt")
            if want_prompt is not None and any(
                len(g.prompt_logprobs) != len(g.prompt_token_ids) for g in gens
            ):
                raise APIError(
                    f"{self.policy.name} does not report prompt logprobs, so echo cannot be "
                    "combined with logprobs here; drop one of them.",
                    param="echo",
                    code="unsupported_parameter",
                )
        except APIError as exc:
            return exc.response()
        echoes = [
            (p if isinstance(p, str) else tok.decode(p)) if req.echo else ""
            for p in prompts
            for _ in range(req.n)
        ]
        meta = self._meta("cmpl")
        if req.stream:
            parts = list(self._completion_stream(req, gens, meta, echoes))
            return self._finish(fault, _stream_response(parts), parts)
        body = self._completion_body(req, gens, meta, len(prompts), echoes)
        encoded = json.dumps(body, ensure_ascii=False).encode("utf-8")
        return self._finish(fault, _json_response(encoded), [encoded])

    def _legacy_logprobs(
        self,
        gen: Generation,
        top: int | None,
        start: int = 0,
        stop: int | None = None,
        offset: int = 0,
        echo: bool = False,
    ) -> dict[str, Any] | None:
        """Legacy (``/v1/completions``) logprobs of ``gen.token_ids[start:stop]``.

        ``text_offset`` counts from ``offset`` (vLLM streams each chunk's offsets from the
        length of the text already sent). With ``echo`` the prompt's tokens come first, the
        first of them with ``None`` for its logprob and alternatives (nothing predicts it).

        As in vLLM, ``top_logprobs`` is a list of one dict per token whenever logprobs were
        asked for, ``logprobs: 0`` included: each dict has the chosen token first, then up
        to ``top`` alternatives (so ``logprobs: 0`` gives ``{token: logprob}`` per token,
        not ``null``).
        """
        if top is None:
            return None
        tok = self.policy.tokenizer
        stop = len(gen.token_ids) if stop is None else stop
        ids: list[int] = list(gen.token_ids[start:stop])
        lps: list[float | None] = list(gen.logprobs[start:stop])
        alts: list[tuple[tuple[int, float], ...] | None] = list(gen.top_logprobs[start:stop])
        alts += [()] * (len(ids) - len(alts))  # a policy that reports no alternatives
        if echo:
            prompt_alts = list(gen.prompt_top_logprobs)
            prompt_alts += [()] * (len(gen.prompt_token_ids) - len(prompt_alts))
            ids = list(gen.prompt_token_ids) + ids
            lps = list(gen.prompt_logprobs) + lps
            alts = prompt_alts + alts
        tokens = [tok.token_str(t) for t in ids]
        offsets, pos = [], offset
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        tops: list[dict[str, float] | None] = []
        for token, lp, step in zip(tokens, lps, alts, strict=True):
            if lp is None:  # the echoed prompt's first token: nothing predicts it
                tops.append(None)
                continue
            entry = {token: lp}
            for t, alt_lp in (step or ())[:top]:
                entry.setdefault(tok.token_str(t), alt_lp)
            tops.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _completion_body(
        self,
        req: CompletionRequest,
        gens: list[Generation],
        meta: dict[str, Any],
        n_prompts: int,
        echoes: list[str],
    ) -> dict[str, Any]:
        choices = []
        for index, gen in enumerate(gens):
            choice: dict[str, Any] = {
                "index": index,
                "text": echoes[index] + (gen.text or ""),
                "logprobs": self._legacy_logprobs(gen, req.logprobs, echo=req.echo),
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
            }
            if req.include_token_ids:
                choice["prompt_token_ids"] = list(gen.prompt_token_ids)
                choice["token_ids"] = list(gen.token_ids)
            choices.append(choice)
        prompt_tokens = sum(len(gens[i * req.n].prompt_token_ids) for i in range(n_prompts))
        return {
            **meta,
            "object": "text_completion",
            "choices": choices,
            "usage": _usage(prompt_tokens, sum(len(g.token_ids) for g in gens)),
        }

    def _completion_stream(
        self,
        req: CompletionRequest,
        gens: list[Generation],
        meta: dict[str, Any],
        echoes: list[str],
    ) -> Iterable[bytes]:
        """Each choice streams its segments, then a final chunk with the finish reason.

        As vLLM does with ``return_token_ids``, a choice's first chunk carries its
        ``prompt_token_ids`` (the final chunk is the first one when the completion is
        empty), every chunk carries ``token_ids`` for its own tokens and, when logprobs
        were asked for, the legacy logprobs of those tokens. With ``echo`` the first chunk's
        text and logprobs begin with the prompt's (its ``token_ids`` stay the completion's).
        """
        base = {**meta, "object": "text_completion"}
        for index, gen in enumerate(gens):
            for choice in self._completion_choice_chunks(req, index, gen, echoes[index]):
                yield _sse({**base, "choices": [choice]})
        if req.include_usage_chunk:
            usage = _usage(
                sum(len(g.prompt_token_ids) for g in gens[:: req.n]),
                sum(len(g.token_ids) for g in gens),
            )
            yield _sse({**base, "choices": [], "usage": usage})
        yield _DONE

    def _completion_choice_chunks(
        self, req: CompletionRequest, index: int, gen: Generation, echo: str
    ) -> Iterable[dict[str, Any]]:
        pieces = [
            (seg.delta.get("content", ""), seg.start, seg.stop)
            for seg in _segments(self.policy.tokenizer, gen)
        ]
        pieces.append(("", pieces[-1][2] if pieces else 0, len(gen.token_ids)))
        sent = 0  # characters already streamed: vLLM's text_offset base for the next chunk
        for n, (text, start, stop) in enumerate(pieces):
            last = n == len(pieces) - 1
            text = echo + text if n == 0 else text
            echoed = req.echo and n == 0
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": self._legacy_logprobs(gen, req.logprobs, start, stop, sent, echoed),
                "finish_reason": gen.finish_reason if last else None,
            }
            if last:
                choice["stop_reason"] = gen.stop_reason
            if req.include_token_ids:
                if n == 0:
                    choice["prompt_token_ids"] = list(gen.prompt_token_ids)
                choice["token_ids"] = list(gen.token_ids[start:stop])
            sent += len(text)
            yield choice

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.policy.name,
            "object": "model",
            "created": 0,
            "owned_by": "envport",
            "root": self.policy.name,
            "max_model_len": self.policy.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "healthy", "model": self.policy.name})


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts: one text or token-id list per choice group."""
    if isinstance(prompt, str):
        return [prompt]
    ids = [p for p in prompt if isinstance(p, int)]
    if len(ids) == len(prompt):
        return [ids]
    out: list[str | list[int]] = []
    for index, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p:
            out.append([int(t) for t in p])
        else:
            raise APIError(
                f"prompt[{index}] must be a text or a non-empty list of token ids.",
                param="prompt",
            )
    return out


def _injected(fault: Fault) -> APIError:
    kind = (
        "rate_limit_error"
        if fault.status == 429
        else ("server_error" if fault.status >= 500 else "invalid_request_error")
    )
    return APIError(
        f"Injected fault: status {fault.status} (X-Envport-Fault).",
        status=fault.status,
        type=kind,
        code="injected_fault",
    )


def _json_response(encoded: bytes) -> Response:
    return Response(encoded, media_type="application/json")


def _stream_response(parts: list[bytes]) -> Response:
    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(message, status=exc.status_code, type=kind).response()


def create_policy_app(policy: Policy | None = None, *, faults: bool = False) -> Starlette:
    """An OpenAI-compatible app serving ``policy`` (the scripted policy if ``None``).

    ``app.state.policy`` is the policy, ``app.state.faults`` the :class:`FaultInjector`
    (inert unless ``faults=True``), ``app.state.counts`` the requests seen per route.
    """
    if policy is None:
        from envport.policy.scripted import ScriptedPolicy

        policy = ScriptedPolicy()
    handler = _Handler(policy, FaultInjector(faults))
    routes = [
        Route("/v1/chat/completions", handler.chat_completions, methods=["POST"]),
        Route("/v1/completions", handler.completions, methods=["POST"]),
        Route("/v1/models", handler.models, methods=["GET"]),
        Route("/health", handler.health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.policy = policy
    app.state.faults = handler.faults
    app.state.counts = handler.counts
    return app


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m envport.policy.server [--port N] [--seed S] [--p-correct P] [--faults]``."""
    import uvicorn

    from envport.policy.scripted import ScriptedPolicy

    parser = argparse.ArgumentParser(
        prog="python -m envport.policy.server",
        description="Serve envport's scripted policy (rules, not a model) as an OpenAI API.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p-correct", type=float, default=0.8)
    parser.add_argument("--faults", action="store_true", help="honour X-Envport-Fault headers")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    policy = ScriptedPolicy(seed=args.seed, p_correct=args.p_correct)
    app = create_policy_app(policy, faults=args.faults)
    print(
        f"envport-scripted (a scripted stand-in, not a model) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
