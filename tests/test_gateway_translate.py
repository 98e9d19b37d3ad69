"""The Anthropic Messages / OpenAI Responses <-> Chat Completions translation layer.

Unit tests run on handcrafted fixtures; the end-to-end tests put a tiny bridge app
(translate -> scripted policy's chat server -> translate back) in front of the official
``anthropic`` and ``openai`` SDKs, streaming and not, to prove the wire shapes are the
ones those SDKs parse.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import ToolUseBlock
from openai.types.responses import ResponseFunctionToolCall
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from envport.errors import EnvportError
from envport.gateway.translate import (
    TranslationError,
    anthropic_error,
    anthropic_to_chat,
    chat_stream_to_anthropic,
    chat_stream_to_responses,
    chat_to_anthropic,
    chat_to_responses,
    openai_error,
    responses_to_chat,
)
from envport.policy import ScriptedPolicy, create_policy_app
from envport.serving import serve_in_thread

# --- helpers --------------------------------------------------------------------------------


async def _aiter(chunks: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for chunk in chunks:
        yield chunk


async def _collect(stream: AsyncIterator[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Parse the SSE bytes a translator yields; each yield must be whole events."""
    events: list[tuple[str, dict[str, Any]]] = []
    async for raw in stream:
        assert raw.endswith(b"\n\n")
        for block in raw.decode().split("\n\n"):
            if not block:
                continue
            name_line, data_line = block.split("\n")
            assert name_line.startswith("event: ")
            assert data_line.startswith("data: ")
            data = json.loads(data_line[6:])
            assert data["type"] == name_line[7:]
            events.append((name_line[7:], data))
    return events


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    choice.update(extra)
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


def _completion(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    choice.update(extra)
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "upstream",
        "choices": [choice],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_anthropic_error_shape(status: int, kind: str) -> None:
    assert anthropic_error(status, "boom") == {
        "type": "error",
        "error": {"type": kind, "message": "boom"},
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_openai_error_shape(status: int, kind: str) -> None:
    assert openai_error(status, "boom", "messages", "bad") == {
        "error": {"message": "boom", "type": kind, "param": "messages", "code": "bad"}
    }


def test_translation_error_is_an_envport_error() -> None:
    err = TranslationError("nope", "tools.0.type")
    assert isinstance(err, EnvportError)
    assert (err.message, err.param, err.status) == ("nope", "tools.0.type", 400)
    assert err.to_anthropic()["error"]["type"] == "invalid_request_error"
    assert err.to_openai()["error"]["param"] == "tools.0.type"


# --- Anthropic -> chat ------------------------------------------------------------------------


def test_anthropic_request_full() -> None:
    req = {
        "model": "claude-x",
        "max_tokens": 256,
        "system": [
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use tools."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Running it."},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "shot", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "partial"},
                            {
                                "type": "image",
                                "source": {"type": "url", "url": "https://x/y.png"},
                            },
                        ],
                    },
                    {"type": "text", "text": "Go on."},
                ],
            },
        ],
        "tools": [
            {
                "name": "bash",
                "description": "Run a command.",
                "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
            {"name": "shot", "input_schema": {"type": "object"}, "cache_control": {}},
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "metadata": {"user_id": "u-1"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stream": True,
        "return_token_ids": True,
    }
    assert anthropic_to_chat(req) == {
        "model": "claude-x",
        "max_tokens": 256,
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "You are terse."},
                    {"type": "text", "text": "Use tools."},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {
                "role": "assistant",
                "content": "Running it.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
                    },
                    {
                        "id": "toolu_2",
                        "type": "function",
                        "function": {"name": "shot", "arguments": "{}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "partial"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                    {"type": "text", "text": "Go on."},
                ],
            },
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                    "description": "Run a command.",
                },
            },
            {"type": "function", "function": {"name": "shot", "parameters": {"type": "object"}}},
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stop": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "user": "u-1",
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def test_anthropic_request_simple_strings_and_prefill() -> None:
    chat = anthropic_to_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "system": "sys",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hel"},
            ],
        }
    )
    assert chat == {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hel"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "any"}, "required"),
        ({"type": "tool", "name": "bash"}, {"type": "function", "function": {"name": "bash"}}),
    ],
)
def test_anthropic_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    req = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    chat = anthropic_to_chat({**req, "tools": tools, "tool_choice": choice})
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_anthropic_consecutive_turns_of_one_role_are_one_turn() -> None:
    """The Messages API combines consecutive user (or assistant) turns into one; they
    were sent upstream as separate chat turns (two assistant turns the model never
    produced, or two user turns a strictly alternating chat template refuses)."""
    tool_use = {"type": "tool_use", "id": "t1", "name": "ls", "input": {"dir": "."}}
    req = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "first"},
            {"role": "user", "content": [{"type": "text", "text": "second"}]},
            {"role": "assistant", "content": "Let me look."},
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
            {"role": "user", "content": "now?"},
        ],
    }
    chat = anthropic_to_chat(req)
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        },
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"dir": "."}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": ""},
        {"role": "user", "content": "now?"},
    ]
    assert "continue_final_message" not in chat
    # a bad block in a combined turn is still named by its own message's index
    bad = {**req, "messages": [*req["messages"], {"role": "user", "content": [{"type": "x"}]}]}
    with pytest.raises(TranslationError) as info:
        anthropic_to_chat(bad)
    assert info.value.param == "messages.6.content.0.type"


@pytest.mark.parametrize("tools", [None, []])
def test_a_tool_choice_without_tools_is_not_sent_unless_it_forces_a_call(
    tools: list[Any] | None,
) -> None:
    """``auto``/``none`` without tools (Codex sends ``tool_choice: "auto"`` with
    ``tools: []`` on its tool-less turns) is left out: vLLM answers 400 "When using
    `tool_choice`, `tools` must be set". A forced choice is kept for upstream to refuse."""
    extra: dict[str, Any] = {} if tools is None else {"tools": tools}
    a_req = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    for kind in ("auto", "none"):
        chat = anthropic_to_chat({**a_req, **extra, "tool_choice": {"type": kind}})
        assert "tool_choice" not in chat
        assert "tools" not in chat
    chat = anthropic_to_chat({**a_req, **extra, "tool_choice": {"type": "any"}})
    assert chat["tool_choice"] == "required"
    r_req = {"model": "m", "input": "summarize", **extra}
    for kind in ("auto", "none"):
        chat = responses_to_chat({**r_req, "tool_choice": kind, "parallel_tool_calls": True})
        assert "tool_choice" not in chat
        assert "tools" not in chat
    chat = responses_to_chat({**r_req, "tool_choice": {"type": "function", "name": "f"}})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": None}, "model"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ]
            },
            "messages.0.content.0.source.type",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"system": [{"type": "image"}]}, "system.0.type"),
    ],
)
def test_anthropic_request_rejected(patch: dict[str, Any], param: str) -> None:
    req: dict[str, Any] = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
    }
    for key, value in patch.items():
        if value is None:
            del req[key]
        else:
            req[key] = value
    with pytest.raises(TranslationError) as info:
        anthropic_to_chat(req)
    assert info.value.param == param
    assert info.value.status == 400


# --- chat -> Anthropic -------------------------------------------------------------------------


def test_chat_to_anthropic_text_and_tools() -> None:
    resp = _completion(
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
                },
                {"id": "call_b", "type": "function", "function": {"name": "t", "arguments": ""}},
            ],
        },
        "tool_calls",
        token_ids=[1, 2, 3],
    )
    msg = chat_to_anthropic(resp, "claude-x")
    assert msg["id"].startswith("msg_")
    assert msg == {
        "id": msg["id"],
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call_a", "name": "bash", "input": {"cmd": "ls"}},
            {"type": "tool_use", "id": "call_b", "name": "t", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 7},
    }


@pytest.mark.parametrize(
    ("finish", "vllm_stop", "reason", "sequence"),
    [
        ("stop", None, "end_turn", None),
        ("stop", 151645, "end_turn", None),
        ("stop", "###", "stop_sequence", "###"),
        ("length", None, "max_tokens", None),
        ("content_filter", None, "refusal", None),
    ],
)
def test_chat_to_anthropic_stop_reasons(
    finish: str, vllm_stop: Any, reason: str, sequence: str | None
) -> None:
    resp = _completion({"role": "assistant", "content": "x"}, finish, stop_reason=vllm_stop)
    msg = chat_to_anthropic(resp, "m")
    assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, sequence)


def test_chat_to_anthropic_cached_tokens_and_empty_content() -> None:
    resp = _completion({"role": "assistant", "content": None})
    resp["usage"]["prompt_tokens_details"] = {"cached_tokens": 4}
    msg = chat_to_anthropic(resp, "m")
    assert msg["content"] == []
    assert msg["usage"] == {"input_tokens": 7, "output_tokens": 7, "cache_read_input_tokens": 4}


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]"])
def test_chat_to_anthropic_bad_arguments_is_upstream_error(arguments: str) -> None:
    resp = _completion(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ],
        },
        "tool_calls",
    )
    with pytest.raises(TranslationError) as info:
        chat_to_anthropic(resp, "m")
    assert info.value.status == 502


def test_chat_to_anthropic_no_choices() -> None:
    with pytest.raises(TranslationError) as info:
        chat_to_anthropic({"choices": []}, "m")
    assert info.value.status == 502


# --- chat stream -> Anthropic ------------------------------------------------------------------

_INTERLEAVED = [
    {**_chunk({"role": "assistant", "content": ""}), "prompt_token_ids": [1, 2, 3, 4, 5]},
    _chunk({"content": "Hello"}, token_ids=[10]),
    _chunk({"content": " world"}, token_ids=[11]),
    _chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": ""},
                }
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd":'}}]}, token_ids=[12]),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "ls"}'}}]}, token_ids=[13]),
    _chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path": "a"}'},
                }
            ]
        },
        token_ids=[14],
    ),
    _chunk({}, "tool_calls", token_ids=[15]),
    {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}},
]


async def test_anthropic_stream_interleaved_blocks() -> None:
    events = await _collect(chat_stream_to_anthropic(_aiter(_INTERLEAVED), "claude-x"))
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert start["model"] == "claude-x"
    assert start["content"] == []
    blocks = [(d["index"], d["content_block"]) for n, d in events if n == "content_block_start"]
    assert blocks == [
        (0, {"type": "text", "text": ""}),
        (1, {"type": "tool_use", "id": "call_1", "name": "bash", "input": {}}),
        (2, {"type": "tool_use", "id": "call_2", "name": "read", "input": {}}),
    ]
    deltas = [(d["index"], d["delta"]) for n, d in events if n == "content_block_delta"]
    assert deltas == [
        (0, {"type": "text_delta", "text": "Hello"}),
        (0, {"type": "text_delta", "text": " world"}),
        (1, {"type": "input_json_delta", "partial_json": '{"cmd":'}),
        (1, {"type": "input_json_delta", "partial_json": ' "ls"}'}),
        (2, {"type": "input_json_delta", "partial_json": '{"path": "a"}'}),
    ]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 6, "input_tokens": 5},
    }


async def test_anthropic_stream_text_after_tool_opens_new_block_and_counts_tokens() -> None:
    chunks = [
        _chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}),
        _chunk({"content": "after"}, token_ids=[1, 2]),
        _chunk({}, "stop", stop_reason="STOP", token_ids=[3]),
    ]
    events = await _collect(chat_stream_to_anthropic(_aiter(chunks), "m"))
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["tool_use", "text"]
    final = events[-2][1]
    # Some servers finish a tool-calling turn with "stop": tool calls win.
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"] == {"output_tokens": 3}

    chunks = [_chunk({"content": "x"}), _chunk({}, "stop", stop_reason="STOP")]
    events = await _collect(chat_stream_to_anthropic(_aiter(chunks), "m"))
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


async def test_anthropic_stream_empty_upstream_still_well_formed() -> None:
    events = await _collect(chat_stream_to_anthropic(_aiter([]), "m"))
    assert [n for n, _ in events] == ["message_start", "ping", "message_delta", "message_stop"]


async def test_anthropic_stream_upstream_error_chunk() -> None:
    chunks = [_chunk({"content": "hi"}), {"error": {"message": "engine died", "code": 500}}]
    events = await _collect(chat_stream_to_anthropic(_aiter(chunks), "m"))
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "engine died"}},
    )
    assert "message_stop" not in [n for n, _ in events]


async def test_anthropic_stream_exception_emits_error_then_reraises() -> None:
    async def broken() -> AsyncIterator[dict[str, Any]]:
        yield _chunk({"content": "hi"})
        raise httpx.ReadError("connection reset")

    got: list[bytes] = []

    async def drain() -> None:
        async for raw in chat_stream_to_anthropic(broken(), "m"):
            got.append(raw)

    with pytest.raises(httpx.ReadError):
        await drain()
    assert got[-1].startswith(b"event: error\n")
    assert b"connection reset" in got[-1]


def _tool_chunk(index: int, args: str = "", **start: Any) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if start:
        call.update(id=start["id"], type="function")
        call["function"]["name"] = start["name"]
    return _chunk({"tool_calls": [call]})


def _blocks_in_order(events: list[tuple[str, dict[str, Any]]]) -> dict[int, str]:
    """Each block's JSON arguments as of its content_block_stop; asserts that blocks
    run one at a time (start, deltas, stop), as Anthropic streams them."""
    open_index: int | None = None
    args: dict[int, str] = {}
    at_stop: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None, f"block {data['index']} started inside {open_index}"
            open_index = data["index"]
            args[data["index"]] = ""
        elif name == "content_block_delta":
            assert data["index"] == open_index, f"a delta for block {data['index']} outside it"
            args[data["index"]] += data["delta"].get("partial_json", "")
        elif name == "content_block_stop":
            assert data["index"] == open_index
            at_stop[data["index"]] = args[data["index"]]
            open_index = None
    return at_stop


async def test_anthropic_stream_interleaved_parallel_tool_calls_stay_in_their_blocks() -> None:
    """Parallel tool calls whose chat deltas interleave (call 0's arguments after call 1
    began) still stream as whole blocks: each block's deltas between its start and
    stop, its input complete at the stop (a Claude-Code-style client builds the tool
    call at content_block_stop). Before, call 0's block was stopped when call 1 began
    and its arguments followed the stop."""
    chunks = [
        _tool_chunk(0, id="call_a", name="read"),
        _tool_chunk(1, id="call_b", name="grep"),
        _tool_chunk(0, '{"path": '),
        _tool_chunk(1, '{"pattern": '),
        _tool_chunk(0, '"a.py"}'),
        _tool_chunk(2, '{"x": 1}', id="call_c", name="ls"),
        _tool_chunk(1, '"def"}'),
        _chunk({}, "tool_calls"),
    ]
    events = await _collect(chat_stream_to_anthropic(_aiter(chunks), "m"))
    at_stop = _blocks_in_order(events)
    assert {i: json.loads(a) for i, a in at_stop.items()} == {
        0: {"path": "a.py"},
        1: {"pattern": "def"},
        2: {"x": 1},
    }
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["id"], b["name"]) for b in starts] == [
        ("call_a", "read"),
        ("call_b", "grep"),
        ("call_c", "ls"),
    ]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_anthropic_stream_sequential_tool_calls_start_as_they_arrive() -> None:
    """vLLM finishes one call before the next begins: the next block starts at once
    and its arguments are streamed as they come, not held until the stream ends."""
    chunks = [
        _tool_chunk(0, id="call_a", name="read"),
        _tool_chunk(0, '{"path": "a"}'),
        _tool_chunk(1, id="call_b", name="read"),
        _tool_chunk(1, '{"path": '),
    ]
    got: list[bytes] = []
    before_end: list[bytes] = []

    async def source() -> AsyncIterator[dict[str, Any]]:
        for chunk in chunks:
            yield chunk
        before_end.extend(got)  # what was sent before upstream's end was seen

    async def gather() -> AsyncIterator[bytes]:
        async for raw in chat_stream_to_anthropic(source(), "m"):
            got.append(raw)
            yield raw

    events = await _collect(gather())
    assert _blocks_in_order(events) == {0: '{"path": "a"}', 1: '{"path": '}
    early = b"".join(before_end)
    assert b'"id":"call_b"' in early
    assert b'"index":1,"delta":{"type":"input_json_delta"' in early


# --- Responses -> chat --------------------------------------------------------------------------


def test_responses_request_full() -> None:
    req = {
        "model": "gpt-x",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Dev note."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe"},
                    {
                        "type": "input_image",
                        "image_url": "data:image/png;base64,AA",
                        "detail": "low",
                    },
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "bash",
                "arguments": '{"cmd":"ls"}',
            },
            {"type": "function_call", "call_id": "call_2", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [
                    {"type": "input_text", "text": "here"},
                    {"type": "input_image", "image_url": "https://x/y.png"},
                ],
            },
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "bash",
                "description": "Run.",
                "parameters": {"type": "object"},
                "strict": True,
            }
        ],
        "tool_choice": {"type": "function", "name": "bash"},
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.5,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"},
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "store": False,
        "metadata": {"k": "v"},
        "stream": True,
        "seed": 7,
    }
    assert responses_to_chat(req) == {
        "model": "gpt-x",
        "seed": 7,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Dev note."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,AA", "detail": "low"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"cmd":"ls"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "shot", "arguments": "{}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "call_2", "content": "here"},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
            },
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "description": "Run.",
                    "parameters": {"type": "object"},
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "bash"}},
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}},
        },
        "reasoning_effort": "low",
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_responses_request_string_input_and_function_call_without_message() -> None:
    assert responses_to_chat({"model": "m", "input": "hi"}) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    }
    chat = responses_to_chat(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "ok"},
            ],
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": 3}, "model"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input.0.content.0.image_url",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ],
)
def test_responses_request_rejected(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(TranslationError) as info:
        responses_to_chat({"model": "m", "input": "hi", **patch})
    assert info.value.param == param


# --- chat -> Responses ------------------------------------------------------------------------


def test_chat_to_responses_full() -> None:
    lp = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.1,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
            }
        ]
    }
    resp = _completion(
        {
            "role": "assistant",
            "content": "Hi",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        "tool_calls",
        logprobs=lp,
    )
    request = {"model": "gpt-x", "input": "x", "tools": [{"type": "function", "name": "f"}]}
    out = chat_to_responses(resp, "gpt-x", request=request)
    assert out["id"].startswith("resp_")
    assert out["object"] == "response"
    assert out["status"] == "completed"
    assert out["model"] == "gpt-x"
    assert out["created_at"] == 1700000000
    assert out["tools"] == request["tools"]
    reasoning, message, call = out["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert message["id"].startswith("msg_")
    assert message["content"] == [
        {
            "type": "output_text",
            "text": "Hi",
            "annotations": [],
            "logprobs": [
                {
                    "token": "Hi",
                    "logprob": -0.1,
                    "bytes": [72, 105],
                    "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
                }
            ],
        }
    ]
    assert call == {
        "type": "function_call",
        "id": call["id"],
        "call_id": "call_a",
        "name": "f",
        "arguments": "{}",
        "status": "completed",
    }
    assert out["usage"] == {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 18,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"reasoning_content": None, "reasoning": "think"},  # both, the old one null
        {"reasoning": "think"},
        {"reasoning_content": "think", "reasoning": None},
        {"reasoning_content": "", "reasoning": "think"},
    ],
)
async def test_responses_reasoning_from_either_field_even_when_the_other_is_null(
    fields: dict[str, Any],
) -> None:
    """A server that sends both ``reasoning_content`` and ``reasoning``, one of them null
    (vLLM since the rename, a non-streamed answer dumping every field), still gives the
    reasoning item: it was dropped when ``reasoning_content`` was present but null."""
    out = chat_to_responses(_completion({"role": "assistant", "content": "Hi", **fields}), "m")
    assert [o["type"] for o in out["output"]] == ["reasoning", "message"]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    chunks = [_chunk({"role": "assistant", **fields}), _chunk({"content": "Hi"}, "stop")]
    events = await _collect(chat_stream_to_responses(_aiter(chunks), "m"))
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]


def test_chat_to_responses_length_is_incomplete() -> None:
    out = chat_to_responses(_completion({"role": "assistant", "content": "abc"}, "length"), "m")
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete"


# --- chat stream -> Responses ------------------------------------------------------------------


async def test_responses_stream_events() -> None:
    chunks = [
        {**_chunk({"role": "assistant", "content": ""}), "prompt_token_ids": [1, 2, 3, 4, 5]},
        _chunk({"reasoning_content": "plan"}),
        *_INTERLEAVED[1:],
    ]
    events = await _collect(chat_stream_to_responses(_aiter(chunks), "gpt-x"))
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # call_1
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added",  # call_2
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    created = events[0][1]["response"]
    assert created["status"] == "in_progress"
    assert created["output"] == []
    final = events[-1][1]["response"]
    assert final["id"] == created["id"]
    assert final["status"] == "completed"
    assert [item["type"] for item in final["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert final["output"][1]["content"][0]["text"] == "Hello world"
    assert [(i["call_id"], i["name"], i["arguments"]) for i in final["output"][2:]] == [
        ("call_1", "bash", '{"cmd": "ls"}'),
        ("call_2", "read", '{"path": "a"}'),
    ]
    assert final["usage"]["input_tokens"] == 5
    assert final["usage"]["output_tokens"] == 6
    added = {d["output_index"]: d["item"]["id"] for n, d in events if n.endswith("item.added")}
    done = {d["output_index"]: d["item"]["id"] for n, d in events if n.endswith("item.done")}
    assert added == done == {i: item["id"] for i, item in enumerate(final["output"])}


async def test_responses_stream_length_and_error() -> None:
    events = await _collect(
        chat_stream_to_responses(_aiter([_chunk({"content": "ab"}), _chunk({}, "length")]), "m")
    )
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}

    chunks = [_chunk({"content": "ab"}), {"error": {"message": "overloaded"}}]
    events = await _collect(chat_stream_to_responses(_aiter(chunks), "m"))
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-1][1]["response"]["error"]["message"] == "overloaded"


# --- end to end with the official SDKs ------------------------------------------------------


async def _upstream_chunks(url: str, chat: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=chat) as resp,
    ):
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            yield json.loads(line[6:])


def _bridge(upstream: str, seen: list[dict[str, Any]]) -> Starlette:
    """A minimal gateway: translate, call the scripted policy over HTTP, translate back."""

    async def call(chat: dict[str, Any]) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as client:
            resp = await client.post(f"{upstream}/v1/chat/completions", json=chat)
        data: dict[str, Any] = resp.json()
        return data

    async def messages(request: Request) -> Response:
        body = await request.json()
        try:
            chat = anthropic_to_chat(body)
        except TranslationError as exc:
            return JSONResponse(exc.to_anthropic(), status_code=exc.status)
        seen.append(chat)
        if chat.get("stream"):
            events = chat_stream_to_anthropic(_upstream_chunks(upstream, chat), body["model"])
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(chat_to_anthropic(await call(chat), body["model"]))

    async def responses(request: Request) -> Response:
        body = await request.json()
        try:
            chat = responses_to_chat(body)
        except TranslationError as exc:
            return JSONResponse(exc.to_openai(), status_code=exc.status)
        seen.append(chat)
        if chat.get("stream"):
            events = chat_stream_to_responses(
                _upstream_chunks(upstream, chat), body["model"], request=body
            )
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(chat_to_responses(await call(chat), body["model"], request=body))

    return Starlette(
        routes=[
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
        ]
    )


class _Bridge:
    def __init__(self, url: str, seen: list[dict[str, Any]]) -> None:
        self.url = url
        self.seen = seen


@pytest.fixture(scope="module")
def bridge() -> Iterator[_Bridge]:
    seen: list[dict[str, Any]] = []
    with serve_in_thread(create_policy_app(ScriptedPolicy(seed=3))) as upstream:  # noqa: SIM117
        with serve_in_thread(_bridge(upstream, seen)) as url:
            yield _Bridge(url, seen)


SUBMIT_TOOL = {
    "name": "submit_answer",
    "description": "Submit the final answer.",
    "input_schema": {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    },
}
SQL_TOOLS = [
    {"name": "list_tables", "input_schema": {"type": "object", "properties": {}}},
    {
        "name": "describe_table",
        "input_schema": {"type": "object", "properties": {"name": {"type": "string"}}},
    },
    {
        "name": "run_query",
        "input_schema": {"type": "object", "properties": {"sql": {"type": "string"}}},
    },
]


def _anthropic(bridge: _Bridge) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=bridge.url, api_key="x", max_retries=0)


def _openai(bridge: _Bridge) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{bridge.url}/v1", api_key="x", max_retries=0)


async def test_anthropic_sdk_tool_use_round_trip(bridge: _Bridge) -> None:
    async with _anthropic(bridge) as client:
        first = await client.messages.create(
            model="claude-test",
            max_tokens=200,
            system="Answer with the tool.",
            messages=[{"role": "user", "content": "What is 6 * 7?"}],
            tools=[SUBMIT_TOOL],  # type: ignore[list-item]
        )
        assert first.type == "message"
        assert first.role == "assistant"
        assert first.model == "claude-test"
        assert first.stop_reason == "tool_use"
        (block,) = first.content
        assert block.type == "tool_use"
        assert block.name == "submit_answer"
        assert isinstance(block.input, dict)
        assert set(block.input) == {"answer"}
        assert first.usage.input_tokens > 0
        assert first.usage.output_tokens > 0

        second = await client.messages.create(
            model="claude-test",
            max_tokens=200,
            messages=[
                {"role": "user", "content": "What is 6 * 7?"},
                {"role": "assistant", "content": [block.model_dump()]},  # type: ignore[misc,list-item]
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": block.id, "content": "accepted"}
                    ],
                },
            ],
            tools=[SUBMIT_TOOL],  # type: ignore[list-item]
        )
        assert second.stop_reason == "end_turn"
        assert second.content[0].type == "text"
        assert second.content[0].text == block.input["answer"]
    # The tool_use input re-serialises to the exact arguments text the model generated.
    sent_back = bridge.seen[-1]["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent_back == json.dumps(block.input)
    assert bridge.seen[-1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": block.id,
        "content": "accepted",
    }


async def test_anthropic_sdk_streaming_equals_non_streaming(bridge: _Bridge) -> None:
    kwargs: dict[str, Any] = {
        "model": "claude-test",
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "Please echo this sentence back, héllo ✓."}],
    }
    async with _anthropic(bridge) as client:
        plain = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            pieces = [text async for text in stream.text_stream]
            streamed = await stream.get_final_message()
        raw = await client.messages.create(**kwargs, stream=True)
        kinds = [event.type async for event in raw]
    assert plain.stop_reason == "end_turn"
    assert plain.content[0].type == "text"
    assert len(pieces) > 1
    assert "".join(pieces) == plain.content[0].text == "Please echo this sentence back, héllo ✓."
    assert streamed.content[0].type == "text"
    assert streamed.content[0].text == plain.content[0].text
    assert streamed.stop_reason == "end_turn"
    assert streamed.usage.input_tokens == plain.usage.input_tokens
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert bridge.seen[-1]["stream_options"] == {"include_usage": True}


async def test_anthropic_sdk_parallel_tool_calls_streamed(bridge: _Bridge) -> None:
    kwargs: dict[str, Any] = {
        "model": "claude-test",
        "max_tokens": 400,
        "tools": SQL_TOOLS,
        "messages": [
            {"role": "user", "content": "How many employees are there?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "list_tables", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "text", "text": '{"tables": ["employees", "orders"]}'}
                        ],
                    }
                ],
            },
        ],
    }
    async with _anthropic(bridge) as client:
        plain = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            streamed = await stream.get_final_message()
    expected = [("describe_table", {"name": "employees"}), ("describe_table", {"name": "orders"})]
    for msg in (plain, streamed):
        assert msg.stop_reason == "tool_use"
        uses = [b for b in msg.content if isinstance(b, ToolUseBlock)]
        assert [(b.name, b.input) for b in uses] == expected
    ids = [[b.id for b in m.content if isinstance(b, ToolUseBlock)] for m in (plain, streamed)]
    assert ids[0] == ids[1]


async def test_anthropic_sdk_stop_sequence_and_max_tokens(bridge: _Bridge) -> None:
    base: dict[str, Any] = {
        "model": "claude-test",
        "messages": [{"role": "user", "content": "alpha beta gamma"}],
    }
    async with _anthropic(bridge) as client:
        stopped = await client.messages.create(**base, max_tokens=100, stop_sequences=["gamma"])
        cut = await client.messages.create(**base, max_tokens=3)
        async with client.messages.stream(**base, max_tokens=100, stop_sequences=["gamma"]) as s:
            streamed = await s.get_final_message()
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "gamma"
    assert stopped.content[0].type == "text"
    assert stopped.content[0].text == "alpha beta "
    assert streamed.stop_reason == "stop_sequence"
    assert streamed.stop_sequence == "gamma"
    assert cut.stop_reason == "max_tokens"
    assert cut.usage.output_tokens == 3


async def test_anthropic_sdk_bad_request(bridge: _Bridge) -> None:
    async with _anthropic(bridge) as client:
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(
                model="claude-test",
                max_tokens=10,
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "web_search_20250305", "name": "web_search"}],
            )
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict)
    assert info.value.body["error"]["type"] == "invalid_request_error"


FUNCTION_TOOL = {
    "type": "function",
    "name": "submit_answer",
    "description": "Submit the final answer.",
    "parameters": {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    },
}


async def test_openai_responses_function_call_round_trip(bridge: _Bridge) -> None:
    async with _openai(bridge) as client:
        first = await client.responses.create(
            model="gpt-test",
            instructions="Use the tool.",
            input="What is 9 - 4?",
            tools=[FUNCTION_TOOL],  # type: ignore[list-item]
        )
        assert first.object == "response"
        assert first.status == "completed"
        assert first.model == "gpt-test"
        (call,) = first.output
        assert call.type == "function_call"
        assert call.name == "submit_answer"
        answer = json.loads(call.arguments)["answer"]
        assert first.usage is not None
        assert first.usage.input_tokens > 0

        second = await client.responses.create(
            model="gpt-test",
            input=[
                {"role": "user", "content": "What is 9 - 4?"},
                call.model_dump(exclude_none=True),  # type: ignore[list-item]
                {"type": "function_call_output", "call_id": call.call_id, "output": "ok"},
            ],
            tools=[FUNCTION_TOOL],  # type: ignore[list-item]
        )
    assert second.output_text == answer
    assert second.output[0].type == "message"


async def test_openai_responses_streaming_equals_non_streaming(bridge: _Bridge) -> None:
    kwargs: dict[str, Any] = {"model": "gpt-test", "input": "Echo me back: ünïcode and more text."}
    async with _openai(bridge) as client:
        plain = await client.responses.create(**kwargs)
        events = [event async for event in await client.responses.create(**kwargs, stream=True)]
        async with client.responses.stream(**kwargs) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    assert plain.output_text == "Echo me back: ünïcode and more text."
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == plain.output_text
    assert len(deltas) > 1
    assert "".join(deltas) == plain.output_text
    assert final.output_text == plain.output_text
    assert final.status == "completed"
    assert final.usage is not None
    assert plain.usage is not None
    assert final.usage.output_tokens == plain.usage.output_tokens


async def test_openai_responses_stream_function_calls(bridge: _Bridge) -> None:
    tools = [
        {"type": "function", "name": t["name"], "parameters": t["input_schema"]} for t in SQL_TOOLS
    ]
    kwargs: dict[str, Any] = {
        "model": "gpt-test",
        "tools": tools,
        "input": [
            {"role": "user", "content": "How many employees are there?"},
            {"type": "function_call", "call_id": "c1", "name": "list_tables", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": '["employees", "orders"]'},
        ],
    }
    async with _openai(bridge) as client:
        plain = await client.responses.create(**kwargs)
        async with client.responses.stream(**kwargs) as stream:
            arg_deltas = [
                e.delta async for e in stream if e.type == "response.function_call_arguments.delta"
            ]
            final = await stream.get_final_response()
    expected = [("describe_table", {"name": "employees"}), ("describe_table", {"name": "orders"})]
    for resp in (plain, final):
        calls = [o for o in resp.output if isinstance(o, ResponseFunctionToolCall)]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len(arg_deltas) == 2


async def test_openai_responses_bad_request(bridge: _Bridge) -> None:
    async with _openai(bridge) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(
                model="gpt-test", input="hi", tools=[{"type": "web_search"}]
            )
    assert info.value.status_code == 400
    assert info.value.param == "tools.0.type"
