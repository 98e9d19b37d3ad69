"""Traces: the full record of each run, where they are stored, and how they move.

* :mod:`envport.trace.model` — the versioned :class:`Trace` model (JSON Schema in
  ``docs/trace.schema.json``, see :mod:`envport.trace.schema`).
* :mod:`envport.trace.store` — the :class:`TraceStore` interface, the embedded
  :class:`SQLiteTraceStore` (WAL; acknowledged writes survive SIGKILL) and the
  :class:`AsyncTraceStore` facade.
* :mod:`envport.trace.export` — JSONL and Parquet export and import.
"""

from envport.trace.errors import (
    TraceFormatError,
    TraceNotFoundError,
    TraceStoreError,
    TraceStoreLockedError,
)
from envport.trace.export import (
    export_traces,
    import_traces,
    read_jsonl,
    read_parquet,
    write_jsonl,
    write_parquet,
)
from envport.trace.model import (
    SCHEMA_VERSION,
    Choice,
    ContentPart,
    ErrorKind,
    ForkRef,
    Message,
    ModelCall,
    Reward,
    Run,
    SamplingParams,
    StepRecord,
    TokenLogprob,
    ToolCall,
    Trace,
    TraceError,
    TraceStatus,
    Usage,
)
from envport.trace.schema import trace_json_schema, write_schema
from envport.trace.store import AsyncTraceStore, SQLiteTraceStore, TraceStore

__all__ = [
    "SCHEMA_VERSION",
    "AsyncTraceStore",
    "Choice",
    "ContentPart",
    "ErrorKind",
    "ForkRef",
    "Message",
    "ModelCall",
    "Reward",
    "Run",
    "SQLiteTraceStore",
    "SamplingParams",
    "StepRecord",
    "TokenLogprob",
    "ToolCall",
    "Trace",
    "TraceError",
    "TraceFormatError",
    "TraceNotFoundError",
    "TraceStatus",
    "TraceStore",
    "TraceStoreError",
    "TraceStoreLockedError",
    "Usage",
    "export_traces",
    "import_traces",
    "read_jsonl",
    "read_parquet",
    "trace_json_schema",
    "write_jsonl",
    "write_parquet",
    "write_schema",
]
