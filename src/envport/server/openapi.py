"""``GET /openapi.json``: an OpenAPI 3.1 description of the server's HTTP routes.

OpenEnv's servers (FastAPI) publish one, and ``openenv validate --url`` reads it: its
``info.version`` is the OpenEnv HTTP API version the server speaks (``1.0.0``, as
OpenEnv's own), and its ``paths`` tell the validator the server's mode (``/reset``,
``/step`` and ``/state`` present: simulation). The document is built once per app from
the environment's action, observation and state schemas; ``/ws`` (WebSocket), which
OpenAPI cannot describe, is named in ``info.description``.
"""

from __future__ import annotations

import copy
from typing import Any

from envport import __version__

#: The OpenEnv HTTP API version envport's routes follow (OpenEnv's servers say the same).
OPENENV_API_VERSION = "1.0.0"

_REF = "#/components/schemas/"
_SESSION_HEADER = {
    "name": "X-Envport-Session",
    "in": "header",
    "required": False,
    "description": "A session's control token (from POST /sessions): act on that live "
    "session. Without it the request gets a fresh environment (OpenEnv's stateless HTTP).",
    "schema": {"type": "string"},
}


def _hoist(name: str, schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """Put ``schema`` into ``components`` as ``name``, its ``$defs`` beside it (renamed
    on a clash), every ``#/$defs/X`` reference rewritten to point there; returns a
    reference to it."""
    schema = copy.deepcopy(schema)
    defs: dict[str, Any] = schema.pop("$defs", {}) or {}
    mapping: dict[str, str] = {}
    for key, value in defs.items():
        target = key
        while target in components and components[target] != value:
            target = f"{name}_{target}"
        mapping[key] = target
    target = name
    while target in components or target in mapping.values():
        target = f"{target}_"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                out["$ref"] = _REF + mapping.get(ref[8:], ref[8:])
            elif ref == "#":  # a recursive model's reference to itself
                out["$ref"] = _REF + target
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for key, value in defs.items():
        components[mapping[key]] = rewrite(value)
    components[target] = rewrite(schema)
    return {"$ref": _REF + target}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document(
    *, title: str, description: str, schemas: dict[str, Any], mcp: bool
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an envport server for one environment."""
    components: dict[str, Any] = {}
    action = _hoist("Action", schemas.get("action") or {"type": "object"}, components)
    observation = _hoist(
        "Observation", schemas.get("observation") or {"type": "object"}, components
    )
    state = _hoist("State", schemas.get("state") or {"type": "object"}, components)
    components["ErrorBody"] = {
        "type": "object",
        "properties": {
            "detail": {"type": "string"},
            "error": {
                "type": "object",
                "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                "required": ["code", "message"],
                "additionalProperties": True,
            },
        },
        "required": ["detail", "error"],
    }
    components["StepReply"] = {
        "type": "object",
        "properties": {
            "observation": observation,
            "reward": {"type": ["number", "null"]},
            "done": {"type": "boolean"},
            "request_id": {"description": "The request's request_id, echoed."},
            "session_id": {"type": "string", "description": "With X-Envport-Session."},
        },
        "required": ["observation", "done"],
        "additionalProperties": True,
    }
    error = _json({"$ref": _REF + "ErrorBody"}, "An error: its wire code and message.")
    errors = {"4XX": error, "5XX": error}
    step_reply = _json({"$ref": _REF + "StepReply"}, "The observation, reward and done.")
    session = [_SESSION_HEADER]

    def get(summary: str, reply: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": reply, **errors}, **extra}}

    paths: dict[str, Any] = {
        "/reset": {
            "post": {
                "summary": "Start an episode.",
                "parameters": session,
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "seed": {"type": ["integer", "null"]},
                                    "episode_id": {"type": ["string", "null"]},
                                    "request_id": {},
                                },
                                "additionalProperties": True,
                                "description": "Reset options: the environment's own "
                                "keyword arguments besides seed and episode_id.",
                            }
                        }
                    },
                },
                "responses": {"200": step_reply, **errors},
            }
        },
        "/step": {
            "post": {
                "summary": "Take one action.",
                "parameters": session,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {"action": action, "request_id": {}},
                                "required": ["action"],
                                "additionalProperties": True,
                            }
                        }
                    },
                },
                "responses": {"200": step_reply, **errors},
            }
        },
        "/state": get("The episode's state.", _json(state, "The state."), parameters=session),
        "/health": get(
            "Liveness.",
            _json(
                {"type": "object", "properties": {"status": {"const": "healthy"}}},
                "Healthy.",
            ),
        ),
        "/metadata": get(
            "The environment's name, description and version.",
            _json({"type": "object", "additionalProperties": True}, "The metadata."),
        ),
        "/schema": get(
            "JSON Schemas of the action, observation and state (and the tools).",
            _json(
                {
                    "type": "object",
                    "properties": {"action": action, "observation": observation, "state": state},
                    "additionalProperties": True,
                },
                "The schemas.",
            ),
        ),
        "/stats": get(
            "Session counts and event-loop stall counters.",
            _json({"type": "object", "additionalProperties": True}, "The counters."),
        ),
        "/sessions": {
            "post": {
                "summary": "Create a live session for HTTP (and MCP) requests.",
                "responses": {
                    "201": _json(
                        {
                            "type": "object",
                            "properties": {
                                "session_id": {"type": "string"},
                                "token": {"type": "string"},
                                "tools_token": {"type": "string"},
                                "header": {"type": "string"},
                                "idle_timeout_s": {"type": "number"},
                            },
                            "required": ["session_id", "token", "tools_token"],
                        },
                        "The session and its tokens.",
                    ),
                    **errors,
                },
            },
            "delete": {
                "summary": "Close the session X-Envport-Session names.",
                "parameters": [{**_SESSION_HEADER, "required": True}],
                "responses": {"204": {"description": "Closed."}, **errors},
            },
        },
    }
    if mcp:
        rpc = {"type": "object", "properties": {"jsonrpc": {"const": "2.0"}}}
        paths["/mcp"] = {
            "post": {
                "summary": "MCP (Streamable HTTP), or one plain JSON-RPC request "
                "(OpenEnv's clients): the environment's tools.",
                "requestBody": {"required": True, "content": {"application/json": {"schema": rpc}}},
                "responses": {
                    "200": {
                        "description": "A JSON-RPC answer (or an MCP event stream).",
                        "content": {"application/json": {"schema": rpc}, "text/event-stream": {}},
                    },
                    "202": {"description": "A notification or response, accepted."},
                },
            },
            "get": {
                "summary": "An MCP session's server-to-client event stream.",
                "responses": {"200": {"description": "An event stream."}},
            },
            "delete": {
                "summary": "End an MCP session.",
                "responses": {"200": {"description": "Ended."}},
            },
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": OPENENV_API_VERSION,
            "description": f"{description}\n\nOpenEnv's HTTP API, served by envport "
            f"{__version__}. WebSocket: /ws (OpenEnv's frames; see envport's "
            "docs/protocol.md).",
            "x-envport-version": __version__,
        },
        "paths": paths,
        "components": {"schemas": components},
    }
