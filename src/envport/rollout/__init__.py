"""The rollout controller: pools, deadlines, retries and backends for environments.

* :mod:`envport.rollout.controller` — :class:`Controller`: rollouts (task x harness x
  attempt budget) under global and per-environment limits, stage deadlines, heartbeat
  hang detection, retries on fresh instances, exactly-once results across restarts.
* :mod:`envport.rollout.state` — the rollout and attempt state machines, persisted in the
  trace store.
* :mod:`envport.rollout.pool` — :class:`EnvPool`: warm pools of instances, leases,
  recycling, backpressure.
* :mod:`envport.rollout.backends` — where instances run: in-process, local processes,
  sandboxes, Ray, Kubernetes, all behind :class:`~envport.rollout.backends.Backend`.
"""

from envport.rollout.backends.base import Backend, BackendError, EnvInstance, EnvLaunch
from envport.rollout.backends.inprocess import InProcessBackend
from envport.rollout.backends.local import LocalProcessBackend
from envport.rollout.controller import (
    Controller,
    ControllerConfig,
    ControllerConflictError,
    ControllerSummary,
    Harness,
    RolloutEvent,
    RolloutResult,
    RolloutSpec,
    classify,
    heartbeat,
    rollout_id,
)
from envport.rollout.pool import EnvPool, Lease, PoolClosedError, PoolStats
from envport.rollout.state import AttemptState, IllegalTransitionError, RolloutState

__all__ = [
    "AttemptState",
    "Backend",
    "BackendError",
    "Controller",
    "ControllerConfig",
    "ControllerConflictError",
    "ControllerSummary",
    "EnvInstance",
    "EnvLaunch",
    "EnvPool",
    "Harness",
    "IllegalTransitionError",
    "InProcessBackend",
    "Lease",
    "LocalProcessBackend",
    "PoolClosedError",
    "PoolStats",
    "RolloutEvent",
    "RolloutResult",
    "RolloutSpec",
    "RolloutState",
    "classify",
    "heartbeat",
    "rollout_id",
]
