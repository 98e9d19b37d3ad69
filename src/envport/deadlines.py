"""Calls that declare how long they may take.

An action (or a tool call's arguments) with a numeric ``timeout_s`` says how long the
environment may work on it: a shell command running a test suite for ten minutes is not
a hung environment. Every layer that puts a deadline on one call honours it (the
session's call deadline, a client transport's reply wait, the rollout controller's hang
watchdog): the deadline for that call becomes ``timeout_s`` plus :data:`GRACE_S`, when
that is longer than the layer's own. The environment enforces ``timeout_s`` itself (it
kills the command), so the extended deadline is only the backstop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

#: Seconds past a call's declared ``timeout_s`` before a layer gives up on it: time for
#: the environment to kill the command and answer.
GRACE_S = 10.0

#: The longest a call may declare (one day); a larger value counts as this.
MAX_DECLARED_S = 86_400.0

#: When the stage the current task runs in must end, on :func:`time.monotonic`'s clock;
#: ``None`` when no deadline is known. Set by whoever runs a stage under a deadline (the
#: rollout controller, for its agent stage), in the stage's own task; read with
#: :func:`stage_time_left` by work with a deadline of its own that must end first (a
#: CLI agent's harness, so that it stops the agent itself and records why).
stage_deadline: ContextVar[float | None] = ContextVar("envport_stage_deadline", default=None)


def stage_time_left() -> float | None:
    """Seconds left before :data:`stage_deadline` (negative once past); ``None`` if unset."""
    deadline = stage_deadline.get()
    return None if deadline is None else deadline - time.monotonic()


def declared_timeout(payload: Any) -> float | None:
    """The ``timeout_s`` a step declares (the action's own, or a tool call's
    ``arguments``), if it is a positive finite number; else None."""
    value: Any = None
    if type(payload) is dict or isinstance(payload, Mapping):
        value = payload.get("timeout_s")
        arguments = payload.get("arguments")
        if value is None and isinstance(arguments, Mapping):
            value = arguments.get("timeout_s")
    else:
        value = getattr(payload, "timeout_s", None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return min(float(value), MAX_DECLARED_S)


def extended(base_s: float | None, declared: float | None) -> float | None:
    """A layer's deadline ``base_s`` for a call that ``declared`` its ``timeout_s``:
    ``timeout_s + GRACE_S`` when that is longer. None (no deadline) stays None."""
    if base_s is None or declared is None:
        return base_s
    return max(base_s, declared + GRACE_S)


def call_deadline(base_s: float | None, payload: Any) -> float | None:
    """The deadline for one call with ``payload`` (see :func:`extended`)."""
    return extended(base_s, declared_timeout(payload))


def frame_timeout(frame: Mapping[str, Any]) -> float | None:
    """The ``timeout_s`` a client frame declares: a ``step``'s action (or its tool call's
    arguments), an ``mcp`` ``tools/call``'s arguments, the longest of a ``batch``'s."""
    kind, data = frame.get("type"), frame.get("data")
    if kind == "step":
        return declared_timeout(data)
    if kind == "mcp" and isinstance(data, Mapping):
        return declared_timeout(data.get("params"))
    if kind == "batch" and isinstance(data, list):
        declared = [frame_timeout(item) for item in data if isinstance(item, Mapping)]
        return max((d for d in declared if d is not None), default=None)
    return None
