"""Gateway errors, and the OpenAI- and Anthropic-shaped bodies they are answered with.

::

    EnvportError
    └── GatewayError                  a request the gateway answers with an HTTP error
        ├── BadRequestError           400: malformed JSON, missing rollout id, bad field
        ├── AuthenticationError       401: missing, unknown, expired or revoked token
        ├── PermissionDeniedError     403: wrong scope, or another rollout's id
        ├── RolloutNotFoundError      404: no such rollout (lists how to create one)
        ├── RolloutConflictError      409: a rollout id that is already taken
        ├── RolloutFinishedError      410: the rollout was finished; no more calls
        ├── NotImplementedRouteError  501: an API the gateway cannot translate yet
        ├── PausedError               503: paused for a weight update longer than the wait
        ├── TraceNotStoredError       503: a finished rollout's trace could not be stored
        └── UpstreamError             502: upstream down, invalid JSON, cut stream
            └── UpstreamTimeoutError  504: upstream did not answer within the budget

Each error is rendered in the dialect of the route that raised it: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` for ``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses`` and the admin routes, Anthropic's
``{"type": "error", "error": {"type", "message"}}`` for ``/v1/messages``.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from starlette.responses import Response

from envport.errors import EnvportError, ErrorCode

Dialect = Literal["openai", "anthropic"]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


#: OpenAI's error ``type`` for an HTTP status (the rest are ``server_error``).
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
}


def openai_type(status: int) -> str:
    """The OpenAI error ``type`` an answer with this HTTP status carries."""
    return _OPENAI_TYPES.get(status, "server_error")


class GatewayError(EnvportError):
    """A request the gateway refuses or cannot serve; ``status`` is its HTTP status."""

    status: int = 500
    type: str = "server_error"
    code = ErrorCode.EXECUTION_ERROR

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        error_code: str | None = None,
        retry_after_s: float | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message, **details)
        self.param = param
        self.error_code = error_code
        self.retry_after_s = retry_after_s

    def body(self, dialect: Dialect = "openai") -> dict[str, Any]:
        if dialect == "anthropic":
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.error_code,
            }
        }

    def response(self, dialect: Dialect = "openai") -> Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after_s)))
        return Response(
            orjson.dumps(self.body(dialect)),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )


class BadRequestError(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = ErrorCode.INVALID_JSON


class AuthenticationError(GatewayError):
    status = 401
    type = "authentication_error"
    code = ErrorCode.UNAUTHORIZED


class PermissionDeniedError(GatewayError):
    status = 403
    type = "permission_error"
    code = ErrorCode.UNAUTHORIZED


class RolloutNotFoundError(GatewayError, LookupError):
    status = 404
    type = "not_found_error"
    code = ErrorCode.SESSION_NOT_FOUND


class RolloutConflictError(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = ErrorCode.SESSION_ERROR


class RolloutFinishedError(GatewayError):
    status = 410
    type = "invalid_request_error"
    code = ErrorCode.SESSION_CLOSED


class NotImplementedRouteError(GatewayError):
    status = 501
    type = "not_implemented_error"


class PausedError(GatewayError):
    status = 503
    type = "service_unavailable_error"
    code = ErrorCode.CAPACITY_REACHED


class TraceNotStoredError(GatewayError):
    """The store failed a finished rollout's trace; the trace is kept, and finishing the
    rollout again stores it."""

    status = 503
    type = "service_unavailable_error"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"


class UpstreamTimeoutError(UpstreamError):
    status = 504
    type = "timeout_error"
    code = ErrorCode.TIMEOUT


def sse_error_event(message: str, *, type: str = "upstream_error") -> bytes:
    """An SSE event carrying an OpenAI-shaped error; the openai SDK raises it as APIError."""
    body = {"error": {"message": message, "type": type, "param": None, "code": None}}
    return b"data: " + orjson.dumps(body) + b"\n\n"
