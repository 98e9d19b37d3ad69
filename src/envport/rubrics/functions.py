"""Reward functions: any callable, sync or async, given what it asks for by name.

::

    def correct(answer, reference) -> float: ...
    async def tests_pass(env, params) -> Score: ...

A reward function's parameters are resolved **by name** from the
:class:`~envport.rubrics.context.ScoringContext`; the names it may use are
:data:`PARAMETERS`:

========== ==========================================================================
task        the :class:`~envport.tasks.task.Task` (``None`` when scoring without one)
trace       the :class:`~envport.trace.model.Trace` of the run
observation the final observation, a dict (``None`` if there is none)
completion  text of the last assistant message (``None`` if there is none)
answer      the final answer marked in the completion (``None`` if none is marked)
state       the environment's ``state()`` as a dict, fetched on first use
env         the :class:`~envport.rubrics.context.EnvHandle` (files, commands, tools)
reference   ``task.answer``, the reference answer
metadata    ``task.metadata``
params      the component's own parameters (a task's ``RubricSpec.params``)
========== ==========================================================================

A parameter with another name is an error when the rubric is built
(:class:`~envport.rubrics.errors.RubricBuildError`), so a typo never becomes a silent
``None``. The one exception is a keyword-only parameter with a default, which is left
at its default: that is what ``functools.partial(fn, threshold=0.5)`` produces. A
``**kwargs`` parameter receives every name.

A function returns a number (``bool`` counts as 1.0/0.0) or a :class:`Score` carrying a
reason and extra metrics. A number is any real number: ``int``, ``float``, ``bool``, or a
type that converts like one, such as numpy's ``float32``, ``int64`` and ``bool_``, a 0-d
array, ``Fraction`` or ``Decimal`` (the same holds for metrics). ``None``, NaN,
infinities, text, complex numbers and other types are errors, not 0.
Async functions run on the event loop; sync ones in a worker thread
(``asyncio.to_thread``), so a slow check does not stall other rollouts. A sync function
that is given ``env`` cannot await it: write it ``async`` if it inspects the environment.
A sync function that runs past its timeout is reported as failed, but its thread runs on
to the end (threads cannot be stopped): give slow checks a subprocess or an ``env`` call.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from envport.rubrics.context import ScoringContext
from envport.rubrics.errors import RubricBuildError, RubricError

#: The names a reward function's parameters may have, and what each receives.
PARAMETERS: Mapping[str, str] = {
    "task": "the Task",
    "trace": "the Trace of the run",
    "observation": "the final observation (dict)",
    "completion": "text of the last assistant message",
    "answer": "the final answer marked in the completion",
    "state": "the environment's state() (dict)",
    "env": "an EnvHandle to inspect the environment",
    "reference": "task.answer",
    "metadata": "task.metadata",
    "params": "the component's own parameters",
}

RewardFn = Callable[..., Any]


@dataclass(frozen=True)
class Score:
    """A reward value with the reason for it and any extra metrics to record."""

    value: float
    reason: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Injection:
    """How to call one reward function: which names go where."""

    positional: tuple[str, ...]
    keyword: tuple[str, ...]
    is_async: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.positional + self.keyword)


def callable_name(fn: RewardFn) -> str:
    """A readable name for ``fn``: its ``__name__``, unwrapping ``functools.partial``."""
    inner = getattr(fn, "func", fn)
    name = getattr(inner, "__name__", None) or type(inner).__name__
    return str(name)


def is_async_callable(fn: RewardFn) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


def inspect_reward_fn(fn: RewardFn, name: str | None = None) -> Injection:
    """Check ``fn``'s parameter names against :data:`PARAMETERS`; say how to call it."""
    label = name or callable_name(fn)
    if not callable(fn):
        raise RubricBuildError(f"reward function {label!r} is a {type(fn).__name__}, not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise RubricBuildError(
            f"cannot read the parameters of reward function {label!r}: {exc}"
        ) from exc
    positional: list[str] = []
    keyword: list[str] = []
    unknown: list[str] = []
    for param in signature.parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            continue
        if param.kind is param.VAR_KEYWORD:
            keyword.extend(n for n in PARAMETERS if n not in positional and n not in keyword)
            continue
        if param.name not in PARAMETERS:
            if param.kind is param.KEYWORD_ONLY and param.default is not param.empty:
                continue  # bound configuration, e.g. functools.partial(fn, threshold=0.5)
            unknown.append(param.name)
        elif param.kind is param.POSITIONAL_ONLY:
            positional.append(param.name)
        else:
            keyword.append(param.name)
    if unknown:
        names = ", ".join(repr(n) for n in unknown)
        raise RubricBuildError(
            f"reward function {label!r} asks for {names}, which the rubric cannot provide. "
            f"Parameters are filled by name from: {', '.join(PARAMETERS)}. Pass other "
            "settings through 'params' (or bind them with functools.partial).",
            function=label,
            unknown=unknown,
        )
    return Injection(tuple(positional), tuple(keyword), is_async_callable(fn))


async def resolve(name: str, ctx: ScoringContext, params: Mapping[str, Any]) -> Any:
    """The value of one injectable name in ``ctx``."""
    if name == "state":
        return await ctx.get_state()
    if name == "env":
        if ctx.env is None:
            raise RubricError(
                "this reward function inspects the environment ('env'), but the scoring "
                "context has no environment handle; pass env=LocalDirHandle(...) or "
                "ClientHandle(client) to ScoringContext"
            )
        return ctx.env
    if name == "params":
        return dict(params)
    if name == "reference":
        return ctx.reference
    if name == "metadata":
        return ctx.metadata
    return getattr(ctx, name)


async def call_reward_fn(
    fn: RewardFn,
    injection: Injection,
    ctx: ScoringContext,
    params: Mapping[str, Any],
    *,
    name: str,
) -> Score:
    """Call ``fn`` with what it asked for, and check what it returned."""
    args = [await resolve(n, ctx, params) for n in injection.positional]
    kwargs = {n: await resolve(n, ctx, params) for n in injection.keyword}
    if injection.is_async:
        value = await fn(*args, **kwargs)
    else:
        value = await asyncio.to_thread(fn, *args, **kwargs)
        if inspect.isawaitable(value):
            value = await value
    return to_score(value, name)


def real_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number, else ``None``.

    Accepts ``int``, ``float``, ``bool`` and any other real number type — anything
    registered as :class:`numbers.Real` (numpy's ``float32``, ``int64``, …) or that converts
    with ``__float__`` or ``__index__`` (numpy's ``bool_``, a 0-d array, ``Decimal``). Text,
    bytes and complex numbers are not numbers here, even where ``float()`` would take them.
    The result may be NaN or infinite; callers decide about that.
    """
    if isinstance(value, str | bytes | bytearray):
        return None
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return None  # float() would drop the imaginary part, or refuse
    if getattr(getattr(value, "dtype", None), "kind", None) == "c":
        return None  # a complex numpy array
    cls = type(value)
    try:
        if isinstance(value, numbers.Real) or hasattr(cls, "__float__"):
            return float(value)
        if hasattr(cls, "__index__"):
            return float(operator.index(value))
    except (TypeError, ValueError, OverflowError):
        return None
    return None


def to_score(value: Any, name: str) -> Score:
    """A reward function's return value as a :class:`Score`; anything else is an error.

    Numbers of any real type (see :func:`real_number`) come back as ``float``.
    """
    score = value if isinstance(value, Score) else Score(value)
    number = real_number(score.value)
    if number is None:
        what = "a Score whose value is " if isinstance(value, Score) else ""
        raise RubricError(
            f"reward function {name!r} returned {what}{type(score.value).__name__} "
            f"({score.value!r:.80}); return a number, a bool, or a Score"
        )
    if not math.isfinite(number):
        raise RubricError(f"reward function {name!r} returned {number}; rewards are finite")
    metrics: dict[str, float] = {}
    for key, metric in score.metrics.items():
        as_float = real_number(metric)
        if as_float is None:
            raise RubricError(
                f"reward function {name!r} returned metric {key!r} = {metric!r:.80}; "
                "metrics are numbers"
            )
        metrics[key] = as_float
    return Score(number, score.reason, metrics)
