"""envport's HTTP/1.1 server (what ``envport gateway`` serves with), on real sockets.

Raw clients send exactly the bytes each test means: keep-alive, pipelining, framing,
limits, broken requests, apps that fail, clients that leave or stop reading, the
lifespan and a graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from envport.gateway.errors import GatewayError
from envport.gateway.front import SEND_NOWAIT, serve_asgi
from envport.serving import serve_in_thread

App = Callable[[Any, Any, Any], Awaitable[None]]


@contextlib.asynccontextmanager
async def running(app: App, **kwargs: Any) -> AsyncIterator[tuple[int, asyncio.Task[None]]]:
    """Serve ``app`` on an ephemeral port in this loop; stopped (gracefully) on exit."""
    stop = asyncio.Event()
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_asgi(app, "127.0.0.1", 0, stop=stop, ready=bound.set_result, **kwargs)
    )
    waiting: list[asyncio.Future[Any]] = [bound, task]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        await task  # startup failed: raise it
    try:
        yield bound.result(), task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


_clients: list[asyncio.StreamWriter] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _clients:
        writer = _clients.pop()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw client connection (closed after the test)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    _clients.append(writer)
    return reader, writer


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case), body (de-chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return status, headers, body
            body += (await reader.readexactly(size + 2))[:-2]
    length = int(headers.get("content-length", "0"))
    return status, headers, await reader.readexactly(length)


async def closed(reader: asyncio.StreamReader, within_s: float = 5.0) -> bool:
    """True when the server closed the connection (EOF) within ``within_s``."""
    try:
        return await asyncio.wait_for(reader.read(1), within_s) == b""
    except ConnectionResetError:
        return True


def request(path: str = "/", body: bytes = b"", *, method: str = "POST", extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def echo(scope: Any, receive: Any, send: Any) -> None:
    """Answers with the method, path, query and body it got (length given when asked)."""
    if scope["type"] != "http":
        return
    message = await receive()
    body = b"%s %s?%s|%s" % (
        scope["method"].encode(),
        scope["path"].encode(),
        scope["query_string"],
        message["body"],
    )
    headers = [(b"content-type", b"text/plain")]
    if scope["query_string"] == b"sized":
        headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def test_keep_alive_chunked_and_sized_answers_on_one_connection() -> None:
    async with running(echo) as (port, _):
        reader, writer = await connect(port)
        writer.write(request("/a%20b", b"one"))
        status, headers, body = await read_response(reader)
        assert (status, body) == (200, b"POST /a b?|one")
        assert headers["transfer-encoding"] == "chunked"
        assert "date" in headers
        writer.write(request("/x?sized", b"two"))
        status, headers, body = await read_response(reader)
        assert (status, body) == (200, b"POST /x?sized|two")
        assert headers["content-length"] == str(len(body))
        assert "transfer-encoding" not in headers
        writer.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async def slow_first(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        message = await receive()
        if message["body"] == b"first":
            await asyncio.sleep(0.2)  # the second is complete long before
        await echo_body(message["body"], send)

    async with running(slow_first) as (port, _):
        reader, writer = await connect(port)
        writer.write(request(body=b"first") + request(body=b"second") + request(body=b"third"))
        answers = [(await read_response(reader))[2] for _ in range(3)]
        assert answers == [b"first", b"second", b"third"]
        writer.close()


async def echo_body(body: bytes, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def test_http10_and_connection_close_end_the_connection() -> None:
    async with running(echo) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert status == 200
        assert headers["connection"] == "close"
        assert await closed(reader)

        reader, writer = await connect(port)
        writer.write(request(extra="connection: close\r\n"))
        status, headers, _ = await read_response(reader)
        assert status == 200
        assert headers["connection"] == "close"
        assert await closed(reader)


async def test_a_chunked_request_body_is_handed_over_whole() -> None:
    async with running(echo) as (port, _):
        reader, writer = await connect(port)
        writer.write(
            b"POST /c HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
        )
        _, _, body = await read_response(reader)
        assert body == b"POST /c?|abcdefg"
        writer.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"NOT-HTTP\r\n\r\n",
        b"POST / HTTP/1.1\r\ncontent-length: nope\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad header line\r\n\r\n",
    ],
    ids=["garbage", "bad-length", "bad-header"],
)
async def test_a_malformed_request_gets_400_and_the_app_never_sees_it(raw: bytes) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        await echo(scope, receive, send)

    async with running(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(raw)
        status, headers, body = await read_response(reader)
        assert status == 400
        assert b"Invalid HTTP request" in body
        assert headers["connection"] == "close"
        assert await closed(reader)
    assert [s for s in seen if s["type"] == "http"] == []


async def test_an_upgrade_is_refused() -> None:
    async with running(echo) as (port, _):
        reader, writer = await connect(port)
        writer.write(
            b"GET /ws HTTP/1.1\r\nhost: t\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
        )
        status, _, body = await read_response(reader)
        assert status == 400
        assert b"Upgrades" in body
        assert await closed(reader)


async def test_an_oversize_body_gets_413_whether_announced_or_streamed() -> None:
    calls: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            calls.append((await receive())["body"])
            await echo_body(b"ok", send)

    async with running(app, max_body=1000) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 413
        assert b"1000 bytes" in body
        assert await closed(reader)

        reader, writer = await connect(port)
        chunk = b"x" * 600
        writer.write(
            b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            + (b"258\r\n" + chunk + b"\r\n") * 2
            + b"0\r\n\r\n"
        )
        status, _, _ = await read_response(reader)
        assert status == 413
        assert await closed(reader)

        reader, writer = await connect(port)  # at the limit is fine
        writer.write(request(body=b"y" * 1000))
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"ok")
        writer.close()
    assert calls == [b"y" * 1000]


async def test_bodies_arriving_at_once_past_the_server_s_budget_get_503() -> None:
    """Each body is bounded by max_body and the request timeout, but not their sum: many
    connections uploading at once (before any token is checked) could hold gigabytes.
    Past the budget of bodies still arriving, a request is refused; the budget frees as
    bodies are handed over, refused or dropped."""
    calls: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            calls.append((await receive())["body"])
            await echo_body(b"ok", send)

    async with running(app, max_body=1000, max_buffered=1500) as (port, _):
        first, first_w = await connect(port)
        first_w.write(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n" + b"a" * 900)
        second, second_w = await connect(port)
        second_w.write(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n" + b"b" * 900)
        status, _, body = await read_response(second)
        assert status == 503
        assert b"too many request bodies" in body
        assert await closed(second)
        first_w.write(b"a" * 100)  # the first finishes: served
        assert (await read_response(first))[::2] == (200, b"ok")
        third, third_w = await connect(port)  # what was handed over no longer counts
        third_w.write(request(body=b"c" * 1000))
        assert (await read_response(third))[::2] == (200, b"ok")
        _, dropped_w = await connect(port)  # a client leaving mid-body frees its share
        head = b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n"
        dropped_w.write(head + b"d" * 900)
        dropped_w.close()
        for _ in range(100):  # until the server has heard it leave
            fourth, fourth_w = await connect(port)
            fourth_w.write(request(body=b"e" * 1000))
            status, _, body = await read_response(fourth)
            if status == 200:
                break
            assert status == 503
            await asyncio.sleep(0.05)
        assert (status, body) == (200, b"ok")
    assert calls == [b"a" * 1000, b"c" * 1000, b"e" * 1000]


async def test_an_oversize_head_gets_431_however_it_comes() -> None:
    """Before anything is authenticated, a request's head is bounded: one endless header
    line (held by the parser until it ends), too many lines, a long URL."""
    calls: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            calls.append((await receive())["body"])
            await echo_body(b"ok", send)

    async with running(app) as (port, _):  # the default: 64 KiB
        reader, writer = await connect(port)
        writer.write(b"POST / HTTP/1.1\r\nhost: t\r\nx-pad: ")
        for _ in range(66):  # one line that never ends, a piece at a time (the last crosses)
            writer.write(b"a" * 1000)
            await writer.drain()
            await asyncio.sleep(0.002)
        status, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert status == 431
        assert b"65536 bytes" in body
        assert await closed(reader)

    async with running(app, max_head=4096) as (port, _):
        reader, writer = await connect(port)  # small, but too many lines
        writer.write(b"POST / HTTP/1.1\r\nhost: t\r\n" + b"x: 1\r\n" * 300 + b"\r\n")
        status, _, _ = await asyncio.wait_for(read_response(reader), 5)
        assert status == 431
        assert await closed(reader)

        reader, writer = await connect(port)  # a long URL, all in one read
        writer.write(request("/" + "u" * 5000))
        status, _, _ = await asyncio.wait_for(read_response(reader), 5)
        assert status == 431

        reader, writer = await connect(port)  # under the limit is fine
        writer.write(request("/" + "u" * 1000, extra="x-pad: " + "a" * 2000 + "\r\n"))
        status, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert (status, body) == (200, b"ok")
    assert calls == [b""]


async def test_the_server_s_own_errors_on_model_paths_are_in_the_api_s_shape() -> None:
    """An SDK reads the server's own refusals as any API error: OpenAI's shape on the
    OpenAI paths, Anthropic's on /v1/messages, plain text elsewhere."""
    async with running(echo, max_body=1000) as (port, _):
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/rollouts/r1/v1", api_key="k", max_retries=0
        )
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 2000}]
            )
        await client.close()
        assert info.value.status_code == 413
        error = info.value.response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "1000 bytes" in error["message"]

        anthropic_client = anthropic.AsyncAnthropic(
            base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0
        )
        with pytest.raises(anthropic.APIStatusError) as refused:
            await anthropic_client.messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "x" * 2000}]
            )
        await anthropic_client.close()
        assert refused.value.status_code == 413
        body = refused.value.response.json()
        assert body["type"] == "error"
        assert body["error"]["type"] == "request_too_large"

        reader, writer = await connect(port)  # malformed, on a model path
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: x\r\n\r\n")
        status, headers, raw = await read_response(reader)
        assert status == 400
        assert headers["content-type"] == "application/json"
        assert orjson.loads(raw)["error"]["type"] == "invalid_request_error"

        reader, writer = await connect(port)  # elsewhere: plain text
        writer.write(b"POST /other HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n\r\n")
        status, headers, raw = await read_response(reader)
        assert status == 413
        assert headers["content-type"].startswith("text/plain")


def test_anthropic_error_types_for_422_and_408() -> None:
    for status, kind in [(422, "invalid_request_error"), (408, "timeout_error")]:
        error = GatewayError("m")
        error.status = status
        assert error.body("anthropic")["error"]["type"] == kind


async def test_expect_100_continue_gets_the_interim_answer() -> None:
    async with running(echo) as (port, _):
        reader, writer = await connect(port)
        writer.write(
            b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
        )
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hi")
        _, _, body = await read_response(reader)
        assert body == b"POST /?|hi"
        writer.close()


async def test_100_continue_waits_its_turn_and_checks_and_is_for_http11_only() -> None:
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/stream":
            await send({"type": "http.response.body", "body": b"data: 1", "more_body": True})
            await release.wait()
        await send({"type": "http.response.body", "body": b"|" + body})

    async with running(app, max_body=1000) as (port, _):
        # pipelined behind an answer still streaming: not in the middle of it
        reader, writer = await connect(port)
        writer.write(request("/stream"))
        await reader.readuntil(b"data: 1\r\n")
        writer.write(
            b"POST / HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n"
        )
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.3)  # nothing, 100 included, for now
        release.set()
        rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        assert rest == b"1\r\n|\r\n0\r\n\r\n"  # the stream ends as it should
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hi")
        _, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert body == b"|hi"

        # too large: 413 at once, no 100 before it (whatever the order of the headers)
        reader, writer = await connect(port)
        writer.write(
            b"POST / HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 5000\r\n\r\n"
        )
        status, _, _ = await asyncio.wait_for(read_response(reader), 5)
        assert status == 413

        # HTTP/1.0 has no 100 Continue
        reader, writer = await connect(port)
        writer.write(b"POST / HTTP/1.0\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
        await asyncio.sleep(0.1)
        writer.write(b"ok")
        status, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert (status, body) == (200, b"|ok")


async def test_head_answers_carry_no_body() -> None:
    async with running(echo) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"HEAD /h?sized HTTP/1.1\r\nhost: t\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"content-length: 14" in head  # what a GET would get, no bytes follow
        writer.write(request(body=b"next"))  # the connection is still in step
        _, _, body = await read_response(reader)
        assert body == b"POST /?|next"
        writer.close()


async def test_app_failures_get_500_or_a_cut_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/raise-first":
            raise ValueError("boom before the answer")
        if scope["path"] == "/nothing":
            return
        if scope["path"] == "/raise-after-start":  # the head has not gone out yet
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise ValueError("boom after the start")
        if scope["path"] == "/wrong-length":  # refused before anything went out
            sized = [(b"content-length", b"10")]
            await send({"type": "http.response.start", "status": 200, "headers": sized})
            await send({"type": "http.response.body", "body": b"abc"})
        if scope["path"] == "/bad-header":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"x-evil", b"a\r\nset-cookie: b")],
                }
            )
            return
        if scope["path"] == "/bad-name":  # a lone LF in a name, after a good header
            headers = [(b"x-fine", b"1"), (b"x-a\nb", b"v")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        if scope["path"] == "/raise-midway":
            raise ValueError("boom midway")
        # /unfinished: returns with the answer begun

    caplog.set_level(logging.ERROR, "envport.gateway.front")
    async with running(app) as (port, _):
        for path in (
            "/raise-first",
            "/nothing",
            "/bad-header",
            "/bad-name",
            "/raise-after-start",
            "/wrong-length",
        ):
            reader, writer = await connect(port)
            writer.write(request(path))
            status, _, body = await read_response(reader)
            assert (status, body) == (500, b"Internal Server Error"), path
            assert await closed(reader)
        for path in ("/raise-midway", "/unfinished"):
            reader, writer = await connect(port)
            writer.write(request(path))
            data = await asyncio.wait_for(reader.read(), 5)  # up to the server's close
            assert data.startswith(b"HTTP/1.1 200 OK"), path
            assert b"part" in data, path
            assert not data.endswith(b"0\r\n\r\n"), path  # cut: the body never ended
    text = caplog.text
    assert "boom before the answer" in text
    assert "boom after the start" in text
    assert "Invalid HTTP header b'x-evil'" in text
    assert "Invalid HTTP header b'x-a\\nb'" in text
    assert "shorter than its Content-Length" in text
    assert "boom midway" in text
    assert "sent no response" in text
    assert "unfinished" in text


async def test_a_failure_after_a_complete_answer_keeps_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Starlette's error middleware sends a whole 500, then re-raises: the answer is
    complete, so the failure is logged and the next request on the connection (here
    pipelined) is served."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/fail":
            await echo_body(b"Internal Server Error", send)
            raise ValueError("boom after the answer")
        await echo_body(b"fine", send)

    caplog.set_level(logging.ERROR, "envport.gateway.front")
    async with running(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(request("/fail") + request("/next"))
        _, headers, body = await asyncio.wait_for(read_response(reader), 5)
        assert body == b"Internal Server Error"
        assert headers.get("connection") != "close"
        _, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert body == b"fine"
        writer.write(request("/again"))  # and it stays open
        _, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert body == b"fine"
    assert "boom after the answer" in caplog.text


async def test_the_head_goes_out_alone_when_the_body_is_not_ready() -> None:
    """The head waits for the first body bytes to go out with them (one write), but
    never for an app that waits between the two: it goes out at the end of the step."""
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await release.wait()
        await send({"type": "http.response.body", "body": b"late"})

    async with running(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(request())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 201 Created\r\n")
        assert not release.is_set()
        release.set()
        assert await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5) == (
            b"4\r\nlate\r\n0\r\n\r\n"
        )


async def test_a_client_leaving_is_heard_and_later_sends_go_nowhere() -> None:
    heard: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    after: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        heard.set_result(await receive())
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        after.append("sent")

    async with running(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(request())
        await reader.readuntil(b"data: 1\n\n")
        writer.close()
        assert (await asyncio.wait_for(heard, 5)) == {"type": "http.disconnect"}
        await asyncio.sleep(0.05)
    assert after == ["sent"]


async def test_an_answer_waits_for_a_client_that_stops_reading() -> None:
    sent: list[int] = []
    piece = b"x" * 65536
    total = 400  # 26 MB, far more than the sockets' buffers

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(total):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            sent.append(1)
        await send({"type": "http.response.body", "body": b""})

    async with running(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(request())
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.5)
        stalled_at = len(sent)
        await asyncio.sleep(0.3)
        assert len(sent) == stalled_at < total  # held back, not buffered in memory
        received = 0
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            received += len(await reader.readexactly(size + 2)) - 2
        assert received == total * len(piece)
        writer.close()


async def test_idle_keep_alive_connections_are_closed_busy_ones_are_not() -> None:
    async def slow(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await asyncio.sleep(0.6)  # longer than the keep-alive timeout
        await echo_body(b"late", send)

    async with running(slow, keep_alive_s=0.2) as (port, _):
        reader, writer = await connect(port)
        writer.write(request())
        _, _, body = await read_response(reader)
        assert body == b"late"  # not cut while the app worked
        assert await closed(reader, within_s=3)  # then idle: closed


@pytest.mark.parametrize("part", ["head", "body"])
async def test_a_request_trickling_in_gets_408_and_is_closed(part: str) -> None:
    """Each byte comes well within the keep-alive timeout, but the request as a whole
    never arrives: it is timed from its first byte, not from its latest."""
    async with running(echo, keep_alive_s=0.5, request_timeout_s=1.0) as (port, _):
        reader, writer = await connect(port)
        head = b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n"
        if part == "body":
            writer.write(head + b"\r\n")
        trickle = (head if part == "head" else b"") + b"x" * 1000
        answer = asyncio.ensure_future(read_response(reader))
        sent = 0
        while not answer.done() and sent < 100:  # 10 s at most
            writer.write(trickle[sent : sent + 1])
            sent += 1
            await asyncio.sleep(0.1)
        status, _, body = await asyncio.wait_for(answer, 5)
        assert status == 408
        assert b"within 1 s" in body
        assert await closed(reader)

        reader, writer = await connect(port)  # slow, but in time: served
        for piece in (b"POST / HTTP/1.1\r\nhost: t\r\n", b"content-length: 2\r\n\r\n", b"hi"):
            writer.write(piece)
            await asyncio.sleep(0.2)
        _, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert body == b"POST /?|hi"


async def test_lifespan_runs_around_serving() -> None:
    events: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                if message["type"] == "lifespan.startup":
                    scope["state"]["ready"] = True
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await receive()
        await echo_body(b"ready" if scope["state"].get("ready") else b"no state", send)

    async with running(app) as (port, _):
        assert events == ["lifespan.startup"]
        reader, writer = await connect(port)
        writer.write(request())
        assert (await read_response(reader))[2] == b"ready"
        writer.close()
    assert events == ["lifespan.startup", "lifespan.shutdown"]


async def test_a_failed_startup_stops_the_server_and_an_app_without_lifespan_serves() -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no database"})

    with pytest.raises(RuntimeError, match="no database"):
        async with running(failing):
            pass

    async def plain(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http", "no lifespan support"
        await receive()
        await echo_body(b"plain", send)

    async with running(plain) as (port, _):
        reader, writer = await connect(port)
        writer.write(request())
        assert (await read_response(reader))[2] == b"plain"
        writer.close()


async def test_shutdown_finishes_answers_in_progress_and_refuses_new_connections() -> None:
    started = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/long":
            started.set()
            await asyncio.sleep(0.5)
        await echo_body(b"finished", send)

    stop = asyncio.Event()
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_asgi(app, "127.0.0.1", 0, stop=stop, ready=bound.set_result))
    port = await bound
    idle_reader, idle_writer = await connect(port)
    idle_writer.write(request())
    await read_response(idle_reader)  # a kept-alive, now idle connection
    reader, writer = await connect(port)
    writer.write(request("/long"))
    await started.wait()
    stop.set()
    assert await closed(idle_reader, within_s=2)  # idle: closed at once
    status, headers, body = await read_response(reader)
    assert (status, body) == (200, b"finished")
    assert headers["connection"] == "close"
    await asyncio.wait_for(task, 10)
    with pytest.raises(ConnectionRefusedError):
        await connect(port)


def test_serve_in_thread_lean_with_a_real_client() -> None:
    with serve_in_thread(echo, lean=True) as url, httpx.Client(base_url=url) as client:
        for i in range(3):  # one kept-alive connection
            r = client.post("/p", params={"q": "1"}, content=f"n{i}".encode())
            assert r.status_code == 200
            assert r.text == f"POST /p?q=1|n{i}"


async def test_the_app_runs_eagerly_inside_its_own_task() -> None:
    """The app's first step runs as the request is parsed, yet inside the task that then
    carries it: current_task() is that task, timeouts work, context stays per request."""
    import contextvars
    import inspect

    seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="")
    observed: list[tuple[bool, bool, str]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = (await receive())["body"]
        # still inside the parser's callback: nothing else ran between parse and app
        eager = any(frame.function == "on_message_complete" for frame in inspect.stack())
        task = asyncio.current_task()
        before = seen.get()  # another request's value would leak in here
        seen.set(body.decode())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):  # needs the current task
                await asyncio.sleep(5)
        observed.append((eager, task is asyncio.current_task() and task is not None, before))
        await echo_body(seen.get().encode(), send)

    async with running(app) as (port, _):
        reader, writer = await connect(port)
        for word in (b"one", b"two"):
            writer.write(request(body=word))
            assert (await read_response(reader))[2] == word
    assert observed == [(True, True, ""), (True, True, "")]


async def test_a_cancelled_request_task_closes_the_app() -> None:
    closed_app = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        try:
            await asyncio.sleep(30)
        finally:
            closed_app.set()

    async with running(app, grace_s=0.1) as (port, _):
        _, writer = await connect(port)
        writer.write(request())
        await asyncio.sleep(0.1)
    # the shutdown's grace ran out: the task was cancelled and the app's finally ran
    await asyncio.wait_for(closed_app.wait(), 5)


async def test_nothing_is_served_after_a_failure_closed_the_connection() -> None:
    paths: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        paths.append(scope["path"])
        await receive()
        if scope["path"] == "/fail":
            raise ValueError("boom")
        await echo_body(b"ok", send)

    async with running(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(request("/fail") + request("/after"))  # one write: parsed together
        status, _, _ = await read_response(reader)
        assert status == 500
        assert await closed(reader)
    assert paths == ["/fail"]


async def test_shutdown_cancels_a_pipelined_request_still_running_after_the_grace() -> None:
    ended = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/hang":
            try:
                await asyncio.sleep(30)
            finally:
                ended.set()
        await asyncio.sleep(0.05)  # the second request is parsed meanwhile: it waits its turn
        await echo_body(b"quick", send)

    async with running(app, grace_s=0.1) as (port, _):
        reader, writer = await connect(port)
        writer.write(request("/quick") + request("/hang"))  # the second starts from a task
        assert (await read_response(reader))[2] == b"quick"
        await asyncio.sleep(0.1)
    await asyncio.wait_for(ended.wait(), 5)


async def test_the_synchronous_send_writes_at_once_and_says_when_the_socket_is_full() -> None:
    told: list[bool] = []
    piece = b"x" * 65536

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        nowait = scope["extensions"][SEND_NOWAIT]
        assert nowait.__self__ is send.__self__  # the exchange's own
        told.append(nowait({"type": "http.response.start", "status": 200, "headers": []}))
        sent = 0
        while sent < 200:  # the client does not read yet: its socket fills up
            sent += 1
            if nowait({"type": "http.response.body", "body": piece, "more_body": True}):
                break
        told.append(sent < 200)
        await send({"type": "http.response.body", "body": b"", "more_body": True})  # drains
        await send({"type": "http.response.body", "body": b"end"})
        told.append(True)

    async with running(app) as (port, _):
        reader, writer = await connect(port)
        writer.write(request())
        await asyncio.sleep(0.3)  # (the kernel's buffers may take it all, and drain)
        assert told[:2] == [False, True]  # the start never waits; the full socket is told
        status, _, body = await asyncio.wait_for(read_response(reader), 10)
        assert status == 200
        assert body.endswith(b"end")
        assert len(body) % 65536 == 3  # every piece, whole, then the end
        assert told == [False, True, True]
