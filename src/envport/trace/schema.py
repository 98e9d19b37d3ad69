"""The published JSON Schema of :class:`~envport.trace.model.Trace`.

``docs/trace.schema.json`` is generated from the model and committed; a test keeps the
two equal. Regenerate it after changing the model::

    python -m envport.trace docs/trace.schema.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from envport.trace.model import SCHEMA_VERSION, Trace

SCHEMA_ID = f"https://envport.dev/schemas/trace/v{SCHEMA_VERSION}.json"


def trace_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a serialised trace."""
    schema = Trace.model_json_schema(mode="serialization")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        **schema,
    }


def render_schema() -> str:
    """The schema as the committed file holds it: indented, sorted, newline-terminated."""
    return json.dumps(trace_json_schema(), indent=2, sort_keys=True) + "\n"


def write_schema(path: str | Path) -> Path:
    """Write the schema to ``path`` and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_schema(), encoding="utf-8")
    return path
