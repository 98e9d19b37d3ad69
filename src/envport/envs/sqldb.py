"""``sql-db-v1``: answer a question about a real SQLite database by querying it.

Each ``reset`` writes a fresh SQLite file (``departments``, ``employees``, ``orders``,
filled from ``self.rng`` so a seed fixes every row) into a temporary directory the
environment owns, and picks a question whose answer one SQL query computes. The agent
explores with the tools ``list_tables``, ``describe_table`` and ``run_query`` and ends the
episode with ``submit_answer`` (reward 1.0 if right, else 0.0). Clients without tools
send plain actions instead: ``{"sql": "SELECT ..."}`` or ``{"answer": "..."}``.

Queries are read-only three times over: only ``SELECT``/``WITH`` statements are accepted,
the connection is opened with ``mode=ro``, and ``PRAGMA query_only`` is set. Each query
also gets a deadline, caps on its length, on value size and on LIKE/GLOB patterns, and a
row limit, so one query cannot hang or flood the environment.

Threads: plain hooks run in the environment's worker thread and sync tools in others, so
no ``sqlite3`` connection is shared. Every call opens its own connection under one lock
that also guards the episode's state. The directory is removed by ``close()``, or, if an
instance is dropped without closing, by a finaliser.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, model_validator

from envport.env import AnyAction, Env
from envport.envs.arithmetic import parse_number
from envport.errors import ActionValidationError, EnvNotResetError, ToolError
from envport.tools import tool
from envport.types import Action, Observation, StepResult

# --- the data ----------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE departments (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    city TEXT NOT NULL,
    budget INTEGER NOT NULL
);
CREATE TABLE employees (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    department_id INTEGER NOT NULL REFERENCES departments(id),
    salary INTEGER NOT NULL,
    hire_year INTEGER NOT NULL
);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    employee_id INTEGER NOT NULL REFERENCES employees(id),
    amount INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'shipped', 'cancelled')),
    order_date TEXT NOT NULL
);
"""

DEPARTMENTS = ("Engineering", "Sales", "Marketing", "Finance", "Support", "Research", "Legal")
CITIES = ("Berlin", "Lagos", "Lima", "Osaka", "Oslo", "Pune", "Quebec", "Seoul")
FIRST_NAMES = (
    "Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade",
    "Kofi", "Lena", "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara",
)  # fmt: skip
LAST_NAMES = ("Abe", "Berg", "Costa", "Diaz", "Evans", "Fox", "Gupta", "Hale", "Ito", "Jones")
STATUSES = ("pending", "shipped", "cancelled")


def seed_database(conn: sqlite3.Connection, rng: random.Random) -> None:
    """Create the tables and fill them from ``rng``; same rng state, same rows."""
    conn.executescript(SCHEMA)
    depts = rng.sample(DEPARTMENTS, rng.randint(4, 5))
    for i, name in enumerate(depts, start=1):
        conn.execute(
            "INSERT INTO departments VALUES (?, ?, ?, ?)",
            (i, name, rng.choice(CITIES), rng.randrange(100_000, 1_000_000, 1_000)),
        )
    people = rng.sample([f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES], 16)
    for i, name in enumerate(people, start=1):
        dept = i if i <= len(depts) else rng.randint(1, len(depts))  # no empty department
        salary = rng.randrange(40_000, 160_000, 500)
        conn.execute(
            "INSERT INTO employees VALUES (?, ?, ?, ?, ?)",
            (i, name, dept, salary, rng.randint(2012, 2024)),
        )
    for i in range(1, rng.randint(30, 50) + 1):
        date = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        conn.execute(
            "INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
            (i, rng.randint(1, len(people)), rng.randint(5, 2_000), rng.choice(STATUSES), date),
        )
    conn.commit()


# --- questions ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Question:
    kind: str
    text: str
    sql: str  # computes the answer; shown to rubrics through state()
    answer: str
    tolerance: Fraction = Fraction(0)


def _scalar(conn: sqlite3.Connection, sql: str) -> Any:
    return conn.execute(sql).fetchone()[0]


def _names(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[0] for row in conn.execute(f"SELECT name FROM {table} ORDER BY id")]


def _q_count(conn: sqlite3.Connection, rng: random.Random) -> Question | None:
    dept = rng.choice(_names(conn, "departments"))
    sql = (
        "SELECT COUNT(*) FROM employees e JOIN departments d ON e.department_id = d.id "
        f"WHERE d.name = '{dept}'"
    )
    text = f"How many employees work in the {dept} department?"
    return Question("count_employees", text, sql, str(_scalar(conn, sql)))


def _q_total(conn: sqlite3.Connection, rng: random.Random) -> Question | None:
    dept = rng.choice(_names(conn, "departments"))
    status = rng.choice(STATUSES)
    sql = (
        "SELECT COALESCE(SUM(o.amount), 0) FROM orders o "
        "JOIN employees e ON o.employee_id = e.id "
        "JOIN departments d ON e.department_id = d.id "
        f"WHERE d.name = '{dept}' AND o.status = '{status}'"
    )
    text = (
        f"What is the total amount of all '{status}' orders handled by employees "
        f"of the {dept} department?"
    )
    return Question("total_order_amount", text, sql, str(_scalar(conn, sql)))


def _q_avg(conn: sqlite3.Connection, rng: random.Random) -> Question | None:
    dept = rng.choice(_names(conn, "departments"))
    sql = (
        "SELECT ROUND(AVG(e.salary), 2) FROM employees e "
        f"JOIN departments d ON e.department_id = d.id WHERE d.name = '{dept}'"
    )
    text = (
        f"What is the average salary of employees in the {dept} department, "
        "rounded to two decimal places?"
    )
    value = _scalar(conn, sql)
    return Question("average_salary", text, sql, f"{value:.2f}", Fraction(1, 200))


def _top(conn: sqlite3.Connection, sql: str) -> str | None:
    """The single top name of ``sql`` (name, value rows, best first), or None on a tie."""
    rows = conn.execute(sql + " LIMIT 2").fetchall()
    if not rows or (len(rows) == 2 and rows[0][1] == rows[1][1]):
        return None
    return str(rows[0][0])


def _q_top_department(conn: sqlite3.Connection, rng: random.Random) -> Question | None:
    sql = (
        "SELECT d.name, AVG(e.salary) AS avg_salary FROM employees e "
        "JOIN departments d ON e.department_id = d.id "
        "GROUP BY d.id ORDER BY avg_salary DESC"
    )
    answer = _top(conn, sql)
    text = "Which department has the highest average employee salary?"
    return None if answer is None else Question("top_department", text, sql, answer)


def _q_top_employee(conn: sqlite3.Connection, rng: random.Random) -> Question | None:
    sql = (
        "SELECT e.name, SUM(o.amount) AS total FROM orders o "
        "JOIN employees e ON o.employee_id = e.id "
        "WHERE o.status != 'cancelled' GROUP BY e.id ORDER BY total DESC"
    )
    answer = _top(conn, sql)
    text = (
        "Which employee handled the largest total order amount, not counting cancelled orders? "
        "Give the full name."
    )
    return None if answer is None else Question("top_employee", text, sql, answer)


def _q_hired(conn: sqlite3.Connection, rng: random.Random) -> Question | None:
    year = rng.randint(2014, 2021)
    salary = rng.randrange(60_000, 120_000, 10_000)
    sql = f"SELECT COUNT(*) FROM employees WHERE hire_year > {year} AND salary > {salary}"
    text = f"How many employees were hired after {year} and earn more than {salary}?"
    return Question("hired_after", text, sql, str(_scalar(conn, sql)))


QUESTIONS: dict[str, Callable[[sqlite3.Connection, random.Random], Question | None]] = {
    "count_employees": _q_count,
    "total_order_amount": _q_total,
    "average_salary": _q_avg,
    "top_department": _q_top_department,
    "top_employee": _q_top_employee,
    "hired_after": _q_hired,
}


def _normalise(text: str) -> str:
    text = " ".join(text.split()).strip().strip("'\"`").strip()
    return text.rstrip(".").casefold()


def answers_match(given: str | int | float, question: Question) -> bool:
    """Numbers compare by value (within the question's tolerance), names by text."""
    expected = parse_number(question.answer)
    if expected is not None:
        value = parse_number(given)
        return value is not None and abs(value - expected) <= question.tolerance
    return _normalise(str(given)) == _normalise(question.answer)


# --- queries -----------------------------------------------------------------------------


class QueryError(Exception):
    """A query was refused or failed; the message is meant for the agent."""


_LEADING_COMMENTS = re.compile(r"^(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*", re.DOTALL)
_READ_ONLY_START = ("SELECT", "WITH")


def first_keyword(sql: str) -> str:
    rest = _LEADING_COMMENTS.sub("", sql, count=1)
    match = re.match(r"[A-Za-z]+", rest)
    return match.group(0).upper() if match else ""


# Bounds on what one query returns, besides ``max_rows``: a query can build large values
# (``zeroblob``, ``printf('%.*c', ...)``) in every column of every row, and blobs double in
# size as hex, so without these a few rows make an observation of hundreds of megabytes.
MAX_VALUE_BYTES = 100_000  # SQLITE_LIMIT_LENGTH: any one string or blob, in SQLite
MAX_COLUMNS = 100  # SQLITE_LIMIT_COLUMN
MAX_CELL_CHARS = 1_000  # a text value, or a blob's hex, is cut to this many characters
MAX_RESULT_BYTES = 256_000  # the rows as JSON; rows past it are left out
# SQLite matches LIKE and GLOB within one VM instruction, where the progress handler never
# runs, in time (value length x pattern length): with SQLite's default pattern limit
# (50,000) one call on a long value takes seconds, and a row of such calls minutes, far
# past ``query_timeout_s``. Patterns are capped (a call on a MAX_VALUE_BYTES value then
# takes milliseconds), and so is the statement, which bounds how many calls one row makes.
MAX_PATTERN_CHARS = 50  # SQLITE_LIMIT_LIKE_PATTERN_LENGTH
MAX_SQL_CHARS = 10_000
PROGRESS_EVERY = 1_000  # VM instructions between deadline checks


@dataclasses.dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = {
            "columns": self.columns,
            "rows": self.rows,
            "row_count": len(self.rows),
            "truncated": self.truncated,
        }
        if self.note:
            out["note"] = self.note
        return out


def _cell(value: Any) -> tuple[Any, bool]:
    """A value as it is returned (blobs as hex), and whether it was cut to MAX_CELL_CHARS."""
    if isinstance(value, bytes):
        if 2 * len(value) <= MAX_CELL_CHARS:
            return value.hex(), False
        return value[: MAX_CELL_CHARS // 2].hex() + f"... [{len(value)} bytes, cut]", True
    if isinstance(value, str) and len(value) > MAX_CELL_CHARS:
        return value[:MAX_CELL_CHARS] + f"... [{len(value)} characters, cut]", True
    return value, False


# --- the environment ---------------------------------------------------------------------


class SqlAction(Action):
    """Exactly one of ``sql`` (run a read-only query) or ``answer`` (submit, ends the episode)."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"sql": "SELECT name FROM departments"}, {"answer": "42"}]}
    )

    sql: str | None = Field(default=None, description="A read-only SELECT/WITH query to run.")
    answer: str | int | float | None = Field(
        default=None, description="Your final answer; ends the episode."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> SqlAction:
        if (self.sql is None) == (self.answer is None):
            raise ValueError("give exactly one of 'sql' (a query) or 'answer' (final answer)")
        return self


class SqlObservation(Observation):
    question: str = Field(default="", description="The question to answer.")
    schema_sql: str = Field(
        default="", description="CREATE statements of every table (first observation only)."
    )
    tables: list[str] = Field(default_factory=list)
    columns: list[str] | None = Field(default=None, description="Columns of the last query.")
    rows: list[list[Any]] | None = Field(default=None, description="Rows of the last query.")
    truncated: bool = Field(
        default=False, description="True if rows or long values were cut at the limits."
    )
    error: str | None = Field(default=None, description="Why the last query failed.")
    correct: bool | None = Field(default=None, description="After an answer: was it right.")
    expected: str | None = Field(default=None, description="After an answer: the right one.")
    steps_left: int = 0
    message: str = ""


@dataclasses.dataclass(frozen=True)
class _Outcome:
    reward: float
    terminated: bool


class SqlDbEnv(Env[SqlAction, SqlObservation]):
    """Answer a question about a small SQLite database (departments, employees, orders).

    Tools: ``list_tables``, ``describe_table``, ``run_query`` (read-only, row-limited) and
    ``submit_answer`` (ends the episode: reward 1.0 if right, else 0.0). Plain actions
    ``{"sql": ...}`` and ``{"answer": ...}`` do the same without tools. The episode is
    truncated after ``max_steps`` steps. Reset option ``question_kind`` picks the kind of
    question (one of :data:`QUESTIONS`).
    """

    action_type = SqlAction
    observation_type = SqlObservation
    check_actions: ClassVar[list[dict[str, Any]]] = [
        {"sql": "SELECT COUNT(*) FROM employees"},
        {"answer": "0"},
    ]
    reward_range = (0.0, 1.0)
    version = "1"

    def __init__(
        self, max_steps: int = 20, max_rows: int = 50, query_timeout_s: float = 2.0
    ) -> None:
        super().__init__()
        if max_steps < 1 or max_rows < 1 or query_timeout_s <= 0:
            raise ValueError("max_steps, max_rows and query_timeout_s must be positive.")
        self.max_steps = max_steps
        self.max_rows = max_rows
        self.query_timeout_s = query_timeout_s
        self.workdir: Path | None = None
        self.db_path: Path | None = None
        self.question: Question | None = None
        self.schema_sql = ""
        self.tables: list[str] = []
        self.submitted: str | None = None
        self.correct: bool | None = None
        self.episode_over = False
        self.queries_run = 0
        self._lock = threading.RLock()
        self._pending: _Outcome | None = None
        self._episodes = 0
        self._cleanup: weakref.finalize[Any, Any] | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def on_reset(self, seed: int | None, **options: Any) -> StepResult[SqlObservation]:
        unknown = sorted(set(options) - {"question_kind"})
        if unknown:
            raise ActionValidationError(
                f"Unknown reset option(s) for sql-db-v1: {', '.join(unknown)}. "
                "Allowed: question_kind."
            )
        kind = options.get("question_kind")
        if kind is not None and kind not in QUESTIONS:
            raise ActionValidationError(
                f"Unknown question_kind {kind!r}; choose one of {', '.join(QUESTIONS)}."
            )
        with self._lock:
            path = self._fresh_db_path()
            conn = sqlite3.connect(path)
            try:
                seed_database(conn, self.rng)
                self.question = self._pick_question(conn, kind)
                self.tables = [
                    r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
                ]
                self.schema_sql = ";\n".join(
                    r[0] for r in conn.execute("SELECT sql FROM sqlite_master WHERE type='table'")
                )
            finally:
                conn.close()
            self.db_path = path
            self.submitted = None
            self.correct = None
            self.episode_over = False
            self.queries_run = 0
            self._pending = None
            message = (
                "Answer the question using the database. Tools: list_tables, describe_table, "
                "run_query (read-only), submit_answer; or send {'sql': ...} / {'answer': ...}."
            )
            obs = self._observation(message=message)
            return StepResult(observation=obs.model_copy(update={"schema_sql": self.schema_sql}))

    def on_step(self, action: SqlAction) -> StepResult[SqlObservation]:
        with self._lock:
            if self.question is None or self.episode_over:
                raise EnvNotResetError("The sql-db episode is over; call reset() to start anew.")
            if action.answer is not None:
                outcome = self._submit(action.answer)
                obs = self._observation(message="Correct." if self.correct else "Incorrect.")
                return StepResult(observation=obs, reward=outcome.reward, terminated=True)
            assert action.sql is not None
            try:
                result = self._query(action.sql)
            except QueryError as exc:
                return StepResult(observation=self._observation(error=str(exc)), reward=0.0)
            obs = self._observation(
                columns=result.columns,
                rows=result.rows,
                truncated=result.truncated,
                message=result.note,
            )
            return StepResult(observation=obs, reward=0.0)

    async def step(self, action: SqlAction | AnyAction | dict[str, Any]) -> StepResult[Any]:
        """:meth:`Env.step`, plus: ``submit_answer`` through ``call_tool`` ends the
        episode with its reward, and every kind of step counts toward ``max_steps``."""
        self._pending = None
        result = await super().step(action)
        outcome, self._pending = self._pending, None
        if outcome is not None and result.reward is None:
            update = {"reward": outcome.reward, "terminated": outcome.terminated}
            result = result.model_copy(update=update)
        if not result.done and self.step_count >= self.max_steps:
            self.episode_over = True
            result = result.model_copy(update={"truncated": True})
        return result

    def on_close(self) -> None:
        with self._lock:
            if self._cleanup is not None:
                self._cleanup()  # removes the directory; runs at most once
            self.db_path = None

    def extra_state(self) -> dict[str, Any]:
        question = self.question
        return {
            "db_path": str(self.db_path) if self.db_path else None,
            "question": question.text if question else None,
            "question_kind": question.kind if question else None,
            "reference_answer": question.answer if question else None,
            "reference_sql": question.sql if question else None,
            "submitted_answer": self.submitted,
            "correct": self.correct,
            "queries_run": self.queries_run,
            "episode_over": self.episode_over,
        }

    # --- tools -------------------------------------------------------------------------

    @tool
    def list_tables(self) -> list[str]:
        """List the tables in the database."""
        with self._lock:
            self._require_db()
            return list(self.tables)

    @tool
    def describe_table(self, name: str) -> dict[str, Any]:
        """Describe one table: its columns, their types, its row count and CREATE statement.

        Args:
            name: The table's name, as given by list_tables.
        """
        with self._lock:
            self._require_db()
            if name not in self.tables:
                raise ToolError(
                    f"No table named {name!r}. Tables: {', '.join(self.tables)}.",
                    kind="invalid_args",
                )
            conn = self._connect()
            try:
                info = conn.execute(f'PRAGMA table_info("{name}")').fetchall()
                count = conn.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0]
                create = conn.execute(
                    "SELECT sql FROM sqlite_master WHERE type='table' AND name=?", (name,)
                ).fetchone()[0]
            finally:
                conn.close()
        columns = [
            {"name": c[1], "type": c[2], "nullable": not c[3], "primary_key": bool(c[5])}
            for c in info
        ]
        return {"name": name, "columns": columns, "row_count": count, "sql": create}

    @tool
    def run_query(self, sql: str) -> dict[str, Any]:
        """Run one read-only SQL query (SELECT or WITH) and return its rows.

        At most ``max_rows`` rows, and about 256 KB, come back, and a long value is cut to
        1,000 characters; ``truncated`` says whether anything was left out, and ``note`` what.

        Args:
            sql: A single SELECT or WITH statement in SQLite's dialect.
        """
        with self._lock:
            self._require_db()
            try:
                return self._query(sql).as_dict()
            except QueryError as exc:
                raise ToolError(str(exc), kind="execution_error") from exc

    @tool
    def submit_answer(self, answer: str | int | float) -> dict[str, Any]:
        """Submit your final answer to the question. Ends the episode.

        Args:
            answer: The answer: a number (as a number or text) or a name, as the question
                asks.
        """
        with self._lock:
            self._require_db()
            if self.episode_over:
                raise ToolError(
                    "The episode is over; call reset() to start a new one.",
                    kind="execution_error",
                )
            outcome = self._submit(answer)
            assert self.question is not None
            return {
                "correct": self.correct,
                "expected": self.question.answer,
                "reward": outcome.reward,
                "done": True,
            }

    # --- internals ---------------------------------------------------------------------

    def _fresh_db_path(self) -> Path:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="envport-sqldb-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.workdir, True)
        if self.db_path is not None:
            self.db_path.unlink(missing_ok=True)
        self._episodes += 1
        return self.workdir / f"episode-{self._episodes}.sqlite"

    def _pick_question(self, conn: sqlite3.Connection, kind: str | None) -> Question:
        kinds = [kind] if kind else list(QUESTIONS)
        for _ in range(20):
            question = QUESTIONS[self.rng.choice(kinds)](conn, self.rng)
            if question is not None:
                return question
        # Every draw was a tie (vanishingly rare): a count question always exists.
        question = _q_count(conn, self.rng)
        assert question is not None
        return question

    def _require_db(self) -> None:
        if self.db_path is None:
            raise ToolError("No database yet; call reset() first.", kind="execution_error")

    def _connect(self) -> sqlite3.Connection:
        assert self.db_path is not None
        conn = sqlite3.connect(f"{self.db_path.as_uri()}?mode=ro", uri=True)
        conn.execute("PRAGMA query_only = ON")
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_PATTERN_CHARS)
        return conn

    def _query(self, sql: str) -> QueryResult:
        if len(sql) > MAX_SQL_CHARS:
            raise QueryError(
                f"The query is {len(sql):,} characters long; at most {MAX_SQL_CHARS:,} "
                "characters are allowed."
            )
        keyword = first_keyword(sql)
        if keyword not in _READ_ONLY_START:
            shown = keyword or "(empty)"
            raise QueryError(
                "Only read-only queries are allowed: a statement must start with SELECT or "
                f"WITH, and this one starts with {shown}. The database cannot be modified."
            )
        self.queries_run += 1
        conn = self._connect()
        deadline = time.monotonic() + self.query_timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_EVERY)
        rows: list[list[Any]] = []
        notes: list[str] = []
        try:
            cursor = conn.execute(sql)
            columns = [d[0] for d in cursor.description or ()]
            size = len(json.dumps(columns))
            cut_cells = False
            while (row := cursor.fetchone()) is not None:
                if len(rows) == self.max_rows:
                    notes.append(f"only the first {self.max_rows} rows (max_rows) are shown")
                    break
                cells = [_cell(v) for v in row]
                values = [value for value, _ in cells]
                size += len(json.dumps(values, default=str)) + 1
                if size > MAX_RESULT_BYTES:
                    notes.append(
                        f"only the first {len(rows)} rows are shown: the result passed "
                        f"{MAX_RESULT_BYTES:,} bytes"
                    )
                    break
                cut_cells = cut_cells or any(cut for _, cut in cells)
                rows.append(values)
            if cut_cells:
                notes.append(f"values longer than {MAX_CELL_CHARS:,} characters were cut")
        except sqlite3.Error as exc:
            if time.monotonic() > deadline:
                raise QueryError(
                    f"The query ran longer than {self.query_timeout_s:g} s and was stopped."
                ) from exc
            if "readonly" in str(exc) or "read-only" in str(exc):
                raise QueryError(
                    f"The database is read-only; the query tried to write ({exc})."
                ) from exc
            if "pattern too complex" in str(exc):
                raise QueryError(
                    f"SQL error: {exc}: a LIKE or GLOB pattern may have at most "
                    f"{MAX_PATTERN_CHARS} characters."
                ) from exc
            raise QueryError(f"SQL error: {exc}") from exc
        finally:
            conn.close()
        note = f"Result truncated: {'; '.join(notes)}." if notes else ""
        return QueryResult(columns=columns, rows=rows, truncated=bool(notes), note=note)

    def _submit(self, answer: str | int | float) -> _Outcome:
        assert self.question is not None
        self.submitted = str(answer)
        self.correct = answers_match(answer, self.question)
        self.episode_over = True
        outcome = _Outcome(reward=1.0 if self.correct else 0.0, terminated=True)
        self._pending = outcome
        return outcome

    def _observation(
        self,
        *,
        message: str = "",
        columns: list[str] | None = None,
        rows: list[list[Any]] | None = None,
        truncated: bool = False,
        error: str | None = None,
    ) -> SqlObservation:
        assert self.question is not None
        return SqlObservation(
            question=self.question.text,
            tables=list(self.tables),
            columns=columns,
            rows=rows,
            truncated=truncated,
            error=error,
            correct=self.correct,
            expected=self.question.answer if self.submitted is not None else None,
            steps_left=max(0, self.max_steps - self.step_count),
            message=message,
        )
