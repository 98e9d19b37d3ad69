"""Translate Anthropic Messages and OpenAI Responses to and from OpenAI Chat Completions.

The gateway's upstreams speak only Chat Completions (vLLM-shaped: responses may carry
``prompt_token_ids``, ``choices[].token_ids`` and ``choices[].logprobs.content``). Harnesses
built on the Anthropic Messages API or the OpenAI Responses API reach them through these
pure functions; the gateway records the chat request and response it actually exchanged,
so token ids and logprobs are captured whatever API the harness spoke.

For each API a trio:

- ``anthropic_to_chat(req)`` / ``responses_to_chat(req)``: a request as the harness sent
  it -> a Chat Completions request;
- ``chat_to_anthropic(resp, model)`` / ``chat_to_responses(resp, model)``: a chat
  completion -> the API's response object;
- ``chat_stream_to_anthropic(chunks, model)`` / ``chat_stream_to_responses(chunks, model)``:
  parsed chat completion chunks (the ``data:`` objects, without ``[DONE]``) -> the API's
  server-sent events as bytes, ready to write to the wire. Nothing is buffered: each chunk
  yields its events at once.

Mapping decisions (the complete list of what is lossy):

- Only ``choices[0]`` is translated back: neither API has ``n``, and neither request ever
  asks for more than one choice.
- Anthropic ``thinking`` / ``redacted_thinking`` blocks in requests are dropped, and so is
  the ``thinking`` parameter; a chat response's ``reasoning_content`` / ``reasoning`` is
  not turned into thinking blocks (they need a signature Anthropic would verify). The
  Responses API has an unsigned reasoning item, so there reasoning text comes back as a
  ``reasoning`` output item; ``reasoning`` items in Responses input are dropped.
- ``tool_result.is_error`` has no Chat Completions equivalent and is dropped (the tool
  message carries the result text unchanged). Images inside a tool result (or a
  ``function_call_output``) cannot ride on a tool message; they are sent in a user
  message right after the tool messages of that turn.
- Several system blocks become one system message whose content is a list of text parts
  (one block: a plain string). Responses ``developer`` messages become ``system``.
- Consecutive Anthropic messages of one role are combined into one turn first, as the
  Messages API does (their text parts joined as within one message).
- A final Anthropic ``assistant`` message (prefill) is sent with vLLM's
  ``continue_final_message: true, add_generation_prompt: false``.
- Anthropic ``metadata.user_id`` becomes ``user``; ``top_k`` is passed through (vLLM
  accepts it). ``cache_control``, ``service_tier``, ``store``, ``metadata`` (Responses),
  ``truncation``, ``prompt_cache_key``, ``background: false`` and ``include`` other than
  logprobs are dropped. Top-level keys this module does not know are passed through
  unchanged, so ``extra_body`` fields (``return_token_ids``, ``seed``...) reach the upstream.
- ``tool_use.input`` goes back upstream as ``json.dumps(input, ensure_ascii=False)``
  (``", "`` / ``": "`` separators, as vLLM's tool parsers and Python write arguments), so
  the re-rendered prompt matches the arguments the model generated in the usual case.
- Streaming requests ask for ``stream_options.include_usage`` so usage can be reported.
- A ``tool_choice`` of auto/none with no tools is left out (vLLM refuses a
  ``tool_choice`` without ``tools``; it means no tool call either way).
- Anthropic streams one content block at a time. Chat tool-call deltas that interleave
  (call 0's arguments after call 1 began) are reordered: a call's block starts once the
  open tool block's arguments are a complete JSON value (its arguments so far are sent
  with its start), or at the end of the stream.

Unsupported (raises :class:`TranslationError`, which the gateway answers with 400 in the
API's own error shape): server-side and Anthropic-defined tools (anything without an
``input_schema``), non-function Responses tools, ``document`` / ``search_result`` /
file-id inputs, ``previous_response_id`` / ``conversation`` / ``background: true``
(the gateway keeps no state), ``item_reference`` and built-in tool call items in
Responses input. Malformed upstream responses (no choices, tool arguments that are not a
JSON object in a non-streaming Anthropic reply) raise it with ``status=502``.

Errors while streaming: a chunk of the form ``{"error": {...}}`` (vLLM reports mid-stream
failures that way) becomes the API's error event and ends the stream. An exception raised
by ``chunks`` itself is turned into the same error event, which is yielded, and is then
re-raised so the gateway can record the failure.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import orjson

from envport.errors import EnvportError, ErrorCode

__all__ = [
    "TranslationError",
    "anthropic_error",
    "anthropic_to_chat",
    "chat_stream_to_anthropic",
    "chat_stream_to_responses",
    "chat_to_anthropic",
    "chat_to_responses",
    "openai_error",
    "responses_to_chat",
]

JSON = dict[str, Any]


# --- errors --------------------------------------------------------------------------------


class TranslationError(EnvportError):
    """A request (or upstream response) this module cannot translate.

    ``param`` names the offending field (``"messages.2.content.0.type"``); ``status`` is
    the HTTP status to answer with: 400 for the harness's request, 502 for an upstream
    response that cannot be expressed in the harness's API.
    """

    code = ErrorCode.VALIDATION_ERROR

    def __init__(self, message: str, param: str | None = None, *, status: int = 400) -> None:
        super().__init__(message, param=param)
        self.param = param
        self.status = status

    def to_anthropic(self) -> JSON:
        """The Anthropic error body for this error."""
        return anthropic_error(self.status, self.message)

    def to_openai(self) -> JSON:
        """The OpenAI error body for this error."""
        code = "invalid_value" if self.status == 400 else "upstream_error"
        return openai_error(self.status, self.message, self.param, code)


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

_OPENAI_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def anthropic_error(status: int, message: str) -> JSON:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_ERROR_TYPES.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSON:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _OPENAI_ERROR_TYPES.get(status)
    if kind is None:
        kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- shared helpers ------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _obj(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TranslationError(f"{param}: expected an object.", param)
    return value


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise TranslationError(f"{param}: expected an array.", param)
    return value


def _str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise TranslationError(f"{param}: expected a string.", param)
    return value


def _int(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TranslationError(f"{param}: expected a positive integer.", param)
    return value


def _first_choice(resp: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise TranslationError("The upstream response has no choices.", "choices", status=502)
    first: Mapping[str, Any] = choices[0]
    return first


def _text_of(content: Any) -> str:
    """The text of a chat message's content: a string, ``None`` or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
        )
    return str(content)


def _reasoning_of(message: Mapping[str, Any]) -> str:
    """A message's (or delta's) reasoning text: vLLM's ``reasoning_content`` or the
    newer ``reasoning``, whichever holds text (a server may send both, one ``null``)."""
    value = message.get("reasoning_content")
    if not isinstance(value, str) or not value:
        value = message.get("reasoning")
    return value if isinstance(value, str) else ""


def _usage_counts(resp: Mapping[str, Any]) -> tuple[int | None, int | None, int]:
    """(prompt tokens, completion tokens, cached prompt tokens) from ``usage``."""
    usage = resp.get("usage")
    if not isinstance(usage, Mapping):
        return None, None, 0
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return (
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else None,
        cached if isinstance(cached, int) else 0,
    )


def _image_part(url: str, detail: Any = None) -> JSON:
    image: JSON = {"url": url}
    if isinstance(detail, str) and detail != "auto":
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _content_value(parts: list[JSON]) -> str | list[JSON]:
    """A single text part as a plain string; anything else as a list of parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        text: str = parts[0]["text"]
        return text
    return parts


def _dumps(obj: Any) -> str:
    """JSON as Python's and vLLM's tool parsers write it (``", "`` and ``": "``), so a
    ``tool_use.input`` sent back re-renders as the arguments the model generated."""
    return json.dumps(obj, ensure_ascii=False)


def _drop_idle_tool_choice(chat: JSON) -> None:
    """Without tools, ``auto`` and ``none`` mean no tool call, which is what no
    ``tool_choice`` means; vLLM (like Chat Completions) rejects a ``tool_choice`` without
    ``tools``, and harnesses send one anyway (Codex: ``"auto"`` on every request, its
    tool-less compaction turns included). A forced choice stays, for upstream to refuse."""
    if "tools" not in chat and chat.get("tool_choice") in ("auto", "none"):
        del chat["tool_choice"]


def _passthrough(req: Mapping[str, Any], known: Iterable[str]) -> JSON:
    skip = set(known)
    return {k: v for k, v in req.items() if k not in skip}


# --- Anthropic Messages -> chat -----------------------------------------------------------

_ANTHROPIC_KNOWN = {
    "model",
    "max_tokens",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "metadata",
    "thinking",
    "service_tier",
    "container",
    "mcp_servers",
    "context_management",
    "inference_geo",
}


def _anthropic_image(block: Mapping[str, Any], param: str) -> JSON:
    source = _obj(block.get("source"), f"{param}.source")
    kind = source.get("type")
    if kind == "base64":
        media = _str(source.get("media_type"), f"{param}.source.media_type")
        data = _str(source.get("data"), f"{param}.source.data")
        return _image_part(f"data:{media};base64,{data}")
    if kind == "url":
        return _image_part(_str(source.get("url"), f"{param}.source.url"))
    raise TranslationError(
        f"{param}.source.type: image source {kind!r} is not supported (use base64 or url).",
        f"{param}.source.type",
    )


def _anthropic_blocks(content: Any, param: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks = _list(content, param)
    return [_obj(b, f"{param}.{i}") for i, b in enumerate(blocks)]


def _anthropic_tool_result(block: Mapping[str, Any], param: str, images: list[JSON]) -> JSON:
    call_id = _str(block.get("tool_use_id"), f"{param}.tool_use_id")
    texts: list[str] = []
    content = block.get("content")
    if content is not None:
        for j, part in enumerate(_anthropic_blocks(content, f"{param}.content")):
            kind = part.get("type")
            if kind == "text":
                texts.append(_str(part.get("text"), f"{param}.content.{j}.text"))
            elif kind == "image":
                images.append(_anthropic_image(part, f"{param}.content.{j}"))
            else:
                raise TranslationError(
                    f"{param}.content.{j}.type: {kind!r} is not supported in a tool result.",
                    f"{param}.content.{j}.type",
                )
    text: str | list[JSON]
    if len(texts) <= 1:
        text = texts[0] if texts else ""
    else:
        text = [{"type": "text", "text": t} for t in texts]
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _turn_blocks(content: Any, param: str) -> list[tuple[str, Mapping[str, Any]]]:
    """A turn's content blocks, each with its path (for errors)."""
    return [(f"{param}.{i}", b) for i, b in enumerate(_anthropic_blocks(content, param))]


def _anthropic_user(blocks: list[tuple[str, Mapping[str, Any]]]) -> list[JSON]:
    tool_messages: list[JSON] = []
    parts: list[JSON] = []
    images_from_results: list[JSON] = []
    for where, block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _str(block.get("text"), f"{where}.text")})
        elif kind == "image":
            parts.append(_anthropic_image(block, where))
        elif kind == "tool_result":
            tool_messages.append(_anthropic_tool_result(block, where, images_from_results))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise TranslationError(
                f"{where}.type: content block {kind!r} is not supported in a user message.",
                f"{where}.type",
            )
    out = list(tool_messages)
    parts = images_from_results + parts
    if parts:
        out.append({"role": "user", "content": _content_value(parts)})
    elif not tool_messages:
        out.append({"role": "user", "content": ""})
    return out


def _anthropic_assistant(blocks: list[tuple[str, Mapping[str, Any]]]) -> JSON:
    texts: list[str] = []
    calls: list[JSON] = []
    for where, block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(_str(block.get("text"), f"{where}.text"))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            calls.append(
                {
                    "id": _str(block.get("id"), f"{where}.id"),
                    "type": "function",
                    "function": {
                        "name": _str(block.get("name"), f"{where}.name"),
                        "arguments": _dumps(_obj(arguments, f"{where}.input")),
                    },
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise TranslationError(
                f"{where}.type: content block {kind!r} is not supported in an assistant message.",
                f"{where}.type",
            )
    message: JSON = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _anthropic_tools(tools: Any) -> list[JSON]:
    out: list[JSON] = []
    for i, raw in enumerate(_list(tools, "tools")):
        tool = _obj(raw, f"tools.{i}")
        kind = tool.get("type", "custom")
        if kind != "custom" or "input_schema" not in tool:
            raise TranslationError(
                f"tools.{i}: only client tools with an input_schema are supported "
                f"(got type {kind!r}).",
                f"tools.{i}.type",
            )
        function: JSON = {
            "name": _str(tool.get("name"), f"tools.{i}.name"),
            "parameters": dict(_obj(tool["input_schema"], f"tools.{i}.input_schema")),
        }
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _anthropic_tool_choice(value: Any, chat: JSON) -> None:
    choice = _obj(value, "tool_choice")
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        name = _str(choice.get("name"), "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise TranslationError(f"tool_choice.type: unknown tool choice {kind!r}.", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        chat["parallel_tool_calls"] = False


def anthropic_to_chat(req: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request -> an OpenAI Chat Completions request."""
    req = dict(_obj(req, "body"))
    chat: JSON = _passthrough(req, _ANTHROPIC_KNOWN)
    chat["model"] = _str(req.get("model"), "model")
    if "max_tokens" not in req:
        raise TranslationError("max_tokens: Field required", "max_tokens")
    chat["max_tokens"] = _int(req["max_tokens"], "max_tokens")

    messages: list[JSON] = []
    system = req.get("system")
    if system is not None:
        if isinstance(system, str):
            if system:
                messages.append({"role": "system", "content": system})
        else:
            parts = []
            for i, block in enumerate(_anthropic_blocks(system, "system")):
                if block.get("type") != "text":
                    raise TranslationError(
                        f"system.{i}.type: only text blocks are supported.", f"system.{i}.type"
                    )
                parts.append({"type": "text", "text": _str(block.get("text"), f"system.{i}")})
            if parts:
                messages.append({"role": "system", "content": _content_value(parts)})

    turns = _list(req.get("messages"), "messages")
    if not turns:
        raise TranslationError("messages: at least one message is required.", "messages")
    # Consecutive turns of one role are one turn, as the Messages API combines them.
    groups: list[tuple[str, list[tuple[str, Mapping[str, Any]]]]] = []
    for i, raw in enumerate(turns):
        turn = _obj(raw, f"messages.{i}")
        role = turn.get("role")
        if role not in ("user", "assistant"):
            raise TranslationError(
                f"messages.{i}.role: expected 'user' or 'assistant', got {role!r}.",
                f"messages.{i}.role",
            )
        blocks = _turn_blocks(turn.get("content"), f"messages.{i}.content")
        if groups and groups[-1][0] == role:
            groups[-1][1].extend(blocks)
        else:
            groups.append((role, blocks))
    for role, blocks in groups:
        if role == "user":
            messages.extend(_anthropic_user(blocks))
        else:
            messages.append(_anthropic_assistant(blocks))
    chat["messages"] = messages
    if turns and _obj(turns[-1], "messages").get("role") == "assistant":
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False

    if req.get("tools"):
        chat["tools"] = _anthropic_tools(req["tools"])
    if req.get("tool_choice") is not None:
        _anthropic_tool_choice(req["tool_choice"], chat)
        _drop_idle_tool_choice(chat)
    stops = req.get("stop_sequences")
    if stops:
        chat["stop"] = [
            _str(s, f"stop_sequences.{i}") for i, s in enumerate(_list(stops, "stop_sequences"))
        ]
    for key in ("temperature", "top_p", "top_k"):
        if req.get(key) is not None:
            chat[key] = req[key]
    metadata = req.get("metadata")
    if isinstance(metadata, Mapping) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    if req.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# --- chat -> Anthropic Messages -----------------------------------------------------------


def _anthropic_stop(finish: Any, vllm_stop: Any, has_calls: bool) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if finish in ("tool_calls", "function_call") or (has_calls and finish in ("stop", None)):
        return "tool_use", None
    if finish == "content_filter":
        return "refusal", None
    if isinstance(vllm_stop, str) and vllm_stop:
        return "stop_sequence", vllm_stop
    return "end_turn", None


def _anthropic_usage(resp: Mapping[str, Any], output_fallback: int = 0) -> JSON:
    prompt, completion, cached = _usage_counts(resp)
    usage: JSON = {
        "input_tokens": max((prompt or 0) - cached, 0),
        "output_tokens": completion if completion is not None else output_fallback,
    }
    if cached:
        usage["cache_read_input_tokens"] = cached
    return usage


def _parse_arguments(arguments: Any, param: str) -> JSON:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError) as exc:
        raise TranslationError(
            f"{param}: the model's tool arguments are not valid JSON: {arguments!r}",
            param,
            status=502,
        ) from exc
    if not isinstance(value, dict):
        raise TranslationError(
            f"{param}: the model's tool arguments are not a JSON object: {arguments!r}",
            param,
            status=502,
        )
    return value


def chat_to_anthropic(resp: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion -> an Anthropic ``Message`` (``model`` is the name to report)."""
    choice = _first_choice(resp)
    message = choice.get("message")
    message = message if isinstance(message, Mapping) else {}
    content: list[JSON] = []
    text = _text_of(message.get("content"))
    if text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls") or []
    for i, call in enumerate(calls if isinstance(calls, list) else []):
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or _new_id("toolu_"),
                "name": function.get("name", ""),
                "input": _parse_arguments(
                    function.get("arguments"), f"choices.0.message.tool_calls.{i}"
                ),
            }
        )
    stop_reason, stop_sequence = _anthropic_stop(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls)
    )
    return {
        "id": _new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _anthropic_usage(resp),
    }


def _complete_json(text: str) -> bool:
    """Whether streamed tool arguments are a whole JSON object (or array) already."""
    if not text.rstrip().endswith(("}", "]")):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _sse_event(event: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class _AnthropicStream:
    """The state of one Anthropic event stream built from chat chunks."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = False
        self.block = -1  # index of the last block started
        self.open_kind: str | None = None  # "text" or "tool" while a block is open
        self.tool_blocks: dict[int, int] = {}  # chat tool index -> block index
        # tool calls not started yet: their name has not arrived, or another tool's
        # block is open and its arguments are not complete (see _start_ready)
        self.pending: dict[int, JSON] = {}
        self.open_tool: int | None = None
        self.open_args = ""  # the arguments streamed so far into the open tool block
        self.finish: Any = None
        self.vllm_stop: Any = None
        self.saw_calls = False
        self.prompt_tokens: int | None = None
        self.cached = 0
        self.completion_tokens: int | None = None
        self.counted_tokens = 0

    def _start(self, chunk: Mapping[str, Any]) -> list[bytes]:
        self.started = True
        ids = chunk.get("prompt_token_ids")
        if isinstance(ids, list):
            self.prompt_tokens = len(ids)
        message: JSON = {
            "id": _new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": max((self.prompt_tokens or 0) - self.cached, 0),
                "output_tokens": 0,
            },
        }
        return [
            _sse_event("message_start", {"type": "message_start", "message": message}),
            _sse_event("ping", {"type": "ping"}),
        ]

    def _take_usage(self, chunk: Mapping[str, Any]) -> None:
        prompt, completion, cached = _usage_counts(chunk)
        if prompt is not None:
            self.prompt_tokens = prompt
            self.cached = cached
        if completion is not None:
            self.completion_tokens = completion

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind, self.open_tool = None, None
        return [
            _sse_event("content_block_stop", {"type": "content_block_stop", "index": self.block})
        ]

    def _open(self, block: JSON) -> list[bytes]:
        out = self._close()
        self.block += 1
        self.open_kind = "text" if block["type"] == "text" else "tool"
        event = {"type": "content_block_start", "index": self.block, "content_block": block}
        out.append(_sse_event("content_block_start", event))
        return out

    def _delta(self, index: int, delta: JSON) -> bytes:
        return _sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def _start_tool(self, tool_index: int, call: JSON) -> list[bytes]:
        block = {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}
        out = self._open(block)
        self.tool_blocks[tool_index] = self.block
        self.open_tool = tool_index
        self.open_args = call["arguments"]
        if call["arguments"]:
            out.append(
                self._delta(
                    self.block, {"type": "input_json_delta", "partial_json": call["arguments"]}
                )
            )
        return out

    def feed(self, chunk: Mapping[str, Any]) -> list[bytes]:
        self._take_usage(chunk)
        out: list[bytes] = [] if self.started else self._start(chunk)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return out
        for choice in choices:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.counted_tokens += len(ids)
            delta = choice.get("delta")
            delta = delta if isinstance(delta, Mapping) else {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self.open_kind != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta(self.block, {"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or []:
                out += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                self.vllm_stop = choice.get("stop_reason")
        return out

    def _tool_delta(self, call: Mapping[str, Any]) -> list[bytes]:
        self.saw_calls = True
        index = call.get("index", 0)
        function = call.get("function") or {}
        args = function.get("arguments") or ""
        if index in self.tool_blocks:
            if not args:
                return []
            delta = {"type": "input_json_delta", "partial_json": args}
            out = [self._delta(self.tool_blocks[index], delta)]
            if index == self.open_tool:
                self.open_args += args
                if self.pending:
                    out += self._start_ready()
            return out
        pending = self.pending.setdefault(index, {"id": None, "name": None, "arguments": ""})
        if call.get("id"):
            pending["id"] = call["id"]
        if function.get("name"):
            pending["name"] = function["name"]
        pending["arguments"] += args
        return self._start_ready()

    def _start_ready(self) -> list[bytes]:
        """Start the pending tool calls that can be, in index order.

        Anthropic streams one content block at a time: a block's deltas come between its
        start and its stop. Chat streams may interleave parallel tool calls (arguments
        of call 0 after call 1 began), so a call waits while the open tool block's
        arguments are not yet a complete JSON value; its arguments are kept and sent
        when it starts. Sequential calls (vLLM's parsers finish one before the next)
        start at once, as before."""
        out: list[bytes] = []
        while self.pending:
            index = min(self.pending)
            call = self.pending[index]
            if call["name"] is None:
                break
            if self.open_kind == "tool" and not _complete_json(self.open_args):
                break
            del self.pending[index]
            call["id"] = call["id"] or _new_id("toolu_")
            out += self._start_tool(index, call)
        return out

    def finish_events(self) -> list[bytes]:
        out: list[bytes] = [] if self.started else self._start({})
        for index in sorted(self.pending):
            call = self.pending[index]
            call["id"] = call["id"] or _new_id("toolu_")
            call["name"] = call["name"] or ""
            out += self._start_tool(index, call)
        self.pending.clear()
        out += self._close()
        stop_reason, stop_sequence = _anthropic_stop(self.finish, self.vllm_stop, self.saw_calls)
        usage: JSON = {
            "output_tokens": self.completion_tokens
            if self.completion_tokens is not None
            else self.counted_tokens
        }
        if self.prompt_tokens is not None:
            usage["input_tokens"] = max(self.prompt_tokens - self.cached, 0)
            if self.cached:
                usage["cache_read_input_tokens"] = self.cached
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        out.append(
            _sse_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        )
        out.append(_sse_event("message_stop", {"type": "message_stop"}))
        return out

    def error_events(self, status: int, message: str) -> list[bytes]:
        return [_sse_event("error", anthropic_error(status, message))]


def _upstream_error(chunk: Mapping[str, Any]) -> tuple[int, str] | None:
    error = chunk.get("error")
    if error is None:
        return None
    if isinstance(error, Mapping):
        message = str(error.get("message") or "The upstream model server failed.")
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code <= 599 else 502
        return status, message
    return 502, str(error)


async def chat_stream_to_anthropic(
    chunks: AsyncIterator[dict[str, Any]], model: str
) -> AsyncIterator[bytes]:
    """Chat completion chunks -> Anthropic Messages server-sent events (bytes)."""
    state = _AnthropicStream(model)
    try:
        async for chunk in chunks:
            failed = _upstream_error(chunk)
            if failed is not None:
                for event in state.error_events(*failed):
                    yield event
                return
            for event in state.feed(chunk):
                yield event
    except Exception as exc:
        for event in state.error_events(502, f"The upstream stream failed: {exc}"):
            yield event
        raise
    for event in state.finish_events():
        yield event


# --- OpenAI Responses -> chat -------------------------------------------------------------

_RESPONSES_KNOWN = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "top_logprobs",
    "include",
    "store",
    "metadata",
    "truncation",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "background",
    "previous_response_id",
    "conversation",
    "max_tool_calls",
    "prompt",
}


def _responses_parts(content: Any, param: str, images: list[JSON] | None = None) -> list[JSON]:
    """Responses content parts -> chat parts. With ``images``, images go there instead."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts: list[JSON] = []
    for j, raw in enumerate(_list(content, param)):
        part = _obj(raw, f"{param}.{j}")
        kind = part.get("type")
        where = f"{param}.{j}"
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append({"type": "text", "text": _str(part.get("text"), f"{where}.text")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": _str(part.get("refusal"), f"{where}.refusal")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise TranslationError(
                    f"{where}: only images given by image_url are supported (not file_id).",
                    f"{where}.image_url",
                )
            image = _image_part(url, part.get("detail"))
            (parts if images is None else images).append(image)
        else:
            raise TranslationError(
                f"{where}.type: content part {kind!r} is not supported.", f"{where}.type"
            )
    return parts


def _responses_tools(tools: Any) -> list[JSON]:
    out: list[JSON] = []
    for i, raw in enumerate(_list(tools, "tools")):
        tool = _obj(raw, f"tools.{i}")
        if tool.get("type") != "function":
            raise TranslationError(
                f"tools.{i}.type: only function tools are supported (got {tool.get('type')!r}).",
                f"tools.{i}.type",
            )
        function: JSON = {"name": _str(tool.get("name"), f"tools.{i}.name")}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if tool.get("parameters") is not None:
            function["parameters"] = dict(_obj(tool["parameters"], f"tools.{i}.parameters"))
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _responses_tool_choice(value: Any) -> Any:
    if value in ("auto", "none", "required"):
        return value
    choice = _obj(value, "tool_choice")
    if choice.get("type") == "function":
        return {
            "type": "function",
            "function": {"name": _str(choice.get("name"), "tool_choice.name")},
        }
    raise TranslationError(
        f"tool_choice: {choice.get('type')!r} is not supported (use auto, none, required or a "
        "function).",
        "tool_choice",
    )


def _responses_format(text: Any) -> JSON | None:
    fmt = _obj(text, "text").get("format")
    if fmt is None:
        return None
    fmt = _obj(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema: JSON = {
            "name": _str(fmt.get("name"), "text.format.name"),
            "schema": dict(_obj(fmt.get("schema"), "text.format.schema")),
        }
        if isinstance(fmt.get("strict"), bool):
            schema["strict"] = fmt["strict"]
        if isinstance(fmt.get("description"), str):
            schema["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": schema}
    raise TranslationError(f"text.format.type: {kind!r} is not supported.", "text.format.type")


class _ResponsesInput:
    """Builds chat messages from Responses input items, merging an assistant turn's parts."""

    def __init__(self) -> None:
        self.messages: list[JSON] = []
        self.images: list[JSON] = []  # from tool outputs, sent after the tool messages

    def _flush_images(self) -> None:
        if self.images:
            self.messages.append({"role": "user", "content": list(self.images)})
            self.images.clear()

    def _assistant(self) -> JSON:
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            return last
        message: JSON = {"role": "assistant", "content": None}
        self.messages.append(message)
        return message

    def add(self, item: Mapping[str, Any], param: str) -> None:
        kind = item.get("type", "message")
        if kind != "function_call_output":
            self._flush_images()
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                text = _text_of(_responses_parts(item.get("content"), f"{param}.content"))
                message = self._assistant()
                if message.get("tool_calls"):
                    message = {"role": "assistant", "content": None}
                    self.messages.append(message)
                message["content"] = (message["content"] or "") + text
                return
            if role not in ("user", "system", "developer"):
                raise TranslationError(f"{param}.role: unknown role {role!r}.", f"{param}.role")
            parts = _responses_parts(item.get("content"), f"{param}.content")
            self.messages.append(
                {
                    "role": "user" if role == "user" else "system",
                    "content": _content_value(parts) if parts else "",
                }
            )
        elif kind == "function_call":
            call = {
                "id": _str(item.get("call_id"), f"{param}.call_id"),
                "type": "function",
                "function": {
                    "name": _str(item.get("name"), f"{param}.name"),
                    "arguments": _str(item.get("arguments", ""), f"{param}.arguments"),
                },
            }
            self._assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            parts = _responses_parts(
                output if output is not None else "", f"{param}.output", self.images
            )
            content: str | list[JSON] = _content_value(parts) if len(parts) == 1 else (parts or "")
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _str(item.get("call_id"), f"{param}.call_id"),
                    "content": content,
                }
            )
        elif kind == "reasoning":
            return
        else:
            raise TranslationError(
                f"{param}.type: input item {kind!r} is not supported.", f"{param}.type"
            )


def responses_to_chat(req: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Responses request -> an OpenAI Chat Completions request."""
    req = dict(_obj(req, "body"))
    for key in ("previous_response_id", "conversation", "prompt"):
        if req.get(key):
            raise TranslationError(
                f"{key}: stored state is not supported by the gateway; send the full input.",
                key,
            )
    if req.get("background"):
        raise TranslationError("background: background responses are not supported.", "background")
    chat: JSON = _passthrough(req, _RESPONSES_KNOWN)
    chat["model"] = _str(req.get("model"), "model")
    builder = _ResponsesInput()
    instructions = req.get("instructions")
    if instructions:
        builder.messages.append({"role": "system", "content": _str(instructions, "instructions")})
    raw_input = req.get("input")
    if isinstance(raw_input, str):
        builder.messages.append({"role": "user", "content": raw_input})
    else:
        items = _list(raw_input, "input")
        for i, item in enumerate(items):
            builder.add(_obj(item, f"input.{i}"), f"input.{i}")
        builder._flush_images()
    if not builder.messages:
        raise TranslationError("input: at least one input item is required.", "input")
    chat["messages"] = builder.messages

    if req.get("tools"):
        chat["tools"] = _responses_tools(req["tools"])
    if req.get("tool_choice") is not None:
        chat["tool_choice"] = _responses_tool_choice(req["tool_choice"])
        _drop_idle_tool_choice(chat)
    if isinstance(req.get("parallel_tool_calls"), bool):
        chat["parallel_tool_calls"] = req["parallel_tool_calls"]
    if req.get("max_output_tokens") is not None:
        chat["max_tokens"] = _int(req["max_output_tokens"], "max_output_tokens")
    for key in ("temperature", "top_p"):
        if req.get(key) is not None:
            chat[key] = req[key]
    user = req.get("user", req.get("safety_identifier"))
    if isinstance(user, str):
        chat["user"] = user
    if req.get("text") is not None:
        fmt = _responses_format(req["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    reasoning = req.get("reasoning")
    if isinstance(reasoning, Mapping) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    include = req.get("include") or []
    top = req.get("top_logprobs")
    if "message.output_text.logprobs" in include or top:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    if req.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# --- chat -> OpenAI Responses -------------------------------------------------------------

_RESPONSE_ECHO = ("instructions", "metadata", "temperature", "top_p", "max_output_tokens", "user")


def _response_shell(model: str, created: Any, request: Mapping[str, Any] | None) -> JSON:
    request = request or {}
    shell: JSON = {
        "id": _new_id("resp_"),
        "object": "response",
        "created_at": created if isinstance(created, int | float) else int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": list(request.get("tools") or []),
        "text": request.get("text") or {"format": {"type": "text"}},
        "usage": None,
    }
    for key in _RESPONSE_ECHO:
        shell[key] = request.get(key)
    if shell["metadata"] is None:
        shell["metadata"] = {}
    return shell


def _responses_usage(prompt: int, completion: int, cached: int) -> JSON:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _responses_logprobs(logprobs: Any) -> list[JSON]:
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    out: list[JSON] = []
    for entry in content if isinstance(content, list) else []:
        if not isinstance(entry, Mapping):
            continue
        out.append(
            {
                "token": entry.get("token", ""),
                "logprob": entry.get("logprob", 0.0),
                "bytes": entry.get("bytes") or [],
                "top_logprobs": [
                    {
                        "token": top.get("token", ""),
                        "logprob": top.get("logprob", 0.0),
                        "bytes": top.get("bytes") or [],
                    }
                    for top in entry.get("top_logprobs") or []
                    if isinstance(top, Mapping)
                ],
            }
        )
    return out


def _finish_status(finish: Any) -> tuple[str, JSON | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _reasoning_item(item_id: str, text: str, status: str) -> JSON:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _text_part(text: str, logprobs: list[JSON]) -> JSON:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, part: JSON | None, status: str) -> JSON:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [part] if part is not None else [],
    }


def _function_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> JSON:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def chat_to_responses(
    resp: dict[str, Any], model: str, *, request: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A chat completion -> an OpenAI Responses ``response`` object.

    ``request``, the Responses request, when given, is echoed the way the API does
    (``tools``, ``tool_choice``, ``instructions``, ``temperature``...).
    """
    choice = _first_choice(resp)
    message = choice.get("message")
    message = message if isinstance(message, Mapping) else {}
    output: list[JSON] = []
    reasoning = _reasoning_of(message)
    if reasoning:
        output.append(_reasoning_item(_new_id("rs_"), reasoning, "completed"))
    text = _text_of(message.get("content"))
    status, incomplete = _finish_status(choice.get("finish_reason"))
    if text:
        part = _text_part(text, _responses_logprobs(choice.get("logprobs")))
        output.append(_message_item(_new_id("msg_"), part, status))
    calls = message.get("tool_calls") or []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = _dumps(arguments) if arguments is not None else ""
        output.append(
            _function_item(
                _new_id("fc_"),
                call.get("id") or _new_id("call_"),
                function.get("name", ""),
                arguments,
                "completed",
            )
        )
    body = _response_shell(model, resp.get("created"), request)
    prompt, completion, cached = _usage_counts(resp)
    body.update(
        status=status,
        incomplete_details=incomplete,
        output=output,
        usage=_responses_usage(prompt or 0, completion or 0, cached),
    )
    return body


class _ResponsesStream:
    """The state of one Responses event stream built from chat chunks."""

    def __init__(self, model: str, request: Mapping[str, Any] | None) -> None:
        self.model = model
        self.request = request
        self.seq = 0
        self.response: JSON | None = None
        self.output: dict[int, JSON] = {}  # output index -> finished item
        self.next_index = 0
        # the open reasoning or message item: (kind, output index, item id, text, logprobs)
        self.open: tuple[str, int, str] | None = None
        self.open_text = ""
        self.open_logprobs: list[JSON] = []
        self.calls: dict[int, JSON] = {}  # chat tool index -> open function call state
        self.pending: dict[int, JSON] = {}
        self.finish: Any = None
        self.prompt_tokens: int | None = None
        self.cached = 0
        self.completion_tokens: int | None = None
        self.counted_tokens = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse_event(kind, data)

    def _start(self, chunk: Mapping[str, Any]) -> list[bytes]:
        self.response = _response_shell(self.model, chunk.get("created"), self.request)
        ids = chunk.get("prompt_token_ids")
        if isinstance(ids, list):
            self.prompt_tokens = len(ids)
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def _take_usage(self, chunk: Mapping[str, Any]) -> None:
        prompt, completion, cached = _usage_counts(chunk)
        if prompt is not None:
            self.prompt_tokens, self.cached = prompt, cached
        if completion is not None:
            self.completion_tokens = completion

    def _close_open(self) -> list[bytes]:
        if self.open is None:
            return []
        kind, index, item_id = self.open
        text = self.open_text
        self.open = None
        if kind == "reasoning":
            part: JSON = {"type": "reasoning_text", "text": text}
            item = _reasoning_item(item_id, text, "completed")
            out = [
                self._event(
                    "response.reasoning_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            ]
        else:
            part = _text_part(text, self.open_logprobs)
            item = _message_item(item_id, part, "completed")
            out = [
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=self.open_logprobs,
                )
            ]
        out.append(
            self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            )
        )
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output[index] = item
        return out

    def _open_item(self, kind: str) -> list[bytes]:
        out = self._close_open()
        index = self.next_index
        self.next_index += 1
        if kind == "reasoning":
            item_id = _new_id("rs_")
            item = _reasoning_item(item_id, "", "in_progress")
            item["content"] = []
            part: JSON = {"type": "reasoning_text", "text": ""}
        else:
            item_id = _new_id("msg_")
            item = _message_item(item_id, None, "in_progress")
            part = _text_part("", [])
        self.open = (kind, index, item_id)
        self.open_text, self.open_logprobs = "", []
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        out.append(
            self._event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            )
        )
        return out

    def _text(self, kind: str, text: str, logprobs: list[JSON]) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open[0] != kind:
            out += self._open_item(kind)
        assert self.open is not None
        _, index, item_id = self.open
        self.open_text += text
        if kind == "reasoning":
            out.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                )
            )
        else:
            self.open_logprobs.extend(logprobs)
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=logprobs,
                )
            )
        return out

    def _start_call(self, tool_index: int, call: JSON) -> list[bytes]:
        out = self._close_open()
        index = self.next_index
        self.next_index += 1
        state = {
            "output_index": index,
            "id": _new_id("fc_"),
            "call_id": call["id"],
            "name": call["name"],
            "arguments": "",
        }
        self.calls[tool_index] = state
        item = _function_item(state["id"], state["call_id"], state["name"], "", "in_progress")
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if call["arguments"]:
            out += self._call_args(state, call["arguments"])
        return out

    def _call_args(self, state: JSON, args: str) -> list[bytes]:
        state["arguments"] += args
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=state["id"],
                output_index=state["output_index"],
                delta=args,
            )
        ]

    def _tool_delta(self, call: Mapping[str, Any]) -> list[bytes]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        args = function.get("arguments") or ""
        if index in self.calls:
            return self._call_args(self.calls[index], args) if args else []
        pending = self.pending.setdefault(index, {"id": None, "name": None, "arguments": ""})
        if call.get("id"):
            pending["id"] = call["id"]
        if function.get("name"):
            pending["name"] = function["name"]
        pending["arguments"] += args
        if pending["name"] is None:
            return []
        del self.pending[index]
        pending["id"] = pending["id"] or _new_id("call_")
        return self._start_call(index, pending)

    def feed(self, chunk: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = self._start(chunk) if self.response is None else []
        self._take_usage(chunk)
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.counted_tokens += len(ids)
            delta = choice.get("delta")
            delta = delta if isinstance(delta, Mapping) else {}
            reasoning = _reasoning_of(delta)
            if reasoning:
                out += self._text("reasoning", reasoning, [])
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self._text("message", text, _responses_logprobs(choice.get("logprobs")))
            for call in delta.get("tool_calls") or []:
                out += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return out

    def finish_events(self) -> list[bytes]:
        out: list[bytes] = self._start({}) if self.response is None else []
        for index in sorted(self.pending):
            call = self.pending[index]
            call["id"] = call["id"] or _new_id("call_")
            call["name"] = call["name"] or ""
            out += self._start_call(index, call)
        self.pending.clear()
        out += self._close_open()
        for state in sorted(self.calls.values(), key=lambda s: int(s["output_index"])):
            index = state["output_index"]
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=state["id"],
                    output_index=index,
                    name=state["name"],
                    arguments=state["arguments"],
                )
            )
            item = _function_item(
                state["id"], state["call_id"], state["name"], state["arguments"], "completed"
            )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
            self.output[index] = item
        status, incomplete = _finish_status(self.finish)
        completion = (
            self.completion_tokens if self.completion_tokens is not None else self.counted_tokens
        )
        assert self.response is not None
        final = dict(self.response)
        final.update(
            status=status,
            incomplete_details=incomplete,
            output=[self.output[i] for i in sorted(self.output)],
            usage=_responses_usage(self.prompt_tokens or 0, completion, self.cached),
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=final))
        return out

    def error_events(self, status: int, message: str) -> list[bytes]:
        out: list[bytes] = self._start({}) if self.response is None else []
        body = openai_error(status, message, code="upstream_error")["error"]
        out.append(self._event("error", code=body["code"], message=message, param=None))
        assert self.response is not None
        failed = dict(self.response)
        failed.update(
            status="failed",
            error={"code": "server_error", "message": message},
            output=[self.output[i] for i in sorted(self.output)],
        )
        out.append(self._event("response.failed", response=failed))
        return out


async def chat_stream_to_responses(
    chunks: AsyncIterator[dict[str, Any]],
    model: str,
    *,
    request: Mapping[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """Chat completion chunks -> OpenAI Responses server-sent events (bytes)."""
    state = _ResponsesStream(model, request)
    try:
        async for chunk in chunks:
            failed = _upstream_error(chunk)
            if failed is not None:
                for event in state.error_events(*failed):
                    yield event
                return
            for event in state.feed(chunk):
                yield event
    except Exception as exc:
        for event in state.error_events(502, f"The upstream stream failed: {exc}"):
            yield event
        raise
    for event in state.finish_events():
        yield event
