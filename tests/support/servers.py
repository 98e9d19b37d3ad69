"""Run real servers on real sockets for tests: uvicorn in a thread, ephemeral port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from envport.server import ServerConfig, create_app
from envport.serving import free_port, serve_in_thread
from envport.session import EnvFactory

__all__ = ["free_port", "run_asgi", "run_env_server"]


@contextmanager
def run_asgi(app: Any, config: ServerConfig | None = None) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1; yields ``http://127.0.0.1:PORT``."""
    with serve_in_thread(app, config=config or ServerConfig()) as url:
        yield url


@contextmanager
def run_env_server(
    env: str | EnvFactory, config: ServerConfig | None = None, *, mcp: bool = True
) -> Iterator[tuple[str, Any]]:
    """Serve an environment on 127.0.0.1 (so with the MCP transport's DNS-rebinding
    protection, as ``envport serve`` has by default); yields (base URL, the Starlette app)."""
    config = config or ServerConfig()
    app = create_app(env, config, mcp=mcp, host="127.0.0.1")
    with run_asgi(app, config) as url:
        yield url, app
