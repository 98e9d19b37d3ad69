"""`envport gateway` as a real process, driven by the official openai and anthropic SDKs."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from envport.policy import create_policy_app
from envport.serving import serve_in_thread
from envport.trace import SQLiteTraceStore, TraceStatus
from tests.support.processes import server_process

ORCHESTRATOR = "orchestrator-secret-for-tests"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("gateway")
    db = tmp / "traces.db"
    argv = [str(Path(sys.executable).parent / "envport"), "gateway", "--store", str(db),
            "--token-ids"]  # fmt: skip
    os.environ["ENVPORT_GATEWAY_TOKEN"] = ORCHESTRATOR
    try:
        with serve_in_thread(create_policy_app()) as upstream:
            argv += ["--upstream", upstream + "/v1"]
            with server_process(argv, tmp / "gateway.log") as url:
                yield url, db
    finally:
        os.environ.pop("ENVPORT_GATEWAY_TOKEN", None)


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ORCHESTRATOR}"})


TOOLS_ANTHROPIC: list[Any] = [
    {
        "name": "guess",
        "description": "Guess the number.",
        "input_schema": {
            "type": "object",
            "properties": {"number": {"type": "integer"}},
            "required": ["number"],
        },
    }
]


async def test_sdks_through_the_gateway_land_in_the_trace(gateway: tuple[str, Path]) -> None:
    url, db = gateway
    with admin(url) as http:
        grant = http.post("/admin/rollouts", json={}).json()
    claude = anthropic.AsyncAnthropic(base_url=grant["anthropic_base_url"], api_key=grant["token"])
    reply = await claude.messages.create(
        model="any",
        max_tokens=64,
        tools=TOOLS_ANTHROPIC,
        messages=[{"role": "user", "content": "I am thinking of an integer from 1 to 100."}],
    )
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "guess"
    assert use.input == {"number": 50}

    async with claude.messages.stream(
        model="any", max_tokens=32, messages=[{"role": "user", "content": "What is 2 + 3?"}]
    ) as stream:
        streamed = await stream.get_final_message()
    text = "".join(b.text for b in streamed.content if b.type == "text")
    assert text.strip().lstrip("-").isdigit()

    gpt = openai.AsyncOpenAI(base_url=grant["base_url"], api_key=grant["token"])
    chunks = await gpt.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "What is 4 + 4?"}], stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in chunks if c.choices]
    assert "".join(pieces).strip().lstrip("-").isdigit()
    await claude.close()
    await gpt.close()

    with admin(url) as http:
        done = http.post(f"/admin/rollouts/{grant['rollout_id']}/finish", json={"reward": 1.0})
        assert done.status_code == 200, done.text
    store = SQLiteTraceStore(db)
    try:
        (trace,) = store.query(rollout_id=grant["rollout_id"])
    finally:
        store.close()
    assert trace.status is TraceStatus.COMPLETED
    assert trace.reward == 1.0
    assert len(trace.model_calls) == 3
    assert [c.streamed for c in trace.model_calls] == [False, True, True]
    for call in trace.model_calls:
        choice = call.choices[0]
        assert call.prompt_token_ids
        assert choice.completion_token_ids
        assert choice.completion_logprobs is not None
        assert len(choice.completion_logprobs) == len(choice.completion_token_ids)
        assert call.original_request is not None  # --token-ids rewrote it; both kept
    assert trace.model_calls[1].ttft_s is not None


def test_agent_token_cannot_reach_admin_or_other_rollouts(gateway: tuple[str, Path]) -> None:
    url, _ = gateway
    with admin(url) as http:
        a = http.post("/admin/rollouts", json={}).json()
        b = http.post("/admin/rollouts", json={}).json()
    agent = {"Authorization": f"Bearer {a['token']}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=url) as http:
        assert http.post("/admin/pause", headers=agent).status_code == 403
        assert http.get(f"/admin/rollouts/{b['rollout_id']}", headers=agent).status_code == 403
        other = http.post(f"/rollouts/{b['rollout_id']}/v1/chat/completions", json=body,
                          headers=agent)  # fmt: skip
        assert other.status_code == 403
        assert other.json()["error"]["message"]
        assert http.post("/v1/chat/completions", json=body).status_code == 401


@pytest.mark.parametrize("bad", ["not-a-url", "ftp://host/v1", "http:///v1"])
def test_gateway_refuses_an_upstream_that_is_not_an_http_url(bad: str) -> None:
    from tests.support.cli import envport_cli

    result = envport_cli("gateway", "-u", "http://127.0.0.1:9/v1", "-u", bad, timeout=60)
    assert result.returncode == 2
    assert f"upstream {bad!r} is not an http(s) URL" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_upstream_pool_refuses_a_bad_base_url() -> None:
    from envport.gateway.upstream import UpstreamPool

    with pytest.raises(ValueError, match="not an http"):
        UpstreamPool(["localhost:8000/v1"])
