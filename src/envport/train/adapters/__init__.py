"""Trainer adapters: envport rollouts in, each trainer's own data contract out.

One module per trainer, each imported on its own so a trainer package is only needed
when its adapter is used:

* :mod:`envport.train.adapters.trl` — TRL ``GRPOTrainer``: ``rollout_func``
  (:class:`~envport.train.adapters.trl.EnvportRolloutFunc`) and ``environment_factory``
  (:func:`~envport.train.adapters.trl.environment_class`);
* :mod:`envport.train.adapters.verl` — verl: an ``AgentLoopBase`` subclass registered as
  ``"envport"`` that returns ``AgentLoopOutput``;
* :mod:`envport.train.adapters.skyrl` — SkyRL: a ``GeneratorInterface`` returning
  ``GeneratorOutput``;
* prime-rl and OpenPipe ART read exported rows: :mod:`envport.train.export`.

Every adapter builds its data from :func:`envport.train.build_rows` (token-exact, never
re-tokenized) and hands a trainer one row per rollout (:func:`pick_row`); a rollout that
split keeps its label (``split_reason``) rather than being glued back together.
"""

from envport.train.adapters._common import (
    FRAGMENTS,
    Generated,
    Rollout,
    RolloutRunner,
    TokenChatModel,
    parse_tool_calls,
    pick_row,
)

__all__ = [
    "FRAGMENTS",
    "Generated",
    "Rollout",
    "RolloutRunner",
    "TokenChatModel",
    "parse_tool_calls",
    "pick_row",
]
