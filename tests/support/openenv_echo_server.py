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
* Two flavours of the same environment:

  - ``EchoEnvironment`` (the default here, and what the tests use) overrides
    ``reset_async`` / ``step_async`` with inline coroutines (the documented way to
    give OpenEnv "a true async implementation"): no thread hop per call, the
    strongest OpenEnv baseline for a trivial env.
  - ``SyncEchoEnvironment`` (``--sync-env``) is written the standard OpenEnv way:
    only the sync ``reset`` / ``_step_impl``. OpenEnv then runs ``reset`` in the
    session's executor thread and ``MCPEnvironment.step_async`` runs ``_step_impl``
    in the loop's default thread pool, once per call. Tool calls take the same
    FastMCP path in both.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

# openenv-core imports gradio (about 6 s of CPU) only for its web interface, served
# with ENABLE_WEB_INTERFACE alone, and leaves that out when gradio cannot be imported.
# Nothing here serves it, so the server starts without gradio.
sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]

from fastmcp import FastMCP  # noqa: E402
from openenv.core.env_server.http_server import create_fastapi_app  # noqa: E402
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

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


class _EchoBase(MCPEnvironment):
    """Echoes each message back. Reward is 0.1 x the message length, capped at 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True

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


class SyncEchoEnvironment(_EchoBase):
    """The echo env written the standard OpenEnv way: sync hooks only (thread per call)."""


class EchoEnvironment(_EchoBase):
    """The echo env with OpenEnv's documented async fast path (inline coroutines)."""

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EchoObservation:
        return self.reset(seed=seed, episode_id=episode_id, **kwargs)

    async def step_async(
        self, action: Action, timeout_s: float | None = None, **kwargs: Any
    ) -> Observation:
        if isinstance(action, CallToolAction | ListToolsAction):
            # MCP actions: OpenEnv's MCPEnvironment routing (FastMCP client).
            if isinstance(action, CallToolAction):
                self._state.step_count += 1
            return await super().step_async(action, timeout_s=timeout_s, **kwargs)
        return self._step_impl(action, timeout_s=timeout_s, **kwargs)


def build_app(max_concurrent_envs: int = 2048, *, sync_env: bool = False) -> Any:
    """The FastAPI app, built by OpenEnv's ``create_fastapi_app``."""
    return create_fastapi_app(
        SyncEchoEnvironment if sync_env else EchoEnvironment,
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
        "--sync-env",
        "--threaded-steps",
        action="store_true",
        help="serve the env written the standard way (sync hooks, a thread hop per call)",
    )
    parser.add_argument("--ws", default="auto", help="uvicorn WebSocket implementation")
    parser.add_argument(
        "--loop", default="auto", help="uvicorn event loop (auto: uvloop if installed)"
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    import uvicorn

    uvicorn.run(
        build_app(args.max_concurrent_envs, sync_env=args.sync_env),
        host=args.host,
        port=args.port,
        ws=args.ws,
        loop=args.loop,
        log_level=args.log_level,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
