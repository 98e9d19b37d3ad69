"""The gateway's upstream HTTP/1.1 client, against scripted servers on real sockets.

Each server is a raw asyncio TCP server that answers with exactly the bytes a test
gives it, so framing, keep-alive and every way an answer can go wrong are exercised.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from envport.gateway.http1 import (
    ConnectError,
    Http1Pool,
    HTTPError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    Response,
    Timeouts,
)
from envport.serving import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head + content-length body); b"" when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    """Run ``handler(reader, writer, connection_number)`` for each connection."""
    state = Server()
    tasks: set[asyncio.Task[None]] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        writers.add(writer)
        try:
            await handler(reader, writer, state.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            writers.discard(writer)
            tasks.discard(task)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)  # a port of its own
    port = server.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        yield state
    finally:
        server.close()
        for writer in list(writers):
            writer.transport.abort()  # handlers waiting on a read see the end and return
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


def answering(*answers: bytes, state: list[Server] | None = None, close: bool = False) -> Handler:
    """A keep-alive handler that answers the n-th request on a connection with answers[n].

    Then it holds the connection until the client closes it, or with ``close`` closes it.
    """

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        for answer in answers:
            request = await read_request(reader)
            if not request:
                return
            writer.write(answer)
            await writer.drain()
        if not close:
            await reader.read()  # hold the connection open until the client closes it

    return handler


def json_answer(body: bytes, extra: bytes = b"") -> bytes:
    return JSON_HEAD + b"content-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


HEADERS = (("content-type", "application/json"),)


class Declining:
    """An early sink (``post(early=...)``) that takes no answer: the post must then
    behave exactly as without one. Notes each head it was offered."""

    def __init__(self) -> None:
        self.heads: list[int] = []

    def head(self, response: Response) -> bool:
        assert asyncio.current_task() is None  # from the read callback the head came in
        self.heads.append(response.status)
        return False

    def piece(self, data: bytes) -> None:
        raise AssertionError("never tapped")

    def end(self) -> None:
        raise AssertionError("never tapped")

    def fail(self, exc: HTTPError) -> None:
        raise AssertionError("never tapped")


@pytest.fixture(params=["no-sink", "declining-sink"])
def early(request: pytest.FixtureRequest) -> Declining | None:
    """Each test using it runs twice: without an early sink, and with one that declines
    every answer it is offered (the post must behave the same)."""
    return Declining() if request.param == "declining-sink" else None


async def test_content_length_answers_reuse_one_connection() -> None:
    async with serve(answering(json_answer(b'{"a":1}'), json_answer(b'{"b":2}'))) as srv:
        pool = Http1Pool()
        first = await pool.post(srv.url, b'{"x":1}', HEADERS)
        assert (first.status, first.headers["content-type"]) == (200, "application/json")
        assert await first.read() == b'{"a":1}'
        assert first.at_eof()
        second = await pool.post(srv.url, b"{}", HEADERS)
        assert await second.read() == b'{"b":2}'
        assert srv.connections == 1
        assert pool.idle_connections() == 1
        await pool.aclose()
        assert pool.idle_connections() == 0


async def test_the_request_carries_host_length_and_the_given_headers() -> None:
    seen: list[bytes] = []

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        seen.append(await read_request(reader))
        writer.write(json_answer(b"{}"))
        await reader.read()

    async with serve(handler) as srv:
        pool = Http1Pool()
        await (await pool.post(srv.url + "?q=1", b'{"k":"v"}', HEADERS)).read()
        await pool.aclose()
    head, _, body = seen[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions?q=1 HTTP/1.1"
    assert f"host: {srv.url.split('/')[2]}".encode() in lines
    assert b"content-type: application/json" in lines
    assert b"content-length: 9" in lines
    assert body == b'{"k":"v"}'


async def test_chunked_streams_arrive_piece_by_piece() -> None:
    go_on = asyncio.Event()

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6;ext=1\r\ndata: \r\n")
        await go_on.wait()  # the client must have the first piece before the rest exists
        writer.write(b"3\r\nabc\r\n0\r\nx-trailer: t\r\n\r\n")
        await reader.read()

    async with serve(handler) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        pieces = []
        async for piece in response.chunks():
            pieces.append(piece)
            go_on.set()
        assert pieces == [b"data: ", b"abc"]
        assert response.at_eof()
        assert pool.idle_connections() == 1  # trailers read: the connection is reusable
        await pool.aclose()


async def test_a_body_that_ends_with_the_connection_is_read_and_not_reused() -> None:
    async with serve(answering(b"HTTP/1.0 200 OK\r\n\r\nall of it", close=True)) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        assert await response.read() == b"all of it"
        assert pool.idle_connections() == 0
        await pool.aclose()


async def test_connection_close_is_honoured() -> None:
    async with serve(answering(json_answer(b"{}", b"connection: close\r\n"))) as srv:
        pool = Http1Pool()
        assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b"{}"
        assert pool.idle_connections() == 0
        await pool.aclose()


async def test_gzip_is_decoded_and_unknown_encodings_refused() -> None:
    packed = gzip.compress(b'{"ok":true}')
    answers = [
        JSON_HEAD
        + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(packed), packed),
        JSON_HEAD + b"content-encoding: br\r\ncontent-length: 2\r\n\r\nzz",
    ]
    async with serve(answering(*answers)) as srv:
        pool = Http1Pool()
        assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b'{"ok":true}'
        with pytest.raises(RemoteProtocolError, match="unsupported content-encoding 'br'"):
            await pool.post(srv.url, b"{}", HEADERS)
        await pool.aclose()


async def test_an_idle_connection_the_server_dropped_is_replaced_transparently(
    early: Declining | None,
) -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(json_answer(b'{"n":%d}' % number))
        await writer.drain()
        if number == 1:
            return  # closes after answering, without saying so: a keep-alive timeout

    async with serve(handler) as srv:
        pool = Http1Pool()
        assert await (await pool.post(srv.url, b"{}", HEADERS, early=early)).read() == b'{"n":1}'
        await asyncio.sleep(0.05)
        assert await (await pool.post(srv.url, b"{}", HEADERS, early=early)).read() == b'{"n":2}'
        assert srv.connections == 2
        await pool.aclose()


async def test_a_close_racing_the_request_on_a_reused_connection_is_retried_once(
    early: Declining | None,
) -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(json_answer(b'{"n":%d}' % number))
        await writer.drain()
        if number == 1:
            await read_request(reader)  # takes the second request, then drops it unanswered
            return
        await reader.read()

    async with serve(handler) as srv:
        pool = Http1Pool()
        writes: list[int] = []
        sent = functools.partial(writes.append, 1)
        first = await pool.post(srv.url, b"{}", HEADERS, early=early, sent=sent)
        assert await first.read() == b'{"n":1}'
        assert writes == [1]
        second = await pool.post(srv.url, b"{}", HEADERS, early=early, sent=sent)
        assert await second.read() == b'{"n":2}'
        assert writes == [1, 1, 1]  # told of each write: the first, and the one sent again
        assert srv.connections == 2
        await pool.aclose()


async def test_sent_is_told_once_the_request_is_written_and_a_failing_one_drops_it() -> None:
    async with serve(answering(json_answer(b"{}"), json_answer(b"{}"))) as srv:
        pool = Http1Pool()
        told: list[int] = []

        def sent() -> None:
            told.append(pool.idle_connections())

        response = await pool.post(srv.url, b"{}", HEADERS, sent=sent)
        assert told == [0]
        assert await response.read() == b"{}"
        assert pool.idle_connections() == 1
        # On a pooled connection the write, and so the call, come in the post's first
        # step: before it awaits anything.
        posting = asyncio.ensure_future(pool.post(srv.url, b"{}", HEADERS, sent=sent))
        await asyncio.sleep(0)
        assert told == [0, 0]  # the connection was taken from the pool when told
        assert not posting.done()
        assert await (await posting).read() == b"{}"

        def failing() -> None:
            raise RuntimeError("a bug in the caller's bookkeeping")

        with pytest.raises(RuntimeError, match="bookkeeping"):
            await pool.post(srv.url, b"{}", HEADERS, sent=failing)
        assert pool.idle_connections() == 0  # its answer is owed on it: not reused
        await pool.aclose()

    # no connection, nothing written: never told
    pool = Http1Pool(Timeouts(connect=1))
    with pytest.raises(ConnectError):
        await pool.post(f"http://127.0.0.1:{free_port()}/v1", b"{}", HEADERS, sent=sent)
    assert told == [0, 0]


async def test_no_answer_on_a_new_connection_is_an_error(early: Declining | None) -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)  # and close without a word

    async with serve(handler) as srv:
        pool = Http1Pool()
        with pytest.raises(RemoteProtocolError, match="no status line"):
            await pool.post(srv.url, b"{}", HEADERS, early=early)
        assert srv.connections == 1  # not retried: this was no stale connection
        await pool.aclose()


CHUNKED_START = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (JSON_HEAD + b"content-length: 100\r\n\r\n0123456789", "10 of 100 body bytes"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nabc", "in a chunk"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        # int(..., 16) takes these; a chunk size is hex digits only (-6 looped forever)
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-6\r\n0\r\n\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x3\r\nabc\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n+3\r\nabc\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1_0\r\nabc\r\n", "chunk size"),
        (CHUNKED_START + b"1" * 17 + b"\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcde\r\n", "CRLF"),
    ],
)
async def test_a_body_cut_short_or_malformed_is_an_error(answer: bytes, message: str) -> None:
    async with serve(answering(answer, close=True)) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        with pytest.raises(RemoteProtocolError, match=message):
            await response.read()
        assert pool.idle_connections() == 0
        await pool.aclose()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2\xb2\xb3 OK\r\n\r\n", "not an HTTP/1.x status line"),  # not ASCII digits
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (JSON_HEAD + b"content-length: lots\r\n\r\n", "invalid content-length"),
        (JSON_HEAD + b"content-length: -5\r\n\r\n", "invalid content-length"),
        (JSON_HEAD + b"content-length: +5\r\n\r\n", "invalid content-length"),
        (b"HTTP/1.1 200 OK\r\ncontent-le", "headers cut short"),
    ],
)
async def test_an_answer_that_is_not_http_is_an_error(
    answer: bytes, message: str, early: Declining | None
) -> None:
    async with serve(answering(answer, close=True)) as srv:
        pool = Http1Pool()
        with pytest.raises(RemoteProtocolError, match=message):
            await pool.post(srv.url, b"{}", HEADERS, early=early)
        await pool.aclose()


async def test_informational_answers_are_skipped(early: Declining | None) -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + json_answer(b"{}")
    async with serve(answering(answer)) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS, early=early)
        assert response.status == 200
        assert await response.read() == b"{}"
        if early is not None:
            assert early.heads == [200]  # the 100 was never offered
        await pool.aclose()


async def test_errors_and_no_body_statuses(early: Declining | None) -> None:
    answers = [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        (JSON_HEAD + b"content-length: 2\r\nretry-after: 3\r\n\r\n{}").replace(b"200 OK", b"503 X"),
    ]
    async with serve(answering(*answers)) as srv:
        pool = Http1Pool()
        empty = await pool.post(srv.url, b"{}", HEADERS, early=early)
        assert (empty.status, empty.at_eof()) == (204, True)
        assert await empty.read() == b""
        busy = await pool.post(srv.url, b"{}", HEADERS, early=early)
        assert (busy.status, busy.headers["retry-after"]) == (503, "3")
        assert await busy.read() == b"{}"
        assert srv.connections == 1
        if early is not None:
            assert early.heads == [204, 503]
        await pool.aclose()


async def test_connect_errors_and_timeouts(early: Declining | None) -> None:
    pool = Http1Pool(Timeouts(connect=5, read=0.2))
    with pytest.raises(ConnectError, match="cannot connect"):
        await pool.post(f"http://127.0.0.1:{free_port()}/v1", b"{}", HEADERS)
    with pytest.raises(ConnectError, match="not an http"):
        await pool.post("ftp://example.invalid/x", b"{}", HEADERS, early=early)

    async def silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        await reader.read()

    async with serve(silent) as srv:
        with pytest.raises(ReadTimeout, match="read timeout"):
            await pool.post(srv.url, b"{}", HEADERS, early=early)
        assert isinstance(ReadTimeout(), TimeoutError)
    await pool.aclose()
    with pytest.raises(ConnectError, match="closed"):
        await pool.post("http://127.0.0.1:1/v1", b"{}", HEADERS, early=early)


async def test_https_to_a_plain_server_fails_to_connect() -> None:
    async def plain(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    async with serve(plain) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        with pytest.raises(ConnectError):
            await pool.post(srv.url.replace("http://", "https://"), b"{}", HEADERS)
        await pool.aclose()


async def test_a_reader_may_stop_early_and_drain_the_rest_for_reuse() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n1\r\nb\r\n0\r\n\r\n"
    sized = JSON_HEAD + b"content-length: 6\r\n\r\n"

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(chunked)
        await read_request(reader)
        writer.write(sized + b"abc")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"def")
        await read_request(reader)
        writer.write(json_answer(b"{}"))
        await reader.read()

    async with serve(handler) as srv:
        pool = Http1Pool()
        for expected in (b"a", b"abc"):
            response = await pool.post(srv.url, b"{}", HEADERS)
            async for piece in response.chunks():
                assert piece == expected
                break  # stop after the first piece, as the relay does after [DONE]
            assert not response.at_eof()
            await response.drain(5)
            assert response.at_eof()
        assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b"{}"
        assert srv.connections == 1  # every answer on the one connection
        await pool.aclose()


async def test_a_body_whose_end_came_with_the_last_piece_is_done_without_another_read() -> None:
    # The relay stops at [DONE]; when the end of the chunked body came in the same read
    # (the usual case), draining needs no read and no timer: the connection goes back.
    body = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n4\r\nb\n\nc\r\n0\r\n\r\n"
    )

    async with serve(answering(body, json_answer(b"{}"))) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        async for piece in response.chunks(batch=True):
            assert piece == b"ab\n\nc"
            break  # stop at the last piece, as the relay does after [DONE]
        assert not response.at_eof()
        await response.drain(0)  # no time to read: none is needed
        assert response.at_eof()
        assert pool.idle_connections() == 1
        assert [p async for p in response.chunks(batch=True)] == []
        assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b"{}"
        assert srv.connections == 1
        await pool.aclose()


async def test_a_drain_that_takes_too_long_closes_the_connection() -> None:
    # the rest never comes
    async with serve(
        answering(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
    ) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        async for _ in response.chunks():
            break
        await response.drain(0.1)
        assert not response.at_eof()
        assert pool.idle_connections() == 0
        with pytest.raises(ReadError, match="closed before its body was read"):
            await response.read()
        await pool.aclose()


async def test_batched_chunks_come_as_one_piece_per_read_and_the_rest_stays_readable() -> None:
    first = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n2\r\nbc\r\n3\r\nde"
    go_on = asyncio.Event()

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(first)  # two whole chunks and part of a third
        await go_on.wait()
        writer.write(b"f\r\n1\r\ng\r\n0\r\nx-trail")  # the end, trailer split across reads
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"er: t\r\n\r\n")
        await read_request(reader)
        writer.write(json_answer(b"{}"))
        await reader.read()

    async with serve(handler) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        async for piece in response.chunks(batch=True):
            assert piece == b"abc"  # the complete chunks of the read, nothing of the third
            break  # stop early; what was read past this piece is kept
        go_on.set()
        assert [p async for p in response.chunks(batch=True)] == [b"defg"]
        assert response.at_eof()
        assert pool.idle_connections() == 1
        assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b"{}"
        assert srv.connections == 1
        await pool.aclose()


async def test_unbatched_chunks_read_together_still_come_one_piece_each() -> None:
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n2\r\nbc\r\n0\r\n\r\n"

    async with serve(answering(answer)) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        assert [p async for p in response.chunks()] == [b"a", b"bc"]
        assert pool.idle_connections() == 1
        await pool.aclose()


async def test_an_endless_chunk_size_line_is_an_error() -> None:
    async with serve(
        answering(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"1" * 70000)
    ) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        with pytest.raises(RemoteProtocolError, match="chunk header line is too long"):
            await response.read()
        assert pool.idle_connections() == 0
        await pool.aclose()


@pytest.mark.parametrize("batch", [True, False])
async def test_a_chunked_body_that_stalls_is_a_read_timeout(batch: bool) -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"1\r\nb\r\n")  # keeps coming, each read well within the timeout
        await reader.read()  # then nothing more

    async with serve(handler) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=0.5))
        response = await pool.post(srv.url, b"{}", HEADERS)
        pieces: list[bytes] = []

        async def collect() -> None:
            async for piece in response.chunks(batch=batch):
                pieces.append(piece)

        with pytest.raises(ReadTimeout, match="read timeout"):
            await collect()
        assert pieces == [b"a", b"b"]
        assert pool.idle_connections() == 0
        await pool.aclose()


async def test_time_between_reads_does_not_count_against_the_read_timeout() -> None:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"a", b"b", b"c"):
            writer.write(b"1\r\n" + part + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await reader.read()

    async with serve(handler) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=0.4))
        response = await pool.post(srv.url, b"{}", HEADERS)
        pieces = []
        async for piece in response.chunks(batch=True):
            pieces.append(piece)
            await asyncio.sleep(0.6)  # a slow reader: longer than the read timeout per piece
        assert b"".join(pieces) == b"abc"
        assert response.at_eof()
        await pool.aclose()


async def test_cancelling_a_reader_mid_body_is_a_cancellation_not_a_timeout() -> None:
    async with serve(
        answering(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
    ) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=0.2))
        response = await pool.post(srv.url, b"{}", HEADERS)
        got = asyncio.Event()

        async def consume() -> None:
            async for _ in response.chunks(batch=True):
                got.set()

        task = asyncio.ensure_future(consume())
        await got.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # past the read timeout: no stray timer fires
        assert pool.idle_connections() == 0
        await pool.aclose()


async def test_a_request_deadline_caps_the_wait_for_headers_and_the_body(
    early: Declining | None,
) -> None:
    # One timer keeps both the read timeout and the request's deadline (the gateway's
    # budget for a call): a server slower than the deadline but never idle longer than
    # the read timeout is still cut at the deadline, for the headers as for the body.
    async def silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        await reader.read()

    async def trickling(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        writer.write(JSON_HEAD + b"content-length: 100\r\n\r\n")
        for _ in range(100):  # a byte every 50 ms: within the read timeout each time
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.05)

    loop = asyncio.get_running_loop()
    pool = Http1Pool(Timeouts(connect=5, read=10))
    async with serve(silent) as srv:
        t0 = loop.time()
        with pytest.raises(ReadTimeout, match="deadline"):
            await pool.post(srv.url, b"{}", HEADERS, deadline=t0 + 0.2, early=early)
        assert loop.time() - t0 < 5
    async with serve(trickling) as srv:
        t0 = loop.time()
        response = await pool.post(srv.url, b"{}", HEADERS, deadline=t0 + 0.3, early=early)
        with pytest.raises(ReadTimeout, match="deadline"):
            await response.read(deadline=t0 + 0.3)
        assert loop.time() - t0 < 5
        assert pool.idle_connections() == 0  # a body cut short: its connection is dropped
    await pool.aclose()


async def test_a_cancelled_post_is_a_cancellation_and_leaves_no_timer(
    early: Declining | None,
) -> None:
    async def silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        await reader.read()

    pool = Http1Pool(Timeouts(connect=5, read=0.2))
    async with serve(silent) as srv:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.call_later(0.05, task.cancel)
        with pytest.raises(asyncio.CancelledError):
            await pool.post(srv.url, b"{}", HEADERS, deadline=loop.time() + 0.3, early=early)
        task.uncancel()
        await asyncio.sleep(0.4)  # past the read timeout and the deadline: no timer fires
        assert pool.idle_connections() == 0
    await pool.aclose()


async def test_ready_tells_whether_body_bytes_are_waiting_to_be_read() -> None:
    go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")  # head alone
        await go.wait()
        writer.write(b"2\r\nab\r\n0\r\n\r\n")
        await reader.read()  # hold the connection until the client closes it

    async with serve(handler) as srv:
        pool = Http1Pool()
        response = await pool.post(srv.url, b"{}", HEADERS)
        assert not response.ready()  # the body has not started: a read would wait
        go.set()
        for _ in range(200):
            if response.ready():
                break
            await asyncio.sleep(0.005)
        assert response.ready()
        assert [p async for p in response.chunks(batch=True)] == [b"ab"]
        assert response.at_eof()
        assert response.ready()  # at the end: a read returns at once
        await pool.aclose()


# --- tapping: the body from the connection's read callback ----------------------------------


class Sink:
    """Records what a tapped body hands over; ``over`` resolves at end() or fail()."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.over: asyncio.Future[HTTPError | None] = asyncio.get_running_loop().create_future()
        self.calls = 0  # end() and fail() together

    def piece(self, data: bytes) -> None:
        assert not self.over.done()
        self.pieces.append(data)

    def end(self) -> None:
        self.calls += 1
        self.over.set_result(None)

    def fail(self, exc: HTTPError) -> None:
        self.calls += 1
        self.over.set_result(exc)


def scripted(*parts: bytes, gap_s: float = 0.05, then: str = "hold") -> Handler:
    """Answers the first request with ``parts``, ``gap_s`` apart; ``then`` "hold" keeps
    the connection (and answers later requests with a small JSON body), "close" closes
    it, "reset" aborts it."""

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(gap_s)
            writer.write(part)
            await writer.drain()
        if then == "reset":
            writer.transport.abort()
        elif then == "hold":
            while await read_request(reader):
                writer.write(json_answer(b"{}"))
                await writer.drain()

    return handler


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_a_tapped_body_is_handed_over_as_it_arrives_and_the_connection_reused() -> None:
    parts = (CHUNKED_HEAD + b"3\r\nabc\r\n", b"2\r\nde\r\n1\r\nf\r\n", b"0\r\n\r\n")
    async with serve(scripted(*parts)) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        response = await pool.post(srv.url, b"{}", HEADERS)
        await asyncio.sleep(0.01)  # the first chunk came with the head, or just after
        sink = Sink()
        assert response.tap(sink)
        assert sink.pieces == [b"abc"]  # what had arrived is handed over at once
        assert await asyncio.wait_for(sink.over, 5) is None
        assert sink.pieces == [b"abc", b"def"]  # one piece per read: its chunks joined
        assert response.at_eof()
        assert pool.idle_connections() == 1
        again = await pool.post(srv.url, b"{}", HEADERS)
        assert await again.read() == b"{}"
        assert srv.connections == 1
        await asyncio.sleep(0.1)
        assert sink.calls == 1
        await pool.aclose()


@pytest.mark.parametrize(
    ("parts", "then", "error", "message"),
    [
        ((CHUNKED_HEAD, b"3\r\nabc\r\nzz\r\n"), "hold", RemoteProtocolError, "chunk size"),
        ((CHUNKED_HEAD, b"3\r\nabc\r\n-6\r\n"), "hold", RemoteProtocolError, "chunk size"),
        ((CHUNKED_HEAD, b"3\r\nabc\r\n1\r\nxyz"), "hold", RemoteProtocolError, "CRLF"),
        ((CHUNKED_HEAD, b"3\r\nabc\r\n5\r\nab"), "close", RemoteProtocolError, "in a chunk"),
        ((CHUNKED_HEAD, b"3\r\nabc\r\n"), "reset", HTTPError, ""),
        ((CHUNKED_HEAD, b"3\r\nabc\r\n"), "hold", ReadTimeout, "read timeout"),
    ],
    ids=["malformed", "negative", "no-crlf", "cut", "reset", "stalled"],
)
async def test_a_tapped_body_that_fails_is_told_once_and_its_connection_dropped(
    parts: tuple[bytes, ...], then: str, error: type[HTTPError], message: str
) -> None:
    async with serve(scripted(*parts, then=then)) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=0.3))
        response = await pool.post(srv.url, b"{}", HEADERS)
        sink = Sink()
        assert response.tap(sink)
        failure = await asyncio.wait_for(sink.over, 5)
        assert isinstance(failure, error)
        assert message in str(failure)
        assert sink.pieces == [b"abc"]  # what came before the failure was handed over
        await asyncio.sleep(0.5)  # past another read timeout: nothing more is told
        assert sink.calls == 1
        assert pool.idle_connections() == 0
        await pool.aclose()


async def test_a_server_closing_after_the_last_chunk_ends_a_tapped_body() -> None:
    async with serve(scripted(CHUNKED_HEAD + b"3\r\nabc\r\n", b"0\r\n", then="close")) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        response = await pool.post(srv.url, b"{}", HEADERS)
        sink = Sink()
        assert response.tap(sink)
        assert await asyncio.wait_for(sink.over, 5) is None
        assert b"".join(sink.pieces) == b"abc"
        assert pool.idle_connections() == 0  # closed by the server: not kept
        await pool.aclose()


async def test_a_paused_tap_reads_nothing_and_the_rest_can_be_read_after_untap() -> None:
    parts = (CHUNKED_HEAD + b"1\r\na\r\n", b"1\r\nb\r\n", b"1\r\nc\r\n0\r\n\r\n")
    async with serve(scripted(*parts, gap_s=0.1)) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=0.3))
        response = await pool.post(srv.url, b"{}", HEADERS)
        await asyncio.sleep(0.02)
        sink = Sink()
        assert response.tap(sink)
        assert sink.pieces == [b"a"]
        response.pause()
        await asyncio.sleep(0.5)  # the rest arrives meanwhile; paused, no read timeout
        assert sink.pieces == [b"a"]
        assert not sink.over.done()
        response.untap()  # reading goes on without the tap
        rest = [piece async for piece in response.chunks(batch=True)]
        assert b"".join(rest) == b"bc"
        assert sink.pieces == [b"a"]
        assert not sink.over.done()
        assert pool.idle_connections() == 1
        await pool.aclose()


async def test_only_a_plain_chunked_body_can_be_tapped() -> None:
    gzipped = gzip.compress(b"abc")
    answers = (
        json_answer(b"{}"),
        CHUNKED_HEAD[:-2]
        + b"content-encoding: gzip\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(gzipped), gzipped),
    )
    async with serve(answering(*answers)) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        for expected in (b"{}", b"abc"):
            response = await pool.post(srv.url, b"{}", HEADERS)
            assert not response.tap(Sink())
            assert await response.read() == expected  # read as usual instead
        await pool.aclose()


class Early(Sink):
    """An early sink that takes what ``accept`` says (and notes when it was offered)."""

    def __init__(self, accept: bool = True, on_head: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.accept = accept
        self.on_head = on_head
        self.offered: list[tuple[int, bool]] = []  # (status, from inside a task)

    def head(self, response: Response) -> bool:
        self.offered.append((response.status, asyncio.current_task() is not None))
        if self.on_head is not None:
            self.on_head()
        return self.accept and response.tappable()


async def test_an_early_sink_takes_the_body_from_the_read_callback_the_head_came_in() -> None:
    parts = (CHUNKED_HEAD + b"3\r\nabc\r\n", b"2\r\nde\r\n", b"0\r\n\r\n")
    async with serve(scripted(*parts)) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        sink = Early()
        response = await pool.post(srv.url, b"{}", HEADERS, early=sink)
        # Offered from the read callback (no task), and the bytes that came with the
        # head were handed over there too, before the awaiting task woke up.
        assert sink.offered == [(200, False)]
        assert response.tapped
        assert sink.pieces == [b"abc"]
        assert await asyncio.wait_for(sink.over, 5) is None
        assert sink.pieces == [b"abc", b"de"]
        assert pool.idle_connections() == 1  # read to its end: kept
        assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b"{}"
        assert srv.connections == 1
        await pool.aclose()


async def test_an_early_sink_that_declines_leaves_the_answer_to_be_read() -> None:
    answer = CHUNKED_HEAD.replace(b"200 OK", b"503 Busy") + b"2\r\n{}\r\n0\r\n\r\n"
    async with serve(answering(answer)) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        sink = Early(accept=False)
        response = await pool.post(srv.url, b"{}", HEADERS, early=sink)
        assert sink.offered == [(503, False)]
        assert not response.tapped
        assert await response.read() == b"{}"
        assert sink.pieces == []
        await pool.aclose()


@pytest.mark.parametrize("whole", [False, True], ids=["body-to-come", "whole-answer"])
async def test_a_post_cancelled_as_its_answer_arrives_drops_the_answer(whole: bool) -> None:
    # The answer came (and was tapped) but the awaiting task was cancelled before it woke:
    # the cancellation stands and the answer is dropped: its connection closed, unless
    # the whole answer came and the connection is back in the pool already (left open).
    answer = CHUNKED_HEAD + b"3\r\nabc\r\n" + (b"0\r\n\r\n" if whole else b"")
    async with serve(scripted(answer)) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        sink = Early(on_head=lambda: loop.call_soon(task.cancel))
        with pytest.raises(asyncio.CancelledError):
            await pool.post(srv.url, b"{}", HEADERS, early=sink)
        task.uncancel()
        assert sink.pieces == [b"abc"]
        assert pool.idle_connections() == (1 if whole else 0)
        await asyncio.sleep(0.05)
        assert sink.calls == (1 if whole else 0)  # dropped: no failure told to the sink
        if whole:  # the connection left open serves the next request
            assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b"{}"
            assert srv.connections == 1
        await pool.aclose()


async def test_a_connection_given_back_from_the_read_callback_serves_the_next_request() -> None:
    # The whole answer came with its head: it is read, and its connection back in the
    # pool, from that read callback. Another request may take the connection before the
    # first one's task wakes; the first one must leave it alone.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + b"3\r\nabc\r\n0\r\n\r\n")
        while await read_request(reader):
            writer.write(json_answer(b'{"second":1}'))

    async with serve(handler) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        class Ending(Early):
            def end(self) -> None:
                super().end()
                ended.set_result(None)  # wakes the second request before the first

        async def second() -> bytes:
            await ended
            return await (await pool.post(srv.url, b"{}", HEADERS)).read()

        other = asyncio.create_task(second())
        await asyncio.sleep(0)
        sink = Ending()
        first = await pool.post(srv.url, b"{}", HEADERS, early=sink)
        assert first.at_eof()
        assert sink.pieces == [b"abc"]
        assert await asyncio.wait_for(other, 3) == b'{"second":1}'
        assert srv.connections == 1
        await pool.aclose()


async def test_a_sink_that_fails_as_the_answer_ends_drops_it_and_keeps_the_pool_sound() -> None:
    class Failing(Early):
        def end(self) -> None:
            raise RuntimeError("a sink bug")

    async with serve(scripted(CHUNKED_HEAD + b"3\r\nabc\r\n0\r\n\r\n")) as srv:
        pool = Http1Pool(Timeouts(connect=5, read=5))
        with pytest.raises(RuntimeError, match="a sink bug"):
            await pool.post(srv.url, b"{}", HEADERS, early=Failing())
        # The answer had put its connection back before the sink failed: it stays pooled
        # and sound (not closed under whoever takes it next).
        assert pool.idle_connections() == 1
        assert await (await pool.post(srv.url, b"{}", HEADERS)).read() == b"{}"
        assert srv.connections == 1
        await pool.aclose()
