"""Encoding and decoding of frames (orjson), with size and shape checks."""

from __future__ import annotations

from typing import Any

import orjson

from envport.errors import (
    EnvExecutionError,
    InvalidJSONError,
    PayloadTooLargeError,
    ProtocolError,
    as_envport_error,
)

#: Client frame types a server understands.
FRAME_TYPES = frozenset(
    {"reset", "step", "state", "close", "mcp", "hello", "open", "batch", "ping", "schema"}
)


def encode(frame: dict[str, Any]) -> bytes:
    """The frame as JSON; a reply that is not JSON-serialisable (an environment put a set
    or an arbitrary object in its ``info``) becomes an error reply, never a dropped
    connection."""
    try:
        return orjson.dumps(frame)
    except orjson.JSONEncodeError as exc:
        error = EnvExecutionError(
            f"The environment's {frame.get('type', 'reply')} could not be sent as JSON: {exc}."
        )
        return orjson.dumps(error_frame(error, frame.get("id")))


def decode_frame(raw: str | bytes, max_bytes: int) -> dict[str, Any]:
    """Parse one client frame or raise the protocol error that describes it."""
    size = len(raw)
    if type(raw) is str and size * 4 > max_bytes:  # characters, not bytes: count them
        size = len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise PayloadTooLargeError(
            f"Frame of {size} bytes exceeds the limit of {max_bytes} bytes.",
            limit_bytes=max_bytes,
        )
    try:
        frame = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSONError(f"Invalid JSON: {exc}") from exc
    if not isinstance(frame, dict):
        raise ProtocolError(
            f"A frame must be a JSON object, got {type(frame).__name__}.",
        )
    kind = frame.get("type")
    try:
        known = kind in FRAME_TYPES
    except TypeError:  # a list or an object: unhashable, so no type either
        known = False
    if not known:
        raise _refused(
            frame,
            f"Unknown message type: {kind!r}. Known: {', '.join(sorted(FRAME_TYPES))}.",
        )
    data = frame.get("data")
    if data is not None and not isinstance(data, dict | list):
        raise _refused(frame, f"'data' of a {kind!r} frame must be an object.")
    return frame


def _refused(frame: dict[str, Any], message: str) -> ProtocolError:
    """The error for a frame that parsed but is not the protocol; its reply carries the
    frame's id, so a client matching replies by id takes it for that frame's."""
    exc = ProtocolError(message)
    exc.frame_id = frame.get("id")
    return exc


def error_frame(exc: Exception, frame_id: Any = None) -> dict[str, Any]:
    """The error frame for ``exc`` (any exception: see :func:`as_envport_error`)."""
    out: dict[str, Any] = {"type": "error", "data": as_envport_error(exc).to_wire()}
    if frame_id is not None:
        out["id"] = frame_id
    return out
