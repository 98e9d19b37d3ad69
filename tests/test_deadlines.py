"""A call that declares its own timeout_s may take that long, at every layer that puts a
deadline on one call: the session, the client transports, the controller's watchdog."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from envport.client import EnvClient
from envport.deadlines import GRACE_S, call_deadline, declared_timeout
from envport.errors import EnvTimeoutError, RemoteError
from envport.rollout import Controller, ControllerConfig, InProcessBackend, RolloutSpec
from envport.server import ServerConfig
from envport.session import Session
from envport.tasks import Task
from envport.trace import AsyncTraceStore, SQLiteTraceStore, Trace
from tests.support.faulty_envs import LongCommandEnv
from tests.support.servers import run_env_server

LONG = "tests.support.faulty_envs:LongCommandEnv"


def test_what_a_call_declares() -> None:
    assert declared_timeout({"command": "x", "timeout_s": 120}) == 120.0
    tool = {"type": "call_tool", "tool_name": "run", "arguments": {"timeout_s": 90.5}}
    assert declared_timeout(tool) == 90.5
    for nothing in ({}, {"timeout_s": True}, {"timeout_s": -1}, {"timeout_s": "9"}, None, 3):
        assert declared_timeout(nothing) is None
    assert declared_timeout({"timeout_s": float("inf")}) is None
    assert declared_timeout({"timeout_s": 1e12}) == 86_400.0
    assert call_deadline(30.0, {"timeout_s": 120}) == 120 + GRACE_S
    assert call_deadline(30.0, {"timeout_s": 5}) == 30.0  # never shorter than the base
    assert call_deadline(None, {"timeout_s": 5}) is None


async def test_the_session_gives_a_declared_call_its_time_and_others_its_own() -> None:
    session = Session(LongCommandEnv, call_timeout_s=0.3)
    await session.reset()
    result = await session.step({"command": "sleep:0.8", "timeout_s": 2})
    assert result.observation.echoed_message == "slept 0.8"
    with pytest.raises(EnvTimeoutError, match=r"within 0\.3 s"):
        await session.step({"command": "sleep:0.8"})  # nothing declared: the session's
    await session.close()


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_a_client_waits_for_a_declared_call(transport: str) -> None:
    with run_env_server(LONG, ServerConfig(call_timeout_s=0.3), mcp=False) as (url, _):
        # 0.8 s: under the 1 s steps, yet time enough for the reset on a loaded machine
        async with EnvClient.connect(url, transport=transport, timeout_s=0.8) as env:  # type: ignore[arg-type]
            await env.reset()
            result = await env.step({"command": "sleep:1.0", "timeout_s": 3})
            assert result.observation["echoed_message"] == "slept 1"
            with pytest.raises((RemoteError, EnvTimeoutError)):
                await env.step({"command": "sleep:1.0"})


async def test_a_websocket_mcp_tool_call_and_a_batch_declaring_timeouts_are_waited_for() -> None:
    from envport.client.transports import WebSocketTransport

    with run_env_server(LONG, ServerConfig(call_timeout_s=0.3), mcp=False) as (url, _):
        transport = WebSocketTransport(url, timeout_s=0.8)  # under the 1 s calls
        try:
            await transport.open()
            await transport.request({"type": "reset", "data": {}})
            call = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "run", "arguments": {"command": "sleep:1", "timeout_s": 3}},
            }
            reply = await transport.request({"type": "mcp", "data": call})
            assert reply["data"]["result"]["data"] == "slept 1"
            session_id = transport.session_id
            step = {"command": "sleep:1", "timeout_s": 3}
            batch = [{"session_id": session_id, "type": "step", "data": step}]
            replies = await transport.request({"type": "batch", "data": batch})
            assert replies["data"][0]["data"]["observation"]["echoed_message"] == "slept 1"
        finally:
            await transport.close()


class _LongCommandHarness:
    name = "long"

    def __init__(self, declare: bool) -> None:
        self.declare = declare

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        await env.reset()
        action: dict[str, Any] = {"command": "sleep:1.5"}
        if self.declare:
            action["timeout_s"] = 5
        await env.step(action)


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
async def test_the_hang_watchdog_waits_for_a_declared_call(tmp_path: Path, declare: bool) -> None:
    config = ControllerConfig(
        hang_timeout_s=0.4, health_interval_s=0.2, heartbeat_persist_s=0.1, max_attempts=1
    )
    task = Task(id="long", prompt="go", env_id=LONG)
    async with AsyncTraceStore(SQLiteTraceStore(tmp_path / "t.db")) as store:
        ctl = Controller(
            store, InProcessBackend(), _LongCommandHarness(declare), config, run_id="r"
        )
        summary = await asyncio.wait_for(ctl.run([RolloutSpec(task)]), 30)
        (trace,) = await store.query(run_id="r")
    if declare:
        assert summary.succeeded == 1, trace.errors
    else:
        assert summary.failed == 1
        assert "no heartbeat" in trace.errors[0].message
