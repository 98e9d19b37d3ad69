"""``python -m envport.server ENV [--host H] [--port P]``: serve without the CLI.

A ``module:Class`` ENV imports from the current directory first, as with ``envport serve``.
"""

from __future__ import annotations

import argparse
import json

from envport.errors import EnvportError
from envport.registry import import_from_cwd, resolve
from envport.server import ServerConfig, serve, ws_impl


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m envport.server")
    parser.add_argument("env", help="environment id or module:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=4096)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--env-options",
        default="{}",
        help="JSON object of keyword arguments for the environment's constructor",
    )
    args = parser.parse_args()
    try:
        options = json.loads(args.env_options)
    except json.JSONDecodeError as exc:
        parser.error(f"--env-options is not JSON: {exc}")
    if not isinstance(options, dict):
        parser.error("--env-options must be a JSON object")
    try:
        ws_impl()
    except ValueError as exc:
        parser.error(str(exc))
    import_from_cwd()
    try:
        factory, _ = resolve(args.env, options)
    except (EnvportError, ValueError, TypeError) as exc:
        parser.error(exc.message if isinstance(exc, EnvportError) else str(exc))
    serve(
        factory,
        host=args.host,
        port=args.port,
        config=ServerConfig(max_sessions=args.max_sessions),
        log_level=args.log_level,
    )


if __name__ == "__main__":
    main()
