"""A lean HTTP/1.1 server for ASGI apps: what ``envport gateway`` serves with.

The gateway's model calls are small requests whose answers wait on a model; what the
server does per request is on the path to every agent's first token, and under bursts
(a whole batch of agents asking at once) each request waits for the server's work on
the requests ahead of it. This server does per request only what HTTP/1.1 needs:

* the request is parsed by httptools (llhttp) and handed to the app once complete, with
  its body (bounded by ``max_body``, else ``413``; its line and headers by ``max_head``
  bytes and ``MAX_HEADERS`` lines, else ``431``): ``receive()`` answers it at once and
  then waits only for a disconnect;
* the app runs on it right away, up to its first wait, inside its own task
  (:meth:`_Http11._start`), so under a burst each request reaches its upstream call
  before the next one is parsed;
* ``send()`` writes each message to the socket as it comes (the head at once, bodies
  chunked unless the app gave a length) and waits only when the socket's buffer is full;
* keep-alive connections idle longer than ``keep_alive_s`` are closed by one sweep per
  second, not by a timer per request, and the same sweep answers ``408`` to a request
  that is still arriving ``request_timeout_s`` after its first byte (a client trickling
  bytes in is not kept forever); pipelined requests wait for the answer before them.

What it does not do (the gateway needs none of it): WebSockets and other upgrades
(``400``), TLS (put it behind a TLS-terminating proxy), HTTP/2. It runs the app's
``lifespan`` (startup before the first connection, shutdown after the last) and shuts
down gracefully on SIGINT/SIGTERM: it stops accepting, closes idle connections, lets
answers in progress finish for up to ``grace_s``, then closes the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import email.utils
import logging
import signal
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from http import HTTPStatus
from typing import Any

import httptools
import orjson

from envport.coro import resume, step_as
from envport.gateway.errors import Dialect, GatewayError, openai_type

_log = logging.getLogger("envport.gateway.front")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]

MAX_BODY = 64 * 1024 * 1024
# Request bodies still arriving, all connections together: past it a request is refused
# (503) rather than buffered, so many large uploads at once cannot exhaust memory before
# any token is checked (each is bounded by MAX_BODY and the request timeout only).
MAX_BUFFERED = 16 * MAX_BODY
MAX_HEAD = 64 * 1024  # a request's line and headers, in bytes
MAX_HEADERS = 256  # header lines in one request
KEEP_ALIVE_S = 5.0
REQUEST_TIMEOUT_S = 30.0  # from a request's first byte to its last
GRACE_S = 30.0
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_NO_BODY_STATUSES = frozenset({204, 304})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# The scope extension under which an app finds the exchange's synchronous send
# (:meth:`_Exchange.send_nowait`); envport's gateway relays streams with it.
SEND_NOWAIT = "envport.send_nowait"
# The scope extension under which an app finds the exchange itself: it may set its
# ``on_lost`` to a callable, called once (from the event loop's callback) if the client
# leaves before the answer is complete, and read ``client_lost``. No task, no future: an
# answer that needs no ``receive()`` hears a disconnect at no cost while none happens.
CLIENT = "envport.client"
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})  # ours to set


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d \r\n" % status
    return line


class _Clock:
    """The ``date`` header, made once a second."""

    __slots__ = ("header", "second")

    def __init__(self) -> None:
        self.second = 0
        self.header = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.header = b"date: %s\r\n" % email.utils.formatdate(now, usegmt=True).encode()
        return self.header


class _Server:
    """What every connection shares: the app, limits, the live connections."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body: int,
        keep_alive_s: float,
        state: dict[str, Any],
        max_head: int = MAX_HEAD,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_buffered: int = MAX_BUFFERED,
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.max_buffered = max_buffered
        self.buffered = 0  # bytes of request bodies still arriving, every connection
        self.max_head = max_head
        self.keep_alive_s = keep_alive_s
        self.request_timeout_s = request_timeout_s
        self.state = state
        self.clock = _Clock()
        self.connections: set[_Http11] = set()
        self.closing = False
        self.all_closed = asyncio.Event()  # set once closing and no connection is left

    def sweep(self) -> None:
        """Close keep-alive connections idle for longer than ``keep_alive_s``, and answer
        ``408`` (and close) to a request still arriving ``request_timeout_s`` after its
        first byte: its bytes trickling in do not make it new (a slow-loris client would
        hold the connection forever). Connections with an answer in progress are left
        alone (a request behind it is timed from when its turn came)."""
        now = time.monotonic()
        idle = now - self.keep_alive_s
        late = now - self.request_timeout_s
        for conn in list(self.connections):
            if conn.exchange is not None:
                continue
            began = conn.began
            if began:
                if began < late:
                    conn.too_slow()
            elif conn.idle_since < idle:
                conn.transport.close()


class _Exchange:
    """One request and its answer: the ``receive`` and ``send`` the app is given."""

    __slots__ = (
        "body",
        "chunked",
        "complete",
        "conn",
        "gone",
        "head",
        "head_only",
        "keep_alive",
        "left",
        "on_lost",
        "read",
        "started",
        "status",
        "task",
    )

    def __init__(self, conn: _Http11, body: bytes, keep_alive: bool, head_only: bool) -> None:
        self.conn = conn
        self.body = body
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.read = False
        self.started = False
        self.complete = False
        self.chunked = False
        self.left = 0  # bytes still owed of a response with a content-length
        self.status = 0
        self.gone: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None  # what runs the app on it
        self.on_lost: Callable[[], object] | None = None  # see CLIENT
        self.head = b""  # the response's head, until it goes out with the first body bytes

    @property
    def client_lost(self) -> bool:
        """Whether the client has left (its connection is gone)."""
        return self.conn.lost

    async def receive(self) -> Message:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not self.complete and not self.conn.lost:
            gone = self.gone
            if gone is None or gone.cancelled():
                gone = self.gone = self.conn.loop.create_future()
            await gone  # the client left, or the answer is complete
        return {"type": "http.disconnect"}

    def over(self) -> None:
        """The client left or the answer is complete: a waiting ``receive()`` returns."""
        gone = self.gone
        if gone is not None and not gone.done():
            gone.set_result(None)

    async def send(self, message: Message) -> None:
        if self.send_nowait(message):
            await self.conn.drained()

    def send_nowait(self, message: Message) -> bool:
        """:meth:`send` for a caller that cannot await (a read callback), offered to the
        app as ``scope["extensions"][SEND_NOWAIT]``: the message goes out now. True when
        the socket's buffer is full: the caller then waits for it to drain (``await
        send(...)`` of an empty body does) before it sends more."""
        conn = self.conn
        if conn.lost:
            return False  # the client left: nothing to write to (its disconnect was told)
        if not self.started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected 'http.response.start', got {message['type']!r}")
            self.head = self._head(message["status"], message.get("headers", ()))
            self.started = True
            conn.loop.call_soon(self.flush)
            return False
        if self.complete:
            raise RuntimeError(f"Unexpected {message['type']!r} after the response completed")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"Expected 'http.response.body', got {message['type']!r}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        sized = not self.head_only and not self.chunked
        if sized:  # checked before anything goes out: a wrong length can still be a 500
            if len(body) > self.left:
                raise RuntimeError("Response content longer than its Content-Length")
            if not more and self.left > len(body):
                raise RuntimeError("Response content shorter than its Content-Length")
            self.left -= len(body)
        head, self.head = self.head, b""
        if self.head_only:
            if head:
                conn.transport.write(head)
        elif self.chunked:
            if body:
                if more:
                    conn.transport.write(b"%s%x\r\n%s\r\n" % (head, len(body), body))
                else:
                    conn.transport.write(b"%s%x\r\n%s\r\n0\r\n\r\n" % (head, len(body), body))
            elif not more:
                conn.transport.write(head + b"0\r\n\r\n")
            elif head:
                conn.transport.write(head)
        elif body or head:
            conn.transport.write(head + body if head else body)
        if not more:
            self.complete = True
            conn.answered(self)
            return False
        return conn.paused

    def flush(self) -> None:
        """Write the head if no body bytes took it along (the app waits for them)."""
        head, self.head = self.head, b""
        if head and not self.conn.lost and not self.conn.transport.is_closing():
            self.conn.transport.write(head)

    def _head(self, status: int, headers: Any) -> bytes:
        self.status = status
        fields: list[bytes] = []
        length: int | None = None
        for name, value in headers:
            lower = name.lower()
            if lower in _FRAMING:
                if lower == b"content-length":
                    length = int(value)
                elif lower == b"transfer-encoding":
                    continue  # the server frames the body itself
                elif b"close" in value.lower():  # connection: close
                    self.keep_alive = False
                    continue
            fields += (name, b": ", value, b"\r\n")
        lines = b"".join(fields)
        # One line per header, no more: a CR or LF inside a name or value would start
        # another header (or the body). Counted over all of them at once.
        if lines.count(b"\n") != len(fields) // 4 or lines.count(b"\r") != len(fields) // 4:
            for i in range(0, len(fields), 4):
                name, value = fields[i], fields[i + 2]
                if any(c in name or c in value for c in (b"\r", b"\n")):
                    raise RuntimeError(f"Invalid HTTP header {name!r}: {value!r}")
        parts = [_status_line(status), self.conn.server.clock.date(), lines]
        if length is not None:
            self.left = 0 if self.head_only else length
        elif not self.head_only and status not in _NO_BODY_STATUSES and status >= 200:
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive or self.conn.server.closing:
            self.keep_alive = False
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


class _Http11(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.addresses: tuple[Any, Any] = (None, None)
        self.exchange: _Exchange | None = None
        self.pipeline: deque[tuple[Scope, bytes, bool]] = deque()
        self.lost = False
        self.paused = False
        self.resumed: asyncio.Future[None] | None = None
        self.idle_since = time.monotonic()
        # the request being parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.began = 0.0  # when its first byte came (monotonic); 0: none is arriving
        self.heading = False  # its head is not complete yet
        self.head_size = 0  # bytes read while its head was not complete
        self.continue_due = False  # it expects 100 Continue once its turn comes
        self.refused = False  # answered without the app (and closing): the rest is ignored

    # --- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.addresses = (
            _address(transport.get_extra_info("sockname")),
            _address(transport.get_extra_info("peername")),
        )
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._release()
        server = self.server
        server.connections.discard(self)
        if server.closing and not server.connections:
            server.all_closed.set()
        exchange = self.exchange
        if exchange is not None:
            exchange.over()
            hook = exchange.on_lost
            if hook is not None:
                exchange.on_lost = None
                hook()
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)

    def eof_received(self) -> None:
        # A client that shuts its side has left (HTTP clients do not half-close to wait
        # for an answer): the transport closes, and an answer in progress hears it.
        return None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)

    async def drained(self) -> None:
        if self.resumed is None or self.resumed.done():
            self.resumed = self.loop.create_future()
        await asyncio.shield(self.resumed)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "Upgrades (WebSocket, h2c) are not served here.")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"Invalid HTTP request: {exc}")
        if self.heading:  # (httptools holds a header line until it ends: counted here)
            self.head_size += len(data)
            if self.head_size > self.server.max_head:
                self._head_too_large()

    # --- httptools callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = []
        self.size = 0
        self.began = time.monotonic()
        self.heading = True
        self.head_size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.heading = False
        if self.parser.should_upgrade():
            self._refuse(400, "Upgrades (WebSocket, h2c) are not served here.")
            return
        headers = self.headers
        size = len(self.url)
        for name, value in headers:
            size += len(name) + len(value)
        if size > self.server.max_head or len(headers) > MAX_HEADERS:
            self._head_too_large()
            return
        expect = False
        for name, value in headers:
            if name == b"content-length" and value.isdigit():
                if int(value) > self.server.max_body:
                    self._too_large()
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
        # Only to HTTP/1.1 clients, and only once the answers before it are out: in the
        # middle of another answer it would corrupt that one (see answered()).
        if expect and self.parser.get_http_version() == "1.1":
            if self.exchange is None:
                self.transport.write(_CONTINUE)
            else:
                self.continue_due = True

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        self.continue_due = False  # the body comes without it
        self.size += len(body)
        server = self.server
        server.buffered += len(body)
        if self.size > server.max_body:
            self._too_large()
        elif server.buffered > server.max_buffered:
            self._release()
            self.body = []
            self._refuse(503, "The server is receiving too many request bodies; retry later.")
        else:
            self.body.append(body)

    def _release(self) -> None:
        """This request's body no longer counts as arriving (handed over, refused, lost)."""
        self.server.buffered -= self.size
        self.size = 0

    def _head_too_large(self) -> None:
        self._refuse(
            431,
            f"The request's headers are larger than this server takes "
            f"({self.server.max_head} bytes, {MAX_HEADERS} lines).",
        )
        self.headers = []

    def _too_large(self) -> None:
        limit = self.server.max_body
        self._release()
        self._refuse(413, f"The request body is larger than this server takes ({limit} bytes).")
        self.body = []

    def on_message_complete(self) -> None:
        self.began = 0.0
        self.continue_due = False
        if self.size:
            self._release()  # the body is the app's now
        if self.refused or self.transport.is_closing():
            return  # answered already, or the connection ends: nothing more is served
        parser = self.parser
        url = self.url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            raw_path, query = url, b""  # the usual request target: a bare path
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        version = parser.get_http_version()
        server, client = self.addresses
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "server": server,
            "client": client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
            "state": self.server.state.copy(),
        }
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        keep_alive = parser.should_keep_alive() and not self.server.closing
        if self.exchange is None:
            self._start(scope, body, keep_alive)
        else:  # pipelined: answered in order, once the answer before it is complete
            self.pipeline.append((scope, body, keep_alive))
            self.transport.pause_reading()

    # --- exchanges --------------------------------------------------------------------

    def _start(self, scope: Scope, body: bytes, keep_alive: bool) -> None:
        """Run the app on the request, eagerly: up to its first wait, right here.

        A task started the usual way runs only after every other connection's bytes that
        arrived with these have been parsed; under a burst of requests each one's
        upstream call would wait for the whole burst to be read. Here the app runs at
        once, inside its own (not yet started) task, as Python 3.12's eager tasks do: the
        task's context, and :func:`asyncio.current_task` is that task (timeouts and
        cancellation work as in any task). The task picks the app up at its first wait.
        """
        exchange = _Exchange(self, body, keep_alive, scope["method"] == "HEAD")
        self.exchange = exchange
        scope["extensions"] = {SEND_NOWAIT: exchange.send_nowait, CLIENT: exchange}
        call = self._run(scope, exchange)
        if asyncio.current_task(self.loop) is not None:
            # From a task (a pipelined request started when the answer before it
            # completed): no stepping inside another task; started the usual way.
            exchange.task = self.loop.create_task(call)
            return
        context = contextvars.copy_context()
        begun = _Begun(call)
        task = exchange.task = self.loop.create_task(begun.finish(), context=context)
        context.run(begun.step, self.loop, task)

    async def _run(self, scope: Scope, exchange: _Exchange) -> None:
        try:
            await self.server.app(scope, exchange.receive, exchange.send)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                _log.exception("the app failed on %s %s", scope["method"], scope["path"])
            if exchange.complete:
                pass  # answered whole (an error middleware's 500, re-raised): carry on
            elif (not exchange.started or exchange.head) and not self.lost:
                exchange.head = b""  # nothing went out yet: the answer can still be a 500
                exchange.keep_alive = False
                self._answer_plain(500, "Internal Server Error", scope["raw_path"])
            else:
                self.transport.close()
            if not isinstance(exc, Exception):
                raise
            return
        if not exchange.complete and not self.lost:
            if not exchange.started:
                _log.error("the app sent no response to %s %s", scope["method"], scope["path"])
                self._answer_plain(500, "Internal Server Error", scope["raw_path"])
            else:  # an answer begun and never finished: the client must not wait for it
                _log.error(
                    "the app left its response to %s %s unfinished", scope["method"], scope["path"]
                )
                self.transport.close()

    def answered(self, exchange: _Exchange) -> None:
        """The response is complete: next request, idle, or close."""
        self.exchange = None
        exchange.over()  # its receive() says disconnect from now on
        if not exchange.keep_alive or self.server.closing:
            self.transport.close()
            return
        if self.pipeline:
            scope, body, keep_alive = self.pipeline.popleft()
            if not self.pipeline:
                self.transport.resume_reading()
            self._start(scope, body, keep_alive)
            return
        self.idle_since = now = time.monotonic()
        if self.began:  # the next request is arriving: its time starts now
            self.began = now
            if self.continue_due:  # and the client waits for this to send its body
                self.continue_due = False
                self.transport.write(_CONTINUE)

    def too_slow(self) -> None:
        """The request being read took longer than ``request_timeout_s`` (see sweep)."""
        self.began = 0.0
        limit = self.server.request_timeout_s
        self._refuse(408, f"The request did not arrive within {limit:g} s.")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the app never sees, and close the connection."""
        if self.refused:
            return
        self.refused = True
        if self.exchange is not None:  # an answer is due first: it cannot be kept in order
            self.transport.close()
            return
        self._answer_plain(status, message)

    def _answer_plain(self, status: int, message: str, target: bytes | None = None) -> None:
        """An answer from the server itself (to the request at ``target``, by default
        the one being read); the connection closes after it."""
        kind, body = _error_body(self.url if target is None else target, status, message)
        self.transport.write(
            b"%s%scontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (_status_line(status), self.server.clock.date(), kind, len(body), body)
        )
        self.transport.close()

    def shutdown(self) -> None:
        """Close now if idle; else once the answer in progress is complete."""
        if self.exchange is None:
            self.transport.close()
        else:
            self.exchange.keep_alive = False


class _Begun:
    """A coroutine's first step, taken inside the task that then finishes it."""

    __slots__ = ("call", "failure", "pending", "returned")

    def __init__(self, call: Coroutine[Any, Any, None]) -> None:
        self.call = call
        self.pending: Any = None
        self.returned = False
        self.failure: BaseException | None = None

    def step(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[None]) -> None:
        try:
            self.returned, self.pending = step_as(loop, task, self.call)
        except BaseException as exc:  # raised by the task, where it belongs
            self.failure = exc

    async def finish(self) -> None:
        if self.returned:
            return
        if self.failure is not None:
            raise self.failure
        try:
            await resume(self.call, self.pending)
        finally:
            self.call.close()  # if the task was cancelled before it began: close the app too


def _error_body(target: bytes, status: int, message: str) -> tuple[bytes, bytes]:
    """The content type and body of the server's own error answer: in the API's error
    shape on a model API's path (``/v1/messages``: Anthropic's; another ``/v1/`` path:
    OpenAI's), so an SDK reads it as any error; plain text elsewhere."""
    path = target.split(b"?", 1)[0]
    dialect: Dialect | None = None
    if path.endswith(b"/v1/messages"):
        dialect = "anthropic"
    elif b"/v1/" in path:
        dialect = "openai"
    if dialect is None:
        return b"text/plain; charset=utf-8", message.encode()
    error = GatewayError(message)
    error.status, error.type = status, openai_type(status)
    return b"application/json", orjson.dumps(error.body(dialect))


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


class _Lifespan:
    """Runs the app's ``lifespan`` scope: startup before serving, shutdown after."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.started = asyncio.Event()
        self.stopped = asyncio.Event()
        self.failure: str | None = None
        self.supported = True
        self.task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        self.task = asyncio.create_task(self._run())
        await self.inbox.put({"type": "lifespan.startup"})
        await self.started.wait()
        if self.failure is not None:
            raise RuntimeError(f"The app's startup failed: {self.failure}")

    async def shutdown(self) -> None:
        if not self.supported or self.task is None:
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.stopped.wait()
        if self.failure is not None:
            _log.error("the app's shutdown failed: %s", self.failure)

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self.state}
        try:
            await self.app(scope, self.inbox.get, self._send)
        except BaseException as exc:
            if not self.started.is_set():
                # An app without lifespan support raises on the unknown scope type.
                self.supported = False
                _log.debug("the app does not run a lifespan: %r", exc)
            else:
                self.failure = f"{type(exc).__name__}: {exc}"
                _log.exception("the app's lifespan failed")
        finally:
            self.started.set()
            self.stopped.set()

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self.started.set()
        elif kind == "lifespan.startup.failed":
            self.failure = str(message.get("message", "startup failed"))
            self.started.set()
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            if kind.endswith("failed"):
                self.failure = str(message.get("message", "shutdown failed"))
            self.stopped.set()


async def serve_asgi(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 8100,
    *,
    max_body: int = MAX_BODY,
    max_head: int = MAX_HEAD,
    keep_alive_s: float = KEEP_ALIVE_S,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    max_buffered: int = MAX_BUFFERED,
    grace_s: float = GRACE_S,
    stop: asyncio.Event | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` until ``stop`` is set (or SIGINT/SIGTERM arrives).

    ``ready(port)`` is called once the socket listens (with the port the system chose
    when ``port`` is 0).
    """
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    state: dict[str, Any] = {}
    lifespan = _Lifespan(app, state)
    await lifespan.startup()
    shared = _Server(
        app,
        max_body=max_body,
        max_head=max_head,
        keep_alive_s=keep_alive_s,
        request_timeout_s=request_timeout_s,
        max_buffered=max_buffered,
        state=state,
    )
    server = await loop.create_server(lambda: _Http11(shared), host, port, backlog=2048)
    handled: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    try:
        if ready is not None:
            ready(server.sockets[0].getsockname()[1])
        every = min(1.0, keep_alive_s / 2, request_timeout_s / 2)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            shared.sweep()
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        shared.closing = True
        server.close()
        for conn in list(shared.connections):
            conn.shutdown()
        if shared.connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(shared.all_closed.wait(), grace_s)
        for conn in list(shared.connections):
            conn.transport.close()
            if conn.exchange is not None and conn.exchange.task is not None:
                conn.exchange.task.cancel()
        await server.wait_closed()
        await lifespan.shutdown()
