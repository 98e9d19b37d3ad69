"""Helpers for the rollout backends' tests (in-process, local, sandbox, Ray, Kubernetes)."""

from __future__ import annotations

from envport.rollout.backends.base import EnvInstance


async def echo(instance: EnvInstance, message: str) -> str:
    """Open a session on an ``echo-v1`` instance, reset, step ``message``; what it echoed."""
    async with instance.client() as env:
        await env.reset()
        result = await env.step({"message": message})
    return str(result.observation["echoed_message"])
