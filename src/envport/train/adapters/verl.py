"""verl (0.9.x): an agent loop that runs envport rollouts and returns ``AgentLoopOutput``.

``EnvportAgentLoop`` subclasses verl's ``AgentLoopBase`` and is registered as
``"envport"``. For each dataset row it runs one rollout of the row's envport task with
the built-in agent: every turn's prompt is rendered with verl's tokenizer (its chat
template), generated token-in/token-out through verl's ``server_manager.generate``
(so verl's own inference servers sample it), its tool calls run on the envport
environment, and the run is scored by the env and the task's rubric. The trace then
becomes one token-exact row (:mod:`envport.train.rows`), and the row becomes the
``AgentLoopOutput``: ``prompt_ids``, ``response_ids``, ``response_mask`` (0 on tool
results and template tokens), ``response_logprobs`` (as the server returned them, when
verl asks for them), ``reward_score`` (the run's reward), ``num_turns`` (messages after
the system prompt) and ``metrics`` (model and tool time).

**Plugging it in.** Build the dataset with :func:`verl_dataset` (each row carries its
task as JSON in ``extra_info.envport_task`` and ``agent_name: envport``), and point
verl at the class with an agent-loop config file
(``actor_rollout_ref.rollout.agent.agent_loop_config_path``)::

    - name: envport
      _target_: envport.train.adapters.verl.EnvportAgentLoop

or call :func:`register_agent_loop` in the worker process. verl is imported only then:
this module imports without it.

**Splits and failures.** A rollout that split hands verl one fragment (the last, by
default), its label in ``extra_fields["envport_split_reason"]``. A response longer than
``rollout.response_length`` is cut at the last sampled token that fits (labelled
``truncated``). A rollout that gave no row at all is returned fully masked (one pad
token, mask 0, ``reward_score`` 0.0, ``extra_fields["envport_status"] = "failed"``):
it trains nothing, but verl still counts its 0.0 in the group's baseline, so filter on
that field if that matters; ``on_failure = "raise"`` (a class attribute) raises instead.
A completed rollout without a reward (no rubric; a non-finite one) keeps its tokens
under mask 0 with ``reward_score`` 0.0 and ``envport_status = "unscored"``, the same
stand-in (an agent loop sees one sample, not its group, so it cannot pick a reward that
leaves the group's statistics alone as the SkyRL generator does); ``None`` would make
verl drop ``rm_scores`` for the whole batch.
Traces are kept in the SQLite file named by ``ENVPORT_TRACE_DB`` (shared by every
worker process), else in memory.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterable
from typing import Any, ClassVar

from envport.harness.agent import AgentConfig
from envport.tasks import Task
from envport.trace import SQLiteTraceStore, TraceStore
from envport.train.adapters._common import (
    Fragment,
    Generated,
    Rollout,
    RolloutRunner,
    TokenChatModel,
)
from envport.train.adapters.trl import task_messages
from envport.train.rows import MISSING_LOGPROBS, TrainingRow, _cut

AGENT_NAME = "envport"

_store_lock = threading.Lock()
_stores: dict[str, TraceStore] = {}


def _shared_store() -> TraceStore:
    path = os.environ.get("ENVPORT_TRACE_DB") or ":memory:"
    with _store_lock:
        if path not in _stores:
            _stores[path] = SQLiteTraceStore(path)
        return _stores[path]


def verl_dataset(tasks: Iterable[Task], *, data_source: str = "envport") -> list[dict[str, Any]]:
    """Rows for verl's ``RLHFDataset`` (write them with ``pandas.DataFrame(rows).to_parquet``)."""
    return [
        {
            "data_source": data_source,
            "prompt": task_messages(task),
            "agent_name": AGENT_NAME,
            "reward_model": {"style": "rule", "ground_truth": json.dumps(task.answer)},
            "extra_info": {"index": i, "envport_task": task.model_dump_json()},
        }
        for i, task in enumerate(tasks)
    ]


def task_from_kwargs(kwargs: dict[str, Any]) -> Task:
    """The envport task of one verl dataset row (``extra_info.envport_task``)."""
    extra = kwargs.get("extra_info") or {}
    raw = extra.get("envport_task") if isinstance(extra, dict) else None
    if raw is None:
        raise ValueError(
            "this dataset row has no extra_info.envport_task; build the dataset with "
            "envport.train.adapters.verl.verl_dataset(tasks)"
        )
    return (
        Task.model_validate_json(raw) if isinstance(raw, str | bytes) else Task.model_validate(raw)
    )


def output_fields(
    rollout: Rollout,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_id: int = 0,
    logprobs: bool = True,
) -> dict[str, Any]:
    """Keyword arguments of verl's ``AgentLoopOutput`` (all but ``metrics``) for a rollout.

    ``logprobs`` says whether verl asked for them (``sampling_params["logprobs"]``, i.e.
    ``rollout.calculate_log_probs``): verl batches ``response_logprobs`` only when the
    batch's first output has them and then concatenates every output's, so all outputs
    must agree. Asked, every output has a list: a stand-in's and a row without logprobs
    (labelled ``missing_logprobs``) are 0.0 per token; not asked, every output has ``None``.

    verl pads prompts to ``rollout.prompt_length`` and responses to ``response_length``
    and cannot hold longer ones: a longer response is cut at the last sampled token that
    fits (labelled ``truncated``), a longer prompt (a late fragment's) is left-truncated
    as verl's own loops do (``extra_fields["envport_prompt_truncated"]``: tokens cut).
    """
    trace = rollout.trace
    row: TrainingRow | None = rollout.row
    limit = response_length
    if row is not None and limit is not None and len(row.completion_ids) > limit:
        row = _cut(row, len(row.prompt_ids) + limit)
    prompt_cut = 0
    if row is not None and prompt_length is not None and len(row.prompt_ids) > prompt_length:
        prompt_cut = len(row.prompt_ids) - prompt_length
    extra: dict[str, Any] = {
        "envport_prompt_truncated": prompt_cut,
        "envport_trace_id": trace.trace_id,
        "envport_rollout_id": trace.rollout_id,
        "envport_status": str(trace.status) if row is not None else "failed",
        "envport_split_reason": None if row is None else row.split_reason,
        "envport_num_fragments": len(rollout.result.rows),
        "envport_labels": [] if row is None else list(row.labels),
    }
    labels = extra["envport_labels"]
    if logprobs and row is not None and row.logprobs is None and MISSING_LOGPROBS not in labels:
        labels.append(MISSING_LOGPROBS)
    if row is None:
        first = next((c.prompt_token_ids for c in trace.model_calls if c.prompt_token_ids), None)
        prompt = list(first or [pad_id])
        if prompt_length is not None:
            prompt = prompt[-prompt_length:]
        return {
            "prompt_ids": prompt,
            "response_ids": [pad_id],
            "response_mask": [0],
            "response_logprobs": [0.0] if logprobs else None,
            "reward_score": 0.0,
            "num_turns": 0,
            "extra_fields": extra,
        }
    mask = list(row.mask)
    reward = row.reward
    if reward is None:
        # Completed but unscored: a masked stand-in like a failed rollout (None would make
        # verl drop rm_scores for the whole batch).
        extra["envport_status"] = "unscored"
        mask = [0] * len(mask)
        reward = 0.0
    return {
        "prompt_ids": list(row.prompt_ids[prompt_cut:]),
        "response_ids": list(row.completion_ids),
        "response_mask": mask,
        "response_logprobs": _logprobs(row) if logprobs else None,
        "reward_score": reward,
        "num_turns": sum(1 for m in trace.messages if m.role != "system"),
        "extra_fields": extra,
    }


def _logprobs(row: TrainingRow) -> list[float]:
    if row.logprobs is None:
        return [0.0] * len(row.completion_ids)
    return list(row.logprobs)


class _EnvportAgentLoop:
    """The behaviour of ``EnvportAgentLoop``; verl's ``AgentLoopBase`` supplies the rest."""

    # Set by AgentLoopBase.__init__.
    server_manager: Any
    tokenizer: Any
    rollout_config: Any

    #: Class-level settings (verl instantiates the loop itself, with its own arguments).
    env_urls: ClassVar[dict[str, str]] = {}
    agent_config: ClassVar[AgentConfig] = AgentConfig(max_turns=16)
    fragment: ClassVar[Fragment] = "last"
    on_failure: ClassVar[str] = "mask"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

        task = task_from_kwargs(kwargs)
        request_id = uuid.uuid4().hex  # one sticky session per rollout: prefix caching
        response_length = _config_int(self.rollout_config, "response_length")

        async def generate(prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
            out = await self.server_manager.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling
            )
            # verl's stop_reason ("completed"/"aborted") does not tell a stop from a cut:
            # the end-of-turn token and the token budget decide (TokenChatModel).
            return Generated(
                token_ids=list(out.token_ids),
                logprobs=None if out.log_probs is None else list(out.log_probs),
            )

        sampling = dict(sampling_params)
        if response_length is not None:
            sampling.setdefault("max_tokens", response_length)
        model = TokenChatModel(generate, self.tokenizer, model="verl-policy", sampling=sampling)
        agent = self.agent_config
        if response_length is not None and agent.max_total_tokens is None:
            agent = agent.model_copy(update={"max_total_tokens": response_length})
        runner = RolloutRunner(
            env_urls=self.env_urls,
            agent=agent,
            store=_shared_store(),
            fragment=self.fragment,
            tokenizer=self.tokenizer,
        )
        uid = kwargs.get("uid")  # verl's GRPO group: the n samples of one prompt
        index = int(kwargs.get("index", 0) or 0)
        # Rollout ids are final once stored, so each run gets its own (the n samples of a
        # prompt share uid and index).
        run_id = f"verl/{uid if uid is not None else 'nouid'}/{request_id[:12]}"
        group = str(uid) if uid is not None else None
        rollout = await runner.run(model, task, index, run_id, group_id=group)
        if rollout.row is None and self.on_failure == "raise":
            raise RuntimeError(
                f"envport rollout {rollout.trace.rollout_id} gave no training row: "
                f"{[e.message for e in rollout.trace.errors] or rollout.dropped_reasons}"
            )
        pad = getattr(self.tokenizer, "pad_token_id", None)
        fields = output_fields(
            rollout,
            prompt_length=_config_int(self.rollout_config, "prompt_length"),
            response_length=response_length,
            pad_id=int(pad) if pad is not None else 0,
            logprobs=bool(sampling_params.get("logprobs")),
        )
        trace = rollout.trace
        metrics = AgentLoopMetrics(
            generate_sequences=sum(c.latency_s or 0.0 for c in trace.model_calls),
            tool_calls=sum(s.latency_s or 0.0 for s in trace.steps),
        )
        return AgentLoopOutput(**fields, metrics=metrics)


def _config_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get"):
        value = config.get(name)
    return int(value) if value is not None else None


_loop_class: type | None = None


def register_agent_loop(name: str = AGENT_NAME) -> type:
    """Build ``EnvportAgentLoop`` on verl's ``AgentLoopBase`` and register it as ``name``."""
    global _loop_class
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, register

    if _loop_class is None:
        _loop_class = type(
            "EnvportAgentLoop",
            (_EnvportAgentLoop, AgentLoopBase),
            {"__module__": __name__, "__qualname__": "EnvportAgentLoop", "__doc__": __doc__},
        )
    registered: type = register(name)(_loop_class)
    return registered


def __getattr__(name: str) -> Any:
    if name == "EnvportAgentLoop":
        return register_agent_loop()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
