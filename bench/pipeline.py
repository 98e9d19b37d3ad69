"""Trainer idle time with and without rollout/update overlap, on the tiny policy.

Run from the repository root::

    .venv/bin/python bench/pipeline.py                 # 8 iterations per mode
    .venv/bin/python bench/pipeline.py --iterations 4  # quicker
    .venv/bin/python bench/pipeline.py --epochs 4      # a heavier update per batch

Both modes run the same GRPO pipeline (:mod:`envport.train.pipeline`) from the same
warm start (cached in ``--out``): every rollout through the rollout controller, the
recording gateway, envport's model server with the tiny transformer, and an
``arithmetic-v1`` server on a socket; rows from the gateway's traces; the update
in-process; weights hot-swapped behind the gateway's pause/drain.

* ``no overlap``: collect batch k, then update on it; the trainer waits for every batch.
* ``overlap``: a producer collects batch k+1 while the trainer updates on k (staleness
  bound ``--max-staleness``, rows further behind dropped).

The figure is the trainer's **idle fraction**: time blocked waiting for rollouts over
the wall time. ``idle after it 0`` leaves out the first batch, which nothing can hide.
Overlap can hide at most the shorter of the two phases, so the floor of the idle
fraction is ``max(0, 1 - update / collect)``: the table prints both phases' mean times
so the result can be read against that floor. Writes ``timeline.png`` (and
``reward.png``) and ``results.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from envport.cli_train import plot_rewards, plot_timeline, results_json
from envport.train.grpo import GrpoConfig
from envport.train.pipeline import PipelineConfig, PipelineResult, run_pipeline

console = Console(width=140)


def mean_span(result: PipelineResult, lane: str, kind: str) -> float:
    spans = [s.end - s.start for s in result.spans if s.lane == lane and s.kind == kind]
    return statistics.fmean(spans) if spans else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2, help="GRPO passes per batch.")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-pipeline"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    base = PipelineConfig(
        iterations=args.iterations,
        prompts=args.prompts,
        group_size=args.group_size,
        max_staleness=args.max_staleness,
        grpo=GrpoConfig(epochs=args.epochs),
    )
    results: dict[str, PipelineResult] = {}
    warm = None
    for mode, overlap in (("no overlap", False), ("overlap", True)):
        console.print(f"[bold]{mode}[/]: {args.iterations} iterations …")
        config = base.model_copy(update={"overlap": overlap})
        result, warm = asyncio.run(run_pipeline(config, args.out, warm=warm))
        results[mode] = result
    assert warm is not None
    table = Table(title="trainer idle fraction (waiting for rollouts / wall time)")
    for col in (
        "mode",
        "iters",
        "wall s",
        "wait s",
        "idle",
        "idle after it 0",
        "collect s/it",
        "update s/it",
        "expected reward before→after",
    ):
        table.add_column(col, justify="right")
    for mode, res in results.items():
        table.add_row(
            mode,
            str(len(res.iterations)),
            f"{res.wall_s:.1f}",
            f"{res.wait_s:.1f}",
            f"{res.idle_fraction:.1%}",
            f"{res.steady_idle_fraction:.1%}",
            f"{mean_span(res, 'producer', 'collect'):.2f}",
            f"{mean_span(res, 'trainer', 'update'):.2f}",
            f"{res.expected_reward_before:.3f}→{res.expected_reward_after:.3f}",
        )
    console.print(table)
    off, on = results["no overlap"], results["overlap"]
    console.print(
        f"idle with overlap / without: {on.idle_fraction / off.idle_fraction:.2f}; "
        f"wall time per iteration: {off.wall_s / len(off.iterations):.2f} s → "
        f"{on.wall_s / len(on.iterations):.2f} s "
        f"({off.wall_s / len(off.iterations) / (on.wall_s / len(on.iterations)):.2f}x)"
    )
    plot_timeline(results, args.out / "timeline.png")
    plot_rewards(on, args.out / "reward.png")
    (args.out / "results.json").write_text(json.dumps(results_json(results, warm), indent=2))
    console.print(f"wrote {args.out / 'timeline.png'}, {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
