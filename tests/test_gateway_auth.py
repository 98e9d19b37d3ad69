"""TokenRegistry: scoped tokens, and the memory of tokens that passed a check."""

from __future__ import annotations

import time

import pytest

from envport.gateway import auth
from envport.gateway.auth import Scope, TokenRegistry
from envport.gateway.errors import AuthenticationError


def _code(registry: TokenRegistry, token: str) -> str:
    with pytest.raises(AuthenticationError) as caught:
        registry.check(token)
    return str(caught.value.error_code)


def test_a_token_checked_before_is_refused_once_revoked(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []
    digest = auth._digest
    monkeypatch.setattr(auth, "_digest", lambda token: hashed.append(token) or digest(token))
    registry = TokenRegistry()
    token, _ = registry.issue_agent("r1", ttl_s=None)
    other, _ = registry.issue_agent("r2", ttl_s=None)
    hashed.clear()
    for _ in range(3):
        grant = registry.check(token)
        assert (grant.scope, grant.rollout_id) == (Scope.AGENT, "r1")
    assert hashed == [token]  # hashed once: the next checks were answered from memory
    registry.check(other)
    registry.revoke_rollout("r1")
    assert _code(registry, token) == "invalid_token"
    assert registry.check(other).rollout_id == "r2"  # the other rollout's is unaffected
    assert registry.check(registry.orchestrator_token).scope is Scope.ORCHESTRATOR


def test_a_remembered_token_still_expires_and_is_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_000_000.0]
    monkeypatch.setattr(auth.time, "time", lambda: now[0])
    registry = TokenRegistry()
    token, grant = registry.issue_agent("r1", ttl_s=60)
    assert registry.check(token) == grant
    now[0] += 61
    assert _code(registry, token) == "expired_token"
    assert registry.prune() == 1
    assert _code(registry, token) == "invalid_token"  # forgotten, not only expired


def test_restoring_a_digest_replaces_what_was_remembered_for_it() -> None:
    registry = TokenRegistry()
    token, _ = registry.issue_agent("r1", ttl_s=None)
    registry.check(token)
    digest = registry.digest_of("r1")
    assert digest is not None
    registry.restore_agent("r1", digest, expires_at=time.time() - 1)  # restored as expired
    assert _code(registry, token) == "expired_token"


def test_the_memory_is_bounded_and_every_token_still_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "_CHECKED_MAX", 3)
    registry = TokenRegistry()
    tokens = [registry.issue_agent(f"r{i}", ttl_s=None)[0] for i in range(10)]
    for _ in range(2):
        for i, token in enumerate(tokens):
            assert registry.check(token).rollout_id == f"r{i}"
    assert len(registry._checked) <= 3
    registry.revoke_rollout("r9")  # remembered (checked last): forgotten with it
    assert _code(registry, tokens[9]) == "invalid_token"
