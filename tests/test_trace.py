"""Traces: the model, the SQLite store, export/import, and crash safety."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from envport.errors import EnvportError
from envport.trace import (
    AsyncTraceStore,
    Choice,
    ContentPart,
    ErrorKind,
    ForkRef,
    Message,
    ModelCall,
    Reward,
    Run,
    SamplingParams,
    SQLiteTraceStore,
    StepRecord,
    TokenLogprob,
    ToolCall,
    Trace,
    TraceError,
    TraceFormatError,
    TraceNotFoundError,
    TraceStatus,
    TraceStore,
    TraceStoreError,
    TraceStoreLockedError,
    Usage,
    export_traces,
    import_traces,
    read_jsonl,
    read_parquet,
    write_jsonl,
    write_parquet,
)
from envport.trace.schema import render_schema
from envport.trace.store import RolloutRecord
from tests.support.cli import envport_cli

REPO = Path(__file__).resolve().parents[1]
WRITER = Path(__file__).parent / "support" / "trace_writer.py"
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def full_trace(i: int = 0, **fields: object) -> Trace:
    """A trace that uses every part of the model."""
    trace = Trace(
        trace_id=f"t{i:04d}",
        run_id="run-a",
        task_id=f"task-{i % 3}",
        task_hash="sha256:abc",
        taskset="arith",
        rollout_id=f"r{i}",
        attempt=1,
        group_id=f"g{i // 4}",
        env_id="envport/arith-v1",
        harness="builtin",
        policy_version=7,
        status=TraceStatus.COMPLETED,
        stop_reason="no_tool_calls",
        created_at=T0 + timedelta(seconds=i),
        started_at=T0,
        finished_at=T0 + timedelta(seconds=3),
        timings={"setup": 0.2, "rollout": 2.5, "scoring": 0.1},
        metrics={"turns": 2.0},
        metadata={"note": "x"},
    )
    system = trace.reply("system", "You add numbers.")
    user = trace.reply(
        "user",
        [
            ContentPart(type="text", text="2+2?"),
            ContentPart(type="image_url", image_url={"url": "data:image/png;base64,AA"}),
        ],
    )
    call = ModelCall(
        id=f"mc{i}",
        step_index=0,
        model="qwen3-8b",
        provider="vllm",
        endpoint="http://gpu:8000/v1/chat/completions",
        api="chat.completions",
        sampling=SamplingParams(temperature=1.0, top_p=0.95, max_tokens=64, seed=3, min_tokens=1),
        input_message_ids=[system.id, user.id],
        request={"model": "qwen3-8b", "messages": []},
        original_request={"model": "qwen", "messages": []},
        response={"choices": [{"index": 0}]},
        prompt_token_ids=[1, 2, 3],
        choices=[
            Choice(
                index=0,
                finish_reason="tool_calls",
                completion_token_ids=[4, 5],
                completion_logprobs=[-0.25, float("-inf")],
                top_logprobs=[[TokenLogprob(token_id=4, token="a", logprob=-0.25)], []],
            )
        ],
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5, cached_tokens=0),
        started_at=T0,
        latency_s=0.5,
        ttft_s=0.05,
        streamed=True,
        attempts=2,
        policy_version=7,
    )
    trace.model_calls.append(call)
    assistant = trace.reply(
        "assistant",
        None,
        model_call_id=call.id,
        reasoning="use the tool",
        tool_calls=[ToolCall(id="c1", name="add", arguments={"a": 2, "b": 2})],
    )
    call.choices[0].message_id = assistant.id
    trace.reply("tool", "4", tool_call_id="c1", name="add")
    trace.steps.append(
        StepRecord(
            index=0,
            action={"a": 2, "b": 2},
            observation={"result": 4},
            tool_name="add",
            tool_call_id="c1",
            reward=0.5,
            latency_s=0.01,
        )
    )
    trace.rewards = [
        Reward(name="correct", value=1.0, weight=0.8),
        Reward(name="format", value=0.5, weight=0.2, reason="ok"),
    ]
    trace.reward = trace.weighted_reward()
    assert trace.reward == pytest.approx(0.9)
    trace.rewards.append(Reward(name="step", value=5.0, step_index=0))  # a step's own
    assert trace.weighted_reward() == pytest.approx(0.9)
    trace.rewards.pop()
    trace.errors.append(
        TraceError(kind=ErrorKind.SANDBOX, message="slow", where="sandbox", retryable=True)
    )
    return trace.model_copy(update=fields)


def store_at(tmp_path: Path) -> SQLiteTraceStore:
    return SQLiteTraceStore(tmp_path / "traces.db")


# --- the model --------------------------------------------------------------------------


def test_full_trace_round_trips_through_json_including_infinite_logprobs() -> None:
    trace = full_trace()
    text = trace.to_json()
    json.loads(text)  # strict JSON: no bare Infinity
    back = Trace.from_json(text)
    assert back == Trace.model_validate(json.loads(text))
    assert back.model_calls[0].choices[0].completion_logprobs is not None
    assert math.isinf(back.model_calls[0].choices[0].completion_logprobs[1])
    # -inf != -inf is False, so equality of the whole model is meaningful here
    assert back == trace
    assert back.model_calls[0].sampling.model_extra == {"min_tokens": 1}
    assert back.model_calls[0].finish_reason == "tool_calls"
    assert back.reward == pytest.approx(0.9)


def test_message_graph_holds_branches() -> None:
    trace = Trace()
    root = trace.reply("system", "sys")
    user = trace.reply("user", "q")
    a1 = trace.reply("assistant", "first answer")
    retry = trace.append_message(Message(role="assistant", content="second", parent_id=user.id))
    follow = trace.append_message(Message(role="user", content="more", parent_id=retry.id))

    assert [m.id for m in trace.children(user.id)] == [a1.id, retry.id]
    assert [m.id for m in trace.children(None)] == [root.id]
    assert [m.id for m in trace.leaves()] == [a1.id, follow.id]
    assert [m.text for m in trace.path(follow.id)] == ["sys", "q", "second", "more"]
    assert [[m.text for m in b] for b in trace.branches()] == [
        ["sys", "q", "first answer"],
        ["sys", "q", "second", "more"],
    ]
    # The graph survives serialisation.
    assert Trace.from_json(trace.to_json()).path(follow.id) == trace.path(follow.id)

    with pytest.raises(ValueError, match="not a message of this trace"):
        trace.append_message(Message(role="user", content="x", parent_id="nope"))
    with pytest.raises(KeyError, match="nope"):
        trace.path("nope")


def test_message_graph_rejects_unknown_parents_and_duplicate_ids() -> None:
    with pytest.raises(ValidationError, match="parents must come before their children"):
        Trace(messages=[Message(id="b", role="user", parent_id="a"), Message(id="a", role="user")])
    with pytest.raises(ValidationError, match="duplicate message id 'a'"):
        Trace(messages=[Message(id="a", role="user"), Message(id="a", role="user")])


def test_forked_trace_names_its_origin() -> None:
    fork = Trace(forked_from=ForkRef(trace_id="t0", message_id="m3", step_index=2))
    assert Trace.from_json(fork.to_json()).forked_from == fork.forked_from


def test_choice_token_ids_and_logprobs_must_align() -> None:
    with pytest.raises(ValidationError, match="2 completion_token_ids but 1 completion_logprobs"):
        Choice(completion_token_ids=[1, 2], completion_logprobs=[-0.1])


def test_newer_schema_version_is_refused_with_advice() -> None:
    data = json.loads(Trace().to_json())
    data["schema_version"] = 99
    with pytest.raises(ValidationError, match="upgrade envport"):
        Trace.model_validate(data)


def test_unknown_trace_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="rewrd"):
        Trace.model_validate({"rewrd": 1.0})


def test_trace_error_from_exception_classifies_and_keeps_the_traceback() -> None:
    try:
        raise ConnectionResetError("upstream reset")
    except ConnectionResetError as exc:
        err = TraceError.from_exception(
            exc, ErrorKind.MODEL_PROVIDER, where="gateway", retryable=True
        )
    assert err.kind is ErrorKind.MODEL_PROVIDER
    assert err.type == "ConnectionResetError"
    assert err.message == "upstream reset"
    assert err.traceback is not None
    assert "upstream reset" in err.traceback
    assert {k.value for k in ErrorKind} == {
        "model_provider",
        "harness",
        "environment",
        "sandbox",
        "rubric",
        "infrastructure",
        "task",
    }


def test_committed_schema_equals_generated() -> None:
    committed = (REPO / "docs" / "trace.schema.json").read_text(encoding="utf-8")
    assert committed == render_schema(), (
        "docs/trace.schema.json is stale; run: python -m envport.trace docs/trace.schema.json"
    )
    schema = json.loads(committed)
    assert schema["title"] == "Trace"
    for field in ("messages", "model_calls", "steps", "rewards", "errors", "policy_version"):
        assert field in schema["properties"]


def test_serialised_traces_validate_against_the_published_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "docs" / "trace.schema.json").read_text(encoding="utf-8"))
    trace = full_trace(metrics={"nan_metric": float("nan")})
    jsonschema.Draft202012Validator(schema).validate(json.loads(trace.to_json()))
    bad = json.loads(trace.to_json())
    bad["errors"][0]["kind"] = "cosmic_ray"
    with pytest.raises(jsonschema.ValidationError, match="cosmic_ray"):
        jsonschema.Draft202012Validator(schema).validate(bad)


def _non_finite_trace() -> Trace:
    """A trace with an infinity or a NaN in every float field, typed or free-form."""
    inf, nan = float("inf"), float("nan")
    return Trace(
        trace_id="nf",
        timings={"rollout": inf, "scoring": nan},
        metrics={"m": nan},
        rewards=[Reward(name="r", value=1.0, weight=inf)],
        model_calls=[
            ModelCall(
                model="m",
                sampling=SamplingParams(temperature=inf, top_p=nan, repetition_penalty=-inf),
                latency_s=inf,
                ttft_s=inf,
            )
        ],
        steps=[StepRecord(index=0, reward=nan, latency_s=inf, observation={"v": -inf})],
        metadata={"score": nan, "big": inf},
    )


def test_non_finite_floats_round_trip_and_match_the_published_schema(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "docs" / "trace.schema.json").read_text(encoding="utf-8"))
    trace = _non_finite_trace()
    text = trace.to_json()
    data = json.loads(text)  # strict JSON
    jsonschema.Draft202012Validator(schema).validate(data)  # timings' "Infinity" was refused
    with SQLiteTraceStore(tmp_path / "s.db") as store:
        store.put(trace)
        stored = store.get("nf")
    for back in (Trace.from_json(text), stored):
        # Every typed float field gives back the float.
        assert back.timings["rollout"] == math.inf
        assert math.isnan(back.timings["scoring"])
        assert math.isnan(back.metrics["m"])
        assert back.rewards[0].weight == math.inf
        call = back.model_calls[0]
        assert call.sampling.temperature == math.inf
        assert call.sampling.top_p is not None
        assert math.isnan(call.sampling.top_p)
        assert call.sampling.repetition_penalty == -math.inf
        assert call.latency_s == call.ttft_s == back.steps[0].latency_s == math.inf
        assert back.steps[0].reward is not None
        assert math.isnan(back.steps[0].reward)
        # Free-form JSON has no float type to restore: documented, they read back as strings.
        assert back.metadata == {"score": "NaN", "big": "Infinity"}
        assert back.steps[0].observation == {"v": "-Infinity"}


def test_latencies_stay_non_negative_in_model_and_schema() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        ModelCall(model="m", latency_s=-1.0)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        StepRecord(index=0, latency_s=float("nan"))
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "docs" / "trace.schema.json").read_text(encoding="utf-8"))
    data = json.loads(Trace(model_calls=[ModelCall(model="m", latency_s=1.0)]).to_json())
    data["model_calls"][0]["latency_s"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(data)


# --- the store --------------------------------------------------------------------------


def test_store_is_a_trace_store_in_wal_mode(tmp_path: Path) -> None:
    with store_at(tmp_path) as store:
        assert isinstance(store, TraceStore)
        assert store.schema_version == 2
    conn = sqlite3.connect(tmp_path / "traces.db")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = conn.execute("SELECT version, description FROM schema_migrations").fetchall()
        assert rows == [(1, "runs and traces"), (2, "rollout and attempt state (envport.rollout)")]
    finally:
        conn.close()
    # Reopening applies nothing twice.
    with store_at(tmp_path) as store:
        assert store.schema_version == 2


def test_store_refuses_a_database_from_a_newer_envport(tmp_path: Path) -> None:
    store_at(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "traces.db")
    with conn:
        conn.execute("INSERT INTO schema_migrations VALUES (42, 'future', 'now')")
    conn.close()
    with pytest.raises(TraceStoreError, match="schema version 42, newer"):
        store_at(tmp_path)


def test_store_refuses_a_file_that_is_not_sqlite(tmp_path: Path) -> None:
    bad = tmp_path / "traces.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(TraceStoreError, match="not a usable SQLite trace store"):
        SQLiteTraceStore(bad)


def test_store_crud(tmp_path: Path) -> None:
    with store_at(tmp_path) as store:
        trace = full_trace(1)
        store.put(trace)
        assert store.get("t0001") == trace
        assert store.has("t0001")

        updated = trace.model_copy(update={"status": TraceStatus.FAILED, "reward": None})
        store.put(updated)  # upsert
        assert store.get("t0001") == updated
        assert store.count() == 1
        assert store.count(status="failed") == 1

        assert store.delete("t0001") is True
        assert store.delete("t0001") is False
        with pytest.raises(TraceNotFoundError, match="t0001") as info:
            store.get("t0001")
        assert isinstance(info.value, EnvportError)
        assert isinstance(info.value, LookupError)

    with pytest.raises(TraceStoreError, match="closed"):
        store.get("t0001")


def test_store_full_sync_mode_and_checkpoint(tmp_path: Path) -> None:
    with SQLiteTraceStore(tmp_path / "full.db", synchronous="FULL") as store:
        store.put(Trace(trace_id="x"))
        store.checkpoint()
        assert store.get("x").trace_id == "x"
    with pytest.raises(ValueError, match="'NORMAL' or 'FULL'"):
        SQLiteTraceStore(tmp_path / "x.db", synchronous="OFF")  # type: ignore[arg-type]


def _seed(store: SQLiteTraceStore) -> list[Trace]:
    traces = []
    statuses = list(TraceStatus)
    for i in range(20):
        traces.append(
            full_trace(
                i,
                run_id="run-a" if i < 12 else "run-b",
                status=statuses[i % len(statuses)],
                reward=None if i % 5 == 4 else i / 20,
            )
        )
    assert store.put_many(traces) == 20
    return traces


def test_store_queries_by_run_task_status_and_reward(tmp_path: Path) -> None:
    with store_at(tmp_path) as store:
        traces = _seed(store)
        by_id = {t.trace_id: t for t in traces}

        def ids(found: list[Trace]) -> list[str]:
            return [t.trace_id for t in found]

        assert ids(store.query()) == sorted(by_id)  # oldest first
        assert ids(store.query(run_id="run-b")) == [f"t{i:04d}" for i in range(12, 20)]
        assert ids(store.query(task_id="task-1")) == [f"t{i:04d}" for i in range(1, 20, 3)]
        assert ids(store.query(status="failed")) == [f"t{i:04d}" for i in range(3, 20, 5)]
        assert ids(store.query(status=[TraceStatus.PENDING, "cancelled"])) == [
            f"t{i:04d}" for i in range(20) if i % 5 in (0, 4)
        ]
        assert ids(store.query(min_reward=0.5, max_reward=0.6)) == ["t0010", "t0011", "t0012"]
        assert ids(store.query(run_id="run-a", min_reward=0.5)) == ["t0010", "t0011"]
        assert ids(store.query(group_id="g1")) == ["t0004", "t0005", "t0006", "t0007"]
        assert ids(store.query(rollout_id="r3")) == ["t0003"]
        assert ids(store.query(limit=3, offset=2)) == ["t0002", "t0003", "t0004"]
        top = store.query(order_by="reward", descending=True, limit=2)
        assert ids(top) == ["t0018", "t0017"]
        # Unscored traces sort last whichever way.
        assert store.query(order_by="reward")[-1].reward is None
        assert store.query(task_id="task-2")[0] == by_id["t0002"]

        assert store.count() == 20
        assert store.count(run_id="run-a", status="completed") == 2
        assert store.count(min_reward=0.9) == 1
        assert store.count(group_id="g4", status=["failed", "cancelled"]) == 2
        assert store.count_by_status() == dict.fromkeys(TraceStatus, 4)
        assert store.count_by_status(run_id="run-b") == {
            TraceStatus.PENDING: 1,
            TraceStatus.RUNNING: 1,
            TraceStatus.COMPLETED: 2,
            TraceStatus.FAILED: 2,
            TraceStatus.CANCELLED: 2,
        }
        with pytest.raises(ValueError, match="unknown trace status 'done'; expected one of"):
            store.query(status="done")
        assert [t.trace_id for t in store.iter_traces(batch_size=3)] == sorted(by_id)
        assert len(list(store.iter_traces(run_id="run-b", batch_size=4))) == 8


def test_text_that_is_not_unicode_is_stored_as_replacement_characters(tmp_path: Path) -> None:
    # os.fsdecode (surrogateescape) makes a file name that is not UTF-8 a lone surrogate.
    # An in-process env that listed such a file made its trace unstorable: the store
    # raised PydanticSerializationError, and the controller's task group took the whole
    # eval down with it, the rollout left in "scoring" and its trace lost.
    name = b"caf\xe9.txt".decode("utf-8", "surrogateescape")
    trace = Trace(trace_id="t", run_id="r", status=TraceStatus.COMPLETED, reward=1.0)
    trace.reply("user", f"open {name}")
    trace.steps.append(StepRecord(index=0, observation={"files": [name]}, info={name: 1}))
    with store_at(tmp_path) as store:
        store.put(trace)
        back = store.get("t")
        assert back.messages[0].content == "open caf\ufffd.txt"
        assert back.steps[0].observation == {"files": ["caf\ufffd.txt"]}
        assert back.steps[0].info == {"caf\ufffd.txt": 1}
        assert back.reward == 1.0
        # The controller's path: the final trace and the rollout's state in one write.
        store.ensure_rollout(RolloutRecord(rollout_id=trace.rollout_id, run_id="r"))
        store.finish_rollout(trace.rollout_id, expect="pending", trace=trace, state="succeeded")
        assert store.get_rollout(trace.rollout_id).trace_id == "t"
        for suffix in (".jsonl", ".parquet"):
            assert export_traces(store, tmp_path / f"out{suffix}") == 1
            (read,) = (read_jsonl if suffix == ".jsonl" else read_parquet)(
                tmp_path / f"out{suffix}"
            )
            assert read == back
    assert trace.steps[0].observation == {"files": [name]}  # the trace itself is unchanged
    with pytest.raises(Exception, match="serializ"):  # what is not JSON at all still fails
        Trace(metadata={"x": object()}).to_json()


def test_store_runs(tmp_path: Path) -> None:
    with store_at(tmp_path) as store:
        run = Run(run_id="exp-1", name="baseline", config={"lr": 1e-6, "model": "m"}, created_at=T0)
        store.put_run(run)
        assert store.get_run("exp-1") == run
        store.put(Trace(run_id="exp-2"))  # a trace's run is created on first sight
        assert [r.run_id for r in store.list_runs()] == ["exp-1", "exp-2"]
        assert store.get_run("exp-2").config == {}
        with pytest.raises(TraceNotFoundError, match="runs: exp-1, exp-2"):
            store.get_run("exp-3")


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_store_refuses_a_non_finite_reward(tmp_path: Path, reward: float) -> None:
    # A NaN reward was stored as NULL and then counted as unscored.
    with store_at(tmp_path) as store:
        with pytest.raises(ValueError, match=r"reward must be a finite number, or None"):
            store.put(Trace(trace_id="bad", run_id="r", reward=reward))
        batch = [Trace(trace_id="ok", run_id="r", reward=1.0), Trace(trace_id="bad", reward=reward)]
        with pytest.raises(ValueError, match="'bad' has reward"):
            store.put_many(batch)
        assert store.count() == 0  # the whole batch was refused
        store.put(Trace(trace_id="unscored", run_id="r", reward=None))
        store.put(Trace(trace_id="scored", run_id="r", reward=0.0))
        assert store.count(min_reward=0.0) == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_import_refuses_a_non_finite_reward_naming_the_record(tmp_path: Path, suffix: str) -> None:
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    path = tmp_path / f"in{suffix}"
    traces = [Trace(trace_id="ok", reward=1.0), Trace(trace_id="bad", reward=float("nan"))]
    (write_jsonl if suffix == ".jsonl" else write_parquet)(traces, path)
    where = f"{path}:2" if suffix == ".jsonl" else f"{path}:row 1"
    with store_at(tmp_path) as store:
        with pytest.raises(TraceFormatError, match="'bad' has reward nan") as info:
            import_traces(store, path)
        assert info.value.location == where
        assert store.count() == 0


def test_concurrent_writers_from_threads_and_two_connections(tmp_path: Path) -> None:
    shared = store_at(tmp_path)
    other = store_at(tmp_path)  # a second connection to the same file
    errors: list[BaseException] = []

    def writer(store: SQLiteTraceStore, w: int) -> None:
        try:
            for i in range(40):
                store.put(Trace(trace_id=f"w{w}-{i}", run_id="r", reward=float(i)))
                store.count(run_id="r")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=writer, args=(shared if w % 2 else other, w)) for w in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert shared.count() == 320
    assert other.count(min_reward=39) == 8
    shared.close()
    other.close()


def _open_and_write(path: str, i: int, barrier: Any, results: Any) -> None:
    """A process opening ``path`` the moment its peers do; reports 'ok' or the error."""
    try:
        barrier.wait(timeout=60)
        with SQLiteTraceStore(path) as store:
            for k in range(5):
                store.put(Trace(trace_id=f"p{i}-{k}", run_id=f"r{i}"))
        results.put((i, "ok"))
    except BaseException as exc:  # reported to the test
        results.put((i, f"{type(exc).__name__}: {exc}"))


def test_processes_opening_a_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    # Setting up a new file takes locks SQLite's busy timeout does not wait for (the
    # switch to WAL): without retrying, one of several processes failed at once.
    ctx = multiprocessing.get_context("fork")
    n = 8
    for rep in range(12):
        path = str(tmp_path / f"s{rep}.db")
        barrier = ctx.Barrier(n)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_open_and_write, args=(path, i, barrier, results)) for i in range(n)
        ]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=90) for _ in range(n)]
        for p in procs:
            p.join(timeout=30)
        failed = [o for o in outcomes if o[1] != "ok"]
        assert not failed, f"rep {rep}: {failed}"
        with SQLiteTraceStore(path) as store:
            assert store.count() == n * 5
            assert store.schema_version == 2


def test_a_store_locked_past_the_busy_timeout_is_a_lock_error(tmp_path: Path) -> None:
    store_at(tmp_path).close()
    holder = sqlite3.connect(tmp_path / "traces.db", isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")  # held until the end of the test
    try:
        started = time.monotonic()
        with pytest.raises(TraceStoreLockedError, match="is locked by another process") as info:
            SQLiteTraceStore(tmp_path / "traces.db", busy_timeout_s=0.5)
        assert 0.4 < time.monotonic() - started < 10
        assert "not a usable" not in str(info.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with store_at(tmp_path) as store:  # usable once the lock is gone
        assert store.count() == 0


_FULL_DISK_WRITER = """
import os, resource, signal, sys
from envport.trace import SQLiteTraceStore, Trace, TraceStatus, TraceStoreError

path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
store = SQLiteTraceStore(path)
store.put(Trace(trace_id="first", status=TraceStatus.COMPLETED, reward=1.0))
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path + "-wal") + 500_000, hard))
big = [Trace(trace_id=f"big{i}", metadata={"x": "y" * 300_000}) for i in range(20)]
try:
    store.put_many(big)
    print("stored")
except TraceStoreError as exc:
    print("error:", exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print("count:", store.count())
store.put_many(big[:2])  # the store is usable once there is room again
print("count:", store.count())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_write_that_runs_out_of_disk_reports_the_disk_error(tmp_path: Path) -> None:
    # A file-size limit makes the disk "full" for one real process. SQLite rolls the
    # transaction back by itself on such an I/O error; the store's own ROLLBACK then
    # failed, and the user read "cannot rollback - no transaction is active" instead.
    db = tmp_path / "full.db"
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_WRITER, str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("error: write to trace store"), lines
    assert "disk I/O error" in lines[0] or "disk is full" in lines[0], lines[0]
    assert "cannot rollback" not in lines[0]
    assert lines[1:] == ["count: 1", "count: 3"]  # nothing half-written, nothing stuck
    with SQLiteTraceStore(db) as store:
        assert sorted(t.trace_id for t in store.query()) == ["big0", "big1", "first"]


async def test_async_store_from_asyncio(tmp_path: Path) -> None:
    async with AsyncTraceStore(store_at(tmp_path)) as store:
        await asyncio.gather(*(store.put(Trace(trace_id=f"a{i}", run_id="r")) for i in range(20)))
        assert await store.count(run_id="r") == 20
        assert (await store.get("a3")).trace_id == "a3"
        assert len(await store.query(run_id="r", limit=5)) == 5
        assert (await store.count_by_status())[TraceStatus.PENDING] == 20
        await store.put_many([Trace(trace_id="b")])
        assert await store.delete("b")
        await store.put_run(Run(run_id="r2"))
        assert [r.run_id for r in await store.list_runs()] == ["r", "r2"]
        assert (await store.get_run("r2")).run_id == "r2"


async def test_async_store_writes_while_the_default_executor_is_full(tmp_path: Path) -> None:
    # Blocked work on the loop's default executor (sync reward functions still running
    # past their timeout) must not hold trace writes back: the facade has its own thread.
    loop = asyncio.get_running_loop()
    release = threading.Event()
    busy = ThreadPoolExecutor(max_workers=2)
    loop.set_default_executor(busy)
    blocked = [loop.run_in_executor(None, release.wait) for _ in range(4)]
    try:
        store = AsyncTraceStore(store_at(tmp_path))
        await asyncio.wait_for(store.put(Trace(trace_id="t", run_id="r")), timeout=10)
        assert await asyncio.wait_for(store.count(run_id="r"), timeout=10) == 1
        names = await asyncio.wait_for(
            store.run(lambda: threading.current_thread().name), timeout=10
        )
        assert names.startswith("envport-trace-store")
        await asyncio.wait_for(store.aclose(), timeout=10)
        assert all(not f.done() for f in blocked)  # the default executor was full throughout
    finally:
        release.set()
        await asyncio.gather(*blocked)
        busy.shutdown(wait=True)


async def test_async_store_close_closes_the_store_and_its_thread(tmp_path: Path) -> None:
    inner = store_at(tmp_path)
    store = AsyncTraceStore(inner)
    await store.put(Trace(trace_id="t"))
    worker = await store.run(threading.current_thread)
    assert worker is not threading.current_thread()
    await store.aclose()
    await store.aclose()  # twice is fine
    with pytest.raises(TraceStoreError, match="closed"):
        inner.count()
    with pytest.raises(TraceStoreError, match="closed"):
        await store.count()
    worker.join(timeout=10)  # the worker thread goes once the executor is shut down
    assert not worker.is_alive()
    with pytest.raises(ValueError, match="max_workers"):
        AsyncTraceStore(inner, max_workers=0)


# --- export / import --------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_import_round_trip(tmp_path: Path, suffix: str) -> None:
    with store_at(tmp_path) as source:
        traces = _seed(source)
        path = tmp_path / f"out{suffix}"
        assert export_traces(source, path) == 20
        assert export_traces(source, tmp_path / f"b{suffix}", run_id="run-b") == 8

    with SQLiteTraceStore(tmp_path / "copy.db") as copy:
        assert import_traces(copy, path) == 20
        assert copy.query() == traces
        assert import_traces(copy, path) == 20  # idempotent upsert
        assert copy.count() == 20
    reader = read_jsonl if suffix == ".jsonl" else read_parquet
    assert [t.run_id for t in reader(tmp_path / f"b{suffix}")] == ["run-b"] * 8


def test_parquet_has_queryable_columns(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    traces = [full_trace(i) for i in range(3)]
    assert write_parquet(traces, tmp_path / "t.parquet", row_group_size=2) == 3
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.column("trace_id").to_pylist() == ["t0000", "t0001", "t0002"]
    assert table.column("status").to_pylist() == ["completed"] * 3
    assert table.column("policy_version").to_pylist() == ["7"] * 3
    assert table.column("created_at").to_pylist()[1] == T0 + timedelta(seconds=1)
    assert list(read_parquet(tmp_path / "t.parquet")) == traces
    assert write_parquet([], tmp_path / "empty.parquet") == 0
    assert list(read_parquet(tmp_path / "empty.parquet")) == []


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"envport\[parquet\]"):
        write_parquet([Trace()], tmp_path / "t.parquet")


def test_bad_jsonl_lines_are_reported_by_line(tmp_path: Path) -> None:
    good = Trace(trace_id="ok").to_json()
    path = tmp_path / "bad.jsonl"

    path.write_text(f"{good}\n\n{{not json\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:3: line is not valid JSON") as info:
        list(read_jsonl(path))
    assert info.value.location == f"{path}:3"

    path.write_text(f'{good}\n{{"messages": [{{"role": "robot"}}]}}\n', encoding="utf-8")
    with pytest.raises(
        TraceFormatError, match=r"bad\.jsonl:2: line is not a valid trace: messages\.0\.role"
    ):
        list(read_jsonl(path))

    path.write_text(f'{good}\n{{"trace_id": "x", "attempt": 0}}\n', encoding="utf-8")
    with store_at(tmp_path) as store:
        with pytest.raises(TraceFormatError, match=r":2: .*attempt"):
            import_traces(store, path)
        assert store.count() == 0  # validated in full before anything was written

    path.write_text(f"{good}\n\n   \n{good}\n", encoding="utf-8")
    assert [t.trace_id for t in read_jsonl(path)] == ["ok", "ok"]


def test_bad_parquet_is_reported_by_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"body": [Trace().to_json(), '{"status": "weird"}']}), path)
    with pytest.raises(TraceFormatError, match=r"bad\.parquet:row 1: body is not a valid trace"):
        list(read_parquet(path))
    pq.write_table(pa.table({"x": [1]}), path)
    with pytest.raises(TraceFormatError, match="no 'body' column"):
        list(read_parquet(path))
    path.write_text("nope", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="not a readable Parquet file"):
        list(read_parquet(path))


def test_unknown_export_format_says_what_to_pass(tmp_path: Path) -> None:
    with store_at(tmp_path) as store, pytest.raises(ValueError, match="format='jsonl'"):
        export_traces(store, tmp_path / "out.csv")
    assert write_jsonl([], tmp_path / "empty.jsonl") == 0


# --- the traces command: errors ---------------------------------------------------------


def _one_error_line(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Assert ``result`` failed with exit 2 and one ``error:`` line holding ``expected``."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "nope.jsonl", ("nope.jsonl", "no such file")),
        (lambda d: (d / "x.txt", (d / "x.txt").write_text("{}\n"))[0], ("cannot tell its format",)),
        (lambda d: (d / "in", (d / "in").mkdir())[0], ("is not a file",)),
        (
            lambda d: (d / "bad.jsonl", (d / "bad.jsonl").write_bytes(b"\xff\xfe{}\n"))[0],
            ("bad.jsonl:1", "not UTF-8"),
        ),
        (
            lambda d: (d / "bad.jsonl", (d / "bad.jsonl").write_text('{"trace_id": 3}\n'))[0],
            ("bad.jsonl:1", "not a valid trace"),
        ),
    ],
    ids=["missing", "txt", "directory", "not-utf8", "not-a-trace"],
)
def test_traces_import_errors_are_one_line_and_create_no_store(
    tmp_path: Path, make: Any, expected: tuple[str, ...]
) -> None:
    source = make(tmp_path)
    before = _listing(tmp_path)
    store = tmp_path / "runs" / "new" / "s.db"
    result = envport_cli("traces", "import", str(source), "--store", str(store), cwd=tmp_path)
    _one_error_line(result, *expected)
    assert not (tmp_path / "runs").exists()  # no store, no folders made for it
    assert _listing(tmp_path) == before


def test_traces_import_error_leaves_an_existing_store_as_it_was(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with SQLiteTraceStore(db) as store:
        store.put(Trace(trace_id="kept"))
    (tmp_path / "bad.jsonl").write_text(Trace(trace_id="new").to_json() + "\nnot json\n")
    result = envport_cli("traces", "import", "bad.jsonl", "--store", str(db), cwd=tmp_path)
    _one_error_line(result, "bad.jsonl:2", "not valid JSON")
    with SQLiteTraceStore(db) as store:
        assert [t.trace_id for t in store.query()] == ["kept"]


def _newer_store(db: Path) -> None:
    SQLiteTraceStore(db).close()
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT INTO schema_migrations VALUES (42, 'future', 'now')")
    conn.close()


@pytest.mark.parametrize("command", [["list"], ["runs"], ["show", "t1"], ["export", "o.jsonl"]])
@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda db: db.write_text("hello\n"), "is not a usable SQLite trace store"),
        (_newer_store, "has schema version 42, newer than this envport knows"),
        (lambda db: db.mkdir(), "is not a trace store file"),
    ],
    ids=["not-sqlite", "newer-schema", "directory"],
)
def test_traces_commands_on_an_unusable_store_fail_in_one_line(
    tmp_path: Path, command: list[str], make: Any, expected: str
) -> None:
    db = tmp_path / "s.db"
    make(db)
    before = _listing(tmp_path)
    result = envport_cli("traces", *command, "--store", str(db), cwd=tmp_path)
    _one_error_line(result, expected)
    assert _listing(tmp_path) == before  # nothing created or changed


def test_traces_export_to_a_missing_directory_fails_in_one_line(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with SQLiteTraceStore(db) as store:
        store.put(Trace(trace_id="t1", run_id="r1"))
    for fmt in ("trace", "rows"):
        args = ["export", "nodir/out.jsonl", "--store", str(db), "--format", fmt]
        result = envport_cli("traces", *args, cwd=tmp_path)
        _one_error_line(result, "nodir/out.jsonl", "directory nodir does not exist")
    assert not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("command", [["export", "out.jsonl"], ["list"]])
def test_traces_run_filter_naming_no_stored_run_warns(tmp_path: Path, command: list[str]) -> None:
    """``--run`` with a typo quietly wrote "wrote 0 traces" (an empty table for list): it
    now warns on stderr, naming the runs the store holds; the exit status stays 0."""
    db = tmp_path / "s.db"
    with SQLiteTraceStore(db) as store:
        store.put(Trace(trace_id="t1", run_id="r1"))
        store.put(Trace(trace_id="t2", run_id="r2"))
    args = [*command, "--store", str(db)]
    typo = envport_cli("traces", *args, "--run", "r3", cwd=tmp_path)
    assert typo.returncode == 0, typo.stderr
    assert typo.stderr.strip().splitlines() == [
        f"warning: no traces of run 'r3' in {db}; runs there: r1, r2"
    ]
    if command[0] == "export":
        assert "wrote 0 traces" in typo.stdout
    known = envport_cli("traces", *args, "--run", "r1", cwd=tmp_path)
    assert known.returncode == 0, known.stderr
    assert known.stderr == ""


def test_a_stored_trace_that_does_not_parse_is_a_one_line_error(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with SQLiteTraceStore(db) as store:
        store.put(Trace(trace_id="t1", run_id="r1", created_at=T0))
        store.put(Trace(trace_id="t2", run_id="r1", created_at=T0 + timedelta(seconds=1)))
    conn = sqlite3.connect(db)
    with conn:  # as a newer envport would have written it
        body = json.loads(Trace(trace_id="t2", run_id="r1").to_json())
        conn.execute(
            "UPDATE traces SET body = ? WHERE trace_id = 't2'",
            (json.dumps({**body, "schema_version": 99}),),
        )
    conn.close()
    expected = ("trace 't2'", "does not parse", "schema_version", "newer than this envport")
    shown = envport_cli("traces", "show", "t2", "--store", str(db), cwd=tmp_path)
    _one_error_line(shown, *expected)
    listed = envport_cli("traces", "list", "--store", str(db), cwd=tmp_path)
    _one_error_line(listed, *expected)
    (tmp_path / "out.jsonl").write_text("earlier export\n")
    exported = envport_cli("traces", "export", "out.jsonl", "--store", str(db), cwd=tmp_path)
    _one_error_line(exported, "Cannot export to out.jsonl", *expected)
    # The earlier file is untouched and no partial file is left behind.
    assert (tmp_path / "out.jsonl").read_text() == "earlier export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "s.db"]
    assert envport_cli("traces", "show", "t1", "--store", str(db), cwd=tmp_path).returncode == 0


# --- crash safety -----------------------------------------------------------------------


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)


def _run_and_kill(db: Path, prefix: str, wanted: int) -> set[str]:
    """Start the writer, SIGKILL it after ``wanted`` acks; return every id it acked."""
    acked: set[str] = set()
    lines: queue.Queue[str] = queue.Queue()
    with subprocess.Popen(
        [sys.executable, str(WRITER), str(db), prefix],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        pump = threading.Thread(target=_pump, args=(proc, lines), daemon=True)
        pump.start()
        try:
            while len(acked) < wanted:
                try:
                    line = lines.get(timeout=20)
                except queue.Empty:
                    proc.kill()
                    pytest.fail(f"writer stalled; stderr:\n{proc.communicate()[1]}")
                if line.startswith("ack "):
                    acked.add(line.split()[1])
            proc.send_signal(signal.SIGKILL)  # mid-loop: most likely inside a write
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            pump.join(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    while not lines.empty():  # acks printed before the kill are acknowledged too
        line = lines.get_nowait()
        if line.startswith("ack "):
            acked.add(line.split()[1])
    return acked


def test_sigkill_during_writes_loses_no_acknowledged_trace(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    acked: set[str] = set()
    for round_, wanted in enumerate((25, 60, 40)):  # each round reopens the crashed file
        acked |= _run_and_kill(db, f"p{round_}", wanted)
        conn = sqlite3.connect(db)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            stored = {row[0] for row in conn.execute("SELECT trace_id FROM traces")}
        finally:
            conn.close()
        assert acked <= stored, f"lost acknowledged traces: {sorted(acked - stored)[:5]}"

    with SQLiteTraceStore(db) as store:
        assert store.count() >= len(acked) >= 125
        for trace_id in sorted(acked)[::10]:
            assert store.get(trace_id).trace_id == trace_id  # bodies parse
