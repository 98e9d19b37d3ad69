"""Run real servers on real sockets for tests: uvicorn in a thread, ephemeral port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from envport.server import ServerConfig, create_app, uvicorn_config
from envport.session import EnvFactory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def run_asgi(app: Any, config: ServerConfig | None = None) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1; yields ``http://127.0.0.1:PORT``."""
    config = config or ServerConfig()
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, config=config))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@contextmanager
def run_env_server(
    env: str | EnvFactory, config: ServerConfig | None = None, *, mcp: bool = True
) -> Iterator[tuple[str, Any]]:
    """Serve an environment; yields (base URL, the Starlette app)."""
    config = config or ServerConfig()
    app = create_app(env, config, mcp=mcp)
    with run_asgi(app, config) as url:
        yield url, app
