"""``make demo`` / ``python -m envport.demo``: envport's main job on embedded defaults.

1. Serve an environment (``guess-number-v1``) on a real socket and drive an episode over
   the OpenEnv WebSocket protocol; reach the same server's tools with the official MCP
   client.
2. Run an eval: the built-in tasksets (arithmetic, guessing game, SQL) through the
   built-in agent against envport's local scripted model server (token ids and logprobs
   in vLLM's format), each environment behind its own envport server, every trace in a
   SQLite store; then show one trace as a transcript.
3. Train: GRPO on envport's tiny PyTorch transformer (``envport train-demo``, shortened),
   every rollout through the controller, the gateway and a served environment; a table
   per iteration, the reward curve and the trainer's timeline as PNGs.

Everything stays on 127.0.0.1; nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.rule import Rule
from rich.table import Table

console = Console()
STORE = Path("runs/demo.db")


async def drive_episode(url: str) -> None:
    from envport.client import EnvClient

    table = Table("step", "guess", "feedback", "reward", "done", title="guess-number-v1 over /ws")
    async with EnvClient.connect(url) as env:
        first = await env.reset(seed=7, high=100, max_steps=10)
        console.print(f"[bold]reset →[/] {first.observation['message']}")
        low, high = 1, 100
        for step in range(1, 11):
            guess = (low + high) // 2
            result = await env.step({"guess": guess})
            feedback = result.observation["feedback"]
            table.add_row(str(step), str(guess), feedback, str(result.reward), str(result.done))
            if result.done:
                break
            low, high = (guess + 1, high) if feedback == "higher" else (low, guess - 1)
        state = await env.state()
    console.print(table)
    console.print(f"state: episode {state['episode_id'][:8]}…, {state['step_count']} steps")


async def mcp_tools(url: str) -> None:
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with (
        streamable_http_client(url + "/mcp") as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        listed = await session.list_tools()
        names = ", ".join(t.name for t in listed.tools)
        result = await session.call_tool("guess", {"number": 50})
        text = result.content[0].text if result.content else ""  # type: ignore[union-attr]
        console.print(f"[bold]MCP client[/] (official SDK) → tools: {names}; guess(50) → {text}")


def part_one() -> None:
    from envport.server import ServerConfig, create_app
    from envport.serving import serve_in_thread

    console.print(Rule("1 · an environment served and driven end to end"))
    config = ServerConfig()
    with serve_in_thread(create_app("guess-number-v1", config), config=config) as url:
        console.print(f"envport serve guess-number-v1 → {url} (WebSocket /ws, HTTP, MCP /mcp)")
        asyncio.run(drive_episode(url))
        asyncio.run(mcp_tools(url))


def part_two() -> None:
    from envport.cli_runs import _run, env_servers, local_scripted_model
    from envport.evaluate import EvalConfig
    from envport.harness import AgentConfig
    from envport.report import summary_table, transcript
    from envport.tasks import load
    from envport.trace import SQLiteTraceStore

    console.print(Rule("2 · a whole eval: tasks → agent → model → envs → rubric → store"))
    tasks = [
        *load("builtin:arithmetic"),
        *load("builtin:guess-number"),
        *load("builtin:sql"),
    ]
    STORE.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        model = stack.enter_context(local_scripted_model())
        console.print(
            f"[yellow]model: envport's scripted stand-in at {model} — rule-based, clearly "
            "not a model; pass a real endpoint with `envport eval --model URL`.[/]"
        )
        urls = stack.enter_context(env_servers({t.env_id for t in tasks if t.env_id}))
        for env_id, url in urls.items():
            console.print(f"  {env_id} served at {url}")
        config = EvalConfig(
            rollouts=2, concurrency=16, env_urls=urls, agent=AgentConfig(max_turns=12)
        )
        summary = asyncio.run(
            _run(
                model,
                "envport-scripted",
                None,
                STORE,
                config,
                tasks,
                "builtin",
                None,
                False,
                quiet=False,
            )
        )
    console.print(summary_table(summary))
    store = SQLiteTraceStore(STORE)
    try:
        sample = store.query(run_id=summary.run_id, task_id="guess-number-001", limit=1)
    finally:
        store.close()
    if sample:
        console.print(Rule(f"one trace: envport traces show {sample[0].trace_id} --store {STORE}"))
        console.print(transcript(sample[0]))
    console.print(
        f"\nAll traces: [bold]envport traces list --run {summary.run_id} --store {STORE}[/]"
    )


def part_three() -> None:
    from envport.cli_train import train_demo_command

    console.print(Rule("3 · real RL on this CPU: GRPO on a tiny transformer (envport train-demo)"))
    train_demo_command(
        iterations=10,
        prompts=32,
        group_size=4,
        compare_iterations=3,
        max_staleness=1,
        warmstart_steps=400,
        seed=0,
        out_dir=Path("runs/train-demo"),
    )
    console.print(
        "The full run: [bold]envport train-demo[/] (30 iterations; see docs/training.md)."
    )


def main() -> int:
    part_one()
    part_two()
    part_three()
    return 0


if __name__ == "__main__":
    sys.exit(main())
