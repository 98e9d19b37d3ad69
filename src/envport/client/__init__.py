"""Clients for envport (and OpenEnv) environment servers."""

from envport.client.client import ClientStepResult, EnvClient
from envport.client.sync import SyncEnvClient
from envport.client.transports import (
    HTTPTransport,
    InProcessTransport,
    Transport,
    WebSocketTransport,
)

__all__ = [
    "ClientStepResult",
    "EnvClient",
    "HTTPTransport",
    "InProcessTransport",
    "SyncEnvClient",
    "Transport",
    "WebSocketTransport",
]
