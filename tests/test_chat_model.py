"""The built-in agent's model client and the agent's handling of what the model sends:
malformed replies, unusable tool-call arguments, sampling parameters, retries."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from envport.client import EnvClient
from envport.harness import AgentConfig, ChatModel, ModelProviderError, ToolCallingAgent
from envport.tasks import Task
from envport.trace import ErrorKind, Trace

Reply = tuple[int, Any]


def scripted(replies: list[Reply], **kwargs: Any) -> tuple[ChatModel, list[dict[str, Any]]]:
    """A ChatModel whose endpoint answers ``replies`` in order; the requests it got."""
    pending = iter(replies)
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        status, body = next(pending)
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return ChatModel("http://model.test/v1", "m", client=client, **kwargs), seen


def completion(message: Any) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def guess_call(arguments: Any, call_id: str = "c1") -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "guess", "arguments": arguments},
    }


def calling(*calls: Any) -> dict[str, Any]:
    return completion({"role": "assistant", "content": None, "tool_calls": list(calls)})


async def run_guess(model: ChatModel, max_turns: int = 1) -> Trace:
    """One guessing-game episode; an exception the agent raises is kept on
    ``trace.metadata["raised"]``."""
    task = Task(
        id="g",
        prompt="Guess my number between 1 and 100.",
        env_id="guess-number-v1",
        seed=1,
        env_options={"max_steps": 5},
    )
    trace = Trace(task_id=task.id)
    async with EnvClient.connect("guess-number-v1") as env:
        agent = ToolCallingAgent(model, AgentConfig(max_turns=max_turns))
        try:
            await agent.run(task, env, trace)
        except Exception as exc:  # the test looks at what was raised
            trace.metadata["raised"] = exc
    return trace


# --- malformed replies are the provider's, not the agent's -------------------------------


async def test_object_arguments_are_accepted_as_their_json_string() -> None:
    model, _ = scripted([(200, calling(guess_call({"number": 5})))])
    call, message = await model.complete([{"role": "user", "content": "hi"}])
    assert message["tool_calls"][0]["function"]["arguments"] == '{"number": 5}'
    # The recorded response is what the server sent.
    assert call.response is not None
    sent = call.response["choices"][0]["message"]["tool_calls"][0]["function"]
    assert sent["arguments"] == {"number": 5}

    model, _ = scripted([(200, calling(guess_call({"number": 5})))])
    trace = await run_guess(model)
    assert "raised" not in trace.metadata
    (step,) = trace.steps
    assert step.action["arguments"] == {"number": 5}
    assert trace.messages[-1].role == "tool"
    assert not trace.messages[-1].content.startswith("Error")


BAD_MESSAGES: dict[str, Any] = {
    "null-tool-call": {"role": "assistant", "content": "hi", "tool_calls": [None]},
    "tool-calls-not-a-list": {"role": "assistant", "content": None, "tool_calls": {"id": "c"}},
    "function-not-an-object": {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": "guess"}],
    },
    "no-name": {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}],
    },
    "name-not-a-string": {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "function": {"name": 7, "arguments": "{}"}}],
    },
    "arguments-a-number": {"role": "assistant", "tool_calls": [guess_call(5)]},
    "id-not-a-string": {"role": "assistant", "tool_calls": [guess_call("{}", call_id=3)]},  # type: ignore[arg-type]
    "content-a-number": {"role": "assistant", "content": 5},
    "null-message": None,
}


@pytest.mark.parametrize("message", list(BAD_MESSAGES.values()), ids=list(BAD_MESSAGES))
async def test_a_malformed_reply_is_a_model_provider_error_with_its_call(message: Any) -> None:
    model, _ = scripted([(200, completion(message))])
    with pytest.raises(ModelProviderError, match="invalid completion") as caught:
        await model.complete([{"role": "user", "content": "hi"}])
    assert caught.value.retryable is False
    call = caught.value.call
    assert call is not None
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert call.request is not None
    assert call.request["messages"]
    assert call.metadata["body"]  # the unusable answer, kept


async def test_the_agent_records_a_malformed_reply_as_the_provider_s_failure() -> None:
    """A null entry in tool_calls used to crash the agent (AttributeError, kind harness)."""
    model, _ = scripted([(200, calling(None))])
    trace = await run_guess(model)
    assert isinstance(trace.metadata["raised"], ModelProviderError)
    (call,) = trace.model_calls
    assert call.error is not None
    assert call.error.kind is ErrorKind.MODEL_PROVIDER
    assert trace.steps == []


# --- tool-call arguments that are not a JSON object never reach the environment ----------


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ('{"number": 5', "Expecting ',' delimiter"),  # cut off at max_tokens
        ("[5]", "got an array"),
        ('"5"', "got a string"),
        ("5", "got a number"),
    ],
    ids=["truncated", "array", "string", "number"],
)
async def test_arguments_that_are_not_an_object_are_answered_not_run(
    arguments: str, why: str
) -> None:
    model, seen = scripted(
        [(200, calling(guess_call(arguments))), (200, calling(guess_call('{"number": 5}', "c2")))]
    )
    trace = await run_guess(model, max_turns=2)
    assert "raised" not in trace.metadata
    assert trace.stop_reason == "max_turns"
    refused, ran = trace.steps
    # The first call never reached the environment; its error is where the env's would be.
    assert refused.info == {"sent_to_env": False}
    assert refused.tool_call_id == "c1"
    assert refused.action == {"type": "call_tool", "tool_name": "guess", "raw_arguments": arguments}
    assert refused.observation["error"]["error_type"] == "invalid_args"
    assert refused.reward is None
    # The second is the environment's first guess: the refused one was not counted there.
    assert ran.action["arguments"] == {"number": 5}
    assert ran.observation["error"] is None
    assert ran.observation["result"]["data"]["attempts_used"] == 1
    # The model read the error as that call's tool message before its next turn.
    tool = next(m for m in trace.messages if m.role == "tool")
    assert tool.tool_call_id == "c1"
    assert tool.content.startswith("Error (invalid_args): the arguments are not a JSON object: ")
    assert why in tool.content
    assert seen[1]["messages"][-1] == {
        "role": "tool",
        "content": tool.content,
        "tool_call_id": "c1",
    }


async def test_one_bad_call_among_several_is_refused_alone() -> None:
    model, _ = scripted(
        [(200, calling(guess_call('{"number": 5', "a"), guess_call('{"number": 50}', "b")))]
    )
    trace = await run_guess(model)
    assert [s.info.get("sent_to_env", True) for s in trace.steps] == [False, True]
    assert [m.tool_call_id for m in trace.messages if m.role == "tool"] == ["a", "b"]
    assert trace.steps[1].observation["result"]["data"]["last_guess"] == 50


async def test_no_arguments_at_all_is_the_empty_object() -> None:
    """A tool without parameters may get ``""`` or no ``arguments``: that is ``{}``."""
    model, _ = scripted([(200, calling(guess_call("")))])
    trace = await run_guess(model)
    (step,) = trace.steps
    assert step.action["arguments"] == {}
    assert "sent_to_env" not in step.info


# --- sampling parameters in OpenAI's forms ------------------------------------------------


def answer(text: str = "5") -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ]
    }


async def test_a_string_stop_is_sent_as_given_and_recorded_as_a_list() -> None:
    """OpenAI accepts ``stop`` as one string; every successful call used to fail while
    being recorded (SamplingParams.stop is a list)."""
    model, seen = scripted(
        [(200, answer()), (200, answer())],
        sampling={"stop": "\n", "temperature": None, "max_completion_tokens": 7},
    )
    for _ in range(2):
        call, message = await model.complete([{"role": "user", "content": "2+3?"}])
        assert message["content"] == "5"
        assert call.sampling.stop == ["\n"]
        assert call.sampling.max_tokens == 7
    assert all(body["stop"] == "\n" for body in seen)  # sent in the form it was given


async def test_a_failed_call_records_its_sampling_in_the_same_forms() -> None:
    model, _ = scripted([(400, {"error": "no"})], sampling={"stop": "\n"})
    with pytest.raises(ModelProviderError) as caught:
        await model.complete([{"role": "user", "content": "hi"}])
    assert caught.value.call is not None
    assert caught.value.call.sampling.stop == ["\n"]


@pytest.mark.parametrize("stream", [True, "yes"])
def test_stream_is_refused_when_the_client_is_built(stream: Any) -> None:
    with pytest.raises(ModelProviderError, match="'stream' cannot be set"):
        ChatModel("http://model.test/v1", "m", sampling={"stream": stream})
    ChatModel("http://model.test/v1", "m", sampling={"stream": False})  # the default: fine


# --- retries, against a real HTTP server --------------------------------------------------


class Script:
    """A chat endpoint on a real socket answering ``(status, headers, delay_s)`` in turn
    (the last one repeated): 200 is a completion, anything else an error body."""

    def __init__(self, *answers: tuple[int, dict[str, str], float]) -> None:
        self.answers = list(answers)
        self.requests = 0

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def chat(request: Request) -> JSONResponse:
            import asyncio

            await request.body()
            status, headers, delay = self.answers[min(self.requests, len(self.answers) - 1)]
            self.requests += 1
            await asyncio.sleep(delay)
            if status == 200:
                return JSONResponse(answer("ok"))
            return JSONResponse({"error": {"message": f"status {status}"}}, status, headers)

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


FAST = {"backoff_s": 0.001, "max_backoff_s": 0.01}


async def chat_via(script: Script, **kwargs: Any) -> tuple[Any, Any]:
    """Run one completion against ``script``; (the call, None) or (None, the error)."""
    from envport.serving import serve_in_thread

    with serve_in_thread(script.app()) as url:
        model = ChatModel(url + "/v1", "m", **kwargs)
        try:
            call, _ = await model.complete([{"role": "user", "content": "hi"}])
        except ModelProviderError as exc:
            return None, exc
        finally:
            await model.aclose()
    return call, None


async def test_a_429_is_retried_and_the_retry_recorded() -> None:
    script = Script((429, {}, 0), (200, {}, 0))
    call, error = await chat_via(script, **FAST)
    assert error is None
    assert script.requests == 2
    assert call.metadata["retries"] == 1
    assert "HTTP 429" in call.metadata["retry_errors"][0]
    assert call.error is None


async def test_retry_after_in_seconds_is_honoured_and_capped() -> None:
    import time

    script = Script((503, {"Retry-After": "0.3"}, 0), (200, {}, 0))
    t0 = time.monotonic()
    call, error = await chat_via(script, **{**FAST, "max_backoff_s": 5.0})
    assert error is None
    assert call.metadata["retries"] == 1
    assert time.monotonic() - t0 >= 0.3  # waited as asked, not the tiny backoff
    # A wait the server asks for beyond max_backoff_s is cut to it.
    script = Script((429, {"Retry-After": "3600"}, 0), (200, {}, 0))
    t0 = time.monotonic()
    call, error = await chat_via(script, **FAST)
    assert error is None
    assert time.monotonic() - t0 < 30


async def test_5xx_past_the_budget_fails_retryable_with_the_count() -> None:
    script = Script((500, {}, 0))
    call, error = await chat_via(script, **FAST, max_retries=2)
    assert call is None
    assert script.requests == 3
    assert error.retryable is True
    assert error.status == 500
    assert error.call.metadata["retries"] == 2
    assert len(error.call.metadata["retry_errors"]) == 2
    assert error.call.error.retryable is True


async def test_a_timeout_is_retried() -> None:
    # The retry must be answered within timeout_s: not 0.3 s, which a loaded machine's
    # new connection to a server thread can take.
    script = Script((200, {}, 1.5), (200, {}, 0))
    call, error = await chat_via(script, **FAST, timeout_s=0.8)
    assert error is None
    assert script.requests == 2
    assert "timed out" in call.metadata["retry_errors"][0]


@pytest.mark.parametrize(
    ("answers", "kwargs"),
    [
        ([(400, {}, 0)], FAST),  # not retryable
        ([(500, {}, 0)], {**FAST, "max_retries": 0}),
        ([(500, {}, 0)], {**FAST, "retry_window_s": 0}),  # no retry starts past the window
    ],
    ids=["400", "no-retries", "window-over"],
)
async def test_no_retry(answers: list[Any], kwargs: dict[str, Any]) -> None:
    script = Script(*answers)
    call, error = await chat_via(script, **kwargs)
    assert call is None
    assert script.requests == 1
    assert "retries" not in error.call.metadata


@pytest.mark.parametrize("url", ["localhost:1/v1", "127.0.0.1:8000/v1", "http://", "ftp://h/v1"])
def test_a_url_without_http_scheme_or_host_is_refused_when_built(url: str) -> None:
    with pytest.raises(ModelProviderError, match="not an http\\(s\\) URL") as caught:
        ChatModel(url, "m")
    assert caught.value.retryable is False
