"""SkyRL (``skyrl-train`` 0.3): a ``GeneratorInterface`` that runs envport rollouts.

``EnvportGenerator.generate(GeneratorInput) -> GeneratorOutput`` runs one envport
rollout per prompt of the batch, concurrently: every turn's prompt is rendered with
SkyRL's tokenizer, generated token-in/token-out by SkyRL's ``InferenceEngineClient``
(``prompt_token_ids`` in, ``response_ids`` and ``response_logprobs`` out, one session
per trajectory), its tool calls run on the envport environment, and the run is scored
by the env and the task's rubric. Each rollout's token-exact row
(:mod:`envport.train.rows`) becomes one entry of each ``GeneratorOutput`` list:
``prompt_token_ids``, ``response_ids``, ``loss_masks`` (0 on tool results and template
tokens), ``rewards`` (per token: the run's reward, env plus rubric, on the last token;
with ``step_rewards=True`` each step's reward is added on the last token of the turn that
earned it, for a rubric that does not already count them), ``rollout_logprobs``,
``stop_reasons`` and ``trajectory_ids`` (passed through).

Which task a prompt is: ``env_extras[i]["envport_task"]`` (a task as JSON; build the
dataset with :func:`skyrl_dataset`), else a task made from the prompt and
``env_classes[i]`` as the env id. A rollout that split hands SkyRL one fragment.

**Rollouts without a score** (a rollout that gave no row, e.g. a failed one; a
completed one without a reward, or with a non-finite one) are masked stand-ins: loss
mask all 0, so they carry no gradient (a rollout without a row is one pad token; an
unscored one keeps its tokens), and a reward chosen so that they do not move the
group's GRPO statistics (see :func:`stand_in_rewards`). They are counted in
``rollout_metrics["envport/no_row"]`` and ``["envport/unscored"]``; ``on_failure="raise"``
raises on a rollout without a row instead.

skyrl-train is imported only when the class is built (``EnvportGenerator`` on first
access, or :func:`generator_class`): this module imports without it.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import uuid
from collections.abc import Iterable
from typing import Any

from envport.harness.agent import AgentConfig
from envport.tasks import Task
from envport.trace import TraceStore
from envport.train.adapters._common import (
    Fragment,
    Generated,
    Rollout,
    RolloutRunner,
    TokenChatModel,
)
from envport.train.adapters.trl import task_messages
from envport.train.rows import TrainingRow, _cut


def skyrl_dataset(tasks: Iterable[Task]) -> list[dict[str, Any]]:
    """Rows for SkyRL's ``PromptDataset`` (``prompt``, ``env_class``, and the task as JSON)."""
    return [
        {
            "prompt": task_messages(task),
            "env_class": task.env_id or "envport",
            "envport_task": task.model_dump_json(),
            "uid": task.id,
        }
        for task in tasks
    ]


def _task(prompt: list[dict[str, Any]], env_class: str, extras: dict[str, Any] | None) -> Task:
    raw = (extras or {}).get("envport_task")
    if raw is not None:
        return Task.model_validate_json(raw) if isinstance(raw, str) else Task.model_validate(raw)
    return Task.model_validate(
        {"id": f"prompt-{uuid.uuid4().hex[:8]}", "prompt": prompt, "env_id": env_class}
    )


def stand_in_rewards(scored: list[float], count: int) -> list[float]:
    """Rewards for ``count`` masked stand-ins in a group whose scored rollouts got ``scored``.

    skyrl-train's GRPO advantage is ``(r - mean) / (std + eps)`` over every rollout the
    group's ``uid`` holds, stand-ins included (``std``: sample standard deviation), and a
    generator cannot take a rollout out of its group. The stand-ins' rewards are chosen
    so that the group keeps the mean and std of its scored rollouts, which leaves every
    scored rollout's advantage what it would be without the stand-ins:

    * two or more stand-ins: spread symmetrically around the scored mean (their
      deviations sum to 0, their squares to ``count * std**2``); exact;
    * one stand-in: the scored mean (no single value keeps the std as well): the mean,
      hence every advantage's sign, is kept; the std shrinks by ``sqrt((k-1)/k)`` for
      ``k`` scored rollouts, so their advantages grow by ``sqrt(k/(k-1))`` (exact under
      Dr. GRPO, ``grpo_norm_by_std=False``);
    * one scored rollout: its reward (the group has no spread: advantage 0, as a group
      of one has no baseline); none: 0.0.

    The stand-ins' own advantages do not matter: their loss mask is 0. Their rewards are
    bookkeeping, not scores (they can fall outside the reward's range).
    """
    if count <= 0:
        return []
    if not scored:
        return [0.0] * count
    mean = statistics.fmean(scored)
    if len(scored) == 1 or count == 1:
        return [mean] * count
    std = statistics.stdev(scored)
    offsets = [j - (count - 1) / 2 for j in range(count)]
    scale = math.sqrt(count / sum(x * x for x in offsets))
    return [mean + std * scale * x for x in offsets]


def _scored(row: TrainingRow | None) -> bool:
    return row is not None and row.reward is not None and math.isfinite(row.reward)


def output_lists(
    rollouts: list[Rollout],
    *,
    max_response_length: int | None = None,
    pad_id: int = 0,
    step_rewards: bool = False,
) -> dict[str, Any]:
    """The list fields of SkyRL's ``GeneratorOutput`` for rollouts, in order.

    A rollout with no row, or whose row has no finite reward, is a masked stand-in (loss
    mask all 0) with a reward from :func:`stand_in_rewards` over its group (same
    ``trace.group_id``; a rollout without a group is a group of its own)."""
    rows: list[TrainingRow | None] = []
    for rollout in rollouts:
        row = rollout.row
        limit = max_response_length
        if row is not None and limit is not None and len(row.completion_ids) > limit:
            row = _cut(row, len(row.prompt_ids) + limit)
        rows.append(row)
    groups: dict[str, list[int]] = {}
    for i, rollout in enumerate(rollouts):
        group = rollout.trace.group_id
        groups.setdefault(f"g:{group}" if group is not None else f"i:{i}", []).append(i)
    stand_in: dict[int, float] = {}
    for members in groups.values():
        scored = [
            sum(row.token_rewards(steps=step_rewards))
            for row in (rows[i] for i in members)
            if row is not None and _scored(row)
        ]
        masked = [i for i in members if not _scored(rows[i])]
        stand_in.update(zip(masked, stand_in_rewards(scored, len(masked)), strict=True))
    out: dict[str, Any] = {
        "prompt_token_ids": [],
        "response_ids": [],
        "rewards": [],
        "loss_masks": [],
        "stop_reasons": [],
    }
    logprobs: list[list[float]] | None = []
    splits = no_row = unscored = 0
    for i, (rollout, row) in enumerate(zip(rollouts, rows, strict=True)):
        if row is None:
            no_row += 1
            first = next(
                (c.prompt_token_ids for c in rollout.trace.model_calls if c.prompt_token_ids),
                None,
            )
            out["prompt_token_ids"].append(list(first or [pad_id]))
            out["response_ids"].append([pad_id])
            out["rewards"].append([stand_in[i]])
            out["loss_masks"].append([0])
            out["stop_reasons"].append("error")
            if logprobs is not None:
                logprobs.append([0.0])
            continue
        splits += row.split_reason is not None
        out["prompt_token_ids"].append(list(row.prompt_ids))
        out["response_ids"].append(list(row.completion_ids))
        if i in stand_in:  # completed, but not scored: its tokens stay, masked out
            unscored += 1
            rewards = [0.0] * len(row.completion_ids)
            rewards[-1] = stand_in[i]
            out["rewards"].append(rewards)
            out["loss_masks"].append([0] * len(row.mask))
        else:
            out["rewards"].append(row.token_rewards(steps=step_rewards))
            out["loss_masks"].append(list(row.mask))
        finish = row.metadata.get("finish_reasons") or [None]
        out["stop_reasons"].append("length" if row.truncated else str(finish[-1] or "stop"))
        if logprobs is not None and row.logprobs is not None:
            logprobs.append(list(row.logprobs))
        else:
            logprobs = None
    out["rollout_logprobs"] = logprobs
    rewards = [
        r.trace.reward
        for r in rollouts
        if r.row is not None and r.trace.reward is not None and math.isfinite(r.trace.reward)
    ]
    out["rollout_metrics"] = {
        "envport/rollouts": len(rollouts),
        "envport/no_row": no_row,
        "envport/unscored": unscored,
        "envport/split_rows": splits,
        "envport/mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "envport/mean_turns": (
            sum(r.row.num_turns for r in rollouts if r.row) / max(1, len(rollouts) - no_row)
        ),
    }
    return out


class _EnvportGenerator:
    """The behaviour of ``EnvportGenerator``; SkyRL's ``GeneratorInterface`` is its base."""

    def __init__(
        self,
        inference_engine_client: Any,
        tokenizer: Any,
        *,
        sampling: dict[str, Any] | None = None,
        env_urls: dict[str, str] | None = None,
        agent: AgentConfig | None = None,
        store: TraceStore | None = None,
        fragment: Fragment = "last",
        max_response_length: int | None = None,
        on_failure: str = "mask",
        step_rewards: bool = False,
        run_id: str | None = None,
    ) -> None:
        if on_failure not in ("mask", "raise"):
            raise ValueError(f"on_failure must be 'mask' or 'raise', not {on_failure!r}")
        self.client = inference_engine_client
        self.tokenizer = tokenizer
        self.sampling = dict(sampling or {})
        self.max_response_length = max_response_length
        self.on_failure = on_failure
        self.step_rewards = step_rewards
        self.run_id = run_id or f"skyrl/{uuid.uuid4().hex[:12]}"
        self.runner = RolloutRunner(
            env_urls=env_urls, agent=agent, store=store, fragment=fragment, tokenizer=tokenizer
        )
        self.batches = 0
        self.last_rollouts: list[Rollout] = []

    def _model(self, session: str, sampling: dict[str, Any]) -> TokenChatModel:
        async def generate(prompt_ids: list[int], params: dict[str, Any]) -> Generated:
            out = await self.client.generate(
                {
                    "prompts": None,
                    "prompt_token_ids": [prompt_ids],
                    "sampling_params": params,
                    "session_ids": [session],
                }
            )
            lps = out.get("response_logprobs")
            stop = (out.get("stop_reasons") or [None])[0]
            return Generated(
                token_ids=list(out["response_ids"][0]),
                logprobs=None if not lps or lps[0] is None else list(lps[0]),
                finish_reason=stop if stop in ("stop", "length") else None,
            )

        return TokenChatModel(generate, self.tokenizer, model="skyrl-policy", sampling=sampling)

    async def generate(self, input_batch: dict[str, Any]) -> dict[str, Any]:
        prompts = input_batch["prompts"]
        env_classes = input_batch.get("env_classes") or ["envport"] * len(prompts)
        extras = input_batch.get("env_extras") or [None] * len(prompts)
        trajectory_ids = input_batch.get("trajectory_ids")
        sampling = {**self.sampling, **(input_batch.get("sampling_params") or {})}
        self.batches += 1
        run_id = f"{self.run_id}/b{self.batches}"

        async def one(i: int) -> Rollout:
            task = _task(prompts[i], env_classes[i], extras[i])
            group = task.id if trajectory_ids is None else str(trajectory_ids[i].instance_id)
            model = self._model(f"{run_id}/{i}", sampling)
            # The rollout's index is its place in the batch: a task twice in one batch
            # (same instance and repetition ids) is two rollouts, not one run twice.
            return await self.runner.run(model, task, i, run_id, group_id=f"{run_id}/{group}")

        async with asyncio.TaskGroup() as tg:
            running = [tg.create_task(one(i)) for i in range(len(prompts))]
        rollouts = [r.result() for r in running]
        if self.on_failure == "raise":
            for r in rollouts:
                if r.row is None:
                    raise RuntimeError(
                        f"envport rollout {r.trace.rollout_id} gave no training row: "
                        f"{[e.message for e in r.trace.errors] or r.dropped_reasons}"
                    )
        pad = getattr(self.tokenizer, "pad_token_id", None)
        out = output_lists(
            rollouts,
            max_response_length=self.max_response_length,
            pad_id=int(pad) if pad is not None else 0,
            step_rewards=self.step_rewards,
        )
        out["trajectory_ids"] = trajectory_ids
        out["is_last_step"] = None
        self.last_rollouts = rollouts
        return out


_generator_class: type | None = None


def generator_class() -> type:
    """``EnvportGenerator``: :class:`_EnvportGenerator` on SkyRL's ``GeneratorInterface``."""
    global _generator_class
    if _generator_class is None:
        from skyrl_train.generators.base import GeneratorInterface

        _generator_class = type(
            "EnvportGenerator",
            (_EnvportGenerator, GeneratorInterface),
            {"__module__": __name__, "__qualname__": "EnvportGenerator", "__doc__": __doc__},
        )
    return _generator_class


def __getattr__(name: str) -> Any:
    if name == "EnvportGenerator":
        return generator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["generator_class", "output_lists", "skyrl_dataset", "stand_in_rewards"]
