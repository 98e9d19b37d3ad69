"""The ASGI application: ``/ws``, OpenEnv's HTTP routes, session routes and ``/mcp``.

Everything that runs in the background (the session reaper, the MCP session manager)
lives in the lifespan's task group and is awaited on shutdown; shutdown closes every
live session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route, WebSocketRoute

from envport.loopwatch import LoopWatchdog
from envport.registry import resolve
from envport.server import http
from envport.server.openapi import openapi_document
from envport.server.security import OriginGuard, mcp_security
from envport.server.sessions import ServerConfig, SessionManager
from envport.server.ws import websocket_endpoint
from envport.session import EnvFactory, build_env
from envport.types import EnvMetadata


def create_app(
    env: str | EnvFactory,
    config: ServerConfig | None = None,
    *,
    mcp: bool = True,
    host: str | None = None,
) -> Starlette:
    """Serve ``env`` (a registry id, ``module:Class``, or a zero-argument factory).

    ``host`` is the address the server will bind, if known: a loopback one turns on the
    MCP transport's DNS-rebinding protection (:func:`~envport.server.security.mcp_security`).
    Browser requests from origins outside ``config.allowed_origins`` are refused either
    way (:class:`~envport.server.security.OriginGuard`).
    """
    config = config or ServerConfig()
    factory, env_name = resolve(env)
    manager = SessionManager(factory, config)
    probe = build_env(factory)  # a constructor's failure: EnvFactoryError
    meta: EnvMetadata = probe.metadata()  # a wrapper's: what it wraps
    meta.tools = [t.name for t in probe.tool_specs()]
    endpoint = None
    if mcp:
        from envport.mcp.server import MCPEndpoint

        endpoint = MCPEndpoint(
            manager, name=env_name, security=mcp_security(host, config.allowed_origins)
        )

    watchdog = None
    if config.stall_warn_s is not None:
        watchdog = LoopWatchdog(warn_s=config.stall_warn_s, exit_after_s=config.stall_exit_s)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await probe.close()
        if watchdog is not None:
            watchdog.start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(manager.reaper)
            try:
                if endpoint is not None:
                    async with endpoint.running():
                        yield
                else:
                    yield
            finally:
                tg.cancel_scope.cancel()
                try:
                    await manager.close_all()
                finally:
                    if watchdog is not None:
                        watchdog.stop()

    routes: list[Any] = [
        WebSocketRoute("/ws", websocket_endpoint),
        Route("/reset", http.reset, methods=["POST"]),
        Route("/step", http.step, methods=["POST"]),
        Route("/state", http.state, methods=["GET"]),
        Route("/health", http.health, methods=["GET"]),
        Route("/metadata", http.metadata, methods=["GET"]),
        Route("/schema", http.schema, methods=["GET"]),
        Route("/sessions", http.create_session, methods=["POST"]),
        Route("/sessions", http.delete_session, methods=["DELETE"]),
        Route("/stats", http.stats, methods=["GET"]),
        Route("/openapi.json", http.openapi, methods=["GET"]),
    ]
    if endpoint is not None:
        routes.append(Route("/mcp", endpoint.asgi, methods=["GET", "POST", "DELETE"]))
    guard = Middleware(OriginGuard, allowed=config.allowed_origins)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[guard])
    app.state.manager = manager
    app.state.watchdog = watchdog
    app.state.metadata = meta
    app.state.schemas = {
        **probe.schemas(),
        "tools": [t.model_dump() for t in probe.tool_specs()],
    }
    app.state.env_name = env_name
    app.state.openapi = openapi_document(
        title=meta.name or env_name,
        description=meta.description or "",
        schemas=app.state.schemas,
        mcp=endpoint is not None,
    )
    return app
