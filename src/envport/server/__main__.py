"""``python -m envport.server ENV [--host H] [--port P]``: serve without the CLI."""

from __future__ import annotations

import argparse

from envport.server import ServerConfig, serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m envport.server")
    parser.add_argument("env", help="environment id or module:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=4096)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    serve(
        args.env,
        host=args.host,
        port=args.port,
        config=ServerConfig(max_sessions=args.max_sessions),
        log_level=args.log_level,
    )


if __name__ == "__main__":
    main()
