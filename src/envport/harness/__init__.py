"""Harnesses: what drives the model.

* :class:`ToolCallingAgent` — the built-in agent loop, with its recording client
  :class:`ChatModel` for any OpenAI-compatible endpoint.
* :class:`SubprocessHarness` — any CLI agent, unmodified, pointed at a model endpoint
  (usually the gateway) through the variables it already reads; :func:`mini_swe_agent`
  is a ready preset.
"""

from envport.harness.agent import AgentConfig, ToolCallingAgent, observation_text, reset_options
from envport.harness.model import ChatModel, ModelProviderError
from envport.harness.subprocess import (
    HarnessResult,
    ModelEndpoint,
    SubprocessHarness,
    mini_swe_agent,
)

__all__ = [
    "AgentConfig",
    "ChatModel",
    "HarnessResult",
    "ModelEndpoint",
    "ModelProviderError",
    "SubprocessHarness",
    "ToolCallingAgent",
    "mini_swe_agent",
    "observation_text",
    "reset_options",
]
