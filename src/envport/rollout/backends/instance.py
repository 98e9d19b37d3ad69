"""The server process of one local or sandboxed instance.

``python -m envport.rollout.backends.instance ENV --sessions S --options JSON
--instance-id ID --error-file E``, then either ``--port-file F`` (TCP on ``--host``: the
server binds port 0 and writes the port it got to ``F``; the local backend) or ``--uds
PATH`` (a Unix socket; the sandbox backend).

This module is imported by no package ``__init__`` (``envport.rollout`` imports the
backends' modules), so ``-m`` runs it once, as ``__main__``, and never beside a copy
already imported (runpy's "found in sys.modules" RuntimeWarning).

An environment that cannot be built (an unknown id, a ``module:Class`` that does not
import, a constructor that raises) is not a crashed server. The process writes the
error's wire form (:meth:`~envport.errors.EnvportError.to_wire`) to ``--error-file``,
prints it as one line and exits with :data:`ENV_ERROR_EXIT`; the backend raises it again
as the environment's error (:func:`envport.rollout.backends.local.start_failure`), which
the controller classifies ``environment`` and does not retry, as in-process.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envport.errors import ENV_ERROR_EXIT, EnvportError, env_error_line


def instance_app(
    env: str, sessions: int, options: dict[str, Any], *, host: str | None = None
) -> tuple[Any, Any]:
    """The ASGI app (and its ServerConfig) that one instance process serves.

    ``host`` is the address the server binds (``None`` for a Unix socket): a loopback
    one turns on the ``/mcp`` endpoint's ``Host`` check, as ``envport serve`` does
    (:func:`~envport.server.security.mcp_security`).

    Raises an :class:`~envport.errors.EnvportError` when the environment cannot be built:
    the registry's own error, or :class:`~envport.errors.EnvFactoryError` naming what
    else its import or constructor raised (as a session's construction does)."""
    from envport.registry import resolve
    from envport.server import ServerConfig, create_app
    from envport.session import building_env

    # Room beyond the leased sessions for ones a dropped connection keeps for resume.
    config = ServerConfig(max_sessions=max(2 * sessions, sessions + 4))
    with building_env():
        factory, _ = resolve(env, options)
        return create_app(factory, config, host=host), config


def instance_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments every instance server process takes (env, sessions, options, id)."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("env", help="environment id or module:Class")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--options", default="{}", help="JSON keyword arguments for the env")
    parser.add_argument("--instance-id", default="", help="names the process for re-adoption")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of one instance's server process."""
    parser = instance_parser("python -m envport.rollout.backends.instance")
    parser.add_argument("--host", default="127.0.0.1")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port-file", help="listen on TCP; write the bound port here")
    where.add_argument("--uds", help="listen on this Unix socket instead of TCP")
    where.add_argument(
        "--fd", type=int, help="serve on this inherited, listening Unix socket (a sandbox's)"
    )
    parser.add_argument("--error-file", help="where to report an environment not built")
    args = parser.parse_args(argv)

    import socket

    import uvicorn

    from envport.server import uvicorn_config

    # A Unix socket binds no address (and no web page can reach one): no Host check.
    host = None if args.uds is not None or args.fd is not None else args.host
    try:
        app, config = instance_app(args.env, args.sessions, json.loads(args.options), host=host)
    except EnvportError as exc:
        if args.error_file:
            tmp = Path(args.error_file + ".tmp")
            tmp.write_text(json.dumps(exc.to_wire(), default=str))
            tmp.replace(args.error_file)
        print(env_error_line(exc), file=sys.stderr)
        raise SystemExit(ENV_ERROR_EXIT) from None
    if args.uds is not None:
        uv = uvicorn_config(app, host="127.0.0.1", port=0, config=config)
        uv.uds = args.uds  # a Unix socket instead of TCP: a sandbox has no shared network
        uvicorn.Server(uv).run()
        return
    if args.fd is not None:
        # The controller made and bound it outside the sandbox, where nothing inside can
        # replace it (a path in the sandbox's /tmp could be swapped for a symlink that the
        # controller would follow on the host).
        listener = socket.socket(fileno=args.fd)
        uv = uvicorn_config(app, host="127.0.0.1", port=0, config=config)
        uvicorn.Server(uv).run(sockets=[listener])
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, 0))
    port = sock.getsockname()[1]
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(args.port_file)  # appears whole, or not at all
    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=port, config=config))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
