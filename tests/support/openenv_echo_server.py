"""An echo environment served by OpenEnv's *own* server (``openenv-core``).

This is the reference that envport is measured and checked against: the same
environment as envport's ``echo-v1`` (action ``{"message": str}``, observation
``{echoed_message, message_length}``, reward ``min(1, 0.1 * len(message))``,
tools ``echo(message)`` and ``reverse(message)``), but behind OpenEnv's
``HTTPEnvServer`` (FastAPI on uvicorn), so every frame is produced by OpenEnv's
code, not ours.

Run::

    python tests/support/openenv_echo_server.py --port 8123 [--max-concurrent-envs 2048]

Then ``GET /health``, WebSocket ``/ws`` (OpenEnv frames), ``POST /reset|/step``,
``GET /state|/schema|/metadata`` and ``POST /mcp`` / WebSocket ``/mcp`` (OpenEnv's
JSON-RPC ``tools/list`` / ``tools/call``) are served on 127.0.0.1.

How the pieces of ``openenv-core`` are used (checked against 0.3.0):

* ``create_fastapi_app(factory, action_cls, observation_cls, max_concurrent_envs)``
  builds the app; the factory is called once per WebSocket session.
* ``max_concurrent_envs > 1`` is refused (``ConcurrencyConfigurationError``)
  unless the environment class sets ``SUPPORTS_CONCURRENT_SESSIONS = True``.
  OpenEnv's default capacity is one session.
* Tools: the environment subclasses ``MCPEnvironment`` with a FastMCP server, so
  ``{"type":"call_tool",...}`` / ``{"type":"list_tools"}`` step actions are routed
  by OpenEnv to FastMCP through a FastMCP in-memory ``Client`` (the session is held
  open per WebSocket by the server), and ``/mcp`` answers ``tools/list`` /
  ``tools/call``.
* OpenEnv only turns ``call_tool`` / ``list_tools`` step payloads into MCP actions
  when ``action_cls`` is the bare ``Action`` (or an MCP action class); with a
  typed action class (ours: ``EchoAction``) it calls ``action_cls.model_validate``.
  ``EchoAction.model_validate`` therefore forwards those two payload types to
  OpenEnv's own ``CallToolAction`` / ``ListToolsAction``, so one server accepts
  both plain echo actions and tool calls, like envport's ``echo-v1``.
* ``reset_async`` / ``step_async`` are overridden with inline coroutines (the
  documented way to give OpenEnv "a true async implementation"). Without them a
  plain step would hop to a worker thread per call; with them the benchmark
  compares server overhead, the strongest OpenEnv baseline for a trivial env.
  ``--threaded-steps`` keeps OpenEnv's default thread-pool path instead.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

RESET_MESSAGE = "Echo environment ready!"
_MCP_ACTIONS: dict[str, type[Action]] = {
    "call_tool": CallToolAction,
    "list_tools": ListToolsAction,
}


class EchoAction(Action):
    """``{"message": str}``; ``call_tool`` / ``list_tools`` payloads become MCP actions."""

    message: str = Field(description="Text to echo back.")

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if isinstance(obj, dict) and obj.get("type") in _MCP_ACTIONS:
            return _MCP_ACTIONS[obj["type"]].model_validate(obj, **kwargs)
        return super().model_validate(obj, **kwargs)


class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


def _build_tools() -> FastMCP:
    mcp = FastMCP("echo-v1")

    @mcp.tool
    def echo(message: str) -> str:
        """Echo a message back.

        Args:
            message: The text to echo.
        """
        return message

    @mcp.tool
    def reverse(message: str) -> str:
        """Reverse a message.

        Args:
            message: The text to reverse.
        """
        return message[::-1]

    return mcp


class EchoEnvironment(MCPEnvironment):
    """Echoes each message back. Reward is 0.1 x the message length, capped at 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    THREADED_STEPS = False  # set by --threaded-steps

    def __init__(self) -> None:
        # One FastMCP server per environment, as OpenEnv's own examples do.
        super().__init__(_build_tools())
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    # -- sync API (OpenEnv's abstract methods) ---------------------------------
    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EchoObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return EchoObservation(echoed_message=RESET_MESSAGE, message_length=0, reward=0.0)

    def _step_impl(
        self, action: Action, timeout_s: float | None = None, **kwargs: Any
    ) -> Observation:
        if not isinstance(action, EchoAction):
            raise TypeError(f"expected EchoAction, got {type(action).__name__}")
        self._state.step_count += 1
        message = action.message
        return EchoObservation(
            echoed_message=message,
            message_length=len(message),
            reward=min(1.0, 0.1 * len(message)),
        )

    @property
    def state(self) -> State:
        return self._state

    # -- async fast path ---------------------------------------------------------
    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EchoObservation:
        return self.reset(seed=seed, episode_id=episode_id, **kwargs)

    async def step_async(
        self, action: Action, timeout_s: float | None = None, **kwargs: Any
    ) -> Observation:
        if self.THREADED_STEPS or isinstance(action, CallToolAction | ListToolsAction):
            # MCP actions: OpenEnv's MCPEnvironment routing (FastMCP client).
            # Threaded mode: OpenEnv's default run_in_executor path for _step_impl.
            if isinstance(action, CallToolAction):
                self._state.step_count += 1
            return await super().step_async(action, timeout_s=timeout_s, **kwargs)
        return self._step_impl(action, timeout_s=timeout_s, **kwargs)


def build_app(max_concurrent_envs: int = 2048) -> Any:
    """The FastAPI app, built by OpenEnv's ``create_fastapi_app``."""
    return create_fastapi_app(
        EchoEnvironment,
        EchoAction,
        EchoObservation,
        max_concurrent_envs=max_concurrent_envs,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=2048,
        help="OpenEnv session capacity (its own default is 1)",
    )
    parser.add_argument(
        "--threaded-steps",
        action="store_true",
        help="step plain actions on OpenEnv's default worker-thread path",
    )
    parser.add_argument("--ws", default="auto", help="uvicorn WebSocket implementation")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    import uvicorn

    EchoEnvironment.THREADED_STEPS = args.threaded_steps
    uvicorn.run(
        build_app(args.max_concurrent_envs),
        host=args.host,
        port=args.port,
        ws=args.ws,
        log_level=args.log_level,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
