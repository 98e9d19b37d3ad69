"""The model gateway, driven by the official ``openai`` SDK over real sockets.

Upstreams are envport's scripted policy server (vLLM-shaped token ids and logprobs) with
fault injection on, so every failure here is a real HTTP failure on a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from envport.gateway import (
    Gateway,
    GatewayPolicy,
    RetryPolicy,
    create_gateway_app,
)
from envport.gateway.capture import (
    CallRecord,
    IdSource,
    Rollout,
    RolloutInfo,
    StreamAssembler,
    has_output,
    new_id,
)
from envport.gateway.http1 import Http1Pool, Timeouts
from envport.gateway.upstream import client_timeout
from envport.policy import ScriptedPolicy, create_policy_app
from envport.serving import free_port, serve_in_thread
from envport.trace import ErrorKind, ModelCall, SQLiteTraceStore, TraceStatus, TraceStoreError

GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the number.",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer"}},
            "required": ["number"],
        },
    },
}
GUESS = [{"role": "user", "content": "I am thinking of an integer from 1 to 100. Find it."}]
ASK = [{"role": "user", "content": "What is 12 + 7?"}]
FAST_RETRY = RetryPolicy(max_attempts=3, deadline_s=30, backoff_base_s=0.01, backoff_max_s=0.05)


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstreams() -> Iterator[list[tuple[str, Any]]]:
    """Two scripted upstreams with fault injection: [(base URL ending /v1, app)]."""
    with ExitStack() as stack:
        out = []
        for _ in range(2):
            app = create_policy_app(ScriptedPolicy(seed=0), faults=True)
            url = stack.enter_context(serve_in_thread(app))
            out.append((f"{url}/v1", app))
        yield out


@pytest.fixture(autouse=True)
def _clear_faults(upstreams: list[tuple[str, Any]]) -> Iterator[None]:
    for _, app in upstreams:
        app.state.faults.clear()
    yield
    for _, app in upstreams:
        app.state.faults.clear()


@pytest.fixture
def upstream(upstreams: list[tuple[str, Any]]) -> tuple[str, Any]:
    return upstreams[0]


class Served:
    """A gateway on a real socket, and helpers to drive it as the orchestrator."""

    def __init__(self, gateway: Gateway, url: str) -> None:
        self.gw = gateway
        self.url = url
        self.admin = httpx.AsyncClient(
            base_url=url, headers={"authorization": f"Bearer {gateway.orchestrator_token}"}
        )

    async def rollout(self, **info: Any) -> dict[str, Any]:
        r = await self.admin.post("/admin/rollouts", json=info)
        assert r.status_code == 201, r.text
        body: dict[str, Any] = r.json()
        return body

    def client(self, rollout: dict[str, Any], **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=rollout["base_url"], api_key=rollout["token"], **kwargs)

    async def calls(self, rollout_id: str) -> list[ModelCall]:
        r = await self.admin.get(f"/admin/rollouts/{rollout_id}")
        assert r.status_code == 200, r.text
        return [ModelCall.model_validate(c) for c in r.json()["model_calls"]]

    async def view(self, rollout_id: str) -> dict[str, Any]:
        r = await self.admin.get(f"/admin/rollouts/{rollout_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    async def stats(self) -> dict[str, Any]:
        body: dict[str, Any] = (await self.admin.get("/admin/stats")).json()
        return body


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(upstream_urls, **gateway_kwargs) -> Served``; all stopped at the end."""
    stack = ExitStack()
    served: list[Served] = []

    def start(urls: list[str], **kwargs: Any) -> Served:
        kwargs.setdefault("retry", FAST_RETRY)
        gateway = Gateway(urls, **kwargs)
        url = stack.enter_context(serve_in_thread(create_gateway_app(gateway), lean=True))
        served.append(Served(gateway, url))
        return served[-1]

    with stack:
        yield start


@pytest.fixture
async def gw(serve: Any, upstream: tuple[str, Any]) -> AsyncIterator[Served]:
    served: Served = serve([upstream[0]])
    yield served
    await served.admin.aclose()


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {})[name]


async def collect(stream: Any, into: list[Any]) -> None:
    async for chunk in stream:
        into.append(chunk)


async def wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# --- recording --------------------------------------------------------------------------------


async def test_non_streaming_with_tools_records_everything(gw: Served) -> None:
    ro = await gw.rollout(task_id="guess-1")
    async with gw.client(ro) as client:
        resp = await client.chat.completions.create(
            model="my-model", messages=GUESS, tools=[GUESS_TOOL], n=2, logprobs=True, top_logprobs=2
        )
    assert resp.choices[0].message.tool_calls
    assert resp.choices[0].message.tool_calls[0].function.name == "guess"
    [call] = await gw.calls(ro["rollout_id"])
    assert call.api == "chat.completions"
    assert call.model == "my-model"  # as requested; never rewritten
    assert call.response_model == resp.model
    assert call.request is not None
    assert call.request["tools"] == [GUESS_TOOL]
    assert call.original_request is None  # forwarded unchanged
    assert call.sampling.n == 2
    assert call.sampling.logprobs is True
    assert call.response is not None
    assert call.response["choices"][1]["message"]["tool_calls"]
    assert [c.finish_reason for c in call.choices] == ["tool_calls", "tool_calls"]
    assert call.attempts == 1
    assert call.error is None
    assert not call.streamed
    assert call.latency_s is not None
    assert call.latency_s > 0
    assert call.usage is not None
    assert call.usage.prompt_tokens == resp.usage.prompt_tokens
    # Token ids and logprobs are exactly what the upstream produced, for every choice.
    assert call.prompt_token_ids == extra(resp, "prompt_token_ids")
    assert len(call.choices) == 2
    for recorded, choice in zip(call.choices, resp.choices, strict=True):
        assert recorded.completion_token_ids == extra(choice, "token_ids")
        assert choice.logprobs is not None
        assert choice.logprobs.content is not None
        assert recorded.completion_logprobs == [t.logprob for t in choice.logprobs.content]
        assert recorded.top_logprobs is not None
        assert len(recorded.top_logprobs[0]) == 2
    assert call.metadata["token_ids"] == "present"
    assert call.metadata["logprobs"] == "present"


async def test_streaming_reassembles_to_the_non_streamed_call(gw: Served) -> None:
    ro = await gw.rollout()
    kwargs: dict[str, Any] = {"model": "m", "messages": GUESS, "tools": [GUESS_TOOL]}
    kwargs.update(n=2, logprobs=True, seed=3)
    async with gw.client(ro) as client:
        plain = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert len(chunks) > 4
    first, second = await gw.calls(ro["rollout_id"])
    assert second.streamed
    assert not first.streamed
    assert second.ttft_s is not None
    assert second.latency_s is not None
    assert 0 < second.ttft_s <= second.latency_s
    assert second.usage is not None
    assert second.usage.total_tokens == plain.usage.total_tokens
    assert second.prompt_token_ids == first.prompt_token_ids
    assert [c.model_dump() for c in second.choices] == [c.model_dump() for c in first.choices]
    assert first.response is not None
    assert second.response is not None
    for a, b in zip(first.response["choices"], second.response["choices"], strict=True):
        assert a["message"]["tool_calls"] == b["message"]["tool_calls"]
        assert (a["message"]["content"] or "") == (b["message"]["content"] or "")


def _paced_upstream(release: threading.Event, *, hold_first: bool = False) -> Starlette:
    """An upstream that sends one chunk, then waits for ``release`` before the rest
    (``hold_first``: it sends only the answer's head before it waits, as a model server
    does during a long prefill)."""

    def event(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> bytes:
        import json

        choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids}
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "paced"}
        return f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode()

    async def chat(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for _ in range(1000 if hold_first else 0):  # released from another thread
                if release.is_set():
                    break
                await asyncio.sleep(0.01)
            yield event({"role": "assistant", "content": "Hel"}, [1, 2])
            for _ in range(1000):
                if release.is_set():
                    break
                await asyncio.sleep(0.01)
            yield event({"content": "lo"}, [3])
            yield event({}, [4], "stop")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_stream_chunks_are_relayed_as_they_arrive(serve: Any) -> None:
    release = threading.Event()
    with serve_in_thread(_paced_upstream(release)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        async with served.client(ro) as client:
            stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
            it = aiter(stream)
            first = await anext(it)
            # The upstream is still holding the rest back: no buffering in between.
            assert first.choices[0].delta.content == "Hel"
            assert not release.is_set()
            release.set()
            rest = [c async for c in it]
        assert "".join(c.choices[0].delta.content or "" for c in rest) == "lo"
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert call.streamed
    assert call.ttft_s is not None
    assert call.latency_s is not None
    assert call.ttft_s < call.latency_s
    assert call.choices[0].completion_token_ids == [1, 2, 3, 4]
    assert call.choices[0].finish_reason == "stop"
    assert call.response is not None
    assert call.response["choices"][0]["message"]["content"] == "Hello"
    assert call.metadata["logprobs"] == "missing"


def _stream_request(served: Served, ro: dict[str, Any]) -> tuple[str, int, bytes]:
    """(host, port, the bytes of a streamed chat call for rollout ``ro``)."""
    host, port = served.url.removeprefix("http://").split(":")
    body = orjson.dumps({"model": "m", "messages": ASK, "stream": True})
    request = (
        f"POST /rollouts/{ro['rollout_id']}/v1/chat/completions HTTP/1.1\r\n"
        f"host: {host}\r\nauthorization: Bearer {ro['token']}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    return host, int(port), request


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """One chunked HTTP/1.1 response body, read to its terminating chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    body = b""
    while size := int((await reader.readline()).split(b";")[0], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    assert await reader.readline() == b"\r\n"
    return body


async def test_a_stream_ends_with_done_and_a_complete_answer_on_a_kept_connection(
    gw: Served,
) -> None:
    # [DONE] and the end of the chunked answer go out together; the agent's connection
    # stays usable for its next call, and a finished stream is not taken for a cut one.
    ro = await gw.rollout()
    host, port, request = _stream_request(gw, ro)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(2):
            writer.write(request)
            answer = await _read_chunked(reader)
            assert answer.startswith(b"data: {")
            assert answer.endswith(b"data: [DONE]\n\n")
    finally:
        writer.close()
        await writer.wait_closed()
    calls = await gw.calls(ro["rollout_id"])
    assert [c.streamed for c in calls] == [True, True]
    assert [c.error for c in calls] == [None, None]
    assert all(c.choices and c.choices[0].finish_reason for c in calls)


async def test_completions_streaming_and_not(gw: Served) -> None:
    ro = await gw.rollout()
    async with gw.client(ro) as client:
        plain = await client.completions.create(model="m", prompt="What is 2 + 3?", logprobs=1)
        stream = await client.completions.create(model="m", prompt="What is 2 + 3?", stream=True)
        text = "".join([c.choices[0].text async for c in stream])
    assert text == plain.choices[0].text
    first, second = await gw.calls(ro["rollout_id"])
    assert first.api == second.api == "completions"
    assert first.choices[0].completion_token_ids == extra(plain.choices[0], "token_ids")
    assert first.prompt_token_ids == extra(plain.choices[0], "prompt_token_ids")
    assert first.choices[0].completion_logprobs is not None
    assert second.choices[0].completion_token_ids == first.choices[0].completion_token_ids
    assert second.prompt_token_ids == first.prompt_token_ids


async def test_missing_token_ids_are_marked_missing(gw: Served) -> None:
    ro = await gw.rollout()
    async with gw.client(ro) as client:
        await client.chat.completions.create(
            model="m", messages=ASK, extra_body={"return_token_ids": False}
        )
    [call] = await gw.calls(ro["rollout_id"])
    assert call.choices[0].completion_token_ids is None
    assert call.metadata["token_ids"] == "missing"
    assert call.metadata["logprobs"] == "missing"


async def test_a_policy_asks_for_token_data_and_both_requests_are_recorded(
    serve: Any, upstream: tuple[str, Any]
) -> None:
    served: Served = serve([upstream[0]], policy=GatewayPolicy(request_token_ids=True))
    ro = await served.rollout()
    async with served.client(ro) as client:
        await client.chat.completions.create(
            model="m", messages=ASK, extra_body={"return_token_ids": False}
        )
    [call] = await served.calls(ro["rollout_id"])
    await served.admin.aclose()
    assert call.original_request is not None
    assert "logprobs" not in call.original_request
    assert call.original_request["return_token_ids"] is False
    assert call.request is not None
    assert call.request["logprobs"] is True
    assert call.request["return_token_ids"] is True
    assert call.choices[0].completion_token_ids
    assert call.choices[0].completion_logprobs
    assert call.metadata["token_ids"] == "present"


# --- retries, upstream failures ---------------------------------------------------------------


async def test_upstream_500_is_retried_then_succeeds(gw: Served, upstream: tuple[str, Any]) -> None:
    ro = await gw.rollout()
    upstream[1].state.faults.push("500", times=2)
    async with gw.client(ro) as client:
        resp = await client.chat.completions.create(model="m", messages=ASK)
    assert resp.choices[0].message.content
    [call] = await gw.calls(ro["rollout_id"])
    assert call.attempts == 3
    assert call.error is None
    assert [a["status"] for a in call.metadata["attempt_log"]] == [500, 500, 200]


async def test_upstream_500_past_the_budget_fails_and_is_recorded(
    gw: Served, upstream: tuple[str, Any]
) -> None:
    ro = await gw.rollout()
    upstream[1].state.faults.push("500", times=3)
    async with gw.client(ro) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="m", messages=ASK)
    assert info.value.status_code == 500
    assert "Injected fault" in str(info.value)  # upstream's own error body, passed through
    [call] = await gw.calls(ro["rollout_id"])
    assert call.attempts == 3
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert call.error.retryable


async def test_sdk_retries_are_attempts_of_one_call(serve: Any, upstream: tuple[str, Any]) -> None:
    retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.02)
    served: Served = serve([upstream[0]], retry=retry)
    ro = await served.rollout()
    upstream[1].state.faults.push("500", times=3)  # gateway gives up once; the SDK retries
    async with served.client(ro, max_retries=2) as client:
        resp = await client.chat.completions.create(model="m", messages=ASK)
    assert resp.choices[0].message.content
    calls = await served.calls(ro["rollout_id"])
    await served.admin.aclose()
    assert len(calls) == 1
    [call] = calls
    assert call.attempts == 4
    assert call.error is None
    assert call.metadata["client_retries"] == 1
    assert call.metadata["earlier_errors"][0]["kind"] == "model_provider"


async def test_upstream_down_is_502_after_retries(serve: Any) -> None:
    served: Served = serve([f"http://127.0.0.1:{free_port()}/v1"])
    ro = await served.rollout()
    async with served.client(ro) as client:
        asked = datetime.now(UTC)
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=ASK)
        answered = datetime.now(UTC)
    assert info.value.status_code == 502
    assert isinstance(info.value.body, dict)
    assert info.value.body["type"] == "upstream_error"
    [call] = await served.calls(ro["rollout_id"])
    await served.admin.aclose()
    assert call.attempts == 3
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert "ConnectError" in call.error.message
    # when it started, not when its tries ran out (nothing was ever written upstream)
    assert asked <= call.started_at <= call.started_at + timedelta(seconds=call.latency_s)
    assert call.started_at + timedelta(seconds=call.latency_s) <= answered + timedelta(seconds=0.01)


async def test_a_dead_upstream_fails_over_and_the_rollout_moves(
    serve: Any, upstream: tuple[str, Any]
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    served: Served = serve([dead, upstream[0]])
    ro = await served.rollout()
    async with served.client(ro) as client:
        await client.chat.completions.create(model="m", messages=ASK)
        await client.chat.completions.create(model="m", messages=ASK)
    first, second = await served.calls(ro["rollout_id"])
    view = await served.view(ro["rollout_id"])
    await served.admin.aclose()
    assert first.attempts == 2
    assert first.metadata["attempt_log"][0]["upstream"] == dead
    assert second.attempts == 1
    assert second.endpoint is not None
    assert second.endpoint.startswith(upstream[0])
    assert view["upstream"] == upstream[0]


async def test_slow_upstream_times_out_with_504(serve: Any, upstream: tuple[str, Any]) -> None:
    retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01)
    served: Served = serve([upstream[0]], retry=retry, timeout=httpx.Timeout(0.3))
    ro = await served.rollout()
    upstream[1].state.faults.push("slow:1", times=2)
    async with served.client(ro) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=ASK)
    assert info.value.status_code == 504
    [call] = await served.calls(ro["rollout_id"])
    await served.admin.aclose()
    assert call.attempts == 2
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert "timed out" in call.error.message


async def test_the_call_budget_cuts_a_slow_upstream_before_its_read_timeout(
    serve: Any, upstream: tuple[str, Any]
) -> None:
    # The budget (RetryPolicy.deadline_s) and the read timeout share one timer per try:
    # an upstream slower than the budget fails the call at the budget (504), not after
    # the 30 s read timeout, and no retry starts once the budget is spent.
    retry = RetryPolicy(max_attempts=3, deadline_s=0.3, backoff_base_s=0.01)
    served: Served = serve([upstream[0]], retry=retry, timeout=httpx.Timeout(30))
    ro = await served.rollout()
    upstream[1].state.faults.push("slow:1", times=3)
    async with served.client(ro) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=ASK, stream=True)
    assert info.value.status_code == 504
    [call] = await served.calls(ro["rollout_id"])
    stats = await served.stats()
    await served.admin.aclose()
    assert call.attempts == 1
    assert call.streamed
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert "timed out" in call.error.message
    assert "deadline" in call.error.message
    assert stats["in_flight"] == 0


def test_call_and_rollout_ids_are_unique_within_and_across_processes(tmp_path: Path) -> None:
    ids = [new_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert CallRecord("chat.completions", {}, {}, None).call_id != ids[-1]
    # A restarted gateway is a new process: its ids start with another prefix.
    script = "from envport.gateway.capture import new_id; print(new_id())"
    others = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert len({others[0][:20], others[1][:20], ids[0][:20]}) == 3
    source = IdSource()
    first = source()
    source.reseed()  # what a forked child does
    assert source()[:20] != first[:20]


async def test_a_rollout_is_built_a_slice_at_a_time_in_order() -> None:
    # Building the records of a long rollout (at finish) gives the event loop a turn
    # between slices, so the streams it relays meanwhile are not held up by it.
    rollout = Rollout("r1", RolloutInfo(), None)
    for i in range(50):
        record = CallRecord("chat.completions", {"model": "m"}, {"model": "m"}, None, streamed=True)
        record.raw_chunks = [
            orjson.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}),
            orjson.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        ]
        rollout.add(record, "chat.completions", f"d{i}", 0)
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    before = turns
    calls = await rollout.build(slice_s=0.0)  # a pause after every record
    task.cancel()
    await asyncio.wait([task])
    assert turns - before >= 49
    assert [c.response["choices"][0]["message"]["content"] for c in calls] == [
        f"t{i}" for i in range(50)
    ]
    assert [c.choices[0].finish_reason for c in calls] == ["stop"] * 50
    assert not rollout._pending
    assert rollout.calls == calls


async def test_invalid_json_from_upstream_is_502(gw: Served, upstream: tuple[str, Any]) -> None:
    ro = await gw.rollout()
    upstream[1].state.faults.push("garbage")
    async with gw.client(ro) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=ASK)
    assert info.value.status_code == 502
    [call] = await gw.calls(ro["rollout_id"])
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert "invalid JSON" in call.error.message
    assert call.attempts == 1


async def test_a_body_cut_before_the_end_is_retried(gw: Served, upstream: tuple[str, Any]) -> None:
    ro = await gw.rollout()
    upstream[1].state.faults.push("cut-stream")  # non-streaming: half the body, then EOF
    async with gw.client(ro) as client:
        resp = await client.chat.completions.create(model="m", messages=ASK)
    assert resp.choices[0].message.content
    [call] = await gw.calls(ro["rollout_id"])
    assert call.attempts == 2
    assert call.error is None


@pytest.mark.parametrize("fault", ["cut-stream", "garbage"])
async def test_a_stream_failing_midway_ends_with_an_error_event(
    gw: Served, upstream: tuple[str, Any], fault: str
) -> None:
    ro = await gw.rollout()
    upstream[1].state.faults.push(fault)
    seen = []
    async with gw.client(ro) as client:
        stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
        with pytest.raises(openai.APIError) as info:
            await collect(stream, seen)
    assert "Upstream" in info.value.message
    [call] = await gw.calls(ro["rollout_id"])
    assert call.streamed
    assert call.attempts == 1
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    if fault == "cut-stream":
        assert seen
        assert call.response is not None


_OK_CHAT = orjson.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
)
_JSON = {"content-type": "application/json"}


def _scripted_upstream(
    answers: list[tuple[int, dict[str, str], bytes]], arrived: list[float]
) -> Starlette:
    """An upstream answering its n-th request with ``answers[n]`` (the last one from then
    on), noting when each request arrived."""

    async def chat(request: Request) -> Response:
        arrived.append(time.monotonic())
        status, headers, body = answers[min(len(arrived), len(answers)) - 1]
        return Response(body, status, headers=headers)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_a_429_is_retried_after_the_time_its_retry_after_asks(serve: Any) -> None:
    limited = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})
    arrived: list[float] = []
    answers = [(429, {**_JSON, "retry-after": "1"}, limited), (200, _JSON, _OK_CHAT)]
    with serve_in_thread(_scripted_upstream(answers, arrived)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        async with served.client(ro) as client:
            resp = await client.chat.completions.create(model="m", messages=ASK)
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert resp.choices[0].message.content == "hi"
    assert len(arrived) == 2
    assert arrived[1] - arrived[0] >= 0.95  # upstream's Retry-After, not the 10 ms backoff
    assert call.attempts == 2
    assert [a["status"] for a in call.metadata["attempt_log"]] == [429, 200]
    assert call.error is None


async def test_a_429_asking_for_more_than_the_budget_is_answered_with_its_retry_after(
    serve: Any,
) -> None:
    limited = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})
    arrived: list[float] = []
    answers = [(429, {**_JSON, "retry-after": "60"}, limited)]
    with serve_in_thread(_scripted_upstream(answers, arrived)) as up:
        served: Served = serve([f"{up}/v1"], retry=RetryPolicy(max_attempts=3, deadline_s=5))
        ro = await served.rollout()
        async with served.client(ro) as client:
            with pytest.raises(openai.RateLimitError) as info:
                await client.chat.completions.create(model="m", messages=ASK)
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert len(arrived) == 1  # no retry that could not finish within the budget
    assert info.value.response.headers["retry-after"] == "60"
    assert "slow down" in info.value.message
    assert call.error is not None
    assert call.error.retryable
    assert "HTTP 429: slow down" in call.error.message


_HTML_502 = (502, {"content-type": "text/html"}, b"<html><h1>502 Bad Gateway</h1></html>")
_JSON_500 = (
    500,
    _JSON,
    orjson.dumps({"error": {"message": "boom", "type": "server_error", "code": "engine_dead"}}),
)
_JSON_400 = (
    400,
    _JSON,
    orjson.dumps(
        {
            "object": "error",  # vLLM's flat shape
            "message": "temperature must be >= 0",
            "type": "BadRequestError",
            "param": "temperature",
            "code": 400,
        }
    ),
)
_NOT_JSON_200 = (200, _JSON, b'{"id": "c1", "choices": [')


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize(
    ("answer", "status", "says"),
    [
        (_HTML_502, 502, "502 Bad Gateway"),
        (_JSON_500, 500, "boom"),
        (_JSON_400, 400, "temperature must be >= 0"),
        (_NOT_JSON_200, 502, "invalid JSON"),
        (None, 502, "failed"),  # nothing listening
        ("slow", 504, "timed out"),
    ],
    ids=["html-502", "json-500", "vllm-400", "invalid-json", "down", "slow"],
)
async def test_every_upstream_failure_gets_its_status_and_an_error_body_in_the_api_s_shape(
    serve: Any, api: str, answer: Any, status: int, says: str
) -> None:
    """On every model API, non-streamed: the agent gets the right status and an error body
    its SDK reads (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", ...}``),
    and the call is recorded as failed by the model provider."""
    arrived: list[float] = []
    timeout = None
    with contextlib.ExitStack() as stack:
        if answer is None:
            url = f"http://127.0.0.1:{free_port()}/v1"
        elif answer == "slow":
            url = stack.enter_context(serve_in_thread(_slow_upstream())) + "/v1"
            timeout = httpx.Timeout(0.3, connect=2.0)
        else:
            url = stack.enter_context(serve_in_thread(_scripted_upstream([answer], arrived)))
            url += "/v1"
        served: Served = serve([url], timeout=timeout) if timeout else serve([url])
        ro = await served.rollout()
        headers = {"authorization": f"Bearer {ro['token']}"}
        if api == "chat":
            r = await served.admin.post(
                f"{ro['base_url']}/chat/completions",
                json={"model": "m", "messages": ASK},
                headers=headers,
            )
        elif api == "responses":
            r = await served.admin.post(
                f"{ro['base_url']}/responses", json={"model": "m", "input": "hi"}, headers=headers
            )
        else:
            r = await served.admin.post(
                f"{ro['anthropic_base_url']}/v1/messages",
                json={"model": "m", "max_tokens": 16, "messages": ASK},
                headers={"x-api-key": ro["token"], "anthropic-version": "2023-06-01"},
            )
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    if api == "messages":
        assert body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        kinds = {400: "invalid_request_error", 504: "timeout_error"}
        assert body["error"]["type"] == kinds.get(status, "api_error")
        assert says in body["error"]["message"]
    elif api == "chat" and answer in (_JSON_500, _JSON_400):
        assert r.content == answer[2]  # upstream's own JSON error body, as it was
    else:
        error = body["error"]
        assert {"message", "type", "param", "code"} <= set(error)
        assert says in error["message"]
        if answer is _JSON_400 and api == "responses":  # upstream's details kept
            assert (error["param"], error["code"]) == ("temperature", "400")
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert says in call.error.message


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_a_streamed_call_refused_by_upstream_gets_the_status_retry_after_and_shape(
    serve: Any, api: str
) -> None:
    """``stream: true`` and upstream answers 429 with a JSON error (no stream): the agent
    gets the 429, upstream's Retry-After, and an error body in its API's shape (upstream's
    own on chat; its message and type kept on the Responses API)."""
    refusal = {"message": "too many tokens", "type": "tokens", "code": "rate_limit_exceeded"}
    answer = (429, {**_JSON, "retry-after": "60"}, orjson.dumps({"error": refusal}))
    arrived: list[float] = []
    with serve_in_thread(_scripted_upstream([answer], arrived)) as up:
        served: Served = serve([f"{up}/v1"], retry=RetryPolicy(max_attempts=3, deadline_s=5))
        ro = await served.rollout()
        auth = {"authorization": f"Bearer {ro['token']}"}
        if api == "chat":
            url, body = f"{ro['base_url']}/chat/completions", {"model": "m", "messages": ASK}
        elif api == "responses":
            url, body = f"{ro['base_url']}/responses", {"model": "m", "input": "hi"}
        else:
            url = f"{ro['anthropic_base_url']}/v1/messages"
            body = {"model": "m", "max_tokens": 16, "messages": ASK}
            auth = {"x-api-key": ro["token"], "anthropic-version": "2023-06-01"}
        r = await served.admin.post(url, json={**body, "stream": True}, headers=auth)
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert r.status_code == 429
    assert r.headers["retry-after"] == "60"
    assert r.headers["content-type"].startswith("application/json")
    if api == "chat":
        assert r.json() == {"error": refusal}
    elif api == "responses":
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert "too many tokens" in error["message"]
    else:
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert "too many tokens" in r.json()["error"]["message"]
    assert len(arrived) == 1
    assert call.streamed
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert "too many tokens" in call.error.message


@pytest.mark.parametrize(
    ("status", "content", "message", "kind", "code", "is_object"),
    [
        (503, b'{"error": "overloaded"}', "overloaded", "server_error", None, True),
        (422, b'{"error": {"message": "m", "code": true}}', "m", "invalid_request_error", None, 1),
        (
            422,
            b'{"error": {"message": "m", "code": {"a": 1}}}',
            "m",
            "invalid_request_error",
            None,
            1,
        ),
        (429, b'{"message": "m", "code": 7, "type": "tokens"}', "m", "tokens", "7", True),
        (500, b"[1, 2]", "[1, 2]", "server_error", None, False),
        (502, b"\xff\xfe not utf-8", "\ufffd\ufffd not utf-8", "server_error", None, False),
        (500, b"", "(no body)", "server_error", None, False),
    ],
    ids=["string-error", "bool-code", "dict-code", "flat-int-code", "array", "not-utf8", "empty"],
)
def test_upstream_error_bodies_of_every_shape_are_read_safely(
    status: int, content: bytes, message: str, kind: str, code: str | None, is_object: bool
) -> None:
    from envport.gateway.app import _upstream_status_error

    error, obj = _upstream_status_error(status, content)
    assert error.status == status
    assert error.message == f"Upstream answered HTTP {status}: {message}"
    assert (error.type, error.error_code, obj) == (kind, code, bool(is_object))


def test_a_huge_upstream_error_message_is_cut() -> None:
    from envport.gateway.app import _upstream_status_error

    error, _ = _upstream_status_error(500, orjson.dumps({"error": {"message": "x" * 100_000}}))
    assert len(error.message) < 2100
    assert error.message.endswith("x...")


def _slow_upstream() -> Starlette:
    async def chat(request: Request) -> Response:
        await asyncio.sleep(1)  # past the gateway's 0.3 s timeout
        return Response(_OK_CHAT, media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_upstream_4xx_passes_through_unretried(gw: Served, upstream: tuple[str, Any]) -> None:
    ro = await gw.rollout()
    async with gw.client(ro) as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages=[])
    [call] = await gw.calls(ro["rollout_id"])
    assert call.attempts == 1
    assert call.error is not None
    assert not call.error.retryable


# --- routing ----------------------------------------------------------------------------------


async def test_least_loaded_routing_with_sticky_rollouts(
    serve: Any, upstreams: list[tuple[str, Any]]
) -> None:
    (u1, app1), (u2, _) = upstreams
    served: Served = serve([u1, u2])
    a, b, c = [await served.rollout() for _ in range(3)]
    async with served.client(a) as ca, served.client(b) as cb, served.client(c) as cc:
        await ca.chat.completions.create(model="m", messages=ASK)  # both idle: the first
        app1.state.faults.push("slow:1")
        slow = asyncio.create_task(ca.chat.completions.create(model="m", messages=ASK))

        async def a_in_flight() -> bool:
            return (await served.stats())["upstreams"][0]["in_flight"] == 1

        await wait_for(a_in_flight)
        await cb.chat.completions.create(model="m", messages=ASK)  # u1 is busy: u2
        await cc.chat.completions.create(model="m", messages=ASK)  # u1 still busy: u2
        await slow
        await ca.chat.completions.create(model="m", messages=ASK)  # sticky: u1
        await cb.chat.completions.create(model="m", messages=ASK)  # sticky: u2

    def upstream_of(call: ModelCall) -> str:
        assert call.endpoint is not None
        return u1 if call.endpoint.startswith(u1) else u2

    assert [upstream_of(x) for x in await served.calls(a["rollout_id"])] == [u1, u1, u1]
    assert [upstream_of(x) for x in await served.calls(b["rollout_id"])] == [u2, u2]
    assert [upstream_of(x) for x in await served.calls(c["rollout_id"])] == [u2]
    stats = await served.stats()
    await served.admin.aclose()
    assert [u["rollouts"] for u in stats["upstreams"]] == [1, 2]
    assert stats["in_flight"] == 0


# --- pause / drain / resume -------------------------------------------------------------------


async def test_pause_drains_in_flight_calls_and_resume_stamps_the_version(
    serve: Any, upstream: tuple[str, Any]
) -> None:
    served: Served = serve([upstream[0]], policy_version=1)
    ro = await served.rollout()
    async with served.client(ro) as client:
        upstream[1].state.faults.push("slow:0.5")
        in_flight = asyncio.create_task(client.chat.completions.create(model="m", messages=ASK))

        async def busy() -> bool:
            return (await served.stats())["in_flight"] == 1

        await wait_for(busy)
        pause = await served.admin.post("/admin/pause", json={"drain": True, "timeout_s": 20})
        # pause returned only once the in-flight call had finished
        assert pause.json() == {"paused": True, "drained": True, "in_flight": 0}
        assert in_flight.done()
        waiting = asyncio.create_task(client.chat.completions.create(model="m", messages=ASK))

        async def queued() -> bool:
            return (await served.stats())["waiting"] == 1

        await wait_for(queued)
        assert not waiting.done()
        resume = await served.admin.post("/admin/resume", json={"policy_version": 2})
        assert resume.json() == {"paused": False, "policy_version": 2}
        await waiting
        await client.chat.completions.create(model="m", messages=ASK)
    calls = await served.calls(ro["rollout_id"])
    await served.admin.aclose()
    assert [c.policy_version for c in calls] == [1, 2, 2]


async def test_paused_past_the_wait_is_503(serve: Any, upstream: tuple[str, Any]) -> None:
    served: Served = serve([upstream[0]], pause_wait_s=0.1)
    ro = await served.rollout()
    assert (await served.admin.post("/admin/pause")).json()["paused"] is True
    async with served.client(ro) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="m", messages=ASK)
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"]
    view = await served.view(ro["rollout_id"])
    await served.admin.aclose()
    assert view["model_calls"] == []
    assert view["errors"][0]["kind"] == "infrastructure"


async def test_a_call_waiting_at_the_gate_when_its_rollout_finishes_gets_410(
    serve: Any, upstream: tuple[str, Any]
) -> None:
    served: Served = serve([upstream[0]])
    ro = await served.rollout()
    await served.admin.post("/admin/pause", json={"drain": False})
    async with served.client(ro) as client:
        waiting = asyncio.create_task(client.chat.completions.create(model="m", messages=ASK))

        async def queued() -> bool:
            return (await served.stats())["waiting"] == 1

        await wait_for(queued)
        finish = await served.admin.post(f"/admin/rollouts/{ro['rollout_id']}/finish", json={})
        assert finish.json()["model_calls"] == 0
        await served.admin.post("/admin/resume", json={"policy_version": 2})
        with pytest.raises(openai.APIStatusError) as info:
            await waiting
    assert info.value.status_code == 410
    assert info.value.body["code"] == "rollout_finished"  # type: ignore[index]
    stats = await served.stats()
    await served.admin.aclose()
    assert stats["in_flight"] == 0
    assert stats["calls"] == 0  # never forwarded
    assert stats["upstreams"][0]["rollouts"] == 0  # and the finished rollout not assigned
    assert ro["rollout_id"] not in served.gw.pool._sticky


# --- rollouts, the store ----------------------------------------------------------------------


async def test_finish_stores_the_trace_and_revokes_the_agent(
    serve: Any, upstream: tuple[str, Any], tmp_path: Path
) -> None:
    store = SQLiteTraceStore(tmp_path / "traces.db")
    served: Served = serve([upstream[0]], store=store)
    ro = await served.rollout(task_id="t1", run_id="run-1", metadata={"k": "v"})
    async with served.client(ro) as client:
        await client.chat.completions.create(model="m", messages=ASK)
        await client.chat.completions.create(model="m", messages=ASK, stream=True)
        r = await served.admin.post(
            f"/admin/rollouts/{ro['rollout_id']}/finish",
            json={"rewards": [{"name": "correct", "value": 1.0}], "stop_reason": "done"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["reward"] == 1.0
        assert r.json()["model_calls"] == 2
        with pytest.raises(openai.AuthenticationError):  # token revoked with the rollout
            await client.chat.completions.create(model="m", messages=ASK)
    [trace] = store.query(rollout_id=ro["rollout_id"])
    assert trace.task_id == "t1"
    assert trace.run_id == "run-1"
    assert trace.metadata["k"] == "v"
    assert trace.status is TraceStatus.COMPLETED
    assert trace.reward == 1.0
    assert [c.streamed for c in trace.model_calls] == [False, True]
    assert all(c.choices[0].completion_token_ids for c in trace.model_calls)
    view = await served.view(ro["rollout_id"])  # read back from the store
    assert view["state"] == "finished"
    assert view["trace_id"] == trace.trace_id
    assert [c["streamed"] for c in view["model_calls"]] == [False, True]
    assert view["model_calls"][1]["choices"] == [
        c.model_dump(mode="json") for c in trace.model_calls[1].choices
    ]
    again = await served.admin.post(
        f"/rollouts/{ro['rollout_id']}/v1/chat/completions", json={"messages": ASK}
    )
    assert again.status_code == 410
    assert again.json()["error"]["code"] == "rollout_finished"
    await served.admin.aclose()
    store.close()


class _FlakyStore(SQLiteTraceStore):
    """A store whose writes fail while ``failing`` is set."""

    failing = True

    def put_many(self, traces: Any) -> int:
        if self.failing:
            raise TraceStoreError("disk full (simulated)")
        return super().put_many(traces)


async def test_a_finish_the_store_fails_is_a_503_and_a_retry_stores_the_trace(
    serve: Any, upstream: tuple[str, Any], tmp_path: Path
) -> None:
    store = _FlakyStore(tmp_path / "traces.db")
    served: Served = serve([upstream[0]], store=store)
    ro = await served.rollout(task_id="t1")
    rid = ro["rollout_id"]
    async with served.client(ro) as client:
        await client.chat.completions.create(model="m", messages=ASK)
        r = await served.admin.post(f"/admin/rollouts/{rid}/finish", json={"reward": 1.0})
        assert r.status_code == 503
        assert r.headers["retry-after"]
        assert r.json()["error"]["code"] == "trace_not_stored"
        assert "disk full" in r.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):  # closed to calls all the same
            await client.chat.completions.create(model="m", messages=ASK)
    assert (await served.view(rid))["state"] == "finishing"
    r = await served.admin.post(f"/admin/rollouts/{rid}/finish", json={"reward": 1.0})
    assert r.status_code == 503  # still failing: still kept
    store.failing = False
    r = await served.admin.post(f"/admin/rollouts/{rid}/finish", json={"reward": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["model_calls"] == 1
    [trace] = store.query(rollout_id=rid)
    assert trace.reward == 1.0
    assert trace.task_id == "t1"
    assert len(trace.model_calls) == 1
    assert r.json()["trace_id"] == trace.trace_id
    assert (await served.stats())["rollouts_live"] == 0
    again = await served.admin.post(f"/admin/rollouts/{rid}/finish", json={"reward": 1.0})
    assert again.status_code == 410
    await served.admin.aclose()
    store.close()


async def test_a_trace_the_store_failed_to_take_is_stored_when_the_gateway_stops(
    upstream: tuple[str, Any], tmp_path: Path
) -> None:
    """A finish answered 503 keeps its trace; if nobody finishes the rollout again, the
    gateway's shutdown stores it (with that finish's outcome) rather than dropping it."""
    store = _FlakyStore(tmp_path / "traces.db")
    gateway = Gateway([upstream[0]], store=store, retry=FAST_RETRY)
    with serve_in_thread(create_gateway_app(gateway), lean=True) as url:
        served = Served(gateway, url)
        ro = await served.rollout(task_id="t1")
        rid = ro["rollout_id"]
        async with served.client(ro) as client:
            await client.chat.completions.create(model="m", messages=ASK)
        r = await served.admin.post(f"/admin/rollouts/{rid}/finish", json={"reward": 0.5})
        assert r.status_code == 503
        assert store.query(rollout_id=rid) == []
        store.failing = False  # the disk has room again, but no one finishes it
        await served.admin.aclose()
    [trace] = store.query(rollout_id=rid)
    assert trace.reward == 0.5
    assert len(trace.model_calls) == 1
    store.close()


async def test_a_rollout_left_to_expire_is_finished_and_stored_with_an_error(
    serve: Any, upstream: tuple[str, Any], tmp_path: Path
) -> None:
    store = SQLiteTraceStore(tmp_path / "traces.db")
    served: Served = serve([upstream[0]], store=store)
    ro = await served.rollout(task_id="t1", ttl_s=2.0)
    kept = await served.rollout(task_id="t2")  # the default TTL: a day
    async with served.client(ro) as client:
        await client.chat.completions.create(model="m", messages=ASK)

        async def expired() -> bool:
            return (await served.stats())["rollouts_live"] == 1

        await wait_for(expired)  # the orchestrator never finished it
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=ASK)
    [trace] = store.query(rollout_id=ro["rollout_id"])
    assert trace.status is TraceStatus.FAILED
    assert trace.stop_reason == "expired"
    assert trace.reward is None
    assert len(trace.model_calls) == 1
    [error] = trace.errors
    assert error.kind is ErrorKind.INFRASTRUCTURE
    assert "expired" in error.message
    assert (await served.view(ro["rollout_id"]))["state"] == "finished"
    assert (await served.view(kept["rollout_id"]))["state"] == "live"
    assert ro["rollout_id"] not in served.gw.tokens._by_rollout
    await served.admin.aclose()
    store.close()


async def test_rollout_from_header_or_from_the_token(gw: Served) -> None:
    ro = await gw.rollout()
    base = f"{gw.url}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key=ro["token"], max_retries=0) as plain:
        await plain.chat.completions.create(model="m", messages=ASK)  # the token's rollout
        await plain.chat.completions.create(
            model="m", messages=ASK, extra_headers={"X-Envport-Rollout": ro["rollout_id"]}
        )
    # The orchestrator may call for any rollout it names.
    r = await gw.admin.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": ASK},
        headers={"x-envport-rollout": ro["rollout_id"]},
    )
    assert r.status_code == 200
    assert len(await gw.calls(ro["rollout_id"])) == 3
    r = await gw.admin.post("/v1/chat/completions", json={"model": "m", "messages": ASK})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "missing_rollout"


# --- bad input and denials --------------------------------------------------------------------


async def test_malformed_json_is_400_and_recorded(gw: Served) -> None:
    ro = await gw.rollout()
    headers = {"authorization": f"Bearer {ro['token']}", "content-type": "application/json"}
    async with httpx.AsyncClient() as http:
        for body in (b"{not json", b"[1, 2]"):
            r = await http.post(f"{ro['base_url']}/chat/completions", content=body, headers=headers)
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["code"] == "invalid_json"
    view = await gw.view(ro["rollout_id"])
    assert [e["kind"] for e in view["errors"]] == ["harness", "harness"]
    assert view["model_calls"] == []


async def test_unknown_rollout_is_404(gw: Served) -> None:
    r = await gw.admin.post("/rollouts/nope/v1/chat/completions", json={"messages": ASK})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "rollout_not_found"
    assert (await gw.admin.get("/admin/rollouts/nope")).status_code == 404
    assert (await gw.admin.post("/admin/rollouts/nope/finish")).status_code == 404
    r = await gw.admin.post("/admin/rollouts", json={"rollout_id": "bad id!"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "rollout_id"
    await gw.rollout(rollout_id="taken")
    r = await gw.admin.post("/admin/rollouts", json={"rollout_id": "taken"})
    assert r.status_code == 409


async def test_finish_refuses_a_non_finite_reward_and_keeps_the_rollout_open(gw: Served) -> None:
    """A NaN reward used to be stored and later broke every advantage of its group."""
    ro = await gw.rollout()
    url = f"/admin/rollouts/{ro['rollout_id']}/finish"
    for body, param in (
        ({"reward": "NaN"}, "reward"),
        ({"reward": "-Infinity"}, "reward"),
        ({"rewards": [{"name": "judge", "value": "NaN"}]}, "rewards"),
    ):
        r = await gw.admin.post(url, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert error["code"] == "invalid_value"
        assert "finite" in error["message"]
    assert (await gw.view(ro["rollout_id"]))["state"] != "finished"
    r = await gw.admin.post(url, json={"reward": 0.5})
    assert r.status_code == 200, r.text
    assert r.json()["reward"] == 0.5


async def test_missing_unknown_and_expired_tokens_are_401(gw: Served) -> None:
    ro = await gw.rollout(ttl_s=1.0)  # long enough for the first calls on a loaded machine
    url = f"{ro['base_url']}/chat/completions"
    body = {"model": "m", "messages": ASK}
    async with httpx.AsyncClient() as http:
        r = await http.post(url, json=body)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "missing_token"
        r = await http.post(url, json=body, headers={"authorization": "Bearer epa_nope"})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        r = await http.post(url, json=body, headers={"x-api-key": ro["token"]})
        assert r.status_code == 200  # the Anthropic SDK's header works too
        await asyncio.sleep(max(0.0, ro["expires_at"] - time.time()) + 0.05)
        r = await http.post(url, json=body, headers={"x-api-key": ro["token"]})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "expired_token"
        r = await http.get(f"{gw.url}/admin/stats")
        assert r.status_code == 401
        # Anthropic-shaped on the Messages route
        r = await http.post(f"{gw.url}/v1/messages", json={})
        assert r.status_code == 401
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
    async with gw.client(ro) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=ASK)


async def test_agent_tokens_are_denied_every_admin_route_and_other_rollouts(gw: Served) -> None:
    a, b = await gw.rollout(), await gw.rollout()
    admin_routes = [
        ("POST", "/admin/rollouts"),
        ("GET", "/admin/rollouts"),
        ("GET", f"/admin/rollouts/{a['rollout_id']}"),
        ("GET", f"/admin/rollouts/{b['rollout_id']}"),
        ("POST", f"/admin/rollouts/{a['rollout_id']}/finish"),
        ("POST", "/admin/pause"),
        ("POST", "/admin/resume"),
        ("GET", "/admin/stats"),
    ]
    headers = {"authorization": f"Bearer {a['token']}"}
    async with httpx.AsyncClient(base_url=gw.url, headers=headers) as agent:
        for method, path in admin_routes:
            r = await agent.request(method, path, json={})
            assert r.status_code == 403, (method, path)
            assert r.json()["error"]["type"] == "permission_error"
        body = {"model": "m", "messages": ASK}
        r = await agent.post(f"/rollouts/{b['rollout_id']}/v1/chat/completions", json=body)
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "wrong_rollout"
        r = await agent.post(
            "/v1/chat/completions", json=body, headers={"x-envport-rollout": b["rollout_id"]}
        )
        assert r.status_code == 403
        r = await agent.post("/rollouts/unknown/v1/chat/completions", json=body)
        assert r.status_code == 403  # an agent learns nothing about other rollout ids
    assert not gw.gw.gate.paused
    assert (await gw.view(b["rollout_id"]))["model_calls"] == []
    assert (await gw.view(b["rollout_id"]))["errors"] == []
    own = await gw.view(a["rollout_id"])
    assert own["state"] == "live"
    # the agent's probing of other rollouts shows on its own trace (the model calls)
    assert [e["kind"] for e in own["errors"]] == ["harness"] * 3
    assert b["rollout_id"] in own["errors"][0]["message"]
    assert (await gw.stats())["denied"] >= len(admin_routes) + 3


async def test_health_and_unknown_routes(gw: Served) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        r = await http.get("/health")
        assert r.status_code == 200
        assert r.json()["status"] == "healthy"
        r = await http.get("/nowhere")
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"


# --- other APIs -------------------------------------------------------------------------------


async def test_responses_api_through_the_gateway(gw: Served) -> None:
    ro = await gw.rollout()
    async with gw.client(ro) as client:
        resp = await client.responses.create(model="m", input="What is 12 + 7?")
    assert resp.output_text
    [call] = await gw.calls(ro["rollout_id"])
    assert call.api == "responses"
    assert call.original_request is not None
    assert call.original_request["input"]
    assert call.request is not None
    assert call.request["messages"]
    assert call.choices[0].completion_token_ids


async def test_responses_api_streaming_with_tools_through_the_gateway(gw: Served) -> None:
    """The openai SDK's Responses stream, with a function tool, through the real gateway
    (translated from upstream's chat stream by the relay): the SDK's own event parser
    reads every event, and the call is recorded with its token ids."""
    ro = await gw.rollout()
    tool = {"type": "function", **GUESS_TOOL["function"]}
    async with gw.client(ro) as client:
        plain = await client.responses.create(model="m", input=GUESS[0]["content"], tools=[tool])
        stream = await client.responses.create(
            model="m", input=GUESS[0]["content"], tools=[tool], stream=True
        )
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    final = events[-1].response
    [streamed_call] = [o for o in final.output if o.type == "function_call"]
    [plain_call] = [o for o in plain.output if o.type == "function_call"]
    assert streamed_call.name == plain_call.name == "guess"
    assert orjson.loads(streamed_call.arguments) == orjson.loads(plain_call.arguments)
    first, second = await gw.calls(ro["rollout_id"])
    assert (first.api, second.api) == ("responses", "responses")
    assert second.streamed
    assert second.error is None
    assert second.ttft_s is not None
    assert second.request is not None
    assert second.request["stream"] is True
    assert second.request["tools"][0]["function"]["name"] == "guess"
    assert second.choices[0].completion_token_ids == first.choices[0].completion_token_ids
    assert second.metadata["token_ids"] == "present"


async def test_messages_api_through_the_gateway(gw: Served) -> None:
    ro = await gw.rollout()
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi there"}]}
    headers = {"x-api-key": ro["token"], "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{ro['anthropic_base_url']}/v1/messages", json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["type"] == "message"
        assert r.json()["content"][0]["text"]
        async with http.stream(
            "POST",
            f"{ro['anthropic_base_url']}/v1/messages",
            json={**body, "stream": True},
            headers=headers,
        ) as s:
            text = (await s.aread()).decode()
    assert "event: message_start" in text
    assert "event: message_stop" in text
    calls = await gw.calls(ro["rollout_id"])
    assert [c.api for c in calls] == ["messages", "messages"]
    assert [c.streamed for c in calls] == [False, True]
    assert all(c.choices[0].completion_token_ids for c in calls)


def _sse_body(chunks: list[dict[str, Any]]) -> bytes:
    events = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return events + b"data: [DONE]\n\n"


def _tool_call_chunk(index: int, args: str = "", **start: str) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if start:
        call.update(id=start["id"], type="function")
        call["function"]["name"] = start["name"]
    delta = {"tool_calls": [call]}
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }


async def test_messages_stream_with_interleaved_parallel_tool_calls_through_the_gateway(
    serve: Any,
) -> None:
    """Upstream interleaves two tool calls' arguments; the anthropic SDK's stream helper
    sees each tool_use block complete at its content_block_stop (where a Claude-Code-style
    client takes the call) and the final message has both inputs."""
    chunks = [
        _tool_call_chunk(0, id="call_a", name="read"),
        _tool_call_chunk(1, id="call_b", name="read"),
        _tool_call_chunk(0, '{"path": '),
        _tool_call_chunk(1, '{"path": '),
        _tool_call_chunk(0, '"a"}'),
        _tool_call_chunk(1, '"b"}'),
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
        },
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 8},
        },
    ]
    answers = [(200, {"content-type": "text/event-stream"}, _sse_body(chunks))]
    with serve_in_thread(_scripted_upstream(answers, [])) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        client = anthropic.AsyncAnthropic(
            base_url=ro["anthropic_base_url"], api_key=ro["token"], max_retries=0
        )
        at_stop = []
        tool = {"name": "read", "input_schema": {"type": "object"}}
        async with client.messages.stream(
            model="claude-x",
            max_tokens=64,
            messages=[{"role": "user", "content": "read a and b"}],
            tools=[tool],  # type: ignore[list-item]
        ) as stream:
            async for event in stream:
                if event.type == "content_block_stop":
                    at_stop.append(event.content_block.model_dump())
            final = await stream.get_final_message()
        await client.close()
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert [(b["id"], b["input"]) for b in at_stop] == [
        ("call_a", {"path": "a"}),
        ("call_b", {"path": "b"}),
    ]
    assert [b.input for b in final.content if b.type == "tool_use"] == [
        {"path": "a"},
        {"path": "b"},
    ]
    assert final.stop_reason == "tool_use"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 8)
    assert call.api == "messages"
    assert call.original_request is not None
    assert call.original_request["messages"] == [{"role": "user", "content": "read a and b"}]


async def test_an_agent_leaving_mid_stream_is_recorded_and_frees_its_slot(serve: Any) -> None:
    release = threading.Event()
    with serve_in_thread(_paced_upstream(release)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        async with served.client(ro) as client:
            stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
            await anext(aiter(stream))
            await stream.close()  # the agent goes away while upstream is still generating

        call, stats = await _left_call(served, ro, release)
    assert call.error is not None
    assert call.error.kind is ErrorKind.HARNESS
    assert call.choices[0].completion_token_ids == [1, 2]  # what was relayed is kept
    assert stats["in_flight"] == 0
    assert stats["upstreams"][0]["in_flight"] == 0


async def _left_call(
    served: Served, ro: dict[str, Any], release: threading.Event
) -> tuple[ModelCall, dict[str, Any]]:
    """Once the call the agent walked away from is recorded: it and the gateway's stats
    (then upstream is released and the admin client closed)."""

    async def recorded() -> bool:
        return len((await served.view(ro["rollout_id"]))["model_calls"]) == 1

    await wait_for(recorded)
    [call] = await served.calls(ro["rollout_id"])
    stats = await served.stats()
    release.set()
    await served.admin.aclose()
    return call, stats


async def test_an_agent_leaving_before_the_first_token_is_heard_while_upstream_waits(
    serve: Any,
) -> None:
    release = threading.Event()
    with serve_in_thread(_paced_upstream(release, hold_first=True)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        async with served.client(ro) as client:
            stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
            await stream.close()  # gone before any event: upstream is still "prefilling"

        # heard at once: upstream has sent nothing yet
        call, stats = await _left_call(served, ro, release)
    assert call.error is not None
    assert call.error.kind is ErrorKind.HARNESS
    assert "disconnected" in call.error.message
    assert stats["in_flight"] == 0
    assert stats["upstreams"][0]["in_flight"] == 0


async def test_an_agent_leaving_a_non_streamed_call_closes_upstream_and_is_recorded(
    serve: Any,
) -> None:
    """Upstream never answers; the agent walks away: its call stops there (upstream's
    request closed, the slot freed for a drain) and is recorded as the agent's doing."""
    asked = asyncio.Event()
    upstream_closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        asked.set()
        await reader.read()  # until the gateway closes the request
        upstream_closed.set()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        served: Served = serve([f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"])
        ro = await served.rollout()
        host, port = served.url.removeprefix("http://").split(":")
        body = orjson.dumps({"model": "m", "messages": ASK})
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /rollouts/%s/v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
            % (ro["rollout_id"].encode(), ro["token"].encode(), len(body), body)
        )
        await asyncio.wait_for(asked.wait(), 10)
        writer.close()  # the agent leaves
        await asyncio.wait_for(upstream_closed.wait(), 10)

        async def recorded() -> bool:
            return len((await served.view(ro["rollout_id"]))["model_calls"]) == 1

        await wait_for(recorded)
        [call] = await served.calls(ro["rollout_id"])
        stats = await served.stats()
        await served.admin.aclose()
    finally:
        server.close()
    assert call.error is not None
    assert call.error.kind is ErrorKind.HARNESS
    assert "disconnected" in call.error.message
    assert stats["in_flight"] == 0
    assert stats["upstreams"][0]["in_flight"] == 0
    assert stats["call_errors"] == 1


@pytest.mark.parametrize("lean", [True, False], ids=["envport-server", "uvicorn"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_agent_leaving_while_the_gateway_is_paused_is_never_forwarded(
    upstream: tuple[str, Any], lean: bool, stream: bool
) -> None:
    """A call waiting at the pause gate whose agent walks away leaves the queue then: after
    the resume it is not sent upstream, and no call the agent never saw enters its trace
    (a trainer would train on it); the rollout records the agent's leaving."""
    gateway = Gateway([upstream[0]], retry=FAST_RETRY)
    with serve_in_thread(create_gateway_app(gateway), lean=lean) as url:
        served = Served(gateway, url)
        ro = await served.rollout()
        await served.admin.post("/admin/pause", json={"drain": False})
        host, port = url.removeprefix("http://").split(":")
        body = orjson.dumps({"model": "m", "messages": ASK, "stream": stream})
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /rollouts/%s/v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
            % (ro["rollout_id"].encode(), ro["token"].encode(), len(body), body)
        )

        async def waiting(n: int) -> Any:
            async def check() -> bool:
                return (await served.stats())["waiting"] == n

            return check

        await wait_for(await waiting(1))
        async with served.client(ro) as client:
            # another call waits beside it, and stays
            stays = asyncio.create_task(
                client.chat.completions.create(model="m", messages=ASK, stream=stream)
            )
            await wait_for(await waiting(2))
            writer.close()  # the agent leaves while the gateway is paused
            await wait_for(await waiting(1))
            await served.admin.post("/admin/resume", json={"policy_version": 2})
            answer = await stays
            if stream:
                assert [chunk async for chunk in answer]
            await client.chat.completions.create(model="m", messages=ASK)
        view = await served.view(ro["rollout_id"])
        stats = await served.stats()
        await served.admin.aclose()
    assert [c["policy_version"] for c in view["model_calls"]] == [2, 2]
    assert [e["kind"] for e in view["errors"]] == ["harness"]
    assert "paused" in view["errors"][0]["message"]
    assert stats["in_flight"] == 0
    assert stats["upstreams"][0]["requests"] == 2, stats


# --- the hot path: raw ASGI dispatch, lazy records, background writes ---------------------------


async def test_records_are_built_when_read_with_the_latency_of_the_call(gw: Served) -> None:
    ro = await gw.rollout()
    rollout = gw.gw.rollouts[ro["rollout_id"]]
    async with gw.client(ro) as client:
        t0 = time.perf_counter()
        await client.chat.completions.create(model="m", messages=ASK)
        elapsed = time.perf_counter() - t0

    async def noted() -> bool:  # right after the answer is written (in the server's thread)
        return len(rollout._pending) == 1

    await wait_for(noted)  # noted on the response path, not built
    await asyncio.sleep(0.2)
    [call] = await gw.calls(ro["rollout_id"])
    assert not rollout._pending
    assert call.latency_s is not None
    assert call.latency_s <= elapsed  # measured when the call ended, not when read
    assert call.choices[0].completion_token_ids
    assert call.metadata["token_ids"] == "present"


async def test_model_paths_keep_their_http_semantics(gw: Served) -> None:
    ro = await gw.rollout()
    auth = {"authorization": f"Bearer {ro['token']}"}
    async with httpx.AsyncClient(base_url=gw.url, headers=auth) as http:
        r = await http.get(f"/rollouts/{ro['rollout_id']}/v1/chat/completions")
        assert r.status_code == 405
        r = await http.post("/rollouts//v1/chat/completions", json={"messages": ASK})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        r = await http.post(f"/rollouts/{ro['rollout_id']}/v1/embeddings", json={})
        assert r.status_code == 404
        # Claude Code asks for a count first: the anthropic SDK must read the refusal
        r = await http.post(f"/rollouts/{ro['rollout_id']}/v1/messages/count_tokens", json={})
        assert r.status_code == 404
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "not_found_error"
        r = await http.post(
            f"/rollouts/{ro['rollout_id']}/v1/chat/completions",
            content=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-envport-call-id"]
        assert int(r.headers["content-length"]) == len(r.content)
    [call] = await gw.calls(ro["rollout_id"])
    assert call.id == r.headers["x-envport-call-id"]


class _BrokenPolicy(GatewayPolicy):
    def apply(self, body: dict[str, Any], api: str) -> dict[str, Any]:
        raise RuntimeError("policy bug")


async def test_a_gateway_bug_is_a_500_in_the_api_shape_and_nothing_is_held(
    serve: Any, upstream: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    served: Served = serve([upstream[0]], policy=_BrokenPolicy())
    ro = await served.rollout()
    headers = {"x-api-key": ro["token"]}
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{ro['base_url']}/chat/completions", json=body, headers=headers)
        assert r.status_code == 500
        assert "policy bug" in r.json()["error"]["message"]
        r = await http.post(f"{ro['anthropic_base_url']}/v1/messages", json=body, headers=headers)
        assert r.status_code == 500
        assert r.json()["type"] == "error"
    stats = await served.stats()
    await served.admin.aclose()
    assert stats["in_flight"] == 0
    assert stats["upstreams"][0]["in_flight"] == 0
    assert "policy bug" in caplog.text  # logged with its traceback


async def test_concurrent_finishes_are_all_stored_and_outlive_the_gateway(
    upstream: tuple[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "traces.db"
    store = SQLiteTraceStore(path)
    gateway = Gateway([upstream[0]], store=store, retry=FAST_RETRY)
    with serve_in_thread(create_gateway_app(gateway)) as url:
        served = Served(gateway, url)
        rollouts = [await served.rollout(task_id=f"t{i}") for i in range(12)]
        for ro in rollouts:
            async with served.client(ro) as client:
                await client.chat.completions.create(model="m", messages=ASK)
        finishes = await asyncio.gather(
            *(
                served.admin.post(f"/admin/rollouts/{ro['rollout_id']}/finish", json={})
                for ro in rollouts
            )
        )
        assert all(r.status_code == 200 and r.json()["stored"] for r in finishes)
        await served.admin.aclose()
    # The server is gone (its lifespan closed the writer); the file has every trace.
    assert gateway.writer is not None
    assert gateway.writer.written == 12
    store.close()
    with SQLiteTraceStore(path) as again:
        traces = again.query()
    assert sorted(t.task_id or "" for t in traces) == sorted(f"t{i}" for i in range(12))
    assert all(len(t.model_calls) == 1 for t in traces)


async def test_an_injected_client_is_used_and_left_open(upstream: tuple[str, Any]) -> None:
    # In-process (httpx's ASGITransport), with the caller's own HTTP client.
    pool = Http1Pool(Timeouts(connect=5, read=30))
    gateway = Gateway([upstream[0]], client=pool, retry=FAST_RETRY)
    grant = gateway.create_rollout()
    transport = httpx.ASGITransport(app=create_gateway_app(gateway))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        r = await http.post(
            f"/rollouts/{grant.rollout_id}/v1/chat/completions",
            json={"model": "m", "messages": ASK},
            headers={"authorization": f"Bearer {grant.token}"},
        )
    await gateway.aclose()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert gateway.pool.client is pool
    assert not pool.closed  # the caller's, so the gateway did not close it
    assert pool.idle_connections() == 1  # kept alive for the next call
    await pool.aclose()
    assert pool.idle_connections() == 0
    [call] = gateway.rollouts[grant.rollout_id].calls
    assert call.choices[0].completion_token_ids


async def test_streams_and_calls_reuse_one_upstream_connection(gw: Served) -> None:
    ro = await gw.rollout()
    async with gw.client(ro) as client:
        for stream in (True, False, True, True):
            if stream:
                out: list[Any] = []
                await collect(
                    await client.chat.completions.create(model="m", messages=ASK, stream=True),
                    out,
                )
                assert out
            else:
                await client.chat.completions.create(model="m", messages=ASK)

            async def parked() -> bool:
                return gw.gw.pool.client.idle_connections() == 1

            await wait_for(parked)  # back in the pool once the stream's end was read
    assert len(await gw.calls(ro["rollout_id"])) == 4
    stats = await gw.stats()
    assert stats["upstreams"][0]["in_flight"] == 0


def test_upstream_timeouts_from_httpx_or_seconds() -> None:
    assert client_timeout(httpx.Timeout(0.3, connect=2.0)) == Timeouts(connect=2.0, read=0.3)
    assert client_timeout(5) == Timeouts(connect=5.0, read=5.0)
    given = Timeouts(connect=1, read=None)
    assert client_timeout(given) is given
    assert client_timeout(None) == Timeouts(connect=10.0, read=600.0)


@pytest.mark.parametrize(
    "chunk",
    [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "hmm"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]},
        {"choices": [{"index": 0, "delta": {}, "token_ids": [5]}]},
        {"choices": [{"index": 0, "delta": {}, "token_ids": []}]},
        {"choices": [{"index": 0, "text": "x"}]},
        {"choices": [{"index": 0, "text": ""}]},
        {"choices": [], "usage": {"prompt_tokens": 1}},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": 1},  # malformed: no output, and neither raises
        {"choices": "text"},
        {"choices": [1, {"index": 0, "delta": {"content": "a"}}]},
    ],
)
def test_has_output_agrees_with_the_assembler(chunk: dict[str, Any]) -> None:
    choices = chunk["choices"] if isinstance(chunk["choices"], list) else []
    texts = any(isinstance(c, dict) and "text" in c for c in choices)
    api = "completions" if texts else "chat.completions"
    assert has_output(chunk) == StreamAssembler(api).feed(chunk)


def test_a_long_stream_of_one_token_chunks_folds_every_token_in_order() -> None:
    # vLLM streams one token per chunk: thousands of chunks fold into one choice whose
    # token ids and logprobs are all there, in order (and the chunks are left as they were).
    chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f"t{i}"},
                    "token_ids": [i],
                    "logprobs": {"content": [{"token": f"t{i}", "logprob": -i / 10}]},
                }
            ]
        }
        for i in range(3000)
    ]
    before = copy.deepcopy(chunks)
    assembler = StreamAssembler("chat.completions")
    for chunk in chunks:
        assert assembler.feed(chunk)
    (choice,) = assembler.response()["choices"]
    assert choice["token_ids"] == list(range(3000))
    assert [lp["logprob"] for lp in choice["logprobs"]["content"]] == [-i / 10 for i in range(3000)]
    assert choice["message"]["content"] == "".join(f"t{i}" for i in range(3000))
    assert chunks == before


# --- restarts ---------------------------------------------------------------------------------


async def test_a_restarted_gateway_takes_back_its_live_rollouts(
    upstream: tuple[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "traces.db"
    first = Gateway([upstream[0]], store=SQLiteTraceStore(path), retry=FAST_RETRY)
    with serve_in_thread(create_gateway_app(first)) as url:
        served = Served(first, url)
        ro = await served.rollout(task_id="t-restart", metadata={"k": "v"})
        short = await served.rollout(ttl_s=0.05)  # its token expires while the gateway is down
        done = await served.rollout()
        async with served.client(ro) as client:
            await client.chat.completions.create(model="m", messages=ASK)
        r = await served.admin.post(f"/admin/rollouts/{done['rollout_id']}/finish", json={})
        assert r.status_code == 200
        await served.admin.aclose()
    assert first.store is not None
    first.store.store.close()
    await asyncio.sleep(0.1)

    second = Gateway([upstream[0]], store=SQLiteTraceStore(path), retry=FAST_RETRY)
    assert second.restored == 1
    assert set(second.rollouts) == {ro["rollout_id"]}  # not the expired one, not the finished one
    assert short["rollout_id"] not in second.rollouts
    with serve_in_thread(create_gateway_app(second)) as url:
        # The orchestrator token is per process; the agent keeps the token it was given.
        served = Served(second, url)
        ro_again = {
            **ro,
            "base_url": ro["base_url"].replace(ro["base_url"].split("/rollouts")[0], url),
        }
        async with served.client(ro_again) as client:
            resp = await client.chat.completions.create(model="m", messages=ASK)
        assert resp.choices[0].message.content
        view = await served.view(ro["rollout_id"])
        assert len(view["model_calls"]) == 1  # the call before the restart was in memory
        assert view["info"]["task_id"] == "t-restart"
        assert view["info"]["metadata"] == {"k": "v"}
        [note] = view["errors"]
        assert note["kind"] == "infrastructure"
        assert "restarted" in note["message"]
        r = await served.admin.post(f"/admin/rollouts/{ro['rollout_id']}/finish", json={})
        assert r.status_code == 200
        await served.admin.aclose()
    assert second.store is not None
    second.store.store.close()

    third = Gateway([upstream[0]], store=SQLiteTraceStore(path))
    assert third.restored == 0  # finished rollouts are not taken back
    await third.aclose()
    assert third.store is not None
    third.store.store.close()
    with SQLiteTraceStore(path) as store:
        [trace] = store.query(task_id="t-restart")
    assert len(trace.model_calls) == 1
    assert any("restarted" in e.message for e in trace.errors)


async def test_a_rollout_opened_on_the_loop_is_registered_or_not_kept(
    upstream: tuple[str, Any], tmp_path: Path
) -> None:
    # POST /admin/rollouts writes the restart registration in a worker thread; it is in
    # the file once the grant is returned, and a failed write leaves nothing behind.
    path = tmp_path / "traces.db"
    first = Gateway([upstream[0]], store=SQLiteTraceStore(path))
    grant = await first.open_rollout(RolloutInfo(task_id="t-open"))
    again = Gateway([upstream[0]], store=SQLiteTraceStore(path))
    assert set(again.rollouts) == {grant.rollout_id}
    assert again.rollouts[grant.rollout_id].info.task_id == "t-open"
    for gw in (first, again):
        await gw.aclose()
        assert gw.store is not None
        gw.store.store.close()

    broken = Gateway([upstream[0]], store=SQLiteTraceStore(tmp_path / "broken.db"))
    assert broken.registry is not None
    broken.registry._conn.close()  # every registration write now fails
    with pytest.raises(TraceStoreError, match="gateway rollouts"):
        await broken.open_rollout(RolloutInfo(rollout_id="r-open"))
    with pytest.raises(TraceStoreError, match="gateway rollouts"):
        broken.create_rollout(RolloutInfo(rollout_id="r-create"))
    assert broken.rollouts == {}
    assert broken.tokens.digest_of("r-open") is None  # its token was revoked
    assert broken.tokens.digest_of("r-create") is None
    await broken.aclose()
    assert broken.store is not None
    broken.store.store.close()


def _one_piece_upstream(tail: bytes) -> Starlette:
    """An upstream that sends a whole stream (two content events, then ``tail``) in one
    write, so the gateway gets several events from one read."""

    def event(delta: dict[str, Any], ids: list[int]) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": None, "token_ids": ids}
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "one"}
        return b"data: " + orjson.dumps({**chunk, "choices": [choice]}) + b"\n\n"

    async def chat(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield (
                b": keep-alive\n\n"
                + event({"content": "Hel"}, [1, 2])
                + event({"content": "lo"}, [3])
                + tail
            )

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def test_events_that_arrive_together_are_all_relayed_and_recorded(serve: Any) -> None:
    with serve_in_thread(_one_piece_upstream(b"data: [DONE]\n\n")) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        async with served.client(ro) as client:
            stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
            seen = [c.choices[0].delta.content async for c in stream]
        assert seen == ["Hel", "lo"]
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert call.error is None
    assert call.ttft_s is not None
    assert call.choices[0].completion_token_ids == [1, 2, 3]
    assert call.response is not None
    assert call.response["choices"][0]["message"]["content"] == "Hello"


@pytest.mark.parametrize(
    ("tail", "message"),
    [(b"data: {not json\n\ndata: [DONE]\n\n", "not JSON"), (b"", "before [DONE]")],
    ids=["bad-event", "no-done"],
)
async def test_a_stream_that_goes_wrong_after_good_events_ends_with_an_error_after_them(
    serve: Any, tail: bytes, message: str
) -> None:
    # A bad event after good ones in the same read, or the body ending without [DONE].
    with serve_in_thread(_one_piece_upstream(tail)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        seen: list[Any] = []
        async with served.client(ro) as client:
            stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
            with pytest.raises(openai.APIError) as info:
                await collect(stream, seen)
        assert [c.choices[0].delta.content for c in seen] == ["Hel", "lo"]
        assert message in info.value.message
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert message in call.error.message
    assert call.choices[0].completion_token_ids == [1, 2, 3]  # what came before is kept


def _flood_upstream(
    events: int, sent: list[int], *, gzip: bool = False, pad_chars: int = 1400
) -> Starlette:
    """An upstream that streams ``events`` content events (``pad_chars`` + ~100 bytes
    each) as fast as its socket takes them, counting in ``sent`` how many it has written;
    with ``gzip`` the stream is compressed (``content-encoding: gzip``, flushed per
    event)."""
    pad = "x" * pad_chars

    async def chat(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            packer = zlib.compressobj(wbits=31) if gzip else None
            for i in range(events):
                choice = {"index": 0, "delta": {"content": f"{i} {pad}"}, "token_ids": [i]}
                chunk = {"id": "f", "object": "chat.completion.chunk", "model": "f"}
                data = b"data: " + orjson.dumps({**chunk, "choices": [choice]}) + b"\n\n"
                if i == events - 1:
                    data += b"data: [DONE]\n\n"
                if packer is not None:
                    data = packer.compress(data) + packer.flush(zlib.Z_SYNC_FLUSH)
                    if i == events - 1:
                        data += packer.flush()
                yield data
                sent[0] = i + 1

        headers = {"content-encoding": "gzip"} if gzip else None
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def _raw_stream_request(
    served: Served, ro: dict[str, Any], *, rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streamed chat call sent on a plain socket (the answer is left to read)."""
    host, port, request = _stream_request(served, ro)
    sock = socket.socket()
    if rcvbuf is not None:  # a small window: the gateway's writes to it soon wait
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
    writer.write(request)
    return reader, writer


def _contents(answer: bytes) -> list[str]:
    events = [e for e in answer.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    return [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]]


async def test_an_agent_that_stops_reading_holds_upstream_back_and_loses_nothing(
    serve: Any,
) -> None:
    # Upstream's events are written to the agent from upstream's read callback; when the
    # agent stops reading, the gateway stops reading upstream (it does not buffer the
    # stream), and once the agent reads again every event arrives, in order.
    # ~90 MB in all: more than the kernel can hold between upstream and the agent (the
    # gateway's receive buffer alone autotunes up to net.ipv4.tcp_rmem's maximum, 32 MB
    # on this machine: with ~30 MB the whole stream could sit there, held back or not).
    events, sent, pad = 20_000, [0], 4500
    with serve_in_thread(_flood_upstream(events, sent, pad_chars=pad)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        reader, writer = await _raw_stream_request(served, ro, rcvbuf=4096)
        try:
            last = -1
            while sent[0] != last:  # wait until upstream cannot write any more
                last = sent[0]
                await asyncio.sleep(0.5)
            assert 0 < sent[0] < events  # held back
            answer = await asyncio.wait_for(_read_chunked(reader), 60)
        finally:
            writer.close()
        assert sent[0] == events
        assert _contents(answer) == [f"{i} {'x' * pad}" for i in range(events)]
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert call.error is None
    assert call.choices[0].completion_token_ids == list(range(events))


async def test_a_compressed_stream_is_relayed_and_recorded(serve: Any) -> None:
    # A gzip-encoded stream cannot be tapped; it is read (and decoded) piece by piece.
    events = 50
    with serve_in_thread(_flood_upstream(events, [0], gzip=True)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        reader, writer = await _raw_stream_request(served, ro)
        try:
            answer = await asyncio.wait_for(_read_chunked(reader), 30)
        finally:
            writer.close()
        assert _contents(answer) == [f"{i} {'x' * 1400}" for i in range(events)]
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert call.error is None
    assert call.choices[0].completion_token_ids == list(range(events))


async def test_a_translated_stream_failing_midway_ends_with_an_error_event(
    gw: Served, upstream: tuple[str, Any]
) -> None:
    ro = await gw.rollout()
    upstream[1].state.faults.push("cut-stream")
    body = {"model": "m", "max_tokens": 64, "stream": True, "messages": ASK}
    headers = {"x-api-key": ro["token"], "anthropic-version": "2023-06-01"}
    async with (
        httpx.AsyncClient() as http,
        http.stream(
            "POST", f"{ro['anthropic_base_url']}/v1/messages", json=body, headers=headers
        ) as s,
    ):
        text = (await s.aread()).decode()
    assert "event: message_start" in text  # what came before the cut was relayed
    assert "event: error" in text
    assert "event: message_stop" not in text
    [call] = await gw.calls(ro["rollout_id"])
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER


# --- a stream relayed from the read callback its answer's head arrived in ------------------


def _sse_chunk(content: str, ids: list[int]) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": None, "token_ids": ids}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    event = b"data: " + orjson.dumps({**chunk, "choices": [choice]}) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
DONE_AND_END = b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n")


@contextlib.asynccontextmanager
async def _raw_upstream(parts: list[bytes], gates: list[asyncio.Event]) -> AsyncIterator[str]:
    """An upstream answering each request with ``parts``, one write each, the first at
    once and each next one when the gate before it opens; yields its base URL."""
    handlers: set[asyncio.Task[None]] = set()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(parts[0])
                for gate, part in zip(gates, parts[1:], strict=True):
                    await gate.wait()
                    writer.write(part)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def test_crlf_events_split_between_cr_and_lf_are_relayed_whole(serve: Any) -> None:
    def event(content: str) -> bytes:
        choice = {"index": 0, "delta": {"content": content}, "finish_reason": None}
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        return b"data: " + orjson.dumps({**chunk, "choices": [choice]})

    def chunked(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    parts = [  # CRLF line ends; a read ends between the CR and the LF of a blank line
        SSE_HEAD + chunked(event("a") + b"\r\n\r"),
        chunked(b"\n" + event("b") + b"\r\n\r"),
        chunked(b"\ndata: [DONE]\r\n\r\n") + b"0\r\n\r\n",
    ]
    gates = [asyncio.Event(), asyncio.Event()]
    async with _raw_upstream(parts, gates) as url:
        served: Served = serve([url])
        ro = await served.rollout()

        async def pace() -> None:
            for gate in gates:
                await asyncio.sleep(0.05)  # each part its own read
                gate.set()

        async with served.client(ro) as client:
            pacing = asyncio.create_task(pace())
            stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
            seen = [c.choices[0].delta.content async for c in stream]
            await pacing
        [call] = await served.calls(ro["rollout_id"])
        await served.admin.aclose()
    assert seen == ["a", "b"]
    assert call.error is None
    assert call.response is not None
    assert call.response["choices"][0]["message"]["content"] == "ab"


async def _agent_call(gateway: Gateway, send: Any) -> tuple[Any, Any, dict[str, Any], Any]:
    """``handle_call`` as the front does it: (outcome, call, scope, receive)."""
    from envport.gateway.app import CHAT

    grant = gateway.create_rollout()
    body = orjson.dumps({"model": "m", "messages": ASK, "stream": True})
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", f"Bearer {grant.token}".encode())],
    }
    asked = False
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never  # the agent stays
        return {"type": "http.disconnect"}

    outcome, call = await gateway.handle_call(CHAT, grant.rollout_id, scope, receive, send)
    return outcome, call, scope, receive


async def test_the_head_and_first_events_go_out_before_the_call_s_task_wakes() -> None:
    release = asyncio.Event()
    first, rest = SSE_HEAD + _sse_chunk("Hel", [1, 2]), _sse_chunk("lo", [3]) + DONE_AND_END
    async with _raw_upstream([first, rest], [release]) as url:
        gateway = Gateway([url], retry=FAST_RETRY)
        await _first_events_before_the_task_wakes(gateway, release)


async def _first_events_before_the_task_wakes(gateway: Gateway, release: asyncio.Event) -> None:
    sent: list[tuple[dict[str, Any], bool]] = []  # (message, sent from inside a task)
    at_answer: list[list[str]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append((message, asyncio.current_task() is not None))

    real = gateway.pool.send

    async def upstream_send(*args: Any, **kwargs: Any) -> Any:
        opened = await real(*args, **kwargs)
        at_answer.append([m["type"] for m, _ in sent])  # as the call's task wakes up
        return opened

    gateway.pool.send = upstream_send  # type: ignore[method-assign]
    try:
        outcome, call, scope, receive = await _agent_call(gateway, send)
        assert at_answer == [["http.response.start", "http.response.body"]]
        assert [in_task for _, in_task in sent] == [False, False]  # from the read callback
        assert b'"Hel"' in sent[1][0]["body"]
        release.set()
        await outcome(scope, receive, send)
        call.done()
        bodies = b"".join(m.get("body", b"") for m, _ in sent[1:])
        assert bodies.count(b"data: ") == 3
        assert bodies.endswith(b"data: [DONE]\n\n")
        assert sent[-1][0].get("more_body", False) is False
        [record] = gateway.rollout(call.rollout.rollout_id).calls
        assert record.error is None
        assert record.ttft_s is not None
        assert record.choices[0].completion_token_ids == [1, 2, 3]
    finally:
        await gateway.aclose()


async def test_a_send_that_waits_as_the_stream_begins_holds_the_events_back_in_order() -> None:
    # An ASGI server whose send of the answer's head waits (a full socket): the events
    # read meanwhile wait behind it, upstream is not read on, and nothing is lost.
    release = asyncio.Event()
    first, rest = SSE_HEAD + _sse_chunk("a", [1]), _sse_chunk("b", [2]) + DONE_AND_END
    async with _raw_upstream([first, rest], [release]) as url:
        gateway = Gateway([url], retry=FAST_RETRY)
        await _held_back_in_order(gateway, release)


async def _held_back_in_order(gateway: Gateway, release: asyncio.Event) -> None:
    opened_up = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            await opened_up.wait()

    try:
        outcome, call, scope, receive = await _agent_call(gateway, send)
        assert [m["type"] for m in sent] == ["http.response.start"]  # the event waits
        release.set()  # upstream sends the rest: not read while the head's send waits
        relay = asyncio.create_task(outcome(scope, receive, send))
        await asyncio.sleep(0.1)
        assert len(sent) == 1
        opened_up.set()
        await asyncio.wait_for(relay, 10)
        call.done()
        bodies = [m["body"] for m in sent[1:] if m.get("body")]
        assert b'"a"' in bodies[0]
        assert b"".join(bodies).count(b"data: ") == 3
        assert b"".join(bodies).index(b'"a"') < b"".join(bodies).index(b'"b"')
        [record] = gateway.rollout(call.rollout.rollout_id).calls
        assert record.error is None
        assert record.choices[0].completion_token_ids == [1, 2]
    finally:
        await gateway.aclose()


async def test_events_arriving_while_the_head_s_send_waits_in_the_task_wait_behind_it() -> None:
    # The head alone first: the relay's task finishes its waiting send, and an event that
    # arrives meanwhile must wait behind it (never two sends at once, never out of order).
    gates = [asyncio.Event(), asyncio.Event()]
    parts = [SSE_HEAD, _sse_chunk("a", [1]), _sse_chunk("b", [2]) + DONE_AND_END]
    async with _raw_upstream(parts, gates) as url:
        gateway = Gateway([url], retry=FAST_RETRY)
        try:
            can_send = asyncio.Event()
            log: list[str] = []

            async def send(message: dict[str, Any]) -> None:
                log.append(f"begin {message['type']}")
                if message["type"] == "http.response.start":
                    await can_send.wait()
                log.append(f"end {message['type']}")

            outcome, call, scope, receive = await _agent_call(gateway, send)
            relay = asyncio.create_task(outcome(scope, receive, send))
            await asyncio.sleep(0.05)  # the task is finishing the head's send now
            gates[0].set()  # an event arrives meanwhile
            await asyncio.sleep(0.1)
            assert log == ["begin http.response.start"]
            can_send.set()
            gates[1].set()
            await asyncio.wait_for(relay, 10)
            call.done()
            assert log[:2] == ["begin http.response.start", "end http.response.start"]
            assert all(
                log[i].startswith("begin") and log[i + 1].startswith("end")
                for i in range(0, len(log), 2)
            )  # one send at a time
            [record] = gateway.rollout(call.rollout.rollout_id).calls
            assert record.choices[0].completion_token_ids == [1, 2]
        finally:
            await gateway.aclose()


async def test_a_stream_whose_chunks_are_not_the_api_s_shape_is_kept_and_its_rollout_finishes(
    serve: Any,
) -> None:
    # JSON objects, so relayed as they came; not chat chunks, so the record cannot fold
    # them: it keeps them as they came and says why, and the rollout still finishes.
    odd = b'data: {"id":"c1","choices":[{"index":0,"delta":"oops"}]}\n\ndata: [DONE]\n\n'
    with serve_in_thread(_one_piece_upstream(odd)) as up:
        served: Served = serve([f"{up}/v1"])
        ro = await served.rollout()
        async with served.client(ro) as client:
            stream = await client.chat.completions.create(model="m", messages=ASK, stream=True)
            with contextlib.suppress(Exception):  # the SDK may choke on the odd chunk
                async for _ in stream:
                    pass
        [call] = await served.calls(ro["rollout_id"])
        assert "parse_error" in call.metadata
        assert call.metadata["token_ids"] == "unparsed"
        assert [c["choices"][0]["delta"] for c in call.metadata["stream_chunks"]] == [
            {"content": "Hel"},
            {"content": "lo"},
            "oops",
        ]
        r = await served.admin.post(f"/admin/rollouts/{ro['rollout_id']}/finish", json={})
        assert r.status_code == 200, r.text
        await served.admin.aclose()


async def test_a_relay_failing_after_done_still_releases_its_upstream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = asyncio.Event()
    first, rest = SSE_HEAD + _sse_chunk("a", [1]), DONE_AND_END
    async with _raw_upstream([first, rest], [release]) as url:
        gateway = Gateway([url], retry=FAST_RETRY)
        try:

            def broken_add(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("a bug while noting the call")

            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            outcome, _, scope, receive = await _agent_call(gateway, send)
            monkeypatch.setattr(Rollout, "add", broken_add)
            release.set()
            with pytest.raises(RuntimeError, match="a bug while noting"):
                await outcome(scope, receive, send)
            [upstream] = gateway.pool.upstreams
            assert upstream.in_flight == 0  # its answer was closed, not left open
            assert gateway.pool.client.idle_connections() == 0
        finally:
            await gateway.aclose()


async def test_a_stream_stalling_after_its_first_events_ends_with_a_timeout_error_event() -> None:
    """The first events come with the head (relayed from the read callback), then upstream
    goes quiet: the read timeout still runs, and the agent gets an error event."""
    never = asyncio.Event()
    first = SSE_HEAD + _sse_chunk("Hel", [1, 2])
    async with _raw_upstream([first, DONE_AND_END], [never]) as url:
        timeout = httpx.Timeout(0.3, connect=2.0)
        gateway = Gateway([url], retry=FAST_RETRY, timeout=timeout)
        try:
            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            outcome, call, scope, receive = await _agent_call(gateway, send)
            assert b'"Hel"' in sent[1]["body"]  # relayed before the stall
            await asyncio.wait_for(outcome(scope, receive, send), 10)
            call.done()
            bodies = b"".join(m.get("body", b"") for m in sent[1:])
            assert b"stalled mid-stream" in bodies.split(b"data: ")[-1]
            assert sent[-1].get("more_body", False) is False
            [upstream] = gateway.pool.upstreams
            assert upstream.in_flight == 0
            [recorded] = gateway.rollouts[call.rollout.rollout_id].calls
            assert recorded.error is not None
            assert "stalled mid-stream" in recorded.error.message
        finally:
            await gateway.aclose()


def test_the_synchronous_send_is_used_only_when_send_is_the_server_s_own() -> None:
    from envport.gateway.app import _nowait
    from envport.gateway.front import SEND_NOWAIT

    class Exchange:
        async def send(self, message: dict[str, Any]) -> None:
            pass

        def send_nowait(self, message: dict[str, Any]) -> bool:
            return False

    exchange, other = Exchange(), Exchange()
    scope: dict[str, Any] = {"extensions": {SEND_NOWAIT: exchange.send_nowait}}
    assert _nowait(scope, exchange.send) == exchange.send_nowait

    async def wrapped(message: dict[str, Any]) -> None:  # a middleware's send
        await exchange.send(message)

    assert _nowait(scope, wrapped) is None
    assert _nowait(scope, other.send) is None
    assert _nowait(scope, None) is None
    assert _nowait({}, exchange.send) is None
    assert _nowait({"extensions": None}, exchange.send) is None
