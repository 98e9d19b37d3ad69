"""Group-relative advantages for training rows (GRPO and Dr. GRPO).

Rollouts of one prompt share a ``group_id``; each rollout's advantage is its reward
against the others of its group, computed by :func:`envport.rubrics.group_advantages`
(``(r - mean) / (std + eps)``, or ``r - mean`` without ``normalize_std``). A rollout is
counted once (per trace) however many fragments (rows) it was split into, and every fragment gets
the rollout's advantage. Rows without a ``group_id`` form a group of their own
(advantage 0); unscored rollouts (reward ``None``, NaN or infinite) get ``None`` and do
not count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from envport.rubrics import group_advantages
from envport.train.rows import TrainingRow


def row_advantages(
    rows: Iterable[TrainingRow], *, normalize_std: bool = True, eps: float = 1e-4
) -> dict[str, float | None]:
    """``trace_id -> advantage`` within each ``group_id`` (one entry per rollout attempt)."""
    groups: dict[str, dict[str, float | None]] = {}
    for row in rows:
        key = row.group_id if row.group_id is not None else f"\0{row.trace_id}"
        reward = row.reward
        if reward is not None and not math.isfinite(reward):
            reward = None  # NaN or infinity: unscored (build_rows already makes it None)
        groups.setdefault(key, {}).setdefault(row.trace_id, reward)
    out: dict[str, float | None] = {}
    for members in groups.values():
        ids = list(members)
        values = group_advantages([members[i] for i in ids], normalize_std=normalize_std, eps=eps)
        out.update(zip(ids, values, strict=True))
    return out


def assign_advantages(
    rows: Iterable[TrainingRow], *, normalize_std: bool = True, eps: float = 1e-4
) -> list[TrainingRow]:
    """Copies of ``rows`` with ``advantage`` set (see the module docstring)."""
    rows = list(rows)
    advantages = row_advantages(rows, normalize_std=normalize_std, eps=eps)
    return [r.model_copy(update={"advantage": advantages[r.trace_id]}) for r in rows]
