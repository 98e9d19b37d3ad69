"""Harnesses: the built-in tool-calling agent and its recording model client."""

from envport.harness.agent import AgentConfig, ToolCallingAgent, observation_text
from envport.harness.model import ChatModel, ModelProviderError

__all__ = ["AgentConfig", "ChatModel", "ModelProviderError", "ToolCallingAgent", "observation_text"]
