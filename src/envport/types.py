"""The typed data that crosses the environment contract.

``Action``, ``Observation`` and ``State`` are pydantic models that environments
subclass; ``StepResult`` is what ``reset`` and ``step`` return. The wire form of a
``StepResult`` is OpenEnv's: ``{"observation": {...}, "reward": r, "done": b,
"metadata": {...}}``; ``terminated``/``truncated`` are kept apart locally (as in
Gymnasium) and ``done`` is their union.
"""

from __future__ import annotations

import json
import math
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


def tool_text(value: Any) -> str:
    """A tool result as one text block: a string as is, anything else as JSON. Valid
    JSON: NaN and infinities are null, as in the ``structuredContent`` beside it (JSON has
    no token for them; Python's ``NaN`` would break every other parser)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str, allow_nan=False)
    except ValueError as exc:
        if "float" not in str(exc):  # a circular reference, say: not ours to mend
            raise
        # a non-finite float somewhere (rare: only then the walk)
        return json.dumps(_finite(value), ensure_ascii=False, default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def structured_content(value: Any) -> dict[str, Any]:
    """A tool result as MCP's ``structuredContent``: a dict as is, any other value wrapped
    as ``{"result": value}`` (MCP requires an object there through 2025-11-25)."""
    return value if isinstance(value, dict) else {"result": value}


class TextContent(BaseModel):
    """MCP's text content block, with the keys OpenEnv's step observations give it."""

    type: Literal["text"] = "text"
    text: str
    annotations: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None


class CallToolResult(BaseModel):
    """A successful tool call as OpenEnv's ``call_tool`` observation carries it.

    OpenEnv puts FastMCP's ``CallToolResult`` in ``result`` and dumps it with these
    snake_case keys; its clients return ``data``, the tool's plain JSON value. ``content``
    is one text block (:func:`tool_text`), ``structured_content`` is
    :func:`structured_content` of the value (as on envport's MCP endpoint), ``meta`` is
    null and ``is_error`` false: a failed call has no result, it has the observation's
    ``error``.
    """

    content: list[TextContent]
    structured_content: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    data: Any = None
    is_error: bool = False

    @classmethod
    def of(cls, value: Any) -> CallToolResult:
        """The result of a call that returned ``value`` (JSON-able)."""
        return cls(
            content=[TextContent(text=tool_text(value))],
            structured_content=structured_content(value),
            data=value,
        )


def tool_result_value(result: Any) -> Any:
    """The plain value in a ``call_tool`` observation's wire ``result``.

    A ``CallToolResult`` gives its ``data``; when a plain OpenEnv server's FastMCP tool
    has no output schema, ``data`` and ``structured_content`` are null and its text
    content is the value. Anything else is taken to be the bare value itself.
    """
    if not (
        isinstance(result, dict)
        and isinstance(result.get("content"), list)
        and "data" in result
        and "is_error" in result
    ):
        return result
    if result["data"] is not None or result.get("structured_content") is not None:
        return result["data"]
    texts = [
        str(block.get("text", ""))
        for block in result["content"]
        if isinstance(block, dict) and block.get("type") == "text"
    ]
    return "".join(texts) if texts else None


class ListToolsObservation(Observation):
    tools: list[ToolSpec]


class CallToolObservation(Observation):
    """OpenEnv's ``CallToolObservation``: ``result`` on success, ``error`` on failure."""

    tool_name: str
    result: CallToolResult | None = None
    error: ToolErrorInfo | None = None
