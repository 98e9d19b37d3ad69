"""Serve an ASGI app on a real socket from a background thread.

Used wherever envport needs a server next to the code that drives it: the demo, ``envport
eval`` starting its local scripted model, environment servers for a run, and the tests.
The context manager owns the thread and joins it on exit; nothing is left running.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Where :func:`free_port` looks: from here up to the kernel's ephemeral range (above
#: Ray's worker ports, 10002-19999 by default, which a Ray node refuses to share).
_PICK_FROM = 20000
_pick = random.Random()  # its own: never the global generator an environment seeds


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections and ``bind(0)``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess, and the bind check still holds


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a server (a subprocess, say) to bind later.

    Picked below the kernel's ephemeral range: ports in that range go to outgoing
    connections at any moment, so one found free there can be taken before the server
    binds it (even by a connection to that same port, which then connects to itself).
    When the server can bind first and report its port, prefer that
    (:func:`listening_socket`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    for _ in range(64 if low > _PICK_FROM + 1000 else 0):
        port = _pick.randrange(_PICK_FROM, low)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:  # no room below: any port
        sock.bind((host, 0))
        found: int = sock.getsockname()[1]
        return found


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a port of its own on ``host`` (not yet listening)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


@contextmanager
def serve_in_thread(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    config: Any = None,
    startup_timeout_s: float = 30.0,
    lean: bool = False,
) -> Iterator[str]:
    """Run ``app`` on uvicorn in a thread; yields ``http://HOST:PORT``.

    ``config`` is an envport ``ServerConfig`` for environment servers (frame limits, …);
    other apps get uvicorn's defaults. ``lean=True`` serves with envport's own HTTP/1.1
    server instead (:mod:`envport.gateway.front`, what ``envport gateway`` runs).
    """
    if lean:
        with _serve_lean_in_thread(app, host, port or 0, startup_timeout_s) as url:
            yield url
        return
    import uvicorn

    # Bound here and handed to uvicorn: a port found free, closed and bound again later
    # can be taken in between by any other process's connection.
    sockets: list[socket.socket] | None = None
    if not port:
        sockets = [listening_socket(host)]
        port = int(sockets[0].getsockname()[1])
    if config is not None:
        from envport.server import uvicorn_config

        uv_config = uvicorn_config(app, host=host, port=port, config=config)
    else:
        uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(
        target=server.run, args=(sockets,), name=f"envport-serve-{port}", daemon=True
    )
    try:
        thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                raise RuntimeError(f"server on {host}:{port} did not start")
            time.sleep(0.01)
        try:
            yield f"http://{host}:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    finally:
        for sock in sockets or ():
            sock.close()  # uvicorn closes it on shutdown; not if it never started


@contextmanager
def _serve_lean_in_thread(
    app: Any, host: str, port: int, startup_timeout_s: float
) -> Iterator[str]:
    import asyncio

    from envport.gateway.front import serve_asgi

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()  # bound to the loop that first waits on it: the thread's
    bound: list[int] = []
    failed: list[BaseException] = []
    ready = threading.Event()

    def listening(p: int) -> None:
        bound.append(p)
        ready.set()

    def run() -> None:
        try:
            loop.run_until_complete(serve_asgi(app, host, port, stop=stop, ready=listening))
        except BaseException as exc:  # startup failed: told to the caller
            failed.append(exc)
        finally:
            ready.set()
            loop.close()

    def stop_soon() -> None:
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(stop.set)

    thread = threading.Thread(target=run, name=f"envport-serve-{port}", daemon=True)
    thread.start()
    if not ready.wait(startup_timeout_s) or not bound:
        stop_soon()
        raise RuntimeError(f"server on {host}:{port} did not start") from (
            failed[0] if failed else None
        )
    try:
        yield f"http://{host}:{bound[0]}"
    finally:
        stop_soon()
        thread.join(timeout=60)
