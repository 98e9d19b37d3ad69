"""Scoped bearer tokens: one for the orchestrator, one per rollout for its agent.

Two scopes, nothing in between:

* **orchestrator** — creates and finishes rollouts (and posts their rewards), pauses and
  resumes the gateway, reads every rollout and the stats, and may make model calls on
  behalf of any live rollout.
* **agent** — makes model calls for *its own* rollout, and nothing else. It cannot read
  recorded calls (its own included), pause, finish, or act as another rollout.

Tokens are random (``secrets.token_urlsafe``), carry a recognisable prefix (``epo_`` /
``epa_``) so a leaked one is easy to find in logs, and are stored (the gateway's SQLite
file) only as SHA-256 digests. A token that passed a check is remembered in memory until
it is revoked, so the next call with it is not hashed again: on the model call's path a
cold SHA-256 costs more than the rest of the check. Agent tokens expire after a TTL and
are revoked when their rollout is finished. A request presents its token as
``Authorization: Bearer …`` (the openai SDK, recent anthropic SDKs) or ``x-api-key: …``
(older anthropic SDKs).

Denials: a missing, unknown, expired or revoked token is **401**; a valid token used out
of its scope (an agent on an admin route, an agent naming another rollout) is **403**.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
from collections.abc import Mapping
from enum import StrEnum

from envport.gateway.errors import AuthenticationError, PermissionDeniedError


class Scope(StrEnum):
    ORCHESTRATOR = "orchestrator"
    AGENT = "agent"


@dataclasses.dataclass(frozen=True)
class Grant:
    """What a token allows: its scope, its rollout (agents), and when it expires."""

    scope: Scope
    rollout_id: str | None = None
    expires_at: float | None = None  # time.time(); None: never

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at

    def require_orchestrator(self, what: str) -> None:
        if self.scope is not Scope.ORCHESTRATOR:
            raise PermissionDeniedError(
                f"{what} needs the orchestrator token; an agent token may only make "
                "model calls for its own rollout.",
                error_code="wrong_scope",
            )

    def require_rollout(self, rollout_id: str) -> None:
        """Allow model calls for ``rollout_id``: the orchestrator, or that rollout's agent."""
        if self.scope is Scope.AGENT and self.rollout_id != rollout_id:
            raise PermissionDeniedError(
                f"This token belongs to another rollout; it cannot call as {rollout_id!r}.",
                error_code="wrong_rollout",
            )


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def token_from_headers(headers: Mapping[str, str]) -> str | None:
    """The token of ``Authorization: Bearer …``, else of ``x-api-key``; None if neither."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key")
    return key.strip() or None if key else None


class TokenRegistry:
    """Issues, checks and revokes tokens (kept in memory; the gateway writes live
    rollouts' digests to its SQLite file, :mod:`envport.gateway.registry`)."""

    def __init__(self, orchestrator_token: str | None = None) -> None:
        self.orchestrator_token = orchestrator_token or new_token(Scope.ORCHESTRATOR)
        self._grants: dict[str, Grant] = {
            _digest(self.orchestrator_token): Grant(Scope.ORCHESTRATOR)
        }
        self._by_rollout: dict[str, str] = {}
        # tokens that passed a check, and by digest (to forget them when revoked)
        self._checked: dict[str, Grant] = {}
        self._checked_digest: dict[str, str] = {}

    def issue_agent(self, rollout_id: str, ttl_s: float | None) -> tuple[str, Grant]:
        token = new_token(Scope.AGENT)
        expires = None if ttl_s is None else time.time() + ttl_s
        grant = Grant(Scope.AGENT, rollout_id, expires)
        digest = _digest(token)
        self._grants[digest] = grant
        self._by_rollout[rollout_id] = digest
        return token, grant

    def digest_of(self, rollout_id: str) -> str | None:
        """The SHA-256 digest of a rollout's agent token (what is kept, never the token)."""
        return self._by_rollout.get(rollout_id)

    def restore_agent(self, rollout_id: str, digest: str, expires_at: float | None) -> Grant:
        """Accept again the agent token whose digest is ``digest`` (after a restart)."""
        grant = Grant(Scope.AGENT, rollout_id, expires_at)
        self._forget(digest)
        self._grants[digest] = grant
        self._by_rollout[rollout_id] = digest
        return grant

    def revoke_rollout(self, rollout_id: str) -> None:
        digest = self._by_rollout.pop(rollout_id, None)
        if digest is not None:
            self._grants.pop(digest, None)
            self._forget(digest)

    def check(self, token: str | None) -> Grant:
        """The grant of ``token``; :class:`AuthenticationError` (401) if it has none."""
        if not token:
            raise AuthenticationError(
                "No token. Send 'Authorization: Bearer <token>' or 'x-api-key: <token>' "
                "with the token POST /admin/rollouts returned.",
                error_code="missing_token",
            )
        grant = self._checked.get(token)
        if grant is None:
            digest = _digest(token)
            grant = self._grants.get(digest)
            if grant is None:
                raise AuthenticationError(
                    "Unknown or revoked token (tokens are revoked when their rollout finishes).",
                    error_code="invalid_token",
                )
            if len(self._checked) >= _CHECKED_MAX:  # (more live tokens than that: rare)
                self._checked.clear()
                self._checked_digest.clear()
            self._checked[token] = grant
            self._checked_digest[digest] = token
        if grant.expired():
            raise AuthenticationError(
                "The token has expired; ask the orchestrator for a new rollout.",
                error_code="expired_token",
            )
        return grant

    def prune(self) -> int:
        """Forget expired agent tokens; returns how many."""
        now = time.time()
        dead = [d for d, g in self._grants.items() if g.expired(now)]
        for d in dead:
            grant = self._grants.pop(d)
            self._forget(d)
            if grant.rollout_id is not None and self._by_rollout.get(grant.rollout_id) == d:
                del self._by_rollout[grant.rollout_id]
        return len(dead)

    def _forget(self, digest: str) -> None:
        token = self._checked_digest.pop(digest, None)
        if token is not None:
            self._checked.pop(token, None)


_CHECKED_MAX = 100_000


def new_token(scope: Scope) -> str:
    prefix = "epo_" if scope is Scope.ORCHESTRATOR else "epa_"
    return prefix + secrets.token_urlsafe(32)
