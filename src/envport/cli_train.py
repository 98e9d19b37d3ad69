"""``envport train-demo``: GRPO on the tiny policy, end to end, on this machine.

A thin shell over :mod:`envport.train.pipeline`: warm start (cached), a training run
with rollout/update overlap, a short run without it for comparison, a table per
iteration, and PNG plots of the reward curve and of the trainer's timeline. Plotting
needs matplotlib (the ``train`` extra).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Wide enough for the per-iteration table when the output is piped (make demo | tee).
# No emoji codes, as in the other commands: text prints as written.
out = Console(emoji=False) if sys.stdout.isatty() else Console(width=140, emoji=False)
err = Console(stderr=True, emoji=False)

DEFAULT_OUT = Path("runs/train-demo")


def _iteration_table(title: str) -> Table:
    table = Table(title=title)
    for name in (
        "iter",
        "mean reward",
        "expected",
        "pass rate",
        "rollouts",
        "rows",
        "dropped",
        "tokens",
        "loss",
        "clip",
        "update s",
        "wait s",
        "version",
    ):
        table.add_column(name, justify="right")
    return table


def _add_row(table: Table, it: Any) -> None:
    dropped = ", ".join(f"{k} {v}" for k, v in it.dropped.items()) or "0"
    if it.failed:
        dropped += f" (failed {it.failed})"
    table.add_row(
        str(it.iteration),
        f"{it.mean_reward:.3f}",
        f"{it.expected_reward:.3f}",
        f"{it.pass_rate:.0%}",
        str(it.rollouts),
        str(it.rows),
        dropped,
        str(it.tokens),
        f"{it.update.loss:+.4f}" if not math.isnan(it.update.loss) else "-",
        f"{it.update.clip_fraction:.2f}",
        f"{it.update_s:.2f}",
        f"{it.wait_s:.2f}",
        str(it.policy_version),
    )


def run_training(
    config: Any,
    out_dir: Path,
    *,
    title: str,
    warm: Any = None,
    show: bool = True,
) -> tuple[Any, Any]:
    """One :func:`~envport.train.pipeline.run_pipeline` with a live table and progress."""
    from envport.train.pipeline import run_pipeline

    table = _iteration_table(title)
    progress = Progress(
        TextColumn("warm start (supervised, noisy answers)"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    )
    task = progress.add_task("warm", total=config.warmstart.steps)

    def warm_step(done: int, total: int) -> None:
        progress.update(task, completed=done)

    with Live(table, console=out, refresh_per_second=4, transient=not show) as live:

        def on_iteration(it: Any) -> None:
            _add_row(table, it)
            live.refresh()

        with progress:
            result, warm = asyncio.run(
                run_pipeline(
                    config, out_dir, warm=warm, on_iteration=on_iteration, on_warmstart=warm_step
                )
            )
    return result, warm


def summary_table(results: dict[str, Any]) -> Table:
    table = Table(title="trainer idle time: waiting for rollouts")
    for name in ("mode", "iterations", "wall s", "trainer wait s", "idle", "idle after it 0"):
        table.add_column(name, justify="right")
    for mode, res in results.items():
        table.add_row(
            mode,
            str(len(res.iterations)),
            f"{res.wall_s:.1f}",
            f"{res.wait_s:.1f}",
            f"{res.idle_fraction:.0%}",
            f"{res.steady_idle_fraction:.0%}",
        )
    return table


def plot_rewards(result: Any, path: Path) -> Path:
    """Mean reward and pass rate per iteration, with the expected reward before/after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [it.iteration for it in result.iterations]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        its,
        [it.mean_reward for it in result.iterations],
        marker="o",
        alpha=0.5,
        label="batch mean reward (sampled rollouts)",
    )
    ax.plot(
        its,
        [it.expected_reward for it in result.iterations],
        marker="s",
        color="green",
        label="expected reward over all 81 questions",
    )
    ax.axhline(
        result.expected_reward_before,
        color="grey",
        linestyle="--",
        label=f"expected reward before RL ({result.expected_reward_before:.2f})",
    )
    ax.axhline(
        result.expected_reward_after,
        color="green",
        linestyle="--",
        label=f"expected reward after RL ({result.expected_reward_after:.2f})",
    )
    ax.set_xlabel("iteration (GRPO update)")
    ax.set_ylabel("reward (1 = exactly right)")
    ax.set_ylim(0, 1)
    ax.set_title("envport-tiny on arithmetic-v1 (single-digit sums), GRPO")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(results: dict[str, Any], path: Path) -> Path:
    """Per mode: the trainer's wait/update spans and the producer's collect spans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"wait": "tab:red", "update": "tab:green", "collect": "tab:blue"}
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.8 * len(results) + 0.6), sharex=True)
    axes_list = list(axes) if len(results) > 1 else [axes]
    for ax, (mode, res) in zip(axes_list, results.items(), strict=True):
        lanes = {"trainer": 1, "producer": 0}
        for span in res.spans:
            y = lanes[span.lane]
            ax.broken_barh(
                [(span.start, span.end - span.start)],
                (y - 0.35, 0.7),
                facecolors=colours[span.kind],
                edgecolor="white",
                linewidth=0.5,
            )
        ax.set_yticks([0, 1], ["rollouts", "trainer"])
        ax.set_title(
            f"{mode}: trainer idle {res.idle_fraction:.0%} of {res.wall_s:.1f} s",
            fontsize=9,
        )
        ax.grid(axis="x", alpha=0.3)
    axes_list[-1].set_xlabel("seconds")
    from matplotlib.patches import Patch

    handles = [Patch(color=c) for c in colours.values()]
    fig.legend(
        handles,
        ["trainer waits", "trainer updates", "rollouts collected"],
        loc="lower right",
        fontsize=8,
        ncol=3,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def results_json(results: dict[str, Any], warm: Any) -> dict[str, Any]:
    return {
        "warm_start": {
            "steps": warm.steps,
            "seconds": warm.seconds,
            "cached": warm.cached,
            "expected_reward": warm.expected_reward,
        },
        "runs": {
            mode: {
                "iterations": len(res.iterations),
                "wall_s": res.wall_s,
                "wait_s": res.wait_s,
                "idle_fraction": res.idle_fraction,
                "steady_idle_fraction": res.steady_idle_fraction,
                "expected_reward_before": res.expected_reward_before,
                "expected_reward_after": res.expected_reward_after,
                "mean_reward": [it.mean_reward for it in res.iterations],
                "expected_reward": [it.expected_reward for it in res.iterations],
                "config": res.config.model_dump(mode="json"),
            }
            for mode, res in results.items()
        },
    }


def train_demo_command(
    iterations: Annotated[int, typer.Option(help="GRPO iterations of the main run.")] = 30,
    prompts: Annotated[int, typer.Option(help="Tasks per iteration.")] = 32,
    group_size: Annotated[int, typer.Option(help="Rollouts per task (the GRPO group).")] = 4,
    compare_iterations: Annotated[
        int, typer.Option(help="Iterations of the comparison run without overlap (0: skip).")
    ] = 4,
    max_staleness: Annotated[int, typer.Option(help="Drop rows sampled > K versions ago.")] = 1,
    warmstart_steps: Annotated[
        int, typer.Option(help="Supervised warm-start steps (cached in --out).")
    ] = 400,
    seed: Annotated[int, typer.Option()] = 0,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Where the plots, traces and cache go.")
    ] = DEFAULT_OUT,
) -> None:
    """Real RL on this CPU: GRPO on a tiny transformer, every rollout through the stack.

    Rollouts go controller → gateway (recorded, version-stamped) → envport's model server
    (the tiny policy, token ids and logprobs in vLLM's format) and an arithmetic-v1 server;
    rows come from the recorded traces; the update runs in-process and the new weights are
    hot-swapped into the server. Writes reward.png, timeline.png and results.json.
    """
    from pydantic import ValidationError

    from envport.train.pipeline import PipelineConfig, WarmStartConfig

    try:  # checked before anything is printed or written
        base = PipelineConfig(
            iterations=iterations,
            prompts=prompts,
            group_size=group_size,
            max_staleness=max_staleness,
            seed=seed,
            warmstart=WarmStartConfig(steps=warmstart_steps),
        )
        if compare_iterations < 0:
            raise ValueError("--compare-iterations: must be 0 (skip) or more")
    except (ValidationError, ValueError) as exc:
        if isinstance(exc, ValidationError):
            option = {"steps": "warmstart-steps"}  # WarmStartConfig's field
            message = "; ".join(
                f"--{option.get(str(e['loc'][-1]), str(e['loc'][-1]).replace('_', '-'))}: "
                f"{e['msg']}"
                for e in exc.errors(include_url=False)
            )
        else:
            message = str(exc)
        err.print(
            f"[bold red]error:[/] invalid train-demo option: {escape(message)}", soft_wrap=True
        )
        raise typer.Exit(2) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    out.print(
        "[bold]envport train-demo[/]: GRPO on [bold]envport-tiny[/] (a 2-layer transformer, "
        "byte tokenizer, random init) on arithmetic-v1's single-digit sums.\n"
        "[yellow]Honest setup:[/] a short supervised warm start on imperfect answers (the "
        "right number 70% of the time, the bare-number format the env accepts 25%) leaves it "
        "right ~10% of the time; RL has to find the format that scores and sharpen the sums."
    )
    results: dict[str, Any] = {}
    main, warm = run_training(
        base, out_dir, title="GRPO with rollout/update overlap (per iteration)"
    )
    results["overlap"] = main
    out.print()
    out.print(
        f"warm start: {warm.steps} steps"
        + (" (cached)" if warm.cached else f" in {warm.seconds:.1f} s")
        + f"; expected reward over all questions: [bold]{main.expected_reward_before:.3f}[/] "
        f"before RL → [bold green]{main.expected_reward_after:.3f}[/] after "
        f"{len(main.iterations)} GRPO iterations ({main.wall_s:.0f} s)"
    )
    if compare_iterations > 0:
        serial_config = base.model_copy(update={"iterations": compare_iterations, "overlap": False})
        serial, _ = run_training(
            serial_config, out_dir, title="comparison: no overlap", warm=warm, show=False
        )
        results["no overlap"] = serial
    out.print(summary_table(results))
    reward_png = plot_rewards(main, out_dir / "reward.png")
    timeline_png = plot_timeline(results, out_dir / "timeline.png")
    (out_dir / "results.json").write_text(json.dumps(results_json(results, warm), indent=2))
    out.print(f"wrote {reward_png}, {timeline_png}, {out_dir / 'results.json'}")
    out.print(f"traces (every rollout, as the gateway recorded it): {out_dir / 'traces.db'}")


def register(app: typer.Typer) -> None:
    app.command("train-demo")(train_demo_command)
