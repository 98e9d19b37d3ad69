"""The built-in agent: a tool-calling loop for any OpenAI-compatible chat endpoint.

It reads the environment's tools (without taking a step) and offers them to the model as
function schemas; an environment without tools gets plain text actions, the model's reply
going into the action's one required field (``{"answer": "42"}``). Each model call, each
message (with its parent), and each step lands in the trace as it happens, so a run that
fails midway still shows everything up to the failure.

A tool call whose arguments are not a JSON object (cut off at ``max_tokens``, or an array,
a number) is not sent to the environment: the model reads an ``invalid_args`` error as
that call's tool message, and the trace records it as a step that did not reach the
environment (``info["sent_to_env"]`` false); the turn counts toward ``max_turns``.

Stop conditions, recorded as ``trace.stop_reason``: ``terminated`` / ``truncated`` (the
environment ended the episode), ``max_turns``, ``token_budget``, ``no_action`` (the model
answered in text where only tools can act).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from pydantic import BaseModel, Field

from envport.client import ClientStepResult, EnvClient
from envport.harness.model import ChatModel, ModelProviderError
from envport.tasks import Task
from envport.trace import Message, StepRecord, ToolCall, Trace
from envport.types import tool_result_value


class AgentConfig(BaseModel):
    max_turns: int = Field(10, ge=1, description="Model calls at most.")
    max_total_tokens: int | None = Field(None, ge=1, description="Completion-token budget.")
    tool_mode: str = Field("auto", pattern="^(auto|tools|text)$")
    action_field: str | None = Field(None, description="Field a text reply fills.")


def observation_text(observation: dict[str, Any]) -> str:
    """What the model reads of an observation: a message if there is one, else JSON."""
    shown = {k: v for k, v in observation.items() if v not in (None, "", [], {})}
    if set(shown) <= {"message", "feedback"} and isinstance(shown.get("message"), str):
        return str(shown["message"])
    return json.dumps(shown, ensure_ascii=False, default=str)


def tool_result_text(result: Any) -> str:
    """What the model reads of a successful tool call, given the observation's
    ``result`` (a ``CallToolResult``): its plain value, a string as is, else JSON."""
    value = tool_result_value(result)
    return value if isinstance(value, str) else json.dumps(value, default=str)


#: Reset options that name a directory on the environment's host (``shell-v1``'s
#: ``task_dir``, ``sandbox-v1``'s ``workspace``); the environment refuses them unless
#: its operator granted the directory (``workspace_roots``).
HOST_DIR_OPTIONS = ("task_dir", "workspace")


def reset_options(task: Task) -> dict[str, Any]:
    """The task's env options, with a relative ``task_dir`` resolved against its root."""
    options = dict(task.env_options)
    if isinstance(options.get("task_dir"), str):
        options["task_dir"] = str(task.resolve(options["task_dir"]))
    return options


def task_host_dirs(task: Task) -> frozenset[str]:
    """The host directories ``task``'s reset options name (:data:`HOST_DIR_OPTIONS`),
    resolved: what a runner grants the environment that runs it (``workspace_roots``)."""
    options = reset_options(task)
    named = (options.get(name) for name in HOST_DIR_OPTIONS)
    return frozenset(os.path.realpath(p) for p in named if isinstance(p, str | os.PathLike))


def text_action_field(action_schema: dict[str, Any]) -> str | None:
    """The one field a free-text reply can fill, if the schema has exactly one."""
    required = [f for f in action_schema.get("required", []) if f != "metadata"]
    if len(required) == 1:
        return str(required[0])
    props = [p for p in action_schema.get("properties", {}) if p != "metadata"]
    return str(props[0]) if len(props) == 1 else None


def parse_arguments(text: str | None) -> tuple[dict[str, Any], str | None]:
    """A tool call's arguments string as an object, or ``({}, why)`` when it is not one.
    No arguments at all (``None`` or ``""``) is the empty object."""
    if not text:
        return {}, None
    try:
        args = json.loads(text)
    except json.JSONDecodeError as exc:
        return {}, str(exc)
    if not isinstance(args, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        return {}, f"got {kind.get(type(args), 'a number')}"
    return args, None


def _tool_schemas(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {"type": "object", "properties": {}}),
            },
        }
        for t in tools
    ]


def _wire_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {
                    "name": tc.name,
                    "arguments": tc.raw_arguments or json.dumps(tc.arguments),
                },
            }
            for tc in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


class ToolCallingAgent:
    """Drives one episode of ``task`` on ``env`` with ``model``, recording into a trace."""

    name = "envport-agent"

    def __init__(self, model: ChatModel, config: AgentConfig | None = None) -> None:
        self.model = model
        self.config = config or AgentConfig()

    async def run(self, task: Task, env: EnvClient, trace: Trace) -> None:
        trace.harness = self.name
        t0 = time.perf_counter()
        first = await env.reset(seed=task.seed, **reset_options(task))
        trace.timings["env_reset"] = time.perf_counter() - t0
        schema = await env.schema()
        tools = schema.get("tools", []) if self.config.tool_mode != "text" else []
        field = self.config.action_field or task.metadata.get("action_field")
        field = field or text_action_field(schema.get("action", {}))
        self._seed_messages(task, trace, first)

        spent = 0
        for turn in range(self.config.max_turns):
            wire = [_wire_message(m) for m in trace.path(trace.messages[-1].id)]
            try:
                call, reply = await self.model.complete(wire, _tool_schemas(tools) or None)
            except ModelProviderError as exc:
                if exc.call is not None:  # the failed call goes on the trace, then the error
                    exc.call.step_index = turn
                    trace.model_calls.append(exc.call)
                raise
            call.step_index = turn
            call.input_message_ids = [m.id for m in trace.path(trace.messages[-1].id)]
            trace.model_calls.append(call)
            spent += (call.usage.completion_tokens or 0) if call.usage else 0
            assistant = self._assistant_message(trace, reply, call.id)
            if call.choices:
                call.choices[0].message_id = assistant.id
            if assistant.tool_calls and tools:
                done = await self._run_tools(env, trace, assistant)
            elif field is not None:
                done = await self._text_step(env, trace, field, assistant)
            else:
                trace.stop_reason = "no_action"
                return
            if done is not None:
                trace.stop_reason = done
                return
            if self.config.max_total_tokens and spent >= self.config.max_total_tokens:
                trace.stop_reason = "token_budget"
                return
        trace.stop_reason = "max_turns"

    def _seed_messages(self, task: Task, trace: Trace, first: ClientStepResult) -> None:
        parent: str | None = None
        if task.system_prompt:
            parent = trace.append_message(Message(role="system", content=task.system_prompt)).id
        if isinstance(task.prompt, str):
            trace.append_message(Message(role="user", content=task.prompt, parent_id=parent))
        else:
            for chat in task.prompt:
                msg = Message(role=chat.role, content=chat.content, parent_id=parent)
                parent = trace.append_message(msg).id
        trace.metadata.setdefault("first_observation", first.observation)

    def _assistant_message(self, trace: Trace, reply: dict[str, Any], call_id: str) -> Message:
        calls = []
        # ChatModel has checked the shape: a list of objects, each function an object with
        # a string name, its arguments a string or absent.
        for raw in reply.get("tool_calls") or []:
            fn = raw["function"]
            text = fn.get("arguments") or "{}"
            args, _ = parse_arguments(text)
            calls.append(
                ToolCall(
                    id=raw.get("id") or "",
                    name=fn["name"],
                    arguments=args,
                    raw_arguments=text,
                )
            )
        message = Message(
            role="assistant",
            content=reply.get("content"),
            tool_calls=calls,
            parent_id=trace.messages[-1].id,
            model_call_id=call_id,
            reasoning=reply.get("reasoning_content") or reply.get("reasoning"),
        )
        return trace.append_message(message)

    async def _record_step(
        self, env: EnvClient, trace: Trace, action: dict[str, Any], **extra: Any
    ) -> ClientStepResult:
        started = time.perf_counter()
        result = await env.step(action)
        trace.steps.append(
            StepRecord(
                index=len(trace.steps),
                action=action,
                observation=result.observation,
                reward=result.reward,
                terminated=bool(
                    result.terminated if result.terminated is not None else result.done
                ),
                truncated=bool(result.truncated),
                latency_s=time.perf_counter() - started,
                info=result.metadata,
                **extra,
            )
        )
        return result

    async def _run_tools(self, env: EnvClient, trace: Trace, assistant: Message) -> str | None:
        for tc in assistant.tool_calls:
            _, invalid = parse_arguments(tc.raw_arguments)
            if invalid is not None:
                self._refuse_call(trace, tc, f"the arguments are not a JSON object: {invalid}")
                continue
            action = {"type": "call_tool", "tool_name": tc.name, "arguments": tc.arguments}
            result = await self._record_step(
                env, trace, action, tool_name=tc.name, tool_call_id=tc.id
            )
            obs = result.observation
            if obs.get("error"):
                err = obs["error"]
                content = f"Error ({err.get('error_type')}): {err.get('message')}"
            else:
                content = tool_result_text(obs.get("result"))
            trace.append_message(
                Message(
                    role="tool",
                    content=content,
                    tool_call_id=tc.id,
                    name=tc.name,
                    parent_id=trace.messages[-1].id,
                )
            )
            if result.done:
                return "truncated" if result.truncated else "terminated"
        return None

    @staticmethod
    def _refuse_call(trace: Trace, tc: ToolCall, why: str) -> None:
        """A call not sent to the environment: recorded as a step that did not reach it
        (the error where the environment's would be), answered with the error."""
        error = {"error_type": "invalid_args", "message": why}
        trace.steps.append(
            StepRecord(
                index=len(trace.steps),
                action={
                    "type": "call_tool",
                    "tool_name": tc.name,
                    "raw_arguments": tc.raw_arguments,
                },
                observation={"tool_name": tc.name, "result": None, "error": error},
                tool_name=tc.name,
                tool_call_id=tc.id,
                info={"sent_to_env": False},
            )
        )
        trace.append_message(
            Message(
                role="tool",
                content=f"Error (invalid_args): {why}",
                tool_call_id=tc.id,
                name=tc.name,
                parent_id=trace.messages[-1].id,
            )
        )

    async def _text_step(
        self, env: EnvClient, trace: Trace, field: str, assistant: Message
    ) -> str | None:
        text = assistant.content if isinstance(assistant.content, str) else ""
        result = await self._record_step(env, trace, {field: text.strip()})
        if result.done:
            return "truncated" if result.truncated else "terminated"
        trace.append_message(
            Message(
                role="user",
                content=observation_text(result.observation),
                parent_id=trace.messages[-1].id,
            )
        )
        return None
