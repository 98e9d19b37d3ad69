"""The OpenEnv reference server (tests/support/openenv_echo_server.py) really works.

It is started as a subprocess on an ephemeral port and driven with OpenEnv's own
``GenericEnvClient``, so the fixture other tests and the benchmark rely on is
proven against OpenEnv's client, not ours.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import websockets
from openenv.core.generic_client import GenericEnvClient

from tests.support.processes import openenv_echo_argv, server_process

SERVER_SCRIPT = Path(__file__).parent / "support" / "openenv_echo_server.py"
STARTUP_TIMEOUT_S = 45.0


@pytest.fixture(scope="module")
def openenv_server(openenv_echo_url: str) -> str:
    return openenv_echo_url  # tests/conftest.py starts it (tests/support/processes.py)


def test_http_routes(openenv_server: str) -> None:
    with httpx.Client(base_url=openenv_server, timeout=5.0) as http:
        assert http.get("/health").json() == {"status": "healthy"}
        schema = http.get("/schema").json()
        assert set(schema) == {"action", "observation", "state"}
        assert schema["action"]["required"] == ["message"]
        assert {"echoed_message", "message_length"} <= set(schema["observation"]["properties"])


async def test_generic_client_reset_step_state(openenv_server: str) -> None:
    async with GenericEnvClient(base_url=openenv_server) as env:
        result = await env.reset()
        assert result.observation["echoed_message"] == "Echo environment ready!"
        assert result.done is False

        result = await env.step({"message": "hello"})
        assert result.observation == {"echoed_message": "hello", "message_length": 5}
        assert result.reward == pytest.approx(0.5)
        result = await env.step({"message": "a much longer message"})
        assert result.reward == pytest.approx(1.0)

        state = await env.state()
        assert state["step_count"] == 2
        assert state["episode_id"]


def test_generic_client_sync_facade(openenv_server: str) -> None:
    with GenericEnvClient(base_url=openenv_server).sync() as env:
        env.reset()
        assert env.step({"message": "sync"}).observation["echoed_message"] == "sync"
        assert env.state()["step_count"] == 1


async def test_tools_via_step(openenv_server: str) -> None:
    async with GenericEnvClient(base_url=openenv_server) as env:
        await env.reset()
        listed = await env.step({"type": "list_tools"})
        assert {t["name"] for t in listed.observation["tools"]} == {"echo", "reverse"}

        called = await env.step(
            {"type": "call_tool", "tool_name": "reverse", "arguments": {"message": "abc"}}
        )
        assert called.observation["error"] is None
        assert called.observation["result"]["data"] == "cba"


async def test_tools_via_mcp_jsonrpc(openenv_server: str) -> None:
    request = {
        "jsonrpc": "2.0",
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {"message": "x"}},
        "id": 7,
    }
    async with httpx.AsyncClient(base_url=openenv_server, timeout=5.0) as http:
        reply = (await http.post("/mcp", json=request)).json()
    assert reply["id"] == 7
    assert reply["result"]["data"] == "x"

    ws_url = openenv_server.replace("http://", "ws://") + "/ws"
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "mcp", "data": request}))
        frame = json.loads(await ws.recv())
    assert frame["type"] == "mcp"
    assert frame["data"]["result"]["data"] == "x"


async def test_many_concurrent_sessions(openenv_server: str) -> None:
    async def one(i: int) -> tuple[str, int]:
        async with GenericEnvClient(base_url=openenv_server) as env:
            await env.reset()
            for _ in range(3):
                result = await env.step({"message": f"s{i}"})
                assert result.observation["echoed_message"] == f"s{i}"
            state = await env.state()
            return state["episode_id"], state["step_count"]

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert len({episode for episode, _ in results}) == 16
    assert all(steps == 3 for _, steps in results)


async def test_capacity_reached_frame(tmp_path: Path) -> None:
    argv = [*openenv_echo_argv(), "--max-concurrent-envs", "1"]
    with server_process(argv, tmp_path / "server.log") as base:
        ws_url = base.replace("http://", "ws://") + "/ws"
        async with websockets.connect(ws_url) as first:
            await first.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(await first.recv())["type"] == "observation"
            async with websockets.connect(ws_url) as second:
                frame = json.loads(await second.recv())
                assert frame["type"] == "error"
                assert frame["data"]["code"] == "CAPACITY_REACHED"
                with pytest.raises(websockets.ConnectionClosedOK):
                    await second.recv()
                assert second.close_code == 1000
