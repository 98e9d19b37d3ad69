"""The environment contract, the registry and the public surface."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import envport
from envport import Action, Env, Observation, StepResult, TimeLimit, tool
from envport.errors import (
    ActionValidationError,
    EnvClosedError,
    EnvExecutionError,
    EnvNotResetError,
    UnknownEnvError,
)


def test_public_surface_is_pinned() -> None:
    assert sorted(envport.__all__) == sorted(
        [
            "Action", "Env", "EnvMetadata", "EnvStatus", "EnvportError", "ErrorCode",
            "Observation", "State", "StepResult", "TimeLimit", "ToolSpec", "Wrapper",
            "__version__", "make", "register", "registered", "tool",
        ]
    )  # fmt: skip
    for name in envport.__all__:
        assert hasattr(envport, name)


class Count(Action):
    by: int = 1


class Total(Observation):
    total: int


class SyncCounter(Env[Count, Total]):
    """A synchronous environment: plain def hooks."""

    action_type = Count
    observation_type = Total
    reward_range = (0.0, 1.0)

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.total = 0
        self.fail_at = fail_at
        self.threads: set[str] = set()

    def on_reset(self, seed: int | None, **options: Any) -> StepResult[Total]:
        self.total = self.rng.randint(0, 100)
        self.threads.add(threading.current_thread().name)
        return StepResult(observation=Total(total=self.total))

    def on_step(self, action: Count) -> StepResult[Total]:
        self.threads.add(threading.current_thread().name)
        if self.fail_at is not None and self.step_count >= self.fail_at:
            raise ValueError("counter overflow")
        self.total += action.by
        return StepResult(observation=Total(total=self.total), reward=0.5)

    @tool
    def add(self, amount: int, note: str = "") -> int:
        """Add to the total.

        Args:
            amount: How much to add.
            note: Free text.
        """
        self.total += amount
        self.threads.add(threading.current_thread().name)
        return self.total


async def test_sync_env_runs_on_its_own_thread() -> None:
    env = SyncCounter()
    first = await env.reset(seed=3)
    again = await SyncCounter().reset(seed=3)
    assert first.observation == again.observation
    await env.step({"by": 2})
    await env.step(Count(by=3))
    state = await env.state()
    assert state.step_count == 2
    assert state.episode_id
    assert env.threads
    assert threading.main_thread().name not in env.threads
    assert len(env.threads) == 1  # one worker thread per instance
    await env.close()
    await env.close()  # twice is safe
    with pytest.raises(EnvClosedError):
        await env.step({"by": 1})


async def test_lifecycle_errors_are_named() -> None:
    env = SyncCounter(fail_at=2)
    with pytest.raises(EnvNotResetError, match="reset"):
        await env.step({"by": 1})
    await env.reset()
    with pytest.raises(ActionValidationError) as bad:
        await env.step({"by": "many"})
    assert bad.value.details["errors"][0]["field"] == "by"
    await env.step({"by": 1})
    with pytest.raises(EnvExecutionError, match="counter overflow"):
        await env.step({"by": 1})
    await env.close()


async def test_tools_from_type_hints_and_docstrings() -> None:
    env = SyncCounter()
    (spec,) = env.tool_specs()
    assert spec.name == "add"
    assert spec.description == "Add to the total."
    props = spec.input_schema["properties"]
    assert props["amount"] == {
        "description": "How much to add.",
        "title": "Amount",
        "type": "integer",
    }
    assert spec.input_schema["required"] == ["amount"]
    await env.reset(seed=0)
    start = env.total
    assert await env.call_tool("add", {"amount": 5}) == start + 5
    result = await env.step({"type": "call_tool", "tool_name": "add", "arguments": {"amount": "x"}})
    assert result.observation.error is not None
    assert result.observation.error.error_type == "invalid_args"


async def test_a_sync_environment_s_hooks_and_tools_share_its_one_thread() -> None:
    env = SyncCounter()
    await env.reset()
    await env.step({"by": 1})
    await env.call_tool("add", {"amount": 2})
    await env.step({"type": "call_tool", "tool_name": "add", "arguments": {"amount": 3}})
    assert len(env.threads) == 1  # on_reset, on_step and the tool: the same worker
    assert next(iter(env.threads)).startswith("envport-SyncCounter")
    await env.close()


async def test_time_limit_truncates() -> None:
    env = TimeLimit(SyncCounter(), max_steps=2)
    await env.reset()
    assert not (await env.step({"by": 1})).truncated
    assert (await env.step({"by": 1})).truncated


async def test_a_wrapped_environment_describes_what_it_wraps() -> None:
    """/schema and /metadata of a served TimeLimit(...) are the wrapped environment's."""
    import httpx

    from tests.support.servers import run_env_server

    wrapped = TimeLimit(SyncCounter(), max_steps=2)
    assert wrapped.schemas() == SyncCounter.schemas()
    assert wrapped.metadata().name == "SyncCounter"
    with run_env_server(lambda: TimeLimit(SyncCounter(), max_steps=2), mcp=False) as (url, _):
        async with httpx.AsyncClient(base_url=url) as http:
            schema = (await http.get("/schema")).json()
            assert schema["action"] == SyncCounter.action_type.model_json_schema()
            assert (await http.get("/metadata")).json()["name"] == "SyncCounter"


class Undocumented(Env[Count, Total]):
    action_type = Count
    observation_type = Total


class Documented(Env[Count, Total]):
    """Counts.

    More about counting.
    """

    action_type = Count
    observation_type = Total


async def test_an_env_without_a_docstring_is_not_described_by_env_s() -> None:
    """Its own docstring or nothing: it was described by Env's ("Base class of every ...")
    in /metadata, OpenAPI's info.description and ``envport envs``."""
    import httpx

    from envport.cli import _describe
    from envport.registry import EnvSpec
    from tests.support.servers import run_env_server

    meta = Undocumented.metadata()
    assert (meta.description, meta.readme_content) == ("", None)
    assert _describe(EnvSpec("undocumented-v1", Undocumented))[0] == ""
    with run_env_server(Undocumented, mcp=False) as (url, _):
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/metadata")).json()["description"] == ""
            info = (await http.get("/openapi.json")).json()["info"]
            assert "Base class" not in info["description"]
    documented = Documented.metadata()
    assert documented.description == "Counts."
    assert documented.readme_content == "Counts.\n\nMore about counting."


def test_registry_versions_paths_and_suggestions() -> None:
    envport.register("counter-v1", SyncCounter)
    envport.register("counter-v2", SyncCounter, fail_at=5)
    assert isinstance(envport.make("counter"), SyncCounter)
    assert envport.make("counter").fail_at == 5  # type: ignore[attr-defined]
    assert envport.make("counter-v1").fail_at is None  # type: ignore[attr-defined]
    assert isinstance(envport.make("tests.test_env:SyncCounter"), SyncCounter)
    with pytest.raises(UnknownEnvError) as unknown:
        envport.make("countr-v1")
    assert unknown.value.suggestion == "counter-v1"
    assert "echo-v1" in str(unknown.value)
    with pytest.raises(UnknownEnvError, match=r"module 'tests\.test_env' has no attribute 'Nope'"):
        envport.make("tests.test_env:Nope")
    with pytest.raises(UnknownEnvError, match=r"could not import module 'tests\.nowhere' \(Modu"):
        envport.make("tests.nowhere:Env")
    assert {"echo-v1", "arithmetic-v1", "sql-db-v1"} <= set(envport.registered())


async def test_a_refused_reset_leaves_the_episode_as_it_was() -> None:
    env = envport.make("guess-number-v1")
    await env.reset(seed=1, max_steps=3)
    await env.step({"guess": 5})
    before = await env.state()
    with pytest.raises(ActionValidationError, match="bogus"):
        await env.reset(seed=2, bogus=1)
    with pytest.raises(ActionValidationError, match="max_steps"):  # high is fine, max_steps not
        await env.reset(seed=2, high=5, max_steps=0)
    after = await env.state()
    assert after.episode_id == before.episode_id  # not a new episode id on the old game
    assert after.step_count == before.step_count == 1
    assert after.model_dump() == before.model_dump()  # the range too: nothing changed
    assert (await env.step({"guess": 6})).observation is not None  # the same game goes on
    assert (await env.state()).step_count == 2
    await env.close()


class BreaksOnReset(Env[Action, Observation]):
    """Resets fine once, then crashes midway through the next reset."""

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[Observation]:
        if options.get("crash"):
            raise RuntimeError("lost the database halfway through")
        return StepResult(observation=Observation())

    async def on_step(self, action: Action) -> StepResult[Observation]:
        return StepResult(observation=Observation(), reward=1.0)

    @tool
    def ping(self) -> str:
        """Answer pong."""
        return "pong"


async def test_a_reset_that_crashes_asks_for_another_before_any_step() -> None:
    env = BreaksOnReset()
    await env.reset()
    await env.step({})
    episode = env.episode_id
    with pytest.raises(EnvExecutionError, match="halfway"):
        await env.reset(crash=True)
    assert env.episode_id == episode
    with pytest.raises(EnvNotResetError, match=r"last reset\(\) failed .*halfway"):
        await env.step({})
    with pytest.raises(EnvNotResetError, match=r"last reset\(\) failed"):  # tools too
        await env.step({"type": "call_tool", "tool_name": "ping", "arguments": {}})
    with pytest.raises(EnvNotResetError, match=r"last reset\(\) failed"):
        await env.call_tool("ping")
    await env.reset()
    assert (await env.step({})).reward == 1.0
    await env.close()


async def test_tool_actions_are_answered_before_the_first_reset() -> None:
    env = BreaksOnReset()
    listed = await env.step({"type": "list_tools"})
    assert [t.name for t in listed.observation.tools] == ["ping"]  # type: ignore[attr-defined]
    called = await env.step({"type": "call_tool", "tool_name": "ping", "arguments": {}})
    assert called.observation.result.data == "pong"  # type: ignore[attr-defined]
    with pytest.raises(EnvNotResetError):  # any other action still needs a reset
        await env.step({})
    await env.close()
    with pytest.raises(EnvClosedError):
        await env.step({"type": "list_tools"})
