"""A rubric: named, weighted reward functions scored together, and group advantages.

::

    rubric = Rubric([
        RewardFunc(tests_pass, weight=1.0),
        RewardFunc(style, weight=0.2, name="style"),
        RewardFunc(length, weight=0.0),           # a metric: recorded, not in the total
    ])
    result = await rubric.score(ScoringContext(trace=trace, task=task, env=handle))
    result.apply(trace)

**How the total combines.** ``total`` is the weighted sum of the rubric's own components
— ``sum(weight * value)`` over components with a non-zero weight (negative weights are
penalties) — and nothing else. Per-step rewards that the environment gave stay where
they were recorded, on ``trace.steps[i].reward``, and are *not* added to the total
unless the rubric asks for them with the built-in ``env_reward`` component (which sums
them, or takes the last). So a trace keeps both: ``trace.steps[].reward`` from the
environment, ``trace.rewards`` (one :class:`~envport.trace.model.Reward` per rubric
component, ``step_index`` unset) and ``trace.reward`` (the total) from the rubric;
``trace.weighted_reward()`` equals the total.

**Metrics.** A component with weight 0 is a metric: it is scored and recorded (as a
reward of weight 0 and in ``metrics`` under its name) but does not change the total.
Extra metrics a function returns in its :class:`~envport.rubrics.functions.Score` are
recorded as ``"<component>/<key>"``.

**Failures.** A component that raises (any ``Exception``, ``SystemExit``, or a
``CancelledError`` of its own), times out, or returns something that is not a finite
number is recorded as a :class:`~envport.trace.model.TraceError` of kind
``rubric``, naming the component in ``where``; it gets no reward entry. If a weighted
component failed, ``total`` is ``None`` — the run was not scored, it did not score 0 —
and ``failed`` is true: the caller marks the run as a rubric failure. A failed metric is
recorded the same way but leaves the total alone. Components run concurrently; one
failing does not stop the others. Only ``KeyboardInterrupt`` and the cancellation of the
scoring itself propagate out of :meth:`Rubric.score`.

**No weighted component.** A rubric that is empty or made only of metrics has no total
either (``total`` is ``None``), but nothing failed: ``weighted`` and ``failed`` are false.
The caller treats such a run like one of a task with no rubric — completed, unscored —
with its metrics (and any failed metric's error) recorded. So ``failed`` means "a
weighted component failed", and ``total is None and not failed`` means "nothing to
total".
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from envport.deadlines import extended
from envport.rubrics.context import EnvHandle, ScoringContext
from envport.rubrics.errors import RubricBuildError, RubricError
from envport.rubrics.functions import (
    Injection,
    RewardFn,
    Score,
    call_reward_fn,
    callable_name,
    inspect_reward_fn,
    reward_threads,
)
from envport.trace.model import ErrorKind, Reward, Trace, TraceError

if TYPE_CHECKING:
    from envport.tasks.task import Task


_F = TypeVar("_F", bound=Callable[..., Any])

#: Reward functions that run a command -> the command's timeout (None: the rubric's).
_COMMANDS: weakref.WeakKeyDictionary[Callable[..., Any], float | None] = weakref.WeakKeyDictionary()


def runs_command(fn: _F, timeout_s: float | None) -> _F:
    """Declare that reward function ``fn`` runs a command that it gives ``timeout_s``
    (``None``: the rubric's ``timeout_s``, which :meth:`Rubric.for_task` sets to the
    task's scoring timeout). The layers above the command then wait ``timeout_s +``
    :data:`~envport.deadlines.GRACE_S` for it when their own deadline is shorter (the
    component's timeout here, the rollout controller's scoring stage: see
    :meth:`Rubric.command_timeout_s`), so the command's own timeout is what fires, with
    its own error (``test_command``'s "ran past its N s timeout"), never theirs."""
    _COMMANDS[fn] = timeout_s
    return fn


class RewardFunc:
    """One rubric component: a reward function, its weight, its name and its params.

    The function's parameters are checked when this is built (see
    :mod:`envport.rubrics.functions`). ``name`` defaults to the function's name;
    ``params`` is what the function receives if it asks for ``params``; ``timeout_s``
    bounds one call (default: the rubric's).
    """

    __slots__ = ("fn", "injection", "name", "params", "timeout_s", "weight")

    def __init__(
        self,
        fn: RewardFn,
        weight: float = 1.0,
        name: str | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.name = name or callable_name(fn)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise RubricBuildError(f"weight of {self.name!r} must be a number, got {weight!r}")
        if not math.isfinite(weight):
            raise RubricBuildError(f"weight of {self.name!r} must be finite, got {weight!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise RubricBuildError(f"timeout_s of {self.name!r} must be > 0, got {timeout_s!r}")
        self.fn = fn
        self.weight = float(weight)
        self.params: dict[str, Any] = dict(params or {})
        self.timeout_s = timeout_s
        self.injection: Injection = inspect_reward_fn(fn, self.name)

    @property
    def is_metric(self) -> bool:
        return self.weight == 0.0

    def __repr__(self) -> str:
        return f"RewardFunc({self.name!r}, weight={self.weight:g})"


class RubricResult(BaseModel):
    """What scoring one run produced. See the module docstring for how ``total`` is made."""

    model_config = ConfigDict(extra="forbid")

    rewards: list[Reward] = Field(default_factory=list)
    total: float | None = None
    #: The rubric had a component with a non-zero weight, so it makes a total. False for
    #: an empty or metrics-only rubric, whose ``total`` is always ``None``.
    weighted: bool = False
    errors: list[TraceError] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """No component failed (metrics included)."""
        return not self.errors

    @property
    def failed(self) -> bool:
        """A weighted component failed, so the run is unscored *because scoring failed*:
        the rollout is a rubric failure. False when there was nothing to total (an empty
        or metrics-only rubric), even if a metric failed."""
        return self.weighted and self.total is None

    def apply(self, trace: Trace) -> Trace:
        """Record this result on ``trace`` (in place) and return it.

        Replaces the trace's run-level rewards (those without ``step_index``), sets
        ``reward`` to ``total``, merges ``metrics``, appends ``errors`` and records the
        ``"scoring"`` timing. Step rewards and the trace's status are left alone.
        """
        trace.rewards = [r for r in trace.rewards if r.step_index is not None]
        trace.rewards.extend(self.rewards)
        trace.reward = self.total
        trace.metrics.update(self.metrics)
        trace.errors.extend(self.errors)
        trace.timings["scoring"] = self.duration_s
        return trace


class Rubric:
    """Weighted reward functions scored together. See the module docstring."""

    def __init__(
        self,
        funcs: Iterable[RewardFunc | RewardFn] = (),
        *,
        timeout_s: float | None = None,
    ) -> None:
        self.funcs: list[RewardFunc] = [
            f if isinstance(f, RewardFunc) else RewardFunc(f) for f in funcs
        ]
        self.timeout_s = timeout_s
        seen: set[str] = set()
        for f in self.funcs:
            if f.name in seen:
                raise RubricBuildError(
                    f"two rubric components are named {f.name!r}; reward names must be "
                    "unique, so give one of them another name (RewardFunc(..., name=...), "
                    "or 'name' in a rubric spec's params)"
                )
            seen.add(f.name)

    @classmethod
    def for_task(cls, task: Task, *, timeout_s: float | None = None) -> Rubric:
        """The rubric a task's ``rubric`` specs describe (see :func:`from_specs`); each
        component's timeout is ``timeout_s``, else the task's scoring timeout (a component
        that runs a command, such as ``test_command``, waits for that command's own
        timeout plus :data:`~envport.deadlines.GRACE_S` when that is longer).

        Cheap — no environment, no network — so a caller builds it before the agent runs
        and scores with it afterwards: a task whose rubric cannot be built (an unknown
        type, a misspelt param such as ``abs_tolerance``, a NaN weight, two components of
        one name) fails at once with :class:`RubricBuildError`, whose message starts
        ``task '<id>': rubric[<i>]: `` and whose details hold ``task`` (and ``index``). A
        task with no rubric gives an empty rubric (``weighted`` false).
        """
        from envport.rubrics.builtin import from_specs, locate

        try:
            return from_specs(task.rubric, timeout_s=timeout_s or task.resources.timeouts.scoring)
        except RubricBuildError as exc:
            raise locate(exc, f"task {task.id!r}", task=task.id) from exc.__cause__

    def _command_s(self, f: RewardFunc) -> float | None:
        """How long ``f``'s command may run (:func:`runs_command`), else ``None``."""
        if f.fn not in _COMMANDS:
            return None
        return _COMMANDS[f.fn] or self.timeout_s

    def command_timeout_s(self) -> float | None:
        """The longest timeout a component gives the command it runs (:func:`runs_command`;
        a Harbor verifier's ``timeout_sec``), or ``None`` when none declares one. Whoever
        bounds the whole scoring (the rollout controller's scoring stage) waits at least
        this plus :data:`~envport.deadlines.GRACE_S`."""
        declared = [d for f in self.funcs if (d := self._command_s(f)) is not None]
        return max(declared, default=None)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.funcs]

    @property
    def weighted(self) -> bool:
        """Whether any component has a non-zero weight (else the rubric makes no total)."""
        return any(not f.is_metric for f in self.funcs)

    def __len__(self) -> int:
        return len(self.funcs)

    def __repr__(self) -> str:
        return f"Rubric({self.funcs!r})"

    async def score(self, ctx: ScoringContext) -> RubricResult:
        """Score one run. Never raises for a failing component; see the module docstring.

        A component that raises any :class:`Exception`, :class:`SystemExit`, or a
        :class:`asyncio.CancelledError` of its own (one that is not the cancellation of
        the scoring task) is recorded as a failure. :class:`KeyboardInterrupt` and the
        cancellation of the scoring itself propagate.
        """
        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._score_one(f, ctx)) for f in self.funcs]
        result = RubricResult()
        failed_weighted = False
        total = 0.0
        for f, task in zip(self.funcs, tasks, strict=True):
            outcome = task.result()
            if isinstance(outcome, TraceError):
                result.errors.append(outcome)
                failed_weighted = failed_weighted or not f.is_metric
                continue
            result.rewards.append(
                Reward(name=f.name, value=outcome.value, weight=f.weight, reason=outcome.reason)
            )
            total += f.weight * outcome.value
            if f.is_metric:
                result.metrics[f.name] = outcome.value
            for key, value in outcome.metrics.items():
                result.metrics[f"{f.name}/{key}"] = value
        result.weighted = self.weighted
        result.total = total if result.weighted and not failed_weighted else None
        result.duration_s = time.perf_counter() - started
        return result

    async def score_trace(
        self,
        trace: Trace,
        task: Task | None = None,
        *,
        env: EnvHandle | None = None,
        state: dict[str, Any] | None = None,
        apply: bool = True,
    ) -> RubricResult:
        """Score ``trace`` (and, with ``apply``, record the result on it)."""
        result = await self.score(ScoringContext(trace=trace, task=task, env=env, state=state))
        if apply:
            result.apply(trace)
        return result

    async def _score_one(self, f: RewardFunc, ctx: ScoringContext) -> Score | TraceError:
        where = f"rubric:{f.name}"
        # A command's own timeout fires first: the component waits a grace beyond it.
        limit = extended(f.timeout_s or self.timeout_s, self._command_s(f))
        started = threading.Event()
        try:
            async with asyncio.timeout(limit) as deadline:
                return await call_reward_fn(
                    f.fn, f.injection, ctx, f.params, name=f.name, started=started
                )
        except TimeoutError as exc:
            if not deadline.expired():
                return TraceError.from_exception(exc, ErrorKind.RUBRIC, where=where)
            if f.injection.is_async or started.is_set():
                late = RubricError(f"reward function {f.name!r} did not finish within {limit:g} s")
            else:
                pool = reward_threads()
                late = RubricError(
                    f"reward function {f.name!r} did not start within {limit:g} s: all "
                    f"{pool.size} reward threads were busy (sync reward functions that "
                    "overran their timeouts hold theirs until they return); it was not run"
                )
            late.__cause__ = exc
            return TraceError.from_exception(late, ErrorKind.RUBRIC, where=where)
        except Exception as exc:
            return TraceError.from_exception(exc, ErrorKind.RUBRIC, where=where)
        except SystemExit as exc:
            # sys.exit() in a grader (or a library it calls) is its failure, not the process's.
            failure = RubricError(f"reward function {f.name!r} raised SystemExit({exc.code!r})")
            failure.__cause__ = exc
            return TraceError.from_exception(failure, ErrorKind.RUBRIC, where=where)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the scoring itself is being cancelled: let it be
            # Raised inside the function (e.g. it awaited a task someone cancelled), while
            # nobody cancelled the scoring: a failure of this component, not a cancellation.
            failure = RubricError(
                f"reward function {f.name!r} raised CancelledError, but the scoring was not "
                "cancelled (did it await a task or future that was cancelled?)"
            )
            failure.__cause__ = exc
            return TraceError.from_exception(failure, ErrorKind.RUBRIC, where=where)


# --- group-relative advantages -------------------------------------------------------------


def group_advantages(
    rewards: Sequence[float | None], *, normalize_std: bool = True, eps: float = 1e-4
) -> list[float | None]:
    """Group-relative advantages of the rewards of one group (rollouts of one prompt).

    With ``normalize_std`` (GRPO): ``(r - mean) / (std + eps)``, ``std`` the sample
    standard deviation (n - 1), as TRL's ``GRPOTrainer`` computes it. Without it
    (Dr. GRPO): ``r - mean``. ``None`` rewards (unscored runs) are skipped: they get
    ``None`` and do not count in the mean or std. A group with one scored run gets 0.
    """
    scored = [r for r in rewards if r is not None]
    if not scored:
        return [None for _ in rewards]
    mean = statistics.fmean(scored)
    std = statistics.stdev(scored) if len(scored) > 1 else 0.0
    out: list[float | None] = []
    for r in rewards:
        if r is None:
            out.append(None)
        elif normalize_std:
            out.append((r - mean) / (std + eps))
        else:
            out.append(r - mean)
    return out


def trace_advantages(
    traces: Iterable[Trace], *, normalize_std: bool = True, eps: float = 1e-4
) -> dict[str, float | None]:
    """``trace_id -> advantage``, computed within each ``group_id``.

    Traces without a ``group_id`` form a group of their own each (advantage 0, or
    ``None`` if unscored).
    """
    groups: dict[str, list[Trace]] = {}
    for trace in traces:
        groups.setdefault(trace.group_id or f"\0{trace.trace_id}", []).append(trace)
    out: dict[str, float | None] = {}
    for members in groups.values():
        values = group_advantages([t.reward for t in members], normalize_std=normalize_std, eps=eps)
        out.update((t.trace_id, a) for t, a in zip(members, values, strict=True))
    return out
