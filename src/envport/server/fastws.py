"""envport's WebSocket protocol for uvicorn: uvicorn's handshake, then a lean frame loop.

A step is one small text frame in and one out, so per-frame overhead is most of what
the server spends on a trivial environment. uvicorn's sans-I/O protocol turns every
frame into parser events, an ASGI message dict, a queue hop and back; this protocol
keeps uvicorn (and the ``websockets`` library) for everything around the frames (the
HTTP upgrade and its validation, the ASGI app and its routing, keepalive pings,
server shutdown) and, once an endpoint *takes over* an accepted connection, parses
and writes the frames itself (RFC 6455: masking, fragmentation, control frames,
close handshake, size limits and the close codes for each protocol violation).

Only envport's ``/ws`` endpoint takes over (:meth:`EnvportWebSocketProtocol.take_over`).
A connection that negotiated an extension (permessage-deflate) or already has frames
in uvicorn's parser stays on the ASGI path, which behaves the same, only slower.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable, Coroutine, MutableMapping
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Frame, Opcode

from envport.coro import resume, step_as

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the C extension ships in websockets' wheels
    from websockets.utils import apply_mask

__all__ = ["EnvportWebSocketProtocol", "FastWebSocket", "MessageHandler"]

#: Answers one message; ``False`` ends the connection's loop.
MessageHandler = Callable[[str | bytes], Coroutine[Any, Any, bool]]

SCOPE_KEY = "envport.fastws"

_CONT, _TEXT, _BINARY, _CLOSE, _PING, _PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_H16 = struct.Struct("!BBH")
_H64 = struct.Struct("!BBQ")

# Close codes (RFC 6455 §7.4.1)
PROTOCOL_ERROR = 1002
INVALID_DATA = 1007
MESSAGE_TOO_BIG = 1009


def frame_header(opcode: int, length: int) -> bytes:
    """The header of a final, unmasked (server-to-client) frame."""
    if length < 126:
        return bytes((0x80 | opcode, length))
    if length < 65536:
        return _H16.pack(0x80 | opcode, 126, length)
    return _H64.pack(0x80 | opcode, 127, length)


class FastWebSocket:
    """One accepted WebSocket whose frames envport reads and writes itself.

    The task that serves the connection calls :meth:`run` with a handler that answers
    one message (and uses :meth:`send` and :meth:`close`). Messages are answered one at
    a time, in order; reading the socket pauses while two messages wait unanswered
    (memory stays bounded).
    """

    def __init__(self, protocol: EnvportWebSocketProtocol) -> None:
        self._protocol = protocol
        self._transport: asyncio.Transport = protocol.transport
        self._loop = protocol.loop
        self._max_size: int = protocol.config.ws_max_size
        self._buffer = bytearray()
        self._fragments: list[bytes] = []
        self._fragment_opcode = 0
        self._fragment_size = 0
        self._messages: deque[str | bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._read_paused = False
        # Reading also pauses while pongs back up: a peer that sends pings and reads
        # nothing would otherwise have every pong buffered (as many bytes as it sends).
        self._pongs_waiting = False
        self._on_message: MessageHandler | None = None
        self._task: asyncio.Task[Any] | None = None
        self._busy = False  # an answer is under way (eagerly begun or in the task)
        self._continuation: tuple[Coroutine[Any, Any, bool], Any] | None = None
        self._error: BaseException | None = None
        self._stop = False
        self.closed = False  # no more messages will come (closed, failed or lost)
        self.close_code: int | None = None

    # ---------------------------------------------------------------- app side

    async def run(self, on_message: MessageHandler) -> None:
        """Answer messages with ``on_message`` until it returns ``False`` or the connection ends.

        Call from the task that serves this connection. Messages are answered one at a
        time, in order. A message that arrives while this task waits for one is answered
        at once, inside the socket's read callback and as this task (see
        :meth:`_answer_eagerly`), instead of waking the task through the event loop;
        the rest of an answer that has to wait (an environment that awaits I/O) goes on
        in this task.
        """
        self._on_message = on_message
        self._task = asyncio.current_task()
        try:
            while not self._stop:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                continuation = self._continuation
                if continuation is not None:
                    self._continuation = None
                    keep = await resume(*continuation)
                elif self._messages:
                    message = self._messages.popleft()
                    if self._read_paused and not self._messages and not self.closed:
                        self._read_paused = False
                        if not self._pongs_waiting:
                            self._transport.resume_reading()
                    self._busy = True
                    keep = await on_message(message)
                elif self.closed:
                    return
                else:
                    self._waiter = self._loop.create_future()
                    try:
                        await self._waiter
                    except asyncio.CancelledError as exc:
                        # Aimed at an answer that began eagerly (its deadline, a server
                        # shutdown): deliver it there, as if that answer had run here.
                        continuation = self._continuation
                        if continuation is None:
                            raise
                        self._continuation = None
                        keep = await resume(continuation[0], None, throw=exc)
                    else:
                        continue
                    finally:
                        self._waiter = None
                self._busy = False
                if not keep:
                    return
        finally:
            self._on_message = None
            self._task = None

    def unread(self) -> list[str | bytes]:
        """Take the messages received but not answered (the connection ended first)."""
        messages = list(self._messages)
        self._messages.clear()
        return messages

    async def send(self, payload: bytes) -> None:
        """Send ``payload`` (UTF-8 JSON) as one text frame; waits while the peer is slow."""
        protocol = self._protocol
        if not protocol.writable.is_set():
            await protocol.writable.wait()
        if self._protocol.close_sent or self._transport.is_closing():
            raise ConnectionResetError("the WebSocket connection is closed")
        self._transport.write(frame_header(_TEXT, len(payload)) + payload)

    async def close(self, code: int = 1000) -> None:
        """Start the closing handshake; the peer's echo (or a timeout) ends the TCP connection."""
        if self._protocol.close_sent or self._transport.is_closing():
            return
        self._send_close(code)
        # On the protocol, where uvicorn looks when the app returns: while it is set, the
        # TCP connection stays open for the peer's echo instead of closing under it.
        self._protocol.close_timer = self._loop.call_later(
            self._protocol.close_timeout, self._transport.close
        )
        if self._read_paused or self._pongs_waiting:  # read on, to see the peer's close
            self._read_paused = self._pongs_waiting = False
            self._transport.resume_reading()

    # ---------------------------------------------------------------- protocol side

    def feed(self, data: bytes) -> None:
        """Bytes from the socket: parse every complete frame in them."""
        # A partial frame waits in a bytearray, so a large frame arriving in many reads
        # is copied once, not once per read.
        buffer: bytes | bytearray
        if self._buffer:
            self._buffer += data
            buffer = self._buffer
        else:
            buffer = data
        pos = 0
        end = len(buffer)
        while end - pos >= 2 and not self.closed:
            b0 = buffer[pos]
            b1 = buffer[pos + 1]
            length = b1 & 0x7F
            head = pos + 2
            if length == 126:
                if end - pos < 4:
                    break
                length = int.from_bytes(buffer[head : head + 2], "big")
                head += 2
            elif length == 127:
                if end - pos < 10:
                    break
                length = int.from_bytes(buffer[head : head + 8], "big")
                head += 8
            if b0 & 0x70 or not b1 & 0x80:
                self._fail(PROTOCOL_ERROR)  # reserved bits, or a client frame not masked
                return
            if length > self._max_size or self._fragment_size + length > self._max_size:
                self._fail(MESSAGE_TOO_BIG)
                return
            frame_end = head + 4 + length
            if frame_end > end:
                break
            payload = apply_mask(buffer[head + 4 : frame_end], buffer[head : head + 4])
            pos = frame_end
            self._frame(b0 & 0x80, b0 & 0x0F, payload)
        if buffer is self._buffer:
            del self._buffer[:pos]
        elif pos < end:
            self._buffer = bytearray(buffer[pos:])

    def _frame(self, fin: int, opcode: int, payload: bytes) -> None:
        """One complete frame, unmasked."""
        if opcode >= _CLOSE:
            if not fin or len(payload) > 125:
                self._fail(PROTOCOL_ERROR)
            elif opcode == _PING:
                self._transport.write(frame_header(_PONG, len(payload)) + payload)
                if not self._protocol.writable.is_set() and not self._pongs_waiting:
                    self._pongs_waiting = True  # the peer does not read: stop reading it
                    self._transport.pause_reading()
            elif opcode == _PONG:
                self._protocol.handle_pong(Frame(Opcode.PONG, payload))
            elif opcode == _CLOSE:
                self._peer_closed(payload)
            else:
                self._fail(PROTOCOL_ERROR)
            return
        if opcode == _CONT:
            if not self._fragments:
                self._fail(PROTOCOL_ERROR)
                return
            self._fragments.append(payload)
            self._fragment_size += len(payload)
            if not fin:
                return
            opcode, payload = self._fragment_opcode, b"".join(self._fragments)
            self._fragments, self._fragment_size = [], 0
        elif self._fragments or opcode > _BINARY:
            self._fail(PROTOCOL_ERROR)  # a new message inside a fragmented one, or no such opcode
            return
        elif not fin:
            self._fragments, self._fragment_opcode = [payload], opcode
            self._fragment_size = len(payload)
            return
        if self._protocol.close_sent:
            return  # past our close frame: only the peer's close matters now
        if opcode == _TEXT:
            try:
                message: str | bytes = payload.decode()
            except UnicodeDecodeError:
                self._fail(INVALID_DATA)
                return
        else:
            message = payload
        waiter, task = self._waiter, self._task
        if waiter is not None and not waiter.done() and not self._busy and task is not None:
            # The task waits for a message and nothing has woken it yet (no answer under
            # way, no stop, no error): answer here.
            self._answer_eagerly(message, task)
            return
        self._messages.append(message)
        if len(self._messages) >= 2 and not self._read_paused:
            self._read_paused = True
            self._transport.pause_reading()
        self._wake()

    def _answer_eagerly(self, message: str | bytes, task: asyncio.Task[Any]) -> None:
        """Answer ``message`` now, as the connection's (idle) task, until it first waits.

        Most answers (a step of a fast environment) finish without waiting: this saves
        the event-loop round trip of waking the task, per frame. The code runs with the
        connection's task as the current task, so ``asyncio.timeout``, ``current_task``
        and cancellation behave as if the task ran it; what remains after it first
        suspends is handed to that task (:meth:`run`), which is the same as Python
        3.12's eager tasks, without a new task per frame.
        """
        loop = self._loop
        assert self._on_message is not None  # set with the task, in run()
        call = self._on_message(message)
        if asyncio.current_task(loop) is not None:  # inside another task: the ordinary path
            call.close()
            self._messages.append(message)
            self._wake()
            return
        self._busy = True
        try:
            returned, pending = step_as(loop, task, call)
        except BaseException as exc:  # the task raises it (an OSError ends the connection)
            self._busy = False
            self._error = exc
            self._wake()
            return
        if returned:
            self._busy = False
            if not pending:
                self._stop = True
                self._wake()
            return
        self._continuation = (call, pending)
        self._wake()

    def writable_again(self) -> None:
        """The transport's buffer drained (``resume_writing``): read on if pongs held it."""
        if self._pongs_waiting:
            self._pongs_waiting = False
            if not self._read_paused and not self.closed and not self._transport.is_closing():
                self._transport.resume_reading()

    def _peer_closed(self, payload: bytes) -> None:
        if len(payload) == 1:
            self._fail(PROTOCOL_ERROR)
            return
        code = int.from_bytes(payload[:2], "big") if payload else 1005
        self.close_code = code
        if not self._protocol.close_sent:
            echo = payload[:2]
            self._transport.write(frame_header(_CLOSE, len(echo)) + echo)
            self._protocol.close_sent = True
        self._end()

    def _fail(self, code: int) -> None:
        """A protocol violation: send the close code and drop the connection."""
        self.close_code = code
        if not self._protocol.close_sent and not self._transport.is_closing():
            self._send_close(code)
        self._end()

    def _send_close(self, code: int) -> None:
        body = code.to_bytes(2, "big")
        self._transport.write(frame_header(_CLOSE, 2) + body)
        self._protocol.close_sent = True

    def _end(self) -> None:
        self._transport.close()
        self.lost()

    def lost(self) -> None:
        """The TCP connection is gone."""
        self.closed = True
        timer = self._protocol.close_timer
        if timer is not None:
            timer.cancel()
            self._protocol.close_timer = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EnvportWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, with two changes for request/response traffic.

    1. Flow control: the stock protocol pauses reading after *every* message and resumes
       when the app takes it (two ``epoll_ctl`` calls per frame). OpenEnv's protocol has
       one frame in flight per client, so one message may wait unread without pausing;
       reading pauses (the stock back-pressure) only when a second one arrives.
    2. :meth:`take_over`: an endpoint may take the accepted connection's frames off the
       ASGI path (:class:`FastWebSocket`).
    """

    fast: FastWebSocket | None = None

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][SCOPE_KEY] = self

    def take_over(self) -> FastWebSocket | None:
        """Serve this accepted connection's frames with :class:`FastWebSocket`.

        ``None`` when the connection must stay on the ASGI path: an extension was
        negotiated, or frames already reached uvicorn's parser or queue.
        """
        if (
            self.fast is not None
            or not self.handshake_complete
            or self.close_sent
            or self.disconnected
            or self.read_paused
            or self.conn.extensions
            or not self.queue.empty()
            or self.frames
            or self.conn.reader.buffer
        ):
            return None
        self.fast = FastWebSocket(self)
        return self.fast

    def data_received(self, data: bytes) -> None:
        fast = self.fast
        if fast is None:
            super().data_received(data)
        else:
            fast.feed(data)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.fast is not None:
            self.fast.writable_again()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.fast is not None:
            self.fast.lost()

    def send_receive_event_to_app(self) -> None:
        if self.read_paused or not self.queue.empty():
            super().send_receive_event_to_app()  # pauses reading: back-pressure
            return
        self.read_paused = True  # the base class then queues without pausing
        try:
            super().send_receive_event_to_app()
        finally:
            self.read_paused = False


def fast_websocket(scope: MutableMapping[str, Any]) -> FastWebSocket | None:
    """Take over the connection behind ``scope`` if its protocol allows it (after accept)."""
    protocol = scope.get("extensions", {}).get(SCOPE_KEY)
    if isinstance(protocol, EnvportWebSocketProtocol):
        return protocol.take_over()
    return None
