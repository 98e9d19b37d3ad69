"""Transports: how an :class:`~envport.client.EnvClient` reaches its environment.

A transport is one method, ``request(frame) -> reply frame``, plus ``open``/``close``.
Three ship with envport:

* :class:`WebSocketTransport`: OpenEnv's ``/ws`` protocol. Against an envport server it
  upgrades itself with ``hello`` (request ids, resume after a dropped connection);
  against an OpenEnv server it speaks the plain protocol.
* :class:`HTTPTransport`: envport's stateful HTTP routes (``POST /sessions`` then
  ``/reset``, ``/step``, ``/state`` with the session header).
* :class:`InProcessTransport`: no sockets at all; the same frames handled in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

import httpx
import orjson
from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.frames import CloseCode

from envport.deadlines import declared_timeout, extended, frame_timeout
from envport.errors import (
    ConnectionLostError,
    EnvportError,
    ErrorCode,
    NoReplyError,
    PayloadTooLargeError,
    ProtocolError,
    RemoteError,
    from_wire,
)
from envport.session import EnvFactory


class Transport(Protocol):
    async def open(self) -> None: ...
    async def request(self, frame: dict[str, Any]) -> dict[str, Any]: ...
    async def close(self) -> None: ...


#: Base URLs of servers on a Unix socket: ``unix:/path/to/server.sock`` (the whole rest is
#: the socket's path); the WebSocket then speaks ``ws://localhost/ws`` over that socket.
UNIX_PREFIX = "unix:"


def unix_socket_path(base_url: str) -> str | None:
    """The socket path of a ``unix:`` base URL, else ``None``."""
    return base_url[len(UNIX_PREFIX) :] if base_url.startswith(UNIX_PREFIX) else None


def _ws_url(base_url: str) -> str:
    if unix_socket_path(base_url) is not None:
        return "ws://localhost/ws"
    url = base_url.rstrip("/")
    if url.startswith("http://"):
        url = "ws://" + url[len("http://") :]
    elif url.startswith("https://"):
        url = "wss://" + url[len("https://") :]
    elif not url.startswith(("ws://", "wss://")):
        url = "ws://" + url
    return url if url.endswith("/ws") else url + "/ws"


def raise_for_error(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("type") == "error":
        data = reply.get("data")
        raise from_wire(data if isinstance(data, dict) else {"message": str(data)})
    return reply


class _SendTimeoutError(TimeoutError):
    """The call's time ran out while its frame was still being sent."""


def _too_big(exc: ConnectionClosed) -> bool:
    """Closed with 1009 (message too big), by the server or by this side."""
    return any(
        close is not None and close.code == CloseCode.MESSAGE_TOO_BIG
        for close in (exc.rcvd, exc.sent)
    )


class WebSocketTransport:
    """OpenEnv's WebSocket protocol, with envport's extensions when the server has them."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        max_frame_bytes: int = 64 * 2**20,
        resume: bool = True,
        resume_attempts: int = 5,
    ) -> None:
        self.url = _ws_url(base_url)
        self.unix_path = unix_socket_path(base_url)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.resume = resume
        self.resume_attempts = resume_attempts
        self.extended = False
        self.session_id: str | None = None
        self.token: str | None = None
        self.tools_token: str | None = None  # the session's tools only (MCP): for an agent
        self._ws: ClientConnection | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._unanswered = 0  # plain protocol: replies still owed to abandoned requests
        # envport's protocol: ids of abandoned requests still owed a reply, oldest first
        self._abandoned: deque[Any] = deque()
        self._resuming = False  # a resume was started and has not finished
        self._closed = False  # close() was called (a call in flight must not resume)
        #: The server's frame limit (its hello says it): a larger frame is refused here.
        self.server_max_frame_bytes: int | None = None

    async def open(self) -> None:
        self._closed = False
        await self._connect()
        try:
            reply = await self._exchange({"type": "hello", "id": next(self._ids), "data": {}})
        except BaseException as exc:
            # Interrupted or failed before a session existed: forget this connection so
            # the next request opens a fresh one instead of speaking on a half-open one.
            self._abort()
            if isinstance(exc, ConnectionClosed | TimeoutError):
                raise ConnectionLostError(
                    f"{self.url} accepted the WebSocket but did not answer hello: "
                    f"{exc or type(exc).__name__}"
                ) from exc
            raise
        if reply.get("type") == "hello":
            self.extended = True
            self.session_id = reply["data"]["session_id"]
            self.token = reply["data"]["token"]
            self.tools_token = reply["data"].get("tools_token")
            self._server_limit(reply)
        # An OpenEnv server answers UNKNOWN_TYPE and keeps the connection: plain mode.

    def _server_limit(self, hello: dict[str, Any]) -> None:
        limit = hello["data"].get("max_frame_bytes")
        self.server_max_frame_bytes = limit if isinstance(limit, int) and limit > 0 else None

    def _where(self) -> str:
        return f"{self.url} on {self.unix_path}" if self.unix_path else self.url

    async def _connect(self) -> None:
        # A new connection replaces the last one (a resume after a drop): never leak it.
        # Replies owed on the old one will never come on this one.
        self._abort()
        self._unanswered = 0
        self._abandoned.clear()
        try:
            if self.unix_path is not None:
                self._ws = await unix_connect(
                    self.unix_path,
                    self.url,
                    open_timeout=self.connect_timeout_s,
                    max_size=self.max_frame_bytes,
                    compression=None,
                )
            else:
                self._ws = await connect(
                    self.url,
                    open_timeout=self.connect_timeout_s,
                    max_size=self.max_frame_bytes,
                    compression=None,
                )
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise ConnectionLostError(
                f"Cannot connect to {self._where()}: the server answered HTTP {status} "
                "instead of accepting the WebSocket (is this an environment server?)"
            ) from exc
        except InvalidHandshake as exc:
            # InvalidMessage (EOF or not HTTP during the handshake), bad upgrade headers.
            raise ConnectionLostError(
                f"Cannot connect to {self._where()}: WebSocket handshake failed "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        except TimeoutError as exc:
            raise ConnectionLostError(
                f"Cannot connect to {self._where()}: no WebSocket handshake within "
                f"{self.connect_timeout_s:g} s"
            ) from exc
        except (OSError, InvalidURI) as exc:
            raise ConnectionLostError(f"Cannot connect to {self._where()}: {exc}") from exc

    def _abort(self) -> None:
        """Drop the socket at once (no closing handshake), forgetting the connection."""
        if self._ws is not None:
            self._ws.transport.abort()
            self._ws = None

    async def _exchange(
        self, frame: dict[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Send one frame and read until its reply (``timeout_s``, default the
        transport's, for it).

        Replies that belong to earlier requests (which timed out or were cancelled on our
        side) are never taken for this one. With envport's extensions a reply carries its
        request's id; a server answers in order, so a reply without one (an error for a
        frame it could not parse) belongs to the oldest abandoned request still owed one
        (``_abandoned``), or, when none is, to this one (an error only: any other frame
        without an id is not a reply). In OpenEnv's plain protocol, which has no ids,
        replies come in order and ``_unanswered`` counts how many to skip.
        """
        assert self._ws is not None
        want = frame.get("id")
        try:
            payload = orjson.dumps(frame)
        except orjson.JSONEncodeError as exc:
            raise ProtocolError(f"The request cannot be sent as JSON: {exc}.") from None
        if self.server_max_frame_bytes is not None and len(payload) > self.server_max_frame_bytes:
            raise PayloadTooLargeError(
                f"Frame of {len(payload)} bytes exceeds the server's limit of "
                f"{self.server_max_frame_bytes} bytes; not sent.",
                limit_bytes=self.server_max_frame_bytes,
            )
        sent = False
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
            # cancellation that lands just as the reply arrives, and the caller then
            # keeps reading (or waits timeout_s for a reply that never comes).
            async with asyncio.timeout(timeout_s or self.timeout_s):
                # The send counts too: it waits while the server does not read.
                await self._ws.send(payload.decode())
                sent = True
                while True:
                    raw = await self._ws.recv()
                    try:
                        reply: dict[str, Any] = orjson.loads(raw)
                        rid = reply.get("id")
                    except (orjson.JSONDecodeError, AttributeError):
                        # Not a JSON object, so no id: in order, the reply of the oldest
                        # request given up on, if any, else this one's.
                        if self._skip_owed():
                            continue
                        raise ProtocolError(
                            f"The server sent a frame that is not a JSON object: {raw[:200]!r}"
                        ) from None
                    if not self.extended:
                        if self._skip_owed():
                            continue
                        return reply
                    if rid == want or want is None:
                        if self._abandoned:
                            self._abandoned.clear()  # answered in order: all before it were
                        return reply
                    if rid is None:
                        if not self._skip_owed() and reply.get("type") == "error":
                            return reply
                    elif rid in self._abandoned:
                        while self._abandoned.popleft() != rid:
                            pass  # answered in order: the ones before it were too
        except (asyncio.CancelledError, TimeoutError) as exc:
            if not sent and isinstance(exc, TimeoutError):
                # The frame is cut off mid-send: nothing more can be said on this
                # connection. Drop it (the next request resumes a resumable session).
                self._abort()
                if self.extended and self.resume and self.token:
                    self._resuming = True
                raise _SendTimeoutError from None
            if not self.extended:
                self._unanswered += 1
            elif want is not None:
                self._abandoned.append(want)
            raise

    def _skip_owed(self) -> bool:
        """A reply without an id arrived: if one is owed to a request given up on, it is
        that one's (the oldest's): count it answered and say so."""
        if not self.extended:
            if self._unanswered:
                self._unanswered -= 1
                return True
        elif self._abandoned:
            self._abandoned.popleft()
            return True
        return False

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            if self._resuming:
                await self._resume()  # a previous resume was interrupted or failed
            elif self._ws is None:
                await self.open()
            if self.extended:
                frame = {**frame, "id": next(self._ids)}
            # A frame that declares its own timeout_s may take that long (envport.deadlines).
            limit = extended(self.timeout_s, frame_timeout(frame)) or self.timeout_s
            try:
                return await self._exchange_resuming(frame, limit)
            except _SendTimeoutError:
                raise NoReplyError(
                    f"The request could not be sent within {limit:g} s (the server is not "
                    "reading); the connection was dropped"
                ) from None
            except TimeoutError:
                raise NoReplyError(f"No reply within {limit:g} s") from None

    async def _exchange_resuming(self, frame: dict[str, Any], limit: float) -> dict[str, Any]:
        drops = 0
        while True:
            try:
                return await self._exchange(frame, limit)
            except ConnectionClosed as exc:
                if self._closed:
                    raise ConnectionLostError(
                        f"The client was closed while this request to {self._where()} ran"
                    ) from exc
                if _too_big(exc):
                    raise self._too_big_error(exc) from exc
                if not (self.extended and self.resume and self.token):
                    self._abort()  # the session went with it: the next request opens anew
                    raise ConnectionLostError(
                        f"Connection to {self._where()} lost: {exc}; the session (and its "
                        "episode) is gone: the next request opens a new one"
                    ) from exc
                if drops >= self.resume_attempts:
                    raise ConnectionLostError(
                        f"Connection to {self._where()} lost {drops + 1} times "
                        f"during one request: {exc}"
                    ) from exc
                drops += 1
                await self._resume()
                # Resent with the same id: the server answers it exactly once.

    def _too_big_error(self, exc: ConnectionClosed) -> PayloadTooLargeError:
        """The connection closed with 1009: a frame over a limit. Resending it would only
        close the next connection too; the session is resumed on the next request."""
        self._abort()
        if self.extended and self.resume and self.token:
            self._resuming = True
        sent, rcvd = exc.sent, exc.rcvd
        if (
            sent is not None
            and sent.code == CloseCode.MESSAGE_TOO_BIG
            and (rcvd is None or not exc.rcvd_then_sent)  # this side closed first
        ):
            return PayloadTooLargeError(
                f"The reply exceeded this client's limit of {self.max_frame_bytes} bytes "
                "(max_frame_bytes); the request may have taken effect.",
                limit_bytes=self.max_frame_bytes,
            )
        return PayloadTooLargeError(
            f"{self._where()} closed the connection: the frame was too large for it ({exc})."
        )

    async def _resume(self) -> None:
        """Reconnect and reattach to the session; if interrupted, the next request retries."""
        self._resuming = True
        delay = 0.05
        last: Exception | None = None
        for _ in range(self.resume_attempts):
            if self._closed:
                raise ConnectionLostError(f"The client was closed; no resume on {self._where()}")
            try:
                await self._connect()
            except ConnectionLostError as exc:
                last = exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                reply = await self._exchange(
                    {"type": "hello", "id": next(self._ids), "data": {"resume": self.token}}
                )
            except (ConnectionClosed, OSError, TimeoutError) as exc:
                self._abort()
                last = exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            except BaseException:
                self._abort()  # cancelled mid-hello: this connection's state is unknown
                raise
            if reply.get("type") != "hello":
                self._abort()  # this connection belongs to no session: never speak on it
                self._session_lost_if(reply)
                raise_for_error(reply)
                raise ProtocolError(f"Expected a hello reply to resume, got {reply!r:.200}")
            self._server_limit(reply)
            if self._closed:  # close() ran meanwhile: it found no connection to end
                await self.close()
                raise ConnectionLostError(f"The client was closed; no resume on {self._where()}")
            self._resuming = False
            return
        raise ConnectionLostError(f"Could not resume session on {self._where()}: {last}")

    def _session_lost_if(self, reply: dict[str, Any]) -> None:
        """A resume refused because the session is gone (the server restarted, or the
        resume grace ran out): forget it, so the next request opens a fresh session."""
        data = reply.get("data")
        code = data.get("code") if isinstance(data, dict) else None
        if code not in (ErrorCode.SESSION_NOT_FOUND, ErrorCode.FORBIDDEN):
            return
        self._resuming = False
        self.token = self.session_id = self.tools_token = None
        message = data.get("message") if isinstance(data, dict) else None
        raise ConnectionLostError(
            f"Connection to {self._where()} lost and the session is gone ({code}: "
            f"{message}): its episode is lost; the next request opens a new session "
            "(reset() starts a new episode)."
        )

    async def drop_connection(self) -> None:
        """Close the socket without closing the session (for tests and failover)."""
        if self._ws is not None:
            await self._ws.close()

    async def close(self) -> None:
        """End the session (OpenEnv's ``close`` frame) and the connection.

        Raises nothing but a cancellation. A call still in flight on another task is not
        waited for: it ends with :class:`ConnectionLostError` (its replies are read by
        it alone, never by two readers at once)."""
        self._closed = True
        self._resuming = False
        self.tools_token = None
        ws = self._ws
        if ws is None:
            return
        owner = not self._lock.locked()  # no call in flight: this task may read
        if owner:
            await self._lock.acquire()  # free: taken without waiting
        try:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await ws.send(orjson.dumps({"type": "close"}).decode())
                    # Replies still owed to abandoned requests may come first. With a
                    # call in flight the server marks the session closing when it reads
                    # the frame; the call's task reads the replies.
                    # With replies still owed (the server is busy with a request given
                    # up on), "closed" comes after them: it is not waited for.
                    if owner and not (self._abandoned or self._unanswered):
                        while _reply_type(await ws.recv()) != "closed":
                            pass
        finally:
            try:
                async with asyncio.timeout(2.0):
                    await ws.close()
            except asyncio.CancelledError:
                ws.transport.abort()
                raise
            except Exception:  # no closing handshake in time, or a broken connection
                ws.transport.abort()
            finally:
                if self._ws is ws:
                    self._ws = None
                if owner:
                    self._lock.release()


def _reply_type(raw: str | bytes) -> Any:
    try:
        return orjson.loads(raw).get("type")
    except (orjson.JSONDecodeError, AttributeError):
        return None


class HTTPTransport:
    """envport's stateful HTTP routes; each frame becomes one request."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 60.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = client or httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)
        self._owns_client = client is None
        self.token: str | None = None
        self.tools_token: str | None = None  # the session's tools only (MCP): for an agent
        self.session_id: str | None = None

    async def open(self) -> None:
        response = await self._client.post("/sessions")
        body = self._decode(response)
        self.token, self.session_id = body["token"], body["session_id"]
        self.tools_token = body.get("tools_token")

    @staticmethod
    def _decode(response: httpx.Response) -> dict[str, Any]:
        try:
            body: dict[str, Any] = response.json()
        except ValueError as exc:
            raise RemoteError(
                f"HTTP {response.status_code}: not JSON", ErrorCode.EXECUTION_ERROR.value
            ) from exc
        if response.is_error:
            raise from_wire(body.get("error") or {"message": str(body)})
        return body

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        if self.token is None:
            await self.open()
        headers = {"X-Envport-Session": self.token or ""}
        kind, data = frame["type"], frame.get("data")
        try:
            if kind == "reset":
                response = await self._client.post("/reset", json=data or {}, headers=headers)
                return {"type": "observation", "data": self._decode(response)}
            if kind == "step":
                # A step that declares its own timeout_s may take that long (deadlines).
                timeout: Any = httpx.USE_CLIENT_DEFAULT
                declared = declared_timeout(data)
                if declared is not None:
                    timeout = httpx.Timeout(self.timeout_s, read=extended(self.timeout_s, declared))
                response = await self._client.post(
                    "/step", json={"action": data}, headers=headers, timeout=timeout
                )
                return {"type": "observation", "data": self._decode(response)}
            if kind == "state":
                response = await self._client.get("/state", headers=headers)
                return {"type": "state", "data": self._decode(response)}
            if kind == "schema":
                response = await self._client.get("/schema")
                return {"type": "schema", "data": self._decode(response)}
        except EnvportError as exc:
            return {"type": "error", "data": exc.to_wire()}
        except httpx.HTTPError as exc:
            raise ConnectionLostError(f"HTTP request to {self.base_url} failed: {exc}") from exc
        raise EnvportError(f"The HTTP transport does not carry {kind!r} frames.")

    async def close(self) -> None:
        try:
            if self.token is not None:
                await self._client.delete("/sessions", headers={"X-Envport-Session": self.token})
        except httpx.HTTPError:
            pass
        finally:
            self.token = self.tools_token = None
            if self._owns_client:
                await self._client.aclose()


class InProcessTransport:
    """The server's own frame handling, in this process: no sockets, same semantics."""

    def __init__(
        self,
        env: str | EnvFactory,
        *,
        call_timeout_s: float | None = 30.0,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """``options`` are keyword arguments for the environment (over the registry's)."""
        from envport.registry import resolve
        from envport.server.sessions import ServerConfig, SessionManager

        factory, _ = resolve(env, options)
        self._manager = SessionManager(factory, ServerConfig(call_timeout_s=call_timeout_s))
        self._conn: Any = None

    async def open(self) -> None:
        from envport.server.dispatch import Connection, handle_frame

        self._conn = Connection(self._manager)
        await handle_frame(self._conn, {"type": "hello"})

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        from envport.server.dispatch import handle_frame

        if self._conn is None:
            await self.open()
        return await handle_frame(self._conn, frame)

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.release(keep_for_resume=False)
            self._conn = None
        await self._manager.close_all()
