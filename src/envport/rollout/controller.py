"""The rollout controller: runs rollouts on leased environments, exactly once each.

A rollout is a task, a harness (the policy that drives it) and an attempt budget. The
controller runs many at once under a global limit and per-environment-type limits,
leases an environment slot from a warm :class:`~envport.rollout.pool.EnvPool` per
environment type, runs the harness under stage deadlines (environment start, agent,
scoring) and a heartbeat watchdog, scores the run, and writes the final trace together
with the rollout's final state in one store transaction.

Use it as an async context manager; everything it starts belongs to its task group and
is stopped (instances included) when the block ends, on error and on Ctrl-C alike::

    async with Controller(store, LocalProcessBackend("runs/instances"), agent,
                          ControllerConfig(concurrency=32), run_id="exp1") as ctl:
        summary = await ctl.run([RolloutSpec(task, k) for task in tasks for k in range(4)])

        # or, for a trainer that overlaps collection with training:
        pending = ctl.submit(next_group_specs)     # returns at once; tasks run
        traces = [r.trace for r in await asyncio.gather(*pending)]

``on_event`` (a plain callback) sees every state change, for progress displays.

Faults, and what becomes of them:

* **Heartbeats.** An attempt is alive while something moves: a reply from the
  environment, a new model call / message / step on the trace, or an explicit
  :func:`heartbeat` from harness code. ``hang_timeout_s`` without one aborts the attempt:
  classified ``infrastructure`` when an environment call was outstanding (the
  environment hung), else ``harness`` (the harness stopped making progress). Instances
  are also health-checked by their backend while an attempt runs; a dead one aborts it.
* **Retries.** Failures of the kinds in ``retry_on`` (infrastructure, sandbox) are retried
  on a fresh instance (the old one is retired) until ``max_attempts``; every attempt is
  a row in the store's ``attempts`` table. Other failures end the rollout ``failed``
  with a classified error and no reward: never a 0, never in training data. One
  rollout's failure never touches its siblings.
* **Restarts.** Rollout ids are deterministic (``run/task/k``, or ``run/task/k@group``
  for a spec that names its own group: :func:`rollout_id`). On entry the controller
  marks every in-flight attempt of its run ``abandoned`` (reason
  ``controller_restart``), requeues those rollouts, and re-adopts the run's instances
  that its backend still has (``Backend.list``). Rollouts already final are skipped, and
  a second final trace for a rollout is refused by the store, so each rollout ends up
  in the store, and in training rows, exactly once.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import inspect
import logging
import math
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticSerializationError

from envport.client import EnvClient
from envport.deadlines import GRACE_S, frame_timeout, stage_deadline
from envport.errors import ConnectionLostError, EnvportError, EnvTimeoutError, NoReplyError
from envport.harness.agent import task_host_dirs
from envport.harness.model import ModelProviderError
from envport.procs import owner_alive, owner_tag, parse_owner
from envport.rollout.backends.base import Backend, BackendError, EnvInstance, EnvLaunch, Limits
from envport.rollout.pool import EnvPool, Lease, PoolClosedError
from envport.rollout.state import AttemptState, IllegalTransitionError, RolloutState
from envport.rubrics import Rubric, RubricBuildError
from envport.tasks import Task
from envport.trace import AsyncTraceStore, ErrorKind, Run, Trace, TraceError, TraceStatus
from envport.trace.store import AttemptRecord, RolloutRecord, SQLiteTraceStore, check_reward

_log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Label a controller puts on every instance it starts; it re-adopts by it.
RUN_LABEL = "envport-run"
#: The limits an instance was started with (:func:`limits_label`): a restarted
#: controller puts it back in the pool of that shape.
LIMITS_LABEL = "envport-limits"

#: The controller that started an instance (the random part of its id): a controller of
#: the same run alive in this process holds it, and it is not re-adopted.
OWNER_LABEL = "envport-controller"

_LIMIT_KEYS = (("c", "cpus"), ("m", "memory_mb"), ("p", "pids"), ("d", "disk_mb"))


def limits_label(limits: Limits) -> str:
    """``limits`` as a label value (``c2-m1024``; ``none``): Kubernetes' label rules."""
    parts = []
    for key, name in _LIMIT_KEYS:
        value = getattr(limits, name)
        if value:  # integers as they are; cpus in plain decimals (no exponent, no '+')
            text = str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0")
            parts.append(f"{key}{text.rstrip('.')}")
    return "-".join(parts) or "none"


def parse_limits_label(value: str) -> Limits | None:
    """The :class:`Limits` a :func:`limits_label` names; None if it is not one."""
    if value == "none":
        return Limits()
    fields: dict[str, float] = {}
    names = dict(_LIMIT_KEYS)
    try:
        for part in value.split("-"):
            fields[names[part[:1]]] = float(part[1:])
        return Limits.model_validate({k: v if k == "cpus" else int(v) for k, v in fields.items()})
    except (KeyError, ValueError):
        return None


#: Controllers alive in this process: their in-flight rollouts are not stale.
_LIVE: set[str] = set()
#: Instance id -> the live controller in this process that re-adopted it.
_ADOPTED: dict[str, str] = {}


class ControllerConflictError(EnvportError):
    """Another live controller is driving this run; two would run rollouts twice."""


class Harness(Protocol):
    """What drives one episode: the built-in agent, or any adapter with this method."""

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None: ...


_beat: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "envport_heartbeat", default=None
)


def heartbeat() -> None:
    """Tell the controller the current attempt is alive (harness code may call it)."""
    beat = _beat.get()
    if beat is not None:
        beat()


def default_group(run_id: str, task: Task) -> str:
    """The group of a rollout whose spec names none: every rollout of the task in the run."""
    return f"{run_id}/{task.id}"


def rollout_id(run_id: str, task: Task, index: int, group_id: str | None = None) -> str:
    """A rollout's deterministic id: ``run/task/index``, or ``run/task/index@group`` when
    the spec names a group of its own. A rollout requested for another group is another
    rollout (a trainer's ``step8/g3`` is never ``step7/g0``'s result, nor mixed into it);
    the same group, task and index again is the same rollout (resume, exactly once).

    The task id's ``%`` and ``@`` are percent-encoded (``a@b`` is ``a%40b`` here; the
    trace's ``task_id`` keeps it as it is), so the first ``@`` is always the group's:
    no task id, index and group can spell another's id."""
    task_part = task.id.replace("%", "%25").replace("@", "%40")
    if group_id is None or group_id == default_group(run_id, task):
        return f"{run_id}/{task_part}/{index}"
    return f"{run_id}/{task_part}/{index}@{group_id}"


#: An environment call that hung: past the server's deadline for it, or no reply at all.
_HUNG = (EnvTimeoutError, NoReplyError)


def classify(exc: BaseException, stage: str) -> ErrorKind:
    """Where a failure belongs, from what was raised and the stage it was raised in."""
    if isinstance(exc, ModelProviderError):
        return ErrorKind.MODEL_PROVIDER
    if isinstance(exc, RubricBuildError):
        return ErrorKind.TASK  # the task's own rubric cannot be built: never retried
    if isinstance(exc, (ConnectionLostError, BackendError, PoolClosedError, *_HUNG)):
        # In any stage: scoring on a dead env is retried; an env call that ran past its
        # deadline, or got no reply at all, hung (the hang watchdog may name it first).
        return ErrorKind.INFRASTRUCTURE
    if stage == "scoring":
        return ErrorKind.RUBRIC
    if stage == "env_start" and isinstance(exc, OSError):  # timeouts, refused, out of fds
        return ErrorKind.INFRASTRUCTURE
    if isinstance(exc, EnvportError) and exc.details.get("failure") == "sandbox":
        return ErrorKind.SANDBOX  # a SandboxFailure, raised here or sent by a server
    if isinstance(exc, EnvportError):
        return ErrorKind.ENVIRONMENT
    return ErrorKind.HARNESS  # the agent loop itself, or its deadline


async def score(task: Task, trace: Trace, env: EnvClient, rubric: Rubric | None = None) -> None:
    """Score with the task's rubric (``rubric``: built already, see
    :meth:`~envport.rubrics.Rubric.for_task`); the env stays open so rubrics can inspect
    it."""
    from envport.rubrics import ClientHandle, ScoringContext

    rubric = rubric if rubric is not None else Rubric.for_task(task)
    if not len(rubric):
        return
    ctx = ScoringContext(trace=trace, task=task, env=ClientHandle(env))
    result = await rubric.score(ctx)
    result.apply(trace)


# --- configuration and results ------------------------------------------------------------


class ControllerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(16, ge=1, description="Rollouts in flight at once.")
    env_concurrency: dict[str, int] = Field(
        default_factory=dict, description="env id -> rollouts of that type in flight at once."
    )
    max_attempts: int = Field(3, ge=1, description="Attempts per rollout (retries + 1).")
    retry_on: frozenset[ErrorKind] = Field(
        frozenset({ErrorKind.INFRASTRUCTURE, ErrorKind.SANDBOX}),
        description="Failure kinds retried on a fresh instance.",
    )
    env_start_timeout_s: float = Field(60.0, gt=0, description="Default env_start deadline.")
    agent_timeout_s: float = Field(300.0, gt=0, description="Default agent deadline.")
    scoring_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Default scoring deadline; extended to a command's own timeout (a "
        "test_command's timeout_s, a Harbor verifier's timeout_sec) plus a grace.",
    )
    hang_timeout_s: float | None = Field(
        60.0, gt=0, description="Abort an attempt after this long without a heartbeat."
    )
    health_interval_s: float = Field(5.0, gt=0, description="Instance health-check period.")
    sessions_per_instance: int = Field(1, ge=1, description="Sessions one instance hosts.")
    pool_size: int = Field(0, ge=0, description="Instances kept warm per environment type.")
    max_episodes: int | None = Field(None, ge=1, description="Recycle an instance after N.")
    env_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="env id -> keyword arguments for its instances."
    )
    env_limits: dict[str, Limits] = Field(
        default_factory=dict,
        description="env id -> resource limits for its instances; a task's own resources "
        "(cpus, memory_mb, storage_mb) override them field by field.",
    )
    heartbeat_persist_s: float = Field(5.0, gt=0, description="How often heartbeats are stored.")


@dataclass(frozen=True)
class RolloutSpec:
    """One rollout to run: task ``index`` (0..k-1) of ``task``, by ``harness``, in group
    ``group_id`` (default: the run's group for the task). The group is part of the
    rollout's identity (:func:`rollout_id`)."""

    task: Task
    index: int = 0
    harness: Harness | None = None
    max_attempts: int | None = None
    group_id: str | None = None


class RolloutEvent(BaseModel):
    """A state change, for progress displays (``on_event``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rollout_id: str
    state: RolloutState
    previous: RolloutState | None = None
    attempt: int = 0
    error_kind: ErrorKind | None = None
    env_start_s: float | None = None
    skipped: bool = False
    trace: Trace | None = None


@dataclass(frozen=True)
class RolloutResult:
    rollout_id: str
    trace: Trace
    attempts: int
    skipped: bool = False

    @property
    def succeeded(self) -> bool:
        return self.trace.status is TraceStatus.COMPLETED


class ControllerSummary(BaseModel):
    run_id: str
    rollouts: int
    succeeded: int
    failed: int
    skipped: int = Field(0, description="Already final in the store (resume).")
    attempts: int = Field(0, description="Attempts this controller started.")
    retried: int = Field(0, description="Attempts that failed and were retried.")
    abandoned: int = Field(0, description="In-flight attempts of a previous controller.")
    adopted: int = Field(0, description="Instances re-adopted from a previous controller.")
    errors_by_kind: dict[str, int] = Field(default_factory=dict)
    env_start_s: dict[str, float] = Field(
        default_factory=dict,
        description="Percentiles (percentiles()) of how long attempts waited for a new "
        "instance to start; warm hits are not samples.",
    )
    env_starts: int = Field(0, description="Attempts that waited for a new instance (samples).")
    wall_s: float = 0.0


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Nearest-rank p50, p90, p99 and max of ``values`` (``{}`` for none): each is a
    sample, the smallest with at least that share of the samples at or below it."""
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


# --- one attempt in flight ------------------------------------------------------------------


class _Hang(Exception):
    """No heartbeat within the hang timeout; ``kind`` says whose fault it was."""

    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


class _StageFailed(Exception):
    """``error`` ended the attempt during ``stage`` (carried out of the watchdog)."""

    def __init__(self, stage: str, error: Exception) -> None:
        super().__init__(stage, error)
        self.stage = stage
        self.error = error

    @property
    def kind(self) -> ErrorKind:
        if isinstance(self.error, _Hang):
            return self.error.kind
        return classify(self.error, self.stage)


class _Monitor:
    """Heartbeats of one attempt: environment replies, trace progress, explicit beats."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.busy = 0
        self.progress = 0
        # A call in flight that declared its timeout_s is no hang before this time.
        self.quiet_until = 0.0

    def beat(self) -> None:
        self.last = time.monotonic()

    def poll(self, trace: Trace) -> None:
        progress = len(trace.model_calls) + len(trace.steps) + len(trace.messages)
        if progress != self.progress:
            self.progress = progress
            self.beat()


class _BeatingTransport:
    """Wraps a client transport: every reply is a heartbeat; counts calls in flight."""

    def __init__(self, inner: Any, monitor: _Monitor) -> None:
        self.inner = inner
        self.monitor = monitor

    async def open(self) -> None:
        self.monitor.busy += 1
        try:
            await self.inner.open()
        finally:
            self.monitor.busy -= 1
            self.monitor.beat()

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        monitor = self.monitor
        declared = frame_timeout(frame)
        if declared is not None:  # a long command is not a hung environment
            until = time.monotonic() + declared + GRACE_S
            monitor.quiet_until = max(monitor.quiet_until, until)
        monitor.busy += 1
        try:
            reply: dict[str, Any] = await self.inner.request(frame)
            return reply
        finally:
            monitor.busy -= 1
            if monitor.busy == 0:
                monitor.quiet_until = 0.0
            monitor.beat()

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class _Flight:
    spec: RolloutSpec
    rollout_id: str
    state: RolloutState
    attempt: AttemptRecord
    trace: Trace
    monitor: _Monitor = field(default_factory=_Monitor)
    next_health: float = 0.0


def _owner(controller_id: str) -> str:
    """A controller id's random part: the :data:`OWNER_LABEL` value (a label value on
    every backend, Kubernetes' rules included)."""
    return controller_id.rsplit(":", 1)[-1]


def _controller_id() -> str:
    """``host:PID-tSTART:random``: the owner tag (:func:`envport.procs.owner_tag`) tells
    this process from a later one that gets the same pid."""
    return f"{socket.gethostname()}:{owner_tag()}:{uuid.uuid4().hex[:8]}"


async def _settle(job: asyncio.Task[None], client: EnvClient) -> None:
    """Cancel ``job``; if a call it is stuck in does not yield within a second, drop the
    environment connection under it so that its task group never waits forever."""
    job.cancel()
    done, _ = await asyncio.wait({job}, timeout=1.0)
    if done:
        return
    transport = client.transport
    inner = getattr(transport, "inner", transport)
    drop = getattr(inner, "drop_connection", None)
    try:
        async with asyncio.timeout(5.0):
            await (drop() if drop is not None else inner.close())
    except Exception:  # best effort: the instance is retired or stopped next anyway
        return


async def _close_quietly(client: EnvClient) -> None:
    try:
        async with asyncio.timeout(5.0):
            await client.close()
    except Exception:  # the session is gone with its instance; nothing left to release
        return


# --- the controller ---------------------------------------------------------------------------


class Controller:
    """Runs rollouts of one run id against one backend into one store."""

    def __init__(
        self,
        store: AsyncTraceStore,
        backend: Backend,
        harness: Harness | None = None,
        config: ControllerConfig | None = None,
        *,
        run_id: str,
        taskset: str | None = None,
        on_event: Callable[[RolloutEvent], None] | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(store.store, SQLiteTraceStore):
            raise TypeError(
                "the controller keeps rollout state in the store; it needs a "
                f"SQLiteTraceStore, not {type(store.store).__name__}"
            )
        self.store = store
        self._db: SQLiteTraceStore = store.store
        self.backend = backend
        self.harness = harness
        self.config = config or ControllerConfig()
        self.run_id = run_id
        self.taskset = taskset
        self.on_event = on_event
        self.run_config = run_config or {}
        self.controller_id = _controller_id()
        self._gate = asyncio.Semaphore(self.config.concurrency)
        self._env_gates: dict[str, asyncio.Semaphore] = {}
        self._pools: dict[str, EnvPool] = {}
        # env id -> the folders holding the host directories its tasks name (task_dir,
        # workspace), granted to its instances as workspace_roots: the env refuses others.
        self._host_dirs: dict[str, frozenset[str]] = {}
        self._tasks: dict[str, asyncio.Task[RolloutResult]] = {}
        self._specs: dict[str, RolloutSpec] = {}  # the spec each rollout id was first given
        self._services: list[asyncio.Task[None]] = []
        self._flights: dict[str, _Flight] = {}
        self._tg: asyncio.TaskGroup | None = None
        #: How long each attempt that started an instance for its lease waited for it
        #: (warm hits are not samples), in the order they came.
        self.env_start_s: list[float] = []
        self.attempts_started = 0
        self.retried = 0
        self.abandoned = 0
        self.adopted = 0

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Controller:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        _LIVE.add(self.controller_id)
        try:
            await self._recover()
            self._services.append(self._tg.create_task(self._persist_heartbeats()))
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, et: Any, exc: Any, tb: Any) -> None:
        """Cancel whatever still runs (the next controller re-runs it), stop instances."""
        assert self._tg is not None
        _LIVE.discard(self.controller_id)
        for instance_id in [i for i, c in _ADOPTED.items() if c == self.controller_id]:
            del _ADOPTED[instance_id]
        for task in [*self._services, *self._tasks.values()]:
            task.cancel()
        # Children are cancelled above; hand the task group only a cancellation, so an
        # error raised in the ``async with`` body propagates as itself, not as a group.
        cancelled = isinstance(exc, asyncio.CancelledError)
        try:
            if cancelled:
                await self._tg.__aexit__(et, exc, tb)
            else:
                await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            # Re-entering starts afresh: the store, not this map, knows what finished.
            self._tasks.clear()
            self._services.clear()
            self._flights.clear()
            pools = list(self._pools.values())
            self._pools.clear()
            results = await asyncio.gather(*(p.aclose() for p in pools), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, Exception):
                    raise result

    async def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        # On the store's own executor: the loop's default one is shared with every
        # asyncio.to_thread user, and work stuck there must not stall rollout state.
        return await self.store.run(fn, *args, **kwargs)

    async def _recover(self) -> None:
        """Requeue what a previous controller of this run left in flight; re-adopt."""
        if not await self._call(self._has_run):
            await self.store.put_run(Run(run_id=self.run_id, config=self.run_config))
        live = [s.value for s in RolloutState if not s.is_final and s is not RolloutState.PENDING]
        rows = await self._call(self._db.rollouts, run_id=self.run_id, states=live)
        stale = [r for r in rows if r.controller not in _LIVE]  # not another one's, here
        host = socket.gethostname()
        for rec in stale:
            parts = (rec.controller or "").split(":")
            owner = parse_owner(parts[1]) if len(parts) == 3 and parts[0] == host else None
            if owner is not None and owner[0] != os.getpid() and owner_alive(*owner):
                raise ControllerConflictError(
                    f"run {self.run_id!r} is being driven by a live controller "
                    f"(pid {owner[0]}); stop it first, or use another run id"
                )
        for rec in stale:
            if await self._requeue(rec, "controller_restart"):
                self.abandoned += 1
        # Instances of the run that another live controller here holds (one it started,
        # or re-adopted) are in use by it (Evaluator.run_one makes a controller per
        # rollout): adopted here, they would be shared, and stopped when this one exits.
        others = _LIVE - {self.controller_id}
        owners = {_owner(c) for c in others}
        by_shape: dict[tuple[str, Limits | None], list[EnvInstance]] = {}
        for instance in await self.backend.list({RUN_LABEL: self.run_id}):
            if instance.labels.get(OWNER_LABEL) in owners:
                continue
            if _ADOPTED.get(instance.instance_id) in others:
                continue
            _ADOPTED[instance.instance_id] = self.controller_id
            shape = parse_limits_label(instance.labels.get(LIMITS_LABEL, ""))
            by_shape.setdefault((instance.env_id, shape), []).append(instance)
        for (env_id, limits), instances in by_shape.items():
            pool = self._pool(env_id) if limits is None else self._pool_with(env_id, limits)
            self.adopted += pool.adopt(instances)

    async def _requeue(self, rec: RolloutRecord, reason: str) -> bool:
        """Put an in-flight rollout back to pending, its open attempt ``abandoned`` for
        ``reason``; whether there was an open attempt."""
        attempts = await self._call(self._db.attempts, rollout_id=rec.rollout_id)
        open_attempt = next((a for a in attempts if not AttemptState(a.state).is_final), None)
        if open_attempt is not None:
            AttemptState(open_attempt.state).check(AttemptState.ABANDONED)
            open_attempt = open_attempt.model_copy(
                update={
                    "state": AttemptState.ABANDONED.value,
                    "reason": reason,
                    "finished_at": datetime.now(UTC),
                }
            )
        RolloutState(rec.state).check(RolloutState.PENDING)
        await self._call(
            self._db.advance_rollout,
            rec.rollout_id,
            expect=rec.state,
            attempt=open_attempt,
            state=RolloutState.PENDING.value,
            controller=self.controller_id,
        )
        return open_attempt is not None

    def _has_run(self) -> bool:
        return any(r.run_id == self.run_id for r in self._db.list_runs())

    async def _persist_heartbeats(self) -> None:
        """Store the live attempts' heartbeats now and then. A failed write (the store
        busy or full) is logged and tried again next time: never raised into the task
        group it runs in, where it would cancel every rollout."""
        while True:
            await asyncio.sleep(self.config.heartbeat_persist_s)
            keys = [(f.rollout_id, f.attempt.attempt) for f in self._flights.values()]
            try:
                await self._call(self._db.heartbeat_attempts, keys)
            except Exception:
                _log.warning("could not store heartbeats; trying again", exc_info=True)

    def _limits(self, env_id: str, task: Task | None) -> Limits:
        """The env type's limits, with the task's declared resources on top."""
        limits = self.config.env_limits.get(env_id, Limits())
        if task is None:
            return limits
        r = task.resources
        own = {"cpus": r.cpus, "memory_mb": r.memory_mb, "disk_mb": r.storage_mb}
        return limits.model_copy(update={k: v for k, v in own.items() if v is not None})

    def _pool(self, env_id: str, task: Task | None = None) -> EnvPool:
        """The pool for instances of ``env_id`` with ``task``'s limits and ``env_start``
        deadline (one pool per shape and deadline)."""
        start_s = task.resources.timeouts.env_start if task is not None else None
        roots = self._host_dirs.get(env_id, frozenset())
        if task is None or not task_host_dirs(task) or not takes_workspace_roots(env_id):
            roots = frozenset()
        return self._pool_with(env_id, self._limits(env_id, task), start_s, roots)

    def _pool_with(
        self,
        env_id: str,
        limits: Limits,
        start_s: float | None = None,
        roots: frozenset[str] = frozenset(),
    ) -> EnvPool:
        """The pool for instances of ``env_id`` started with ``limits``, each start given
        ``start_s`` (default: the config's ``env_start_timeout_s``), granted ``roots``
        (host directories the tasks name)."""
        cfg = self.config
        start_s = start_s or cfg.env_start_timeout_s
        key = (
            env_id
            if limits == cfg.env_limits.get(env_id, Limits())
            else (f"{env_id}#{limits.model_dump_json(exclude_none=True)}")
        )
        if start_s != cfg.env_start_timeout_s:
            key += f"@start={start_s:g}s"
        if roots:
            digest = hashlib.sha256("\n".join(sorted(roots)).encode()).hexdigest()[:12]
            key += f"+roots={digest}"
        pool = self._pools.get(key)
        if pool is None:
            limit = cfg.env_concurrency.get(env_id, cfg.concurrency)
            launch = EnvLaunch(
                env_id=env_id,
                options=cfg.env_options.get(env_id, {}),
                sessions=cfg.sessions_per_instance,
                limits=limits,
                labels={
                    RUN_LABEL: self.run_id,
                    LIMITS_LABEL: limits_label(limits),
                    OWNER_LABEL: _owner(self.controller_id),
                },
                start_timeout_s=start_s,
                workspace_roots=tuple(sorted(roots)),
            )
            pool = EnvPool(
                self.backend,
                launch,
                size=cfg.pool_size,
                max_instances=max(cfg.pool_size, math.ceil(limit / cfg.sessions_per_instance)),
                max_episodes=cfg.max_episodes,
                health_interval_s=cfg.health_interval_s,
            )
            self._pools[key] = pool
            assert self._tg is not None, "use `async with Controller(...)`"
            self._services.append(self._tg.create_task(pool.maintain()))
        return pool

    def pools(self) -> dict[str, EnvPool]:
        return dict(self._pools)

    # --- submitting -------------------------------------------------------------------------

    def submit(self, specs: Iterable[RolloutSpec]) -> list[asyncio.Task[RolloutResult]]:
        """Start rollouts now (they queue on the limits); one task per spec, in order.

        A rollout id already submitted to this controller returns its existing task, unless
        that task was cancelled (then the requeued rollout runs again in a new one). The
        id includes the spec's group (:func:`rollout_id`): the same task and index in
        another group is another rollout. Two different tasks with one id are refused
        (:class:`~envport.errors.EnvportError`) before any rollout of the call starts.
        """
        if self._tg is None:
            raise RuntimeError("submit() needs a running controller: `async with Controller(…)`")
        batch = [(rollout_id(self.run_id, s.task, s.index, s.group_id), s) for s in specs]
        given: dict[str, RolloutSpec] = {}
        for rid, spec in batch:  # all checked before any starts
            first = self._specs.get(rid) or given.setdefault(rid, spec)
            if first.task != spec.task:
                raise EnvportError(
                    f"two different tasks share the id {spec.task.id!r}: rollout {rid} "
                    "would be one of them only; give each task its own id"
                )
        self._specs.update(given)
        # Granted before any pool of this batch starts. The folders that hold the tasks'
        # directories (a dataset's), not each directory: the grant, and so the pool key,
        # stays the same from batch to batch of one taskset, and the warm pool with it.
        for spec in given.values():
            env_id = spec.task.env_id
            dirs = frozenset(os.path.dirname(d) for d in task_host_dirs(spec.task))
            if env_id is not None and dirs:
                self._host_dirs[env_id] = self._host_dirs.get(env_id, frozenset()) | dirs
        out: list[asyncio.Task[RolloutResult]] = []
        for rid, spec in batch:
            task = self._tasks.get(rid)
            # A rollout whose task was cancelled (a caller's wait_for around collect()
            # cancels the rollouts it gathers) was requeued as it ended: run it again,
            # once the old task is done, instead of handing back its CancelledError.
            if task is None or task.cancelled() or (task.cancelling() and not task.done()):
                after = task
                task = self._tg.create_task(
                    self._rollout(spec, rid, after=after), name=f"rollout {rid}"
                )
                self._tasks[rid] = task
            out.append(task)
        return out

    async def collect(self, specs: Iterable[RolloutSpec]) -> list[RolloutResult]:
        """Submit and wait for exactly these rollouts (e.g. one GRPO group)."""
        return list(await asyncio.gather(*self.submit(specs)))

    async def run(self, specs: Iterable[RolloutSpec]) -> ControllerSummary:
        """Run a batch to the end and summarise it (enters the controller if needed)."""
        if self._tg is None:
            async with self:
                return await self.run(specs)
        started = time.perf_counter()
        results = await self.collect(specs)
        return self.summary(results, wall_s=time.perf_counter() - started)

    def summary(self, results: Sequence[RolloutResult], *, wall_s: float) -> ControllerSummary:
        kinds = Counter(
            r.trace.errors[0].kind.value
            for r in results
            if r.trace.status is not TraceStatus.COMPLETED and r.trace.errors
        )
        return ControllerSummary(
            run_id=self.run_id,
            rollouts=len(results),
            succeeded=sum(1 for r in results if r.succeeded),
            failed=sum(1 for r in results if not r.succeeded),
            skipped=sum(1 for r in results if r.skipped),
            attempts=self.attempts_started,
            retried=self.retried,
            abandoned=self.abandoned,
            adopted=self.adopted,
            errors_by_kind=dict(kinds),
            env_start_s=percentiles(self.env_start_s),
            env_starts=len(self.env_start_s),
            wall_s=wall_s,
        )

    # --- one rollout ----------------------------------------------------------------------

    def _emit(self, event: RolloutEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    async def _skip(self, rid: str, rec: RolloutRecord | None) -> RolloutResult | None:
        """The stored result if this rollout already ended (resume), else ``None``."""
        trace: Trace | None = None
        if rec is not None and RolloutState(rec.state).is_final and rec.trace_id:
            trace = await self.store.get(rec.trace_id)
        elif rec is None or rec.attempts == 0:
            done = await self.store.query(rollout_id=rid, status=["completed", "failed"], limit=1)
            trace = done[0] if done else None
        if trace is None:
            return None
        state = (
            RolloutState.SUCCEEDED if trace.status is TraceStatus.COMPLETED else RolloutState.FAILED
        )
        self._emit(RolloutEvent(rollout_id=rid, state=state, skipped=True, trace=trace))
        return RolloutResult(rid, trace, rec.attempts if rec else trace.attempt, skipped=True)

    def _env_gate(self, env_id: str | None) -> asyncio.Semaphore | None:
        if env_id is None or env_id not in self.config.env_concurrency:
            return None
        gate = self._env_gates.get(env_id)
        if gate is None:
            gate = self._env_gates[env_id] = asyncio.Semaphore(self.config.env_concurrency[env_id])
        return gate

    async def _rollout(
        self, spec: RolloutSpec, rid: str, after: asyncio.Task[RolloutResult] | None = None
    ) -> RolloutResult:
        if after is not None:  # a cancelled run of this rollout, still recording its end
            await asyncio.wait({after})
        task = spec.task
        max_attempts = spec.max_attempts or self.config.max_attempts
        rec = await self._call(
            self._db.ensure_rollout,
            RolloutRecord(
                rollout_id=rid,
                run_id=self.run_id,
                task_id=task.id,
                group_id=spec.group_id or default_group(self.run_id, task),
                index=spec.index,
                env_id=task.env_id,
                max_attempts=max_attempts,
                controller=self.controller_id,
            ),
        )
        skipped = await self._skip(rid, rec)
        if skipped is not None:
            return skipped
        if after is not None and RolloutState(rec.state) is not RolloutState.PENDING:
            # Its cancelled run was cut between two writes (before its attempt began, or
            # as it was marked retrying), where nothing recorded it abandoned: this
            # controller's own rollout, requeued here.
            await self._requeue(rec, "cancelled")
            rec = await self._call(self._db.get_rollout, rid)
        if RolloutState(rec.state) is not RolloutState.PENDING:
            raise IllegalTransitionError(
                f"rollout {rid!r} is {rec.state!r} under controller {rec.controller}; "
                "only a pending rollout can start"
            )
        self._emit(RolloutEvent(rollout_id=rid, state=RolloutState.PENDING))
        env_gate = self._env_gate(task.env_id)
        if env_gate is None:
            async with self._gate:
                return await self._attempts(spec, rid, rec, max_attempts)
        # Its type's slot first: rollouts waiting for a busy type hold no global slot,
        # so other types still run.
        async with env_gate, self._gate:
            return await self._attempts(spec, rid, rec, max_attempts)

    def _new_trace(self, spec: RolloutSpec, rid: str, attempt: int) -> Trace:
        task = spec.task
        return Trace(
            run_id=self.run_id,
            task_id=task.id,
            task_hash=task.content_hash,
            taskset=self.taskset,
            rollout_id=rid,
            attempt=attempt,
            group_id=spec.group_id or default_group(self.run_id, task),
            env_id=task.env_id,
            status=TraceStatus.RUNNING,
            started_at=datetime.now(UTC),
            metadata={"rollout_index": spec.index},
        )

    async def _move(
        self, f: _Flight, state: RolloutState, attempt_state: AttemptState, **fields: Any
    ) -> None:
        """Persist ``rollout -> state`` and ``attempt -> attempt_state`` (validated)."""
        f.state.check(state)
        AttemptState(f.attempt.state).check(attempt_state)
        attempt = f.attempt.model_copy(
            update={"state": attempt_state.value, "heartbeat_at": datetime.now(UTC)}
        )
        await self._call(
            self._db.advance_rollout,
            f.rollout_id,
            expect=f.state.value,
            attempt=attempt,
            state=state.value,
            **fields,
        )
        previous, f.state, f.attempt = f.state, state, attempt
        self._emit(
            RolloutEvent(
                rollout_id=f.rollout_id,
                state=state,
                previous=previous,
                attempt=attempt.attempt,
                env_start_s=attempt.env_start_s,
            )
        )

    async def _attempts(
        self, spec: RolloutSpec, rid: str, rec: RolloutRecord, max_attempts: int
    ) -> RolloutResult:
        state = RolloutState(rec.state)
        number, failures = rec.attempts, rec.failures
        history: list[dict[str, Any]] = []
        while True:
            number += 1
            self.attempts_started += 1
            attempt = AttemptRecord(
                rollout_id=rid,
                attempt=number,
                run_id=self.run_id,
                state=AttemptState.STARTING_ENV.value,
                controller=self.controller_id,
                backend=self.backend.name,
            )
            state.check(RolloutState.STARTING_ENV)
            await self._call(
                self._db.advance_rollout,
                rid,
                expect=state.value,
                attempt=attempt,
                state=RolloutState.STARTING_ENV.value,
                attempts=number,
                controller=self.controller_id,
            )
            self._emit(
                RolloutEvent(
                    rollout_id=rid, state=RolloutState.STARTING_ENV, previous=state, attempt=number
                )
            )
            f = _Flight(
                spec, rid, RolloutState.STARTING_ENV, attempt, self._new_trace(spec, rid, number)
            )
            self._flights[rid] = f
            try:
                kind = await self._attempt(f)
            except asyncio.CancelledError:
                await self._abandon(f, "cancelled")
                raise
            finally:
                self._flights.pop(rid, None)
            trace = f.trace
            error = next((e for e in trace.errors if e.kind is kind), None)
            retry = kind in self.config.retry_on and failures + 1 < max_attempts
            if kind is not None:
                failures += 1
            if retry:
                assert kind is not None
                history.append(
                    {
                        "attempt": number,
                        "error_kind": kind.value,
                        "message": error.message if error else "",
                        "instance_id": f.attempt.instance_id,
                    }
                )
                self.retried += 1
                await self._call(
                    self._db.advance_rollout,
                    rid,
                    expect=f.state.value,
                    attempt=self._ended(f, AttemptState.FAILED, kind, error),
                    state=f.state.check(RolloutState.RETRYING).value,
                    failures=failures,
                    error_kind=kind.value,
                    error_message=error.message if error else None,
                )
                self._emit(
                    RolloutEvent(
                        rollout_id=rid,
                        state=RolloutState.RETRYING,
                        previous=f.state,
                        attempt=number,
                        error_kind=kind,
                    )
                )
                state = RolloutState.RETRYING
                continue
            if history:
                trace.metadata["previous_attempts"] = history
            final = RolloutState.SUCCEEDED if kind is None else RolloutState.FAILED
            try:
                await self._finish(f, trace, final, kind, error, failures)
            except PydanticSerializationError as exc:  # nothing written: store it failed
                trace = f.trace = _unstorable(trace, exc)
                failures += kind is None
                kind, error, final = ErrorKind.HARNESS, trace.errors[-1], RolloutState.FAILED
                await self._finish(f, trace, final, kind, error, failures)
            self._emit(
                RolloutEvent(
                    rollout_id=rid,
                    state=final,
                    previous=f.state,
                    attempt=number,
                    error_kind=kind,
                    trace=trace,
                )
            )
            return RolloutResult(rid, trace, number)

    async def _finish(
        self,
        f: _Flight,
        trace: Trace,
        final: RolloutState,
        kind: ErrorKind | None,
        error: TraceError | None,
        failures: int,
    ) -> None:
        """Write the rollout's final trace and state, and its attempt's end, at once."""
        f.state.check(final)
        await self._call(
            self._db.finish_rollout,
            f.rollout_id,
            expect=f.state.value,
            trace=trace,
            attempt=self._ended(
                f, AttemptState.SUCCEEDED if kind is None else AttemptState.FAILED, kind, error
            ),
            state=final.value,
            failures=failures,
            error_kind=kind.value if kind else None,
            error_message=error.message if error else None,
        )

    @staticmethod
    def _ended(
        f: _Flight, state: AttemptState, kind: ErrorKind | None, error: TraceError | None
    ) -> AttemptRecord:
        AttemptState(f.attempt.state).check(state)
        return f.attempt.model_copy(
            update={
                "state": state.value,
                "error_kind": kind.value if kind else None,
                "error_message": error.message if error else None,
                "finished_at": datetime.now(UTC),
                "heartbeat_at": datetime.now(UTC),
            }
        )

    async def _abandon(self, f: _Flight, reason: str) -> None:
        """Best effort on cancellation: record the attempt abandoned, requeue the rollout.

        Runs while the rollout's task is being cancelled, and a task group may cancel it
        again meanwhile: the write is shielded and awaited to the end (the caller
        re-raises the cancellation), so the store never keeps an attempt "running".
        """
        write = asyncio.ensure_future(self._write_abandoned(f, reason))
        give_up = time.monotonic() + 5.0  # bounded: the next controller requeues it anyway
        while not write.done() and time.monotonic() < give_up:
            try:
                await asyncio.wait_for(asyncio.shield(write), max(0.0, give_up - time.monotonic()))
            except asyncio.CancelledError:
                continue
            except Exception:
                return

    async def _write_abandoned(self, f: _Flight, reason: str) -> None:
        attempt = f.attempt.model_copy(
            update={
                "state": AttemptState.ABANDONED.value,
                "reason": reason,
                "finished_at": datetime.now(UTC),
            }
        )
        # The stored state may be a step ahead of ``f.state`` (a transition whose await
        # was the one cancelled, after its write landed): on a mismatch, retry once with
        # the stored state when that state is still in flight.
        expect = f.state.value
        for _ in range(2):
            try:
                await self._call(
                    self._db.advance_rollout,
                    f.rollout_id,
                    expect=expect,
                    attempt=attempt,
                    state=RolloutState.PENDING.value,
                )
                return
            except Exception:
                try:
                    record = await self._call(self._db.get_rollout, f.rollout_id)
                except Exception:  # the next controller requeues it anyway
                    return
                stored = RolloutState(record.state)
                if not stored.in_flight or stored.value == expect:
                    return
                expect = stored.value

    async def _attempt(self, f: _Flight) -> ErrorKind | None:
        """One try; returns the kind of the failure that ends it, or ``None`` if it passed."""
        task, trace, cfg = f.spec.task, f.trace, self.config
        harness = f.spec.harness or self.harness
        timeouts = task.resources.timeouts
        start_s = timeouts.env_start or cfg.env_start_timeout_s
        agent_s = timeouts.agent or cfg.agent_timeout_s
        scoring_s = timeouts.scoring or cfg.scoring_timeout_s
        t0 = time.perf_counter()
        stage = "task"
        rubric: Rubric | None = None
        try:
            # Built before anything starts: a task whose rubric cannot be built never
            # runs its agent (kind `task`), and the rubric says whether it totals.
            rubric = Rubric.for_task(task)
            # A command the rubric runs (Harbor's verifier) has its own timeout, and must
            # be the one to fire: the stage waits a grace beyond it.
            command_s = rubric.command_timeout_s()
            if command_s is not None:
                scoring_s = max(scoring_s, command_s + GRACE_S)
            # One environment call may run a whole verifier (Harbor's test.sh): a call
            # may last as long as the longest stage. A call that hangs is cut by the
            # watchdog (hang_timeout_s), which classifies it as infrastructure; retried.
            call_s = max(60.0, start_s, agent_s, scoring_s)
            stage = "env_start"
            if task.env_id is None:
                raise EnvportError(f"Task {task.id!r} names no environment (env_id).")
            if harness is None:
                raise EnvportError("no harness: give the controller or the RolloutSpec one")
            # One env_start deadline for the lease (an instance started, or a slot freed)
            # and the session's opening together.
            start_by = asyncio.get_running_loop().time() + start_s
            async with self._pool(task.env_id, task).lease(timeout_s=start_s) as lease:
                try:
                    await self._on_instance(
                        f, lease, harness, rubric, call_s, start_by, agent_s, scoring_s
                    )
                except _StageFailed as failed:
                    if failed.kind in cfg.retry_on:  # retried on a fresh instance
                        await self._recycle(lease, failed.error)
                    raise
        except _StageFailed as failed:
            self._record(trace, failed.stage, failed.error, failed.kind)
        except Exception as exc:
            self._record(trace, stage, exc, classify(exc, stage))
        trace.timings["total"] = time.perf_counter() - t0
        trace.finished_at = datetime.now(UTC)
        try:
            check_reward(trace)  # cheap; a value JSON cannot hold is found as it is stored
        except ValueError as exc:
            trace = f.trace = _unstorable(trace, exc)
        # A rubric of metrics only (every weight 0) makes no total: completed, unscored.
        scored = trace.reward is not None or rubric is None or not rubric.weighted
        fatal = [e for e in trace.errors if e.kind is not ErrorKind.RUBRIC]
        if fatal or not scored:
            trace.status = TraceStatus.FAILED
            trace.reward = None  # a failure is never scored
            if fatal:
                return fatal[0].kind
            return trace.errors[0].kind if trace.errors else ErrorKind.RUBRIC
        trace.status = TraceStatus.COMPLETED  # a failed weight-0 metric does not fail it
        return None

    async def _recycle(self, lease: Lease, error: Exception) -> None:
        """After a failure that is retried (``retry_on``): a session that hung on a
        healthy instance that hosts several is dropped alone; otherwise the instance is
        retired, so the retry runs on a fresh one."""
        shared = lease.instance.url is not None and self.config.sessions_per_instance > 1
        hung = isinstance(error, (_Hang, *_HUNG))
        if hung and shared and await self.backend.healthy(lease.instance):
            lease.lose_session()
        else:
            lease.retire(f"{type(error).__name__}: {error}")

    @staticmethod
    def _record(trace: Trace, stage: str, exc: Exception, kind: ErrorKind) -> None:
        if isinstance(exc, _Hang):
            trace.stop_reason = "hang"
            trace.errors.append(TraceError(kind=kind, message=str(exc), where=stage))
        elif isinstance(exc, TimeoutError) and not isinstance(exc, EnvportError):
            # The stage's own deadline (an environment's timeout says what timed out).
            trace.stop_reason = "timeout"
            message = f"{stage} exceeded its deadline"
            trace.errors.append(TraceError(kind=kind, message=message, where=stage))
        else:
            retryable = isinstance(exc, ModelProviderError) and exc.retryable
            trace.errors.append(
                TraceError.from_exception(exc, kind=kind, where=stage, retryable=retryable)
            )

    async def _on_instance(
        self,
        f: _Flight,
        lease: Lease,
        harness: Harness,
        rubric: Rubric,
        call_s: float,
        start_by: float,
        agent_s: float,
        scoring_s: float,
    ) -> None:
        trace = f.trace
        instance = lease.instance
        trace.metadata["instance_id"] = instance.instance_id
        f.attempt = f.attempt.model_copy(
            update={"instance_id": instance.instance_id, "env_start_s": lease.env_start_s}
        )
        if lease.env_start_s > 0:
            self.env_start_s.append(lease.env_start_s)
        trace.timings["env_start"] = lease.env_start_s
        inner = instance.client(timeout_s=call_s)
        client = EnvClient(_BeatingTransport(inner.transport, f.monitor))
        try:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a
                # cancellation that lands as the open completes, and a cancelled
                # rollout would go on to run its harness.
                async with asyncio.timeout_at(start_by):
                    await client.transport.open()
            except Exception as exc:
                raise _StageFailed("env_start", exc) from exc
            await self._move(f, RolloutState.RUNNING, AttemptState.RUNNING)
            await self._watch(
                f, harness.run(f.spec.task, client, trace), agent_s, lease, "agent", client
            )
            await self._move(f, RolloutState.SCORING, AttemptState.SCORING)
            await self._watch(
                f, score(f.spec.task, trace, client, rubric), scoring_s, lease, "scoring", client
            )
        finally:
            await _close_quietly(client)

    async def _check_flight(
        self,
        f: _Flight,
        lease: Lease,
        stage: str,
        start: float,
        deadline_s: float,
        hang_s: float | None,
    ) -> Exception | None:
        """Why the attempt must stop now (deadline, hang, dead instance), or ``None``."""
        now = time.monotonic()
        f.monitor.poll(f.trace)
        if now - start >= deadline_s:
            return TimeoutError(f"{stage} exceeded its deadline")
        quiet = f.monitor.busy > 0 and now < f.monitor.quiet_until
        if hang_s is not None and now - f.monitor.last >= hang_s and not quiet:
            if f.monitor.busy > 0:
                return _Hang(
                    f"no heartbeat for {hang_s:g} s while the environment was answering "
                    "a call; attempt aborted",
                    ErrorKind.INFRASTRUCTURE,
                )
            return _Hang(
                f"no heartbeat from the harness for {hang_s:g} s; attempt aborted",
                ErrorKind.HARNESS,
            )
        if now >= f.next_health:
            f.next_health = now + self.config.health_interval_s
            if not await self.backend.healthy(lease.instance):
                return ConnectionLostError(
                    f"instance {lease.instance.instance_id} failed its health check"
                )
        return None

    async def _watch(
        self,
        f: _Flight,
        work: Coroutine[Any, Any, None],
        deadline_s: float,
        lease: Lease,
        stage: str,
        client: EnvClient,
    ) -> None:
        """Run ``work`` under its deadline, the hang watchdog and instance health checks."""
        cfg = self.config
        hang_s = cfg.hang_timeout_s if stage == "agent" else None
        outcome: list[Exception] = []

        async def guarded() -> None:
            # The stage's end, for work that keeps its own deadline inside it (a CLI
            # harness signals its agent first, so it can flush): in the job's context.
            stage_deadline.set(start + deadline_s)
            try:
                await work
            except Exception as exc:
                outcome.append(exc)

        f.monitor.beat()
        tick = min(0.5, hang_s / 5 if hang_s else 0.5, cfg.health_interval_s)
        start = time.monotonic()
        f.next_health = start + cfg.health_interval_s
        reason: Exception | None = None
        async with asyncio.TaskGroup() as tg:
            token = _beat.set(f.monitor.beat)  # the job's context is copied with the beat
            try:
                job = tg.create_task(guarded())
            finally:
                _beat.reset(token)
            try:
                while not job.done():
                    left = start + deadline_s - time.monotonic()
                    await asyncio.wait({job}, timeout=max(0.0, min(left, tick)))
                    if job.done():
                        break
                    reason = await self._check_flight(f, lease, stage, start, deadline_s, hang_s)
                    if reason is not None:
                        job.cancel()
                        break
                if reason is not None:
                    await _settle(job, client)
            except asyncio.CancelledError:
                await _settle(job, client)
                raise
        if reason is not None:
            raise _StageFailed(stage, reason)
        if outcome:
            error = outcome[0]
            # Whatever the transport raised, an instance that is gone is the cause.
            suspect = classify(error, stage) is not ErrorKind.INFRASTRUCTURE
            suspect = suspect and not isinstance(error, ModelProviderError)
            if suspect and not await self.backend.healthy(lease.instance):
                lost = ConnectionLostError(
                    f"instance {lease.instance.instance_id} died during {stage}: "
                    f"{type(error).__name__}: {error}"
                )
                lost.__cause__ = error
                error = lost
            raise _StageFailed(stage, error) from error


def _unstorable(trace: Trace, exc: Exception) -> Trace:
    """A copy of ``trace`` the store can write, failed as the harness's.

    The harness may put anything on the trace it is given (a numpy number in its
    metadata, a non-finite reward). A trace the store refuses would raise out of the
    rollout's task, and the controller's task group would cancel every sibling rollout:
    instead, values that are not JSON are kept as their ``repr`` and the rollout fails
    with a ``harness`` error that says why (never retried, never scored)."""
    clean = Trace.model_validate(trace.model_dump(mode="json", fallback=repr))
    clean.reward = None
    clean.status = TraceStatus.FAILED
    clean.errors.append(
        TraceError(
            kind=ErrorKind.HARNESS,
            message=f"the trace cannot be stored ({exc}); values that are not JSON "
            "are kept as their repr",
            where="store",
            type=type(exc).__qualname__,
        )
    )
    return clean


@functools.cache
def takes_workspace_roots(env_id: str) -> bool:
    """Whether ``env_id``'s constructor takes ``workspace_roots`` (``sandbox-v1``,
    ``shell-v1``); ``False`` for one that cannot be loaded here."""
    from envport.registry import spec

    try:
        return "workspace_roots" in inspect.signature(spec(env_id).load()).parameters
    except Exception:  # not importable here (a remote image's env), or no signature
        return False
