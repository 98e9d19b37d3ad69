"""The environment checker behind ``envport check``.

Like Gymnasium's ``env_checker``, it ships with the contract and answers one question:
*will every server, client and trainer built on envport be able to rely on this
environment?* It builds the environment from an id (``echo-v1``), a
``package.module:Class`` path or a factory, and runs three kinds of checks:

* **static**: the action, observation and state types are pydantic models whose JSON
  Schemas generate and are valid; an action built from the schema's own defaults and
  examples validates; declared ``check_actions`` validate; tool specs carry valid
  input schemas.
* **runtime**: ``reset`` works and its observation and state survive a dump and
  re-validate; what ``reset``, ``step`` and ``state`` return encodes with the server's
  own encoder (orjson: a set in ``info`` or a 65-bit integer does not); a seed fixes the
  episode (two fresh instances agree on the first observation, on ``state()`` and on the
  results of stepping the same actions, the first replays its episode when reset again
  with the seed, and neither draws from the unseeded global
  ``random`` or ``numpy.random``); ``step`` works; ``state().step_count`` counts steps
  and returns to 0 on ``reset``; rewards stay within ``reward_range``; ``step`` before
  ``reset`` raises ``EnvNotResetError``;
  ``close()`` twice is safe and any call after it raises ``EnvClosedError``.
* **leaks**: one full episode on a fresh instance, then ``close()``; threads, child
  processes, open file descriptors, asyncio tasks and temporary files that outlive it
  are reported. During this check ``tempfile`` and ``$TMPDIR`` point at a private
  directory, so files other processes create in ``/tmp`` never count against the
  environment.

To step, the checker needs valid actions. An environment can declare them as a class
attribute, which the checker reads (the contract itself does not need to know)::

    class GuessEnv(Env[GuessAction, GuessObservation]):
        check_actions: ClassVar[list[dict[str, Any]]] = [{"guess": 50}]

Without it, the checker builds one action from the schema's defaults and examples, and
warns (and checks less) when it cannot.

Every check ends as a :class:`CheckResult` with a status, and a :class:`CheckReport`
collects them; a report is ``ok`` when nothing failed. Warnings and skips are shown, not
counted as failures. An environment that raises inside a check fails that check and
only that check: a broken environment is data, not a crash of the checker.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import gc
import json
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import jsonschema
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.table import Table
from rich.text import Text

from envport.env import Env
from envport.errors import EnvClosedError, EnvNotResetError
from envport.protocol.codec import encode
from envport.registry import EnvFactory, spec
from envport.types import Action, ListToolsAction, Observation, State, StepResult

T = TypeVar("T")

__all__ = [
    "CheckReport",
    "CheckResult",
    "CheckStatus",
    "check",
    "check_env",
    "example_from_schema",
]


class CheckStatus(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    WARN = "warn"
    SKIP = "skip"


_STYLE = {
    CheckStatus.PASS: "green",
    CheckStatus.FAIL: "bold red",
    CheckStatus.WARN: "yellow",
    CheckStatus.SKIP: "dim",
}


class CheckResult(BaseModel):
    """The outcome of one named check."""

    model_config = ConfigDict(frozen=True)

    name: str
    status: CheckStatus
    message: str = ""


class CheckReport(BaseModel):
    """Every check run against one environment, in the order they ran."""

    env_id: str
    results: list[CheckResult] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings and skips do not count)."""
        return not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is CheckStatus.FAIL]

    def get(self, name: str) -> CheckResult:
        """The result of the check called ``name``."""
        for result in self.results:
            if result.name == name:
                return result
        known = ", ".join(r.name for r in self.results)
        raise KeyError(f"No check named {name!r} in this report. Checks: {known}.")

    def counts(self) -> dict[CheckStatus, int]:
        return {s: sum(r.status is s for r in self.results) for s in CheckStatus}

    def summary(self) -> str:
        counts = ", ".join(f"{n} {s.value}" for s, n in self.counts().items() if n)
        verdict = "passed" if self.ok else "FAILED"
        return f"{self.env_id}: {verdict} ({counts})"

    def table(self) -> Table:
        """The report as a rich table, one row per check."""
        table = Table(title=f"envport check: {self.env_id}", title_justify="left")
        table.add_column("check", no_wrap=True)
        table.add_column("status", no_wrap=True)
        table.add_column("message", overflow="fold")
        for r in self.results:
            table.add_row(r.name, Text(r.status.value, style=_STYLE[r.status]), Text(r.message))
        return table

    def __rich__(self) -> Table:
        return self.table()


# --- outcomes a check raises instead of passing ---------------------------------------


class _Outcome(Exception):
    status = CheckStatus.FAIL


class _Fail(_Outcome):
    status = CheckStatus.FAIL


class _Warn(_Outcome):
    status = CheckStatus.WARN


class _Skip(_Outcome):
    status = CheckStatus.SKIP


# --- public entry points --------------------------------------------------------------


async def check_env(
    env: str | EnvFactory,
    *,
    seed: int = 0,
    steps: int = 3,
    call_timeout_s: float = 30.0,
    leak_grace_s: float = 2.0,
) -> CheckReport:
    """Run every check against ``env`` (an id, ``package.module:Class`` or a factory).

    ``steps`` is how many steps each runtime check takes; ``call_timeout_s`` bounds each
    environment call; ``leak_grace_s`` is how long the leak check waits for threads and
    processes to finish after ``close()``. An id that does not resolve raises
    :class:`~envport.errors.UnknownEnvError`; anything the environment does wrong
    becomes a failed check in the report.
    """
    env_id, factory = _resolve(env)
    checker = _Checker(
        env_id,
        factory,
        seed=seed,
        steps=max(1, steps),
        call_timeout_s=call_timeout_s,
        leak_grace_s=leak_grace_s,
    )
    await checker.run()
    return checker.report


def check(env: str | EnvFactory, **options: Any) -> CheckReport:
    """Synchronous :func:`check_env`, for scripts and the CLI."""
    return asyncio.run(check_env(env, **options))


def _resolve(env: str | EnvFactory) -> tuple[str, EnvFactory]:
    if not isinstance(env, str):
        name = f"{getattr(env, '__module__', '?')}:{getattr(env, '__qualname__', repr(env))}"
        return name, env
    env_spec = spec(env)
    loaded = env_spec.load()
    kwargs = dict(env_spec.kwargs)
    return env_spec.id, lambda: loaded(**kwargs)


# --- schema examples ------------------------------------------------------------------


_NO_EXAMPLE = object()


def example_from_schema(schema: dict[str, Any], root: dict[str, Any] | None = None) -> Any:
    """An instance built only from a JSON Schema's examples, consts, defaults and enums.

    Required properties without any of those make the whole example impossible, and
    the function raises ``LookupError`` naming them. Optional properties are left out.
    """
    value = _example(schema, root or schema, path="", depth=0)
    if value is _NO_EXAMPLE:
        raise LookupError("the schema gives no example")
    return value


def _example(schema: dict[str, Any], root: dict[str, Any], path: str, depth: int) -> Any:
    if depth > 20:
        raise LookupError(f"schema nests too deeply at {path or '(root)'}")
    if "$ref" in schema:
        return _example(_deref(schema["$ref"], root), root, path, depth + 1)
    for key in ("examples", "enum"):
        if isinstance(schema.get(key), list) and schema[key]:
            return schema[key][0]
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list):
            return _first_example(options, root, path, depth)
    if schema.get("type") == "null":
        return None
    if schema.get("type") == "object" or "properties" in schema:
        return _object_example(schema, root, path, depth)
    return _NO_EXAMPLE


def _first_example(options: list[Any], root: dict[str, Any], path: str, depth: int) -> Any:
    missing: list[str] = []
    for option in options:
        try:
            value = _example(option, root, path, depth + 1)
        except LookupError as exc:
            missing.append(str(exc))
            continue
        if value is not _NO_EXAMPLE:
            return value
    if missing:
        raise LookupError(missing[0])
    return _NO_EXAMPLE


def _object_example(schema: dict[str, Any], root: dict[str, Any], path: str, depth: int) -> Any:
    props: dict[str, Any] = schema.get("properties", {})
    out: dict[str, Any] = {}
    missing: list[str] = []
    for name in schema.get("required", []):
        field_path = f"{path}.{name}" if path else name
        value = _example(props.get(name, {}), root, field_path, depth + 1)
        if value is _NO_EXAMPLE:
            missing.append(field_path)
        else:
            out[name] = value
    if missing:
        raise LookupError(f"no default or example for required field(s): {', '.join(missing)}")
    return out


def _deref(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise LookupError(f"cannot follow non-local $ref {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    if not isinstance(node, dict):
        raise LookupError(f"$ref {ref!r} does not point at a schema")
    return node


def _schema_errors(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a valid JSON Schema (Draft 2020-12), or None."""
    try:
        json.dumps(schema)
        jsonschema.Draft202012Validator.check_schema(schema)
    except (TypeError, ValueError) as exc:
        return f"not JSON-serialisable: {exc}"
    except jsonschema.SchemaError as exc:
        return f"{exc.message} at {'/'.join(map(str, exc.absolute_path)) or '(root)'}"
    return None


def _instance_errors(instance: Any, schema: dict[str, Any]) -> str | None:
    """Why ``instance`` does not validate against ``schema``, or None."""
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(instance)
    )
    if error is None:
        return None
    where = "/".join(map(str, error.absolute_path)) or "(root)"
    return f"{error.message} at {where}"


# --- resource snapshots for the leak check --------------------------------------------


@dataclass(frozen=True)
class _Snapshot:
    threads: frozenset[threading.Thread]
    fds: frozenset[int]
    children: frozenset[int]
    tasks: frozenset[asyncio.Task[Any]]


def _open_fds() -> frozenset[int]:
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return frozenset()
    fds = set()
    for name in names:
        with contextlib.suppress(ValueError, OSError):
            os.fstat(int(name))  # drops the descriptor listdir itself used
            fds.add(int(name))
    return frozenset(fds)


def _describe_fd(fd: int) -> str:
    try:
        return f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return str(fd)


def _child_pids() -> frozenset[int]:
    """Descendants of this process (Linux ``/proc``; empty elsewhere)."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return frozenset()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 1:
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return frozenset(found)


def _snapshot() -> _Snapshot:
    return _Snapshot(
        threads=frozenset(t for t in threading.enumerate() if t.is_alive()),
        fds=_open_fds(),
        children=_child_pids(),
        tasks=frozenset(t for t in asyncio.all_tasks() if not t.done()),
    )


def _leaks(before: _Snapshot, tmpdir: str) -> list[str]:
    now = _snapshot()
    threads = [
        t.name
        for t in now.threads - before.threads
        # The event loop's own executor (asyncio.to_thread) belongs to the loop.
        if not t.name.startswith("asyncio_")
    ]
    current = asyncio.current_task()
    tasks = [t.get_name() for t in now.tasks - before.tasks if t is not current]
    found: list[str] = []
    if threads:
        found.append(f"threads still running: {', '.join(sorted(threads))}")
    if now.children - before.children:
        found.append(f"child processes alive: {sorted(now.children - before.children)}")
    if now.fds - before.fds:
        fds = ", ".join(_describe_fd(fd) for fd in sorted(now.fds - before.fds))
        found.append(f"file descriptors open: {fds}")
    if tasks:
        found.append(f"asyncio tasks pending: {', '.join(sorted(tasks))}")
    if os.listdir(tmpdir):
        found.append(f"temporary files left: {', '.join(sorted(os.listdir(tmpdir)))}")
    return found


@contextlib.contextmanager
def _private_tempdir() -> Iterator[str]:
    """Point ``tempfile`` and ``$TMPDIR`` at a fresh directory for the duration."""
    path = tempfile.mkdtemp(prefix="envport-check-")
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = path
    os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)


# --- the checker ----------------------------------------------------------------------


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}"
        for e in exc.errors(include_url=False)
    )


def _why(exc: Exception) -> str:
    return _errors(exc) if isinstance(exc, ValidationError) else str(exc)


def _dump(model: BaseModel) -> Any:
    return model.model_dump(mode="json")


def _roundtrip(what: str, value: BaseModel, model: type[BaseModel]) -> None:
    """Fail unless ``value`` survives JSON and re-validation, and matches its schema."""
    dumped = _dump(value)
    try:
        again = _dump(model.model_validate(json.loads(json.dumps(dumped))))
    except (ValidationError, TypeError, ValueError) as exc:
        raise _Fail(f"{what}'s JSON dump does not re-validate: {_why(exc)}") from exc
    if again != dumped:
        raise _Fail(f"{what} changes when re-validated: {_diff(dumped, again)}")
    problem = _instance_errors(dumped, model.model_json_schema())
    if problem:
        raise _Fail(f"{what} does not match its JSON Schema: {problem}")


def _encodes(what: str, kind: str, payload: Callable[[], Any]) -> None:
    """Fail unless ``payload()`` encodes as the server sends it (``encode``, orjson): an
    environment whose results the server cannot encode answers every call with an error."""
    try:
        data = payload()
    except Exception as exc:
        raise _Fail(f"{what} cannot be serialised for the wire: {exc}") from exc
    reply = orjson.loads(encode({"type": kind, "data": data}))
    if reply.get("type") == "error":
        raise _Fail(
            f"{what} cannot be served: {reply['data'].get('message')} Return only JSON "
            "values (dict, list, str, int within 64 bits, float, bool, None) in info and "
            "observations."
        )


def _wire(result: StepResult[Any]) -> Any:
    return result.to_wire(extended=True)


class _GlobalDraw(Exception):
    """The global random generators moved during a determinism run (checked twice)."""


def _global_rng_state() -> tuple[Any, ...]:
    """The state of the process-wide random generators an environment might draw from."""
    states: list[Any] = [random.getstate()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            name, keys, pos, has_gauss, cached = numpy.random.get_state()
            states.append((name, keys.tobytes(), pos, has_gauss, cached))
    return tuple(states)


def _seed_global_rngs(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed(seed)


@contextlib.contextmanager
def _global_rngs_restored() -> Iterator[None]:
    saved = random.getstate()
    numpy = sys.modules.get("numpy")
    saved_numpy = None
    if numpy is not None:
        with contextlib.suppress(Exception):
            saved_numpy = numpy.random.get_state()
    try:
        yield
    finally:
        random.setstate(saved)
        if numpy is not None and saved_numpy is not None:
            with contextlib.suppress(Exception):
                numpy.random.set_state(saved_numpy)


def _same(a: Any, b: Any, key: str = "") -> bool:
    """Equal JSON values, except for what names each instance's own resources rather than
    the episode: values of keys called ``id`` or ending in ``_id`` (a sandbox's id) and
    existing filesystem paths (a private temporary directory)."""
    if key == "id" or key.endswith("_id"):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], str(k)) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if a == b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return (
        isinstance(a, str)
        and isinstance(b, str)
        and os.path.isabs(a)
        and os.path.isabs(b)
        and os.path.exists(a)
        and os.path.exists(b)
    )


_PATH = "<an existing path>"


def _paths_named(value: Any) -> Any:
    """``value`` with each existing absolute path replaced by one marker, taken while the
    episode runs: a path names the instance's or episode's own resource (a temporary
    directory, an episode's file that the next reset removes), not what the seed drew."""
    if isinstance(value, dict):
        return {k: _paths_named(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_paths_named(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value) and os.path.exists(value):
        return _PATH
    return value


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in a.keys() | b.keys() if not _same(a.get(k), b.get(k), str(k)))
        return "differs in " + ", ".join(keys)
    return f"{a!r} != {b!r}"


class _Checker:
    """Runs the checks in order, recording one result each. See the module docstring."""

    def __init__(
        self,
        env_id: str,
        factory: EnvFactory,
        *,
        seed: int,
        steps: int,
        call_timeout_s: float,
        leak_grace_s: float,
    ) -> None:
        self.report = CheckReport(env_id=env_id)
        self.factory = factory
        self.seed = seed
        self.steps = steps
        self.call_timeout_s = call_timeout_s
        self.leak_grace_s = leak_grace_s
        self.env: Env[Any, Any] | None = None
        self.reset_ok = False
        self.actions: list[Any] = []  # valid actions, from check_actions or the schema
        self.rewards: list[float] = []
        self.first_observation: Observation | None = None

    # --- running --------------------------------------------------------------------

    async def run(self) -> None:
        if not await self._run("construct", self.check_construct):
            return
        try:
            await self._run_all()
        finally:
            if self.env is not None:
                with contextlib.suppress(Exception):
                    await self._call(self.env.close(), "close()")

    async def _run_all(self) -> None:
        for name, fn in [
            ("types", self.check_types),
            ("schemas", self.check_schemas),
            ("check_actions", self.check_declared_actions),
            ("action_example", self.check_action_example),
            ("tool_specs", self.check_tool_specs),
            ("reset", self.check_reset),
            ("observation_roundtrip", self.check_observation_roundtrip),
            ("state_roundtrip", self.check_state_roundtrip),
            ("step", self.check_step),
            ("step_count", self.check_step_count),
            ("reward_range", self.check_reward_range),
            ("reset_determinism", self.check_reset_determinism),
            ("step_before_reset", self.check_step_before_reset),
            ("close_twice", self.check_close_twice),
            ("closed_calls", self.check_closed_calls),
            ("leaks", self.check_leaks),
        ]:
            await self._run(name, fn)

    async def _run(self, name: str, fn: Callable[[], Awaitable[str]]) -> bool:
        try:
            status, message = CheckStatus.PASS, await fn()
        except _Outcome as outcome:
            status, message = outcome.status, str(outcome)
        except Exception as exc:
            status, message = CheckStatus.FAIL, f"raised {type(exc).__name__}: {exc}"
        self.report.results.append(CheckResult(name=name, status=status, message=message))
        return status is CheckStatus.PASS

    async def _call(self, awaitable: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(awaitable, self.call_timeout_s)
        except TimeoutError:
            raise _Fail(f"{what} did not return within {self.call_timeout_s:g} s") from None

    def _make(self) -> Env[Any, Any]:
        env = self.factory()
        if not isinstance(env, Env):
            raise _Fail(f"the factory returned {type(env).__name__}, not an envport Env")
        return env

    @property
    def live(self) -> Env[Any, Any]:
        assert self.env is not None
        return self.env

    def _need_reset(self) -> None:
        if not self.reset_ok:
            raise _Skip("reset() failed")

    def _probe_actions(self) -> list[Any]:
        """Domain actions if any, else the always-valid ``list_tools`` action."""
        if self.actions:
            return self.actions
        if "type" in self.live.action_type.model_fields:
            return []
        return [ListToolsAction().model_dump()]

    # --- static ---------------------------------------------------------------------

    async def check_construct(self) -> str:
        self.env = self._make()
        return f"built {type(self.env).__name__}"

    async def check_types(self) -> str:
        notes = []
        for role, base in (("action", Action), ("observation", Observation), ("state", State)):
            model = getattr(self.live, f"{role}_type", None)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise _Fail(f"{role}_type is {model!r}, not a pydantic model class")
            if not issubclass(model, base):
                notes.append(f"{role}_type {model.__name__} does not subclass {base.__name__}")
        lo, hi = self.live.reward_range
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            raise _Fail(f"reward_range {(lo, hi)} is not (low, high) with low <= high")
        if notes:
            raise _Warn("; ".join(notes))
        return "action, observation and state types are pydantic models"

    async def check_schemas(self) -> str:
        for role, schema in self.live.schemas().items():
            problem = _schema_errors(schema)
            if problem:
                raise _Fail(f"{role} JSON Schema is invalid: {problem}")
        return "action, observation and state JSON Schemas are valid (Draft 2020-12)"

    async def check_declared_actions(self) -> str:
        declared = getattr(type(self.live), "check_actions", None)
        if declared is None:
            raise _Skip("no check_actions declared on the class")
        if not isinstance(declared, list | tuple) or not declared:
            raise _Fail("check_actions must be a non-empty list of action dicts")
        for i, action in enumerate(declared):
            try:
                self.live.parse_action(action)
            except Exception as exc:
                raise _Fail(f"check_actions[{i}] is not a valid action: {exc}") from exc
        self.actions = list(declared)
        return f"{len(declared)} declared action(s) validate"

    async def check_action_example(self) -> str:
        model = self.live.action_type
        schema = model.model_json_schema()
        try:
            example = example_from_schema(schema)
        except LookupError as exc:
            raise _Skip(f"cannot build an action from the schema: {exc}") from None
        try:
            action = model.model_validate(example)
        except ValidationError as exc:
            # The model is stricter than its schema (a validator JSON Schema cannot say).
            raise _Warn(
                f"{example!r}, built from the schema's defaults and examples, is rejected "
                f"by {model.__name__}: {_errors(exc)}. Declare check_actions."
            ) from None
        problem = _instance_errors(_dump(action), schema)
        if problem:
            raise _Fail(f"a validated action's dump fails its JSON Schema: {problem}")
        if not self.actions:
            self.actions = [example]
        return f"{example!r} validates and round-trips"

    async def check_tool_specs(self) -> str:
        specs = self.live.tool_specs()
        if not specs:
            raise _Skip("the environment has no tools")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise _Fail(f"duplicate tool names: {names}")
        undocumented = []
        for s in specs:
            if not s.name.isidentifier():
                raise _Fail(f"tool name {s.name!r} is not an identifier")
            if s.input_schema.get("type") != "object":
                raise _Fail(f"tool {s.name!r}: input_schema must have type 'object'")
            problem = _schema_errors(s.input_schema)
            if problem:
                raise _Fail(f"tool {s.name!r}: input_schema is invalid: {problem}")
            if not s.description:
                undocumented.append(s.name)
        if undocumented:
            raise _Warn(f"tools without a description: {', '.join(undocumented)}")
        return f"{len(specs)} tool(s) with valid input schemas: {', '.join(names)}"

    # --- runtime --------------------------------------------------------------------

    async def _reset(self, env: Env[Any, Any], **kwargs: Any) -> StepResult[Any]:
        result = await self._call(env.reset(seed=self.seed, **kwargs), "reset()")
        if not isinstance(result, StepResult):
            raise _Fail(f"reset() returned {type(result).__name__}, not a StepResult")
        return result

    def _record_reward(self, result: StepResult[Any]) -> None:
        if result.reward is not None:
            self.rewards.append(result.reward)

    async def check_reset(self) -> str:
        result = await self._reset(self.live)
        obs_type = self.live.observation_type
        if not isinstance(result.observation, obs_type):
            got = type(result.observation).__name__
            raise _Fail(f"reset() observation is a {got}, not the declared {obs_type.__name__}")
        _encodes("reset()'s result", "observation", lambda: _wire(result))
        self._record_reward(result)
        self.first_observation = result.observation
        self.reset_ok = True
        return f"reset(seed={self.seed}) returned {obs_type.__name__}, which encodes for the wire"

    async def check_observation_roundtrip(self) -> str:
        self._need_reset()
        assert self.first_observation is not None
        _roundtrip("the first observation", self.first_observation, self.live.observation_type)
        return "the first observation dumps, re-validates and matches its schema"

    async def check_state_roundtrip(self) -> str:
        self._need_reset()
        state = await self._call(self.live.state(), "state()")
        state_type = self.live.state_type
        if not isinstance(state, state_type):
            raise _Fail(f"state() returned {type(state).__name__}, not {state_type.__name__}")
        _roundtrip("the state", state, state_type)
        _encodes("state()", "state", lambda: state.model_dump(mode="json"))
        if not state.episode_id:
            raise _Fail("state().episode_id is empty after reset()")
        return "state() dumps, re-validates, matches its schema and encodes for the wire"

    async def check_step(self) -> str:
        self._need_reset()
        if not self.actions:
            raise _Warn(
                "no valid action to step with: declare "
                "check_actions: ClassVar[list[dict[str, Any]]] on the environment class, "
                "or give the action's required fields defaults or examples"
            )
        taken = 0
        for i in range(self.steps):
            action = self.actions[i % len(self.actions)]
            result = await self._call(self.live.step(action), f"step({action!r})")
            taken += 1
            if not isinstance(result, StepResult):
                raise _Fail(f"step() returned {type(result).__name__}, not a StepResult")
            if not isinstance(result.observation, Observation):
                raise _Fail(f"step() observation is a {type(result.observation).__name__}")
            _encodes(f"step({action!r})'s result", "observation", functools.partial(_wire, result))
            self._record_reward(result)
            if result.done:
                break
        return f"stepped {taken} time(s) with valid actions; every result encodes for the wire"

    async def check_step_count(self) -> str:
        self._need_reset()
        actions = self._probe_actions()
        if not actions:
            raise _Skip("no valid action to step with")
        await self._reset(self.live)
        await self._expect_count(0, "after reset()")
        taken = 0
        for i in range(self.steps):
            result = await self._call(self.live.step(actions[i % len(actions)]), "step()")
            self._record_reward(result)
            taken += 1
            await self._expect_count(taken, f"after {taken} step(s)")
            if result.done:
                break
        await self._reset(self.live)
        await self._expect_count(0, f"after {taken} step(s) and another reset()")
        return f"step_count went 0..{taken} and back to 0 on reset()"

    async def _expect_count(self, expected: int, when: str) -> None:
        state = await self._call(self.live.state(), "state()")
        if state.step_count != expected:
            raise _Fail(f"state().step_count is {state.step_count} {when}; expected {expected}")

    async def check_reward_range(self) -> str:
        self._need_reset()
        lo, hi = self.live.reward_range
        if not self.rewards:
            raise _Skip("no rewards observed")
        outside = [r for r in self.rewards if not (math.isfinite(r) and lo <= r <= hi)]
        if outside:
            raise _Fail(f"reward(s) {outside} outside reward_range ({lo}, {hi})")
        return f"{len(self.rewards)} reward(s) within ({lo}, {hi})"

    async def check_reset_determinism(self) -> str:
        self._need_reset()
        try:
            return await self._determinism()
        except _GlobalDraw:
            # Once more: another thread of this process (a library's back-off, say) may
            # have drawn from the global generator meanwhile; an environment that draws
            # from it unseeded does so every time.
            try:
                return await self._determinism()
            except _GlobalDraw as again:
                raise _Fail(str(again)) from None

    async def _determinism(self) -> str:
        # Each instance starts from a different global random state: an environment that
        # draws from random/numpy.random instead of self.rng then diverges, and leaves the
        # global state changed differently (seen even when its outputs happen to agree).
        with _global_rngs_restored():
            made: list[Env[Any, Any]] = []
            try:
                _seed_global_rngs(1)
                made.append(self._make())
                trace_a = await self._trace(made[0])
                drawn_a = _global_rng_state()
                # The same instance, reset again with the same seed, replays its episode:
                # nothing of the first (a counter, a history, a file) reaches the second.
                _seed_global_rngs(1)
                again_a = await self._trace(made[0])
                _seed_global_rngs(2)
                made.append(self._make())
                trace_b = await self._trace(made[1])
                drawn_b = _global_rng_state()
                _seed_global_rngs(1)
                untouched_a = _global_rng_state()
                _seed_global_rngs(2)
                untouched_b = _global_rng_state()
                # Compared while both are open: paths they name (a private temp directory)
                # exist now, and are each instance's own, not a draw.
                mismatch = next(
                    (
                        (what, a, b)
                        for (what, a), (_, b) in zip(trace_a, trace_b, strict=False)
                        if not _same(a, b)
                    ),
                    None,
                )
            finally:
                for env in made:
                    with contextlib.suppress(Exception):
                        await self._call(env.close(), "close()")
        hint = "Draw randomness from self.rng, which reset() seeds."
        if mismatch is not None:
            what, a, b = mismatch
            raise _Fail(
                f"two fresh instances reset with seed={self.seed} disagree on {what}: "
                f"{_diff(a, b)}. {hint}"
            )
        if len(trace_a) != len(trace_b):
            raise _Fail(
                f"two fresh instances reset with seed={self.seed} ended after different "
                f"numbers of steps ({len(trace_a)} and {len(trace_b)} results). {hint}"
            )
        replayed = next(
            (
                (what, a, b)
                for (what, a), (_, b) in zip(trace_a, again_a, strict=False)
                if not _same(a, b)
            ),
            None,
        )
        if replayed is not None or len(trace_a) != len(again_a):
            what, a, b = replayed or ("the number of steps", len(trace_a), len(again_a))
            raise _Fail(
                f"reset(seed={self.seed}) again on the same instance, after an episode, "
                f"disagrees with its first episode on {what}: {_diff(a, b)}. Start every "
                "episode afresh in on_reset: state left by the last episode must not reach "
                "the next."
            )
        # Per generator: an env that seeds `random` itself leaves numpy's as each run's
        # seeding left it (different in a and b, and untouched).
        drew = any(
            a != b and (a != ua or b != ub)
            for a, b, ua, ub in zip(drawn_a, drawn_b, untouched_a, untouched_b, strict=True)
        )
        if drew:
            raise _GlobalDraw(
                f"with seed={self.seed}, reset() or step() drew from the global random module "
                f"(or numpy.random), which the seed does not fix. {hint}"
            )
        steps = sum(what.endswith("'s state()") for what, _ in trace_a)
        return (
            f"seed={self.seed} gives the same first observation, state() and {steps} step "
            "result(s) on fresh instances"
        )

    async def _trace(self, env: Env[Any, Any]) -> list[tuple[str, Any]]:
        """What a seeded episode shows: the first result, state(), then each step's result
        and state(), with the declared (or probe) actions."""
        result = await self._reset(env, episode_id="envport-check")
        trace: list[tuple[str, Any]] = [
            ("the first observation", _paths_named(_dump(result.observation))),
            ("the first reward", result.reward),
        ]
        state = await self._call(env.state(), "state()")
        trace.append(("state() after reset()", _paths_named(_dump(state))))
        actions = self._probe_actions()
        for i in range(self.steps if actions else 0):
            action = actions[i % len(actions)]
            result = await self._call(env.step(action), f"step({action!r})")
            outcome = {
                "observation": _paths_named(_dump(result.observation)),
                "reward": result.reward,
                "terminated": result.terminated,
                "truncated": result.truncated,
            }
            trace.append((f"step {i + 1} ({action!r})", outcome))
            state = await self._call(env.state(), "state()")
            trace.append((f"step {i + 1}'s state()", _paths_named(_dump(state))))
            if result.done:
                break
        return trace

    async def check_step_before_reset(self) -> str:
        env = self._make()
        try:
            if not self.actions:  # list_tools/call_tool are answered before a reset
                raise _Skip("no domain action to step with (tool actions need no reset)")
            try:
                await self._call(env.step(self.actions[0]), "step()")
            except EnvNotResetError:
                return "step() before reset() raises EnvNotResetError"
            except _Outcome:
                raise
            except Exception as exc:
                raise _Fail(
                    f"step() before reset() raised {type(exc).__name__}, not EnvNotResetError"
                ) from exc
            raise _Fail("step() before reset() did not raise EnvNotResetError")
        finally:
            with contextlib.suppress(Exception):
                await self._call(env.close(), "close()")

    async def check_close_twice(self) -> str:
        await self._call(self.live.close(), "close()")
        try:
            await self._call(self.live.close(), "second close()")
        except _Outcome:
            raise
        except Exception as exc:
            raise _Fail(f"a second close() raised {type(exc).__name__}: {exc}") from exc
        return "close() twice is safe"

    async def check_closed_calls(self) -> str:
        env = self.live
        probe = (self._probe_actions() or [{}])[0]
        calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("reset()", lambda: env.reset(seed=self.seed)),
            ("step()", lambda: env.step(probe)),
            ("state()", env.state),
        ]
        wrong = []
        for what, call in calls:
            try:
                await self._call(call(), what)
            except EnvClosedError:
                continue
            except _Outcome:
                raise
            except Exception as exc:
                wrong.append(f"{what} raised {type(exc).__name__}")
                continue
            wrong.append(f"{what} succeeded")
        if wrong:
            raise _Fail(f"after close(), expected EnvClosedError but {'; '.join(wrong)}")
        return "reset(), step() and state() after close() raise EnvClosedError"

    # --- leaks ----------------------------------------------------------------------

    async def check_leaks(self) -> str:
        gc.collect()
        with _private_tempdir() as tmpdir:
            before = _snapshot()
            env = await self._episode_then_close()
            found = await self._wait_for_release(before, tmpdir)
            del env  # held until now, so a leak cannot hide behind garbage collection
        if found:
            raise _Fail("after close(): " + "; ".join(found))
        return "no threads, processes, file descriptors, tasks or temp files outlive close()"

    async def _episode_then_close(self) -> Env[Any, Any]:
        env = self._make()
        try:
            await self._reset(env)
            actions = self._probe_actions()
            for i in range(self.steps if actions else 0):
                result = await self._call(env.step(actions[i % len(actions)]), "step()")
                if result.done:
                    break
        finally:
            await self._call(env.close(), "close()")
        return env

    async def _wait_for_release(self, before: _Snapshot, tmpdir: str) -> list[str]:
        deadline = time.monotonic() + self.leak_grace_s
        while True:
            await asyncio.sleep(0)  # let finished tasks settle
            found = _leaks(before, tmpdir)
            if not found or time.monotonic() >= deadline:
                return found
            await asyncio.sleep(0.05)
