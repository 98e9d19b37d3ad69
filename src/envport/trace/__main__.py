"""``python -m envport.trace OUTPUT.json``: write the trace JSON Schema."""

from __future__ import annotations

import sys

from envport.trace.schema import write_schema


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m envport.trace OUTPUT.json", file=sys.stderr)
        return 2
    print(write_schema(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
