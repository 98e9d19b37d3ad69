"""Per-step overhead of the Ray backend against the local-process backend.

Run from the repository root::

    .venv/bin/python bench/ray_overhead.py              # N=3000 steps per target
    .venv/bin/python bench/ray_overhead.py --n 500      # quick
    .venv/bin/python bench/ray_overhead.py --markdown bench/RAY_RESULTS.md

One invocation starts a local Ray head (``ray.init()``: this process is the driver, the
head's daemons are its children and stop with it), then one ``echo-v1`` instance on each
target:

* ``local``: :class:`envport.rollout.backends.local.LocalProcessBackend`, an envport
  server process on 127.0.0.1 (if that backend is not importable, a plain
  ``python -m envport.server echo-v1`` subprocess, which is what it starts);
* ``ray``: :class:`envport.rollout.backends.ray.RayBackend`, an envport server inside a
  Ray actor's worker process, bound to the node's IP.

Both are driven the same way: one :class:`envport.client.EnvClient` WebSocket session
each, ``reset`` once, a warm-up, then steps timed one by one (send to reply) in rounds
of ``--round`` that alternate between the targets so drift and noise land on both.
Steps never pass through Ray (the client talks to the actor's server directly), so the
difference is what living in a Ray worker costs the server: Ray's core-worker threads in
the same process, and the node IP instead of loopback. Start latency (start() to ready)
is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from envport.client import EnvClient
from envport.rollout.backends.base import EnvLaunch
from envport.serving import free_port

console = Console(width=130)


Target = tuple[str, float, str, int]  # url, start latency s, how, server pid


@asynccontextmanager
async def local_target(state_dir: Path) -> AsyncIterator[Target | None]:
    """The local-process backend's instance, or None when that backend is not there."""
    try:
        from envport.rollout.backends.local import LocalProcessBackend
    except ImportError:
        yield None
        return
    async with LocalProcessBackend(state_dir) as backend:
        inst = await backend.start(EnvLaunch(env_id="echo-v1"))
        assert inst.url is not None
        yield inst.url, inst.start_latency_s or 0.0, "LocalProcessBackend", inst.meta["pid"]


@asynccontextmanager
async def plain_target() -> AsyncIterator[Target]:
    """A plain ``python -m envport.server echo-v1`` subprocess on 127.0.0.1."""
    port = free_port()
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "envport.server", "echo-v1", "--port", str(port)],
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            while True:
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
        yield url, time.perf_counter() - began, "envport.server subprocess", proc.pid
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


@asynccontextmanager
async def ray_target() -> AsyncIterator[Target]:
    import ray

    from envport.rollout.backends.ray import RayBackend

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if "RAY_AUTH_MODE" not in os.environ:  # a token of our own, never ~/.ray/auth_token
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="envport")
    try:
        async with RayBackend(detached=False) as backend:
            inst = await backend.start(EnvLaunch(env_id="echo-v1"))
            assert inst.url is not None
            how = f"RayBackend, actor on {inst.meta['node_ip']}"
            yield inst.url, inst.start_latency_s or 0.0, how, inst.meta["pid"]
    finally:
        ray.shutdown()


async def timed_steps(client: EnvClient, n: int, samples: list[float]) -> None:
    for i in range(n):
        began = time.perf_counter()
        await client.step({"message": f"m{i}"})
        samples.append(time.perf_counter() - began)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="timed steps per target")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--round", type=int, default=100, help="steps per alternation")
    parser.add_argument("--markdown", type=Path, help="also append the table here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="envport-bench-") as tmp:
        async with (
            local_target(Path(tmp)) as local,
            plain_target() as plain,
            ray_target() as on_ray,
        ):
            targets: dict[str, Target] = {"plain": plain, "ray": on_ray}
            if local is not None:
                targets = {"local": local, **targets}
            clients: dict[str, Any] = {}
            samples: dict[str, list[float]] = {name: [] for name in targets}
            cpu: dict[str, float] = dict.fromkeys(targets, 0.0)
            for name, (url, *_) in targets.items():
                clients[name] = await EnvClient.connect(url).__aenter__()
                await clients[name].reset()
                await timed_steps(clients[name], args.warmup, [])
            with Progress(console=console) as progress:
                task = progress.add_task("steps", total=args.n * len(targets))
                done = 0
                rnd = 0
                while done < args.n:
                    chunk = min(args.round, args.n - done)
                    names = list(targets)
                    order = names[rnd % len(names) :] + names[: rnd % len(names)]
                    for name in order:
                        pid = targets[name][3]
                        before = cpu_s(pid)
                        await timed_steps(clients[name], chunk, samples[name])
                        cpu[name] += cpu_s(pid) - before
                        progress.advance(task, chunk)
                    done += chunk
                    rnd += 1
            for client in clients.values():
                await client.close()

    table = Table(title=f"per-step latency, echo-v1, {args.n} steps each (µs)")
    columns = ("target", "how", "start s", "p50", "p90", "p99", "mean", "steps/s", "srv cpu/step")
    for column in columns:
        table.add_column(column, justify="left" if column in ("target", "how") else "right")
    rows = []
    for name, (_, start_s, how, _) in targets.items():
        s = samples[name]
        row = [
            name,
            how,
            f"{start_s:.2f}",
            f"{pct(s, 0.5):.0f}",
            f"{pct(s, 0.9):.0f}",
            f"{pct(s, 0.99):.0f}",
            f"{statistics.fmean(s) * 1e6:.0f}",
            f"{len(s) / sum(s):.0f}",
            f"{cpu[name] / len(s) * 1e6:.0f}",
        ]
        rows.append(row)
        table.add_row(*row)
    console.print(table)
    base = "local" if "local" in targets else "plain"
    ratio = {q: pct(samples["ray"], q) / pct(samples[base], q) for q in (0.5, 0.99)}
    mean_ratio = statistics.fmean(samples["ray"]) / statistics.fmean(samples[base])
    cpu_ratio = cpu["ray"] / cpu[base]
    summary = (
        f"ray / {base}: p50 x{ratio[0.5]:.2f}, p99 x{ratio[0.99]:.2f}, "
        f"mean x{mean_ratio:.2f}, server CPU per step x{cpu_ratio:.2f}"
    )
    console.print(summary)
    if args.markdown is not None:
        header = (
            "| target | how | start s | p50 µs | p90 µs | p99 µs | mean µs | steps/s "
            "| server CPU µs/step |"
        )
        lines = [header, "|" + "---|" * 9, *("| " + " | ".join(r) + " |" for r in rows)]
        with args.markdown.open("a") as out:
            out.write("\n".join(lines) + f"\n\n{summary}\n")


if __name__ == "__main__":
    asyncio.run(main())
