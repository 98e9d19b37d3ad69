"""Model policies behind an OpenAI-compatible server, for offline demos and tests.

- :mod:`envport.policy.base`: the :class:`Policy` contract and :class:`Generation`;
- :mod:`envport.policy.tokenizer`: a byte-level tokenizer and chat template;
- :mod:`envport.policy.scripted`: ``envport-scripted``, a rule-based stand-in;
- :mod:`envport.policy.server`: ``create_policy_app(policy)``, the HTTP server.

The server module is imported on first use, so ``python -m envport.policy.server`` runs
it without importing it twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envport.policy.base import Generation, Policy, SamplingParams, Tokenizer, ToolCall
from envport.policy.scripted import SCRIPTED_MODEL_NAME, ScriptedPolicy
from envport.policy.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from envport.policy.server import FaultInjector, create_policy_app

__all__ = [
    "SCRIPTED_MODEL_NAME",
    "ByteTokenizer",
    "FaultInjector",
    "Generation",
    "Policy",
    "SamplingParams",
    "ScriptedPolicy",
    "Tokenizer",
    "ToolCall",
    "create_policy_app",
]


def __getattr__(name: str) -> Any:
    if name in ("FaultInjector", "create_policy_app"):
        from envport.policy import server

        return getattr(server, name)
    raise AttributeError(f"module 'envport.policy' has no attribute {name!r}")
