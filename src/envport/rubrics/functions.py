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

Async functions run on the event loop; sync ones on a thread of :class:`RewardThreads`,
a bounded pool owned by this module (:data:`DEFAULT_REWARD_THREADS` threads named
``envport-reward-N``, shared by every rubric in the process), so a slow check does not
stall other rollouts. A sync function that is given ``env`` cannot await it: write it
``async`` if it inspects the environment.

A sync function that runs past its timeout is reported as failed, but its thread runs on
to the end (threads cannot be stopped) and holds one of the pool's threads until then:
give slow checks a subprocess or an ``env`` call. The pool is not asyncio's default
executor, so hung graders cannot starve ``asyncio.to_thread`` work elsewhere (trace
stores, file reads). When every thread of the pool is held, a new sync call waits for
one within its own timeout; if none frees up in time it fails with "did not start within
… s: all N reward threads were busy", and a call that never started never runs. The
threads are daemon threads, so a grader that never returns does not keep the process from
exiting. Resize the pool with :func:`set_reward_threads`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import math
import numbers
import operator
import os
import queue
import threading
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


# --- the threads sync reward functions run on ---------------------------------------------

#: Threads in the pool for sync reward functions, unless :func:`set_reward_threads` says.
DEFAULT_REWARD_THREADS = min(32, (os.cpu_count() or 1) + 4)

_WorkItem = tuple["concurrent.futures.Future[Any]", Callable[[], Any]]


class RewardThreads:
    """A bounded pool of daemon threads that runs sync reward functions.

    Threads start as they are needed, up to ``size``, and live until :meth:`shutdown`.
    Work waits in a queue while all of them are busy; a call whose future is cancelled
    before a thread takes it never runs.
    """

    def __init__(self, size: int, *, name: str = "envport-reward") -> None:
        if size < 1:
            raise ValueError(f"a reward thread pool needs at least 1 thread, not {size}")
        self.size = size
        self.name = name
        self._queue: queue.SimpleQueue[_WorkItem | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work (or about to)
        self._queued = 0  # work items no thread has taken yet
        self._closed = False

    @property
    def busy(self) -> int:
        """Threads running a function now (including any that overran their timeout)."""
        with self._lock:
            return len(self._threads) - self._idle

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn()`` on a thread of the pool; its result or exception on the future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} thread pool is shut down")
            self._queue.put((future, fn))
            self._queued += 1
            if self._queued > self._idle and len(self._threads) < self.size:
                thread = threading.Thread(
                    target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                self._idle += 1
                thread.start()
        return future

    def shutdown(self) -> None:
        """Stop taking work; idle threads exit now, busy ones when their function returns.
        Work already queued still runs first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                if item is None:
                    self._threads.remove(threading.current_thread())
                    return
                self._queued -= 1
            future, fn = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:  # handed to the caller, who decides
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn
            with self._lock:
                self._idle += 1


_pool: RewardThreads | None = None
_pool_lock = threading.Lock()


def reward_threads() -> RewardThreads:
    """The pool sync reward functions run on (made on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = RewardThreads(DEFAULT_REWARD_THREADS)
        return _pool


def set_reward_threads(size: int | None) -> None:
    """Give sync reward functions a pool of ``size`` threads (``None``: the default size).

    The old pool is shut down: its idle threads exit, and a thread still running a
    function (one that overran its timeout, say) exits when that function returns.
    """
    global _pool
    new = RewardThreads(DEFAULT_REWARD_THREADS if size is None else size)
    with _pool_lock:
        old, _pool = _pool, new
    if old is not None:
        old.shutdown()


async def run_sync(
    fn: RewardFn,
    *args: Any,
    started: threading.Event | None = None,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` on a thread of :func:`reward_threads`, in a copy of the
    caller's context (as ``asyncio.to_thread`` does). ``started`` is set when a thread
    begins running it; cancelling the call before that means it never runs."""
    context = contextvars.copy_context()

    def call() -> Any:
        if started is not None:
            started.set()
        return context.run(fn, *args, **kwargs)

    future = reward_threads().submit(call)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if not future.cancel() and started is not None:
            started.set()  # a thread had already taken it, and runs it on
        raise


# --- calling a reward function --------------------------------------------------------------


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
    started: threading.Event | None = None,
) -> Score:
    """Call ``fn`` with what it asked for, and check what it returned.

    A sync ``fn`` runs on :func:`reward_threads`; ``started`` is set when it begins
    (for an async ``fn``, when it is called), so a caller that gave up can tell a call
    that overran from one that never got a thread.
    """
    args = [await resolve(n, ctx, params) for n in injection.positional]
    kwargs = {n: await resolve(n, ctx, params) for n in injection.keyword}
    if injection.is_async:
        if started is not None:
            started.set()
        value = await fn(*args, **kwargs)
    else:
        value = await run_sync(fn, *args, started=started, **kwargs)
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
