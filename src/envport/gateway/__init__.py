"""The model gateway: forwards and records every model call of an unmodified agent.

* :mod:`envport.gateway.app` — :class:`Gateway` and :func:`create_gateway_app` (routes,
  streaming relay, status codes).
* :mod:`envport.gateway.auth` — scoped tokens: the orchestrator's and each rollout's agent's.
* :mod:`envport.gateway.upstream` — least-loaded sticky routing, retries, pause/drain.
* :mod:`envport.gateway.http1` — the lean keep-alive HTTP/1.1 client of the upstream hop.
* :mod:`envport.gateway.writer` — traces written in batches, in the background.
* :mod:`envport.gateway.capture` — what is recorded for each call, and the trainer's
  :class:`GatewayPolicy`.
* :mod:`envport.gateway.translate` — Anthropic Messages and OpenAI Responses over chat.
* :mod:`envport.gateway.__main__` — :func:`serve_gateway`, ``python -m envport.gateway``.
"""

from envport.gateway.app import Gateway, RolloutGrant, create_gateway_app
from envport.gateway.auth import Grant, Scope, TokenRegistry
from envport.gateway.capture import FinishRequest, GatewayPolicy, RolloutInfo, RolloutView
from envport.gateway.errors import GatewayError
from envport.gateway.serve import serve_gateway
from envport.gateway.upstream import PauseGate, RetryPolicy, UpstreamPool

__all__ = [
    "FinishRequest",
    "Gateway",
    "GatewayError",
    "GatewayPolicy",
    "Grant",
    "PauseGate",
    "RetryPolicy",
    "RolloutGrant",
    "RolloutInfo",
    "RolloutView",
    "Scope",
    "TokenRegistry",
    "UpstreamPool",
    "create_gateway_app",
    "serve_gateway",
]
