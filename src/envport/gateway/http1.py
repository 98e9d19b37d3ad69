"""A lean HTTP/1.1 client for the gateway's one upstream hop: POST, keep-alive, streaming.

The gateway's added latency is mostly the CPU it spends per call, and most of that was
the upstream client: on the benchmark machine one call through ``httpx.AsyncClient``
cost about 1.4 ms of CPU and through an ``aiohttp.ClientSession`` about 0.3 ms, where
this client (asyncio streams, one write per request, headers parsed once, nothing
else) costs under 0.1 ms (``bench/GATEWAY_RESULTS.md``). Everything a general client
does beyond that (cookies, redirects, proxies, auth flows, request building hooks) the
gateway never needs.

What it speaks is what an OpenAI-compatible server answers: a status line and headers,
then a body framed by ``Content-Length``, by chunked transfer encoding, or by the end
of the connection; ``gzip``/``deflate`` bodies are decoded (the gateway asks for
``identity``, but a server may compress anyway); ``http`` and ``https``. No HTTP/2, no
proxies, no redirects (a 3xx is an answer like any other).

**Tapping** (:meth:`Response.tap`): a chunked body can be handed to a sink from the
connection's own read callback instead of being awaited piece by piece, so a relay does
no task switch per read (the gateway's streams); the sink can pause reading. An
answer's head is parsed in the read callback it arrives in, and the task awaiting it
woken with the parsed answer; an :class:`EarlySink` given to :meth:`Http1Pool.post` is
offered the answer there and may take its body from there on, before that task has
even woken (a relay's first bytes go out with no task switch at all).

**Connections** are kept alive per ``(scheme, host, port)`` and reused when a response
was read to its end and the server did not ask to close. A pooled connection the server
closed while it sat idle is noticed before use; if the server closes it just as a request
is sent (nothing of an answer received), the request is sent once more on a new
connection, as every keep-alive client does.

**Errors** (all :class:`HTTPError`): :class:`ConnectError`, :class:`ConnectTimeout`,
:class:`ReadTimeout`, :class:`ReadError` (the connection failed while reading), and
:class:`RemoteProtocolError` (an answer cut short or not HTTP). The timeouts are also
``TimeoutError``. The names are httpx's, so recorded errors read as they did.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl as ssl_module
import zlib
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

# --- errors -------------------------------------------------------------------------------


class HTTPError(Exception):
    """The upstream could not be reached, or its answer could not be read."""


class ConnectError(HTTPError):
    """No connection (refused, unreachable, name not resolved, TLS handshake failed)."""


class ConnectTimeout(HTTPError, TimeoutError):
    """No connection within the connect timeout."""


class ReadTimeout(HTTPError, TimeoutError):
    """Nothing arrived for the read timeout (waiting for the answer or its next bytes)."""


class ReadError(HTTPError):
    """The connection failed while the answer was being read or the request written."""


class RemoteProtocolError(HTTPError):
    """The answer was cut short or is not HTTP/1.x."""


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds to connect, and to wait for the next bytes of an answer (None: forever)."""

    connect: float | None = 10.0
    read: float | None = 600.0


_NO_BODY = frozenset({204, 304})
_READER_LIMIT = 1 << 16  # asyncio's default stream reader limit
_CUT = "the server closed the connection before the answer was complete"


# --- connections ----------------------------------------------------------------------------


class _ReadDeadline:
    """A read timeout for a whole answer that sets no timer per read.

    Each read notes its deadline (:meth:`arm`) and clears it when it returns
    (:meth:`disarm`); one timer, moved on only when it fires early, cancels the reading
    task when a read has waited past its deadline, and :meth:`expired` turns that
    cancellation into :class:`TimeoutError`. Time spent between reads (the reader
    passing a piece on) does not count, as with a timeout around each read.

    ``until`` (loop time) caps every read's deadline: the whole request's deadline (the
    gateway's budget for a call), kept by the same timer, so a call needs no timeout
    scope of its own; :attr:`capped` tells which of the two ran out.
    """

    __slots__ = (
        "_cancelling",
        "_deadline",
        "_fired",
        "_handle",
        "_loop",
        "_task",
        "capped",
        "timeout",
        "until",
    )

    def __init__(self, timeout: float | None, until: float | None = None) -> None:
        self.timeout = timeout  # None: no timeout
        self.until = until  # None: no cap
        self.capped = False  # the cap, not the read timeout, ran out
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[Any] | None = None
        self._deadline: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False
        self._cancelling = 0

    def arm(self) -> None:
        """A read starts now."""
        until = self.until
        if self.timeout is None:
            if until is None:
                return
            deadline = until
        else:
            deadline = self._loop.time() + self.timeout
            if until is not None and until < deadline:
                deadline = until
        self._task = task = asyncio.current_task()
        assert task is not None
        self._cancelling = task.cancelling()
        self._deadline = deadline
        if self._handle is None:
            self._handle = self._loop.call_at(deadline, self._check)

    def disarm(self) -> None:
        """The read returned."""
        self._deadline = None

    def expired(self) -> bool:
        """After a read was cancelled: whether this deadline did it (then the
        cancellation is taken back, and the caller raises TimeoutError)."""
        if not self._fired:
            return False
        self._fired = False
        assert self._task is not None
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        self._handle = None
        deadline = self._deadline
        if deadline is None or self._task is None:
            return  # not reading; the next read sets the timer again
        if self._loop.time() < deadline:
            self._handle = self._loop.call_at(deadline, self._check)
            return
        self._fired = True
        self.capped = deadline == self.until
        self._task.cancel()

    async def read(self, reader: asyncio.StreamReader, n: int) -> bytes:
        """``reader.read(n)`` under this deadline (TimeoutError when it runs out)."""
        self.arm()
        try:
            return await reader.read(n)
        except asyncio.CancelledError:
            if self.expired():
                raise TimeoutError from None
            raise
        finally:
            self.disarm()


class _Protocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, whose incoming bytes a :class:`Response` can tap
    (:meth:`Response.tap`): while it does, they go straight to it from the event loop's
    read callback instead of into the stream reader, and no task wakes up per read."""

    tap: Response | None = None
    head_hook: Callable[[], None] | None = None  # an answer's head is awaited

    def __init__(self, reader: asyncio.StreamReader, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, loop=loop)
        self.reader = reader  # fed directly (the base class holds it by a weak reference)

    def data_received(self, data: bytes) -> None:
        tap = self.tap
        if tap is None:
            self.reader.feed_data(data)
            if self.head_hook is not None:
                self.head_hook()
        else:
            tap._tapped(data)

    def eof_received(self) -> bool:
        keep_open = bool(super().eof_received())  # the reader knows first: not reusable
        if self.tap is not None:
            self.tap._tapped_end(None)
        elif self.head_hook is not None:
            self.head_hook()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.tap is not None:
            self.tap._tapped_end(exc)
        elif self.head_hook is not None:
            self.head_hook()


class _Connection:
    __slots__ = ("key", "protocol", "reader", "transport", "writer")

    def __init__(
        self,
        key: tuple[str, str, int],
        transport: asyncio.Transport,
        protocol: _Protocol,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.key = key
        self.transport = transport
        self.protocol = protocol
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


@dataclasses.dataclass(frozen=True)
class _Target:
    key: tuple[str, str, int]
    head: bytes  # request line and fixed headers, up to (not including) content-length


class Http1Pool:
    """Keep-alive HTTP/1.1 connections and :meth:`post` over them.

    >>> pool = Http1Pool(Timeouts(connect=5, read=600))  # doctest: +SKIP
    >>> response = await pool.post("http://127.0.0.1:8000/v1/chat/completions", body,
    ...                            (("content-type", "application/json"),))
    >>> data = await response.read()  # or: async for piece in response.chunks(): ...
    """

    def __init__(
        self,
        timeouts: Timeouts | None = None,
        *,
        max_idle_per_host: int = 1024,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.timeouts = timeouts or Timeouts()
        self.max_idle_per_host = max_idle_per_host
        self._ssl = ssl
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[tuple[str, tuple[tuple[str, str], ...]], _Target] = {}
        self.closed = False

    # --- pool -------------------------------------------------------------------------

    def _target(self, url: str, headers: tuple[tuple[str, str], ...]) -> _Target:
        cached = self._targets.get((url, headers))
        if cached is not None:
            return cached
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConnectError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        default = (parts.scheme == "http" and port == 80) or (
            parts.scheme == "https" and port == 443
        )
        host = parts.hostname
        authority = host if default else f"{host}:{port}"
        if ":" in host:  # IPv6 literal
            authority = f"[{host}]" if default else f"[{host}]:{port}"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {path} HTTP/1.1", f"host: {authority}"]
        lines += [f"{name}: {value}" for name, value in headers]
        target = _Target((parts.scheme, host, port), ("\r\n".join(lines) + "\r\n").encode())
        if len(self._targets) < 1024:
            self._targets[(url, headers)] = target
        return target

    async def _connect(self, key: tuple[str, str, int], deadline: float | None) -> _Connection:
        scheme, host, port = key
        context: ssl_module.SSLContext | None = None
        if scheme == "https":
            context = self._ssl or ssl_module.create_default_context()
        until = None
        if self.timeouts.connect is not None:
            until = asyncio.get_running_loop().time() + self.timeouts.connect
        if deadline is not None and (until is None or deadline < until):
            until = deadline
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_READER_LIMIT, loop=loop)
        protocol = _Protocol(reader, loop)
        try:
            async with asyncio.timeout_at(until):
                # what asyncio.open_connection does, with a protocol that can be tapped
                transport, _ = await loop.create_connection(
                    lambda: protocol,
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context else None,
                )
        except TimeoutError as exc:
            if until is not None and until == deadline:
                raise ConnectTimeout(
                    f"no connection to {host}:{port} before the request's deadline"
                ) from exc
            raise ConnectTimeout(
                f"no connection to {host}:{port} within {self.timeouts.connect:g} s"
            ) from exc
        except (OSError, ssl_module.SSLError) as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        return _Connection(key, transport, protocol, reader, writer)

    def _checkout(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    def _checkin(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if self.closed or len(idle) >= self.max_idle_per_host or not conn.usable():
            conn.close()
        else:
            idle.append(conn)

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def aclose(self) -> None:
        """Close every idle connection; connections of open responses close with them."""
        self.closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # --- requests ---------------------------------------------------------------------

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Sequence[tuple[str, str]],
        *,
        deadline: float | None = None,
        early: EarlySink | None = None,
        sent: Callable[[], object] | None = None,
    ) -> Response:
        """POST ``body``; returns once the status line and headers arrived.

        ``deadline`` (event-loop time) caps the whole request: connecting, waiting for
        the answer and, for :meth:`Response.read`, its body; past it, :class:`ReadTimeout`
        (or :class:`ConnectTimeout`). One timer keeps it and the read timeout together.

        ``early`` is offered the answer from the read callback its head arrived in
        (:meth:`EarlySink.head`); if it takes it, the body is tapped to it from there
        and the returned response is that tapped one.

        ``sent`` is called each time the request has been written (again if it is sent
        once more on a new connection), before anything is awaited: a caller's
        bookkeeping goes there, done while upstream already works on the request instead
        of before upstream has it.
        """
        if self.closed:
            raise ConnectError("the HTTP client is closed")
        target = self._target(url, tuple(headers))
        request = b"%scontent-length: %d\r\n\r\n%s" % (target.head, len(body), body)
        conn = self._checkout(target.key)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(target.key, deadline)
            try:
                conn.writer.write(request)
                if sent is not None:
                    sent()
            except BaseException:
                conn.close()
                raise
            try:
                return await self._answer(conn, deadline, early)  # closes conn if it fails
            except _Stale:
                if not reused:
                    raise RemoteProtocolError(f"{_CUT} (no status line received)") from None
                conn, reused = None, False  # the server dropped an idle connection: once more

    async def _answer(
        self, conn: _Connection, deadline: float | None, early: EarlySink | None
    ) -> Response:
        """The answer to the request just sent on ``conn``: its head is parsed in the read
        callback it arrives in (offered to ``early`` there, see :meth:`post`), and this
        task woken with it. If no answer comes (an error, a timeout, a cancellation), the
        connection is closed; an answer that came owns it (it may even be back in the
        pool, its body read in that callback, and serving another request already)."""
        reader, protocol = conn.reader, conn.protocol
        answered: asyncio.Future[Response] = reader._loop.create_future()  # type: ignore[attr-defined]
        built = False  # an answer came: it owns the connection from then on

        def hook() -> None:
            nonlocal built
            if answered.done():
                return
            response: Response | None = None
            try:
                response = self._head_from(conn)
                if response is None:
                    return  # not all of the head yet
                built = True
                if early is not None and early.head(response):
                    response.tap(early)  # what came with the head goes to the sink now
            except BaseException as exc:
                if response is not None:  # the sink failed (a bug): drop the answer
                    response.close()
                if not answered.done():
                    answered.set_exception(exc)
            else:
                if answered.done():  # the wait was cancelled meanwhile (by the sink?)
                    response.close()
                else:
                    answered.set_result(response)
            if protocol.head_hook is hook:
                protocol.head_hook = None

        protocol.head_hook = hook
        timer = _ReadDeadline(self.timeouts.read, deadline)
        try:
            hook()  # what arrived already
            timer.arm()
            try:
                return await answered
            except asyncio.CancelledError:
                expired = timer.expired()
                response = _answer_in(answered)
                if response is not None:
                    # the answer came (and may be relayed already): it is the answer,
                    # whatever cancelled this wait; a cancellation from outside stands
                    if expired:
                        return response
                    response.close()
                    raise
                if not expired:
                    raise
                if timer.capped:
                    raise ReadTimeout("no answer before the request's deadline") from None
                raise ReadTimeout(
                    f"no answer within the read timeout ({self.timeouts.read:g} s)"
                ) from None
            finally:
                timer.disarm()
        except BaseException:
            if not built:
                conn.close()
            raise
        finally:
            if protocol.head_hook is hook:  # (another request may have the connection now)
                protocol.head_hook = None
            timer.close()

    def _head_from(self, conn: _Connection) -> Response | None:
        """The answer whose head is in the reader's buffer (its bytes taken out), None
        if the head is not complete yet. 1xx answers are skipped. A connection that
        ended before any byte of an answer raises :class:`_Stale` (the server had closed
        it: the request is sent again on a new one); one that ended during the head, or
        a bad head, raises :class:`RemoteProtocolError` or :class:`ReadError`."""
        reader = conn.reader
        buf: bytearray = reader._buffer  # type: ignore[attr-defined]
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _READER_LIMIT:
                    raise RemoteProtocolError("the answer's headers are too large")
                exc = reader.exception()
                if exc is not None:
                    if isinstance(exc, ConnectionResetError | BrokenPipeError) and not buf:
                        raise _Stale from exc
                    raise ReadError(f"reading the answer failed: {exc}") from exc
                if reader._eof:  # type: ignore[attr-defined]
                    if not buf:
                        raise _Stale
                    raise RemoteProtocolError(f"{_CUT} (headers cut short)")
                return None
            status, version, headers = _parse_head(_take_buffered(reader, end + 4))
            if status >= 200:
                return Response(self, conn, status, version, headers)


def _take_buffered(reader: asyncio.StreamReader, n: int | None = None) -> bytearray:
    """The first ``n`` bytes the reader holds (all of them by default), taken out as its
    ``read`` would (reading resumes if the buffer had paused it), no coroutine to drive."""
    buf: bytearray = reader._buffer  # type: ignore[attr-defined]
    taken = buf[:n]
    del buf[:n]
    reader._maybe_resume_transport()  # type: ignore[attr-defined]
    return taken


def _answer_in(answered: asyncio.Future[Response]) -> Response | None:
    """The answer ``answered`` holds, if it came (not an error, not cancelled)."""
    if answered.done() and not answered.cancelled() and answered.exception() is None:
        return answered.result()
    return None


class _Stale(Exception):
    """No byte of an answer came back: the server had closed the connection."""


def _parse_head(raw: bytes | bytearray) -> tuple[int, bytes, dict[str, str]]:
    lines = raw[:-4].decode("latin-1").split("\r\n")  # one decode for the whole head
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if (
        not version.startswith("HTTP/1.")
        or len(code) < 3
        or not (code.isascii() and code.isdigit())
    ):
        raise RemoteProtocolError(
            f"not an HTTP/1.x status line: {lines[0][:100].encode('latin-1')!r}"
        )
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise RemoteProtocolError(f"malformed header line: {line[:100].encode('latin-1')!r}")
        headers[name.strip(" \t").lower()] = value.strip(" \t")  # OWS: spaces, tabs
    return int(code), version.encode("latin-1"), headers


# --- responses ------------------------------------------------------------------------------


class Response:
    """An answer whose status and headers arrived; read its body, whole or in pieces.

    Reading it to the end gives the connection back to the pool; :meth:`close` drops it.
    A reader may stop early (leave :meth:`chunks` at a piece) and later read on from there.
    """

    __slots__ = (
        "_chunks",
        "_conn",
        "_decoder",
        "_eof",
        "_keep_alive",
        "_left",
        "_length",
        "_loop",
        "_pool",
        "_sink",
        "_tap_last",
        "_tap_paused",
        "_tap_timer",
        "headers",
        "status",
    )

    def __init__(
        self,
        pool: Http1Pool,
        conn: _Connection,
        status: int,
        version: bytes,
        headers: dict[str, str],
    ) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._conn: _Connection | None = conn
        self._eof = False
        connection = headers.get("connection", "").lower()
        self._keep_alive = version == b"HTTP/1.1" and "close" not in connection
        self._length: int | None = None
        self._left = 0  # body bytes still to read, when framed by content-length
        self._chunks: _Dechunker | None = None  # a chunked body's framing, undone
        self._sink: BodySink | None = None  # who taps the body (tap())
        self._tap_timer: asyncio.TimerHandle | None = None
        self._tap_last = 0.0  # loop time of the tap's last read
        self._tap_paused = False
        self._loop: asyncio.AbstractEventLoop = conn.reader._loop  # type: ignore[attr-defined]
        if status in _NO_BODY or status < 200:
            self._length = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunks = _Dechunker()
        elif "content-length" in headers:
            length = headers["content-length"]
            if not (length.isascii() and length.isdigit()):  # no sign, no "_", no spaces
                self.close()
                raise RemoteProtocolError(f"invalid content-length {length!r}")
            self._length = self._left = int(length)
        else:
            self._keep_alive = False  # the body ends with the connection
        self._decoder: Any = None
        encoding = headers.get("content-encoding")
        if encoding:
            try:
                self._decoder = _decoder(encoding)
            except RemoteProtocolError:
                self.close()
                raise
        if self._length == 0:
            self._finish()

    def ready(self) -> bool:
        """Whether body bytes arrived that were not passed on yet (a read returns now)."""
        if self._eof or (self._chunks is not None and self._chunks.buffered()):
            return True
        conn = self._conn
        return conn is not None and bool(getattr(conn.reader, "_buffer", None))

    def at_eof(self) -> bool:
        """Whether the body was read to its end."""
        return self._eof

    async def read(self, *, deadline: float | None = None) -> bytes:
        """The whole body (decoded); ``deadline`` (loop time) as for :meth:`chunks`."""
        parts = [piece async for piece in self.chunks(batch=True, deadline=deadline)]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def chunks(
        self, *, batch: bool = False, deadline: float | None = None
    ) -> AsyncGenerator[bytes, None]:
        """The body, decoded, piece by piece as it arrives. A chunked body comes one
        piece per chunk, or with ``batch`` all the chunks of one read as one piece.
        A read still waiting at ``deadline`` (event-loop time) fails with
        :class:`ReadTimeout`, as one waiting longer than the read timeout does."""
        if self._decoder is None:
            return self._raw(batch, deadline, True)  # one generator, not two, per piece
        return self._decoded(batch, deadline)

    async def _decoded(self, batch: bool, deadline: float | None) -> AsyncGenerator[bytes, None]:
        if self._eof:
            return
        if self._conn is None:
            raise ReadError("the response was closed before its body was read")
        decoder = self._decoder
        try:
            async with contextlib.aclosing(self._raw(batch, deadline, False)) as raw:
                async for piece in raw:
                    piece = decoder.decompress(piece)
                    if piece:
                        yield piece
            tail = decoder.flush()
            if tail:
                yield tail
        except GeneratorExit:
            raise  # the reader stopped at a piece; the rest can still be read
        except BaseException:
            self.close()
            raise
        self._finish()

    async def _raw(
        self, batch: bool, until: float | None, owner: bool
    ) -> AsyncGenerator[bytes, None]:
        """The body's bytes as they arrive. The ``owner`` (the reader of an identity
        body) also ends the response: at the end of the body it gives the connection
        back, on a failure it closes it; stopping early at a piece does neither."""
        if owner:
            if self._eof:
                return
            if self._conn is None:
                raise ReadError("the response was closed before its body was read")
        assert self._conn is not None
        complete = False  # the end of the body was read
        try:
            reader = self._conn.reader
            timeout = self._pool.timeouts.read
            deadline = _ReadDeadline(timeout, until)
            try:
                chunks = self._chunks
                if chunks is not None:
                    # Every chunk already received goes out in one piece per read (one read,
                    # one timeout): a stream whose events arrive faster than they are relayed
                    # is passed on in fewer, larger pieces. What was read and not yet passed
                    # on stays in ``chunks``, for a reader that stops and reads on later.
                    while True:
                        piece = chunks.take(batch)
                        if piece is not None:
                            yield piece
                            continue
                        if chunks.done:  # the body ends here, and all of it was read
                            complete = True
                            return
                        data = await deadline.read(reader, 1 << 16)
                        if not data:
                            if chunks.trailers:  # closed after the last chunk, before the end
                                complete = True
                                return
                            raise RemoteProtocolError(f"{_CUT} ({chunks.where()})")
                        chunks.add(data)
                elif self._length is not None:
                    while self._left > 0:
                        data = await deadline.read(reader, min(self._left, 1 << 16))
                        if not data:
                            raise RemoteProtocolError(
                                f"{_CUT} ({self._length - self._left} of {self._length} body bytes)"
                            )
                        self._left -= len(data)
                        yield data
                    complete = True
                else:
                    while True:
                        data = await deadline.read(reader, 1 << 16)
                        if not data:
                            complete = True
                            return
                        yield data
            except TimeoutError as exc:
                if deadline.capped:
                    raise ReadTimeout(
                        "the answer did not end before the request's deadline"
                    ) from exc
                raise ReadTimeout(
                    f"the answer stalled for the read timeout ({timeout:g} s)"
                ) from exc
            except asyncio.IncompleteReadError as exc:
                raise RemoteProtocolError(f"{_CUT} (in a chunk)") from exc
            except asyncio.LimitOverrunError as exc:
                raise RemoteProtocolError("a chunk header line is too long") from exc
            except OSError as exc:
                raise ReadError(f"reading the answer failed: {exc}") from exc
            finally:
                deadline.close()
                if complete and owner:
                    self._finish()
        except GeneratorExit:
            raise  # the reader stopped at a piece; the rest can still be read
        except BaseException:
            if owner:
                self.close()
            raise

    # --- tapping: the body from the connection's read callback --------------------------

    def tap(self, sink: BodySink) -> bool:
        """Hand the rest of a chunked body to ``sink`` as it arrives, from the event
        loop's read callback: each read's complete chunks go to :meth:`BodySink.piece`
        right there (no task wakes up, no generator steps, per read), then
        :meth:`BodySink.end` once the body ended (the connection is back in the pool), or
        :meth:`BodySink.fail` once if reading failed (the connection is closed; the read
        timeout counts while the tap is not paused). What arrived already is handed over
        before this returns.

        False (and nothing done) when this body cannot be tapped (not chunked,
        compressed, read or closed already): read :meth:`chunks` instead. A tap ends
        with :meth:`untap` too, after which :meth:`chunks` reads on from where it left.
        """
        if not self.tappable():
            return False
        conn = self._conn
        assert conn is not None
        if self._sink is not None:
            raise RuntimeError("this body is tapped already")
        reader = conn.reader
        self._sink = sink
        conn.protocol.tap = self
        self._tap_last = self._loop.time()
        if reader._buffer:  # type: ignore[attr-defined]  # what arrived before the tap
            self._tapped(bytes(_take_buffered(reader)))
        if self._sink is sink and (reader.at_eof() or reader.exception() is not None):
            self._tapped_end(reader.exception())  # it ended (or broke) before the tap
        if self._sink is sink and not self._tap_paused:
            self._tap_arm()  # after what came is passed on: the first bytes go out first
        return True

    def tappable(self) -> bool:
        """Whether :meth:`tap` would take this body (chunked, not compressed, not read)."""
        return (
            self._conn is not None
            and not self._eof
            and self._chunks is not None
            and self._decoder is None
        )

    @property
    def tapped(self) -> bool:
        return self._sink is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def untap(self) -> None:
        """End the tap (idempotent): bytes that arrive from now on wait in the stream
        reader for :meth:`chunks`."""
        if self._sink is None:
            return
        self._sink = None
        if self._tap_timer is not None:
            self._tap_timer.cancel()
            self._tap_timer = None
        conn = self._conn
        if conn is not None:
            conn.protocol.tap = None
            if self._tap_paused:
                self._tap_paused = False
                conn.transport.resume_reading()

    def pause(self) -> None:
        """Stop reading while tapped (the sink cannot pass more on yet); the read timeout
        does not count meanwhile."""
        conn = self._conn
        if self._sink is not None and conn is not None and not self._tap_paused:
            self._tap_paused = True
            conn.transport.pause_reading()

    def resume(self) -> None:
        """Read on after :meth:`pause`."""
        conn = self._conn
        if self._sink is not None and conn is not None and self._tap_paused:
            self._tap_paused = False
            self._tap_last = self._loop.time()
            self._tap_arm()
            conn.transport.resume_reading()

    def _tapped(self, data: bytes) -> None:
        """The connection's read callback, while tapped."""
        sink = self._sink
        chunks = self._chunks
        assert sink is not None
        assert chunks is not None
        self._tap_last = self._loop.time()
        chunks.add(data)
        try:
            piece = chunks.take(True)
        except RemoteProtocolError as exc:
            self._tap_fail(exc)
            return
        if piece is not None:
            sink.piece(piece)  # which may untap or close this response
            if chunks.error is not None and self._sink is sink:
                self._tap_fail(chunks.error)
                return
        if chunks.done and self._sink is sink:
            self.untap()
            self._finish()
            sink.end()

    def _tapped_end(self, exc: Exception | None) -> None:
        """The connection's EOF or loss, while tapped."""
        sink = self._sink
        chunks = self._chunks
        assert sink is not None
        assert chunks is not None
        if exc is None and chunks.trailers:  # closed after the last chunk, before the end
            self.untap()
            self._finish()
            sink.end()
        elif exc is None:
            self._tap_fail(RemoteProtocolError(f"{_CUT} ({chunks.where()})"))
        else:
            self._tap_fail(ReadError(f"reading the answer failed: {exc}"))

    def _tap_fail(self, exc: HTTPError) -> None:
        sink = self._sink
        assert sink is not None
        self.untap()
        self.close()
        sink.fail(exc)

    def _tap_arm(self) -> None:
        timeout = self._pool.timeouts.read
        if timeout is not None and self._tap_timer is None:
            self._tap_timer = self._loop.call_at(self._tap_last + timeout, self._tap_check)

    def _tap_check(self) -> None:
        """The read timeout's timer, moved on lazily: the tap's last read sets when."""
        self._tap_timer = None
        timeout = self._pool.timeouts.read
        if self._sink is None or self._tap_paused or timeout is None:
            return
        if self._loop.time() < self._tap_last + timeout:
            self._tap_arm()
            return
        self._tap_fail(ReadTimeout(f"the answer stalled for the read timeout ({timeout:g} s)"))

    def _finish(self) -> None:
        self.untap()
        self._eof = True
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._keep_alive:
                self._pool._checkin(conn)
            else:
                conn.close()

    async def drain(self, timeout_s: float) -> None:
        """Read (and drop) what is left of the body, for at most ``timeout_s``, so the
        connection can be reused; if that fails or takes longer, the connection is closed."""
        if self._eof:
            return
        if self._chunks is not None and self._chunks.done:  # all read: no read, no timer
            self._finish()
            return
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in self.chunks(batch=True):
                    pass
        except (HTTPError, TimeoutError):
            self.close()

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the body was read, else
        it is closed (an unread body cannot be skipped safely)."""
        if self._conn is not None:
            self.close()

    def close(self) -> None:
        """Drop the connection now (idempotent); a pending read ends with an error."""
        self.untap()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class BodySink(Protocol):
    """Who taps a body (:meth:`Response.tap`); each method is called from the event
    loop's read callback, so it must not block or await."""

    def piece(self, data: bytes) -> None:
        """The complete chunks of one read, joined (never empty)."""

    def end(self) -> None:
        """The body ended (called once; the tap is over)."""

    def fail(self, exc: HTTPError) -> None:
        """Reading the body failed (called once; the tap is over, the connection closed)."""


class EarlySink(BodySink, Protocol):
    """A :class:`BodySink` that is offered the answer the moment its head arrives."""

    def head(self, response: Response) -> bool:
        """Called from the read callback the head arrived in; True: tap the body to this
        sink now (only if :meth:`Response.tappable`). Must not block or await."""


_MAX_CHUNK_LINE = 1 << 16  # a chunk size line (or trailer) longer than this is refused
_MAX_CHUNK_DIGITS = 16  # a chunk size of more hex digits than this is refused
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class _Dechunker:
    """A chunked body's framing, undone as its bytes arrive (whether a reader awaits
    them or a tap is handed them): :meth:`add` what arrived, :meth:`take` what is
    complete. Holds what arrived and was not taken yet."""

    __slots__ = ("buf", "done", "error", "pos", "trailers")

    def __init__(self) -> None:
        self.buf = b""
        self.pos = 0  # start of the next chunk's size line in buf
        self.trailers = False  # the last chunk was seen: skip to an empty line
        self.done = False  # the body's end was read
        self.error: RemoteProtocolError | None = None  # met after chunks still to take

    def add(self, data: bytes) -> None:
        buf = self.buf
        if self.pos:
            buf = buf[self.pos :]
            self.pos = 0
        self.buf = buf + data if buf else data

    def buffered(self) -> bool:
        """Whether bytes arrived that were not taken, or the end."""
        return self.done or len(self.buf) > self.pos

    def where(self) -> str:
        """Where a body cut short now was cut."""
        return "in a chunk" if b"\n" in self.buf[self.pos :] else "in a chunk header"

    def take(self, batch: bool) -> bytes | None:
        """The next complete chunk's data, or with ``batch`` every complete chunk's
        joined; None when none is complete. Bad framing raises
        :class:`RemoteProtocolError`, once the complete chunks before it were taken."""
        if self.error is not None:
            raise self.error
        buf, pos = self.buf, self.pos
        out: list[bytes] = []
        while not self.done:
            nl = buf.find(b"\n", pos)
            if nl < 0:
                if len(buf) - pos > _MAX_CHUNK_LINE:
                    self.error = RemoteProtocolError("a chunk header line is too long")
                break
            if self.trailers:
                empty = not buf[pos:nl].strip()
                pos = nl + 1
                if empty:
                    self.done = True
                continue
            line = buf[pos:nl]
            hexa = (line.split(b";", 1)[0] if b";" in line else line).strip(b" \t\r")
            # Hex digits only: int(..., 16) alone would take "-6" (a size that never
            # ends the loop), "0x10", "+5" or "1_0".
            if not hexa or len(hexa) > _MAX_CHUNK_DIGITS or hexa.lstrip(_HEX_DIGITS):
                self.error = RemoteProtocolError(f"malformed chunk size line {line[:50]!r}")
                break
            size = int(hexa, 16)
            if size == 0:
                self.trailers = True
                pos = nl + 1
                continue
            end = nl + 1 + size
            if len(buf) < end + 2:
                break
            if buf[end : end + 2] != b"\r\n":
                self.error = RemoteProtocolError(
                    f"a chunk's data does not end with CRLF: {buf[end : end + 2]!r}"
                )
                break
            out.append(buf[nl + 1 : end])
            pos = end + 2
            if not batch:
                break
        if pos >= len(buf):
            self.buf, self.pos = b"", 0
        else:
            self.pos = pos
        if not out:
            if self.error is not None:
                raise self.error
            return None
        return out[0] if len(out) == 1 else b"".join(out)


def _decoder(encoding: str) -> Any:
    """A zlib decompressor for the body, or None for identity."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, by its header
    raise RemoteProtocolError(f"unsupported content-encoding {encoding!r}")
