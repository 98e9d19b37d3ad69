"""Built-in environments, registered under versioned ids."""

from __future__ import annotations

from envport.registry import register


def register_builtins() -> None:
    register("echo-v1", "envport.envs.echo:EchoEnv", description="Echoes messages back.")


register_builtins()
