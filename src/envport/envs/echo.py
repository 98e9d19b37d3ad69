"""``echo-v1``: returns what it is sent. The smallest complete environment."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from envport.env import Env
from envport.tools import tool
from envport.types import Action, Observation, StepResult


class EchoAction(Action):
    message: str = Field(description="Text to echo back.")


class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class EchoEnv(Env[EchoAction, EchoObservation]):
    """Echoes each message back. Reward is 0.1 x the message length, capped at 1."""

    action_type = EchoAction
    observation_type = EchoObservation
    reward_range = (0.0, 1.0)
    version = "1"

    def __init__(self, max_steps: int | None = None) -> None:
        super().__init__()
        self.max_steps = max_steps

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[EchoObservation]:
        return StepResult(observation=EchoObservation(echoed_message="Echo environment ready!"))

    async def on_step(self, action: EchoAction) -> StepResult[EchoObservation]:
        obs = EchoObservation(echoed_message=action.message, message_length=len(action.message))
        truncated = self.max_steps is not None and self.step_count >= self.max_steps
        return StepResult(
            observation=obs, reward=min(1.0, 0.1 * len(action.message)), truncated=truncated
        )

    @tool
    async def echo(self, message: str) -> str:
        """Echo a message back.

        Args:
            message: The text to echo.
        """
        return message

    @tool
    async def reverse(self, message: str) -> str:
        """Reverse a message.

        Args:
            message: The text to reverse.
        """
        return message[::-1]
