"""TRL (``trl>=1.16``): a ``rollout_func`` and an ``environment_factory`` for ``GRPOTrainer``.

**rollout_func** (:class:`EnvportRolloutFunc`). TRL calls ``rollout_func(prompts,
trainer)`` with each prompt already repeated ``num_generations`` times and wants exactly
one completion per prompt, in order. Each prompt is looked up among the tasks it was made
from (:func:`tasks_dataset` builds the dataset; tasks that share a prompt, such as one
question on several seeds, take turns, one per call), one envport rollout runs
against an OpenAI-compatible endpoint that returns token ids (vLLM, or envport's policy server),
and the rollout's token-exact row (:mod:`envport.train.rows`) becomes TRL's
``prompt_ids`` / ``completion_ids`` / ``logprobs`` and ``env_mask`` (1 = sampled by
the policy, 0 = tool results and template tokens; TRL multiplies it into the loss mask).
The endpoint must serve the trainer's weights with the trainer's tokenizer: the ids are
trained on as they were sampled, never re-tokenized.

Other keys go to the reward functions as keyword arguments: ``env_reward`` (the run's
reward from the env and the task's rubric; use :func:`env_reward`), ``split_reason``,
``num_fragments``, ``trace_id``, ``num_turns``, and ``task_id`` / ``seed`` / ``env_options``
of the task that ran. A rollout that split hands TRL one
fragment (``fragment="last"`` by default), with its label; a rollout that gave no row
(failed, no usable call) is either raised (``on_failure="raise"``) or handed over fully
masked with ``env_reward=None`` (``"mask"``: it trains nothing, and when every reward
function returns ``None`` for it, as :func:`env_reward` does, TRL 1.16 leaves it out of
the group's baseline and gives it advantage 0: a failure is never scored as 0).

**environment_factory** (:func:`environment_class`). A class TRL instantiates with no
arguments and pools: ``reset(**row)`` resets the envport environment (``seed`` and
``env_options`` columns of the row), every tool of the environment becomes a method with
the type hints and Google-style docstring TRL reads, and ``get_reward()`` returns the
rewards the steps earned. An environment without tools gets one method, ``act``, whose
parameters are its action's fields. TRL renders, generates and parses the tool calls
itself (its own chat template path); envport only executes them.
"""

from __future__ import annotations

import inspect
import json
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from envport.client import EnvClient, SyncEnvClient
from envport.harness.agent import AgentConfig, observation_text, tool_result_text
from envport.harness.model import ChatModel
from envport.tasks import Task
from envport.trace import TraceStore
from envport.train.adapters._common import Fragment, Rollout, RolloutRunner
from envport.train.rows import Decoder, TrainingRow

OnFailure = Literal["mask", "raise"]


class RolloutFailedError(RuntimeError):
    """A rollout gave no training row and ``on_failure="raise"`` was asked for."""


# --- the dataset ---------------------------------------------------------------------------


def task_messages(task: Task) -> list[dict[str, Any]]:
    """The conversation a task opens with: its system prompt, then its prompt."""
    messages: list[dict[str, Any]] = []
    if task.system_prompt:
        messages.append({"role": "system", "content": task.system_prompt})
    if isinstance(task.prompt, str):
        messages.append({"role": "user", "content": task.prompt})
    else:
        messages += [{"role": m.role, "content": m.content} for m in task.prompt]
    return messages


def _prompt_key(prompt: Any) -> str:
    """One string per conversation, the same for a bare string prompt and its message list."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence):
        return json.dumps(
            [{"role": m.get("role"), "content": m.get("content")} for m in prompt],
            ensure_ascii=False,
        )
    raise TypeError(f"a TRL prompt is a string or a list of messages, not {type(prompt).__name__}")


def tasks_dataset(tasks: Iterable[Task]) -> list[dict[str, Any]]:
    """Dataset rows for ``GRPOTrainer`` (``datasets.Dataset.from_list(rows)``).

    ``prompt`` is the task's conversation; ``task_id``, ``seed`` and ``env_options``
    ride along (the latter two are what :func:`environment_class`'s ``reset`` reads).
    """
    return [
        {
            "prompt": task_messages(t),
            "task_id": t.id,
            "seed": t.seed,
            "env_options": json.dumps(t.env_options),
        }
        for t in tasks
    ]


# --- rows -> TRL ---------------------------------------------------------------------------


def rollout_output(rows: Sequence[TrainingRow | None], *, pad_id: int = 0) -> dict[str, list[Any]]:
    """TRL's ``rollout_func`` output for one row per prompt (``None``: a masked stand-in).

    ``logprobs`` is a list per row (0.0 where the mask is 0), never ``None`` for the
    batch: a row without logprobs gets ``None`` per token, which TRL (1.16) reads as NaN,
    "not scored by the sampler", and leaves out of its importance-sampling correction and
    off-policy mask; ``None`` for the batch made TRL with ``use_vllm=True`` fail.
    """
    out: dict[str, Any] = {
        k: []
        for k in (
            "prompt_ids",
            "completion_ids",
            "env_mask",
            "env_reward",
            "split_reason",
            "num_fragments",
            "num_turns",
            "trace_id",
        )
    }
    logprobs: list[list[float | None]] = []
    for row in rows:
        if row is None:
            out["prompt_ids"].append([pad_id])
            out["completion_ids"].append([pad_id])
            out["env_mask"].append([0])
            out["env_reward"].append(None)
            out["split_reason"].append(None)
            out["num_fragments"].append(0)
            out["num_turns"].append(0)
            out["trace_id"].append(None)
            logprobs.append([0.0])
            continue
        out["prompt_ids"].append(list(row.prompt_ids))
        out["completion_ids"].append(list(row.completion_ids))
        out["env_mask"].append(list(row.mask))
        out["env_reward"].append(row.reward)
        out["split_reason"].append(row.split_reason)
        out["num_fragments"].append(row.num_fragments)
        out["num_turns"].append(row.num_turns)
        out["trace_id"].append(row.trace_id)
        if row.logprobs is not None:
            logprobs.append(list(row.logprobs))
        else:
            logprobs.append([None] * len(row.completion_ids))
    out["logprobs"] = logprobs
    return out


def env_reward(
    completions: Sequence[Any], env_reward: Sequence[float | None], **_: Any
) -> list[float | None]:
    """A TRL reward function: the envport run's reward (env + rubric) for each completion."""
    return list(env_reward)


class EnvportRolloutFunc:
    """``GRPOTrainer(rollout_func=EnvportRolloutFunc(tasks, base_url, model))``.

    ``base_url`` is an OpenAI-compatible endpoint (``.../v1``) that returns token ids and
    logprobs (vLLM with ``return_token_ids``, or envport's policy server) serving the
    trainer's policy. Rollouts of one call run concurrently (``concurrency``); every
    trace is kept in ``store``. ``stats`` counts rows, splits and drops over all calls.
    """

    def __init__(
        self,
        tasks: Iterable[Task],
        base_url: str,
        model: str,
        *,
        sampling: dict[str, Any] | None = None,
        api_key: str | None = None,
        env_urls: dict[str, str] | None = None,
        agent: AgentConfig | None = None,
        store: TraceStore | None = None,
        fragment: Fragment = "last",
        on_failure: OnFailure = "mask",
        max_length: int | None = None,
        tokenizer: Decoder | None = None,
        concurrency: int = 16,
        run_id: str | None = None,
    ) -> None:
        if on_failure not in ("mask", "raise"):
            raise ValueError(f"on_failure must be 'mask' or 'raise', not {on_failure!r}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        # prompt -> the tasks that open with it (several: variants, e.g. other seeds)
        self.tasks: dict[str, list[Task]] = {}
        for task in tasks:
            self.tasks.setdefault(_prompt_key(task_messages(task)), []).append(task)
        if not self.tasks:
            raise ValueError("EnvportRolloutFunc needs at least one task")
        self.base_url = base_url
        self.model = model
        self.sampling = dict(sampling or {})
        self.api_key = api_key
        self.on_failure: OnFailure = on_failure
        self.concurrency = concurrency
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.runner = RolloutRunner(
            env_urls=env_urls,
            agent=agent,
            store=store,
            fragment=fragment,
            max_length=max_length,
            tokenizer=tokenizer,
        )
        self.calls = 0
        self.last_rollouts: list[Rollout] = []

    @property
    def stats(self) -> Counter[str]:
        return self.runner.stats.counts

    def _variants(self, key: str) -> list[Task]:
        variants = self.tasks.get(key)
        if variants is None:
            raise KeyError(
                f"prompt {key[:200]} is not one of the {len(self.tasks)} prompts this "
                "rollout_func was built with; build the dataset with tasks_dataset(tasks)"
            )
        return variants

    def _tasks_for(self, prompts: Sequence[Any], turn: int) -> list[Task]:
        """The task each prompt runs. TRL hands over only the prompt: tasks that share one
        (the same question on other seeds) take turns, one turn per call (``turn``: every
        process calls once per generation, training or evaluation, so all agree), and
        every repeat of a prompt in a call (a GRPO group, wherever TRL splits it across
        processes) runs the same task."""
        chosen = []
        for prompt in prompts:
            key = _prompt_key(prompt)
            variants = self._variants(key)
            pick = (turn + zlib.crc32(key.encode())) % len(variants) if len(variants) > 1 else 0
            chosen.append(variants[pick])
        return chosen

    async def _run(self, tasks: Sequence[Task], batch: str) -> list[Rollout]:
        import asyncio

        seen: Counter[str] = Counter()
        indices = []
        for task in tasks:
            indices.append(seen[task.id])
            seen[task.id] += 1
        model = ChatModel(self.base_url, self.model, api_key=self.api_key, sampling=self.sampling)
        gate = asyncio.Semaphore(self.concurrency)

        async def one(task: Task, index: int) -> Rollout:
            async with gate:
                return await self.runner.run(model, task, index, batch)

        try:
            async with asyncio.TaskGroup() as tg:
                running = [tg.create_task(one(t, i)) for t, i in zip(tasks, indices, strict=True)]
        finally:
            await model.aclose()
        return [r.result() for r in running]

    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, list[Any]]:
        from envport.train.adapters._common import run_sync

        self.calls += 1
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        batch = f"{self.run_id}/step{step if step is not None else self.calls}-{self.calls}"
        tasks = self._tasks_for(prompts, self.calls)
        rollouts = run_sync(self._run(tasks, batch))
        self.last_rollouts = rollouts
        if self.on_failure == "raise":
            for r in rollouts:
                if r.row is None:
                    raise RolloutFailedError(
                        f"rollout {r.trace.rollout_id} gave no training row "
                        f"({', '.join(r.dropped_reasons) or r.trace.status}); "
                        f"errors: {[e.message for e in r.trace.errors]}"
                    )
        pad_id = 0
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
            pad_id = int(tokenizer.pad_token_id)
        out = rollout_output([r.row for r in rollouts], pad_id=pad_id)
        # The task that ran, for reward functions (these override the dataset row's
        # columns, which name the row TRL sampled: maybe another variant of the prompt).
        out["task_id"] = [t.id for t in tasks]
        out["seed"] = [t.seed for t in tasks]
        out["env_options"] = [json.dumps(t.env_options) for t in tasks]
        return out


# --- environment_factory -------------------------------------------------------------------

_PY_TYPES: dict[str, type] = {
    "integer": int,
    "number": float,
    "string": str,
    "boolean": bool,
    "array": list,
    "object": dict,
}


def _param_type(schema: dict[str, Any]) -> type:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None:
        for option in schema.get("anyOf", []):
            if option.get("type") not in (None, "null"):
                kind = option["type"]
                break
    return _PY_TYPES.get(str(kind), str)


def _tool_method(name: str, description: str, schema: dict[str, Any]) -> Callable[..., str]:
    """A method ``name(self, **params) -> str`` with the signature and docstring TRL reads."""
    props: dict[str, Any] = {
        k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"
    }
    required = set(schema.get("required") or [])
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    for pname, pschema in props.items():
        annotations[pname] = _param_type(pschema)
        default = inspect.Parameter.empty if pname in required else pschema.get("default")
        params.append(
            inspect.Parameter(
                pname,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=annotations[pname],
            )
        )
    annotations["return"] = str

    def method(self: EnvportEnvironment, **kwargs: Any) -> str:
        return self._call(name, kwargs)

    method.__name__ = method.__qualname__ = name
    method.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    args_doc = "".join(
        f"\n    {p}: {(props[p].get('description') or props[p].get('title') or p).strip()}"
        for p in props
    )
    summary = (description or f"Call the {name} tool.").strip().splitlines()[0]
    method.__doc__ = f"{summary}\n\nArgs:{args_doc}\n" if props else f"{summary}\n"
    return method


class EnvportEnvironment:
    """Base of the classes :func:`environment_class` builds; one envport session each.

    Public methods of subclasses are the environment's tools (TRL lists them), so
    everything else here is private.
    """

    _target: str = ""
    _reward_mode: str = "sum"
    _action_tool: bool = False
    _instances: list[EnvportEnvironment] = []

    def __init__(self) -> None:
        self._client: SyncEnvClient = EnvClient.connect(self._target).sync()
        self._client.open()
        self._rewards: list[float] = []
        self._done = False
        type(self)._instances.append(self)

    def reset(self, **row: Any) -> str | None:
        """Start a new episode from a dataset row (its ``seed`` and ``env_options``)."""
        options = row.get("env_options") or {}
        if isinstance(options, str):
            options = json.loads(options) if options else {}
        seed = row.get("seed")
        first = self._client.reset(seed=seed, **options)
        self._rewards = []
        self._done = False
        return None if self._prompt_has_task else observation_text(first.observation)

    _prompt_has_task: bool = True

    def get_reward(self) -> float:
        """The reward the episode's steps earned (their sum, or the last one)."""
        if not self._rewards:
            return 0.0
        return self._rewards[-1] if self._reward_mode == "last" else sum(self._rewards)

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        if self._done:
            raise RuntimeError("the episode is over; no more actions are accepted")
        if self._action_tool:
            action: dict[str, Any] = dict(arguments)
        else:
            action = {"type": "call_tool", "tool_name": name, "arguments": arguments}
        result = self._client.step(action)
        if result.reward is not None:
            self._rewards.append(float(result.reward))
        self._done = bool(result.done)
        obs = result.observation
        error = obs.get("error")
        if error:
            raise RuntimeError(f"{error.get('error_type')}: {error.get('message')}")
        if self._action_tool:
            return observation_text(obs)
        return tool_result_text(obs.get("result"))

    def _close(self) -> None:
        self._client.close()

    @classmethod
    def close_all(cls) -> None:
        """Close every session this class opened (TRL never closes its pooled instances)."""
        while cls._instances:
            cls._instances.pop()._close()


def environment_class(
    env: str,
    *,
    reward: Literal["sum", "last"] = "sum",
    observation_in_prompt: bool = False,
    name: str | None = None,
) -> type[EnvportEnvironment]:
    """An ``environment_factory`` class for ``GRPOTrainer`` wrapping envport env ``env``.

    ``env`` is an env id (run in-process) or a server URL. The tools are read once, here,
    from the environment's schema. ``observation_in_prompt`` appends the reset
    observation to the prompt (for envs whose task is in the observation, not the
    dataset). ``reward``: how ``get_reward`` folds the step rewards.
    """
    if reward not in ("sum", "last"):
        raise ValueError(f"reward must be 'sum' or 'last', not {reward!r}")
    from envport.train.adapters._common import run_sync

    async def read_schema() -> dict[str, Any]:
        async with EnvClient.connect(env) as client:
            return await client.schema()

    schema = run_sync(read_schema())
    tools: list[dict[str, Any]] = schema.get("tools") or []
    members: dict[str, Any] = {
        "_target": env,
        "_reward_mode": reward,
        "_prompt_has_task": not observation_in_prompt,
        "_instances": [],
    }
    reserved = {"reset", "get_reward", "close_all"}
    if tools:
        for spec in tools:
            tool_name = str(spec["name"])
            if tool_name in reserved or tool_name.startswith("_"):
                raise ValueError(f"tool name {tool_name!r} clashes with the TRL environment API")
            members[tool_name] = _tool_method(
                tool_name, str(spec.get("description") or ""), spec.get("input_schema") or {}
            )
    else:
        action = schema.get("action") or {}
        members["_action_tool"] = True
        members["act"] = _tool_method(
            "act",
            str(action.get("description") or "Take one step in the environment."),
            action,
        )
    base_name = name or "".join(p.capitalize() for p in env.split("/")[-1].split("-"))
    cls_name = "".join(ch for ch in base_name if ch.isalnum()) or "Envport"
    return type(f"{cls_name}Environment", (EnvportEnvironment,), members)
