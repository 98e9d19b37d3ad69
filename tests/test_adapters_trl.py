"""TRL adapter against the real TRL (1.16): GRPOTrainer runs with both hooks.

Nothing is downloaded: the tokenizer is a Hugging Face ``PreTrainedTokenizerFast``
built here with ids identical to envport's ByteTokenizer (bytes 0..255, then the special
tokens), so the scripted policy server's token ids are the tiny random model's ids too.
The rollouts are real: an envport environment in-process, the built-in agent, the
policy server on a socket; TRL consumes the rows through its own ``rollout_func`` path.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from envport.harness import AgentConfig
from envport.policy.tokenizer import SPECIAL, ByteTokenizer
from envport.serving import serve_in_thread
from envport.tasks import Task, load
from envport.trace import SQLiteTraceStore
from envport.train import TrainingRow
from envport.train.adapters.trl import (
    EnvportRolloutFunc,
    RolloutFailedError,
    env_reward,
    environment_class,
    rollout_output,
    tasks_dataset,
)
from tests.test_adapters_trainers import byte_tokenizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
TOK = ByteTokenizer()
# TRL and transformers announce their own deprecations (e.g. GRPOConfig's defaults).
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def tiny_model(vocab: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        pad_token_id=SPECIAL["<|endoftext|>"],
        eos_token_id=SPECIAL["<|im_end|>"],
    )
    return LlamaForCausalLM(config)


def grpo_config(tmp_path: Path, **extra: Any) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    from envport.policy import create_policy_app

    with serve_in_thread(create_policy_app()) as url:
        yield url + "/v1"


def guess_tasks(n: int) -> list[Task]:
    return list(load("builtin:guess-number").head(n))


def test_tokenizer_matches_byte_tokenizer() -> None:
    hf = byte_tokenizer()
    text = '<|im_start|>user\nhé 2+2?<|im_end|>\n<tool_call>{"a": 1}</tool_call>'
    assert hf.encode(text, add_special_tokens=False) == TOK.encode(text)
    assert len(hf) == TOK.vocab_size


# --- rollout_func --------------------------------------------------------------------------


@pytest.mark.timeout(180)  # a real trainer: heavy imports on a shared 2-core machine
def test_rollout_func_trains_a_real_grpo_step_on_token_exact_rows(
    model_url: str, tmp_path: Path
) -> None:
    from datasets import Dataset
    from trl import GRPOTrainer

    tasks = guess_tasks(1)
    store = SQLiteTraceStore(tmp_path / "traces.db")
    rollout_func = EnvportRolloutFunc(
        tasks,
        model_url,
        "scripted",
        store=store,
        agent=AgentConfig(max_turns=8),
        tokenizer=TOK,
        on_failure="raise",
    )
    seen: list[list[str]] = []

    def by_position(completions: list[Any], trace_id: list[str], **_: Any) -> list[float]:
        seen.append(list(trace_id))  # extra rollout_func keys reach the reward functions
        return [float(i) for i in range(len(completions))]  # spread: nonzero advantages

    tokenizer = byte_tokenizer()
    model = tiny_model(len(tokenizer))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[env_reward, by_position],
        args=grpo_config(tmp_path, max_completion_length=4096),
        train_dataset=Dataset.from_list(tasks_dataset(tasks)),
        rollout_func=rollout_func,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL/transformers deprecation notices
        trainer.train()
    assert trainer.state.global_step == 1
    assert rollout_func.calls == 1
    rollouts = rollout_func.last_rollouts
    assert len(rollouts) == 4  # one per prompt TRL handed over (already repeated x4)
    assert len({r.trace.group_id for r in rollouts}) == 1  # one prompt, one GRPO group
    stored = {t.trace_id: t for t in store.query(limit=None)}
    sampled = []
    for r in rollouts:
        row = r.row
        assert row is not None
        assert row.num_fragments == 1
        assert row.split_reason is None
        trace = stored[r.trace.trace_id]
        calls = trace.model_calls
        assert len(calls) > 1  # multi-turn: tool results sit between the turns
        served = [c.response["choices"][0]["token_ids"] for c in calls if c.response]
        assert row.sampled_ids == [t for ids in served for t in ids]
        assert 0 in row.mask  # tool results are env tokens
        sampled.append(sum(row.mask))
    logs = trainer.state.log_history[0]
    # TRL counts only env_mask == 1 tokens as completion tokens: the mask reached it.
    assert logs["completions/mean_length"] == pytest.approx(sum(sampled) / len(sampled))
    assert logs["rewards/env_reward/mean"] == pytest.approx(
        sum(r.trace.reward or 0.0 for r in rollouts) / 4
    )
    assert rollout_func.stats["rollouts"] == 4
    assert rollout_func.stats["rows"] == 4
    assert seen == [[r.trace.trace_id for r in rollouts]]
    changed = [n for n, p in trainer.model.named_parameters() if not p.equal(before[n])]
    assert changed  # the step trained on the rows (sampled tokens carry the gradient)


def row(mask: list[int], *, split: str | None = None, logprobs: bool = True) -> TrainingRow:
    n = len(mask)
    return TrainingRow(
        prompt_ids=[1, 2, 3],
        completion_ids=list(range(10, 10 + n)),
        mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask] if logprobs else None,
        reward=1.0,
        trace_id="t",
        rollout_id="r",
        policy_versions=[None],
        num_turns=1,
        split_reason=split,
        fragment=1 if split else 0,
        num_fragments=2 if split else 1,
    )


def test_rollout_output_keeps_labels_masks_and_stands_in_for_missing_rows() -> None:
    out = rollout_output([row([1, 0, 1]), row([1, 1], split="retokenization_drift"), None])
    assert out["env_mask"] == [[1, 0, 1], [1, 1], [0]]
    assert out["split_reason"] == [None, "retokenization_drift", None]
    assert out["num_fragments"] == [1, 2, 0]
    assert out["env_reward"] == [1.0, 1.0, None]
    assert out["logprobs"] == [[-0.5, 0.0, -0.5], [-0.5, -0.5], [0.0]]
    for key in ("prompt_ids", "completion_ids", "env_mask", "logprobs"):
        assert len(out[key]) == 3
    # One row without logprobs: None per token for that row alone (TRL: NaN, no
    # correction), never None for the batch, never a misaligned list.
    mixed = rollout_output([row([1]), row([1, 0, 1], logprobs=False), None])
    assert mixed["logprobs"] == [[-0.5], [None, None, None], [0.0]]


@pytest.mark.timeout(180)  # a real trainer: heavy imports on a shared 2-core machine
def test_a_row_without_logprobs_goes_through_trls_vllm_correction(tmp_path: Path) -> None:
    """With use_vllm=True TRL corrects for the sampler with the rows' logprobs; the batch's
    logprobs used to be None as soon as one row had none, and TRL then failed on
    ``old_per_token_logps - None``. Now that row's tokens get no correction (ratio 1)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    tok = byte_tokenizer()

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        rows = [row([1, 1, 1]), row([1, 1, 1], logprobs=False), row([1, 0, 1]), None]
        for r in rows[:3]:
            assert r is not None
            r.completion_ids = [65, 66, SPECIAL["<|im_end|>"]]
            r.prompt_ids = [72, 105]
        return rollout_output(rows[: len(prompts)], pad_id=SPECIAL["<|endoftext|>"])

    trainer = GRPOTrainer(
        model=tiny_model(len(tok)),
        processing_class=tok,
        reward_funcs=[env_reward],
        args=grpo_config(tmp_path, max_completion_length=64),
        train_dataset=Dataset.from_list([{"prompt": "Hi"}] * 4),
        rollout_func=rollout_func,
    )
    assert trainer.vllm_importance_sampling_correction
    # What __init__ sets up with use_vllm=True (vLLM itself is not installed here).
    trainer.use_vllm = True
    trainer._last_loaded_step = trainer.state.global_step
    out = trainer._generate_and_score_completions([{"prompt": "Hi"}] * 4)
    ratio = out["importance_sampling_ratio"]
    assert not ratio.isnan().any()
    assert (ratio[1] == 1.0).all()  # the row without logprobs: no correction


def test_a_string_prompt_finds_its_task_whatever_its_characters() -> None:
    """A str prompt was keyed with ensure_ascii=True and a task's messages with False:
    any non-ASCII prompt ("Répondez") matched no task."""
    from envport.train.adapters.trl import _prompt_key, task_messages

    for text in ("What is 2 + 2?", "Combien font 2 + 2 ? Répondez.", "二加二是多少"):
        assert _prompt_key(text) == _prompt_key(task_messages(Task(id="x", prompt=text)))


def test_tasks_sharing_a_prompt_take_turns_one_per_call(model_url: str) -> None:
    """TRL hands over only prompts: variants of one prompt (other seeds) take turns, one
    per call of rollout_func (every process makes the same calls, in training and in
    evaluation, whatever the steps between them), so every repeat of the prompt in a
    call (a GRPO group, wherever TRL splits it) runs one task, and reward functions are
    told which."""
    task = guess_tasks(1)[0]
    twin = task.model_copy(update={"id": "twin", "seed": 99, "env_options": {"high": 7}})
    other = guess_tasks(2)[1]
    func = EnvportRolloutFunc([task, twin, other], model_url, "scripted")
    prompt, other_prompt = (tasks_dataset([t])[0]["prompt"] for t in (task, other))

    def ran() -> list[str | None]:
        return [r.trace.task_id for r in func.last_rollouts]

    out = func([prompt] * 4 + [other_prompt] * 2)
    first = ran()[0]
    assert first in (task.id, twin.id)
    assert ran() == [first] * 4 + [other.id] * 2
    assert out["task_id"] == ran()  # overrides the sampled row's columns for rewards
    ran_task = task if first == task.id else twin
    assert out["seed"] == [ran_task.seed] * 4 + [other.seed] * 2
    assert out["env_options"][0] == json.dumps(ran_task.env_options)
    seen = [first]
    for _ in range(3):  # each call the next variant: both get their turns
        func([prompt] * 2)
        assert len(set(ran())) == 1
        seen.append(ran()[0])
    assert seen == [first, *[t for t in (task.id, twin.id) if t != first], first, seen[1]]


def test_rollout_func_rejects_unknown_prompts(model_url: str) -> None:
    func = EnvportRolloutFunc(guess_tasks(1), model_url, "scripted")
    with pytest.raises(KeyError, match="not one of the 1 prompts"):
        func([[{"role": "user", "content": "something else"}]])


def test_failed_rollouts_are_masked_or_raised(tmp_path: Path) -> None:
    from envport.serving import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: model_provider failure
    tasks = guess_tasks(1)
    prompt = tasks_dataset(tasks)[0]["prompt"]
    masked = EnvportRolloutFunc(tasks, dead, "m", on_failure="mask")
    out = masked([prompt, prompt])
    assert out["env_mask"] == [[0], [0]]
    assert out["env_reward"] == [None, None]
    assert masked.stats["no_row"] == 2
    assert all(r.trace.errors[0].kind == "model_provider" for r in masked.last_rollouts)
    raising = EnvportRolloutFunc(tasks, dead, "m", on_failure="raise")
    with pytest.raises(RolloutFailedError, match="gave no training row"):
        raising([prompt])


# --- environment_factory ----------------------------------------------------------------


def test_environment_class_exposes_envport_tools_the_way_trl_reads_them() -> None:
    from transformers.utils import get_json_schema

    cls = environment_class("guess-number-v1")
    env = cls()
    try:
        schema = get_json_schema(env.guess)  # what TRL renders into the prompt
        assert schema["function"]["name"] == "guess"
        assert schema["function"]["parameters"]["properties"]["number"]["type"] == "integer"
        assert schema["function"]["parameters"]["required"] == ["number"]
        assert env.reset(seed=0, env_options=json.dumps({"high": 10, "max_steps": 5})) is None
        low, high, reward = 1, 10, 0.0
        for _ in range(5):
            guess = (low + high) // 2
            reply = json.loads(env.guess(number=guess))
            if reply["feedback"] == "correct":
                break
            low, high = (guess + 1, high) if reply["feedback"] == "higher" else (low, guess - 1)
        assert env.get_reward() == 1.0
        with pytest.raises(RuntimeError, match="episode is over"):
            env.guess(number=1)
        reward = env.get_reward()
        env.reset(seed=0, env_options=json.dumps({"high": 10, "max_steps": 5}))
        assert env.get_reward() == 0.0
        assert reward == 1.0
    finally:
        cls.close_all()


def test_environment_class_without_tools_acts_through_its_action_fields() -> None:
    cls = environment_class("arithmetic-v1", observation_in_prompt=True)
    env = cls()
    try:
        question = env.reset(seed=3)
        assert question
        assert "?" in question
        state_before = env.get_reward()
        env.act(answer="not a number")
        assert state_before == 0.0
        assert env.get_reward() == 0.0
        assert [m for m in dir(cls) if not m.startswith("_")] == [
            "act",
            "close_all",
            "get_reward",
            "reset",
        ]
    finally:
        cls.close_all()


@pytest.mark.timeout(180)
def test_environment_factory_runs_in_a_real_grpo_step(tmp_path: Path) -> None:
    from datasets import Dataset
    from trl import GRPOTrainer
    from trl.chat_template_utils import add_response_schema

    template = Path(__import__("trl").__file__).parent / "chat_templates" / "qwen2_5.jinja"
    tokenizer = add_response_schema(byte_tokenizer(template.read_text()))
    cls = environment_class("guess-number-v1")
    tasks = guess_tasks(1)
    try:
        trainer = GRPOTrainer(
            model=tiny_model(len(tokenizer)),
            processing_class=tokenizer,
            args=grpo_config(tmp_path, max_completion_length=8),
            train_dataset=Dataset.from_list(tasks_dataset(tasks)),
            environment_factory=cls,
        )
        # TRL probed one instance and read its tools from the class.
        assert [t.__name__ for t in trainer.tools] == ["guess"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        assert trainer.state.global_step == 1
        logs = trainer.state.log_history[0]
        # The random model makes no valid call in 8 tokens: the env scores every rollout 0.
        reward_keys = [k for k in logs if k.startswith("rewards/") and k.endswith("/mean")]
        assert reward_keys
        assert all(math.isclose(logs[k], 0.0) for k in reward_keys)
        assert len(cls._instances) >= 4  # one pooled session per rollout
    finally:
        cls.close_all()
