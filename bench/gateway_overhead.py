"""Gateway overhead: envport's model gateway vs agent-lightning's LLM proxy vs direct.

Run from the repository root::

    .venv/bin/python bench/gateway_overhead.py             # full run (N=2000, c=1,8,32)
    .venv/bin/python bench/gateway_overhead.py --upstream-delay-ms 0,20  # both questions
    .venv/bin/python bench/gateway_overhead.py --quick     # smoke run (small N)
    .venv/bin/python bench/gateway_overhead.py --targets direct,floor-raw,envport --n 500
    .venv/bin/python bench/gateway_overhead.py --json out.json --markdown table.md
    .venv/bin/python bench/gateway_overhead.py --modes stream --upstream-delay-ms 20 \
        --targets direct,floor-raw,envport-base,envport --base-src OLD  # streams, A/B
    .venv/bin/python bench/gateway_overhead.py --modes stream --upstream-delay-ms 20 \
        --targets direct,floor-raw,envport --arrivals staggered  # spread-out arrivals

One invocation starts, each in its own process, bound to 127.0.0.1 on free ports:

* ``upstream``: a fake vLLM-shaped OpenAI server (this file, ``_upstream`` mode): a raw
  asyncio HTTP/1.1 server with keep-alive answering ``POST /v1/chat/completions`` with a
  fixed chat completion carrying ``prompt_token_ids``, ``choices[].token_ids`` and
  ``logprobs`` (pre-encoded bytes), or, for ``"stream": true``, an SSE stream of
  ``--stream-chunks`` chunks (chunked transfer encoding), the first content chunk sent at
  once and the rest ``--chunk-gap-ms`` apart, so a gateway that buffers shows in the
  time to first token.
* ``floor-raw`` / ``floor``: a bare pass-through proxy (``_floor`` mode): raw ASGI on
  uvicorn (uvloop + httptools when installed), no auth, parsing or recording, with a
  minimal asyncio-streams client (``floor-raw``: the least a Python proxy costs here) or
  one pooled ``aiohttp.ClientSession`` (``floor``). Measured in the same run, they show
  what any Python gateway must pay on this machine, and what envport adds on top.
* ``floor-nginx``: nginx (Debian's ``nginx-light``; not installed by this file) as the
  same pass-through, one worker, keep-alive upstream connections, ``proxy_buffering
  off``: what a proxy written in C costs for the extra hop on this machine.
* ``envport``: ``.venv/bin/python -m envport.gateway --upstream URL/v1 --port P
  --store DB`` (orchestrator token from ``ENVPORT_GATEWAY_TOKEN``). Calls go to
  ``{base_url}/chat/completions`` with the rollout's token, one rollout per client
  worker per round (finished, and so stored, between rounds, outside the timing).
* ``envport-base``: the same, with another copy of the ``envport`` package first on
  ``PYTHONPATH`` (``--base-src DIR``, DIR holding ``envport/``): the code before a change,
  measured interleaved with the code after it in one run; or run by another Python
  (``--base-python PATH``, with envport's dependencies installed there).
* ``agl``: agent-lightning's ``LLMProxy`` (LiteLLM's proxy underneath), from PyPI
  ``agentlightning`` installed on first use into ``bench/.venvs/agl`` (see
  ``--agl-python``). Started by ``_agl`` mode of this file run with that venv's Python;
  calls go to its rollout/attempt-scoped URL ``/rollout/{rid}/attempt/{aid}/v1/...``.

Fairness: one load generator for all targets, a minimal asyncio HTTP/1.1 client (one
keep-alive connection per worker, orjson), so the client adds the same small, constant
cost to every target and the differences are the gateways'. Targets are interleaved:
each concurrency level runs in rounds of ``--round`` requests, and every round visits
every target (rotating which goes first), so slow drift and noise land on all of them.
Each target gets a warm-up first. Latency is per request (write to last byte);
throughput is requests / wall time of that target's rounds. ``cpu us/call`` is the
gateway process's CPU time (user+sys, all threads, from /proc) per call, during the
calls; ``+rollouts us/call`` adds what envport spends between rounds on the rollouts'
bookkeeping (finishing the last round's: building and storing their traces; creating
the next), the CPU per call of the whole workload (one rollout per worker per round).

Where a stream's added TTFT is (``+in ms`` / ``+out ms``): the fake upstream writes into
each stream's role chunk when the request reached it and when it wrote the answer
(``perf_counter``, CLOCK_MONOTONIC, one clock for every process here), so each TTFT splits
into the way in (client write → upstream read) and the way back (upstream write → first
content at the client); the columns are their p50s over ``direct``'s.

Arrivals (``--arrivals``): ``lockstep`` (default) starts a level's ``c`` workers together
in every round, and since every call takes as long, they stay together: at c=32 each
call's TTFT measures a burst of 32 requests arriving at once, which any proxy on one core
serves one after another. ``staggered`` starts each worker at its own random phase within
one call's length (upstream delay + a stream's chunk gaps; fixed seed, same phases for
every target, direct included) and it keeps that phase, so requests arrive spread out, as
from independent agents. The phase sleeps count in each round's wall time for every
target alike.

Pinning (``--layout``; ``--no-pin`` to turn off): ``proxy-alone`` (default) gives the
proxy under test CPUs 1.. and puts the client and the fake upstream (a gateway's outside
world; a model server is on another machine in production) on CPU 0; ``client-alone``
puts the client alone on CPU 0 and proxy and upstream on the rest; ``agent-side`` puts
the client and the proxy on CPU 0 and the upstream on the rest: a gateway deployed next to
the agents it serves, the model server elsewhere (the direct path then also crosses to
the upstream's CPU, as a real call crosses the network).

``--awake-cpus`` keeps the proxy's CPUs from idling: one spinner per CPU at SCHED_IDLE
priority (it runs only when nothing else wants the CPU, and yields at once when the proxy
wakes). On a VM an idle vCPU halts, and waking it for a request or an upstream answer
costs a hypervisor round trip the direct path does not pay (its client and upstream share
CPU 0). The spinners show how much of "+TTFT" that is; they change the machine, not the
proxy, and burn the proxy CPUs' idle time, so the default runs without them.

``--upstream-delay-ms`` takes one or more delays (comma-separated): one full run each,
with fresh servers. With 0 every process is CPU-bound, so "+p50" is the proxy's own cost
and throughput "% of direct" at high concurrency compares CPU per call; with a model-like
delay (20 ms) "% of direct" says whether the gateway keeps up with the model, which is
where the throughput target is meaningful.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AGL_VENV = ROOT / "bench" / ".venvs" / "agl"
HOST = "127.0.0.1"
ENVPORT_AGL = ("envport", "envport-base", "agl")  # targets compared with the aiohttp floor
MODEL = "bench-model"
AGL_KEY = "sk-" + "0123456789abcdef" * 4  # LiteLLM master key for the agl proxy

# --- the fake upstream ------------------------------------------------------------------

PROMPT_TOKENS = 48
COMPLETION_TOKENS = 16
WORDS = [f" w{i}" for i in range(COMPLETION_TOKENS)]


def _logprob(i: int) -> dict[str, Any]:
    token = WORDS[i]
    return {
        "token": token,
        "logprob": -0.01 * (i + 1),
        "bytes": list(token.encode()),
        "top_logprobs": [],
    }


def completion_body() -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "prompt_token_ids": list(range(1000, 1000 + PROMPT_TOKENS)),
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(WORDS),
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": {"content": [_logprob(i) for i in range(COMPLETION_TOKENS)]},
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": list(range(2000, 2000 + COMPLETION_TOKENS)),
            }
        ],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        },
    }
    return json.dumps(body, separators=(",", ":")).encode()


_BENCH_ID = b'"id":"chatcmpl-bench"'
_STAMP = re.compile(rb'"id":"up:([0-9.]+):([0-9.]+)"')


def stream_events(chunks: int) -> list[bytes]:
    """SSE events: role, ``chunks`` content chunks (token ids, logprobs), finish+usage, DONE."""
    per = max(1, COMPLETION_TOKENS // chunks)
    events = []

    def chunk(delta: dict[str, Any], **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": None, **extra}
        body = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": MODEL,
            "choices": [choice],
        }
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    first = chunk({"role": "assistant", "content": ""})
    first = first[:-2] + b"\n\n"
    head = json.loads(first[6:])
    head["prompt_token_ids"] = list(range(1000, 1000 + PROMPT_TOKENS))
    events.append(b"data: " + json.dumps(head, separators=(",", ":")).encode() + b"\n\n")
    for c in range(chunks):
        idx = range(c * per, min(COMPLETION_TOKENS, (c + 1) * per))
        events.append(
            chunk(
                {"content": "".join(WORDS[i] for i in idx)},
                logprobs={"content": [_logprob(i) for i in idx]},
                token_ids=[2000 + i for i in idx],
            )
        )
    last = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": None}],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        },
    }
    events.append(b"data: " + json.dumps(last, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _UpstreamProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, just enough for JSON POSTs (Content-Length bodies)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a streamed answer in progress (no pipelining needed)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._drain()

    def _drain(self) -> None:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            lower = head.lower()
            i = lower.find(b"\r\ncontent-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)].strip())
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            line = head.split(b"\r\n", 1)[0]
            self._answer(line, body)
            if self.busy:
                return

    def _answer(self, line: bytes, body: bytes) -> None:
        assert self.transport is not None
        cfg = self.cfg
        method, path = line.split(b" ")[:2]
        if method == b"GET":
            ok = b'{"status":"ok"}'
            self.transport.write(cfg["json_head"] % len(ok) + ok)
            return
        if not path.endswith(b"/chat/completions"):
            msg = b'{"error":{"message":"not found","type":"not_found"}}'
            self.transport.write(
                b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(msg), msg)
            )
            return
        stream = b'"stream":true' in body.replace(b" ", b"")
        delay = cfg["delay_s"]
        if stream:
            self.busy = True
            asyncio.get_running_loop().create_task(self._stream(delay, time.perf_counter()))
        elif delay > 0:
            self.busy = True
            asyncio.get_running_loop().call_later(delay, self._late_answer)
        else:
            self.transport.write(cfg["completion"])

    def _late_answer(self) -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(self.cfg["completion"])
        self.busy = False
        self._drain()

    async def _stream(self, delay: float, arrived: float) -> None:
        assert self.transport is not None
        cfg = self.cfg
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            events: list[bytes] = cfg["events"]
            t = self.transport
            # Head + role chunk + first content chunk at once; then one chunk per gap.
            # The role chunk's id carries when the request arrived and when this answer
            # is written (CLOCK_MONOTONIC, the same in every process here): the client
            # splits each TTFT into its way in and its way back (``_legs``).
            stamp = b'"id":"up:%.7f:%.7f"' % (arrived, time.perf_counter())
            first = events[0].replace(_BENCH_ID, stamp, 1)
            t.write(cfg["sse_head"] + _chunked(first + events[1]))
            for event in events[2:]:
                if cfg["gap_s"] > 0 and event != b"data: [DONE]\n\n":
                    await asyncio.sleep(cfg["gap_s"])
                if t.is_closing():
                    return
                t.write(_chunked(event))
            t.write(b"0\r\n\r\n")
        finally:
            self.busy = False
            if self.transport is not None and not self.transport.is_closing():
                self._drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def run_upstream(port: int, delay_ms: float, chunks: int, gap_ms: float) -> None:
    completion = completion_body()
    json_head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    cfg = {
        "completion": json_head % len(completion) + completion,
        "json_head": json_head,
        "sse_head": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n",
        "events": stream_events(chunks),
        "delay_s": delay_ms / 1000.0,
        "gap_s": gap_ms / 1000.0,
    }

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _UpstreamProtocol(cfg), HOST, port, backlog=1024, reuse_address=True
        )
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        print(f"fake upstream on http://{HOST}:{port}/v1", file=sys.stderr, flush=True)
        async with server:
            await stop.wait()

    asyncio.run(main())


# --- the floor: the least a Python proxy on this stack can cost ----------------------------


def run_floor(port: int, upstream: str, client: str) -> None:
    """A bare pass-through proxy: raw ASGI on uvicorn (uvloop + httptools when installed);
    no auth, no parsing, no recording. Streams are relayed piece by piece.

    ``client`` is its upstream client: ``aiohttp`` (one pooled ``ClientSession``, what
    envport uses) or ``raw`` (asyncio streams, keep-alive, just enough HTTP/1.1 for this
    upstream: the least any Python client can cost). What envport's gateway costs above
    the ``aiohttp`` floor is envport's own work."""
    import aiohttp
    import uvicorn

    session: list[aiohttp.ClientSession] = []
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    host, _, rest = upstream.removeprefix("http://").partition(":")
    up_port = int(rest.split("/", 1)[0])
    json_head = [(b"content-type", b"application/json")]
    sse_head = [(b"content-type", b"text/event-stream; charset=utf-8")]

    async def lifespan(receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                if session:
                    await session[0].close()
                for _, w in idle:
                    w.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def via_aiohttp(path: str, body: bytes, stream: bool, send: Any) -> None:
        if not session:
            session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
        headers = {"content-type": "application/json"}
        async with session[0].post(upstream + path, data=body, headers=headers) as resp:
            if not stream:
                data = await resp.read()
                head = [*json_head, (b"content-length", str(len(data)).encode())]
                await send({"type": "http.response.start", "status": resp.status, "headers": head})
                await send({"type": "http.response.body", "body": data})
                return
            await send({"type": "http.response.start", "status": resp.status, "headers": sse_head})
            async for piece in resp.content.iter_any():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def via_raw(path: str, body: bytes, stream: bool, send: Any) -> None:
        if idle:
            reader, writer = idle.pop()
        else:
            reader, writer = await asyncio.open_connection(host, up_port)
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(
            b"POST /v1%s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), host.encode(), len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        if b"transfer-encoding: chunked" not in lower:
            i = lower.find(b"content-length:")
            n = int(head[i + 15 : lower.find(b"\r\n", i)])
            data = await reader.readexactly(n)
            out = [*json_head, (b"content-length", str(n).encode())]
            await send({"type": "http.response.start", "status": status, "headers": out})
            await send({"type": "http.response.body", "body": data})
        else:
            await send({"type": "http.response.start", "status": status, "headers": sse_head})
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                piece = (await reader.readexactly(size + 2))[:-2]
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        idle.append((reader, writer))

    forward = via_raw if client == "raw" else via_aiohttp

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": json_head})
            await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"].split("/v1", 1)[-1]
        await forward(path, body, b'"stream":true' in body, send)

    uvicorn.run(app, host=HOST, port=port, log_level="warning", access_log=False)


# --- agent-lightning's proxy (runs in bench/.venvs/agl) ----------------------------------


def run_agl(port: int, upstream: str, ids_file: str, n_rollouts: int) -> None:
    """Serve agent-lightning's ``LLMProxy`` on ``port``: model ``MODEL`` -> ``upstream``.

    agentlightning 0.3 has no ``agl-server`` command for the proxy (``agl`` has only
    ``store``, ``vllm``, ``prometheus``, ``agentops``); the trainer builds an
    ``LLMProxy(port=..., model_list=[...], store=store)`` itself, model entries being
    ``hosted_vllm/<name>`` with an ``api_base``. Its default launch mode ("mp") needs a
    zero-copy store (the HTTP ``LightningStoreClient`` of an ``agl store`` server, one
    more hop per call); here the proxy runs in its "thread" mode with a thread-safe
    ``InMemoryLightningStore`` in the same process: the cheapest way to run it, default
    middlewares (rollout_attempt, stream_conversion) and callbacks (return_token_ids,
    opentelemetry) on. Rollouts/attempts are started in the store first and written to
    ``ids_file``; calls go to ``/rollout/{rid}/attempt/{aid}/v1/chat/completions``.
    """
    from agentlightning import LLMProxy  # type: ignore[import-not-found]
    from agentlightning.store import InMemoryLightningStore  # type: ignore[import-not-found]

    async def main() -> None:
        store = InMemoryLightningStore(thread_safe=True)
        ids = []
        for i in range(n_rollouts):
            r = await store.start_rollout(input={"i": i})
            ids.append([r.rollout_id, r.attempt.attempt_id])
        model_list = [
            {
                "model_name": MODEL,
                "litellm_params": {"model": f"hosted_vllm/{MODEL}", "api_base": upstream},
            }
        ]
        proxy = LLMProxy(
            port=port, model_list=model_list, store=store, host=HOST, launch_mode="thread"
        )
        await proxy.start()
        Path(ids_file).write_text(json.dumps(ids))  # noqa: ASYNC240
        print(f"agl proxy on http://{HOST}:{port}", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()
        await proxy.stop()

    asyncio.run(main())


# --- the load generator -------------------------------------------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection; ``post`` returns (status, ttft_s|None, total_s)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.used = False

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        self.reader = self.writer = None
        self.used = False

    async def post(
        self, path: str, body: bytes, token: str, stream: bool
    ) -> tuple[int, float | None, float, bytes]:
        if self.writer is None:
            await self._open()
        assert self.reader is not None
        assert self.writer is not None
        self.legs: tuple[float, float] | None = None
        req = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"authorization: Bearer {token}\r\ncontent-type: application/json\r\n"
            f"accept: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        reused = self.used
        self.used = True
        t0 = time.perf_counter()
        self.writer.write(req)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            if not reused:
                raise
            # The server closed an idle keep-alive connection (uvicorn does after 5 s;
            # other targets' rounds can take that long): reconnect and send again, as
            # HTTP clients do. Timed from the new write.
            await self.close()
            await self._open()
            assert self.reader is not None
            assert self.writer is not None
            self.used = True
            t0 = time.perf_counter()
            self.writer.write(req)
            head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        keep = b"connection: close" not in lower
        ttft: float | None = None
        out = b""
        if b"transfer-encoding: chunked" in lower:
            pending = b""
            while True:
                size_line = await self.reader.readline()
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    await self.reader.readline()
                    break
                data = await self.reader.readexactly(size + 2)
                data = data[:-2]
                if stream and ttft is None:
                    pending += data
                    if _has_content(pending):
                        ttft = time.perf_counter() - t0
                        self.legs = _legs(out + pending, t0, ttft)
                        pending = b""
                out += data
        else:
            i = lower.find(b"content-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i)
                n = int(head[i + 15 : j].strip())
                out = await self.reader.readexactly(n)
                if stream and ttft is None and _has_content(out):
                    ttft = time.perf_counter() - t0
            else:  # read to close
                out = await self.reader.read()
                keep = False
        total = time.perf_counter() - t0
        if not keep:
            await self.close()
        return status, ttft, total, out


def _legs(buf: bytes, t0: float, ttft: float) -> tuple[float, float] | None:
    """(request leg, answer leg) of a TTFT, from the upstream's stamps in the role chunk:
    client write → upstream read, and upstream write → first content at the client."""
    m = _STAMP.search(buf)
    if m is None:
        return None
    arrived, written = float(m.group(1)), float(m.group(2))
    return arrived - t0, t0 + ttft - written


def _has_content(buf: bytes) -> bool:
    """Whether ``buf`` holds a complete SSE event with non-empty delta content."""
    import orjson

    for event in buf.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                chunk = orjson.loads(data)
                if chunk["choices"][0]["delta"].get("content"):
                    return True
            except Exception:
                continue
    return False


@dataclass
class Target:
    name: str
    port: int
    pid: int | None
    # per-worker (path, token); refreshed per round by ``rollouts``
    slots: list[tuple[str, str]] = field(default_factory=list)
    lat: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    ttft: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    legs: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    wall: dict[tuple[str, int], float] = field(default_factory=dict)
    cpu: dict[tuple[str, int], float] = field(default_factory=dict)
    # the same, plus the rollouts' bookkeeping between rounds (envport: finishing the last
    # round's rollouts, i.e. building and storing their traces, and creating the next ones)
    cpu_all: dict[tuple[str, int], float] = field(default_factory=dict)
    errors: int = 0
    conns: list[Conn] = field(default_factory=list)


def _proc_cpu(pid: int | None) -> float:
    """User+system CPU seconds of a process (and its finished waited-for children)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(parts[11]) + int(parts[12])) / tick


def _http_json(method: str, url: str, token: str | None, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        targets: list[Target],
        orch_token: str,
        delay_ms: float = 0.0,
    ) -> None:
        self.args = args
        self.delay_ms = delay_ms
        self.targets = targets
        self.orch = orch_token
        self.body = json.dumps(
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is 12 + 7? Answer briefly."},
                ],
                "max_tokens": 64,
                "temperature": 1.0,
                "logprobs": True,
            }
        ).encode()
        self.stream_body = self.body[:-1] + b',"stream":true}'
        self.envport_live: dict[str, list[str]] = {}  # per envport target
        self.agl_ids: list[list[str]] = []
        self.round_no = 0
        self._phases: dict[tuple[bool, int], list[float]] = {}

    def phases(self, c: int, stream: bool) -> list[float]:
        """Each worker's start offset in a round (s): all 0 for ``lockstep``; for
        ``staggered``, a random phase within one call of the fake upstream (its delay,
        plus the gaps between a stream's chunks), drawn once per level with a fixed seed
        and the same for every target and round. A worker's calls follow one another,
        so it keeps its offset; the workers' calls arrive spread over the call's length
        instead of in one burst of ``c``."""
        key = (stream, c)
        if key not in self._phases:
            args = self.args
            span = self.delay_ms / 1e3
            if stream:
                span += args.stream_chunks * args.chunk_gap_ms / 1e3
            if args.arrivals == "lockstep" or c == 1 or span <= 0:
                self._phases[key] = [0.0] * c
            else:
                rng = random.Random(1000 * c + stream)
                self._phases[key] = [rng.uniform(0.0, span) for _ in range(c)]
        return self._phases[key]

    def _slots(self, t: Target, c: int) -> list[tuple[str, str]]:
        """(path, token) per worker for the next round."""
        self.round_no += 1
        if t.name in ("direct", "floor", "floor-raw", "floor-nginx"):
            return [("/v1/chat/completions", "sk-bench")] * c
        if t.name in ("envport", "envport-base"):
            base = f"http://{HOST}:{t.port}"
            for rid in self.envport_live.get(t.name, []):  # finish (store) the last round's
                _http_json("POST", f"{base}/admin/rollouts/{rid}/finish", self.orch, {})
            live = self.envport_live[t.name] = []
            out = []
            for _ in range(c):
                g = _http_json("POST", f"{base}/admin/rollouts", self.orch, {})
                live.append(g["rollout_id"])
                path = g["base_url"].split(str(t.port), 1)[1] + "/chat/completions"
                out.append((path, g["token"]))
            return out
        if t.name == "agl":
            ids = self.agl_ids
            out = []
            for w in range(c):
                rid, aid = ids[(self.round_no * c + w) % len(ids)]
                out.append((f"/rollout/{rid}/attempt/{aid}/v1/chat/completions", AGL_KEY))
            return out
        raise ValueError(t.name)

    async def _round(self, t: Target, c: int, n: int, stream: bool, key: Any) -> None:
        cpu_before_slots = _proc_cpu(t.pid)
        slots = self._slots(t, c)
        while len(t.conns) < c:
            t.conns.append(Conn(HOST, t.port))
        body = self.stream_body if stream else self.body
        lat = t.lat.setdefault(key, []) if key else []
        ttft = t.ttft.setdefault(key, []) if key else []
        left = [n]
        phases = self.phases(c, stream)

        async def worker(w: int) -> None:
            conn = t.conns[w]
            path, token = slots[w]
            if phases[w]:
                await asyncio.sleep(phases[w])
            while left[0] > 0:
                left[0] -= 1
                try:
                    status, first, total, out = await conn.post(path, body, token, stream)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    t.errors += 1
                    await conn.close()
                    if t.errors <= 5:
                        print(f"  {t.name}: {exc!r}", file=sys.stderr)
                    continue
                if status != 200 or (stream and first is None):
                    t.errors += 1
                    if t.errors <= 5:
                        print(f"  {t.name}: HTTP {status} {out[:300]!r}", file=sys.stderr)
                    continue
                lat.append(total)
                if first is not None:
                    ttft.append(first)
                    if key and conn.legs is not None:
                        t.legs.setdefault(key, []).append(conn.legs)

        cpu0 = _proc_cpu(t.pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(c)))
        if key:
            t.wall[key] = t.wall.get(key, 0.0) + time.perf_counter() - t0
            cpu1 = _proc_cpu(t.pid)
            t.cpu[key] = t.cpu.get(key, 0.0) + cpu1 - cpu0
            t.cpu_all[key] = t.cpu_all.get(key, 0.0) + cpu1 - cpu_before_slots

    async def level(self, c: int, n: int, stream: bool) -> None:
        key = ("stream" if stream else "json", c)
        rnd = max(min(self.args.round, n), c)
        for t in self.targets:  # warm-up
            await self._round(t, c, max(2 * c, self.args.warmup), stream, None)
        rounds = max(1, n // rnd)
        for r in range(rounds):
            order = self.targets[r % len(self.targets) :] + self.targets[: r % len(self.targets)]
            for t in order:
                await self._round(t, c, rnd, stream, key)

    async def run(self) -> None:
        for c in self.args.concurrency:
            print(f"  concurrency {c}: {self.args.n} x {len(self.targets)} ...", file=sys.stderr)
            await self.level(c, self.args.n, False)
        for c in self.args.stream_concurrency:
            n = self.args.stream_n
            print(f"  streaming, concurrency {c}: {n} x {len(self.targets)} ...", file=sys.stderr)
            await self.level(c, n, True)
        for t in self.targets:
            for conn in t.conns:
                await conn.close()


# --- orchestration ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


_NGINX_GLOBALS = "daemon off; master_process off;"


def _nginx_conf(logs: Path, port: int, upstream_port: int) -> Path:
    """An nginx config for the ``floor-nginx`` target: a bare streaming pass-through."""
    conf = logs / "nginx.conf"
    conf.write_text(
        f"""worker_processes 1;
error_log {logs}/nginx-error.log warn;
pid {logs}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {logs}/nginx-tmp;
    proxy_temp_path {logs}/nginx-tmp;
    upstream model {{ server {HOST}:{upstream_port}; keepalive 256; }}
    server {{
        listen {HOST}:{port} reuseport;
        keepalive_requests 1000000;
        location /health {{ proxy_pass http://model; }}
        location / {{
            proxy_pass http://model;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            tcp_nodelay on;
        }}
    }}
}}
"""
    )
    return conf


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited early (rc={proc.returncode}); see its log")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                r.read()
                return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not come up at {url} within {timeout:.0f} s")


def ensure_agl(python: Path) -> Path:
    """Create ``bench/.venvs/agl`` with ``agentlightning`` on first use; time and size it."""
    if python.exists():
        return python
    venv = python.parent.parent
    print(f"installing agentlightning into {venv} (first run) ...", file=sys.stderr)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "agentlightning"], check=True)
    size = subprocess.run(["du", "-sh", str(venv)], capture_output=True, text=True).stdout
    print(
        f"installed in {time.monotonic() - t0:.0f} s; venv size {size.split()[0]}",
        file=sys.stderr,
    )
    return python


@contextlib.contextmanager
def started(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, cpus)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
                proc.wait(5)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def summarize(targets: list[Target]) -> list[dict[str, Any]]:
    direct = next((t for t in targets if t.name == "direct"), None)
    rows = []
    keys = list(targets[0].lat.keys())
    for key in keys:
        mode, c = key
        base: dict[str, float] = {}
        if direct is not None:
            d = direct.lat[key]
            base = {
                "p50": pct(d, 50),
                "p99": pct(d, 99),
                "tput": len(d) / direct.wall[key],
                "ttft": pct(direct.ttft.get(key, []), 50),
                "ttft99": pct(direct.ttft.get(key, []), 99),
                "req_leg": pct([x[0] for x in direct.legs.get(key, [])], 50),
                "ans_leg": pct([x[1] for x in direct.legs.get(key, [])], 50),
            }
        for t in targets:
            xs = t.lat.get(key, [])
            n = len(xs)
            row = {
                "target": t.name,
                "mode": mode,
                "c": c,
                "n": n,
                "p50_ms": pct(xs, 50) * 1e3,
                "p99_ms": pct(xs, 99) * 1e3,
                "mean_ms": statistics.fmean(xs) * 1e3 if xs else float("nan"),
                "rps": n / t.wall[key] if n else float("nan"),
                "ttft_p50_ms": pct(t.ttft.get(key, []), 50) * 1e3 if mode == "stream" else None,
                "ttft_p99_ms": pct(t.ttft.get(key, []), 99) * 1e3 if mode == "stream" else None,
                "cpu_us_per_call": (t.cpu[key] / n * 1e6) if (t.pid and n) else None,
                "cpu_all_us_per_call": (t.cpu_all[key] / n * 1e6) if (t.pid and n) else None,
            }
            if base:
                row["added_p50_ms"] = row["p50_ms"] - base["p50"] * 1e3
                row["added_p99_ms"] = row["p99_ms"] - base["p99"] * 1e3
                row["tput_pct"] = 100 * row["rps"] / base["tput"]
                if mode == "stream":
                    row["added_ttft_ms"] = row["ttft_p50_ms"] - base["ttft"] * 1e3
                    row["added_ttft_p99_ms"] = row["ttft_p99_ms"] - base["ttft99"] * 1e3
                    legs = t.legs.get(key, [])
                    if legs:  # where the added TTFT is: the way in, or the way back
                        req = pct([x[0] for x in legs], 50) - base["req_leg"]
                        ans = pct([x[1] for x in legs], 50) - base["ans_leg"]
                        row["added_req_leg_ms"] = req * 1e3
                        row["added_ans_leg_ms"] = ans * 1e3
            rows.append(row)
    # what each gateway costs above the bare pass-through proxy (the floor)
    for key in keys:
        mode, c = key
        f = next((r for r in rows if r["target"] == "floor" and (r["mode"], r["c"]) == key), None)
        for r in rows:
            if f is not None and (r["mode"], r["c"]) == key and r["target"] in ENVPORT_AGL:
                r["over_floor_p50_ms"] = r["p50_ms"] - f["p50_ms"]
    # agl-added / envport-added
    for key in keys:
        mode, c = key
        e = next((r for r in rows if r["target"] == "envport" and (r["mode"], r["c"]) == key), None)
        a = next((r for r in rows if r["target"] == "agl" and (r["mode"], r["c"]) == key), None)
        if e and a and "added_p50_ms" in e:
            for r in (e, a):
                r["ratio_p50"] = (
                    a["added_p50_ms"] / e["added_p50_ms"] if e["added_p50_ms"] > 0 else None
                )
                r["ratio_p99"] = (
                    a["added_p99_ms"] / e["added_p99_ms"] if e["added_p99_ms"] > 0 else None
                )
    return rows


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    if x is None or x != x:
        return "-"
    return fmt.format(x)


COLUMNS = [
    ("target", "target"),
    ("mode", "mode"),
    ("c", "conc"),
    ("n", "n"),
    ("p50_ms", "p50 ms"),
    ("p99_ms", "p99 ms"),
    ("added_p50_ms", "+p50 ms"),
    ("added_p99_ms", "+p99 ms"),
    ("rps", "req/s"),
    ("tput_pct", "% direct"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("added_ttft_ms", "+TTFT ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("added_ttft_p99_ms", "+TTFT p99 ms"),
    ("added_req_leg_ms", "+in ms"),
    ("added_ans_leg_ms", "+out ms"),
    ("cpu_us_per_call", "gw cpu us/call"),
    ("cpu_all_us_per_call", "+rollouts us/call"),
    ("over_floor_p50_ms", "p50 over floor ms"),
    ("ratio_p50", "agl/envport +p50"),
    ("ratio_p99", "agl/envport +p99"),
]


def cell(row: dict[str, Any], k: str) -> str:
    v = row.get(k)
    if k in ("target", "mode"):
        return str(v)
    if k in ("c", "n"):
        return str(v)
    if k == "rps":
        return _f(v, "{:.0f}")
    if k == "tput_pct":
        return _f(v, "{:.0f}%")
    if k in ("cpu_us_per_call", "cpu_all_us_per_call"):
        return _f(v, "{:.0f}")
    if k.startswith("ratio"):
        return _f(v, "{:.1f}x")
    if k.startswith("added") and row["target"] == "direct":
        return "-"
    return _f(v, "{:.3f}" if k.startswith(("added", "over")) else "{:.2f}")


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for r in rows:
            print("  ".join(cell(r, k) for k, _ in COLUMNS))
        return
    table = Table(title=title)
    for _, label in COLUMNS:
        table.add_column(label, justify="left" if label in ("target", "mode") else "right")
    last = None
    for r in rows:
        if last is not None and (r["mode"], r["c"]) != last:
            table.add_section()
        last = (r["mode"], r["c"])
        table.add_row(*(cell(r, k) for k, _ in COLUMNS))
    Console(width=220).print(table)


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(label for _, label in COLUMNS) + " |"]
    out.append("|" + "|".join("---" for _ in COLUMNS) + "|")
    for r in rows:
        out.append("| " + " | ".join(cell(r, k) for k, _ in COLUMNS) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = sys.argv[1] if len(sys.argv) > 1 else ""
    if sub == "_upstream":
        p.add_argument("mode")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--delay-ms", type=float, default=0.0)
        p.add_argument("--chunks", type=int, default=8)
        p.add_argument("--gap-ms", type=float, default=2.0)
        a = p.parse_args()
        run_upstream(a.port, a.delay_ms, a.chunks, a.gap_ms)
        return
    if sub == "_floor":
        p.add_argument("mode")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--upstream", required=True)
        p.add_argument("--client", choices=["aiohttp", "raw"], default="aiohttp")
        a = p.parse_args()
        run_floor(a.port, a.upstream, a.client)
        return
    if sub == "_agl":
        p.add_argument("mode")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--upstream", required=True)
        p.add_argument("--ids-file", required=True)
        p.add_argument("--rollouts", type=int, default=256)
        a = p.parse_args()
        run_agl(a.port, a.upstream, a.ids_file, a.rollouts)
        return
    p.add_argument("--n", type=int, default=2000, help="requests per target per level")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--stream-n", type=int, default=500, help="streamed requests per level")
    p.add_argument("--stream-concurrency", default="1,8,32")
    p.add_argument("--round", type=int, default=100, help="requests per target per round")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument(
        "--targets",
        default="direct,floor-raw,floor,envport,agl",
        help="comma-separated, from: direct, floor-raw, floor, floor-nginx (needs nginx), "
        "envport, envport-base (needs --base-src or --base-python), agl",
    )
    p.add_argument(
        "--base-src",
        default=None,
        help="for target envport-base: a folder holding another copy of the envport "
        "package (e.g. the code before a change), run as a second gateway",
    )
    p.add_argument(
        "--base-python",
        default=None,
        help="for target envport-base: the Python that runs it (another version, with "
        "envport's dependencies installed; default: this one)",
    )
    p.add_argument(
        "--modes", default="json,stream", help="which calls to measure: json, stream or both"
    )
    p.add_argument(
        "--upstream-delay-ms",
        default="0",
        help="model generation delay(s), comma-separated: one full run per value",
    )
    p.add_argument("--stream-chunks", type=int, default=8)
    p.add_argument("--chunk-gap-ms", type=float, default=2.0)
    p.add_argument(
        "--arrivals",
        choices=["lockstep", "staggered"],
        default="lockstep",
        help="lockstep: a level's workers start together (a burst of c requests at "
        "once); staggered: each starts at its own random phase within one call's length "
        "and keeps it (same phases for every target)",
    )
    p.add_argument("--agl-python", default=str(AGL_VENV / "bin" / "python"))
    p.add_argument("--no-pin", action="store_true")
    p.add_argument(
        "--layout", choices=["proxy-alone", "client-alone", "agent-side"], default="proxy-alone"
    )
    p.add_argument(
        "--awake-cpus",
        action="store_true",
        help="keep the proxy's CPUs from idling (SCHED_IDLE spinners): isolates the VM's "
        "vCPU wake-up latency",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: n=200, stream-n=50")
    p.add_argument("--json", default=None, help="write rows as JSON here")
    p.add_argument("--markdown", default=None, help="write the table as Markdown here")
    p.add_argument("--logs", default=None, help="folder for server logs (default: temp)")
    args = p.parse_args()
    if args.quick:
        args.n, args.stream_n, args.warmup = 200, 50, 20
    modes = {x for x in str(args.modes).split(",") if x}
    if not modes or modes - {"json", "stream"}:
        raise SystemExit(f"--modes: json and/or stream, not {args.modes!r}")
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x]
    args.stream_concurrency = [int(x) for x in str(args.stream_concurrency).split(",") if x]
    if "json" not in modes:
        args.concurrency = []
    if "stream" not in modes:
        args.stream_concurrency = []
    names = [x for x in args.targets.split(",") if x]

    ncpu = os.cpu_count() or 1
    pin = not args.no_pin and ncpu >= 2 and hasattr(os, "sched_setaffinity")
    if pin and args.layout == "proxy-alone":
        # The proxy under test gets a core to itself; the client and the fake model
        # server (both "the outside world" for a gateway) share the other.
        client_cpus, upstream_cpus, proxy_cpus = {0}, {0}, set(range(1, ncpu))
    elif pin and args.layout == "agent-side":
        # The gateway beside its agents; the model server on the other CPU(s).
        client_cpus, upstream_cpus, proxy_cpus = {0}, set(range(1, ncpu)), {0}
    elif pin:  # client-alone: the earlier layout
        client_cpus, upstream_cpus, proxy_cpus = {0}, set(range(1, ncpu)), set(range(1, ncpu))
    else:
        client_cpus = upstream_cpus = proxy_cpus = None
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    spinners = []
    if args.awake_cpus:
        if not proxy_cpus:
            raise SystemExit("--awake-cpus needs pinning (two or more CPUs, no --no-pin)")
        spinners = [_spinner(cpu) for cpu in sorted(proxy_cpus)]
    try:
        _run_all(args, names, ncpu, pin, (upstream_cpus, proxy_cpus))
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def _spinner(cpu: int) -> subprocess.Popen[bytes]:
    """A busy loop on ``cpu`` at SCHED_IDLE: the CPU never idles, and anything else that
    wants it preempts the loop at once."""
    code = (
        "import os\n"
        f"os.sched_setaffinity(0, {{{cpu}}})\n"
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "while True:\n    pass\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def _run_all(
    args: argparse.Namespace,
    names: list[str],
    ncpu: int,
    pin: bool,
    cpus: tuple[set[int] | None, set[int] | None],
) -> None:
    delays = [float(x) for x in str(args.upstream_delay_ms).split(",") if x]
    base_logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="gw-bench-"))
    results = []
    markdowns = []
    for delay in delays:
        logs = base_logs / f"delay-{delay:g}ms"
        logs.mkdir(parents=True, exist_ok=True)
        targets, elapsed = run_once(args, names, delay, logs, cpus)
        rows = summarize(targets)
        where = {
            "proxy-alone": "proxy on CPU 1; client + upstream on CPU 0",
            "client-alone": "client on CPU 0; proxy + upstream on CPU 1",
            "agent-side": "client + proxy on CPU 0; upstream on CPU 1",
        }[args.layout]
        title = (
            f"Gateway overhead: N={args.n}/target/level (stream {args.stream_n}), "
            f"upstream delay {delay:g} ms, {args.stream_chunks} chunks "
            f"{args.chunk_gap_ms:g} ms apart, {args.arrivals} arrivals, "
            f"{ncpu} CPUs ({where if pin else 'unpinned'})"
            f"{', proxy CPUs kept awake' if args.awake_cpus else ''}"
            f", {elapsed:.0f} s"
        )
        print_table(rows, title)
        for t in targets:
            if t.errors:
                print(f"{t.name}: {t.errors} failed requests", file=sys.stderr)
        results.append({"title": title, "delay_ms": delay, "rows": rows})
        markdowns.append(f"{title}\n\n" + markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(markdowns))


def run_once(
    args: argparse.Namespace,
    names: list[str],
    delay_ms: float,
    logs: Path,
    cpus: tuple[set[int] | None, set[int] | None],
) -> tuple[list[Target], float]:
    """Start the upstream (with ``delay_ms``) and every target, measure, stop them all."""
    upstream_cpus, server_cpus = cpus
    py = sys.executable
    me = str(Path(__file__).resolve())
    orch = "orch-bench-token"
    ports = {
        n: free_port()
        for n in ("upstream", "envport", "envport-base", "agl", "floor", "floor-raw", "floor-nginx")
    }
    upstream_url = f"http://{HOST}:{ports['upstream']}/v1"
    agl_ids: list[list[str]] = []
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(
            started(
                [
                    py,
                    me,
                    "_upstream",
                    "--port",
                    str(ports["upstream"]),
                    "--delay-ms",
                    str(delay_ms),
                    "--chunks",
                    str(args.stream_chunks),
                    "--gap-ms",
                    str(args.chunk_gap_ms),
                ],
                logs / "upstream.log",
                cpus=upstream_cpus,
            )
        )
        wait_http(f"http://{HOST}:{ports['upstream']}/health", up, "fake upstream")
        targets: list[Target] = []
        for name in names:
            if name == "direct":
                targets.append(Target("direct", ports["upstream"], None))
            elif name in ("envport", "envport-base"):
                env = {**os.environ, "ENVPORT_GATEWAY_TOKEN": orch}
                if name == "envport-base":  # another copy, or another Python, to compare with
                    if not (args.base_src or args.base_python):
                        raise SystemExit("target envport-base needs --base-src or --base-python")
                    if args.base_src:
                        env["PYTHONPATH"] = str(Path(args.base_src).resolve())
                proc = stack.enter_context(
                    started(
                        [
                            args.base_python or py if name == "envport-base" else py,
                            "-m",
                            "envport.gateway",
                            "--upstream",
                            upstream_url,
                            "--port",
                            str(ports[name]),
                            "--store",
                            str(logs / f"traces-{name}.db"),
                        ],
                        logs / f"{name}.log",
                        env=env,
                        cpus=server_cpus,
                    )
                )
                wait_http(f"http://{HOST}:{ports[name]}/health", proc, f"{name} gateway")
                targets.append(Target(name, ports[name], proc.pid))
            elif name in ("floor", "floor-raw"):
                client = "raw" if name == "floor-raw" else "aiohttp"
                cmd = [py, me, "_floor", "--port", str(ports[name]), "--client", client]
                proc = stack.enter_context(
                    started(
                        [*cmd, "--upstream", upstream_url],
                        logs / f"{name}.log",
                        cpus=server_cpus,
                    )
                )
                wait_http(f"http://{HOST}:{ports[name]}/health", proc, f"{name} proxy")
                targets.append(Target(name, ports[name], proc.pid))
            elif name == "floor-nginx":
                conf = _nginx_conf(logs, ports[name], ports["upstream"])
                nginx = shutil.which("nginx") or "/usr/sbin/nginx"
                if not Path(nginx).exists():
                    raise SystemExit("target floor-nginx needs nginx (apt-get install nginx-light)")
                proc = stack.enter_context(
                    started(
                        # one process, in the foreground: its CPU is the pid's CPU
                        [nginx, "-c", str(conf), "-p", str(logs), "-g", _NGINX_GLOBALS],
                        logs / f"{name}.log",
                        cpus=server_cpus,
                    )
                )
                wait_http(f"http://{HOST}:{ports[name]}/health", proc, "nginx proxy")
                targets.append(Target(name, ports[name], proc.pid))
            elif name == "agl":
                agl_py = ensure_agl(Path(args.agl_python))
                (logs / "agl-ids.json").unlink(missing_ok=True)
                env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
                env["LITELLM_LOG"] = "ERROR"
                env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no network fetch at start
                # The LiteLLM that agentlightning 0.3 pulls in refuses to start without a
                # master key, and with one, LLMProxy's own readiness probe (GET /health,
                # no key) gets 401 and it kills itself after 60 s. So run it as agl
                # expects, unauthenticated, with LiteLLM's documented local-dev switch.
                env["LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY"] = "true"
                env.pop("LITELLM_MASTER_KEY", None)
                proc = stack.enter_context(
                    started(
                        [
                            str(agl_py),
                            me,
                            "_agl",
                            "--port",
                            str(ports["agl"]),
                            "--upstream",
                            upstream_url,
                            "--ids-file",
                            str(logs / "agl-ids.json"),
                        ],
                        logs / "agl.log",
                        env=env,
                        cpus=server_cpus,
                    )
                )
                wait_http(
                    f"http://{HOST}:{ports['agl']}/health/liveliness",
                    proc,
                    "agent-lightning proxy",
                    timeout=180,
                )
                ids_path = logs / "agl-ids.json"
                deadline = time.monotonic() + 60
                while not ids_path.exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
                agl_ids = json.loads(ids_path.read_text())
                targets.append(Target("agl", ports["agl"], proc.pid))
            else:
                raise SystemExit(f"unknown target {name!r}")
        print(f"servers up (logs in {logs}); measuring ...", file=sys.stderr)
        bench = Bench(args, targets, orch, delay_ms)
        bench.agl_ids = agl_ids
        t0 = time.monotonic()
        asyncio.run(bench.run())
        elapsed = time.monotonic() - t0
    return targets, elapsed


if __name__ == "__main__":
    main()
