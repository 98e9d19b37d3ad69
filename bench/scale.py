"""Controller at scale: a batch where some environments hang, against the same batch without.

Run from the repository root::

    .venv/bin/python bench/scale.py                       # 600 rollouts, 5 % hang
    .venv/bin/python bench/scale.py --quick               # smoke run
    .venv/bin/python bench/scale.py --backend local --sessions 32
    .venv/bin/python bench/scale.py --sandboxes 1000      # memory per idle sandbox

Each rollout resets a :class:`HangingEnv` and takes ``--steps`` steps of ``--step-ms``
each, driven by a scripted harness (no model: this measures the controller). In the
faulty batch each environment instance (session) hangs on its first step with
probability ``--hang-rate``: it never answers. The controller must notice the missing
heartbeats within ``--hang-timeout`` seconds, retire the instance and retry the rollout
on a fresh one. Target: faulty wall time <= 1.2 x the clean wall time, every rollout
succeeded, none twice.

``--sandboxes N`` instead keeps N live :mod:`envport.sandbox` sandboxes, idle, and
reports the memory each one costs: the memory charged to its own cgroup, and the
system's used memory before and after divided by N (noisy on a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from envport.client import EnvClient  # noqa: E402
from envport.env import Env  # noqa: E402
from envport.envs.echo import EchoAction, EchoObservation  # noqa: E402
from envport.types import StepResult  # noqa: E402

console = Console()
ENV_ID = "bench.scale:HangingEnv"


class HangingEnv(Env[EchoAction, EchoObservation]):
    """Echo after ``sleep``; with probability ``hang_rate`` an instance never answers."""

    action_type = EchoAction
    observation_type = EchoObservation
    default_hang_rate: ClassVar[float] = 0.0
    rng: ClassVar[random.Random] = random.Random(0)

    def __init__(self, hang_rate: float | None = None) -> None:
        super().__init__()
        rate = self.default_hang_rate if hang_rate is None else hang_rate
        self.hangs = self.rng.random() < rate

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[EchoObservation]:
        return StepResult(observation=EchoObservation(echoed_message="ready"))

    async def on_step(self, action: EchoAction) -> StepResult[EchoObservation]:
        if self.hangs:
            await asyncio.sleep(3600)
        if action.message.startswith("sleep:"):
            await asyncio.sleep(float(action.message.split(":", 1)[1]))
        return StepResult(observation=EchoObservation(echoed_message=action.message))


class StepHarness:
    """Reset, then ``steps`` steps; no model."""

    def __init__(self, steps: int, step_s: float) -> None:
        self.steps = steps
        self.step_s = step_s

    async def run(self, task: Any, env: EnvClient, trace: Any) -> None:
        from envport.trace import StepRecord

        await env.reset()
        for i in range(self.steps):
            result = await env.step({"message": f"sleep:{self.step_s}"})
            trace.steps.append(StepRecord(index=i, observation=result.observation))


async def batch(
    args: argparse.Namespace, hang_rate: float, run_id: str, db: Path
) -> dict[str, Any]:
    import importlib

    from envport.rollout import (
        Controller,
        ControllerConfig,
        InProcessBackend,
        LocalProcessBackend,
        RolloutSpec,
    )
    from envport.rollout.backends.base import Backend
    from envport.tasks import Task
    from envport.trace import AsyncTraceStore, SQLiteTraceStore

    env_cls = importlib.import_module("bench.scale").HangingEnv  # the class ENV_ID names
    env_cls.default_hang_rate = hang_rate
    env_cls.rng = random.Random(args.seed)
    config = ControllerConfig(
        concurrency=args.concurrency,
        max_attempts=5,
        hang_timeout_s=args.hang_timeout,
        health_interval_s=max(args.hang_timeout, 1.0),
        sessions_per_instance=args.sessions,
        env_options={ENV_ID: {"hang_rate": hang_rate}} if args.backend == "local" else {},
    )
    tasks = [Task(id=f"t{i:05d}", prompt="go", env_id=ENV_ID) for i in range(args.rollouts)]
    backend: Backend
    if args.backend == "local":
        backend = LocalProcessBackend(db.parent / f"instances-{run_id}", cwd=ROOT)
    else:
        backend = InProcessBackend()
    harness = StepHarness(args.steps, args.step_ms / 1000)
    async with AsyncTraceStore(SQLiteTraceStore(db)) as store, backend:
        ctl = Controller(store, backend, harness, config, run_id=run_id)
        async with ctl:
            if args.backend == "local":  # start instances before the clock: not measured
                await ctl.collect([RolloutSpec(Task(id="warm", prompt="go", env_id=ENV_ID))])
            t0 = time.perf_counter()
            summary = await ctl.run([RolloutSpec(t) for t in tasks])
            wall = time.perf_counter() - t0
        traces = await store.query(run_id=run_id, status="completed")
        ids = [t.rollout_id for t in traces if t.task_id != "warm"]
    return {
        "wall_s": wall,
        "succeeded": summary.succeeded,
        "failed": summary.failed,
        "retried": summary.retried,
        "unique": len(set(ids)) == len(ids),
        "env_start": summary.env_start_s,
    }


def run_hang_bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "scale.db"
        clean = asyncio.run(batch(args, 0.0, "clean", db))
        faulty = asyncio.run(batch(args, args.hang_rate, "faulty", db))
    ratio = faulty["wall_s"] / clean["wall_s"]
    table = Table(
        title=f"{args.rollouts} rollouts x {args.steps} steps of {args.step_ms} ms, "
        f"concurrency {args.concurrency}, backend {args.backend}, "
        f"hang timeout {args.hang_timeout} s",
        title_justify="left",
    )
    for col in ("batch", "wall s", "succeeded", "failed", "retried", "each once"):
        table.add_column(col, justify="right")
    for name, r in (("clean", clean), (f"{args.hang_rate:.0%} hang", faulty)):
        table.add_row(
            name,
            f"{r['wall_s']:.2f}",
            str(r["succeeded"]),
            str(r["failed"]),
            str(r["retried"]),
            "yes" if r["unique"] else "NO",
        )
    console.print(table)
    verdict = "[green]meets[/]" if ratio <= 1.2 else "[red]misses[/]"
    console.print(f"faulty / clean wall time = [bold]{ratio:.3f}[/] ({verdict} the <= 1.2 target)")


def run_sandbox_bench(n: int) -> None:
    try:
        from envport import sandbox as sb
    except ImportError:
        console.print("[red]envport.sandbox is not available in this checkout[/]")
        raise SystemExit(2) from None
    asyncio.run(_sandboxes(sb, n))


def _cgroup_mb(box: Any) -> float | None:
    """Memory charged to the sandbox's own cgroup (None when it has none)."""
    cgroup = getattr(getattr(box, "_res", None), "cgroup", None)
    if cgroup is None:
        return None
    return float(cgroup.memory_bytes()) / 2**20


def _mem_used_mb() -> float:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


async def _sandboxes(sb: Any, n: int) -> None:
    from rich.progress import Progress

    boxes: list[Any] = []
    before = _mem_used_mb()
    t0 = time.perf_counter()
    try:
        with Progress(console=console) as progress:
            bar = progress.add_task("sandboxes", total=n)
            for _ in range(n):  # one at a time: concurrent creation measured slower
                boxes.append(await sb.Sandbox.create(sb.SandboxConfig()))
                progress.advance(bar)
        created_s = time.perf_counter() - t0
        await asyncio.sleep(2.0)  # let them settle idle
        after = _mem_used_mb()
        charged = [_cgroup_mb(box) for box in boxes]
        alive = 0
        for box in boxes[:: max(1, n // 20)]:
            result = await box.exec("true")
            alive += int(result.exit_code == 0)
    finally:
        await asyncio.gather(*(box.close() for box in boxes), return_exceptions=True)
    table = Table(title=f"{n} idle sandboxes", title_justify="left")
    cols = ("live", "create s", "system MB", "system MB / box", "cgroup MB / box", "exec ok")
    for col in cols:
        table.add_column(col, justify="right")
    known = [c for c in charged if c is not None]
    table.add_row(
        str(len(boxes)),
        f"{created_s:.1f}",
        f"{after - before:.0f}",
        f"{(after - before) / max(1, len(boxes)):.2f}",
        f"{sum(known) / len(known):.2f}" if known else "-",
        f"{alive}/{len(boxes[:: max(1, n // 20)])} sampled",
    )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--hang-rate", type=float, default=0.05)
    parser.add_argument("--hang-timeout", type=float, default=0.5)
    parser.add_argument("--backend", choices=["inprocess", "local"], default="inprocess")
    parser.add_argument("--sessions", type=int, default=1, help="Sessions per instance.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="A small smoke run.")
    parser.add_argument("--sandboxes", type=int, default=0, help="Idle-sandbox memory mode.")
    args = parser.parse_args()
    if args.sandboxes:
        run_sandbox_bench(args.sandboxes)
        return
    if args.quick:
        args.rollouts, args.concurrency, args.steps = 100, 50, 10
    run_hang_bench(args)


if __name__ == "__main__":
    main()
