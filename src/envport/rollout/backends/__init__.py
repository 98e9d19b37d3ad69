"""Environment backends behind one interface (see :mod:`.base`)."""

from envport.rollout.backends.base import (
    Backend,
    BackendError,
    BackendUnavailableError,
    EnvInstance,
    EnvLaunch,
    Limits,
)

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "EnvInstance",
    "EnvLaunch",
    "Limits",
]
