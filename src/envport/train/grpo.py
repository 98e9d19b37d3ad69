"""A GRPO update on :class:`~envport.train.rows.TrainingRow` batches, in-process, in PyTorch.

The loss is the clipped policy-gradient surrogate of PPO with GRPO's group-relative
advantages (:func:`envport.train.assign_advantages`), averaged over every sampled
(mask-1) token of the batch:

    ratio_t = exp(logp_new(t) - logp_old(t))
    loss    = -mean_t min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)

``logp_old`` is the **sampler's** logprob, carried in the row exactly as the model server
returned it, i.e. ``log_softmax(logits / T)`` at the call's sampling temperature ``T``
(``TrainingRow.temperatures``): ``logp_new`` and ``logp_prox`` are taken at the same
temperature, so before any update the ratio is exactly 1 whatever ``T``. With
``decoupled`` (the default) rows sampled by an older policy version
(bounded staleness: see :mod:`envport.train.pipeline`) are handled as decoupled PPO
does: the ratio is taken against the policy as it was when this update began
(``logp_prox``, recomputed) and each token is weighted by the truncated importance
weight ``min(cap, exp(logp_prox - logp_old))``. Plain clipping against the sampler
would zero the gradient of most tokens of a stale batch: the previous update already
moved them past the clip. No KL term and no reference
model: at this scale the clip is enough, and the demo says so.

The trainer works on any causal LM module whose ``forward(ids) -> logits [B, T, V]``
(the tiny transformer of :mod:`envport.policy.torch_policy`); rows are right-padded,
which a causal model never sees.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from envport.train.rows import TrainingRow


class GrpoConfig(BaseModel):
    """Optimiser and loss settings of :class:`GrpoTrainer`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(
        5e-4,
        gt=0,
        description="AdamW step size. 2e-3 learned the answer format in one update and "
        "then stalled (the digits never sharpened); 5e-4 keeps improving.",
    )
    epochs: int = Field(2, ge=1, description="Passes over each batch (GRPO's mu).")
    minibatch: int = Field(32, ge=1, description="Rows per optimiser step.")
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    decoupled: bool = Field(
        True,
        description="Clip against the policy at the start of the update (recomputed), and "
        "weight each token by min(cap, p_prox / p_sampler): decoupled PPO for stale rows.",
    )
    weight_cap: float = Field(2.0, gt=0, description="Cap of the decoupled importance weight.")
    pad_id: int = Field(0, ge=0)


@dataclass(frozen=True)
class Batch:
    """Rows packed as tensors: ids ``[B, T]``; per target position ``[B, T-1]``."""

    ids: Tensor
    mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    #: ``[B, T-1]``: the sampling temperature of each target position's call (1.0 where
    #: unknown, greedy or not sampled); None: 1.0 everywhere.
    temperatures: Tensor | None = None

    def select(self, idx: Tensor) -> Batch:
        temps = None if self.temperatures is None else self.temperatures[idx]
        return Batch(
            self.ids[idx], self.mask[idx], self.old_logprobs[idx], self.advantages[idx], temps
        )

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


@dataclass(frozen=True)
class UpdateStats:
    """What one :meth:`GrpoTrainer.step` did."""

    rows: int
    tokens: int
    steps: int
    loss: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    seconds: float


class RowError(ValueError):
    """A row cannot be trained on (no advantage, no logprobs, misaligned); says which."""


def pack(rows: Sequence[TrainingRow], *, pad_id: int = 0) -> Batch:
    """Right-pad rows into one :class:`Batch`; loss positions are the mask-1 tokens."""
    if not rows:
        raise RowError("no rows to pack")
    for row in rows:
        if row.advantage is None:
            raise RowError(
                f"row of trace {row.trace_id} has no advantage; call assign_advantages() first"
            )
        if row.logprobs is None:
            raise RowError(
                f"row of trace {row.trace_id} has no sampler logprobs; the policy-gradient "
                "ratio needs them (ask the server for logprobs)"
            )
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length - 1))
    old = torch.zeros((len(rows), length - 1))
    temps = torch.ones((len(rows), length - 1))
    adv = torch.zeros(len(rows))
    for i, row in enumerate(rows):
        seq = row.prompt_ids + row.completion_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        start = len(row.prompt_ids) - 1  # target position of the first completion token
        n = len(row.completion_ids)
        mask[i, start : start + n] = torch.tensor(row.mask, dtype=torch.float)
        assert row.logprobs is not None
        old[i, start : start + n] = torch.tensor(row.logprobs)
        for (lo, hi), temp in zip(row.spans, row.temperatures, strict=False):
            if temp is not None and temp > 0:  # greedy (0) samples from the plain logits
                temps[i, start + lo : start + hi] = temp
        adv[i] = float(row.advantage or 0.0)
    return Batch(ids, mask, old, adv, temps)


def token_logprobs(model: nn.Module, ids: Tensor, temperatures: Tensor | None = None) -> Tensor:
    """``[B, T-1]``: the logprob of ``ids[:, i + 1]`` after ``ids[:, : i + 1]``.

    With ``temperatures`` (``[B, T-1]``, as :func:`pack` makes them) each position's
    logits are divided by the temperature its token was sampled at, as the sampler's
    logprobs were: ``log_softmax(logits / T)``, so the ratio compares like with like.
    """
    logits = model(ids[:, :-1]).float()
    if temperatures is not None:
        logits = logits / temperatures.unsqueeze(-1)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_loss(
    model: nn.Module,
    batch: Batch,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    prox: Tensor | None = None,
    weight_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate over mask-1 tokens, and its diagnostics.

    Without ``prox`` the ratio is against the sampler's logprobs (plain GRPO/PPO). With
    ``prox`` (the logprobs of the policy when this update began) the ratio is against
    ``prox`` and each token is weighted by ``min(weight_cap, exp(prox - sampler))``:
    decoupled PPO, which keeps learning from rows a version or two stale instead of
    clipping them away.
    """
    new = token_logprobs(model, batch.ids, batch.temperatures)
    mask = batch.mask
    n = mask.sum().clamp(min=1.0)
    base = batch.old_logprobs if prox is None else prox
    log_ratio = (new - base) * mask
    ratio = torch.exp(log_ratio)
    adv = batch.advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    weight = torch.ones_like(mask)
    if prox is not None:
        weight = torch.exp((prox - batch.old_logprobs) * mask).clamp(max=weight_cap).detach()
    loss = -(torch.minimum(unclipped, clipped) * weight * mask).sum() / n
    with torch.no_grad():
        was_clipped = ((unclipped != clipped) & (mask > 0)).float().sum() / n
        approx_kl = (((ratio - 1) - log_ratio) * mask).sum() / n
    return loss, {"clip_fraction": float(was_clipped), "approx_kl": float(approx_kl)}


class GrpoTrainer:
    """Owns a trainable module and its optimiser; :meth:`step` runs one GRPO update."""

    def __init__(self, module: nn.Module, config: GrpoConfig | None = None, *, seed: int = 0):
        self.module = module
        self.config = config or GrpoConfig()
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=self.config.lr, weight_decay=0)
        self._gen = torch.Generator().manual_seed(seed)
        self.updates = 0

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def step(self, rows: Sequence[TrainingRow]) -> UpdateStats:
        """``epochs`` passes over ``rows`` in shuffled minibatches (blocking)."""
        t0 = time.perf_counter()
        cfg = self.config
        self.module.train()
        rows = list(rows)
        losses: list[float] = []
        clips: list[float] = []
        kls: list[float] = []
        norms: list[float] = []
        tokens = 0
        full = pack(rows, pad_id=cfg.pad_id)
        prox: Tensor | None = None
        if cfg.decoupled:
            with torch.no_grad():
                self.module.eval()
                prox = token_logprobs(self.module, full.ids, full.temperatures)
                self.module.train()
        for _ in range(cfg.epochs):
            order = torch.randperm(len(rows), generator=self._gen)
            for start in range(0, len(rows), cfg.minibatch):
                idx = order[start : start + cfg.minibatch]
                batch = full.select(idx)
                tokens += batch.tokens
                loss, info = grpo_loss(
                    self.module,
                    batch,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    prox=None if prox is None else prox[idx],
                    weight_cap=cfg.weight_cap,
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                losses.append(float(loss.detach()))
                clips.append(info["clip_fraction"])
                kls.append(info["approx_kl"])
                norms.append(float(norm))
        self.module.eval()
        self.updates += 1

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else math.nan

        return UpdateStats(
            rows=len(rows),
            tokens=tokens // cfg.epochs,
            steps=len(losses),
            loss=mean(losses),
            clip_fraction=mean(clips),
            approx_kl=mean(kls),
            grad_norm=mean(norms),
            seconds=time.perf_counter() - t0,
        )
