"""envport's environment server: OpenEnv's protocol, stateful, many sessions per process.

``create_app(env, config)`` builds the ASGI app; ``serve(env, ...)`` runs it on uvicorn.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from envport.server.app import create_app
from envport.server.sessions import ServerConfig, SessionManager
from envport.session import EnvFactory

__all__ = ["ServerConfig", "SessionManager", "create_app", "serve", "uvicorn_config"]


def uvicorn_config(
    app: Any, *, host: str, port: int, config: ServerConfig, log_level: str = "warning"
) -> Any:
    """A ``uvicorn.Config`` tuned for many small WebSocket frames.

    ``ENVPORT_WS_IMPL`` picks uvicorn's WebSocket implementation (``websockets-sansio``,
    the default, ``websockets``, ``wsproto``, or ``websockets-sansio-stock``: uvicorn's
    sans-I/O protocol without envport's flow-control change, see :func:`_ws_protocol`).
    ``ENVPORT_WS_DEFLATE=1`` turns permessage-deflate on; it is off by default because
    compressing small JSON frames costs more CPU than it saves on a LAN.
    ``ENVPORT_LOOP`` is uvicorn's ``loop`` (``auto``: uvloop when it is installed).
    """
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ws=_ws_protocol(os.environ.get("ENVPORT_WS_IMPL", "websockets-sansio")),
        ws_per_message_deflate=os.environ.get("ENVPORT_WS_DEFLATE", "0") == "1",
        loop=os.environ.get("ENVPORT_LOOP", "auto"),
        # Frames up to twice the limit reach the app, which answers PAYLOAD_TOO_LARGE
        # and keeps the session; anything larger is cut by the protocol layer (1009).
        ws_max_size=config.max_frame_bytes * 2,
        ws_ping_interval=20.0,
        ws_ping_timeout=60.0,
        timeout_keep_alive=30,
        backlog=4096,
        lifespan="on",
    )


def _ws_protocol(name: str) -> Any:
    """uvicorn's WebSocket protocol for ``name``; for the sans-I/O one, a subclass.

    uvicorn's sans-I/O protocol pauses reading the socket after *every* message and
    resumes when the app takes it: two ``epoll_ctl`` calls per frame, about a tenth of
    the server's CPU per step. OpenEnv's protocol is request/response, so a client has
    one frame in flight; the subclass lets one message wait unread without pausing and
    pauses (the stock back-pressure) only when a second one arrives before the app took
    the first. Memory per connection stays bounded (two messages instead of one).
    """
    if name == "websockets-sansio-stock":
        return "websockets-sansio"
    if name != "websockets-sansio":
        return name
    try:
        return _sansio_protocol()
    except ImportError:  # an older uvicorn without the sans-I/O protocol
        return "websockets"


@functools.cache
def _sansio_protocol() -> type[Any]:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    class EnvportWebSocketProtocol(WebSocketsSansIOProtocol):
        def send_receive_event_to_app(self) -> None:
            if self.read_paused or not self.queue.empty():
                super().send_receive_event_to_app()  # pauses reading: back-pressure
                return
            self.read_paused = True  # the base class then queues without pausing
            try:
                super().send_receive_event_to_app()
            finally:
                self.read_paused = False

    return EnvportWebSocketProtocol


def serve(
    env: str | EnvFactory,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    config: ServerConfig | None = None,
    log_level: str = "warning",
) -> None:
    """Serve ``env`` until interrupted."""
    import uvicorn

    config = config or ServerConfig()
    app = create_app(env, config)
    uvicorn.Server(
        uvicorn_config(app, host=host, port=port, config=config, log_level=log_level)
    ).run()
