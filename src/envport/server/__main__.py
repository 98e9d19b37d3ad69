"""``python -m envport.server ENV [--host H] [--port P]``: serve without the CLI.

A ``module:Class`` ENV imports from the current directory first, as with ``envport serve``.
An ENV that cannot be built (not loaded, or its constructor raises) is reported on stderr
as one line, ``envport-env-error: `` and the error's wire form (JSON), and the process
exits with status 3: whoever started it (the Kubernetes backend reads the pod's
termination message) can raise the environment's own error again instead of a crash.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from pydantic import ValidationError

from envport.errors import ENV_ERROR_EXIT, EnvportError, env_error_line
from envport.registry import import_from_cwd, resolve
from envport.server import ServerConfig, create_app, uvicorn_config, ws_impl


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m envport.server")
    parser.add_argument("env", help="environment id or module:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=4096)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin whose browser requests are accepted (repeatable; default none)",
    )
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
    except EnvportError as exc:
        _report(exc)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    try:
        config = ServerConfig(max_sessions=args.max_sessions, allowed_origins=args.allow_origin)
    except ValidationError as exc:
        options = {"max_sessions": "--max-sessions", "allowed_origins": "--allow-origin"}
        parser.error(
            "; ".join(
                f"{options.get(str(e['loc'][0]), e['loc'][0])}: "
                + e["msg"].removeprefix("Value error, ")
                for e in exc.errors()
            )
        )
    try:
        app = create_app(
            factory, config, host=args.host
        )  # builds one environment: its constructor runs
    except EnvportError as exc:
        _report(exc)
    import uvicorn

    uvicorn.Server(
        uvicorn_config(app, host=args.host, port=args.port, config=config, log_level=args.log_level)
    ).run()


def _report(exc: EnvportError) -> NoReturn:
    """Say on stderr, as one line of its wire form, that the environment cannot be
    built, and exit with :data:`ENV_ERROR_EXIT`."""
    print(env_error_line(exc), file=sys.stderr)
    raise SystemExit(ENV_ERROR_EXIT)


if __name__ == "__main__":
    main()
