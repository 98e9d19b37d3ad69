"""The scripted policy server, driven by the official ``openai`` SDK over a real socket."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from envport.envs.guess import GuessNumberEnv
from envport.envs.sqldb import SqlDbEnv
from envport.policy import ByteTokenizer, SamplingParams, ScriptedPolicy, create_policy_app
from envport.policy.tokenizer import (
    IM_END,
    ParsedToolCall,
    parse_assistant,
    render_assistant,
)
from tests.support.processes import server_process
from tests.support.servers import run_asgi

TOK = ByteTokenizer()
GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the number.",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer"}},
            "required": ["number"],
        },
    },
}
GUESS_PROMPT = "I am thinking of an integer from 1 to 100. Find it."


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    app = create_policy_app(ScriptedPolicy(seed=0), faults=True)
    with run_asgi(app) as url:
        yield url, app


@pytest.fixture
def url(served: tuple[str, Any]) -> str:
    return served[0]


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def ask(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model="anything", messages=messages, **kwargs)


def extra(obj: Any, name: str) -> Any:
    """A vLLM field the SDK's models do not declare (kept as a pydantic extra)."""
    return (obj.model_extra or {})[name]


def echo_back(message: Any) -> dict[str, Any]:
    """The assistant message as a client sends it back: text and tool calls only."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls
        ]
    return out


# --- the basics ---------------------------------------------------------------------------


def test_models_and_health(client: openai.OpenAI, url: str) -> None:
    assert [m.id for m in client.models.list()] == ["envport-scripted"]
    assert httpx.get(f"{url}/health").json() == {"status": "healthy", "model": "envport-scripted"}


def test_arithmetic_answer_carries_ids_and_logprobs(client: openai.OpenAI) -> None:
    resp = ask(client, "What is 12 + 7?", logprobs=True, temperature=0)
    choice = resp.choices[0]
    assert resp.model == "envport-scripted"
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls in (None, [])
    assert int(choice.message.content) in range(16, 23)
    ids = extra(choice, "token_ids")
    assert ids[-1] == TOK.encode(IM_END)[0]
    assert TOK.decode(ids) == choice.message.content + IM_END
    assert TOK.decode(ids, skip_special_tokens=True) == choice.message.content
    assert len(choice.logprobs.content) == len(ids)
    assert all(-10 < lp.logprob < 0 for lp in choice.logprobs.content)
    assert [bytes(lp.bytes) for lp in choice.logprobs.content] == [TOK.token_bytes(i) for i in ids]
    prompt_ids = extra(resp, "prompt_token_ids")
    template = TOK.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}])
    assert TOK.decode(prompt_ids) == template
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(ids)


def test_tool_call_in_openai_shape(client: openai.OpenAI) -> None:
    resp = ask(client, GUESS_PROMPT, tools=[GUESS_TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name == "guess"
    assert json.loads(call.function.arguments) == {"number": 50}
    ids = extra(choice, "token_ids")
    rendered = render_assistant(None, [ParsedToolCall("guess", call.function.arguments)])
    assert TOK.decode(ids) == rendered + IM_END
    assert parse_assistant(TOK.decode(ids[:-1])) == (
        None,
        [ParsedToolCall("guess", call.function.arguments)],
    )


def test_top_logprobs(client: openai.OpenAI) -> None:
    resp = ask(client, "What is 3 * 4?", logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == len(extra(resp.choices[0], "token_ids"))
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert entry.token in [t.token for t in tops]
        assert sum(2.718281828**t.logprob for t in tops) <= 1.0 + 1e-6


def test_token_ids_can_be_declined(client: openai.OpenAI) -> None:
    resp = ask(client, "hello", extra_body={"return_token_ids": False})
    assert "prompt_token_ids" not in (resp.model_extra or {})
    assert "token_ids" not in (resp.choices[0].model_extra or {})
    assert resp.choices[0].logprobs is None


def test_n_choices(client: openai.OpenAI) -> None:
    resp = ask(client, "What is 40 + 2?", n=2, logprobs=True)
    assert [c.index for c in resp.choices] == [0, 1]
    for c in resp.choices:
        assert TOK.decode(extra(c, "token_ids"), skip_special_tokens=True) == c.message.content
        assert len(c.logprobs.content) == len(extra(c, "token_ids"))
    total = sum(len(extra(c, "token_ids")) for c in resp.choices)
    assert resp.usage.completion_tokens == total
    greedy = ask(client, "What is 40 + 2?", n=3, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1


def test_n_choices_differ_when_sampling(client: openai.OpenAI) -> None:
    answers = [
        tuple(c.message.content for c in ask(client, f"What is {a} + 1?", n=4).choices)
        for a in range(20)
    ]
    assert any(len(set(a)) > 1 for a in answers)


def test_max_tokens_and_stop(client: openai.OpenAI) -> None:
    resp = ask(client, "a long sentence to echo", max_tokens=3)
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert extra(choice, "token_ids") == TOK.encode("a l")
    assert choice.message.content == "a l"
    stopped = ask(client, "a long sentence to echo", stop=["sentence"])
    assert stopped.choices[0].message.content == "a long "
    assert stopped.choices[0].finish_reason == "stop"
    assert extra(stopped.choices[0], "stop_reason") == "sentence"


def test_a_stop_string_keeps_its_tokens_but_cuts_the_text(client: openai.OpenAI) -> None:
    # vLLM: the engine generated the stop string's tokens, so they are in token_ids (and
    # logprobs, and usage); only the text ends before it.
    resp = ask(client, "say hello world", stop=["world"], logprobs=True)
    choice = resp.choices[0]
    assert choice.message.content == "say hello "
    assert extra(choice, "stop_reason") == "world"
    assert extra(choice, "token_ids") == TOK.encode("say hello world")
    assert len(choice.logprobs.content) == len(TOK.encode("say hello world"))
    assert resp.usage.completion_tokens == len(TOK.encode("say hello world"))
    streamed = reassemble(ask(client, "say hello world", stop=["world"], stream=True))
    assert streamed["content"] == "say hello "
    assert streamed["ids"] == TOK.encode("say hello world")
    kept = ask(
        client, "say hello world", stop=["world"], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == "say hello world"
    assert extra(kept.choices[0], "token_ids") == TOK.encode("say hello world")
    # the stop string completed first wins, as when an engine checks after each token
    first = ask(client, "say hello world", stop=["lo w", "ll"]).choices[0]
    assert (first.message.content, extra(first, "stop_reason")) == ("say he", "ll")
    assert extra(first, "token_ids") == TOK.encode("say hell")
    cmpl = client.completions.create(model="m", prompt="What is 2+2?", stop=[" "])
    assert cmpl.choices[0].text == ""
    assert extra(cmpl.choices[0], "token_ids") == TOK.encode(" ")
    cmpl = client.completions.create(model="m", prompt="Q\nsay hi there", stop=["there"])
    assert cmpl.choices[0].text == " say hi "
    assert extra(cmpl.choices[0], "token_ids") == TOK.encode(" say hi there")


# --- streaming ----------------------------------------------------------------------------


def reassemble(stream: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"content": "", "calls": {}, "ids": [], "logprobs": [], "usage": None}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        extras = chunk.model_extra or {}
        if "prompt_token_ids" in extras:
            out["prompt_ids"] = extras["prompt_token_ids"]
        for choice in chunk.choices:
            assert choice.index == 0
            out["ids"] += (choice.model_extra or {}).get("token_ids", [])
            if choice.logprobs is not None:
                out["logprobs"] += [e.logprob for e in choice.logprobs.content]
            out["content"] += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "args": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += tc.function.name or ""
                call["args"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                out["finish"] = choice.finish_reason
    return out


@pytest.mark.parametrize(
    ("prompt", "tools"),
    [
        ("What is 123 - 45?", None),
        ("héllo wörld ✓ 日本語 — echo me back, please", None),
        (GUESS_PROMPT, [GUESS_TOOL]),
    ],
)
def test_streaming_matches_non_streaming(
    client: openai.OpenAI, prompt: str, tools: list[dict[str, Any]] | None
) -> None:
    kwargs: dict[str, Any] = {"seed": 7, "logprobs": True}
    if tools:
        kwargs["tools"] = tools
    full = ask(client, prompt, **kwargs)
    streamed = reassemble(
        ask(client, prompt, stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    choice = full.choices[0]
    assert streamed["content"] == (choice.message.content or "")
    assert streamed["ids"] == extra(choice, "token_ids")
    assert streamed["logprobs"] == [e.logprob for e in choice.logprobs.content]
    assert streamed["prompt_ids"] == extra(full, "prompt_token_ids")
    assert streamed["finish"] == choice.finish_reason
    assert streamed["usage"].completion_tokens == full.usage.completion_tokens
    calls = [(c["id"], c["name"], c["args"]) for _, c in sorted(streamed["calls"].items())]
    expected = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls == expected


# --- the prefix property ------------------------------------------------------------------


def assert_prefix(turn1: Any, turn2: Any) -> None:
    prompt1, prompt2 = extra(turn1, "prompt_token_ids"), extra(turn2, "prompt_token_ids")
    completion1 = extra(turn1.choices[0], "token_ids")
    head = prompt1 + completion1
    assert prompt2[: len(head)] == head
    assert len(prompt2) > len(head)


def test_prefix_property_across_tool_turns(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Play the game."},
        {"role": "user", "content": GUESS_PROMPT},
    ]
    turn1 = client.chat.completions.create(model="m", messages=messages, tools=[GUESS_TOOL])
    call = turn1.choices[0].message.tool_calls[0]
    messages += [
        echo_back(turn1.choices[0].message),
        {"role": "tool", "tool_call_id": call.id, "content": '{"feedback": "lower"}'},
    ]
    turn2 = client.chat.completions.create(model="m", messages=messages, tools=[GUESS_TOOL])
    assert json.loads(turn2.choices[0].message.tool_calls[0].function.arguments) == {"number": 25}
    assert_prefix(turn1, turn2)


def test_prefix_property_across_text_turns(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Grüße — what is 6 * 7?"}]
    turn1 = client.chat.completions.create(model="m", messages=messages)
    messages += [
        echo_back(turn1.choices[0].message),
        {"role": "user", "content": [{"type": "text", "text": "And 1 + 1?"}]},
    ]
    turn2 = client.chat.completions.create(model="m", messages=messages)
    assert_prefix(turn1, turn2)


def test_template_prefix_property_with_content_and_parallel_calls() -> None:
    tools = [GUESS_TOOL]
    history: list[dict[str, Any]] = [{"role": "user", "content": "ünïcode and two calls"}]
    calls = [ParsedToolCall("guess", '{"number": 1}'), ParsedToolCall("guess", '{"number": 2}')]
    body = render_assistant("Let me try twice:\n", calls)
    assert parse_assistant(body) == ("Let me try twice:\n", calls)
    prompt1 = TOK.encode(TOK.apply_chat_template(history, tools))
    completion1 = [*TOK.encode(body), TOK.encode(IM_END)[0]]
    history += [
        {
            "role": "assistant",
            "content": "Let me try twice:\n",
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": c.name, "arguments": a}}
                for i, (c, a) in enumerate((c, c.arguments) for c in calls)
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "higher"},
        {"role": "tool", "tool_call_id": "c1", "content": "higher"},
    ]
    prompt2 = TOK.encode(TOK.apply_chat_template(history, tools))
    assert prompt2[: len(prompt1) + len(completion1)] == prompt1 + completion1
    assert TOK.decode(TOK.encode("a<|im_start|>b\u00e9")) == "a<|im_start|>b\u00e9"
    assert len(TOK.encode("<|im_end|>")) == 1


# --- the script -----------------------------------------------------------------------------


def test_arithmetic_correct_at_about_p_correct_and_reproducibly(client: openai.OpenAI) -> None:
    rng = random.Random(1234)
    questions = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(100)]

    def answers() -> list[int]:
        return [
            int(ask(client, f"What is {a} + {b}?").choices[0].message.content) for a, b in questions
        ]

    first = answers()
    assert first == answers()
    right = sum(ans == a + b for ans, (a, b) in zip(first, questions, strict=True))
    assert 65 <= right <= 95
    assert all(
        0 < abs(ans - (a + b)) <= 3
        for ans, (a, b) in zip(first, questions, strict=True)
        if ans != a + b
    )


async def test_p_correct_bounds_and_hard_questions() -> None:
    sampling = SamplingParams()
    always, never = ScriptedPolicy(p_correct=1.0), ScriptedPolicy(p_correct=0.0)
    question = [{"role": "user", "content": "What is (12 + 30) * 3 - 8 / 4? Reply with a number."}]
    assert (await always.generate(question, None, sampling)).text == "124"
    assert (await never.generate(question, None, sampling)).text != "124"
    with pytest.raises(ValueError, match="p_correct"):
        ScriptedPolicy(p_correct=1.5)


def openai_tools(env: Any) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": s.name,
                "description": s.description,
                "parameters": s.input_schema,
            },
        }
        for s in env.tool_specs()
    ]


async def run_agent(url: str, env: Any, prompt: str, max_turns: int = 12) -> tuple[list[str], str]:
    """A minimal tool loop; returns the tool names called and the final text."""
    tools = openai_tools(env)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    called: list[str] = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        for _ in range(max_turns):
            resp = await client.chat.completions.create(model="m", messages=messages, tools=tools)
            message = resp.choices[0].message
            messages.append(echo_back(message))
            if not message.tool_calls:
                return called, message.content or ""
            for call in message.tool_calls:
                called.append(call.function.name)
                result = await env.call_tool(
                    call.function.name, json.loads(call.function.arguments)
                )
                content = json.dumps(result)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    raise AssertionError(f"no final answer after {max_turns} turns: {called}")


async def test_binary_search_solves_the_real_guess_env(url: str) -> None:
    async with GuessNumberEnv(high=100, max_steps=7) as env:
        first = await env.reset(seed=3)
        called, text = await run_agent(url, env, first.observation.message)
        assert called == ["guess"] * len(called)
        assert 1 <= len(called) <= 7
        assert env.solved
        assert text == f"The number is {env.secret}."


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_scripted_sql_sequence_answers_the_real_sql_env(url: str, seed: int) -> None:
    env = SqlDbEnv()
    try:
        first = await env.reset(seed=seed)
        called, text = await run_agent(url, env, first.observation.question)
        assert called[0] == "list_tables"
        assert called[1 : 1 + len(env.tables)] == ["describe_table"] * len(env.tables)
        assert called[-2:] == ["run_query", "submit_answer"]
        assert text.startswith("Answer: ")
        assert env.correct is True
    finally:
        await env.close()


def test_other_prompts_are_echoed(client: openai.OpenAI) -> None:
    assert ask(client, "Tell me a story.").choices[0].message.content == "Tell me a story."


# --- /v1/completions ------------------------------------------------------------------------


def test_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="m", prompt="Q: What is 2 + 2?\nA:", logprobs=2, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text.strip() in {str(v) for v in range(1, 8)}
    assert TOK.decode(extra(choice, "token_ids"), skip_special_tokens=True) == choice.text
    assert TOK.decode(extra(choice, "prompt_token_ids")) == "Q: What is 2 + 2?\nA:"
    assert len(choice.logprobs.token_logprobs) == len(extra(choice, "token_ids"))
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    streamed = client.completions.create(
        model="m", prompt="Q: What is 2 + 2?\nA:", stream=True, temperature=0
    )
    text, ids = "", []
    for chunk in streamed:
        for c in chunk.choices:
            text += c.text
            ids += (c.model_extra or {}).get("token_ids", [])
    assert text == choice.text
    assert ids == extra(choice, "token_ids")
    by_ids = client.completions.create(model="m", prompt=TOK.encode("echo this"), n=2)
    assert [c.text for c in by_ids.choices] == [" echo this", " echo this"]


def test_streamed_completions_carry_logprobs_and_prompt_ids(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "prompt": "What is 12 * 3?", "logprobs": 2, "seed": 3}
    full = client.completions.create(**kwargs).choices[0]
    got: dict[str, list[Any]] = {"tokens": [], "lp": [], "top": [], "offsets": [], "ids": []}
    prompt_ids = []
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            assert c.logprobs is not None  # every chunk, the final one included
            got["tokens"] += c.logprobs.tokens
            got["lp"] += c.logprobs.token_logprobs
            got["top"] += c.logprobs.top_logprobs
            got["offsets"] += c.logprobs.text_offset
            got["ids"] += (c.model_extra or {})["token_ids"]
            prompt_ids.append((c.model_extra or {}).get("prompt_token_ids"))
    assert got["ids"] == extra(full, "token_ids")
    assert got["tokens"] == full.logprobs.tokens
    assert got["lp"] == full.logprobs.token_logprobs
    assert got["top"] == full.logprobs.top_logprobs
    assert got["offsets"] == full.logprobs.text_offset
    assert prompt_ids[0] == TOK.encode("What is 12 * 3?")
    assert all(p is None for p in prompt_ids[1:])


def test_streamed_empty_completions_still_carry_prompt_ids(url: str) -> None:
    # The answer starts with the stop string, so nothing is streamed but the final chunk;
    # each choice's first chunk must still carry its prompt_token_ids.
    body = {"prompt": "What is 2+2?", "stream": True, "stop": [" "], "n": 2, "logprobs": 0}
    lines = httpx.post(f"{url}/v1/completions", json=body).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    firsts: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            firsts.setdefault(c["index"], c)
            assert c["logprobs"] is not None
    assert sorted(firsts) == [0, 1]
    for c in firsts.values():
        assert c["prompt_token_ids"] == TOK.encode("What is 2+2?")
        assert c["text"] == ""


def test_batched_token_id_prompts_are_choice_groups(client: openai.OpenAI, url: str) -> None:
    # OpenAI and vLLM take a list of token-id lists: each prompt its own n choices.
    first, second = TOK.encode("echo one"), TOK.encode("What is 2 + 3?")
    resp = client.completions.create(model="m", prompt=[first, second], n=2, seed=1)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model="m", prompt=p, n=2, seed=1) for p in (first, second)]
    expected = [c for single in singles for c in single.choices]
    for got, want in zip(resp.choices, expected, strict=True):
        assert got.text == want.text
        assert extra(got, "token_ids") == extra(want, "token_ids")
        assert extra(got, "prompt_token_ids") == extra(want, "prompt_token_ids")
    assert resp.usage.prompt_tokens == len(first) + len(second)
    assert resp.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in resp.choices)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="m", prompt=[first, second], stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: singles[0].choices[0].text, 1: singles[1].choices[0].text}
    empty = httpx.post(f"{url}/v1/completions", json={"prompt": [[1, 2], []]})
    assert_openai_error(empty, 400, "prompt")
    oov = httpx.post(f"{url}/v1/completions", json={"prompt": [[1, 2], [99999]]})
    assert_openai_error(oov, 400, "prompt")


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="m", prompt="abc", max_tokens=2, seed=2)
    echoed = client.completions.create(model="m", prompt="abc", max_tokens=2, seed=2, echo=True)
    assert echoed.choices[0].text == "abc" + plain.choices[0].text == "abc a"
    assert extra(echoed.choices[0], "token_ids") == extra(plain.choices[0], "token_ids")
    by_ids = client.completions.create(model="m", prompt=TOK.encode("abc"), echo=True, max_tokens=2)
    assert by_ids.choices[0].text == "abc a"
    # with logprobs the prompt's tokens come first, the first without a logprob (vLLM)
    kwargs: dict[str, Any] = {"prompt": "abc", "max_tokens": 2, "seed": 2, "echo": True}
    lp = client.completions.create(model="m", logprobs=2, **kwargs).choices[0]
    assert lp.logprobs.tokens == ["a", "b", "c", " ", "a"]
    assert lp.logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.logprobs.token_logprobs[1:])
    assert lp.logprobs.top_logprobs[0] is None
    assert all(len(t) == 2 for t in lp.logprobs.top_logprobs[1:])
    assert lp.logprobs.text_offset == [0, 1, 2, 3, 4]
    text, tokens, lps, offsets = "", [], [], []
    for chunk in client.completions.create(model="m", logprobs=2, stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens
            lps += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert (text, tokens, lps, offsets) == (
        lp.text,
        lp.logprobs.tokens,
        lp.logprobs.token_logprobs,
        lp.logprobs.text_offset,
    )


def test_streamed_chat_role_chunks_as_vllm_sends_them(url: str) -> None:
    # vLLM opens a chat stream with one role chunk per choice, before any content: its
    # logprobs null, no token_ids, and the prompt's ids on each choice's chunk.
    body = {
        "messages": [{"role": "user", "content": "What is 6 + 1?"}],
        "n": 2,
        "stream": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    lines = httpx.post(f"{url}/v1/chat/completions", json=body).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    roles, rest = chunks[:2], chunks[2:]
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    prompt = TOK.encode(TOK.apply_chat_template(body["messages"]))
    for c in roles:
        choice = c["choices"][0]
        assert choice["delta"] == {"role": "assistant", "content": ""}
        assert choice["logprobs"] is None
        assert "token_ids" not in choice
        assert c["prompt_token_ids"] == prompt
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    assert all("prompt_token_ids" not in c for c in rest)


def test_completion_top_logprobs_as_vllm_reports_them(client: openai.OpenAI) -> None:
    # vLLM's legacy logprobs always carry one top_logprobs dict per token, the chosen
    # token first: with ``logprobs: 0`` that is ``{token: logprob}`` (not null), which is
    # what the gateway's request_token_ids policy asks for on /v1/completions.
    kwargs: dict[str, Any] = {"model": "m", "prompt": "What is 2 + 5?", "seed": 4}
    for top in (0, 2):
        full = client.completions.create(logprobs=top, **kwargs).choices[0].logprobs
        assert full.top_logprobs is not None
        assert len(full.top_logprobs) == len(full.tokens)
        for token, lp, alts in zip(
            full.tokens, full.token_logprobs, full.top_logprobs, strict=True
        ):
            assert next(iter(alts.items())) == (token, lp)  # the chosen token first
            assert len(alts) == (1 if top == 0 else 2)
        streamed = []
        for chunk in client.completions.create(logprobs=top, stream=True, **kwargs):
            for c in chunk.choices:
                streamed += c.logprobs.top_logprobs
        assert streamed == full.top_logprobs
    echoed = client.completions.create(logprobs=0, echo=True, **kwargs).choices[0].logprobs
    assert echoed.top_logprobs[0] is None
    rest = zip(echoed.tokens, echoed.token_logprobs, echoed.top_logprobs, strict=True)
    assert all(alts == {t: lp} for t, lp, alts in list(rest)[1:])


# --- errors ---------------------------------------------------------------------------------


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param


def test_cross_field_rules_vllm_refuses(url: str) -> None:
    # vLLM's request validators answer 400 to these; a stand-in that took them would hide
    # a client (or a gateway rewrite) sending them.
    chat, cmpl = f"{url}/v1/chat/completions", f"{url}/v1/completions"
    ask_ = {"messages": [{"role": "user", "content": "hi"}]}
    options = {"stream_options": {"include_usage": True}}
    assert_openai_error(httpx.post(chat, json={**ask_, **options}), 400, "stream_options")
    assert_openai_error(
        httpx.post(cmpl, json={"prompt": "hi", "stream": False, **options}), 400, "stream_options"
    )
    assert_openai_error(httpx.post(chat, json={**ask_, "top_logprobs": 2}), 400, "top_logprobs")
    # allowed by vLLM: an empty stream_options, top_logprobs 0, both with their switch on
    for body in (
        {**ask_, "stream_options": {}},
        {**ask_, "top_logprobs": 0},
        {**ask_, "top_logprobs": 2, "logprobs": True},
        {**ask_, "stream": True, **options},
    ):
        assert httpx.post(chat, json=body).status_code == 200, body


def test_bad_requests_get_openai_errors(url: str, client: openai.OpenAI) -> None:
    chat = f"{url}/v1/chat/completions"
    bad_json = httpx.post(
        chat, content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert_openai_error(bad_json, 400)
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    assert_openai_error(httpx.post(chat, json={"model": "m"}), 400, "messages")
    assert_openai_error(httpx.post(chat, json=[1, 2]), 400)
    assert_openai_error(httpx.post(chat, json={"messages": []}), 400, "messages")
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert_openai_error(httpx.post(chat, json=bad_role), 400, "messages.0.role")
    assert_openai_error(httpx.get(chat), 405)
    assert_openai_error(httpx.get(f"{url}/v1/nothing-here"), 404)
    assert_openai_error(httpx.post(f"{url}/v1/completions", json={"n": 1}), 400, "prompt")
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "hi", n=0)
    assert info.value.param == "n"
    assert info.value.type == "invalid_request_error"


def test_out_of_vocabulary_token_ids_are_a_client_error(url: str, client: openai.OpenAI) -> None:
    # vLLM answers 400 before generating; a 500 would make clients retry a request that
    # can never succeed.
    for prompt in ([1, 2, 99999], [-5], [TOK.vocab_size]):
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": prompt})
        assert_openai_error(resp, 400, "prompt")
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert "out of vocabulary" in resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=[1, 2, 99999])
    ok = client.completions.create(model="m", prompt=[TOK.vocab_size - 1, 104, 105])
    assert ok.choices[0].finish_reason == "stop"


def test_context_length_is_enforced() -> None:
    app = create_policy_app(ScriptedPolicy(max_model_len=32))
    with run_asgi(app) as url:
        resp = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 40}]}
        )
    assert_openai_error(resp, 400, "messages")
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_must_fit_the_context() -> None:
    # vLLM refuses prompt + max_tokens > max_model_len with a 400 (before: accepted silently).
    app = create_policy_app(ScriptedPolicy(max_model_len=64))
    messages = [{"role": "user", "content": "hi"}]
    n_prompt = len(TOK.encode(TOK.apply_chat_template(messages)))
    room = 64 - n_prompt
    with run_asgi(app) as url:
        chat = f"{url}/v1/chat/completions"
        over = httpx.post(chat, json={"messages": messages, "max_tokens": room + 1})
        assert_openai_error(over, 400, "max_tokens")
        assert over.json()["error"]["code"] == "context_length_exceeded"
        assert over.json()["error"]["message"] == (
            f"'max_tokens' or 'max_completion_tokens' is too large: {room + 1}. This model's "
            f"maximum context length is 64 tokens and your request has {n_prompt} input "
            f"tokens ({room + 1} > 64 - {n_prompt})."
        )
        huge = httpx.post(chat, json={"messages": messages, "max_completion_tokens": 10**9})
        assert_openai_error(huge, 400, "max_tokens")
        assert httpx.post(chat, json={"messages": messages, "max_tokens": room}).status_code == 200
        cmpl = f"{url}/v1/completions"
        over = httpx.post(cmpl, json={"prompt": [65] * 60, "max_tokens": 5})
        assert_openai_error(over, 400, "max_tokens")
        full = httpx.post(cmpl, json={"prompt": [65] * 64})
        assert_openai_error(full, 400, "prompt")  # no room for a single token
        assert "your request has 64 input tokens" in full.json()["error"]["message"]
        # without max_tokens the reply gets what the context has left, as in vLLM
        left = httpx.post(cmpl, json={"prompt": "say something long\n" + "y" * 40}).json()
        choice = left["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["prompt_token_ids"]) + len(choice["token_ids"]) == 64


# --- faults ---------------------------------------------------------------------------------


def fault(name: str) -> dict[str, Any]:
    return {"extra_headers": {"X-Envport-Fault": name}}


def test_fault_status(client: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.InternalServerError):
        ask(client, "hi", **fault("500"))
    with pytest.raises(openai.RateLimitError):
        ask(client, "hi", stream=True, **fault("429"))
    raw = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Envport-Fault": "503"},
    )
    assert_openai_error(raw, 503)
    assert raw.json()["error"]["type"] == "server_error"


def test_fault_garbage(client: openai.OpenAI) -> None:
    with pytest.raises(json.JSONDecodeError):
        ask(client, "hi", **fault("garbage"))
    with pytest.raises(json.JSONDecodeError):
        list(ask(client, "hi", stream=True, **fault("garbage")))


def test_fault_slow(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APITimeoutError):
        ask(client, "hi", timeout=0.3, **fault("slow:2"))
    assert ask(client, "hi", **fault("slow:0.05")).choices[0].message.content == "hi"


def test_fault_cut_stream(client: openai.OpenAI) -> None:
    seen: list[Any] = []
    with pytest.raises(openai.APIConnectionError):
        seen.extend(
            ask(client, "a reply long enough to need chunks", stream=True, **fault("cut-stream"))
        )
    assert not any(c.choices and c.choices[0].finish_reason for c in seen)
    with pytest.raises(openai.APIConnectionError):
        ask(client, "hi", **fault("cut-stream"))


def test_queued_faults_apply_to_the_next_requests(
    served: tuple[str, Any], client: openai.OpenAI
) -> None:
    _, app = served
    app.state.faults.push("502", times=2)
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as info:
            ask(client, "hi")
        assert info.value.status_code == 502
    assert ask(client, "hi").choices[0].message.content == "hi"


def test_unknown_fault_is_a_clear_error(url: str) -> None:
    resp = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Envport-Fault": "explode"},
    )
    assert_openai_error(resp, 400, "x-envport-fault")
    assert "slow:SECONDS" in resp.json()["error"]["message"]


def test_faults_are_ignored_unless_enabled() -> None:
    app = create_policy_app()
    with run_asgi(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
        assert ask(c, "hi", **fault("500")).choices[0].message.content == "hi"
        with pytest.raises(RuntimeError, match="faults=True"):
            app.state.faults.push("500")


# --- the command --------------------------------------------------------------------------


def test_module_runs_a_server(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "envport.policy.server", "--seed", "3"]
    with (
        server_process(argv, tmp_path / "policy.log") as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c,
    ):
        assert ask(c, "What is 1 + 1?").model == "envport-scripted"
    assert "not a model" in (tmp_path / "policy.log").read_text()


BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def test_bash_tool_creates_the_requested_file_then_submits(client: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": "Please solve this issue: Create a file hello.txt "
            "containing 'hello world'\n\n### Create a new file:\n\ncat <<'EOF' > newfile.py",
        },
    ]
    first = client.chat.completions.create(
        model="envport-scripted", messages=messages, tools=[BASH_TOOL]
    )
    [call] = first.choices[0].message.tool_calls or []
    assert call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"command": "echo 'hello world' > hello.txt"}
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"returncode": 0, "output": ""}'},
    ]
    second = client.chat.completions.create(
        model="envport-scripted", messages=messages, tools=[BASH_TOOL]
    )
    [submit] = second.choices[0].message.tool_calls or []
    assert json.loads(submit.function.arguments) == {
        "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
    }
    assert second.choices[0].finish_reason == "tool_calls"


def test_file_task_phrasings() -> None:
    from envport.policy.scripted import find_file_task

    def found(text: str) -> tuple[str, str] | None:
        task = find_file_task([{"role": "user", "content": text}])
        return None if task is None else (task.path, task.content)

    assert found("Create a file hello.txt containing hello world") == ("hello.txt", "hello world")
    assert found('create the file `out/a.md` with content "x y".') == ("out/a.md", "x y")
    assert found("Create a new file named notes.txt with the text: it's done") == (
        "notes.txt",
        "it's done",
    )
    assert found("Create a file ../escape.txt containing x") is None  # stays in the workdir
    assert found("Create a file /etc/passwd containing x") is None
    assert found("### Create a new file:\n\ncat <<'EOF' > newfile.py") is None


def test_bash_tool_without_a_file_task_falls_back_to_echo(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="envport-scripted",
        messages=[{"role": "user", "content": "Tell me a story."}],
        tools=[BASH_TOOL],
    )
    assert reply.choices[0].message.content == "Tell me a story."
    assert not reply.choices[0].message.tool_calls
