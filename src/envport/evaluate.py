"""``envport eval``: tasks x rollouts, run by the built-in agent, scored, stored.

The evaluator is a thin layer over the rollout controller (:mod:`envport.rollout`), so
evaluation and training collection share one engine: deterministic rollout ids
(``run/task/k``), ``resume`` finishing an interrupted run without redoing what is already
final in the store, retries of infrastructure failures on a fresh environment, stage
deadlines and hang detection. A rollout that fails is recorded with a classified error
(``model_provider``, ``environment``, ``harness``, ``rubric``, ``infrastructure``),
status ``failed`` and no reward: it is data, never a zero, and never stops its siblings.
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field

from envport.errors import EnvportError
from envport.harness.agent import AgentConfig, ToolCallingAgent
from envport.harness.model import ChatModel
from envport.rollout.backends.base import Backend
from envport.rollout.backends.inprocess import InProcessBackend
from envport.rollout.controller import (
    Controller,
    ControllerConfig,
    RolloutEvent,
    RolloutSpec,
    classify,
    percentiles,
    rollout_id,
)
from envport.tasks import Task, TaskFileError
from envport.trace import AsyncTraceStore, ErrorKind, Trace, TraceError, TraceStatus

__all__ = [
    "EvalConfig",
    "EvalSummary",
    "Evaluator",
    "classify",
    "pass_at_k",
    "rollout_id",
    "summarise",
]


class EvalConfig(BaseModel):
    rollouts: int = Field(1, ge=1, description="Rollouts per task.")
    concurrency: int = Field(16, ge=1, description="Rollouts in flight at once.")
    env_urls: dict[str, str] = Field(
        default_factory=dict, description="env id -> server URL; others run in-process."
    )
    agent: AgentConfig = Field(default_factory=AgentConfig)
    success_threshold: float = Field(1.0, description="Reward at or above which a run passes.")
    agent_timeout_s: float = Field(300.0, gt=0, description="Default when a task sets none.")
    max_attempts: int = Field(3, ge=1, description="Attempts per rollout (infra retries + 1).")
    hang_timeout_s: float | None = Field(
        180.0, gt=0, description="Abort an attempt this long without progress (> a model call)."
    )

    def controller_config(self) -> ControllerConfig:
        return ControllerConfig(
            concurrency=self.concurrency,
            max_attempts=self.max_attempts,
            agent_timeout_s=self.agent_timeout_s,
            scoring_timeout_s=self.agent_timeout_s,
            hang_timeout_s=self.hang_timeout_s,
        )


class EvalSummary(BaseModel):
    run_id: str
    tasks: int
    rollouts: int
    completed: int
    failed: int
    skipped: int = Field(0, description="Already in the store (resume).")
    mean_reward: float | None
    pass_at_k: dict[int, float]
    errors_by_kind: dict[str, int]
    rollout_latency_s: dict[str, float]
    model_latency_s: dict[str, float]
    wall_s: float


class Evaluator:
    """Runs rollouts of a taskset against one model endpoint into one store.

    ``backend`` decides where environments run (default: in-process, or at
    ``config.env_urls`` for the ids listed there).
    """

    def __init__(
        self,
        model: ChatModel,
        store: AsyncTraceStore,
        config: EvalConfig | None = None,
        *,
        taskset_name: str | None = None,
        backend: Backend | None = None,
        controller_config: ControllerConfig | None = None,
    ) -> None:
        self.model = model
        self.store = store
        self.config = config or EvalConfig()
        self.taskset_name = taskset_name
        self.agent = ToolCallingAgent(model, self.config.agent)
        self.backend = backend
        self.controller_config = controller_config or self.config.controller_config()

    def controller(
        self, run_id: str, on_event: Callable[[RolloutEvent], None] | None = None
    ) -> Controller:
        """A controller for ``run_id`` driving this evaluator's agent (not yet entered)."""
        return Controller(
            self.store,
            self.backend or InProcessBackend(self.config.env_urls),
            self.agent,
            self.controller_config,
            run_id=run_id,
            taskset=self.taskset_name,
            on_event=on_event,
            run_config=self.config.model_dump(mode="json"),
        )

    async def run_one(self, task: Task, index: int, run_id: str) -> Trace:
        """One rollout (``run_id/task/index``), with the controller's retries."""
        async with self.controller(run_id) as ctl:
            (result,) = await ctl.collect([RolloutSpec(task, index)])
        return result.trace

    async def run(
        self,
        tasks: Iterable[Task],
        *,
        run_id: str | None = None,
        resume: bool = False,
        on_done: Callable[[Trace], None] | None = None,
        on_start: Callable[[int], None] | None = None,
        on_event: Callable[[RolloutEvent], None] | None = None,
        invalid: Sequence[TaskFileError] = (),
    ) -> EvalSummary:
        """Run every task ``rollouts`` times. ``invalid``: the task file's bad entries
        (see :func:`~envport.tasks.load_jsonl`), each recorded as a failed trace of kind
        ``task`` (never run), counted in the summary.

        ``on_start(n)`` is called once, before any ``on_done``, with ``n`` the number of
        ``on_done`` calls to come: one per trace this call records (rollouts not already
        final in the store, and a malformed entry's trace once, however many rollouts
        per task)."""
        started = time.perf_counter()
        run_id = run_id or uuid.uuid4().hex[:12]
        task_list = list(tasks)
        stored = await self.store.query(run_id=run_id, limit=None)
        done_ids = {t.rollout_id for t in stored if t.status.is_final}
        if stored and not resume:
            raise EnvportError(
                f"run {run_id!r} already has {len(stored)} traces in the store; "
                "resume it (--resume) or choose another run id"
            )
        bad = [
            t
            for t in _invalid_traces(invalid, run_id, self.taskset_name)
            if t.rollout_id not in done_ids
        ]
        specs = [RolloutSpec(task, k) for task in task_list for k in range(self.config.rollouts)]
        wanted = {rollout_id(run_id, s.task, s.index) for s in specs}
        skipped = len(done_ids & wanted)
        if on_start is not None:
            on_start(len(specs) - skipped + len(bad))  # every trace on_done will see
        if bad:
            await self.store.put_many(bad)
            if on_done is not None:
                for trace in bad:
                    on_done(trace)

        def event(ev: RolloutEvent) -> None:
            if on_event is not None:
                on_event(ev)
            if on_done is not None and ev.trace is not None and not ev.skipped:
                on_done(ev.trace)

        async with self.controller(run_id, event) as ctl:
            await ctl.collect(specs)
        traces = await self.store.query(run_id=run_id, limit=None)
        return summarise(
            run_id,
            traces,
            tasks=len(task_list) + len(invalid),
            skipped=skipped,
            wall_s=time.perf_counter() - started,
            threshold=self.config.success_threshold,
        )


def _invalid_traces(
    invalid: Sequence[TaskFileError], run_id: str, taskset: str | None
) -> list[Trace]:
    """A failed trace per malformed task entry: its file, line and field in the error."""
    now = datetime.now(UTC)
    traces = []
    for error in invalid:
        task_id = f"{Path(error.path).name}:{error.line if error.line is not None else '?'}"
        traces.append(
            Trace(
                run_id=run_id,
                task_id=task_id,
                taskset=taskset,
                rollout_id=f"{run_id}/{task_id}/0",
                group_id=f"{run_id}/{task_id}",
                status=TraceStatus.FAILED,
                errors=[
                    TraceError(
                        kind=ErrorKind.TASK,
                        message=str(error),
                        where="taskset",
                        type=type(error).__name__,
                    )
                ],
                started_at=now,
                finished_at=now,
                metadata={"source": error.path, "line": error.line, "field": error.field},
            )
        )
    return traces


def _agent_failed(trace: Trace) -> bool:
    """A rollout the agent itself failed (its deadline, a crash of the agent loop): a try
    that did not solve the task, so pass@k counts it (a failure of the infrastructure,
    the model provider or the environment is no try of the agent's, and is left out)."""
    return (
        trace.status is TraceStatus.FAILED
        and bool(trace.errors)
        and trace.errors[0].kind is ErrorKind.HARNESS
    )


def _passed(trace: Trace, threshold: float) -> bool:
    return trace.status is TraceStatus.COMPLETED and (trace.reward or 0) >= threshold


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarise(
    run_id: str,
    traces: list[Trace],
    *,
    tasks: int,
    skipped: int = 0,
    wall_s: float = 0.0,
    threshold: float = 1.0,
) -> EvalSummary:
    completed = [t for t in traces if t.status is TraceStatus.COMPLETED]
    rewards = [t.reward for t in completed if t.reward is not None]
    by_task: dict[str, list[Trace]] = {}
    for t in traces:
        if (t.reward is not None and t.status is TraceStatus.COMPLETED) or _agent_failed(t):
            by_task.setdefault(t.task_id or "", []).append(t)
    ks = sorted({1, *(len(v) for v in by_task.values())})
    pass_k: dict[int, float] = {}
    for k in ks:
        scores = [
            pass_at_k(len(v), sum(1 for t in v if _passed(t, threshold)), k)
            for v in by_task.values()
            if len(v) >= k
        ]
        if scores:
            pass_k[k] = statistics.fmean(scores)
    kinds = Counter(e.kind.value for t in traces for e in t.errors)
    return EvalSummary(
        run_id=run_id,
        tasks=tasks,
        rollouts=len(traces),
        completed=len(completed),
        failed=sum(1 for t in traces if t.status is TraceStatus.FAILED),
        skipped=skipped,
        mean_reward=statistics.fmean(rewards) if rewards else None,
        pass_at_k=pass_k,
        errors_by_kind=dict(kinds),
        rollout_latency_s=percentiles([t.timings["total"] for t in traces if "total" in t.timings]),
        model_latency_s=percentiles(
            [c.latency_s for t in traces for c in t.model_calls if c.latency_s is not None]
        ),
        wall_s=wall_s,
    )
