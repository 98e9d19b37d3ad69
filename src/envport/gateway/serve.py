"""Run the gateway as a server: :func:`serve_gateway` (what ``envport gateway`` calls).

The orchestrator token comes from ``orchestrator_token``, else the
``ENVPORT_GATEWAY_TOKEN`` environment variable, else a fresh one printed to stderr once.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from envport.gateway.app import Gateway, create_gateway_app
from envport.gateway.capture import GatewayPolicy
from envport.gateway.upstream import RetryPolicy
from envport.trace.store import SQLiteTraceStore

TOKEN_ENV = "ENVPORT_GATEWAY_TOKEN"


def build_gateway(
    upstreams: Sequence[str],
    *,
    store: str | Path | None = None,
    orchestrator_token: str | None = None,
    public_url: str | None = None,
    request_token_ids: bool = False,
    max_attempts: int = 3,
    deadline_s: float = 600.0,
    upstream_api_key: str | None = None,
) -> Gateway:
    """A :class:`Gateway` configured as the command line would configure it."""
    return Gateway(
        list(upstreams),
        orchestrator_token=orchestrator_token or os.environ.get(TOKEN_ENV) or None,
        store=SQLiteTraceStore(store) if store is not None else None,
        policy=GatewayPolicy(request_token_ids=request_token_ids),
        retry=RetryPolicy(max_attempts=max_attempts, deadline_s=deadline_s),
        public_url=public_url,
        upstream_api_key=upstream_api_key,
    )


SWITCH_INTERVAL_S = 0.0005
GC_THRESHOLDS = (10_000, 10, 10)


def serve_gateway(
    upstreams: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    store: str | Path | None = None,
    orchestrator_token: str | None = None,
    public_url: str | None = None,
    request_token_ids: bool = False,
    max_attempts: int = 3,
    deadline_s: float = 600.0,
    upstream_api_key: str | None = None,
    log_level: str = "warning",
) -> None:
    """Serve a gateway on ``host:port`` until interrupted (blocking).

    ``upstreams`` are OpenAI-compatible base URLs ending in ``/v1``; ``store`` a SQLite
    file where finished rollouts land as traces.
    """
    from envport.gateway.front import serve_asgi  # the server, only when serving

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    given = orchestrator_token or os.environ.get(TOKEN_ENV)
    gateway = build_gateway(
        upstreams,
        store=store,
        orchestrator_token=given,
        public_url=public_url or f"http://{host}:{port}",
        request_token_ids=request_token_ids,
        max_attempts=max_attempts,
        deadline_s=deadline_s,
        upstream_api_key=upstream_api_key,
    )
    print(f"envport gateway on http://{host}:{port} -> {', '.join(upstreams)}", file=sys.stderr)
    if not given:
        print(f"orchestrator token: {gateway.orchestrator_token}", file=sys.stderr, flush=True)
    app = create_gateway_app(gateway)
    # What exists now (modules, models, the app) lives as long as the process: moved out
    # of the garbage collector's sight, so full collections, which pause every stream,
    # scan only what serving creates.
    gc.collect()
    gc.freeze()
    # A young-generation collection traverses every object still alive since the last
    # one: with dozens of streams in flight, their whole state (tasks, frames, buffers).
    # At the default threshold (700) that was a ~0.3 ms pause every dozen streamed calls
    # and a ~1.5 ms middle-generation pass every ~130, each in the way of whichever
    # requests were arriving; at GC_THRESHOLDS a pause costs about as much but comes about
    # ten times less often (bench/GATEWAY_RESULTS.md).
    gc.set_threshold(*GC_THRESHOLDS)
    # The trace writer's thread serializes traces while holding the GIL; when the event
    # loop wants it back it waits up to the switch interval (5 ms by default), which a
    # stream's next event would wait too. 0.5 ms bounds that wait; with one busy thread
    # besides the loop, the extra switches cost next to nothing.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        # envport's own HTTP/1.1 server (envport.gateway.front): per request it does only
        # what HTTP needs, and it starts each request's handler as soon as it is parsed:
        # under bursts of agents, both shorten every request's wait for the first token
        # (bench/GATEWAY_RESULTS.md).
        _run(serve_asgi(app, host, port))
    finally:
        if gateway.store is not None:
            gateway.store.store.close()


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when installed (the ``fast`` extra), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m envport.gateway --upstream URL [--upstream URL] --port P --store PATH``."""
    parser = argparse.ArgumentParser(
        prog="python -m envport.gateway",
        description="Record every model call of an unmodified agent.",
    )
    parser.add_argument("--upstream", action="append", required=True, help="base URL (…/v1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--store", default=None, help="SQLite trace store path")
    parser.add_argument("--public-url", default=None)
    parser.add_argument("--request-token-ids", action="store_true")
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=600.0)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    serve_gateway(
        args.upstream,
        host=args.host,
        port=args.port,
        store=args.store,
        public_url=args.public_url,
        request_token_ids=args.request_token_ids,
        max_attempts=args.max_attempts,
        deadline_s=args.deadline_s,
        log_level=args.log_level,
    )
