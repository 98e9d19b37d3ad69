"""EnvClient over every transport, its sync facade, and both clients against both servers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Literal

import pytest
from openenv.core.generic_client import GenericEnvClient

from envport.client import EnvClient
from envport.errors import ActionValidationError, EnvNotResetError, RemoteError, ToolError
from envport.server import ServerConfig
from tests.support.faulty_envs import FaultyEnv
from tests.support.servers import run_env_server

Transport = Literal["ws", "http", "inprocess"]


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    with run_env_server("echo-v1", mcp=False) as (url, _):
        yield url


def make_client(kind: Transport, url: str) -> EnvClient:
    if kind == "inprocess":
        return EnvClient.connect("echo-v1")
    return EnvClient.connect(url, transport=kind)


@pytest.mark.parametrize("kind", ["ws", "http", "inprocess"])
async def test_same_episode_on_every_transport(kind: Transport, echo_url: str) -> None:
    async with make_client(kind, echo_url) as env:
        first = await env.reset(seed=5)
        assert first.observation["echoed_message"] == "Echo environment ready!"
        rewards = []
        for msg in ["a", "abcd", "x" * 20]:
            result = await env.step({"message": msg})
            assert result.observation["echoed_message"] == msg
            rewards.append(result.reward)
        assert rewards == pytest.approx([0.1, 0.4, 1.0])
        state = await env.state()
        assert state["step_count"] == 3
        tools = await env.list_tools()
        assert [t["name"] for t in tools] == ["echo", "reverse"]
        assert await env.call_tool("reverse", {"message": "envport"}) == "tropvne"
        with pytest.raises(ToolError) as tool_err:
            await env.call_tool("missing")
        assert tool_err.value.kind == "tool_not_found"
        with pytest.raises(ActionValidationError) as bad:
            await env.step({"msg": "typo"})
        assert "message" in str(bad.value)
        assert (await env.state())["step_count"] == 6  # tool actions are steps too


@pytest.mark.parametrize("kind", ["ws", "http", "inprocess"])
async def test_errors_map_to_the_exception_tree(kind: Transport, echo_url: str) -> None:
    async with make_client(kind, echo_url) as env:
        with pytest.raises(EnvNotResetError):
            await env.step({"message": "too early"})


def test_sync_facade(echo_url: str) -> None:
    with EnvClient.connect(echo_url).sync() as env:
        env.reset(seed=1)
        result = env.step({"message": "sync"})
        assert result.observation["echoed_message"] == "sync"
        assert env.state()["step_count"] == 1
        assert env.call_tool("echo", {"message": "m"}) == "m"


async def test_openenv_client_against_envport_server(echo_url: str) -> None:
    async with GenericEnvClient(base_url=echo_url) as env:
        result = await env.reset(seed=2)
        assert result.observation["echoed_message"] == "Echo environment ready!"
        for i in range(1, 6):
            result = await env.step({"message": "z" * i})
            assert result.observation["message_length"] == i
            assert result.done is False
        state = await env.state()
        assert state["step_count"] == 5
        tools = await env.step({"type": "list_tools"})
        assert {t["name"] for t in tools.observation["tools"]} == {"echo", "reverse"}
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            await env.step({"wrong": 1})


def test_openenv_sync_client_against_envport_server(echo_url: str) -> None:
    with GenericEnvClient(base_url=echo_url).sync() as env:
        env.reset()
        assert env.step({"message": "hi"}).reward == pytest.approx(0.2)
        assert env.state()["step_count"] == 1


async def test_envport_client_against_openenv_server(openenv_echo_url: str) -> None:
    async with EnvClient.connect(openenv_echo_url) as env:
        assert env.transport.extended is False  # type: ignore[attr-defined]
        result = await env.reset(seed=3)
        assert result.observation["echoed_message"] == "Echo environment ready!"
        for msg in ["one", "three"]:
            result = await env.step({"message": msg})
            assert result.observation["echoed_message"] == msg
        assert (await env.state())["step_count"] == 2
        with pytest.raises(ActionValidationError, match="Invalid message"):
            await env.step({"wrong": 1})  # OpenEnv's error frame, mapped to our tree
        assert (await env.step({"message": "still"})).observation["echoed_message"] == "still"


async def test_resume_after_dropped_connection(echo_url: str) -> None:
    async with EnvClient.connect(echo_url) as env:
        await env.reset()
        await env.step({"message": "before"})
        await env.transport.drop_connection()  # type: ignore[attr-defined]
        result = await env.step({"message": "after"})
        assert result.observation["echoed_message"] == "after"
        assert (await env.state())["step_count"] == 2


async def test_late_reply_is_never_taken_for_the_next() -> None:
    with run_env_server(FaultyEnv, ServerConfig(call_timeout_s=10), mcp=False) as (url, _):
        async with EnvClient.connect(url, timeout_s=0.3) as env:
            await env.reset()
            with pytest.raises(RemoteError) as timeout:
                await env.step({"message": "sleep:1.0"})
            assert timeout.value.code == "TIMEOUT"
            env.transport.timeout_s = 5  # type: ignore[attr-defined]
            # The late observation for "sleep:1.0" arrives first and must be skipped.
            state = await env.state()
            assert state["step_count"] == 1
            result = await env.step({"message": "next"})
            assert result.observation["echoed_message"] == "next"


async def test_many_concurrent_clients(echo_url: str) -> None:
    async def episode(i: int) -> int:
        async with EnvClient.connect(echo_url) as env:
            await env.reset(seed=i)
            for _ in range(i % 5 + 1):
                await env.step({"message": str(i)})
            return int((await env.state())["step_count"])

    counts = await asyncio.gather(*(episode(i) for i in range(50)))
    assert counts == [i % 5 + 1 for i in range(50)]
