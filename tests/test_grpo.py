"""The GRPO update: packing rows, the direction of the step, clipping, staleness."""

from __future__ import annotations

import pytest
import torch

from envport.policy.tokenizer import ByteTokenizer
from envport.policy.torch_policy import TinyConfig, TinyTransformer, TorchPolicy
from envport.trace import Trace, TraceStatus
from envport.trace.model import Choice, ModelCall
from envport.train.grpo import (
    GrpoConfig,
    GrpoTrainer,
    RowError,
    grpo_loss,
    pack,
    token_logprobs,
)
from envport.train.pipeline import Pipeline, PipelineConfig, addition_tasks
from envport.train.rows import TrainingRow

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = TinyConfig(d_model=32, n_layers=1, n_heads=2, max_len=64, seed=3)
TOK = ByteTokenizer()
PROMPT = TOK.encode("<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n")
GOOD = [*TOK.encode("2"), TOK.im_end_id]
BAD = [*TOK.encode("3"), TOK.im_end_id]


def logprobs_of(module: torch.nn.Module, completion: list[int]) -> list[float]:
    with torch.no_grad():
        lp = token_logprobs(module, torch.tensor([PROMPT + completion]))[0]
    return lp[len(PROMPT) - 1 :].tolist()


def row(
    completion: list[int],
    advantage: float | None,
    logprobs: list[float] | None,
    *,
    mask: list[int] | None = None,
    trace_id: str = "t",
) -> TrainingRow:
    return TrainingRow(
        prompt_ids=PROMPT,
        completion_ids=completion,
        mask=mask or [1] * len(completion),
        logprobs=logprobs,
        reward=None,
        advantage=advantage,
        trace_id=trace_id,
        rollout_id=trace_id,
        policy_versions=[0],
        num_turns=1,
    )


def test_pack_puts_each_completion_token_at_its_target_position() -> None:
    r = row([70, 71, 72], 0.5, [-0.1, 0.0, -0.3], mask=[1, 0, 1])
    short = row([70], -1.0, [-0.2])
    batch = pack([r, short], pad_id=0)
    n = len(PROMPT)
    assert batch.ids.shape == (2, n + 3)
    assert batch.ids[0, n:].tolist() == [70, 71, 72]
    assert batch.ids[1, n + 1 :].tolist() == [0, 0]  # right padding
    # position i predicts ids[i + 1]: the first completion token sits at n - 1
    assert batch.mask[0, n - 1 :].tolist() == [1, 0, 1]
    assert batch.mask[0, : n - 1].sum() == 0
    assert batch.old_logprobs[0, n - 1 :].tolist() == pytest.approx([-0.1, 0.0, -0.3])
    assert batch.mask[1].sum() == 1
    assert batch.advantages.tolist() == [0.5, -1.0]
    assert batch.tokens == 3


def test_pack_refuses_rows_it_cannot_train_on() -> None:
    with pytest.raises(RowError, match="no rows"):
        pack([])
    with pytest.raises(RowError, match="assign_advantages"):
        pack([row(GOOD, None, [-1.0, -1.0])])
    with pytest.raises(RowError, match="no sampler logprobs"):
        pack([row(GOOD, 1.0, None)])


def test_a_step_moves_probability_toward_the_positive_advantage() -> None:
    module = TinyTransformer(SMALL)
    good0, bad0 = sum(logprobs_of(module, GOOD)), sum(logprobs_of(module, BAD))
    rows = [row(GOOD, 1.0, logprobs_of(module, GOOD), trace_id=f"g{i}") for i in range(4)] + [
        row(BAD, -1.0, logprobs_of(module, BAD), trace_id=f"b{i}") for i in range(4)
    ]
    trainer = GrpoTrainer(module, GrpoConfig(lr=1e-2, epochs=3, minibatch=8))
    stats = trainer.step(rows)
    assert stats.rows == 8
    assert stats.tokens == 16
    assert stats.steps == 3
    assert sum(logprobs_of(module, GOOD)) > good0
    assert sum(logprobs_of(module, BAD)) < bad0
    assert not module.training


def test_zero_advantages_and_clipped_ratios_leave_the_weights_alone() -> None:
    module = TinyTransformer(SMALL)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = GrpoTrainer(module, GrpoConfig(lr=1e-2, decoupled=False))
    trainer.step(
        [row(GOOD, 0.0, logprobs_of(module, GOOD)), row(BAD, 0.0, logprobs_of(module, BAD))]
    )
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    # The sampler gave these tokens far less probability than the policy does now: the
    # ratio is past 1 + eps for a positive advantage, so the clip removes the gradient.
    stats = trainer.step([row(GOOD, 1.0, [-30.0, -30.0])])
    assert stats.clip_fraction == 1.0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def _trace(version: int, reward: float, group: str) -> Trace:
    completion = GOOD if reward else BAD
    call = ModelCall(
        model="envport-tiny",
        prompt_token_ids=PROMPT,
        choices=[
            Choice(
                finish_reason="stop",
                completion_token_ids=completion,
                completion_logprobs=[-0.5] * len(completion),
            )
        ],
        policy_version=version,
    )
    return Trace(
        group_id=group,
        status=TraceStatus.COMPLETED,
        reward=reward,
        model_calls=[call],
        policy_version=version,
    )


def test_rows_more_than_k_versions_behind_are_dropped_as_stale() -> None:
    policy = TorchPolicy(TinyTransformer(SMALL))
    config = PipelineConfig(iterations=1, max_staleness=1, model=SMALL)
    pipeline = Pipeline(config, policy, collector=None, tasks=addition_tasks(2))  # type: ignore[arg-type]
    traces = [_trace(0, 1.0, "g"), _trace(1, 0.0, "g"), _trace(2, 1.0, "g"), _trace(2, 0.0, "g")]
    rows, result = pipeline._rows(traces, version=2)
    assert result.counts["stale"] == 1
    assert len(rows) == 3
    assert sorted(v for r in rows for v in r.policy_versions) == [1, 2, 2]  # type: ignore[type-var]
    # advantages are computed over the rows kept: the group's other members
    by_reward = {r.reward: r.advantage for r in rows}
    assert by_reward[1.0] is not None
    assert by_reward[0.0] is not None
    assert by_reward[1.0] > 0 > by_reward[0.0]


def test_decoupled_update_still_learns_from_rows_past_the_clip() -> None:
    """A stale row (sampler far below the current policy) is clipped away by plain PPO,
    but the decoupled loss clips against the policy at the update's start and weights
    the token by the capped importance ratio: the step still moves toward it."""
    module = TinyTransformer(SMALL)
    good0 = sum(logprobs_of(module, GOOD))
    stats = GrpoTrainer(module, GrpoConfig(lr=1e-2, epochs=1)).step(
        [row(GOOD, 1.0, [-30.0, -30.0])]
    )
    assert stats.clip_fraction == 0.0
    assert sum(logprobs_of(module, GOOD)) > good0


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_the_ratio_is_taken_at_the_sampling_temperature(temperature: float) -> None:
    """The sampler's logprobs are log_softmax(logits / T); the trainer's used to be taken
    at T = 1, so at T != 1 the ratio and the importance weight were off before any
    update. Now each call's tokens are scored at its own temperature: exactly 1."""
    from envport.policy.base import SamplingParams as Sampling

    torch.manual_seed(0)
    policy = TorchPolicy(TinyTransformer(SMALL), version=0, seed=0)
    module = policy._weights.module
    first = policy.sample(
        PROMPT, Sampling(temperature=temperature, max_tokens=6, seed=1), chat=False
    )
    gap = [60, 61]  # a tool result between two calls (mask 0)
    second_prompt = [*PROMPT, *first.token_ids, *gap]
    second = policy.sample(
        second_prompt, Sampling(temperature=0.8, max_tokens=4, seed=2), chat=False
    )
    n1, n2 = len(first.token_ids), len(second.token_ids)
    r = TrainingRow(
        prompt_ids=PROMPT,
        completion_ids=[*first.token_ids, *gap, *second.token_ids],
        mask=[1] * n1 + [0, 0] + [1] * n2,
        logprobs=[*first.logprobs, 0.0, 0.0, *second.logprobs],
        reward=1.0,
        advantage=1.0,
        trace_id="t",
        rollout_id="t",
        policy_versions=[0, 0],
        num_turns=2,
        spans=[(0, n1), (n1 + 2, n1 + 2 + n2)],
        temperatures=[temperature, 0.8],
    )
    batch = pack([r])
    with torch.no_grad():
        prox = token_logprobs(module, batch.ids, batch.temperatures)
    on = batch.mask > 0
    weight = torch.exp(prox - batch.old_logprobs)[on]
    assert weight.tolist() == pytest.approx([1.0] * (n1 + n2), abs=1e-4)
    with torch.no_grad():
        _, info = grpo_loss(module, batch)  # plain PPO: the ratio against the sampler
    assert info["clip_fraction"] == 0.0
    assert abs(info["approx_kl"]) < 1e-6
