"""Where traces live: the :class:`TraceStore` interface and its SQLite implementation.

:class:`TraceStore` is a small synchronous protocol (put, get, query, count, runs), so a
server database can implement it later without touching callers; async code wraps any
store in :class:`AsyncTraceStore`, which runs each call in a worker thread of its own.

:class:`SQLiteTraceStore` is the embedded default: one file, no server. Each trace is
stored whole as its JSON body, with the columns that queries filter on (run, task,
rollout, group, status, reward, attempt, created) copied beside it and indexed. The body
is the truth; the columns are an index.

Durability. The database runs in WAL mode. ``put`` returns only after its transaction
has committed, that is, after its pages were written to the WAL file with ``write(2)``.
With ``synchronous=NORMAL`` (the default) SQLite does not ``fsync`` at each commit, but
the written pages sit in the operating system's page cache, which outlives the process:
a writer killed with SIGKILL loses no acknowledged trace, and the next open replays the
WAL into a valid database. Only an OS crash or power loss can drop the last few commits
(never corrupt the file); pass ``synchronous="FULL"`` to ``fsync`` every commit and
survive those too, at the cost of one disk flush per write.

Rollout state. Schema version 2 adds the ``rollouts`` and ``attempts`` tables that the
rollout controller (:mod:`envport.rollout`) keeps its state machines in
(:class:`RolloutRecord`, :class:`AttemptRecord`). State changes are compare-and-set
(:meth:`SQLiteTraceStore.advance_rollout` raises :class:`StaleStateError` when someone
else moved the rollout first), and :meth:`SQLiteTraceStore.finish_rollout` writes a
rollout's final trace together with its final state in one transaction, refusing a
second final trace for the same rollout: each rollout is stored exactly once.

Concurrency. One connection per store, guarded by a lock, so a store may be shared by
threads (and by :class:`AsyncTraceStore`'s worker). Several processes may open the same file; WAL
lets readers proceed while one writes, and ``busy_timeout`` queues writers. Opening
waits out the same timeout, retrying the locks SQLite does not queue (several processes
creating one new store at once); a lock held longer is a :class:`TraceStoreLockedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import math
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envport.trace.errors import (
    TraceNotFoundError,
    TraceStoreError,
    TraceStoreLockedError,
    short_validation_error,
)
from envport.trace.model import Run, Trace, TraceStatus

#: Back-off jitter from a generator of our own: never a draw from the global `random`,
#: which a user (or an environment) may have seeded.
_jitter = random.Random()

StatusFilter = TraceStatus | str | Sequence[TraceStatus | str] | None
OrderBy = Literal["created_at", "reward"]
_T = TypeVar("_T")


@runtime_checkable
class TraceStore(Protocol):
    """What every trace store offers. Writes are upserts keyed by ``trace_id``.

    A call that returns has been made durable to the store's promise (for SQLite: it
    survives the death of the writing process).
    """

    def put(self, trace: Trace) -> None:
        """Insert or replace one trace (and create its run if unknown).

        A ``reward`` that is not finite (NaN, ±inf) is refused with ``ValueError``: the
        reward is a finite number, or ``None`` when the trace was not scored."""
        ...

    def put_many(self, traces: Iterable[Trace]) -> int:
        """Insert or replace many traces in one transaction; returns how many."""
        ...

    def get(self, trace_id: str) -> Trace:
        """The trace; :class:`TraceNotFoundError` if there is none."""
        ...

    def delete(self, trace_id: str) -> bool:
        """Remove a trace; ``False`` if it was not there."""
        ...

    def query(
        self,
        *,
        run_id: str | None = None,
        task_id: str | None = None,
        rollout_id: str | None = None,
        group_id: str | None = None,
        status: StatusFilter = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        limit: int | None = None,
        offset: int = 0,
        order_by: OrderBy = "created_at",
        descending: bool = False,
    ) -> list[Trace]:
        """Traces matching every given filter (reward bounds are inclusive)."""
        ...

    def iter_traces(
        self,
        *,
        run_id: str | None = None,
        task_id: str | None = None,
        status: StatusFilter = None,
        batch_size: int = 500,
    ) -> Iterator[Trace]:
        """Every matching trace, oldest first, read in batches (for export)."""
        ...

    def count(
        self,
        *,
        run_id: str | None = None,
        task_id: str | None = None,
        rollout_id: str | None = None,
        group_id: str | None = None,
        status: StatusFilter = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
    ) -> int:
        """How many traces match (same filters as :meth:`query`)."""
        ...

    def count_by_status(self, *, run_id: str | None = None) -> dict[TraceStatus, int]:
        """Traces per status (every status present, zeros included)."""
        ...

    def put_run(self, run: Run) -> None: ...

    def get_run(self, run_id: str) -> Run: ...

    def list_runs(self) -> list[Run]:
        """Every run, oldest first."""
        ...

    def close(self) -> None: ...


# --- SQLite -----------------------------------------------------------------------------

#: Versioned migrations: (version, description, statements). Append; never edit.
_MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "runs and traces",
        (
            """CREATE TABLE runs (
                run_id     TEXT PRIMARY KEY,
                name       TEXT,
                config     TEXT NOT NULL DEFAULT '{}',
                created_at TEXT NOT NULL
            )""",
            """CREATE TABLE traces (
                trace_id       TEXT PRIMARY KEY,
                run_id         TEXT,
                task_id        TEXT,
                rollout_id     TEXT NOT NULL,
                group_id       TEXT,
                attempt        INTEGER NOT NULL,
                status         TEXT NOT NULL,
                reward         REAL,
                schema_version INTEGER NOT NULL,
                created_at     TEXT NOT NULL,
                updated_at     TEXT NOT NULL,
                body           TEXT NOT NULL
            )""",
            "CREATE INDEX traces_run_status ON traces (run_id, status)",
            "CREATE INDEX traces_run_created ON traces (run_id, created_at, trace_id)",
            "CREATE INDEX traces_task ON traces (task_id)",
            "CREATE INDEX traces_rollout ON traces (rollout_id, attempt)",
            "CREATE INDEX traces_group ON traces (group_id)",
            "CREATE INDEX traces_reward ON traces (reward)",
            "CREATE INDEX traces_created ON traces (created_at, trace_id)",
        ),
    ),
    (
        2,
        "rollout and attempt state (envport.rollout)",
        (
            """CREATE TABLE rollouts (
                rollout_id    TEXT PRIMARY KEY,
                run_id        TEXT NOT NULL,
                task_id       TEXT,
                group_id      TEXT,
                idx           INTEGER NOT NULL,
                env_id        TEXT,
                state         TEXT NOT NULL,
                attempts      INTEGER NOT NULL DEFAULT 0,
                failures      INTEGER NOT NULL DEFAULT 0,
                max_attempts  INTEGER NOT NULL,
                controller    TEXT,
                trace_id      TEXT,
                error_kind    TEXT,
                error_message TEXT,
                created_at    TEXT NOT NULL,
                updated_at    TEXT NOT NULL
            )""",
            "CREATE INDEX rollouts_run_state ON rollouts (run_id, state)",
            """CREATE TABLE attempts (
                rollout_id    TEXT NOT NULL,
                attempt       INTEGER NOT NULL,
                run_id        TEXT NOT NULL,
                state         TEXT NOT NULL,
                controller    TEXT NOT NULL,
                backend       TEXT,
                instance_id   TEXT,
                env_start_s   REAL,
                error_kind    TEXT,
                error_message TEXT,
                reason        TEXT,
                started_at    TEXT NOT NULL,
                heartbeat_at  TEXT NOT NULL,
                finished_at   TEXT,
                PRIMARY KEY (rollout_id, attempt)
            )""",
            "CREATE INDEX attempts_run_state ON attempts (run_id, state)",
        ),
    ),
)

#: The newest schema version this code knows.
DB_SCHEMA_VERSION = _MIGRATIONS[-1][0]

_UPSERT = """
INSERT INTO traces (trace_id, run_id, task_id, rollout_id, group_id, attempt, status,
                    reward, schema_version, created_at, updated_at, body)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (trace_id) DO UPDATE SET
    run_id = excluded.run_id, task_id = excluded.task_id, rollout_id = excluded.rollout_id,
    group_id = excluded.group_id, attempt = excluded.attempt, status = excluded.status,
    reward = excluded.reward, schema_version = excluded.schema_version,
    created_at = excluded.created_at, updated_at = excluded.updated_at, body = excluded.body
"""


# --- rollout state records ----------------------------------------------------------------


class RolloutRecord(BaseModel):
    """One row of ``rollouts``: where a rollout stands (see :mod:`envport.rollout.state`)."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    run_id: str
    task_id: str | None = None
    group_id: str | None = None
    index: int = 0
    env_id: str | None = None
    state: str = "pending"
    attempts: int = Field(0, description="Attempts started (abandoned ones included).")
    failures: int = Field(0, description="Attempts that failed (counted against the budget).")
    max_attempts: int = 1
    controller: str | None = None
    trace_id: str | None = Field(None, description="The final trace, once the rollout ended.")
    error_kind: str | None = None
    error_message: str | None = None
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


class AttemptRecord(BaseModel):
    """One row of ``attempts``: one try at a rollout, on one environment instance."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str
    attempt: int
    run_id: str
    state: str = "starting_env"
    controller: str
    backend: str | None = None
    instance_id: str | None = None
    env_start_s: float | None = None
    error_kind: str | None = None
    error_message: str | None = None
    reason: str | None = Field(None, description="Why it was abandoned or failed.")
    started_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    heartbeat_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    finished_at: datetime | None = None


_ROLLOUT_COLS = (
    "rollout_id, run_id, task_id, group_id, idx, env_id, state, attempts, failures,"
    " max_attempts, controller, trace_id, error_kind, error_message, created_at, updated_at"
)
_ATTEMPT_COLS = (
    "rollout_id, attempt, run_id, state, controller, backend, instance_id, env_start_s,"
    " error_kind, error_message, reason, started_at, heartbeat_at, finished_at"
)
_ROLLOUT_UPDATABLE = frozenset(
    {"state", "attempts", "failures", "controller", "trace_id", "error_kind", "error_message"}
)


def _parse_ts(value: str | None) -> datetime | None:
    if value is None:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def _rollout_row(row: Sequence[Any]) -> RolloutRecord:
    names = [c.strip() for c in _ROLLOUT_COLS.split(",")]
    data = dict(zip(names, row, strict=True))
    data["index"] = data.pop("idx")
    data["created_at"] = _parse_ts(data["created_at"])
    data["updated_at"] = _parse_ts(data["updated_at"])
    return RolloutRecord.model_validate(data)


def _attempt_row(row: Sequence[Any]) -> AttemptRecord:
    names = [c.strip() for c in _ATTEMPT_COLS.split(",")]
    data = dict(zip(names, row, strict=True))
    for key in ("started_at", "heartbeat_at", "finished_at"):
        data[key] = _parse_ts(data[key])
    return AttemptRecord.model_validate(data)


class StaleStateError(TraceStoreError):
    """A compare-and-set on a rollout's state lost: someone else moved it first."""


def check_reward(trace: Trace) -> None:
    """``ValueError`` unless the trace's reward is a finite number or ``None``.

    A NaN reward would be stored as SQL NULL (SQLite has no NaN) and then count as
    unscored; an infinite one would dominate every mean. Reward functions already refuse
    non-finite scores (:mod:`envport.rubrics`); the store refuses them from anywhere else.
    """
    if trace.reward is not None and not math.isfinite(trace.reward):
        raise ValueError(
            f"trace {trace.trace_id!r} has reward {trace.reward}; a trace's reward must be a "
            "finite number, or None when it was not scored"
        )


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    """Whether ``exc`` is SQLite's SQLITE_BUSY or SQLITE_LOCKED (any extended code)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (5, 6)
    return "locked" in str(exc) or "busy" in str(exc)


def _ts(dt: datetime) -> str:
    """A sortable UTC timestamp; naive datetimes are taken to be UTC."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _statuses(status: StatusFilter) -> list[str] | None:
    if status is None:
        return None
    items = [status] if isinstance(status, str) else list(status)
    out: list[str] = []
    for s in items:
        try:
            out.append(TraceStatus(s).value)
        except ValueError:
            known = ", ".join(x.value for x in TraceStatus)
            raise ValueError(f"unknown trace status {s!r}; expected one of: {known}") from None
    return out


def _where(
    *,
    run_id: str | None = None,
    task_id: str | None = None,
    rollout_id: str | None = None,
    group_id: str | None = None,
    status: StatusFilter = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    for column, value in (
        ("run_id", run_id),
        ("task_id", task_id),
        ("rollout_id", rollout_id),
        ("group_id", group_id),
    ):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    statuses = _statuses(status)
    if statuses is not None:
        clauses.append(f"status IN ({', '.join('?' * len(statuses))})")
        params.extend(statuses)
    if min_reward is not None:
        clauses.append("reward >= ?")
        params.append(min_reward)
    if max_reward is not None:
        clauses.append("reward <= ?")
        params.append(max_reward)
    sql = (" WHERE " + " AND ".join(clauses)) if clauses else ""
    return sql, params


class SQLiteTraceStore:
    """The embedded :class:`TraceStore`: one SQLite file in WAL mode.

    >>> store = SQLiteTraceStore("traces.db")          # doctest: +SKIP
    >>> store.put(trace)                                # durable once it returns
    >>> store.query(run_id="r1", status="failed", min_reward=0.5)
    """

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout_s: float = 30.0,
    ) -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', not {synchronous!r}")
        self.path = str(path)
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.RLock()
        self._closed = False
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(
                self.path,
                timeout=busy_timeout_s,
                isolation_level=None,  # we issue BEGIN/COMMIT ourselves
                check_same_thread=False,  # guarded by self._lock
            )
        except sqlite3.Error as exc:
            raise TraceStoreError(f"cannot open trace store {self.path!r}: {exc}") from exc
        try:
            deadline = time.monotonic() + busy_timeout_s
            self._until_unlocked(lambda: self._configure(synchronous, busy_timeout_s), deadline)
            self._until_unlocked(self._migrate, deadline)
        except BaseException:
            self._conn.close()
            raise

    # --- setup -------------------------------------------------------------------------

    def _until_unlocked(self, step: Callable[[], None], deadline: float) -> None:
        """Run ``step``, again and again while the database is locked, until ``deadline``.

        SQLite's busy timeout does not cover every lock taken while a store is set up:
        ``PRAGMA journal_mode = WAL`` on a file another process is creating (or whose
        WAL it is recovering) fails with ``database is locked`` at once. Several
        processes opening one new store together is normal (parallel workers), so the
        setup waits, with backoff, as long as a write would; a lock that outlasts the
        busy timeout is a :class:`TraceStoreLockedError`.
        """
        delay = 0.005
        while True:
            try:
                step()
                return
            except sqlite3.OperationalError as exc:
                if not _is_locked(exc):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TraceStoreLockedError(
                        f"trace store {self.path!r} is locked by another process "
                        f"(still locked after the {self._busy_timeout_s:g} s busy timeout): "
                        f"{exc}"
                    ) from exc
                time.sleep(min(delay * (0.5 + _jitter.random()), left))
                delay = min(delay * 2, 0.25)

    def _configure(self, synchronous: str, busy_timeout_s: float) -> None:
        conn = self._conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if self.path != ":memory:" and str(mode).lower() != "wal":
                raise TraceStoreError(
                    f"trace store {self.path!r} could not enter WAL mode (got {mode!r}); "
                    "is it on a network filesystem?"
                )
            conn.execute(f"PRAGMA synchronous = {synchronous}")
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and _is_locked(exc):
                raise  # retried by _until_unlocked
            raise TraceStoreError(
                f"{self.path!r} is not a usable SQLite trace store: {exc}"
            ) from exc

    def _check_version(self, current: int) -> None:
        if current > DB_SCHEMA_VERSION:
            raise TraceStoreError(
                f"trace store {self.path!r} has schema version {current}, newer than "
                f"this envport knows ({DB_SCHEMA_VERSION}); upgrade envport"
            )

    def _migrate(self) -> None:
        conn = self._conn
        try:  # a store that is up to date (the usual case) needs no write lock to open
            row = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        except sqlite3.OperationalError as exc:
            if _is_locked(exc):
                raise  # retried by _until_unlocked
            row = None  # no schema_migrations yet: a new store
        except sqlite3.DatabaseError as exc:
            raise TraceStoreError(f"cannot migrate trace store {self.path!r}: {exc}") from exc
        if row is not None:
            self._check_version(int(row[0] or 0))
            if int(row[0] or 0) == DB_SCHEMA_VERSION:
                return
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version INTEGER PRIMARY KEY, description TEXT NOT NULL,"
                " applied_at TEXT NOT NULL)"
            )
            row = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
            current = int(row[0] or 0)
            self._check_version(current)
            for version, description, statements in _MIGRATIONS:
                if version <= current:
                    continue
                for statement in statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, description, applied_at)"
                    " VALUES (?, ?, ?)",
                    (version, description, _ts(datetime.now(UTC))),
                )
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError) and _is_locked(exc):
                raise  # retried by _until_unlocked
            if isinstance(exc, sqlite3.Error):
                raise TraceStoreError(f"cannot migrate trace store {self.path!r}: {exc}") from exc
            raise

    @property
    def schema_version(self) -> int:
        """The database schema version (the last migration applied)."""
        with self._lock:
            row = self._db().execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    # --- plumbing ----------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        if self._closed:
            raise TraceStoreError(f"trace store {self.path!r} is closed")
        return self._conn

    def _write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn(conn)`` in one IMMEDIATE transaction, under the lock.

        On some errors (a full disk, an I/O error) SQLite has already rolled the
        transaction back by itself; the rollback here is then skipped, so the error
        reported is the one that happened, not "no transaction is active".
        """
        with self._lock:
            conn = self._db()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(conn)
                    conn.execute("COMMIT")
                except BaseException:
                    self._rollback(conn)
                    raise
            except sqlite3.Error as exc:
                raise TraceStoreError(f"write to trace store {self.path!r} failed: {exc}") from exc
            return result

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        """Roll back the transaction if one is still open; a failure here never hides
        the error that led to it."""
        if not conn.in_transaction:
            return
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            try:
                return self._db().execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise TraceStoreError(f"read from trace store {self.path!r} failed: {exc}") from exc

    def _parse(self, trace_id: str, body: str) -> Trace:
        try:
            return Trace.model_validate_json(body)
        except ValidationError as exc:
            raise TraceStoreError(
                f"trace {trace_id!r} in {self.path!r} does not parse: {short_validation_error(exc)}"
            ) from exc

    @staticmethod
    def _upsert(conn: sqlite3.Connection, trace: Trace) -> None:
        check_reward(trace)
        now = _ts(datetime.now(UTC))
        if trace.run_id is not None:
            conn.execute(
                "INSERT OR IGNORE INTO runs (run_id, created_at) VALUES (?, ?)",
                (trace.run_id, now),
            )
        conn.execute(
            _UPSERT,
            (
                trace.trace_id,
                trace.run_id,
                trace.task_id,
                trace.rollout_id,
                trace.group_id,
                trace.attempt,
                trace.status.value,
                trace.reward,
                trace.schema_version,
                _ts(trace.created_at),
                now,
                trace.to_json(),
            ),
        )

    # --- traces ------------------------------------------------------------------------

    def put(self, trace: Trace) -> None:
        self._write(lambda conn: self._upsert(conn, trace))

    def put_many(self, traces: Iterable[Trace]) -> int:
        def write(conn: sqlite3.Connection) -> int:
            n = 0
            for trace in traces:
                self._upsert(conn, trace)
                n += 1
            return n

        return self._write(write)

    def get(self, trace_id: str) -> Trace:
        rows = self._read("SELECT body FROM traces WHERE trace_id = ?", (trace_id,))
        if not rows:
            raise TraceNotFoundError(f"no trace {trace_id!r} in {self.path!r}", trace_id=trace_id)
        return self._parse(trace_id, rows[0][0])

    def has(self, trace_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM traces WHERE trace_id = ?", (trace_id,)))

    def delete(self, trace_id: str) -> bool:
        def write(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM traces WHERE trace_id = ?", (trace_id,)).rowcount > 0

        return self._write(write)

    def query(
        self,
        *,
        run_id: str | None = None,
        task_id: str | None = None,
        rollout_id: str | None = None,
        group_id: str | None = None,
        status: StatusFilter = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        limit: int | None = None,
        offset: int = 0,
        order_by: OrderBy = "created_at",
        descending: bool = False,
    ) -> list[Trace]:
        if order_by not in ("created_at", "reward"):
            raise ValueError(f"order_by must be 'created_at' or 'reward', not {order_by!r}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, not {limit}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, not {offset}")
        where, params = _where(
            run_id=run_id,
            task_id=task_id,
            rollout_id=rollout_id,
            group_id=group_id,
            status=status,
            min_reward=min_reward,
            max_reward=max_reward,
        )
        direction = "DESC" if descending else "ASC"
        order = f"{order_by} {direction}, trace_id {direction}"
        if order_by == "reward":  # unscored traces last either way
            order = f"reward IS NULL, {order}"
        sql = f"SELECT trace_id, body FROM traces{where} ORDER BY {order} LIMIT ? OFFSET ?"
        rows = self._read(sql, [*params, -1 if limit is None else limit, offset])
        return [self._parse(tid, body) for tid, body in rows]

    def iter_traces(
        self,
        *,
        run_id: str | None = None,
        task_id: str | None = None,
        status: StatusFilter = None,
        batch_size: int = 500,
    ) -> Iterator[Trace]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size}")
        where, params = _where(run_id=run_id, task_id=task_id, status=status)
        joiner = " AND " if where else " WHERE "
        after: tuple[str, str] | None = None
        while True:  # keyset pagination: each batch is one short read, no long lock
            if after is None:
                sql = f"SELECT trace_id, created_at, body FROM traces{where}"
                batch_params = list(params)
            else:
                sql = f"SELECT trace_id, created_at, body FROM traces{where}{joiner}"
                sql += "(created_at, trace_id) > (?, ?)"
                batch_params = [*params, after[0], after[1]]
            sql += " ORDER BY created_at, trace_id LIMIT ?"
            rows = self._read(sql, [*batch_params, batch_size])
            for tid, _created, body in rows:
                yield self._parse(tid, body)
            if len(rows) < batch_size:
                return
            after = (rows[-1][1], rows[-1][0])

    def count(
        self,
        *,
        run_id: str | None = None,
        task_id: str | None = None,
        rollout_id: str | None = None,
        group_id: str | None = None,
        status: StatusFilter = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
    ) -> int:
        where, params = _where(
            run_id=run_id,
            task_id=task_id,
            rollout_id=rollout_id,
            group_id=group_id,
            status=status,
            min_reward=min_reward,
            max_reward=max_reward,
        )
        return int(self._read(f"SELECT COUNT(*) FROM traces{where}", params)[0][0])

    def count_by_status(self, *, run_id: str | None = None) -> dict[TraceStatus, int]:
        where, params = _where(run_id=run_id)
        rows = self._read(f"SELECT status, COUNT(*) FROM traces{where} GROUP BY status", params)
        counts = dict.fromkeys(TraceStatus, 0)
        for status, n in rows:
            counts[TraceStatus(status)] = int(n)
        return counts

    # --- runs --------------------------------------------------------------------------

    def put_run(self, run: Run) -> None:
        def write(conn: sqlite3.Connection) -> None:
            r = run
            conn.execute(
                "INSERT INTO runs (run_id, name, config, created_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (run_id) DO UPDATE SET name = excluded.name,"
                " config = excluded.config, created_at = excluded.created_at",
                (r.run_id, r.name, json.dumps(r.config), _ts(r.created_at)),
            )

        self._write(write)

    def get_run(self, run_id: str) -> Run:
        rows = self._read(
            "SELECT run_id, name, config, created_at FROM runs WHERE run_id = ?", (run_id,)
        )
        if not rows:
            known = [r[0] for r in self._read("SELECT run_id FROM runs ORDER BY created_at")]
            raise TraceNotFoundError(
                f"no run {run_id!r} in {self.path!r}; runs: {', '.join(known) or '(none)'}",
                run_id=run_id,
            )
        return self._run(rows[0])

    def list_runs(self) -> list[Run]:
        rows = self._read(
            "SELECT run_id, name, config, created_at FROM runs ORDER BY created_at, run_id"
        )
        return [self._run(row) for row in rows]

    @staticmethod
    def _run(row: tuple[Any, ...]) -> Run:
        run_id, name, config, created_at = row
        return Run(
            run_id=run_id,
            name=name,
            config=json.loads(config),
            created_at=datetime.strptime(created_at, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC),
        )

    # --- rollout state (envport.rollout) ------------------------------------------------

    def ensure_rollout(self, record: RolloutRecord) -> RolloutRecord:
        """Insert ``record`` unless its rollout id exists; return the stored row."""

        def write(conn: sqlite3.Connection) -> RolloutRecord:
            r = record
            conn.execute(
                "INSERT OR IGNORE INTO runs (run_id, created_at) VALUES (?, ?)",
                (r.run_id, _ts(datetime.now(UTC))),
            )
            conn.execute(
                f"INSERT OR IGNORE INTO rollouts ({_ROLLOUT_COLS})"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    r.rollout_id,
                    r.run_id,
                    r.task_id,
                    r.group_id,
                    r.index,
                    r.env_id,
                    r.state,
                    r.attempts,
                    r.failures,
                    r.max_attempts,
                    r.controller,
                    r.trace_id,
                    r.error_kind,
                    r.error_message,
                    _ts(r.created_at),
                    _ts(r.updated_at),
                ),
            )
            row = conn.execute(
                f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE rollout_id = ?", (r.rollout_id,)
            ).fetchone()
            return _rollout_row(row)

        return self._write(write)

    def get_rollout(self, rollout_id: str) -> RolloutRecord:
        rows = self._read(
            f"SELECT {_ROLLOUT_COLS} FROM rollouts WHERE rollout_id = ?", (rollout_id,)
        )
        if not rows:
            raise TraceNotFoundError(f"no rollout {rollout_id!r} in {self.path!r}")
        return _rollout_row(rows[0])

    def rollouts(
        self, *, run_id: str | None = None, states: Sequence[str] | None = None
    ) -> list[RolloutRecord]:
        """Rollout rows of a run (all runs if ``None``), optionally only in ``states``."""
        clauses: list[str] = []
        params: list[Any] = []
        if run_id is not None:
            clauses.append("run_id = ?")
            params.append(run_id)
        if states is not None:
            clauses.append(f"state IN ({', '.join('?' * len(states))})")
            params.extend(states)
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._read(
            f"SELECT {_ROLLOUT_COLS} FROM rollouts{where} ORDER BY rollout_id", params
        )
        return [_rollout_row(r) for r in rows]

    def attempts(
        self, *, run_id: str | None = None, rollout_id: str | None = None
    ) -> list[AttemptRecord]:
        clauses: list[str] = []
        params: list[Any] = []
        for column, value in (("run_id", run_id), ("rollout_id", rollout_id)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._read(
            f"SELECT {_ATTEMPT_COLS} FROM attempts{where} ORDER BY rollout_id, attempt", params
        )
        return [_attempt_row(r) for r in rows]

    @staticmethod
    def _advance(
        conn: sqlite3.Connection,
        rollout_id: str,
        expect: str,
        fields: dict[str, Any],
        attempt: AttemptRecord | None,
    ) -> None:
        unknown = set(fields) - _ROLLOUT_UPDATABLE
        if unknown:
            raise ValueError(f"not updatable rollout fields: {sorted(unknown)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        sets = f"{sets}, updated_at = ?" if sets else "updated_at = ?"
        cur = conn.execute(
            f"UPDATE rollouts SET {sets} WHERE rollout_id = ? AND state = ?",
            (*fields.values(), _ts(datetime.now(UTC)), rollout_id, expect),
        )
        if cur.rowcount != 1:
            row = conn.execute(
                "SELECT state, controller FROM rollouts WHERE rollout_id = ?", (rollout_id,)
            ).fetchone()
            found = "no such rollout" if row is None else f"it is {row[0]!r} (by {row[1]})"
            raise StaleStateError(f"rollout {rollout_id!r} was expected {expect!r}, but {found}")
        if attempt is not None:
            a = attempt
            conn.execute(
                f"INSERT OR REPLACE INTO attempts ({_ATTEMPT_COLS})"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    a.rollout_id,
                    a.attempt,
                    a.run_id,
                    a.state,
                    a.controller,
                    a.backend,
                    a.instance_id,
                    a.env_start_s,
                    a.error_kind,
                    a.error_message,
                    a.reason,
                    _ts(a.started_at),
                    _ts(a.heartbeat_at),
                    None if a.finished_at is None else _ts(a.finished_at),
                ),
            )

    def advance_rollout(
        self,
        rollout_id: str,
        *,
        expect: str,
        attempt: AttemptRecord | None = None,
        **fields: Any,
    ) -> None:
        """Compare-and-set: update the rollout only if it is still in state ``expect``
        (else :class:`StaleStateError`), and upsert ``attempt``, in one transaction."""
        self._write(lambda conn: self._advance(conn, rollout_id, expect, fields, attempt))

    def finish_rollout(
        self,
        rollout_id: str,
        *,
        expect: str,
        trace: Trace,
        attempt: AttemptRecord | None = None,
        **fields: Any,
    ) -> None:
        """Write the rollout's final trace and its final state in one transaction.

        Any non-final trace left for the rollout id (a crashed attempt) is removed; a
        second final trace for the same rollout is refused, so a rollout appears once.
        """

        def write(conn: sqlite3.Connection) -> None:
            self._advance(conn, rollout_id, expect, {**fields, "trace_id": trace.trace_id}, attempt)
            final = ("completed", "failed", "cancelled")
            other = conn.execute(
                "SELECT trace_id FROM traces WHERE rollout_id = ? AND trace_id != ?"
                " AND status IN (?, ?, ?)",
                (rollout_id, trace.trace_id, *final),
            ).fetchone()
            if other is not None:
                raise StaleStateError(
                    f"rollout {rollout_id!r} already has a final trace {other[0]!r}"
                )
            conn.execute(
                "DELETE FROM traces WHERE rollout_id = ? AND trace_id != ?",
                (rollout_id, trace.trace_id),
            )
            self._upsert(conn, trace)

        self._write(write)

    def heartbeat_attempts(self, keys: Iterable[tuple[str, int]]) -> None:
        """Stamp ``heartbeat_at = now`` on the given (rollout id, attempt) rows."""
        items = list(keys)
        if not items:
            return
        now = _ts(datetime.now(UTC))

        def write(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "UPDATE attempts SET heartbeat_at = ? WHERE rollout_id = ? AND attempt = ?",
                [(now, rid, n) for rid, n in items],
            )

        self._write(write)

    # --- lifecycle ---------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Fold the WAL back into the main file (optional; SQLite does it on its own)."""
        self._read("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SQLiteTraceStore({self.path!r})"


# --- async facade -----------------------------------------------------------------------


class AsyncTraceStore:
    """Any :class:`TraceStore`, awaitable: each call runs in the facade's own worker thread.

    ``async with AsyncTraceStore(SQLiteTraceStore(path)) as store: await store.put(t)``

    The calls run on an executor of the facade's own (one thread by default), not on the
    event loop's default executor: that one is shared with everything else that uses
    ``asyncio.to_thread``, and blocked work there (a sync reward function still running
    past its timeout) would otherwise hold trace writes back. One thread loses nothing
    for :class:`SQLiteTraceStore`, whose calls take turns on one connection anyway; pass
    ``max_workers`` for a store that can serve calls in parallel. :meth:`aclose` closes
    the store and then the executor. An executor left unclosed (a facade dropped without
    :meth:`aclose`, the store still in use elsewhere) lets its idle thread go when the
    facade is garbage collected.
    """

    def __init__(self, store: TraceStore, *, max_workers: int = 1) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, not {max_workers}")
        self.store = store
        self._executor = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="envport-trace-store"
        )
        self._closed = False

    async def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` on the store's executor (for calls beyond this facade,
        such as the rollout methods of :class:`SQLiteTraceStore`)."""
        if self._closed:
            raise TraceStoreError(f"{self!r} is closed")
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        return await loop.run_in_executor(self._executor, call)

    async def put(self, trace: Trace) -> None:
        await self.run(self.store.put, trace)

    async def put_many(self, traces: Iterable[Trace]) -> int:
        items = list(traces)
        return await self.run(self.store.put_many, items)

    async def get(self, trace_id: str) -> Trace:
        return await self.run(self.store.get, trace_id)

    async def delete(self, trace_id: str) -> bool:
        return await self.run(self.store.delete, trace_id)

    async def query(self, **filters: Any) -> list[Trace]:
        return await self.run(lambda: self.store.query(**filters))

    async def count(self, **filters: Any) -> int:
        return await self.run(lambda: self.store.count(**filters))

    async def count_by_status(self, *, run_id: str | None = None) -> dict[TraceStatus, int]:
        return await self.run(lambda: self.store.count_by_status(run_id=run_id))

    async def put_run(self, run: Run) -> None:
        await self.run(self.store.put_run, run)

    async def get_run(self, run_id: str) -> Run:
        return await self.run(self.store.get_run, run_id)

    async def list_runs(self) -> list[Run]:
        return await self.run(self.store.list_runs)

    async def aclose(self) -> None:
        """Close the store (after the calls already queued), then the executor."""
        if self._closed:
            return
        try:
            await self.run(self.store.close)
        finally:
            self._closed = True
            self._executor.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"AsyncTraceStore({self.store!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
