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

from envport.errors import EnvFactoryError, EnvportError
from envport.registry import import_from_cwd, resolve
from envport.server import ServerConfig, create_app, uvicorn_config, ws_impl

#: How a line on stderr that carries an environment's error as its wire form starts.
ENV_ERROR_MARK = "envport-env-error: "
#: The exit status when the environment cannot be loaded.
ENV_ERROR_EXIT = 3


def env_error_in(text: str) -> EnvportError | None:
    """The environment error a server reported in ``text`` (its log or a pod's
    termination message), rebuilt from its wire form, if any."""
    from envport.errors import from_wire

    for line in reversed(text.splitlines()):
        if line.startswith(ENV_ERROR_MARK):
            try:
                data = json.loads(line[len(ENV_ERROR_MARK) :])
            except ValueError:
                return None
            return from_wire(data) if isinstance(data, dict) else None
    return None


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
    except EnvportError as exc:
        _report(exc)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    config = ServerConfig(max_sessions=args.max_sessions)
    try:
        app = create_app(factory, config)  # builds one environment: its constructor runs
    except EnvportError as exc:
        _report(exc)
    except Exception as exc:
        _report(EnvFactoryError(f"Could not create the environment: {type(exc).__name__}: {exc}"))
    import uvicorn

    uvicorn.Server(
        uvicorn_config(app, host=args.host, port=args.port, config=config, log_level=args.log_level)
    ).run()


def _report(exc: EnvportError) -> NoReturn:
    """Say on stderr, as one line of its wire form, that the environment cannot be
    built, and exit with :data:`ENV_ERROR_EXIT`."""
    print(f"{ENV_ERROR_MARK}{json.dumps(exc.to_wire(), default=str)}", file=sys.stderr)
    raise SystemExit(ENV_ERROR_EXIT)


if __name__ == "__main__":
    main()
