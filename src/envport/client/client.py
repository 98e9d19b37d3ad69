"""``EnvClient``: drive an environment locally or remotely with the same code.

::

    async with EnvClient.connect("ws://127.0.0.1:8000") as env:   # or http://, or "echo-v1"
        result = await env.reset(seed=7)
        result = await env.step({"message": "hi"})
        print(result.observation, result.reward, result.done)

``EnvClient.connect`` picks the transport from the target: ``ws://``/``http://`` URLs use
the WebSocket transport (``transport="http"`` for the HTTP one), anything else is an
environment id served in-process. ``.sync()`` gives a blocking facade.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envport.client.transports import (
    HTTPTransport,
    InProcessTransport,
    Transport,
    WebSocketTransport,
    raise_for_error,
)
from envport.errors import EnvportError, ProtocolError, ToolError
from envport.types import tool_result_value

if TYPE_CHECKING:
    from envport.client.sync import SyncEnvClient


class ClientStepResult(BaseModel):
    """A step or reset result as a client sees it (observation as a plain dict)."""

    model_config = ConfigDict(extra="allow")

    observation: dict[str, Any] = Field(default_factory=dict)
    reward: float | None = None
    done: bool = False
    terminated: bool | None = None
    truncated: bool | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class EnvClient:
    """Async client for one environment session."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    @classmethod
    def connect(
        cls,
        target: str,
        *,
        transport: Literal["auto", "ws", "http", "inprocess"] = "auto",
        timeout_s: float = 60.0,
    ) -> EnvClient:
        """A client for a server URL or an in-process environment id (not yet opened)."""
        remote = target.startswith(("ws://", "wss://", "http://", "https://", "unix:"))
        if transport == "http":
            return cls(HTTPTransport(target, timeout_s=timeout_s))
        if transport == "ws" or (transport == "auto" and remote):
            return cls(WebSocketTransport(target, timeout_s=timeout_s))
        return cls(InProcessTransport(target, call_timeout_s=timeout_s))

    @property
    def tools_token(self) -> str | None:
        """The session's tools-only token, for an agent's MCP client (header
        ``X-Envport-Session``): it calls the environment's tools at the server's ``/mcp``
        and cannot reset, step, read or close the session. None until the session is
        open, and for transports without one (in-process, a plain OpenEnv server)."""
        token = getattr(self.transport, "tools_token", None)
        return token if isinstance(token, str) else None

    async def __aenter__(self) -> EnvClient:
        await self.transport.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, frame: dict[str, Any], expect: str) -> Any:
        """Send ``frame``; the ``data`` of its ``expect`` reply (an error reply raises
        its error, any other reply :class:`ProtocolError`)."""
        reply = await self.transport.request(frame)
        kind = reply.get("type")
        if kind == expect:
            return reply.get("data")
        raise_for_error(reply)
        raise ProtocolError(
            f"The server answered a {frame['type']!r} frame with a {kind!r} frame, "
            f"not {expect!r}: {str(reply)[:200]}"
        )

    @staticmethod
    def _result(data: Any) -> ClientStepResult:
        try:
            return ClientStepResult.model_validate(data)
        except ValidationError as exc:
            raise ProtocolError(f"The server's observation is not a step result: {exc}") from None

    async def reset(
        self, *, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> ClientStepResult:
        data: dict[str, Any] = dict(options)
        if seed is not None:
            data["seed"] = seed
        if episode_id is not None:
            data["episode_id"] = episode_id
        return self._result(await self._call({"type": "reset", "data": data}, "observation"))

    async def step(self, action: dict[str, Any] | BaseModel) -> ClientStepResult:
        payload = action.model_dump(mode="json") if isinstance(action, BaseModel) else action
        return self._result(await self._call({"type": "step", "data": payload}, "observation"))

    async def state(self) -> dict[str, Any]:
        return self._mapping(await self._call({"type": "state"}, "state"), "state")

    async def schema(self) -> dict[str, Any]:
        """JSON Schemas of action, observation and state, plus ``tools``; takes no step."""
        return self._mapping(await self._call({"type": "schema"}, "schema"), "schema")

    @staticmethod
    def _mapping(data: Any, kind: str) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise ProtocolError(f"The server's {kind} is not a JSON object: {str(data)[:200]}")
        return data

    async def list_tools(self) -> list[dict[str, Any]]:
        result = await self.step({"type": "list_tools"})
        tools: list[dict[str, Any]] = result.observation.get("tools", [])
        return tools

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """Call a tool and return its plain value (the ``data`` of the observation's
        ``CallToolResult``); raises :class:`ToolError` with the server's error kind."""
        result = await self.step(
            {"type": "call_tool", "tool_name": name, "arguments": arguments or {}}
        )
        error = result.observation.get("error")
        if error:
            raise ToolError(error.get("message", "tool failed"), kind=error.get("error_type"))
        return tool_result_value(result.observation.get("result"))

    async def close(self) -> None:
        with contextlib.suppress(EnvportError):
            await self.transport.close()

    def sync(self) -> SyncEnvClient:
        from envport.client.sync import SyncEnvClient

        return SyncEnvClient(self)
