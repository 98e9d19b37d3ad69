"""A blocking facade over :class:`~envport.client.EnvClient`.

The async client runs on an event loop in a background thread (an anyio blocking
portal), so the facade works from plain scripts and from inside Jupyter alike.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal
from pydantic import BaseModel

from envport.client.client import ClientStepResult, EnvClient


class SyncEnvClient:
    def __init__(self, client: EnvClient) -> None:
        self._client = client
        self._stack = ExitStack()
        self._portal: BlockingPortal | None = None

    def __enter__(self) -> SyncEnvClient:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        if self._portal is None:
            self._portal = self._stack.enter_context(start_blocking_portal())
            self._portal.call(self._client.transport.open)

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.open()
        assert self._portal is not None
        return self._portal.call(lambda: fn(*args, **kwargs))

    def reset(self, **kwargs: Any) -> ClientStepResult:
        result: ClientStepResult = self._run(self._client.reset, **kwargs)
        return result

    def step(self, action: dict[str, Any] | BaseModel) -> ClientStepResult:
        result: ClientStepResult = self._run(self._client.step, action)
        return result

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._run(self._client.state)
        return state

    def list_tools(self) -> list[dict[str, Any]]:
        tools: list[dict[str, Any]] = self._run(self._client.list_tools)
        return tools

    def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        return self._run(self._client.call_tool, name, arguments)

    def close(self) -> None:
        try:
            if self._portal is not None:
                self._portal.call(self._client.close)
        finally:  # the portal's thread ends whatever close() raised
            self._portal = None
            self._stack.close()
