"""Training rows to JSONL and Parquet, in three shapes.

``shape="envport"`` (default, lossless; :func:`read_rows_jsonl` / :func:`read_rows_parquet`
read it back): the generic columns ``prompt_ids``, ``completion_ids``,
``completion_mask`` (0/1), ``completion_logprobs`` (0.0 where the mask is 0; null when
the row has none), ``reward``, ``advantage``, ``group_id``, plus ``trace_id``,
``rollout_id``, ``step_rewards`` ([index, reward] pairs), ``policy_versions`` (as
strings), ``num_turns``, ``call_ids``, ``spans``, ``temperatures``, ``split_reason``,
``fragment``, ``num_fragments``, ``truncated``, ``labels`` and ``metadata`` (JSON text in
Parquet).

``shape="prime-rl"``: the fields of prime-rl's ``TrainingSample``
(``src/prime_rl/transport/types.py``, the msgspec struct its orchestrator sends to the
trainer): ``prompt_ids``, ``prompt_mask`` (all false: prompts are not trained on),
``completion_ids``, ``completion_mask`` (bool), ``completion_logprobs``,
``completion_temperatures`` (per token, from each call's sampling temperature, 1.0 when
the call sent none, as vLLM defaults, or sampled greedily), ``env_name``, ``advantage``,
``reward``. prime-rl moves these over its own transport (msgpack over files or ZMQ), not
from Parquet; this export is those columns for a bridge to fill its structs from.
Assumption: the field set is the one read from public copies of that file; it has
changed between releases (one variant flattens the sequence into
``token_ids``/``mask``/``logprobs``), so check it against the prime-rl version in use.
Rows without logprobs cannot be written in this shape (``completion_logprobs`` is
required there).

``shape="art"``: OpenPipe ART trains from ``Trajectory`` objects (messages and choices)
and tokenizes them itself, reading exact ids where the choices carry vLLM's token
fields: :func:`art_trajectory_groups` / :func:`write_art_jsonl` write ART's
``TrajectoryGroup`` JSON with those fields filled from the rows (checked against the
pydantic models of ``openpipe-art`` 0.5.23). The row shape ``art`` instead mirrors the
token fields of ART's older internal ``TokenizedResult`` (``token_ids`` = prompt +
completion, ``assistant_mask``, ``logprobs`` with NaN where no token was sampled,
``reward``, ``advantage``, ``prompt_length``) plus ``group_id``, for code that feeds ART's
trainer below the trajectory layer. Assumption: read from public copies of ART's
preprocessing code, not from a documented contract (0.5.x tokenizes into
``TokenizedTrajectory`` with per-token flags instead).

JSONL is written with Python's ``json`` (``NaN`` / ``-Infinity`` as its literals, which
Python, pandas and DuckDB read). Parquet needs pyarrow (``envport[parquet]``), imported
only when used.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from envport.trace.model import Message, Trace, TraceStatus
from envport.train.rows import Decoder, TrainingRow, build_rows

Shape = Literal["envport", "prime-rl", "art"]
SHAPES: tuple[Shape, ...] = ("envport", "prime-rl", "art")


def _envport(row: TrainingRow) -> dict[str, Any]:
    return {
        "prompt_ids": row.prompt_ids,
        "completion_ids": row.completion_ids,
        "completion_mask": row.mask,
        "completion_logprobs": row.logprobs,
        "reward": row.reward,
        "advantage": row.advantage,
        "group_id": row.group_id,
        "trace_id": row.trace_id,
        "rollout_id": row.rollout_id,
        "step_rewards": [[i, r] for i, r in row.step_rewards],
        "policy_versions": [None if v is None else str(v) for v in row.policy_versions],
        "num_turns": row.num_turns,
        "call_ids": row.call_ids,
        "spans": [[s, e] for s, e in row.spans],
        "temperatures": row.temperatures,
        "split_reason": row.split_reason,
        "fragment": row.fragment,
        "num_fragments": row.num_fragments,
        "truncated": row.truncated,
        "labels": row.labels,
        "metadata": row.metadata,
    }


def _token_temperatures(row: TrainingRow) -> list[float]:
    """Each completion token's temperature: its call's (gap tokens take the next call's).

    A greedy call (temperature 0, or none given) counts as 1.0, as in
    :func:`envport.train.grpo.pack`: its logprobs are the plain logits' (a trainer
    divides the logits by this number)."""
    out: list[float] = []
    for (_, end), temp in zip(row.spans, row.temperatures, strict=True):
        out += [temp if temp is not None and temp > 0 else 1.0] * (end - len(out))
    return out + [out[-1] if out else 1.0] * (len(row.completion_ids) - len(out))


def _prime_rl(row: TrainingRow) -> dict[str, Any]:
    if row.logprobs is None:
        raise ValueError(
            f"row of trace {row.trace_id!r} has no logprobs; prime-rl's TrainingSample "
            "requires completion_logprobs (filter rows with logprobs=None first)"
        )
    return {
        "prompt_ids": row.prompt_ids,
        "prompt_mask": [False] * len(row.prompt_ids),
        "completion_ids": row.completion_ids,
        "completion_mask": [bool(m) for m in row.mask],
        "completion_logprobs": row.logprobs,
        "completion_temperatures": _token_temperatures(row),
        "env_name": str(row.metadata.get("env_id") or ""),
        "advantage": row.advantage,
        "reward": row.reward,
    }


def _art(row: TrainingRow) -> dict[str, Any]:
    nan = math.nan
    lps = row.logprobs
    return {
        "token_ids": row.prompt_ids + row.completion_ids,
        "assistant_mask": [0] * len(row.prompt_ids) + row.mask,
        "logprobs": [nan] * len(row.prompt_ids)
        + [
            (lps[i] if lps is not None and m else nan)
            for i, m in enumerate(row.mask)  # NaN where nothing was sampled
        ],
        "reward": row.reward,
        "advantage": row.advantage,
        "prompt_length": len(row.prompt_ids),
        "group_id": row.group_id,
    }


def to_record(row: TrainingRow, shape: Shape = "envport") -> dict[str, Any]:
    """One row as a plain dict in ``shape``."""
    if shape == "envport":
        return _envport(row)
    if shape == "prime-rl":
        return _prime_rl(row)
    if shape == "art":
        return _art(row)
    raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")


def from_record(record: dict[str, Any]) -> TrainingRow:
    """A row back from an ``envport``-shape record."""
    versions: list[int | str | None] = []
    for v in record["policy_versions"]:
        versions.append(int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v)
    metadata = record.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    return TrainingRow(
        prompt_ids=record["prompt_ids"],
        completion_ids=record["completion_ids"],
        mask=record["completion_mask"],
        logprobs=record["completion_logprobs"],
        reward=record["reward"],
        advantage=record["advantage"],
        group_id=record["group_id"],
        trace_id=record["trace_id"],
        rollout_id=record["rollout_id"],
        step_rewards=[(int(i), float(r)) for i, r in record["step_rewards"]],
        policy_versions=versions,
        num_turns=record["num_turns"],
        call_ids=record["call_ids"],
        spans=[(int(s), int(e)) for s, e in record["spans"]],
        temperatures=record["temperatures"],
        split_reason=record["split_reason"],
        fragment=record["fragment"],
        num_fragments=record["num_fragments"],
        truncated=record["truncated"],
        labels=record["labels"],
        metadata=metadata,
    )


# --- JSONL ------------------------------------------------------------------------------


def write_rows_jsonl(
    rows: Iterable[TrainingRow], path: str | Path, *, shape: Shape = "envport"
) -> int:
    """Write one record per line; returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(to_record(row, shape)))
            f.write("\n")
            n += 1
    return n


def read_rows_jsonl(path: str | Path) -> Iterator[TrainingRow]:
    """Rows of an ``envport``-shape JSONL file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield from_record(json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not an envport training row: {exc}") from exc


# --- Parquet ----------------------------------------------------------------------------


def _pyarrow() -> tuple[Any, Any]:
    try:
        pa = importlib.import_module("pyarrow")
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError as exc:
        raise ImportError("Parquet export needs pyarrow: pip install 'envport[parquet]'") from exc
    return pa, pq


def _schema(pa: Any, shape: Shape) -> Any:
    ints, floats = pa.list_(pa.int64()), pa.list_(pa.float64())
    if shape == "prime-rl":
        bools = pa.list_(pa.bool_())
        fields = [
            ("prompt_ids", ints),
            ("prompt_mask", bools),
            ("completion_ids", ints),
            ("completion_mask", bools),
            ("completion_logprobs", floats),
            ("completion_temperatures", floats),
            ("env_name", pa.string()),
            ("advantage", pa.float64()),
            ("reward", pa.float64()),
        ]
    elif shape == "art":
        fields = [
            ("token_ids", ints),
            ("assistant_mask", ints),
            ("logprobs", floats),
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
            ("prompt_length", pa.int64()),
            ("group_id", pa.string()),
        ]
    else:
        fields = [
            ("prompt_ids", ints),
            ("completion_ids", ints),
            ("completion_mask", ints),
            ("completion_logprobs", floats),
            ("reward", pa.float64()),
            ("advantage", pa.float64()),
            ("group_id", pa.string()),
            ("trace_id", pa.string()),
            ("rollout_id", pa.string()),
            ("step_rewards", pa.list_(floats)),
            ("policy_versions", pa.list_(pa.string())),
            ("num_turns", pa.int64()),
            ("call_ids", pa.list_(pa.string())),
            ("spans", pa.list_(ints)),
            ("temperatures", floats),
            ("split_reason", pa.string()),
            ("fragment", pa.int64()),
            ("num_fragments", pa.int64()),
            ("truncated", pa.bool_()),
            ("labels", pa.list_(pa.string())),
            ("metadata", pa.large_string()),
        ]
    return pa.schema(fields)


def write_rows_parquet(
    rows: Iterable[TrainingRow],
    path: str | Path,
    *,
    shape: Shape = "envport",
    row_group_size: int = 1000,
) -> int:
    """Write rows to a Parquet file in ``shape``; returns how many."""
    pa, pq = _pyarrow()
    schema = _schema(pa, shape)
    n = 0
    with pq.ParquetWriter(str(path), schema, compression="zstd") as writer:
        batch: list[dict[str, Any]] = []

        def flush() -> None:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))

        for row in rows:
            record = to_record(row, shape)
            if shape == "envport":
                record["metadata"] = json.dumps(record["metadata"], default=str)
            batch.append(record)
            if len(batch) >= row_group_size:
                flush()
                n += len(batch)
                batch = []
        if batch or n == 0:
            flush()
            n += len(batch)
    return n


def read_rows_parquet(path: str | Path) -> Iterator[TrainingRow]:
    """Rows of an ``envport``-shape Parquet file."""
    _pa, pq = _pyarrow()
    for batch in pq.ParquetFile(str(path)).iter_batches():
        for record in batch.to_pylist():
            yield from_record(record)


# --- OpenPipe ART: Trajectory / TrajectoryGroup JSON ---------------------------------------

_ART_FINISH = ("stop", "length", "tool_calls", "content_filter", "function_call")
_Exact = tuple[list[int], list[int], list[float] | None]


def _wire_tool_calls(message: Message) -> list[dict[str, Any]]:
    return [
        {
            "id": tc.id,
            "type": "function",
            "function": {
                "name": tc.name,
                "arguments": tc.raw_arguments or json.dumps(tc.arguments),
            },
        }
        for tc in message.tool_calls
    ]


def _exact_calls(rows: Iterable[TrainingRow]) -> dict[str, _Exact]:
    """``call id -> (prompt ids, sampled ids, logprobs)`` of every call merged into ``rows``."""
    out: dict[str, _Exact] = {}
    for row in rows:
        for call_id, (start, end) in zip(row.call_ids, row.spans, strict=True):
            prompt = row.prompt_ids + row.completion_ids[:start]
            lps = None if row.logprobs is None else row.logprobs[start:end]
            out[call_id] = (prompt, row.completion_ids[start:end], lps)
    return out


def _art_choice(message: Message, finish: str | None, exact: _Exact | None) -> dict[str, Any]:
    """An assistant turn as the OpenAI ``Choice`` ART reads, with vLLM's token fields."""
    calls = _wire_tool_calls(message)
    wire: dict[str, Any] = {"role": "assistant", "content": message.text or None}
    if calls:
        wire["tool_calls"] = calls
    if finish not in _ART_FINISH:
        finish = "tool_calls" if calls else "stop"
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "message": wire}
    choice["logprobs"] = None
    if exact is not None:
        prompt_ids, ids, lps = exact
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = ids
        if lps is not None:
            content: list[dict[str, Any]] = [
                {"token": f"token_id:{t}", "bytes": None, "logprob": lp, "top_logprobs": []}
                for t, lp in zip(ids, lps, strict=True)
            ]
            choice["logprobs"] = {"content": content, "refusal": None}
    return choice


def art_trajectory(trace: Trace, rows: Iterable[TrainingRow]) -> dict[str, Any]:
    """One ART ``Trajectory`` (its ``messages_and_choices`` history) as JSON.

    The conversation is the trace's last branch. Each assistant turn whose model call
    was merged into ``rows`` becomes an OpenAI ``Choice`` carrying that call's exact
    ``prompt_token_ids`` and ``token_ids`` (vLLM's field names, which ART reads) and
    its logprobs (``token_id:N`` entries), all taken from the rows, so ART's tokenizer
    uses the sampled ids rather than re-tokenizing. Turns of calls that are in no row
    (unusable, see :mod:`envport.train.rows`) stay plain messages without token ids.
    """
    rows = list(rows)
    exact = _exact_calls(rows)
    # the finish reason of the choice each assistant turn is (n > 1: not always choice 0)
    finish = {ch.message_id: ch.finish_reason for c in trace.model_calls for ch in c.choices}
    call_finish = {c.id: c.finish_reason for c in trace.model_calls}
    leaves = trace.leaves()
    path = trace.path(leaves[-1].id) if leaves else []
    items: list[dict[str, Any]] = []
    for message in path:
        call_id = message.model_call_id
        if message.role == "assistant" and call_id:
            reason = finish[message.id] if message.id in finish else call_finish.get(call_id)
            items.append(_art_choice(message, reason, exact.get(call_id)))
            continue
        wire: dict[str, Any] = {"role": message.role, "content": message.text}
        if message.tool_calls:
            wire["tool_calls"] = _wire_tool_calls(message)
        if message.tool_call_id:
            wire["tool_call_id"] = message.tool_call_id
        items.append(wire)
    request = next((c.request for c in trace.model_calls if c.request), None) or {}
    versions = [c.policy_version for c in trace.model_calls if isinstance(c.policy_version, int)]
    return {
        "messages_and_choices": items,
        "tools": request.get("tools"),
        "reward": float(trace.reward) if trace.reward is not None else 0.0,
        "initial_policy_version": versions[0] if versions else None,
        "final_policy_version": versions[-1] if versions else None,
        "metrics": {
            **{k: float(v) for k, v in trace.metrics.items()},
            "envport_rows": len(rows),
            "envport_exact_turns": sum(1 for m in path if m.model_call_id in exact),
        },
        "metadata": {
            "trace_id": trace.trace_id,
            "rollout_id": trace.rollout_id,
            "task_id": trace.task_id,
            "env_id": trace.env_id,
            "group_id": trace.group_id,
            "split_reasons": ",".join(r.split_reason for r in rows if r.split_reason),
        },
        "logs": [],
    }


def art_trajectory_groups(
    traces: Iterable[Trace], *, tokenizer: Decoder | None = None
) -> list[dict[str, Any]]:
    """ART ``TrajectoryGroup`` JSON objects, one per ``group_id`` (in first-seen order).

    A completed trace becomes a trajectory (:func:`art_trajectory`); one that failed, or
    was not scored, goes into the group's ``exceptions`` (``type``, ``message``,
    ``traceback``) as ART records a rollout that raised: never a trajectory with reward 0.
    """
    groups: dict[str, dict[str, Any]] = {}
    for trace in traces:
        key = trace.group_id or trace.trace_id
        group = groups.setdefault(
            key,
            {
                "trajectories": [],
                "exceptions": [],
                "metadata": {"group_id": key},
                "metrics": {},
                "logs": [],
            },
        )
        result = build_rows(trace, tokenizer=tokenizer)
        if trace.status is TraceStatus.COMPLETED and trace.reward is not None:
            group["trajectories"].append(art_trajectory(trace, result.rows))
            continue
        error = trace.errors[0] if trace.errors else None
        group["exceptions"].append(
            {
                "type": (error.type or str(error.kind)) if error else "Unscored",
                "message": (
                    f"{trace.rollout_id}: {error.message}"
                    if error
                    else f"{trace.rollout_id}: status {trace.status}, no reward"
                ),
                "traceback": (error.traceback or "") if error else "",
            }
        )
    return list(groups.values())


def write_art_jsonl(
    traces: Iterable[Trace], path: str | Path, *, tokenizer: Decoder | None = None
) -> int:
    """One ART ``TrajectoryGroup`` per line; returns how many groups."""
    groups = art_trajectory_groups(traces, tokenizer=tokenizer)
    with open(path, "w", encoding="utf-8") as f:
        for group in groups:
            f.write(json.dumps(group))
            f.write("\n")
    return len(groups)
