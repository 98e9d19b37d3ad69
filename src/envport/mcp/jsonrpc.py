"""MCP over OpenEnv's WebSocket ``mcp`` frame: a minimal JSON-RPC 2.0 handler.

OpenEnv clients may send ``{"type": "mcp", "data": {JSON-RPC request}}`` on ``/ws``;
the server answers ``{"type": "mcp", "data": {JSON-RPC response}}`` on the same
session. :func:`handle_jsonrpc` produces that ``data``: it never raises, and every
request gets exactly one response (the WebSocket protocol is strict request/response,
so a notification such as ``notifications/initialized`` is acknowledged with an empty
result rather than left unanswered).

Shapes follow OpenEnv's ``mcp_types.JsonRpcResponse``: ``{"jsonrpc": "2.0", "id": ...,
"result": ...}`` or ``{"jsonrpc": "2.0", "id": ..., "error": {"code", "message",
"data"}}``. Methods: ``initialize``, ``ping``, ``tools/list``, ``tools/call``, and
OpenEnv's session methods (``openenv/session/create``, ``openenv/session/close``;
on a connection's own session, create answers that session's id for ``/mcp`` (its
tools-only token) and close is refused, as OpenEnv's server does). A
``tools/call`` result is MCP's ``CallToolResult`` (``content``, ``structuredContent``,
``isError``) plus ``data``, the raw return value, which is where OpenEnv's
``MCPToolClient`` looks for it. Error codes: -32700 unparseable text, -32600 not a
JSON-RPC 2.0 request object, -32601 unknown method, -32602 bad params or unknown tool,
-32603 the session could not serve the call.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any

from envport import __version__
from envport.errors import EnvportError, ToolError
from envport.mcp.results import call_tool, tool_listing
from envport.session import Session

#: The MCP revision this handler answers ``initialize`` with when the client asks for
#: one it does not know.
PROTOCOL_VERSION = "2025-06-18"
_KNOWN_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")


class JsonRpcCode(IntEnum):
    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    SERVER_ERROR = -32000


#: OpenEnv's JSON-RPC extension methods for an MCP session over plain HTTP ``/mcp``
#: (``MCPToolClient``'s production mode).
SESSION_CREATE = "openenv/session/create"
SESSION_CLOSE = "openenv/session/close"


class _RpcError(Exception):
    def __init__(self, code: JsonRpcCode, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


def jsonrpc_error(
    request_id: Any, code: JsonRpcCode, message: str, data: Any = None
) -> dict[str, Any]:
    """A JSON-RPC 2.0 error response."""
    error = {"code": int(code), "message": message, "data": data}
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


async def handle_jsonrpc(session: Session, request: Any) -> dict[str, Any]:
    """Answer one JSON-RPC 2.0 request (a dict, or its JSON text) against ``session``."""
    if isinstance(request, str | bytes | bytearray):
        try:
            request = json.loads(request)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            return jsonrpc_error(None, JsonRpcCode.PARSE_ERROR, f"Parse error: {exc}")
    if not isinstance(request, dict):
        message = f"Invalid Request: expected a JSON object, got {type(request).__name__}."
        return jsonrpc_error(None, JsonRpcCode.INVALID_REQUEST, message)
    raw_id = request.get("id")
    request_id = raw_id if _valid_id(raw_id) else None
    try:
        method, params = _validate(request)
        result = await _dispatch(session, method, params)
    except _RpcError as exc:
        return jsonrpc_error(request_id, exc.code, exc.message, exc.data)
    except Exception as exc:  # a bad request is data: answer it, never drop the session
        return jsonrpc_error(
            request_id, JsonRpcCode.INTERNAL_ERROR, f"Internal error: {type(exc).__name__}: {exc}"
        )
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def _valid_id(value: Any) -> bool:
    return value is None or (isinstance(value, str | int) and not isinstance(value, bool))


def _validate(request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    problems = []
    if request.get("jsonrpc") != "2.0":
        problems.append('"jsonrpc" must be "2.0"')
    if not isinstance(request.get("method"), str) or not request.get("method"):
        problems.append('"method" must be a non-empty string')
    if not _valid_id(request.get("id")):
        problems.append('"id" must be a string, an integer or null')
    params = request.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        problems.append('"params" must be an object')
    if problems:
        raise _RpcError(JsonRpcCode.INVALID_REQUEST, "Invalid Request: " + "; ".join(problems))
    return str(request["method"]), params


async def _dispatch(session: Session, method: str, params: dict[str, Any]) -> dict[str, Any]:
    if method == "initialize":
        return _initialize(params)
    if method == "ping" or method.startswith("notifications/"):
        return {}
    if method == "tools/list":
        return {"tools": tool_listing(session.env.tool_specs())}
    if method == "tools/call":
        return await _tools_call(session, params)
    if method == SESSION_CREATE:  # the session this request is bound to already exists
        return {"session_id": session.tools_token}
    if method == SESSION_CLOSE:
        target = params.get("session_id")
        if not isinstance(target, str) or not target:
            raise _RpcError(JsonRpcCode.INVALID_PARAMS, "Invalid params - 'session_id' is required")
        if target in (session.tools_token, session.token, session.id):
            raise _RpcError(
                JsonRpcCode.INVALID_REQUEST,
                "Cannot close the session this request is bound to via an MCP method "
                "(close it on its own connection).",
            )
        raise _RpcError(JsonRpcCode.INVALID_PARAMS, "Unknown session_id (not closable here).")
    raise _RpcError(JsonRpcCode.METHOD_NOT_FOUND, f"Method not found: {method}", method)


def _initialize(params: dict[str, Any]) -> dict[str, Any]:
    requested = params.get("protocolVersion")
    version = requested if requested in _KNOWN_VERSIONS else PROTOCOL_VERSION
    return {
        "protocolVersion": version,
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": {"name": "envport", "version": __version__},
    }


async def _tools_call(session: Session, params: dict[str, Any]) -> dict[str, Any]:
    name = params.get("name")
    if not isinstance(name, str) or not name:
        raise _RpcError(JsonRpcCode.INVALID_PARAMS, "Missing 'name' in params (the tool to call).")
    arguments = params.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise _RpcError(
            JsonRpcCode.INVALID_PARAMS,
            f"'arguments' must be an object, got {type(arguments).__name__}.",
        )
    try:
        outcome = await call_tool(session, name, arguments)
    except ToolError as exc:  # unknown tool: MCP reports it as invalid params
        raise _RpcError(JsonRpcCode.INVALID_PARAMS, exc.message, exc.to_wire()) from exc
    except EnvportError as exc:
        raise _RpcError(JsonRpcCode.INTERNAL_ERROR, exc.message, exc.to_wire()) from exc
    return {**outcome.to_wire(), "data": outcome.value}
