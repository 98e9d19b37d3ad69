"""The wire protocol: OpenEnv's frames plus envport's opt-in extensions.

Client frames (OpenEnv): ``reset``, ``step``, ``state``, ``close``, ``mcp``.
envport's extensions, never sent to a client that did not ask for them:

* ``id``: any frame may carry one; the reply echoes it, so a late reply can never be
  taken for the next one.
* ``hello``: switches the connection to envport mode and answers with the session id
  and a resume token; ``{"type": "hello", "data": {"resume": TOKEN}}`` reattaches a
  client that lost its connection to its live session within the grace period.
* ``open``: another session on the same connection (for vectorised clients).
* ``batch``: ``reset``/``step``/``state`` for many sessions in one frame.
* ``schema``: the action/observation/state JSON Schemas and the tool list, without
  taking a step (OpenEnv has them only at ``GET /schema``).
"""

from envport.protocol.codec import (
    FRAME_TYPES,
    decode_frame,
    encode,
    error_frame,
)

__all__ = ["FRAME_TYPES", "decode_frame", "encode", "error_frame"]
