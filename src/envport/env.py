"""The environment contract.

An environment is an object with four async methods::

    await env.reset(seed=None, episode_id=None, **options) -> StepResult
    await env.step(action) -> StepResult
    await env.state() -> State
    await env.close()

Subclasses of :class:`Env` write only the hooks ``on_reset`` and ``on_step`` (and, if
they hold resources, ``on_close``); the public methods do the bookkeeping every
environment needs and every server relies on: episode ids, step counts, seeding
``self.rng``, rejecting a step before reset or any call after close, turning a dict into
the typed action (with an error that names the field), and answering OpenEnv's
``list_tools``/``call_tool`` actions from methods marked with :func:`envport.tool`.

Hooks may be ``async def`` or plain ``def``: a plain hook runs in a worker thread
owned by the instance (one thread, so thread-affine libraries keep working), never on
the event loop.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import math
import random
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar, Generic, TypeVar, cast

from pydantic import BaseModel, ValidationError

from envport.errors import (
    ActionValidationError,
    EnvClosedError,
    EnvExecutionError,
    EnvNotResetError,
    EnvportError,
    ToolError,
)
from envport.tools import BoundTool, discover, to_jsonable
from envport.types import (
    Action,
    CallToolAction,
    CallToolObservation,
    CallToolResult,
    EnvMetadata,
    ListToolsAction,
    ListToolsObservation,
    Observation,
    State,
    StepResult,
    ToolErrorInfo,
    ToolSpec,
)

ActT = TypeVar("ActT", bound=Action)
ObsT = TypeVar("ObsT", bound=Observation)
T = TypeVar("T")

AnyAction = Action | ListToolsAction | CallToolAction


class EnvStatus(enum.Enum):
    """Lifecycle of one environment instance."""

    NEW = "new"  # constructed, never reset
    RUNNING = "running"  # reset at least once
    CLOSED = "closed"


class Env(Generic[ActT, ObsT]):
    """Base class of every envport environment. See the module docstring."""

    action_type: ClassVar[type[Action]] = Action
    observation_type: ClassVar[type[Observation]] = Observation
    state_type: ClassVar[type[State]] = State
    #: Inclusive bounds of any reward this environment gives; checked by ``envport check``.
    reward_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)
    #: Shown by ``GET /metadata``; defaults to the class name and docstring.
    description: ClassVar[str | None] = None
    version: ClassVar[str | None] = None
    #: Why the last reset failed, while the episode waits for a new one.
    _failed_reset: str | None = None

    def __init__(self) -> None:
        self.status = EnvStatus.NEW
        self.episode_id: str | None = None
        self.step_count = 0
        self.rng = random.Random()
        self._executor: ThreadPoolExecutor | None = None
        self._tools: dict[str, BoundTool] | None = None

    # --- hooks for subclasses ----------------------------------------------------------

    def on_reset(
        self, seed: int | None, **options: Any
    ) -> StepResult[ObsT] | Awaitable[StepResult[ObsT]]:
        """Start a new episode and return its first observation."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_reset()")

    def on_step(self, action: ActT) -> StepResult[ObsT] | Awaitable[StepResult[ObsT]]:
        """Apply one typed action."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_step()")

    def extra_state(self) -> dict[str, Any]:
        """Fields added to ``state()`` beyond episode id and step count."""
        return {}

    def on_close(self) -> Awaitable[None] | None:
        """Release whatever the environment holds. Called once."""
        return None

    # --- the contract ------------------------------------------------------------------

    async def reset(
        self, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> StepResult[ObsT]:
        self._check_open()
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ActionValidationError(
                f"seed must be an integer or null, not {type(seed).__name__} {seed!r}.",
                errors=[{"field": "seed", "message": "must be an integer or null"}],
            )
        if episode_id is not None and not isinstance(episode_id, str):
            raise ActionValidationError(
                f"episode_id must be a string or null, not {type(episode_id).__name__}.",
                errors=[{"field": "episode_id", "message": "must be a string or null"}],
            )
        before = (self.episode_id, self.step_count, self.rng)
        self.episode_id = episode_id or uuid.uuid4().hex
        self.step_count = 0
        self.rng = random.Random(seed)
        try:
            result = await self._run_hook(self.on_reset, seed, **options)
        except BaseException as exc:
            if self.status is not EnvStatus.CLOSED:
                self._reset_refused(before, exc)
            raise
        self.status = EnvStatus.RUNNING
        self._failed_reset = None
        return result

    def _reset_refused(self, before: tuple[Any, ...], exc: BaseException) -> None:
        """A refused reset (invalid options: :class:`ActionValidationError`, which
        ``on_reset`` raises before it changes anything) leaves the episode as it was. Any
        other failure may have left it half reset: the next step asks for a new reset."""
        self.episode_id, self.step_count, self.rng = before
        if isinstance(exc, ActionValidationError):
            return
        self.status = EnvStatus.NEW
        self._failed_reset = f"{type(exc).__name__}: {exc}"

    async def step(self, action: ActT | AnyAction | dict[str, Any]) -> StepResult[Any]:
        if self.status is not EnvStatus.RUNNING:
            self._check_open()
            self._check_reset_not_failed()
            if not self._is_tool_action(action):
                raise EnvNotResetError("step() called before reset(); call reset() first.")
        typed = self.parse_action(action)
        self.step_count += 1
        if isinstance(typed, ListToolsAction):
            return StepResult(observation=ListToolsObservation(tools=self.tool_specs()))
        if isinstance(typed, CallToolAction):
            return StepResult(observation=await self._tool_observation(typed))
        hook = self.on_step
        if not _is_async_hook(hook):
            return await self._run_hook(hook, cast(ActT, typed))
        try:  # an async hook, awaited here: _run_hook's path without its frame (hot path)
            return await cast("Awaitable[StepResult[ObsT]]", hook(cast(ActT, typed)))
        except (EnvportError, NotImplementedError):
            raise
        except Exception as exc:
            raise self._hook_error(exc) from exc

    def _check_reset_not_failed(self) -> None:
        """After a failed reset the environment may be half reset: nothing reaches it,
        tools included, until a reset succeeds."""
        if self._failed_reset is not None:
            raise EnvNotResetError(
                f"The last reset() failed ({self._failed_reset}); call reset() again."
            )

    def _is_tool_action(self, action: Any) -> bool:
        """``list_tools``/``call_tool``: answered before the first reset too, as OpenEnv's
        MCP environments and envport's ``/mcp`` answer them."""
        if isinstance(action, ListToolsAction | CallToolAction):
            return True
        return (
            isinstance(action, dict)
            and action.get("type") in ("list_tools", "call_tool")
            and "type" not in self.action_type.model_fields
        )

    async def state(self) -> State:
        self._check_open()
        return self.state_type(
            episode_id=self.episode_id, step_count=self.step_count, **self.extra_state()
        )

    async def close(self) -> None:
        """Release resources. Safe to call more than once."""
        if self.status is EnvStatus.CLOSED:
            return
        self.status = EnvStatus.CLOSED
        try:
            hook = self.on_close
            if getattr(hook, "__func__", None) is not Env.on_close:  # the base one does nothing
                await self._run_hook(hook)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    async def __aenter__(self) -> Env[ActT, ObsT]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- actions and tools -------------------------------------------------------------

    def parse_action(self, action: Any) -> AnyAction:
        """Turn a wire dict (or model) into the typed action, or raise a clear error."""
        if type(action) is dict and "type" not in action:  # the common wire case, first
            try:
                validator = self.action_type.__pydantic_validator__
                return cast(AnyAction, validator.validate_python(action))
            except ValidationError:
                pass  # the full path below explains it
        if isinstance(action, (self.action_type, ListToolsAction, CallToolAction)):
            return action
        if isinstance(action, BaseModel):
            action = action.model_dump()
        if not isinstance(action, dict):
            raise ActionValidationError(
                f"An action must be a JSON object, got {type(action).__name__}.",
                schema=self.action_type.model_json_schema(),
            )
        kind = action.get("type")
        if kind in ("list_tools", "call_tool") and "type" not in self.action_type.model_fields:
            model: type[BaseModel] = ListToolsAction if kind == "list_tools" else CallToolAction
        else:
            model = self.action_type
        try:
            return cast(AnyAction, model.model_validate(action))
        except ValidationError as exc:
            errors = [
                {"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]}
                for e in exc.errors(include_url=False)
            ]
            fields = ", ".join(f"{e['field']}: {e['message']}" for e in errors)
            raise ActionValidationError(
                f"Invalid {model.__name__}: {fields}",
                errors=errors,
                schema=model.model_json_schema(),
            ) from exc

    def tools(self) -> dict[str, BoundTool]:
        if self._tools is None:
            self._tools = discover(self)
        return self._tools

    def tool_specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.tools().values()]

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """Call one tool; raises :class:`ToolError` for unknown tools or bad arguments."""
        self._check_open()
        self._check_reset_not_failed()
        bound = self.tools().get(name)
        if bound is None:
            known = ", ".join(sorted(self.tools())) or "(none)"
            raise ToolError(f"Unknown tool {name!r}. Tools: {known}.", kind="tool_not_found")
        try:
            return to_jsonable(await bound.call(arguments or {}, self._in_thread))
        except EnvportError:
            raise
        except Exception as exc:
            raise ToolError(
                f"Tool {name!r} raised {type(exc).__name__}: {exc}", kind="execution_error"
            ) from exc

    async def _tool_observation(self, action: CallToolAction) -> CallToolObservation:
        try:
            result = await self.call_tool(action.tool_name, action.arguments)
        except ToolError as exc:
            error = ToolErrorInfo(error_type=exc.kind, message=exc.message)
            return CallToolObservation(tool_name=action.tool_name, error=error)
        return CallToolObservation(tool_name=action.tool_name, result=CallToolResult.of(result))

    # --- metadata ----------------------------------------------------------------------

    @classmethod
    def metadata(cls) -> EnvMetadata:
        own = cls.__dict__.get("__doc__")  # not inherited: Env's own would describe it
        doc = inspect.cleandoc(own) if isinstance(own, str) else ""
        lo, hi = cls.reward_range
        return EnvMetadata(
            name=cls.__name__,
            description=cls.description or doc.split("\n\n", 1)[0],
            version=cls.version,
            readme_content=doc or None,
            reward_range=None if (math.isinf(lo) and math.isinf(hi)) else (lo, hi),
        )

    @classmethod
    def schemas(cls) -> dict[str, Any]:
        """OpenEnv's ``/schema`` payload: JSON Schemas of action, observation and state."""
        return {
            "action": cls.action_type.model_json_schema(),
            "observation": cls.observation_type.model_json_schema(),
            "state": cls.state_type.model_json_schema(),
        }

    # --- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.status is EnvStatus.CLOSED:
            raise EnvClosedError(f"{type(self).__name__} is closed.")

    async def _run_hook(
        self, hook: Callable[..., T | Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """Call a hook: inline if it is ``async def``, else on the instance's thread."""
        try:
            if _is_async_hook(hook):
                return await cast("Awaitable[T]", hook(*args, **kwargs))
            value = await self._in_thread(partial(hook, *args, **kwargs))
            if inspect.isawaitable(value):
                return await cast("Awaitable[T]", value)
            return value
        except (EnvportError, NotImplementedError):
            raise
        except Exception as exc:
            raise self._hook_error(exc) from exc

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the instance's own worker thread (one per instance: a synchronous
        environment's hooks and tools see one thread, as thread-bound resources need)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"envport-{type(self).__name__}"
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _hook_error(self, exc: Exception) -> EnvExecutionError:
        return EnvExecutionError(
            f"{type(self).__name__} raised {type(exc).__name__}: {exc}",
            exception=type(exc).__name__,
        )


#: ``inspect.iscoroutinefunction`` per hook function, computed once (hot path). A plain
#: dict: one entry per hook a class defines, and looking one up costs no weak reference.
_ASYNC_HOOKS: dict[Any, bool] = {}


def _is_async_hook(hook: Callable[..., Any]) -> bool:
    func = getattr(hook, "__func__", None)
    if func is None:  # not a bound method (a callable set on the instance): no cache
        return inspect.iscoroutinefunction(hook)
    flag = _ASYNC_HOOKS.get(func)
    if flag is None:
        flag = _ASYNC_HOOKS[func] = inspect.iscoroutinefunction(func)
    return flag


class Wrapper(Env[ActT, ObsT]):
    """Wraps another environment; override one hook to change one behaviour."""

    def __init__(self, env: Env[ActT, ObsT]) -> None:
        super().__init__()
        self.env = env
        self.action_type = env.action_type  # type: ignore[misc]
        self.observation_type = env.observation_type  # type: ignore[misc]
        self.state_type = env.state_type  # type: ignore[misc]
        self.reward_range = env.reward_range  # type: ignore[misc]

    async def reset(
        self, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> StepResult[ObsT]:
        return await self.env.reset(seed=seed, episode_id=episode_id, **options)

    async def step(self, action: ActT | AnyAction | dict[str, Any]) -> StepResult[Any]:
        return await self.env.step(action)

    async def state(self) -> State:
        return await self.env.state()

    async def close(self) -> None:
        await self.env.close()

    # What it describes is the wrapped environment's (its types and name), not this
    # class's: called on an instance, as the server and ``envport check`` do.
    def metadata(self) -> EnvMetadata:  # type: ignore[override]
        return self.env.metadata()

    def schemas(self) -> dict[str, Any]:  # type: ignore[override]
        return self.env.schemas()

    def tools(self) -> dict[str, BoundTool]:
        return self.env.tools()

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        return await self.env.call_tool(name, arguments)


class TimeLimit(Wrapper[ActT, ObsT]):
    """Truncates an episode after ``max_steps`` steps."""

    def __init__(self, env: Env[ActT, ObsT], max_steps: int) -> None:
        super().__init__(env)
        self.max_steps = max_steps

    async def step(self, action: ActT | AnyAction | dict[str, Any]) -> StepResult[Any]:
        result = await self.env.step(action)
        state = await self.env.state()
        if state.step_count >= self.max_steps and not result.terminated:
            result = result.model_copy(update={"truncated": True})
        return result
