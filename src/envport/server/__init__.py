"""envport's environment server: OpenEnv's protocol, stateful, many sessions per process.

``create_app(env, config)`` builds the ASGI app; ``serve(env, ...)`` runs it on uvicorn.
"""

from __future__ import annotations

import os
from typing import Any

from envport.server.app import create_app
from envport.server.sessions import ServerConfig, SessionManager
from envport.session import EnvFactory

__all__ = ["ServerConfig", "SessionManager", "create_app", "serve", "uvicorn_config"]


def uvicorn_config(
    app: Any, *, host: str, port: int, config: ServerConfig, log_level: str = "warning"
) -> Any:
    """A ``uvicorn.Config`` tuned for many small WebSocket frames."""
    import uvicorn

    ws_impl = os.environ.get("ENVPORT_WS_IMPL", "websockets-sansio")
    try:
        from uvicorn.protocols.websockets import websockets_sansio_impl  # noqa: F401
    except ImportError:  # older uvicorn
        ws_impl = "websockets"
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ws=ws_impl,
        # Frames up to twice the limit reach the app, which answers PAYLOAD_TOO_LARGE
        # and keeps the session; anything larger is cut by the protocol layer (1009).
        ws_max_size=config.max_frame_bytes * 2,
        ws_ping_interval=20.0,
        ws_ping_timeout=60.0,
        timeout_keep_alive=30,
        backlog=4096,
        lifespan="on",
    )


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
