"""The typed data that crosses the environment contract.

``Action``, ``Observation`` and ``State`` are pydantic models that environments
subclass; ``StepResult`` is what ``reset`` and ``step`` return. The wire form of a
``StepResult`` is OpenEnv's: ``{"observation": {...}, "reward": r, "done": b,
"metadata": {...}}``; ``terminated``/``truncated`` are kept apart locally (as in
Gymnasium) and ``done`` is their union.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class Action(BaseModel):
    """Base of every action. Unknown fields are rejected, so typos are errors."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form metadata.")


class Observation(BaseModel):
    """Base of every observation an environment returns."""

    model_config = ConfigDict(extra="allow")


class State(BaseModel):
    """What ``state()`` returns: at least the episode id and the step count."""

    model_config = ConfigDict(extra="allow")

    episode_id: str | None = Field(default=None, description="Id of the current episode.")
    step_count: int = Field(default=0, ge=0, description="Steps taken in this episode.")


ObsT = TypeVar("ObsT", bound=Observation)


class StepResult(BaseModel, Generic[ObsT]):
    """The outcome of ``reset`` or ``step``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    observation: ObsT
    reward: float | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def to_wire(self, *, extended: bool = False) -> dict[str, Any]:
        """OpenEnv's observation payload; ``extended`` adds terminated/truncated."""
        obs = self.observation
        data: dict[str, Any] = {
            # model_dump(mode="json") without its Python-level argument handling (hot path)
            "observation": type(obs).__pydantic_serializer__.to_python(obs, mode="json"),
            "reward": self.reward,
            "done": self.done,
            "metadata": self.info,
        }
        if extended:
            data["terminated"] = self.terminated
            data["truncated"] = self.truncated
        return data


class EnvMetadata(BaseModel):
    """What ``GET /metadata`` returns (OpenEnv's ``EnvironmentMetadata`` fields)."""

    name: str
    description: str = ""
    version: str | None = None
    author: str | None = None
    readme_content: str | None = None
    documentation_url: str | None = None
    reward_range: tuple[float, float] | None = None
    tools: list[str] = Field(default_factory=list)


# --- tools ------------------------------------------------------------------------------


class ToolSpec(BaseModel):
    """One tool an environment offers (OpenEnv's ``Tool``; MCP's ``inputSchema`` too)."""

    name: str
    description: str = ""
    input_schema: dict[str, Any]


class ListToolsAction(BaseModel):
    """OpenEnv's MCP action that lists tools."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["list_tools"] = "list_tools"
    metadata: dict[str, Any] = Field(default_factory=dict)


class CallToolAction(BaseModel):
    """OpenEnv's MCP action that calls one tool."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["call_tool"] = "call_tool"
    tool_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


class ToolErrorInfo(BaseModel):
    """OpenEnv's ``ToolError``: ``error_type`` is one of its ``ToolErrorType`` values."""

    error_type: Literal[
        "execution_error", "invalid_args", "transport_error", "tool_not_found", "timeout"
    ]
    message: str


class ListToolsObservation(Observation):
    tools: list[ToolSpec]


class CallToolObservation(Observation):
    tool_name: str
    result: Any = None
    error: ToolErrorInfo | None = None
