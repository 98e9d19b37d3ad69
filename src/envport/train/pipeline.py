"""Real RL on this machine: GRPO on the tiny policy, every rollout through the real stack.

One iteration: sample ``prompts`` tasks, run ``group_size`` rollouts of each, build
token-exact rows from what the gateway recorded, give them group-relative advantages,
take a GRPO update in-process, and hot-swap the new weights into the model server.

Every rollout takes the path a production rollout takes (:class:`RolloutCollector` is
the one seam to it): the gateway opens a rollout with its own token and base URL; the
built-in agent (through :class:`envport.evaluate.Evaluator`) reaches the model server
*through the gateway*, and the environment through an envport server on a real socket
(``arithmetic-v1`` over WebSocket); the task's rubric scores the run; the gateway
stores the trace (SQLite) with the policy version stamped on every model call; rows
come from those stored traces through :func:`envport.train.build_rows`.

**Overlap with bounded staleness.** With ``overlap`` on, a producer collects iteration
k+1 while the trainer updates on k (a queue of one batch). Weight swaps close the
gateway's door (pause, drain the calls in flight), load the weights, and reopen it with
the new version, so every call is stamped with the version that sampled it. Rows more
than ``max_staleness`` versions behind the trainer are dropped by ``build_rows``
(``stale``); the clipped ratio against the *sampler's* logprobs corrects the rest.

**Timeline.** The trainer's time is split into ``wait`` (blocked on rollouts) and
``update`` (rows, advantages, optimiser steps, swap); the producer's into ``collect``.
:attr:`PipelineResult.idle_fraction` is the trainer's wait over the wall time.

The expected reward over *all* tasks after each update (:func:`expected_reward`: the
probability of answering exactly right at temperature 1, computed, not sampled) is the
smooth learning curve; the batch's mean reward is the noisy one.

**The learnable task, honestly.** The tasks are the arithmetic environment's own
questions restricted to single-digit addition (the env's ``easy`` level, seeds whose
question is ``a + b`` with one-digit operands: 81 questions). A random tiny transformer
never answers them, so RL alone would see no reward for a long time. The policy first
gets a short supervised **warm start** (:func:`warm_start`) on locally generated
examples whose labels are deliberately noisy (right with probability ``p_correct``,
else off by 1 or 2), which teaches the answer format and a rough answer; RL then has to
sharpen it. The demo reports the expected reward over all 81 questions before and after
RL, so the gain is RL's.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch
from pydantic import BaseModel, ConfigDict, Field

from envport.envs.arithmetic import LEVELS, generate
from envport.policy.tokenizer import ByteTokenizer
from envport.policy.torch_policy import TinyConfig, TinyTransformer, TorchPolicy
from envport.tasks import Task
from envport.trace import Trace, TraceStatus
from envport.train.advantages import assign_advantages
from envport.train.grpo import GrpoConfig, GrpoTrainer, UpdateStats, token_logprobs
from envport.train.rows import RowsResult, TrainingRow, build_rows, summarise

ENV_ID = "arithmetic-v1"
_SINGLE_DIGIT_SUM = re.compile(r"\d \+ \d")
#: Answer formats the environment does not accept as a number (reward 0).
_UNSCORED_FORMATS = ("~{}", "={}", "{}?")

# --- tasks ------------------------------------------------------------------------------------


def addition_tasks(limit: int | None = None, *, max_seed: int = 5000) -> list[Task]:
    """The arithmetic env's ``easy`` questions that are single-digit sums, one per question.

    The prompt is the env's own question for that seed (the env asks the same thing when
    reset with it), and the rubric is the env's reward.
    """
    seen: dict[str, Task] = {}
    for seed in range(max_seed):
        expr = generate(random.Random(seed), LEVELS[1])
        if not _SINGLE_DIGIT_SUM.fullmatch(expr.text) or expr.text in seen:
            continue
        seen[expr.text] = Task(
            id=f"add-{expr.text.replace(' ', '')}",
            prompt=f"What is {expr.text}? Answer with a single number.",
            answer=str(expr.value.numerator),
            env_id=ENV_ID,
            seed=seed,
            env_options={"difficulty": "easy"},
            rubric=({"type": "env_reward", "weight": 1.0},),
            metadata={"expression": expr.text},
        )
        if limit is not None and len(seen) >= limit:
            break
    return sorted(seen.values(), key=lambda t: t.id)


def prompt_ids(task: Task, tokenizer: ByteTokenizer | None = None) -> list[int]:
    tok = tokenizer or ByteTokenizer()
    assert isinstance(task.prompt, str)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": task.prompt}]))


def expected_reward(module: torch.nn.Module, tasks: Sequence[Task]) -> float:
    """Mean probability (temperature 1) that the model answers each task exactly right:
    the answer's digits, then ``<|im_end|>``. Deterministic; no sampling."""
    tok = ByteTokenizer()
    seqs, starts = [], []
    for task in tasks:
        prompt = prompt_ids(task, tok)
        seqs.append([*prompt, *tok.encode(str(task.answer)), tok.im_end_id])
        starts.append(len(prompt))
    ids, mask = _padded(seqs, starts)
    module.eval()
    with torch.no_grad():
        logp = token_logprobs(module, ids)
    return float(((logp * mask).sum(dim=1)).exp().mean())


def _padded(seqs: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), length), dtype=torch.long)
    mask = torch.zeros((len(seqs), length - 1))
    for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, start - 1 : len(seq) - 1] = 1.0
    return ids, mask


# --- the warm start ---------------------------------------------------------------------------


class WarmStartConfig(BaseModel):
    """Supervised steps on noisy answers before RL (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(400, ge=0)
    batch: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    p_correct: float = Field(0.7, ge=0, le=1, description="Chance a label's number is right.")
    p_plain: float = Field(
        0.25, ge=0, le=1, description="Chance a label is the bare number (the env's format)."
    )
    seed: int = 0


@dataclass(frozen=True)
class WarmStart:
    state_dict: dict[str, torch.Tensor]
    steps: int
    seconds: float
    expected_reward: float
    cached: bool


def warm_start(
    model: TinyConfig,
    config: WarmStartConfig,
    tasks: Sequence[Task],
    *,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> WarmStart:
    """Train a fresh model on noisy answers; cached in ``cache_dir`` by its inputs."""
    key = hashlib.sha256(
        (model.model_dump_json() + config.model_dump_json() + "".join(t.id for t in tasks)).encode()
    ).hexdigest()[:16]
    path = cache_dir / f"warmstart-{key}.pt" if cache_dir is not None else None
    module = TinyTransformer(model)
    if path is not None and path.exists():
        state = torch.load(path, weights_only=True)
        module.load_state_dict(state)
        return WarmStart(state, config.steps, 0.0, expected_reward(module, tasks), cached=True)
    t0 = time.perf_counter()
    tok = ByteTokenizer()
    rng = random.Random(config.seed)
    prompts = [prompt_ids(t, tok) for t in tasks]
    answers = [int(str(t.answer)) for t in tasks]
    opt = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=0)
    module.train()
    for step in range(config.steps):
        picks = [rng.randrange(len(tasks)) for _ in range(config.batch)]
        seqs, starts = [], []
        for i in picks:
            number = answers[i]
            if rng.random() >= config.p_correct:
                number = max(0, number + rng.choice((-2, -1, 1, 2)))
            label = str(number)
            if rng.random() >= config.p_plain:
                label = rng.choice(_UNSCORED_FORMATS).format(number)
            seqs.append([*prompts[i], *tok.encode(label), tok.im_end_id])
            starts.append(len(prompts[i]))
        ids, mask = _padded(seqs, starts)
        loss = -(token_logprobs(module, ids) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if progress is not None:
            progress(step + 1, config.steps)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
    seconds = time.perf_counter() - t0
    return WarmStart(state, config.steps, seconds, expected_reward(module, tasks), cached=False)


# --- the served stack -------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """Where the pieces listen: model server, gateway (and its token), environment."""

    policy_url: str
    gateway_url: str
    orchestrator_token: str
    env_url: str
    store_path: Path


@contextmanager
def serve_stack(policy: TorchPolicy, store_path: Path) -> Iterator[Stack]:
    """Model server, gateway (SQLite store) and ``arithmetic-v1`` server, each on a socket."""
    from envport.gateway import Gateway, create_gateway_app
    from envport.policy.torch_policy import create_torch_policy_app
    from envport.server import ServerConfig, create_app
    from envport.serving import serve_in_thread
    from envport.trace import SQLiteTraceStore

    store_path.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        policy_url = stack.enter_context(serve_in_thread(create_torch_policy_app(policy)))
        store = SQLiteTraceStore(store_path)
        stack.callback(store.close)
        gateway = Gateway([f"{policy_url}/v1"], store=store, policy_version=policy.version)
        gateway_url = stack.enter_context(serve_in_thread(create_gateway_app(gateway), lean=True))
        config = ServerConfig()
        env_url = stack.enter_context(serve_in_thread(create_app(ENV_ID, config), config=config))
        yield Stack(policy_url, gateway_url, gateway.orchestrator_token, env_url, store_path)


# --- collecting rollouts ----------------------------------------------------------------------


class _GatewayHarness:
    """The built-in agent, its model reached through one gateway rollout per attempt.

    Each attempt the controller makes opens a fresh gateway rollout (its own token and
    base URL), so a retried attempt's calls never mix with the next one's.
    """

    def __init__(self, collector: RolloutCollector, info: dict[str, Any]) -> None:
        self.collector = collector
        self.info = info
        self.grants: list[dict[str, Any]] = []

    async def run(self, task: Task, env: Any, trace: Trace) -> None:
        from envport.harness import AgentConfig, ToolCallingAgent
        from envport.harness.model import ChatModel

        c = self.collector
        grant = (await c.admin_post("/admin/rollouts", self.info)).json()
        self.grants.append(grant)
        trace.metadata["gateway_rollout_id"] = grant["rollout_id"]
        client = httpx.AsyncClient(
            transport=c._transport,
            headers={"authorization": f"Bearer {grant['token']}"},
            timeout=120.0,
        )
        model = ChatModel(grant["base_url"], c.policy.name, client=client, sampling=c.sampling)
        await ToolCallingAgent(model, AgentConfig(max_turns=1)).run(task, env, trace)


class RolloutCollector:
    """The one seam between training and the rollout machinery.

    :meth:`collect` submits ``group_size`` rollouts of each task to the rollout
    controller (:class:`envport.rollout.controller.Controller`, environments on their
    server through the in-process backend's URL map); each rollout's harness is the
    built-in agent with its model reached through the gateway, on a token scoped to that
    rollout. When the controller has scored a rollout, its gateway rollout is finished
    with the outcome and the gateway stores the trace; :meth:`collect` returns those
    stored traces. :meth:`publish` swaps weights around the gateway's pause/drain.
    """

    def __init__(
        self,
        stack: Stack,
        policy: TorchPolicy,
        *,
        run_id: str,
        temperature: float = 1.0,
        max_tokens: int = 6,
        concurrency: int = 64,
    ) -> None:
        self.stack = stack
        self.policy = policy
        self.run_id = run_id
        self.sampling = {"temperature": temperature, "max_tokens": max_tokens}
        self.concurrency = concurrency
        self._exit = AsyncExitStack()

    async def __aenter__(self) -> RolloutCollector:
        from envport.rollout.backends.inprocess import InProcessBackend
        from envport.rollout.controller import Controller, ControllerConfig
        from envport.trace import AsyncTraceStore, SQLiteTraceStore

        try:
            # No keep-alive: a pooled connection the server closes after its idle timeout
            # (while the trainer updates) can fail the next request that reuses it.
            limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=0)
            self._transport = await self._exit.enter_async_context(
                httpx.AsyncHTTPTransport(limits=limits, retries=2)
            )
            self._admin = await self._exit.enter_async_context(
                httpx.AsyncClient(
                    base_url=self.stack.gateway_url,
                    headers={"authorization": f"Bearer {self.stack.orchestrator_token}"},
                    timeout=120.0,
                    transport=httpx.AsyncHTTPTransport(
                        retries=2, limits=httpx.Limits(max_keepalive_connections=0)
                    ),
                )
            )
            reader = SQLiteTraceStore(self.stack.store_path)
            self._exit.callback(reader.close)
            self._store = AsyncTraceStore(reader)
            rollouts = SQLiteTraceStore(self.stack.store_path.with_name("rollouts.db"))
            self._exit.callback(rollouts.close)
            config = ControllerConfig(concurrency=self.concurrency, hang_timeout_s=120.0)
            backend = InProcessBackend({ENV_ID: self.stack.env_url})
            self.controller = await self._exit.enter_async_context(
                Controller(AsyncTraceStore(rollouts), backend, None, config, run_id=self.run_id)
            )
        except BaseException:
            await self._exit.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._exit.aclose()

    async def collect(self, tasks: Sequence[Task], group_size: int, iteration: int) -> list[Trace]:
        """``group_size`` rollouts of each task; the gateway's traces (one per rollout)."""
        from envport.rollout.controller import RolloutSpec

        batch = f"{self.run_id}-it{iteration:03d}"
        jobs = []
        for task in tasks:
            group = f"{batch}/{task.id}"
            for k in range(group_size):
                info = {
                    "run_id": batch,
                    "task_id": task.id,
                    "task_hash": task.content_hash,
                    "group_id": group,
                    "env_id": task.env_id,
                    "harness": "envport-agent",
                    "metadata": {"iteration": iteration, "rollout_index": k},
                }
                harness = _GatewayHarness(self, info)
                index = iteration * group_size + k  # rollout ids are unique within the run
                spec = RolloutSpec(task, index, harness=harness, group_id=group)
                jobs.append((harness, self.controller.submit([spec])[0]))
        async with asyncio.TaskGroup() as tg:
            for harness, job in jobs:
                tg.create_task(self._finish(harness, job))
        return await self._store.query(run_id=batch, limit=None)

    async def _finish(self, harness: _GatewayHarness, job: Any) -> None:
        """Close the rollout's gateway rollouts: the last with the outcome, others failed."""
        result = await job
        trace: Trace = result.trace
        for n, grant in enumerate(harness.grants):
            last = n == len(harness.grants) - 1
            finish: dict[str, Any] = {
                "status": trace.status.value if last else TraceStatus.FAILED.value,
                "reward": trace.reward if last else None,
                "stop_reason": trace.stop_reason if last else "retried",
                "errors": [e.model_dump(mode="json") for e in trace.errors if e.where != "gateway"]
                if last
                else [],
                "metadata": {"controller_rollout_id": result.rollout_id},
            }
            path = f"/admin/rollouts/{grant['rollout_id']}/finish"
            await self.admin_post(path, finish, done_if=410)

    async def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Pause the gateway (drain calls in flight), swap the weights, resume as ``version``."""
        await self.admin_post("/admin/pause", {"drain": True, "timeout_s": 60})
        try:
            await asyncio.to_thread(self.policy.load_state_dict, state_dict, version=version)
        finally:
            await self.admin_post("/admin/resume", {"policy_version": version})

    async def admin_post(
        self, path: str, body: dict[str, Any], *, done_if: int | None = None
    ) -> httpx.Response:
        """POST to the gateway's admin API; one retry if the connection broke.

        ``done_if``: a status that, on the retry, means the first try went through
        (410 for a finish: the rollout is already finished).
        """
        for attempt in (1, 2):
            try:
                r = await self._admin.post(path, json=body)
            except httpx.TransportError:
                if attempt == 2:
                    raise
                continue
            if attempt == 2 and done_if is not None and r.status_code == done_if:
                return r
            r.raise_for_status()
            return r
        raise AssertionError("unreachable")


# --- the pipeline -----------------------------------------------------------------------------


class PipelineConfig(BaseModel):
    """One training run; the defaults are the demo's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    iterations: int = Field(30, ge=1)
    prompts: int = Field(32, ge=1, description="Tasks per iteration.")
    group_size: int = Field(4, ge=2, description="Rollouts per task (the GRPO group).")
    overlap: bool = Field(True, description="Collect k+1 while updating on k.")
    max_staleness: int = Field(1, ge=0, description="Drop rows sampled > K versions ago.")
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(6, ge=1)
    concurrency: int = Field(64, ge=1, description="Rollouts in flight at once.")
    seed: int = 0
    torch_threads: int | None = Field(
        1, ge=1, description="torch intra-op threads (1 is fastest for tiny models)."
    )
    model: TinyConfig = Field(default_factory=TinyConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)


@dataclass(frozen=True)
class Span:
    """One stretch of time on the timeline (seconds since the run started)."""

    lane: str  # "trainer" or "producer"
    kind: str  # "wait", "update", "collect"
    start: float
    end: float
    iteration: int


@dataclass(frozen=True)
class IterationStats:
    iteration: int
    policy_version: int  # the version the update produced
    rollouts: int
    failed: int
    mean_reward: float
    pass_rate: float
    rows: int
    dropped: dict[str, int]
    tokens: int
    staleness: int
    update: UpdateStats
    wait_s: float
    update_s: float
    expected_reward: float = float("nan")  # over all tasks, after this update


@dataclass
class PipelineResult:
    config: PipelineConfig
    iterations: list[IterationStats] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    wall_s: float = 0.0
    expected_reward_before: float = float("nan")
    expected_reward_after: float = float("nan")

    @property
    def wait_s(self) -> float:
        return sum(s.end - s.start for s in self.spans if s.lane == "trainer" and s.kind == "wait")

    @property
    def idle_fraction(self) -> float:
        """Share of the wall time the trainer spent waiting for rollouts."""
        return self.wait_s / self.wall_s if self.wall_s else float("nan")

    @property
    def steady_idle_fraction(self) -> float:
        """The same, without the first iteration's wait (nothing to overlap it with)."""
        spans = [s for s in self.spans if s.lane == "trainer"]
        first = next((s for s in spans if s.kind == "wait"), None)
        if first is None or self.wall_s <= first.end:
            return float("nan")
        rest = sum(s.end - s.start for s in spans if s.kind == "wait" and s is not first)
        return rest / (self.wall_s - first.end)


@dataclass(frozen=True)
class _Collected:
    iteration: int
    traces: list[Trace]
    span: Span


class Pipeline:
    """Runs :class:`PipelineConfig` against a served stack (see the module docstring)."""

    def __init__(
        self,
        config: PipelineConfig,
        policy: TorchPolicy,
        collector: RolloutCollector,
        tasks: Sequence[Task],
        *,
        on_iteration: Callable[[IterationStats], None] | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.collector = collector
        self.tasks = list(tasks)
        self.on_iteration = on_iteration
        self.trainer = GrpoTrainer(policy.module_copy(), config.grpo, seed=config.seed)
        self._rng = random.Random(config.seed)
        self._schedule = [
            self._rng.sample(self.tasks, min(config.prompts, len(self.tasks)))
            for _ in range(config.iterations)
        ]
        self._t0 = 0.0

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    async def _collect(self, k: int) -> _Collected:
        start = self._now()
        traces = await self.collector.collect(self._schedule[k], self.config.group_size, k)
        return _Collected(k, traces, Span("producer", "collect", start, self._now(), k))

    async def _produce(self, queue: asyncio.Queue[_Collected]) -> None:
        for k in range(self.config.iterations):
            await queue.put(await self._collect(k))

    def _rows(self, traces: list[Trace], version: int) -> tuple[list[TrainingRow], RowsResult]:
        results = [
            build_rows(
                t,
                max_staleness=self.config.max_staleness,
                current_policy_version=version,
                tokenizer=self.policy.tokenizer,
            )
            for t in traces
        ]
        rows = assign_advantages([r for res in results for r in res.rows])
        merged = RowsResult()
        merged.counts.update(summarise(results))
        return rows, merged

    def _update(
        self, collected: _Collected
    ) -> tuple[list[TrainingRow], RowsResult, UpdateStats, float]:
        rows, result = self._rows(collected.traces, self.policy.version)
        usable = [r for r in rows if r.advantage is not None and r.logprobs is not None]
        if usable:
            stats = self.trainer.step(usable)
        else:
            stats = UpdateStats(0, 0, 0, float("nan"), 0.0, 0.0, 0.0, 0.0)
        return usable, result, stats, expected_reward(self.trainer.module, self.tasks)

    async def run(self) -> PipelineResult:
        """Train; returns the stats, the timeline and the expected reward before/after."""
        if self.config.torch_threads is not None:
            torch.set_num_threads(self.config.torch_threads)
        result = PipelineResult(self.config)
        result.expected_reward_before = expected_reward(self.trainer.module, self.tasks)
        queue: asyncio.Queue[_Collected] = asyncio.Queue(maxsize=1)
        self._t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            if self.config.overlap:
                tg.create_task(self._produce(queue))
            for k in range(self.config.iterations):
                w0 = self._now()
                collected = await (queue.get() if self.config.overlap else self._collect(k))
                w1 = self._now()
                result.spans.append(collected.span)
                result.spans.append(Span("trainer", "wait", w0, w1, k))
                rows, rows_result, stats, expected = await asyncio.to_thread(
                    self._update, collected
                )
                version = self.policy.version + 1
                await self.collector.publish(self.trainer.state_dict(), version)
                w2 = self._now()
                result.spans.append(Span("trainer", "update", w1, w2, k))
                it = _iteration_stats(k, version, collected.traces, rows, rows_result, stats)
                it = replace(it, wait_s=w1 - w0, update_s=w2 - w1, expected_reward=expected)
                result.iterations.append(it)
                if self.on_iteration is not None:
                    self.on_iteration(it)
        result.wall_s = self._now()
        result.expected_reward_after = expected_reward(self.trainer.module, self.tasks)
        return result


def _iteration_stats(
    k: int,
    version: int,
    traces: list[Trace],
    rows: list[TrainingRow],
    rows_result: RowsResult,
    stats: UpdateStats,
) -> IterationStats:
    done = [t for t in traces if t.status is TraceStatus.COMPLETED and t.reward is not None]
    rewards = [float(t.reward or 0.0) for t in done]
    versions = [
        int(v) for r in rows for v in r.policy_versions if isinstance(v, int | str) and str(v)
    ]
    dropped = {
        k2: v
        for k2, v in rows_result.counts.items()
        if k2 in ("stale", "failed_rollout", "no_model_calls", "no_usable_calls") and v
    }
    return IterationStats(
        iteration=k,
        policy_version=version,
        rollouts=len(traces),
        failed=len(traces) - len(done),
        mean_reward=sum(rewards) / len(rewards) if rewards else float("nan"),
        pass_rate=sum(1 for r in rewards if r >= 1.0) / len(rewards) if rewards else float("nan"),
        rows=len(rows),
        dropped=dropped,
        tokens=sum(sum(r.mask) for r in rows),
        staleness=(version - 1 - min(versions)) if versions else 0,
        update=stats,
        wait_s=0.0,
        update_s=0.0,
    )


async def run_pipeline(
    config: PipelineConfig,
    out_dir: Path,
    *,
    tasks: Sequence[Task] | None = None,
    run_id: str | None = None,
    on_iteration: Callable[[IterationStats], None] | None = None,
    warm: WarmStart | None = None,
    on_warmstart: Callable[[int, int], None] | None = None,
) -> tuple[PipelineResult, WarmStart]:
    """Warm start (cached in ``out_dir``), serve the stack, train; all torn down after."""
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    tasks = list(tasks) if tasks is not None else addition_tasks()
    if warm is None:
        warm = await asyncio.to_thread(
            warm_start,
            config.model,
            config.warmstart,
            tasks,
            cache_dir=out_dir,
            progress=on_warmstart,
        )
    model = TinyTransformer(config.model)
    model.load_state_dict(warm.state_dict)
    policy = TorchPolicy(model, version=0, seed=config.seed)
    run_id = run_id or f"train-{'overlap' if config.overlap else 'serial'}-{time.time_ns()}"
    with serve_stack(policy, out_dir / "traces.db") as stack:
        async with RolloutCollector(
            stack,
            policy,
            run_id=run_id,
            temperature=config.temperature,
            max_tokens=config.max_tokens,
            concurrency=config.concurrency,
        ) as collector:
            pipeline = Pipeline(config, policy, collector, tasks, on_iteration=on_iteration)
            result = await pipeline.run()
    return result, warm
