"""Moving traces in and out of a store: JSONL and Parquet.

* **JSONL** — one :class:`~envport.trace.model.Trace` per line, exactly its JSON form.
  Lossless, streamable, diffable; the format to archive and to exchange.
* **Parquet** — one row per trace: the columns analysts filter on (``trace_id``,
  ``run_id``, ``task_id``, ``rollout_id``, ``group_id``, ``attempt``, ``status``,
  ``reward``, ``policy_version``, ``created_at``, ``schema_version``) plus ``body``, the
  trace's full JSON. Readers such as DuckDB or pandas query the columns directly; import
  reads ``body``, so the round trip is lossless however the model evolves. Needs the
  ``envport[parquet]`` extra (pyarrow), imported only when used.

Readers validate every record and raise :class:`TraceFormatError` naming the file and
the line (JSONL, 1-based) or row (Parquet, 0-based) that is wrong.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from envport.trace.errors import TraceFormatError, short_validation_error
from envport.trace.model import Trace
from envport.trace.store import StatusFilter, TraceStore, check_reward

Format = Literal["jsonl", "parquet"]

#: Columns of the Parquet layout, besides ``body``.
PARQUET_COLUMNS = (
    "trace_id",
    "run_id",
    "task_id",
    "rollout_id",
    "group_id",
    "attempt",
    "status",
    "reward",
    "policy_version",
    "created_at",
    "schema_version",
)


# --- JSONL ------------------------------------------------------------------------------


def write_jsonl(traces: Iterable[Trace], path: str | Path) -> int:
    """Write ``traces`` to ``path``, one per line; returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for trace in traces:
            f.write(trace.to_json())
            f.write("\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> Iterator[Trace]:
    """Yield each trace in ``path``. Blank lines are skipped; anything else that is not
    a valid trace raises :class:`TraceFormatError` naming its line."""
    for _where, trace in _jsonl_records(path):
        yield trace


def _jsonl_records(path: str | Path) -> Iterator[tuple[dict[str, Any], Trace]]:
    """Each trace of a JSONL file, with where it is (for errors found later)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            location = f"{path}:{lineno}"
            try:  # line by line, so a byte that is not UTF-8 is reported with its line
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(
                    f"line is not UTF-8 text: {exc}", location=location, line=lineno
                ) from exc
            if not line.strip():
                continue
            try:
                trace = Trace.model_validate_json(line)
            except ValidationError as exc:
                if exc.errors()[0]["type"] == "json_invalid":
                    detail = f"line is not valid JSON: {exc.errors()[0]['msg']}"
                else:
                    detail = f"line is not a valid trace: {short_validation_error(exc)}"
                raise TraceFormatError(detail, location=location, line=lineno) from exc
            yield {"location": location, "line": lineno}, trace


# --- Parquet ----------------------------------------------------------------------------


def _pyarrow() -> tuple[Any, Any]:
    try:
        pa = importlib.import_module("pyarrow")
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError as exc:
        raise ImportError(
            "Parquet export/import needs pyarrow: pip install 'envport[parquet]'"
        ) from exc
    return pa, pq


def _schema(pa: Any) -> Any:
    return pa.schema(
        [
            ("trace_id", pa.string()),
            ("run_id", pa.string()),
            ("task_id", pa.string()),
            ("rollout_id", pa.string()),
            ("group_id", pa.string()),
            ("attempt", pa.int64()),
            ("status", pa.string()),
            ("reward", pa.float64()),
            ("policy_version", pa.string()),
            ("created_at", pa.timestamp("us", tz="UTC")),
            ("schema_version", pa.int64()),
            ("body", pa.large_string()),
        ]
    )


def _row(trace: Trace) -> dict[str, Any]:
    pv = trace.policy_version
    return {
        "trace_id": trace.trace_id,
        "run_id": trace.run_id,
        "task_id": trace.task_id,
        "rollout_id": trace.rollout_id,
        "group_id": trace.group_id,
        "attempt": trace.attempt,
        "status": trace.status.value,
        "reward": trace.reward,
        "policy_version": None if pv is None else str(pv),
        "created_at": trace.created_at,
        "schema_version": trace.schema_version,
        "body": trace.to_json(),
    }


def write_parquet(traces: Iterable[Trace], path: str | Path, *, row_group_size: int = 1000) -> int:
    """Write ``traces`` to a Parquet file, ``row_group_size`` rows per group."""
    pa, pq = _pyarrow()
    schema = _schema(pa)
    n = 0
    with pq.ParquetWriter(str(path), schema, compression="zstd") as writer:
        batch: list[dict[str, Any]] = []
        for trace in traces:
            batch.append(_row(trace))
            if len(batch) >= row_group_size:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n += len(batch)
                batch = []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
    return n


def read_parquet(path: str | Path) -> Iterator[Trace]:
    """Yield each trace of a Parquet file written by :func:`write_parquet`."""
    for _where, trace in _parquet_records(path):
        yield trace


def _parquet_records(path: str | Path) -> Iterator[tuple[dict[str, Any], Trace]]:
    """Each trace of a Parquet file, with where it is (for errors found later)."""
    _pa, pq = _pyarrow()
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, …
        raise TraceFormatError(f"not a readable Parquet file: {exc}", location=str(path)) from exc
    if "body" not in pf.schema_arrow.names:
        raise TraceFormatError(
            "Parquet file has no 'body' column; it was not written by envport",
            location=str(path),
        )
    row = 0
    for batch in pf.iter_batches(columns=["body"]):
        for body in batch.column(0).to_pylist():
            location = f"{path}:row {row}"
            if body is None:
                raise TraceFormatError("row has no body", location=location, row=row)
            try:
                trace = Trace.model_validate_json(body)
            except ValidationError as exc:
                raise TraceFormatError(
                    f"body is not a valid trace: {short_validation_error(exc)}",
                    location=location,
                    row=row,
                ) from exc
            yield {"location": location, "row": row}, trace
            row += 1


# --- store <-> file ---------------------------------------------------------------------


def format_of(path: str | Path, fmt: Format | None = None) -> Format:
    """``fmt``, or the format ``path``'s suffix names; ``ValueError`` if it names none."""
    if fmt is not None:
        return fmt
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"cannot tell the format of {str(path)!r}; pass format='jsonl' or 'parquet'")


def export_traces(
    store: TraceStore,
    path: str | Path,
    *,
    format: Format | None = None,
    run_id: str | None = None,
    task_id: str | None = None,
    status: StatusFilter = None,
) -> int:
    """Write the store's matching traces to ``path`` (format from the suffix)."""
    traces = store.iter_traces(run_id=run_id, task_id=task_id, status=status)
    if format_of(path, format) == "jsonl":
        return write_jsonl(traces, path)
    return write_parquet(traces, path)


def import_traces(
    store: TraceStore, path: str | Path, *, format: Format | None = None, batch_size: int = 500
) -> int:
    """Upsert every trace of ``path`` into ``store``; returns how many.

    The file is validated in full first, so a bad record (reported as a
    :class:`TraceFormatError` naming its line or row) leaves the store untouched; a
    trace whose reward is not finite, which no store takes, is such a record.
    """
    fmt = format_of(path, format)

    def reader() -> Iterator[Trace]:
        return read_jsonl(path) if fmt == "jsonl" else read_parquet(path)

    records = _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path)
    for where, trace in records:  # validate everything before writing anything
        try:
            check_reward(trace)
        except ValueError as exc:
            raise TraceFormatError(str(exc), **where) from exc
    n = 0
    batch: list[Trace] = []
    for trace in reader():
        batch.append(trace)
        if len(batch) >= batch_size:
            n += store.put_many(batch)
            batch = []
    if batch:
        n += store.put_many(batch)
    return n
