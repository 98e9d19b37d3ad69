"""Live rollouts that outlive a gateway restart: their registrations in the SQLite file.

When the gateway has a SQLite trace store, each rollout it creates is also written to
one table of that same file, ``gateway_rollouts``: its id, what the orchestrator said
about it (:class:`~envport.gateway.capture.RolloutInfo`), when its agent token expires,
and the token's SHA-256 digest (never the token). Finishing a rollout deletes its row. A
gateway started on the same file takes the rows back: the agents of those rollouts keep
calling with the tokens they have, and the orchestrator can finish them as before.

What is not kept: the calls recorded before the restart (they lived in memory). A
rollout taken back says so: it carries an ``infrastructure`` error naming the restart,
so its trace is not mistaken for a complete one.

Writes happen on the admin path, never on a model call: creating a rollout writes its
row on the event loop; finishing deletes it in the trace writer's thread, with the
other rollouts whose traces were stored in the same batch.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from envport.trace.errors import TraceStoreError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS gateway_rollouts (
    rollout_id   TEXT PRIMARY KEY,
    token_digest TEXT NOT NULL,
    expires_at   REAL,
    created_at   REAL NOT NULL,
    info         TEXT NOT NULL
)
"""


@dataclass(frozen=True)
class Registration:
    """One live rollout as written down: enough to accept its agent again."""

    rollout_id: str
    token_digest: str
    expires_at: float | None
    created_at: float
    info_json: str


class RolloutRegistry:
    """The ``gateway_rollouts`` table of one SQLite file (its own connection)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout = 30000")
            self._conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoint
            with self._conn:
                self._conn.execute(_SCHEMA)
        except sqlite3.Error as exc:
            raise TraceStoreError(f"cannot keep gateway rollouts in {self.path!r}: {exc}") from exc

    def add(self, reg: Registration) -> None:
        self._write(
            "INSERT OR REPLACE INTO gateway_rollouts VALUES (?, ?, ?, ?, ?)",
            (reg.rollout_id, reg.token_digest, reg.expires_at, reg.created_at, reg.info_json),
        )

    def remove(self, rollout_id: str) -> None:
        self._write("DELETE FROM gateway_rollouts WHERE rollout_id = ?", (rollout_id,))

    def remove_many(self, rollout_ids: list[str]) -> None:
        """Delete several registrations in one transaction."""
        with self._lock:
            try:
                with self._conn:
                    self._conn.executemany(
                        "DELETE FROM gateway_rollouts WHERE rollout_id = ?",
                        [(rid,) for rid in rollout_ids],
                    )
            except sqlite3.Error as exc:
                raise TraceStoreError(
                    f"writing gateway rollouts to {self.path!r} failed: {exc}"
                ) from exc

    def live(self, now: float | None = None) -> list[Registration]:
        """The registrations whose token has not expired (expired ones are deleted)."""
        now = time.time() if now is None else now
        self._write(
            "DELETE FROM gateway_rollouts WHERE expires_at IS NOT NULL AND expires_at <= ?",
            (now,),
        )
        with self._lock:
            try:
                rows = self._conn.execute(
                    "SELECT rollout_id, token_digest, expires_at, created_at, info "
                    "FROM gateway_rollouts ORDER BY created_at"
                ).fetchall()
            except sqlite3.Error as exc:
                raise TraceStoreError(f"reading gateway rollouts failed: {exc}") from exc
        return [Registration(*row) for row in rows]

    def _write(self, sql: str, params: tuple[object, ...]) -> None:
        with self._lock:
            try:
                with self._conn:
                    self._conn.execute(sql, params)
            except sqlite3.Error as exc:
                raise TraceStoreError(
                    f"writing gateway rollouts to {self.path!r} failed: {exc}"
                ) from exc

    def close(self) -> None:
        with self._lock:
            self._conn.close()
