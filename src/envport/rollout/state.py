"""The rollout and attempt state machines, persisted in the trace store.

A *rollout* is one run of a task that must end in exactly one trace; an *attempt* is one
try at it on one environment instance. Both move through explicit states, and every
change is written to the store (tables ``rollouts`` and ``attempts``) before the
controller acts on it, so a controller that restarts knows what was in flight.

::

    rollout:  pending ─▶ starting_env ─▶ running ─▶ scoring ─▶ succeeded
                 ▲            │  │          │  │       │  └──▶ failed
                 │            │  └──────────┴──┴───────┴─────▶ retrying ─▶ starting_env
                 └────────────┴── (controller restart: requeued) ◀──────────┘

    attempt:  starting_env ─▶ running ─▶ scoring ─▶ succeeded | failed
                   └──────────┴───────────┴──▶ failed | abandoned (controller restart)

``succeeded`` and ``failed`` are final for a rollout; a failed rollout carries its
classified error and no reward (never a 0). An illegal transition is a bug in the
controller and raises :class:`IllegalTransitionError`.
"""

from __future__ import annotations

from enum import StrEnum

from envport.errors import EnvportError


class IllegalTransitionError(EnvportError):
    """A rollout or attempt was moved between states the state machine does not join."""


class RolloutState(StrEnum):
    PENDING = "pending"
    STARTING_ENV = "starting_env"
    RUNNING = "running"
    SCORING = "scoring"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (RolloutState.SUCCEEDED, RolloutState.FAILED)

    @property
    def in_flight(self) -> bool:
        return self in (RolloutState.STARTING_ENV, RolloutState.RUNNING, RolloutState.SCORING)

    def check(self, new: RolloutState) -> RolloutState:
        """``new`` if the machine allows ``self -> new``, else :class:`IllegalTransitionError`."""
        if new not in _ROLLOUT_NEXT[self]:
            allowed = ", ".join(s.value for s in _ROLLOUT_NEXT[self]) or "(none: final)"
            raise IllegalTransitionError(
                f"rollout cannot go from {self.value!r} to {new.value!r}; allowed: {allowed}"
            )
        return new


class AttemptState(StrEnum):
    STARTING_ENV = "starting_env"
    RUNNING = "running"
    SCORING = "scoring"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ABANDONED = "abandoned"

    @property
    def is_final(self) -> bool:
        return self in (AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.ABANDONED)

    def check(self, new: AttemptState) -> AttemptState:
        if new not in _ATTEMPT_NEXT[self]:
            allowed = ", ".join(s.value for s in _ATTEMPT_NEXT[self]) or "(none: final)"
            raise IllegalTransitionError(
                f"attempt cannot go from {self.value!r} to {new.value!r}; allowed: {allowed}"
            )
        return new


_R = RolloutState
_ROLLOUT_NEXT: dict[RolloutState, frozenset[RolloutState]] = {
    _R.PENDING: frozenset({_R.STARTING_ENV}),
    _R.STARTING_ENV: frozenset({_R.RUNNING, _R.RETRYING, _R.FAILED, _R.PENDING}),
    _R.RUNNING: frozenset({_R.SCORING, _R.RETRYING, _R.FAILED, _R.PENDING}),
    _R.SCORING: frozenset({_R.SUCCEEDED, _R.RETRYING, _R.FAILED, _R.PENDING}),
    _R.RETRYING: frozenset({_R.STARTING_ENV, _R.FAILED, _R.PENDING}),
    _R.SUCCEEDED: frozenset(),
    _R.FAILED: frozenset(),
}

_A = AttemptState
_ATTEMPT_NEXT: dict[AttemptState, frozenset[AttemptState]] = {
    _A.STARTING_ENV: frozenset({_A.RUNNING, _A.FAILED, _A.ABANDONED}),
    _A.RUNNING: frozenset({_A.SCORING, _A.FAILED, _A.ABANDONED}),
    _A.SCORING: frozenset({_A.SUCCEEDED, _A.FAILED, _A.ABANDONED}),
    _A.SUCCEEDED: frozenset(),
    _A.FAILED: frozenset(),
    _A.ABANDONED: frozenset(),
}
