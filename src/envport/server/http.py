"""OpenEnv's HTTP routes, made stateful by an optional session header.

Without ``X-Envport-Session`` the routes behave as OpenEnv's do: each request gets a
fresh environment that is closed when the request ends. With it, ``/reset``, ``/step``
and ``/state`` act on one live session created by ``POST /sessions``, so an HTTP client
can play a whole episode. ``request_id`` in a body is echoed in the reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from envport.errors import (
    HTTP_STATUS,
    ActionValidationError,
    EnvExecutionError,
    EnvportError,
    InvalidJSONError,
    PayloadTooLargeError,
    as_envport_error,
)
from envport.server.security import check_json_body
from envport.server.sessions import SessionManager
from envport.session import Session

SESSION_HEADER = "x-envport-session"


def _json(data: Any) -> Response:
    """A reply; one that is not JSON-serialisable (a set in an environment's ``info``)
    becomes a 500 with an error body, as every other failure does."""
    try:
        return ORJSONResponse(data)
    except TypeError as exc:
        return error_response(EnvExecutionError(f"The reply could not be sent as JSON: {exc}"))


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(exc: Exception) -> Response:
    """The error answer for ``exc`` (any exception: see :func:`as_envport_error`)."""
    exc = as_envport_error(exc)
    body = {"detail": exc.message, "error": exc.to_wire()}
    headers = {}
    if "retry_after_s" in exc.details:
        headers["Retry-After"] = str(max(1, round(float(exc.details["retry_after_s"]))))
    status = getattr(exc, "http_status", None) or HTTP_STATUS[exc.code]
    return ORJSONResponse(body, status_code=status, headers=headers)


def _manager(request: Request) -> SessionManager:
    manager: SessionManager = request.app.state.manager
    return manager


async def _body(request: Request) -> dict[str, Any]:
    limit = _manager(request).config.max_frame_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"Body of {declared} bytes exceeds {limit} bytes.")
    # Counted as it arrives: a chunked body has no Content-Length, and read whole first
    # it could be any size (never more than the limit and one chunk held).
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > limit:
            raise PayloadTooLargeError(f"The body exceeds {limit} bytes.")
    raw = bytes(received)
    # Only JSON: a text/plain or form body is what a web page may post cross-site
    # without a CORS preflight (envport.server.security).
    check_json_body(request.headers.get("content-type"), raw)
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSONError(f"Invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ActionValidationError("The request body must be a JSON object.")
    return body


@asynccontextmanager
async def _session_for(request: Request) -> AsyncIterator[tuple[Session, bool]]:
    """The session the header names (kept), or a throwaway one (closed afterwards)."""
    manager = _manager(request)
    token = request.headers.get(SESSION_HEADER)
    if token:
        session = manager.by_token(token)
        session.attach()  # never reaped while a request is using it
        try:
            yield session, True
        finally:
            session.detach()
            if session.id not in manager.resumable:
                session.detached_at = None  # HTTP sessions expire by idleness, not grace
            # else a session a WebSocket dropped: its resume grace runs from now
        return
    session = await manager.create()
    try:
        yield session, False
    finally:
        await manager.close(session)


def _reply(data: dict[str, Any], body: dict[str, Any], session: Session, stateful: bool) -> Any:
    if "request_id" in body:
        data["request_id"] = body["request_id"]
    if stateful:
        data["session_id"] = session.id
    return data


async def reset(request: Request) -> Response:
    try:
        body = await _body(request)
        options = {k: v for k, v in body.items() if k != "request_id"}
        async with _session_for(request) as (session, stateful):
            result = await session.reset(**options)
            data = _reply(result.to_wire(extended=stateful), body, session, stateful)
    except Exception as exc:  # an envport error, or an env bug: an answer either way
        return error_response(exc)
    return _json(data)


async def step(request: Request) -> Response:
    try:
        body = await _body(request)
        action = body.get("action")
        if not isinstance(action, dict):
            raise ActionValidationError(
                "The body must be {'action': {...}}.", errors=[{"field": "action"}]
            )
        async with _session_for(request) as (session, stateful):
            if not stateful:  # OpenEnv semantics: a fresh environment per request
                await session.reset()
            result = await session.step(action)
            data = _reply(result.to_wire(extended=stateful), body, session, stateful)
    except Exception as exc:  # an envport error, or an env bug: an answer either way
        return error_response(exc)
    return _json(data)


async def state(request: Request) -> Response:
    try:
        async with _session_for(request) as (session, stateful):
            if not stateful:
                data = session.env.state_type().model_dump(mode="json")
            else:
                data = (await session.state()).model_dump(mode="json")
    except Exception as exc:  # an envport error, or an env bug: an answer either way
        return error_response(exc)
    return _json(data)


async def create_session(request: Request) -> Response:
    manager = _manager(request)
    try:
        await _body(request)  # no options yet; a body, if any, must be JSON
        session = await manager.create()
    except EnvportError as exc:
        return error_response(exc)
    return ORJSONResponse(
        {
            "session_id": session.id,
            "token": session.token,
            "tools_token": session.tools_token,
            "header": "X-Envport-Session",
            "idle_timeout_s": manager.config.idle_timeout_s,
        },
        status_code=201,
    )


async def delete_session(request: Request) -> Response:
    manager = _manager(request)
    try:
        session = manager.by_token(request.headers.get(SESSION_HEADER, ""))
    except EnvportError as exc:
        return error_response(exc)
    await manager.close(session)
    return Response(status_code=204)


async def health(request: Request) -> Response:
    return ORJSONResponse({"status": "healthy"})


async def stats(request: Request) -> Response:
    out = _manager(request).stats()
    watchdog = getattr(request.app.state, "watchdog", None)
    if watchdog is not None:
        out.update(watchdog.stats())
    return ORJSONResponse(out)


async def metadata(request: Request) -> Response:
    return ORJSONResponse(request.app.state.metadata.model_dump(mode="json"))


async def schema(request: Request) -> Response:
    return ORJSONResponse(request.app.state.schemas)


async def openapi(request: Request) -> Response:
    return ORJSONResponse(request.app.state.openapi)
