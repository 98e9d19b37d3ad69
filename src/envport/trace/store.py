"""Where traces live: the :class:`TraceStore` interface and its SQLite implementation.

:class:`TraceStore` is a small synchronous protocol (put, get, query, count, runs), so a
server database can implement it later without touching callers; async code wraps any
store in :class:`AsyncTraceStore`, which runs each call in a worker thread.

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

Concurrency. One connection per store, guarded by a lock, so a store may be shared by
threads (and by ``asyncio.to_thread``). Several processes may open the same file; WAL
lets readers proceed while one writes, and ``busy_timeout`` queues writers.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeVar, runtime_checkable

from pydantic import ValidationError

from envport.trace.errors import TraceNotFoundError, TraceStoreError
from envport.trace.model import Run, Trace, TraceStatus

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
        """Insert or replace one trace (and create its run if unknown)."""
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
            self._configure(synchronous, busy_timeout_s)
            self._migrate()
        except BaseException:
            self._conn.close()
            raise

    # --- setup -------------------------------------------------------------------------

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
            raise TraceStoreError(
                f"{self.path!r} is not a usable SQLite trace store: {exc}"
            ) from exc

    def _migrate(self) -> None:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version INTEGER PRIMARY KEY, description TEXT NOT NULL,"
                " applied_at TEXT NOT NULL)"
            )
            row = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
            current = int(row[0] or 0)
            if current > DB_SCHEMA_VERSION:
                raise TraceStoreError(
                    f"trace store {self.path!r} has schema version {current}, newer than "
                    f"this envport knows ({DB_SCHEMA_VERSION}); upgrade envport"
                )
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
        """Run ``fn(conn)`` in one IMMEDIATE transaction, under the lock."""
        with self._lock:
            conn = self._db()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(conn)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise TraceStoreError(f"write to trace store {self.path!r} failed: {exc}") from exc
            return result

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
                f"trace {trace_id!r} in {self.path!r} does not parse: {exc}"
            ) from exc

    @staticmethod
    def _upsert(conn: sqlite3.Connection, trace: Trace) -> None:
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
                trace.model_dump_json(),
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
    """Any :class:`TraceStore`, awaitable: each call runs in a worker thread.

    ``async with AsyncTraceStore(SQLiteTraceStore(path)) as store: await store.put(t)``
    """

    def __init__(self, store: TraceStore) -> None:
        self.store = store

    async def put(self, trace: Trace) -> None:
        await asyncio.to_thread(self.store.put, trace)

    async def put_many(self, traces: Iterable[Trace]) -> int:
        items = list(traces)
        return await asyncio.to_thread(self.store.put_many, items)

    async def get(self, trace_id: str) -> Trace:
        return await asyncio.to_thread(self.store.get, trace_id)

    async def delete(self, trace_id: str) -> bool:
        return await asyncio.to_thread(self.store.delete, trace_id)

    async def query(self, **filters: Any) -> list[Trace]:
        return await asyncio.to_thread(lambda: self.store.query(**filters))

    async def count(self, **filters: Any) -> int:
        return await asyncio.to_thread(lambda: self.store.count(**filters))

    async def count_by_status(self, *, run_id: str | None = None) -> dict[TraceStatus, int]:
        return await asyncio.to_thread(lambda: self.store.count_by_status(run_id=run_id))

    async def put_run(self, run: Run) -> None:
        await asyncio.to_thread(self.store.put_run, run)

    async def get_run(self, run_id: str) -> Run:
        return await asyncio.to_thread(self.store.get_run, run_id)

    async def list_runs(self) -> list[Run]:
        return await asyncio.to_thread(self.store.list_runs)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.store.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
