"""How an environment's tools look to MCP: listings, and a call's outcome.

Shared by the Streamable HTTP endpoint (:mod:`envport.mcp.server`) and the JSON-RPC
handler for OpenEnv's WebSocket ``mcp`` frames (:mod:`envport.mcp.jsonrpc`), so both
answer a tool call the same way.

MCP draws one line that envport keeps: an error *the tool* reports (it raised, or the
arguments failed its schema) is a successful response whose result has ``isError``, so
the model reads the message and can correct itself; an error *in finding* the tool (an
unknown name) is a protocol error. :func:`call_tool` returns the first kind and raises
the second (:class:`~envport.errors.ToolError` with ``kind="tool_not_found"``), leaving
the wire mapping of raised errors to each transport.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envport.errors import EnvTimeoutError, ToolError
from envport.session import Session
from envport.types import ToolSpec, structured_content, tool_text


def tool_listing(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """Tools in MCP's wire form (``name``, ``description``, ``inputSchema``)."""
    return [
        {"name": s.name, "description": s.description, "inputSchema": s.input_schema} for s in specs
    ]


@dataclass(frozen=True)
class ToolOutcome:
    """What one tool call produced, ready to become an MCP ``CallToolResult``.

    ``text`` is the single text content block: a string result as is, anything else as
    JSON. ``structured`` is ``structuredContent``: a dict result as is, any other value
    wrapped as ``{"result": value}`` (MCP requires an object there through 2025-11-25);
    ``None`` on errors. ``value`` is the result as plain JSON data (``None`` on errors):
    where the tool returned a number JSON cannot write (NaN, an infinity) or a value it
    has no form for (bytes, a set, a datetime), ``value`` and ``structured`` hold what
    ``text`` shows (``null``, the value's ``str()``), so every transport can send them.
    """

    text: str
    structured: dict[str, Any] | None
    is_error: bool
    value: Any = None

    @classmethod
    def success(cls, value: Any) -> ToolOutcome:
        if isinstance(value, str):
            text = value
        else:
            try:  # the usual result is plain JSON: then this is tool_text's very text
                text = json.dumps(value, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError):  # a NaN, bytes, a set: as tool_text writes it
                text = tool_text(value)
                value = json.loads(text)
        return cls(text=text, structured=structured_content(value), is_error=False, value=value)

    @classmethod
    def failure(cls, message: str) -> ToolOutcome:
        return cls(text=message, structured=None, is_error=True)

    def to_wire(self) -> dict[str, Any]:
        """The ``CallToolResult`` as a JSON object (camelCase keys)."""
        data: dict[str, Any] = {
            "content": [{"type": "text", "text": self.text}],
            "isError": self.is_error,
        }
        if self.structured is not None:
            data["structuredContent"] = self.structured
        return data


async def call_tool(session: Session, name: str, arguments: dict[str, Any]) -> ToolOutcome:
    """Call one tool on ``session``; tool-side failures become an ``isError`` outcome.

    Raises:
        ToolError: ``kind == "tool_not_found"``: no tool of that name (a protocol error).
        EnvportError: the session itself cannot serve calls (closed, not reset after a
            timeout): the transport reports these as protocol errors.
    """
    try:
        value = await session.call_tool(name, arguments)
    except ToolError as exc:
        if exc.kind == "tool_not_found":
            raise
        return ToolOutcome.failure(exc.message)
    except EnvTimeoutError as exc:
        return ToolOutcome.failure(exc.message)
    return ToolOutcome.success(value)
