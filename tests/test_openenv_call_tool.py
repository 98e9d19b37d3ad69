"""``call_tool`` step results in OpenEnv's shape, read by OpenEnv's own client code.

OpenEnv (0.3.0) answers a ``call_tool`` step with ``observation.result`` set to an MCP
``CallToolResult`` (FastMCP's, dumped with snake_case keys): ``content`` (text blocks),
``structured_content``, ``meta``, ``data`` (the plain value) and ``is_error``; a failed
call has ``result: null`` and ``error: {error_type, message}``. OpenEnv's
``MCPToolClient.call_tool`` returns ``result["data"]``. envport's server is driven here
over real sockets by OpenEnv's ``MCPToolClient`` (WebSocket steps) and with plain HTTP
``/step`` parsed by that client's own ``_parse_result``, and its frames are compared
with those of OpenEnv's own server (tests/support/openenv_echo_server.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mcp.types import TextContent
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.generic_client import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient

from envport import Action, Env, Observation, StepResult, tool
from envport.client import EnvClient
from envport.errors import ToolError
from envport.types import CallToolObservation as EnvportCallToolObservation
from envport.types import CallToolResult, tool_result_value
from tests.support.servers import run_env_server

#: A dict that has a ``data`` key of its own: OpenEnv's client must not mistake it for
#: the result's ``data`` field.
WITH_DATA = {"data": [1, 2], "note": "mine"}

#: tool name -> (its plain value, the text block OpenEnv's client reads)
RESULTS: dict[str, tuple[Any, str]] = {
    "with_data": (WITH_DATA, '{"data": [1, 2], "note": "mine"}'),
    "text": ("héllo", "héllo"),
    "items": ([1, "two", None], '[1, "two", null]'),
    "nothing": (None, "null"),
}


class Say(Action):
    message: str = ""


class Kinds(Env[Say, Observation]):
    """One tool per kind of result a tool can return, and one that fails."""

    action_type = Say

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[Observation]:
        return StepResult(observation=Observation())

    async def on_step(self, action: Say) -> StepResult[Observation]:
        return StepResult(observation=Observation(), reward=0.0)

    @tool
    async def with_data(self) -> dict[str, Any]:
        """A dict with a key named data."""
        return dict(WITH_DATA)

    @tool
    async def text(self) -> str:
        """A string."""
        return "héllo"

    @tool
    async def items(self) -> list[Any]:
        """A list."""
        return [1, "two", None]

    @tool
    async def nothing(self) -> None:
        """No value."""

    @tool
    async def fails(self) -> str:
        """Raises."""
        raise ValueError("boom")


@pytest.fixture(scope="module")
def kinds_url() -> Iterator[str]:
    with run_env_server(Kinds, mcp=False) as (url, _):
        yield url


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    with run_env_server("echo-v1", mcp=False) as (url, _):
        yield url


def check_call_tool_result(result: Any, value: Any, text: str) -> None:
    """``result`` is a ``CallToolResult`` in OpenEnv's wire form carrying ``value``."""
    assert isinstance(result, dict)
    assert set(result) == {"content", "structured_content", "meta", "data", "is_error"}
    (block,) = result["content"]
    assert TextContent.model_validate(block) == TextContent(type="text", text=text)
    assert set(block) == {"type", "text", "annotations", "meta"}
    expected = value if isinstance(value, dict) else {"result": value}
    assert result["structured_content"] == expected
    assert result["data"] == value
    assert result["is_error"] is False


# --- OpenEnv's MCPToolClient over the WebSocket ------------------------------------------


async def test_openenv_tool_client_reads_every_kind_of_result(kinds_url: str) -> None:
    async with MCPToolClient(base_url=kinds_url) as env:
        await env.reset()
        assert {t.name for t in await env.list_tools()} == {*RESULTS, "fails"}
        for name, (value, _) in RESULTS.items():
            assert await env.call_tool(name) == value, name
        with pytest.raises(RuntimeError, match=r"boom.*\(type: execution_error\)"):
            await env.call_tool("fails")
        with pytest.raises(RuntimeError, match=r"\(type: tool_not_found\)"):
            await env.call_tool("missing")


async def test_openenv_tool_client_works_before_any_reset(kinds_url: str) -> None:
    """OpenEnv documents ``list_tools()``/``call_tool()`` straight after connecting, and
    its MCP environments answer them unreset (as envport's ``/mcp`` does)."""
    async with MCPToolClient(base_url=kinds_url) as env:
        assert {t.name for t in await env.list_tools()} == {*RESULTS, "fails"}
        assert await env.call_tool("text") == "héllo"


async def test_openenv_step_observation_is_a_call_tool_result(kinds_url: str) -> None:
    async with MCPToolClient(base_url=kinds_url) as env:
        await env.reset()
        for name, (value, text) in RESULTS.items():
            step = await env.step(CallToolAction(tool_name=name, arguments={}))
            obs = step.observation
            assert isinstance(obs, CallToolObservation)
            assert obs.tool_name == name
            assert obs.error is None
            check_call_tool_result(obs.result, value, text)
        failed = (await env.step(CallToolAction(tool_name="fails", arguments={}))).observation
        assert isinstance(failed, CallToolObservation)
        assert failed.result is None
        assert failed.error is not None
        assert failed.error.error_type.value == "execution_error"
        assert "boom" in failed.error.message


# --- HTTP /step, parsed by OpenEnv's client code -------------------------------------------


async def test_http_step_replies_parse_as_openenv_call_tool_observations(kinds_url: str) -> None:
    parser = MCPToolClient(base_url=kinds_url)  # only its _parse_result; never connected
    async with httpx.AsyncClient(base_url=kinds_url, timeout=10.0) as http:
        for name, (value, text) in RESULTS.items():
            action = {"type": "call_tool", "tool_name": name, "arguments": {}}
            reply = await http.post("/step", json={"action": action})
            assert reply.status_code == 200
            obs = parser._parse_result(reply.json()).observation
            assert isinstance(obs, CallToolObservation)
            assert obs.error is None
            check_call_tool_result(obs.result, value, text)
        action = {"type": "call_tool", "tool_name": "fails", "arguments": {}}
        failed = (await http.post("/step", json={"action": action})).json()["observation"]
        assert failed["result"] is None
        assert failed["error"]["error_type"] == "execution_error"


# --- the same frames as OpenEnv's own server -----------------------------------------------


def _without_meta(observation: dict[str, Any]) -> dict[str, Any]:
    """The observation less ``result.meta`` (FastMCP's server info there is its own)."""
    result = dict(observation["result"])
    result.pop("meta")
    return {**observation, "result": result}


async def test_call_tool_observation_matches_openenv_servers(
    echo_url: str, openenv_echo_url: str
) -> None:
    action = {"type": "call_tool", "tool_name": "reverse", "arguments": {"message": "abc"}}
    observations = []
    for url in (echo_url, openenv_echo_url):
        async with GenericEnvClient(base_url=url) as env:
            await env.reset()
            observations.append((await env.step(action)).observation)
    ours, theirs = observations
    assert ours["result"]["meta"] is None
    assert _without_meta(ours) == _without_meta(theirs)
    assert ours == {
        "tool_name": "reverse",
        "result": {
            "content": [{"type": "text", "text": "cba", "annotations": None, "meta": None}],
            "structured_content": {"result": "cba"},
            "meta": None,
            "data": "cba",
            "is_error": False,
        },
        "error": None,
    }

    replies = []
    for url in (echo_url, openenv_echo_url):
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as http:
            replies.append((await http.post("/step", json={"action": action})).json())
    assert _without_meta(replies[0]["observation"]) == _without_meta(replies[1]["observation"])

    unknown = {"type": "call_tool", "tool_name": "nope", "arguments": {}}
    failures = []
    for url in (echo_url, openenv_echo_url):
        async with GenericEnvClient(base_url=url) as env:
            await env.reset()
            failures.append((await env.step(unknown)).observation)
    assert [set(f) for f in failures] == [{"tool_name", "result", "error"}] * 2
    assert [f["result"] for f in failures] == [None, None]
    assert [f["error"]["error_type"] for f in failures] == ["tool_not_found"] * 2


# --- envport's own client still returns the plain value ------------------------------------


@pytest.mark.parametrize("kind", ["ws", "http", "inprocess"])
async def test_envport_client_returns_plain_values(kind: str, kinds_url: str) -> None:
    client = (
        EnvClient.connect(kinds_url, transport=kind)  # type: ignore[arg-type]
        if kind != "inprocess"
        else EnvClient.connect("tests.test_openenv_call_tool:Kinds")
    )
    async with client as env:
        await env.reset()
        for name, (value, _) in RESULTS.items():
            assert await env.call_tool(name) == value, name
        with pytest.raises(ToolError) as failed:
            await env.call_tool("fails")
        assert failed.value.kind == "execution_error"


async def test_envport_client_unwraps_openenv_servers_results(openenv_echo_url: str) -> None:
    async with EnvClient.connect(openenv_echo_url) as env:
        await env.reset()
        assert await env.call_tool("reverse", {"message": "abc"}) == "cba"
        with pytest.raises(ToolError) as missing:
            await env.call_tool("nope")
        assert missing.value.kind == "tool_not_found"


# --- in process, and reading a result --------------------------------------------------


async def test_in_process_observation_carries_a_call_tool_result() -> None:
    async with Kinds() as env:
        await env.reset()
        for name, (value, text) in RESULTS.items():
            step = await env.step({"type": "call_tool", "tool_name": name, "arguments": {}})
            obs = step.observation
            assert isinstance(obs, EnvportCallToolObservation)
            assert isinstance(obs.result, CallToolResult)
            assert obs.result.data == value
            check_call_tool_result(step.to_wire()["observation"]["result"], value, text)
        failed = (await env.step({"type": "call_tool", "tool_name": "fails"})).observation
        assert failed.result is None
        assert failed.error is not None


def test_tool_result_value_reads_each_form() -> None:
    for value, _ in RESULTS.values():
        wire = CallToolResult.of(value).model_dump(mode="json")
        assert tool_result_value(wire) == value
    # A bare value (an envport server from before results were CallToolResults).
    assert tool_result_value("cba") == "cba"
    assert tool_result_value(WITH_DATA) == WITH_DATA
    assert tool_result_value(None) is None
    # A plain OpenEnv server's FastMCP tool without an output schema: text only.
    text_only = {
        "content": [{"type": "text", "text": "cba", "annotations": None, "meta": None}],
        "structured_content": None,
        "meta": None,
        "data": None,
        "is_error": False,
    }
    assert tool_result_value(text_only) == "cba"
    assert tool_result_value({**text_only, "content": []}) is None


def test_a_tool_result_text_block_is_valid_json_with_non_finite_floats_as_null() -> None:
    """Python's json writes NaN/Infinity, which no other JSON parser reads; the text
    block says null there, as structuredContent does once serialised."""
    from envport.types import tool_text

    text = tool_text({"loss": float("nan"), "bounds": [float("-inf"), 1.5], "ok": True})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}")) == {
        "loss": None,
        "bounds": [None, 1.5],
        "ok": True,
    }
    assert tool_text([1, 2]) == "[1, 2]"
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular"):
        tool_text(loop)
