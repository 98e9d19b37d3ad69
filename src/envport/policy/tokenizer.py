"""A byte-level tokenizer and a ChatML-like chat template, with nothing to download.

Token ids ``0..255`` are raw bytes; a handful of special tokens follow (:data:`SPECIAL`).
Byte-level means every string has exactly one encoding and the encoding of ``a + b`` is
the encoding of ``a`` followed by that of ``b`` (unless a special token's text straddles
the seam), which is what makes the template's prefix property easy to keep:

    prompt_ids(turn k+1) starts with prompt_ids(turn k) + completion_ids(turn k)

whenever the client echoes the assistant message of turn k back unchanged (content and
tool calls; ids, token ids and logprobs are not rendered). The completion of a turn is
``render_assistant(content, tool_calls)`` followed by ``<|im_end|>``, and the template
renders a past assistant message as ``<|im_start|>assistant\\n`` + that same body +
``<|im_end|>\\n``. Token-exact training (see ``envport.train``) relies on this.

The template::

    <|im_start|>system
    {system text}{tools block, if tools}<|im_end|>
    <|im_start|>user
    {text}<|im_end|>
    <|im_start|>assistant
    {content}
    <tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call><|im_end|>
    <|im_start|>tool
    {tool result}<|im_end|>
    <|im_start|>assistant
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

#: Special tokens and their ids; byte ``b`` is id ``b``.
SPECIAL: dict[str, int] = {
    ENDOFTEXT: 256,
    IM_START: 257,
    IM_END: 258,
    TOOL_CALL_OPEN: 259,
    TOOL_CALL_CLOSE: 260,
}
_SPECIAL_BY_ID = {i: s for s, i in SPECIAL.items()}
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL))

_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions. Their signatures, one JSON object a "
    "line, are inside <tools></tools>:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nTo call a function, write one line per call:\n"
    '<tool_call>{"name": <function-name>, "arguments": <arguments-json-object>}</tool_call>'
)
_CALL_RE = re.compile(r'\A\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (.*)\}\Z', re.DOTALL)


def content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, ``None`` or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


@dataclass(frozen=True)
class ParsedToolCall:
    """A tool call found in generated text; ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str


def render_tool_call(name: str, arguments: str | Mapping[str, Any]) -> str:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; JSON ``arguments`` verbatim.

    A string that is valid JSON is inserted byte for byte, so a tool call echoed back by a
    client renders exactly as it was generated.
    """
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            args_text = arguments
        except ValueError:
            args_text = json.dumps(arguments)
    else:
        args_text = json.dumps(dict(arguments))
    return (
        f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {args_text}}}{TOOL_CALL_CLOSE}'
    )


def render_assistant(content: str | None, tool_calls: Iterable[ParsedToolCall] = ()) -> str:
    """The text an assistant turn is generated as (without the closing ``<|im_end|>``)."""
    calls = [render_tool_call(c.name, c.arguments) for c in tool_calls]
    text = content or ""
    if calls:
        return text + ("\n" if text else "") + "\n".join(calls)
    return text


def parse_assistant(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split generated text into content and tool calls; the inverse of :func:`render_assistant`.

    Content is the text before the first ``<tool_call>`` (``None`` if that is empty and there
    are calls). Text that does not hold well-formed calls is all content.
    """
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    calls: list[ParsedToolCall] = []
    rest = text[start:]
    for block in rest.split("\n"):
        if not (block.startswith(TOOL_CALL_OPEN) and block.endswith(TOOL_CALL_CLOSE)):
            return text, []
        call = _parse_call(block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)])
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start]
    content = content[:-1] if content.endswith("\n") else content
    return (content or None), calls


def _parse_call(body: str) -> ParsedToolCall | None:
    match = _CALL_RE.match(body)
    if match:
        try:
            name = json.loads(match.group(1))
            args = json.loads(match.group(2))
        except ValueError:
            return None
        if isinstance(name, str) and isinstance(args, dict):
            return ParsedToolCall(name, match.group(2))
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", {})
        return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))
    return None


def _message_tool_calls(message: Mapping[str, Any]) -> list[ParsedToolCall]:
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        calls.append(ParsedToolCall(str(fn.get("name", "")), fn.get("arguments") or "{}"))
    return calls


class ByteTokenizer:
    """Bytes are ids 0..255, special tokens follow. Deterministic; no vocabulary files."""

    vocab_size = 256 + len(SPECIAL)
    eos_token_id = SPECIAL[ENDOFTEXT]
    im_end_id = SPECIAL[IM_END]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special tokens written out in the text become their single id."""
        ids: list[int] = []
        pos = 0
        for match in _SPECIAL_RE.finditer(text):
            ids.extend(text[pos : match.start()].encode("utf-8"))
            ids.append(SPECIAL[match.group(0)])
            pos = match.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if i not in _SPECIAL_BY_ID:
                raise ValueError(
                    f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
            if not skip_special_tokens:
                out.append(_SPECIAL_BY_ID[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token's text for special tokens)."""
        if 0 <= token_id < 256:
            return bytes([token_id])
        return _SPECIAL_BY_ID[token_id].encode("utf-8")

    def token_str(self, token_id: int) -> str:
        """One token as text, in OpenAI's convention: ``bytes:\\xNN`` for a partial character."""
        if token_id < 128 or token_id >= 256:
            return self.token_bytes(token_id).decode("utf-8")
        return f"bytes:\\x{token_id:02x}"

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render a conversation as prompt text (see the module docstring for the layout).

        Tools are listed at the end of the first system message (one is added if the
        conversation has none). ``developer`` is treated as ``system``.
        """
        parts: list[str] = []
        tools_block = ""
        if tools:
            lines = [json.dumps(t.get("function", t), sort_keys=True) for t in tools]
            tools_block = _TOOLS_HEADER + "\n".join(lines) + _TOOLS_FOOTER
        first_is_system = bool(messages) and messages[0].get("role") in ("system", "developer")
        if tools_block and not first_is_system:
            parts.append(f"{IM_START}system\n{tools_block.lstrip()}{IM_END}\n")
        for index, message in enumerate(messages):
            role = str(message.get("role", "user"))
            if role == "developer":
                role = "system"
            if role == "assistant":
                body = render_assistant(
                    content_text(message.get("content")) or None, _message_tool_calls(message)
                )
            else:
                body = content_text(message.get("content"))
            if index == 0 and first_is_system:
                body += tools_block
            parts.append(f"{IM_START}{role}\n{body}{IM_END}\n")
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)
