"""One exception tree for envport, and the closed set of wire error codes.

::

    EnvportError
    ├── EnvError                    an environment misbehaved or was misused
    │   ├── EnvFactoryError         the environment could not be constructed
    │   ├── UnknownEnvError         no such id in the registry (lists the ones that exist)
    │   ├── EnvNotResetError        step()/state() before reset()
    │   ├── EnvClosedError          any call after close()
    │   ├── EnvTimeoutError         a call ran past its per-call deadline
    │   └── EnvExecutionError       the environment's own code raised
    ├── ActionValidationError       an action failed its schema (names the field)
    ├── ToolError                   unknown tool, bad arguments, or the tool raised
    ├── ProtocolError               a frame or request that is not the protocol
    │   └── PayloadTooLargeError
    ├── SessionError
    │   ├── CapacityError           the server is full; carries retry_after_s
    │   └── SessionNotFoundError    unknown/expired session id or resume token
    └── RemoteError                 the other end of a connection reported an error
        └── ConnectionLostError     the connection dropped and could not be resumed

Every error that crosses the wire carries one :class:`ErrorCode`. The first seven are
OpenEnv's own codes (its ``WSErrorCode``), so OpenEnv clients understand them; the rest
are envport's, and are only ever sent for requests OpenEnv's protocol cannot express.
Foreign exceptions are mapped to these once, at the boundary that sees them.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    """Wire error codes: the closed set envport servers send."""

    # OpenEnv's codes.
    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"
    # envport's additions.
    NOT_RESET = "NOT_RESET"
    SESSION_CLOSED = "SESSION_CLOSED"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    TIMEOUT = "TIMEOUT"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    TOOL_ERROR = "TOOL_ERROR"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"


#: HTTP status for each wire code, used by the HTTP routes.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.UNKNOWN_TYPE: 400,
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.EXECUTION_ERROR: 500,
    ErrorCode.CAPACITY_REACHED: 503,
    ErrorCode.FACTORY_ERROR: 500,
    ErrorCode.SESSION_ERROR: 409,
    ErrorCode.NOT_RESET: 409,
    ErrorCode.SESSION_CLOSED: 410,
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.TOOL_ERROR: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
}


class EnvportError(Exception):
    """Root of every error envport raises."""

    code: ErrorCode = ErrorCode.EXECUTION_ERROR

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def to_wire(self) -> dict[str, Any]:
        """The ``data`` of an OpenEnv error frame: message, code, then any details."""
        return {"message": self.message, "code": self.code.value, **self.details}


class EnvError(EnvportError):
    """An environment misbehaved or was used out of order."""


class EnvFactoryError(EnvError):
    """The environment could not be constructed."""

    code = ErrorCode.FACTORY_ERROR


class UnknownEnvError(EnvError, LookupError):
    """No environment is registered under this id, or its import path does not load.

    For an id, the message lists the registered ones and suggests the closest; for a
    ``package.module:Class`` path, ``reason`` says what failed (the import, the attribute).
    """

    code = ErrorCode.FACTORY_ERROR

    def __init__(self, env_id: str, known: Iterable[str], *, reason: str | None = None) -> None:
        if reason is not None:
            super().__init__(f"Cannot load environment {env_id!r}: {reason}.", env_id=env_id)
            self.suggestion: str | None = None
            return
        known = sorted(known)
        close = difflib.get_close_matches(env_id, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        listing = ", ".join(known) if known else "(none registered)"
        super().__init__(
            f"Unknown environment {env_id!r}.{hint} Registered: {listing}. "
            "A 'package.module:Class' path also works.",
            env_id=env_id,
        )
        self.suggestion = close[0] if close else None


class EnvNotResetError(EnvError):
    """``step`` or ``state`` was called before the first ``reset``."""

    code = ErrorCode.NOT_RESET


class EnvClosedError(EnvError):
    """The environment (or its session) was already closed."""

    code = ErrorCode.SESSION_CLOSED


class EnvTimeoutError(EnvError, TimeoutError):
    """An environment call ran past its deadline."""

    code = ErrorCode.TIMEOUT


class EnvExecutionError(EnvError):
    """The environment's own code raised."""

    code = ErrorCode.EXECUTION_ERROR


class ActionValidationError(EnvportError, ValueError):
    """An action (or reset option) does not match the environment's schema."""

    code = ErrorCode.VALIDATION_ERROR


class ToolError(EnvportError):
    """A tool call failed: unknown tool, invalid arguments, or the tool raised.

    ``kind`` uses OpenEnv's ``ToolErrorType`` values.
    """

    code = ErrorCode.TOOL_ERROR

    def __init__(self, message: str, *, kind: str, **details: Any) -> None:
        super().__init__(message, kind=kind, **details)
        self.kind = kind


class ProtocolError(EnvportError):
    """A frame or request that does not follow the protocol."""

    code = ErrorCode.UNKNOWN_TYPE
    #: The ``id`` of the frame refused, when it parsed (its error reply echoes it).
    frame_id: Any = None


class InvalidJSONError(ProtocolError):
    code = ErrorCode.INVALID_JSON


class PayloadTooLargeError(ProtocolError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class SessionError(EnvportError):
    code = ErrorCode.SESSION_ERROR


class CapacityError(SessionError):
    """The server has no room; retry after ``retry_after_s`` seconds."""

    code = ErrorCode.CAPACITY_REACHED

    def __init__(self, active: int, limit: int, retry_after_s: float) -> None:
        super().__init__(
            f"Server at capacity ({active}/{limit} sessions, wait queue full or timed out); "
            f"retry after {retry_after_s:g} s.",
            active_sessions=active,
            max_sessions=limit,
            retry_after_s=retry_after_s,
        )
        self.retry_after_s = retry_after_s


class SessionNotFoundError(SessionError, LookupError):
    code = ErrorCode.SESSION_NOT_FOUND


class UnauthorizedError(EnvportError):
    code = ErrorCode.UNAUTHORIZED


class ForbiddenError(EnvportError):
    """A valid credential used for something outside its scope."""

    code = ErrorCode.FORBIDDEN


class RemoteError(EnvportError):
    """The other end reported an error frame; ``code`` is what it sent."""

    def __init__(self, message: str, code: str, **details: Any) -> None:
        super().__init__(message, **details)
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = ErrorCode.EXECUTION_ERROR
        self.remote_code = code


class NoReplyError(RemoteError):
    """The other end sent no reply within the call's limit: it hung (or the link did).
    Code ``TIMEOUT``, like a deadline the server enforced, but raised by this side."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.TIMEOUT.value)


class ConnectionLostError(RemoteError, ConnectionError):
    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.SESSION_ERROR.value)


_BY_CODE: dict[ErrorCode, type[EnvportError]] = {
    ErrorCode.NOT_RESET: EnvNotResetError,
    ErrorCode.SESSION_CLOSED: EnvClosedError,
    ErrorCode.TIMEOUT: EnvTimeoutError,
    ErrorCode.VALIDATION_ERROR: ActionValidationError,
    ErrorCode.SESSION_NOT_FOUND: SessionNotFoundError,
    ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLargeError,
    ErrorCode.INVALID_JSON: InvalidJSONError,
    ErrorCode.UNKNOWN_TYPE: ProtocolError,
    ErrorCode.UNAUTHORIZED: UnauthorizedError,
    ErrorCode.FORBIDDEN: ForbiddenError,
}


def as_envport_error(exc: Exception) -> EnvportError:
    """``exc`` as an envport error: itself, or (an environment's bug that escaped
    classification) an :class:`EnvExecutionError` naming it, so it is still an answer."""
    if isinstance(exc, EnvportError):
        return exc
    return EnvExecutionError(f"{type(exc).__name__}: {exc}")


def from_wire(data: dict[str, Any]) -> EnvportError:
    """Rebuild the most specific local exception for a received error frame."""
    message = str(data.get("message", "unknown error"))
    raw_code = str(data.get("code", "EXECUTION_ERROR"))
    details = {k: v for k, v in data.items() if k not in ("message", "code")}
    try:
        code = ErrorCode(raw_code)
    except ValueError:
        return RemoteError(message, raw_code, **details)
    if code is ErrorCode.CAPACITY_REACHED:
        return CapacityError(
            int(details.get("active_sessions", 0)),
            int(details.get("max_sessions", 0)),
            float(details.get("retry_after_s", 1.0)),
        )
    if code is ErrorCode.TOOL_ERROR:
        kind = str(details.pop("kind", "execution_error"))
        return ToolError(message, kind=kind, **details)
    cls = _BY_CODE.get(code)
    if cls is None:
        return RemoteError(message, raw_code, **details)
    return cls(message, **details)


# --- an environment that cannot be built, reported by a server process ------------------

#: How a line on stderr that carries an environment's error as its wire form starts.
ENV_ERROR_MARK = "envport-env-error: "
#: Exit status of a server process whose environment could not be built.
ENV_ERROR_EXIT = 3


def env_error_line(exc: EnvportError) -> str:
    """The one line a server process prints when its environment cannot be built."""
    return f"{ENV_ERROR_MARK}{json.dumps(exc.to_wire(), default=str)}"


def env_error_in(text: str) -> EnvportError | None:
    """The environment error a server reported in ``text`` (its log, or a pod's
    termination message) with :func:`env_error_line`, rebuilt, if any."""
    for line in reversed(text.splitlines()):
        if line.startswith(ENV_ERROR_MARK):
            try:
                data = json.loads(line[len(ENV_ERROR_MARK) :])
            except ValueError:
                return None
            return from_wire(data) if isinstance(data, dict) else None
    return None
