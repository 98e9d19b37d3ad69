"""A flood of bare MCP ``initialize`` requests cannot lock real agents out of ``/mcp``.

The SDK caps live MCP sessions (``ServerConfig.mcp_max_sessions``); a session that only
sent ``initialize`` holds no envport session and lived ``idle_timeout_s``, so one client
looping on ``initialize`` filled the cap and every other MCP client got 503 "Too many
open sessions" until they expired. Here the cap is small, on a real server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from envport.server import ServerConfig
from tests.support.servers import run_env_server

CAP = 8
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "flood", "version": "1"},
    },
}
STREAMABLE = {"accept": "application/json, text/event-stream"}


async def flood(url: str, count: int, concurrency: int = CAP // 2) -> list[httpx.Response]:
    """``count`` bare ``initialize``s, ``concurrency`` at a time (fewer than the cap, so
    none is evicted while its own answer is on its way); their answers."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:

        async def one() -> httpx.Response:
            async with gate:
                return await http.post("/mcp", json=INITIALIZE, headers=STREAMABLE)

        return await asyncio.gather(*(one() for _ in range(count)))


@asynccontextmanager
async def agent(url: str) -> AsyncIterator[ClientSession]:
    """A real agent: the official SDK client, initialized."""
    async with (
        httpx2.AsyncClient() as http,
        streamable_http_client(f"{url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def test_an_initialize_flood_does_not_lock_out_agents() -> None:
    config = ServerConfig(mcp_max_sessions=CAP)
    with run_env_server("echo-v1", config) as (url, app):
        manager = app.state.manager
        flooded = await flood(url, 3 * CAP)  # three times the cap

        async with agent(url) as session:  # a new MCP session at the full cap
            result = await session.call_tool("echo", {"message": "hi"})
            assert result.content[0].text == "hi"  # type: ignore[union-attr]
            assert manager.active == 1

            # Every flooded initialize got a session too (evicting older ones), and
            # none of them took an envport session.
            assert [r.status_code for r in flooded] == [200] * (3 * CAP)
            assert len({r.headers["mcp-session-id"] for r in flooded}) == 3 * CAP

            # A session in use is never the one a flood evicts.
            await flood(url, 3 * CAP)
            result = await session.call_tool("reverse", {"message": "abc"})
            assert result.content[0].text == "cba"  # type: ignore[union-attr]
            (owned,) = manager.sessions.values()
            assert owned.env.step_count == 2  # the same environment throughout

        # The evicted sessions are gone: their IDs answer 404, as after an idle expiry.
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
            headers = {
                **STREAMABLE,
                "mcp-session-id": flooded[0].headers["mcp-session-id"],
                "mcp-protocol-version": "2025-06-18",
            }
            reply = await http.post("/mcp", json=ping, headers=headers)
            assert reply.status_code == 404


async def test_at_the_cap_with_every_session_in_use_a_new_one_is_refused() -> None:
    config = ServerConfig(mcp_max_sessions=2)
    with run_env_server("echo-v1", config) as (url, _app):
        async with agent(url) as one, agent(url) as two:
            await one.list_tools()
            await two.call_tool("echo", {"message": "x"})
            (refused,) = await flood(url, 1)
            assert refused.status_code == 503
            assert "Too many open sessions" in refused.text
            await one.call_tool("echo", {"message": "y"})  # both still work
            await two.call_tool("echo", {"message": "z"})
        # They ended (DELETE; the SDK forgets a session just after answering it): room
        # again.
        for _ in range(500):
            (admitted,) = await flood(url, 1)
            if admitted.status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert admitted.status_code == 200
