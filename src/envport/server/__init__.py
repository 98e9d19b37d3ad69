"""envport's environment server: OpenEnv's protocol, stateful, many sessions per process.

``create_app(env, config)`` builds the ASGI app; ``serve(env, ...)`` runs it on uvicorn.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import TYPE_CHECKING, Any

from envport.server.sessions import ServerConfig, SessionManager
from envport.session import EnvFactory

if TYPE_CHECKING:
    from envport.server.app import create_app


def __getattr__(name: str) -> Any:
    # create_app imports the web stack (starlette, uvicorn, MCP): only on first use, so
    # that importing ServerConfig (``envport --help`` shows its defaults) stays cheap.
    if name == "create_app":
        from envport.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "WS_IMPLEMENTATIONS",
    "ServerConfig",
    "SessionManager",
    "create_app",
    "serve",
    "uvicorn_config",
    "ws_impl",
]

#: The values ``ENVPORT_WS_IMPL`` may take (see :func:`_ws_protocol`); the first is the default.
WS_IMPLEMENTATIONS = (
    "envport",
    "websockets-sansio",
    "websockets-sansio-stock",
    "websockets",
    "wsproto",
)


def ws_impl() -> str:
    """The WebSocket implementation ``ENVPORT_WS_IMPL`` names (unset: ``envport``).

    Raises ``ValueError``, naming the valid values, for any other value (an empty one
    too), so that a server fails with one clear line before it starts.
    """
    name = os.environ.get("ENVPORT_WS_IMPL", WS_IMPLEMENTATIONS[0])
    if name not in WS_IMPLEMENTATIONS:
        raise ValueError(
            f"ENVPORT_WS_IMPL={name!r} is not a WebSocket implementation; "
            f"use one of: {', '.join(WS_IMPLEMENTATIONS)}."
        )
    return name


def uvicorn_config(
    app: Any, *, host: str, port: int, config: ServerConfig, log_level: str = "warning"
) -> Any:
    """A ``uvicorn.Config`` tuned for many small WebSocket frames.

    ``ENVPORT_WS_IMPL`` picks the WebSocket implementation: ``envport``, the default
    (:mod:`envport.server.fastws`), ``websockets-sansio`` (every frame through ASGI),
    ``websockets-sansio-stock``, ``websockets`` or ``wsproto`` (see :func:`_ws_protocol`);
    any other value raises ``ValueError`` (:func:`ws_impl`).
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
        http=_http_protocol(config.request_timeout_s),
        ws=_ws_protocol(ws_impl()),
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


@functools.cache
def _http_protocol(request_timeout_s: float) -> Any:
    """uvicorn's HTTP protocol (httptools), with a deadline on each request's arrival.

    uvicorn times only the wait *between* requests (``timeout_keep_alive``): a client
    that opens a connection and sends nothing, or sends a request a byte at a time and
    never finishes it, holds the connection (and its file descriptor) forever, and a few
    thousand such clients starve the server. Here a connection whose request has not
    fully arrived ``request_timeout_s`` after it began (or after the connection opened)
    is closed. ``"auto"`` (uvicorn's choice) when httptools is not installed.
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools ships with uvicorn[standard]
        return "auto"

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _arrival: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._arrival is None:
                self._arrival = self.loop.call_later(request_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._arrival is not None:
                self._arrival.cancel()
                self._arrival = None

        def _too_slow(self) -> None:
            self._arrival = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()  # nothing sent yet: the first request's time runs from now

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def handle_websocket_upgrade(self) -> None:
            self._disarm()  # the WebSocket protocol takes the connection over
            super().handle_websocket_upgrade()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedHttpToolsProtocol


def _ws_protocol(name: str) -> Any:
    """uvicorn's ``ws`` setting for ``ENVPORT_WS_IMPL=name``.

    ``envport`` (the default): :class:`~envport.server.fastws.EnvportWebSocketProtocol`,
    uvicorn's sans-I/O protocol for the handshake, envport's frame loop for ``/ws``.
    ``websockets-sansio``: the same protocol with every frame through ASGI (its flow
    control fix kept). ``websockets-sansio-stock``, ``websockets``, ``wsproto``: uvicorn's own.
    Any other name raises ``ValueError``.
    """
    if name not in WS_IMPLEMENTATIONS:
        raise ValueError(
            f"unknown WebSocket implementation {name!r}; "
            f"use one of: {', '.join(WS_IMPLEMENTATIONS)}."
        )
    if name == "websockets-sansio-stock":
        return "websockets-sansio"
    if name not in ("envport", "websockets-sansio"):
        return name
    from envport.server.fastws import EnvportWebSocketProtocol

    if name == "envport":
        return EnvportWebSocketProtocol
    return _asgi_only_protocol()


@functools.cache
def _asgi_only_protocol() -> type[Any]:
    from envport.server.fastws import EnvportWebSocketProtocol

    class AsgiOnlyProtocol(EnvportWebSocketProtocol):
        def take_over(self) -> None:
            return None

    return AsgiOnlyProtocol


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

    from envport.server.app import create_app

    config = config or ServerConfig()
    app = create_app(env, config, host=host)
    uvicorn.Server(
        uvicorn_config(app, host=host, port=port, config=config, log_level=log_level)
    ).run()
