"""``envport eval``: tasks x rollouts, run by the built-in agent, scored, stored.

Each rollout has a deterministic id (``run/task/k``), so ``resume`` can finish an
interrupted run without redoing what is already in the store. A rollout that fails is
recorded with a classified error (``model_provider``, ``environment``, ``harness``,
``rubric``, ``infrastructure``), status ``failed`` and no reward: it is data, never a
zero, and never stops its siblings.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from envport.client import EnvClient
from envport.errors import ConnectionLostError, EnvportError
from envport.harness.agent import AgentConfig, ToolCallingAgent
from envport.harness.model import ChatModel, ModelProviderError
from envport.tasks import Task
from envport.trace import (
    AsyncTraceStore,
    ErrorKind,
    Run,
    Trace,
    TraceError,
    TraceStatus,
)


class EvalConfig(BaseModel):
    rollouts: int = Field(1, ge=1, description="Rollouts per task.")
    concurrency: int = Field(16, ge=1, description="Rollouts in flight at once.")
    env_urls: dict[str, str] = Field(
        default_factory=dict, description="env id -> server URL; others run in-process."
    )
    agent: AgentConfig = Field(default_factory=AgentConfig)
    success_threshold: float = Field(1.0, description="Reward at or above which a run passes.")
    agent_timeout_s: float = Field(300.0, gt=0, description="Default when a task sets none.")


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


def rollout_id(run_id: str, task: Task, index: int) -> str:
    return f"{run_id}/{task.id}/{index}"


def classify(exc: BaseException, stage: str) -> ErrorKind:
    """Where a failure belongs, from what was raised and the stage it was raised in."""
    if isinstance(exc, ModelProviderError):
        return ErrorKind.MODEL_PROVIDER
    if stage == "scoring":
        return ErrorKind.RUBRIC
    if isinstance(exc, ConnectionLostError):
        return ErrorKind.INFRASTRUCTURE
    if isinstance(exc, EnvportError):
        return ErrorKind.ENVIRONMENT
    return ErrorKind.HARNESS  # the agent loop itself, or its deadline


async def _score(task: Task, trace: Trace, env: EnvClient) -> None:
    """Score with the task's rubric; the env stays open so rubrics can inspect it."""
    from envport.rubrics import ClientHandle, ScoringContext, from_specs

    if not task.rubric:
        return
    rubric = from_specs(task.rubric)
    ctx = ScoringContext(trace=trace, task=task, env=ClientHandle(env))
    result = await rubric.score(ctx)
    result.apply(trace)


class Evaluator:
    """Runs rollouts of a taskset against one model endpoint into one store."""

    def __init__(
        self,
        model: ChatModel,
        store: AsyncTraceStore,
        config: EvalConfig | None = None,
        *,
        taskset_name: str | None = None,
    ) -> None:
        self.model = model
        self.store = store
        self.config = config or EvalConfig()
        self.taskset_name = taskset_name
        self.agent = ToolCallingAgent(model, self.config.agent)

    def _client(self, task: Task) -> EnvClient:
        assert task.env_id is not None
        # One environment call may run a whole verifier (Harbor's test.sh): allow the
        # longest stage deadline the task declares.
        t = task.resources.timeouts
        timeout = max([60.0, *(x for x in (t.agent, t.scoring, t.env_start) if x)])
        url = self.config.env_urls.get(task.env_id)
        target = url or task.env_id
        return EnvClient.connect(target, timeout_s=timeout)

    async def run_one(self, task: Task, index: int, run_id: str) -> Trace:
        trace = Trace(
            run_id=run_id,
            task_id=task.id,
            task_hash=task.content_hash,
            taskset=self.taskset_name,
            rollout_id=rollout_id(run_id, task, index),
            group_id=f"{run_id}/{task.id}",
            env_id=task.env_id,
            status=TraceStatus.RUNNING,
            started_at=datetime.now(UTC),
            metadata={"rollout_index": index},
        )
        t0 = time.perf_counter()
        stage = "env_start"
        try:
            if task.env_id is None:
                raise EnvportError(f"Task {task.id!r} names no environment (env_id).")
            timeouts = task.resources.timeouts
            async with self._client(task) as env:
                stage = "agent"
                agent_s = timeouts.agent or self.config.agent_timeout_s
                await asyncio.wait_for(self.agent.run(task, env, trace), agent_s)
                stage = "scoring"
                scoring_s = timeouts.scoring or self.config.agent_timeout_s
                await asyncio.wait_for(_score(task, trace, env), scoring_s)
        except Exception as exc:
            kind = classify(exc, stage)
            if isinstance(exc, TimeoutError):
                message = f"{stage} exceeded its deadline"
                trace.stop_reason = "timeout"
                trace.errors.append(TraceError(kind=kind, message=message, where=stage))
            else:
                trace.errors.append(TraceError.from_exception(exc, kind=kind, where=stage))
        trace.timings["total"] = time.perf_counter() - t0
        trace.finished_at = datetime.now(UTC)
        scored = trace.reward is not None or not task.rubric
        fatal = [e for e in trace.errors if e.kind is not ErrorKind.RUBRIC]
        if fatal or not scored:
            trace.status = TraceStatus.FAILED
            trace.reward = None  # a failure is never scored
        else:  # a failed weight-0 metric is recorded but does not fail the run
            trace.status = TraceStatus.COMPLETED
        await self.store.put(trace)
        return trace

    async def run(
        self,
        tasks: Iterable[Task],
        *,
        run_id: str | None = None,
        resume: bool = False,
        on_done: Callable[[Trace], None] | None = None,
        on_start: Callable[[int], None] | None = None,
    ) -> EvalSummary:
        started = time.perf_counter()
        run_id = run_id or uuid.uuid4().hex[:12]
        task_list = list(tasks)
        done_ids: set[str] = set()
        if resume:
            for trace in await self.store.query(run_id=run_id, limit=None):
                if trace.status in (TraceStatus.COMPLETED, TraceStatus.FAILED):
                    done_ids.add(trace.rollout_id)
                else:  # in flight when the run was interrupted: redone from scratch
                    await self.store.delete(trace.trace_id)
        else:
            await self.store.put_run(Run(run_id=run_id, config=self.config.model_dump(mode="json")))
        todo = [
            (task, k)
            for task in task_list
            for k in range(self.config.rollouts)
            if rollout_id(run_id, task, k) not in done_ids
        ]
        if on_start is not None:
            on_start(len(todo))
        gate = asyncio.Semaphore(self.config.concurrency)

        async def one(task: Task, k: int) -> None:
            async with gate:
                trace = await self.run_one(task, k, run_id)
            if on_done is not None:
                on_done(trace)

        async with asyncio.TaskGroup() as tg:
            for task, k in todo:
                tg.create_task(one(task, k))
        traces = await self.store.query(run_id=run_id, limit=None)
        return summarise(
            run_id,
            traces,
            tasks=len(task_list),
            skipped=len(done_ids),
            wall_s=time.perf_counter() - started,
            threshold=self.config.success_threshold,
        )


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


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
    for t in completed:
        by_task.setdefault(t.task_id or "", []).append(t)
    ks = sorted({1, *(len(v) for v in by_task.values())})
    pass_k: dict[int, float] = {}
    for k in ks:
        scores = [
            pass_at_k(len(v), sum(1 for t in v if (t.reward or 0) >= threshold), k)
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
        rollout_latency_s=_pcts([t.timings["total"] for t in traces if "total" in t.timings]),
        model_latency_s=_pcts(
            [c.latency_s for t in traces for c in t.model_calls if c.latency_s is not None]
        ),
        wall_s=wall_s,
    )
