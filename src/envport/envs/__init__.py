"""Built-in environments, registered under versioned ids.

==================  ==============================================================
``echo-v1``         echoes messages back (the smallest complete environment)
``guess-number-v1`` guess an integer with higher/lower feedback
``guess-word-v1``   guess a five-letter word with Wordle letter feedback
``arithmetic-v1``   one arithmetic question, verifiable reward
``sql-db-v1``       answer a question about a SQLite database with SQL tools
``shell-v1``        a sandboxed bash workspace with Harbor's paths (Harbor tasks run here)
``sandbox-v1``      a task's repository in an envport.sandbox sandbox: persistent shell,
                    snapshot/restore reset, fork for trainers
==================  ==============================================================

Entry points are import paths, so importing this package stays cheap: an environment's
module is imported the first time it is made.
"""

from __future__ import annotations

from envport.registry import register


def register_builtins() -> None:
    register("echo-v1", "envport.envs.echo:EchoEnv", description="Echoes messages back.")
    register(
        "guess-number-v1",
        "envport.envs.guess:GuessNumberEnv",
        description="Guess a secret integer with higher/lower feedback.",
    )
    register(
        "guess-word-v1",
        "envport.envs.guess:GuessWordEnv",
        description="Guess a five-letter word with Wordle-style letter feedback.",
    )
    register(
        "arithmetic-v1",
        "envport.envs.arithmetic:ArithmeticEnv",
        description="Answer one arithmetic question; reward 1 if exactly right.",
    )
    register(
        "sql-db-v1",
        "envport.envs.sqldb:SqlDbEnv",
        description="Answer a question about a SQLite database using read-only SQL tools.",
    )
    register(
        "shell-v1",
        "envport.envs.shell:ShellEnv",
        description="A bash workspace in a bubblewrap sandbox, laid out as a Harbor task's.",
    )
    register(
        "sandbox-v1",
        "envport.envs.sandbox_env:SandboxEnv",
        description="A task's repository in an isolated sandbox with a persistent shell.",
    )


register_builtins()
