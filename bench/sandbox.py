"""Sandbox latencies and density: start, command round trip, reset, fork; --scale N.

    .venv/bin/python bench/sandbox.py                 # latencies (median, p99)
    .venv/bin/python bench/sandbox.py --scale 1000    # N idle sandboxes: memory, spawn

Latencies (each over ``--runs`` tries):

* start: ``Sandbox.create`` to the first command's answer (an isolated shell ready),
  cold, and from a warm ``SandboxPool`` (a started sandbox rebound to the task: the
  pool is refilled in the background, and each try waits, untimed, for one to be idle);
* exec: one command round trip (``:``, a builtin; and ``/bin/true``, a fork+exec);
* restore: back to a snapshot after a command changed files; reset: back to the task's
  initial state with a fresh shell;
* fork: one child (and four) of a sandbox whose workspace is a 50 MB repository plus
  1 MB of the agent's changes; also with the 50 MB written by the agent itself.

Targets (issue 5): start p50 <= 15 ms, reset p99 <= 10 ms, fork <= 20 ms. Reference
points: E2B documents ~150 ms start and ~1 s resume; AgentENV (Firecracker) < 50 ms.

``--scale N`` starts N idle sandboxes (memory_mb/pids limits on) and reports the memory
of one idle sandbox: the PSS of all its processes (``/proc/PID/smaps_rollup``: bwrap's
monitor, the sandbox's init and bash), its tmpfs pages, and the kernel's growth (slab,
page tables, kernel stacks from ``/proc/meminfo``: machine-wide, so other load shows up
in it too), plus spawn latency as N grows (a PNG plot with ``--plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from envport.sandbox import Sandbox, SandboxConfig, SandboxPool, probe

console = Console()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float]) -> tuple[str, str]:
    return f"{statistics.median(values) * 1e3:.2f}", f"{pct(values, 0.99) * 1e3:.2f}"


async def until_idle(pool: SandboxPool) -> None:
    """Wait (untimed) until the pool has a started sandbox ready."""
    while pool.idle == 0:
        if pool.fill_errors:
            raise RuntimeError(f"the pool could not start sandboxes: {pool.fill_errors[-1]}")
        await asyncio.sleep(0.005)


def make_repo(root: Path, mb: int) -> Path:
    repo = root / "repo"
    (repo / "src").mkdir(parents=True)
    chunk = os.urandom(1024 * 1024)
    for i in range(mb):
        (repo / "src" / f"blob{i:03d}.bin").write_bytes(chunk)
    (repo / "README").write_text("a 50 MB task repository\n")
    return repo


async def timed(coro_fn, runs: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        await coro_fn()
        out.append(time.perf_counter() - t)
    return out


async def latencies(runs: int, tmp: Path) -> None:
    cfg = SandboxConfig()
    rows: list[tuple[str, str, str, str]] = []

    starts, closes = [], []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("start", total=runs)
        for _ in range(runs):
            t = time.perf_counter()
            sb = await Sandbox.create(cfg)
            await sb.exec(":")
            starts.append(time.perf_counter() - t)
            t = time.perf_counter()
            await sb.close()
            closes.append(time.perf_counter() - t)
            progress.advance(task)
    rows.append(("start (create + first command)", *ms(starts), "p50 <= 15"))
    rows.append(("close (kill, cgroups, mounts)", *ms(closes), ""))

    repo = make_repo(tmp, 50)
    async with SandboxPool(cfg, size=2) as pool:
        warm, warm_forks = [], []
        for _ in range(runs):
            await until_idle(pool)
            t = time.perf_counter()
            sb = await pool.create(workspace=repo)
            await sb.exec(":")
            warm.append(time.perf_counter() - t)
            if len(warm_forks) < max(3, runs // 2):
                await sb.exec("head -c 1048576 /dev/urandom > agent.bin; cd src; export K=v")
                await until_idle(pool)
                t = time.perf_counter()
                (child,) = await sb.fork(1)
                warm_forks.append(time.perf_counter() - t)
                await child.close()
            await sb.close()
    rows.append(("start from a warm pool (50 MB repo)", *ms(warm), "p50 <= 15"))
    async with await Sandbox.create(cfg.model_copy(update={"workspace": repo})) as sb:
        builtin = await timed(lambda: sb.exec(":"), runs * 4)
        fork_exec = await timed(lambda: sb.exec("/bin/true"), runs * 2)
        rows.append(("exec round trip (builtin `:`)", *ms(builtin), ""))
        rows.append(("exec round trip (`/bin/true`)", *ms(fork_exec), ""))
        await sb.exec("echo changed > README; mkdir -p out; echo x > out/y")
        snap = await sb.snapshot()
        restores, resets = [], []
        for _ in range(runs):
            await sb.exec("rm -r out; echo again >> README; touch z")
            t = time.perf_counter()
            await sb.restore(snap)
            restores.append(time.perf_counter() - t)
        for _ in range(runs):
            await sb.exec("cd out; export V=1; echo more > f")
            t = time.perf_counter()
            await sb.reset()
            resets.append(time.perf_counter() - t)
        rows.append(("restore to snapshot", *ms(restores), ""))
        rows.append(("reset to initial state (+ fresh shell)", *ms(resets), "p99 <= 10"))

        await sb.exec("head -c 1048576 /dev/urandom > agent.bin; cd src; export K=v")
        for n in (1, 4):
            forks = []
            for _ in range(max(3, runs // (2 * n))):
                await sb.exec("echo $RANDOM >> ../agent.log")  # a change: a new layer
                t = time.perf_counter()
                children = await sb.fork(n)
                forks.append(time.perf_counter() - t)
                for child in children:
                    await child.close()
            label = f"fork x{n}, 50 MB repo + 1 MB changes"
            rows.append((label, *ms(forks), "<= 20" if n == 1 else ""))

    async with await Sandbox.create(cfg.model_copy(update={"disk_mb": 256})) as sb:
        await sb.exec("mkdir big; for i in $(seq 50); do head -c 1048576 /dev/urandom "
                      "> big/b$i; done")  # fmt: skip
        forks = []
        for _ in range(max(3, runs // 4)):
            await sb.exec("echo $RANDOM >> big/log")
            t = time.perf_counter()
            children = await sb.fork(1)
            forks.append(time.perf_counter() - t)
            for child in children:
                await child.close()
        rows.append(("fork x1, 50 MB written by the agent", *ms(forks), ""))
    rows.append(("fork x1 from a warm pool, 50 MB repo + 1 MB", *ms(warm_forks), "<= 20"))

    table = Table(title=f"envport.sandbox latencies (ms, {runs} runs)")
    for col in ("operation", "p50", "p99", "target"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


async def scale(n: int, plot: Path | None) -> None:
    cfg = SandboxConfig(memory_mb=256, pids=64)
    before = meminfo()
    boxes: list[Sandbox] = []
    spawn: list[float] = []
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"starting {n} sandboxes", total=n)
            for _ in range(n):
                t = time.perf_counter()
                sb = await Sandbox.create(cfg)
                await sb.exec(":")
                spawn.append(time.perf_counter() - t)
                boxes.append(sb)
                progress.advance(task)
        await asyncio.sleep(1.0)
        after = meminfo()
        pids = [p for sb in boxes for p in sb.process_ids()]
        pss = sum(pss_kb(p) for p in pids)
        tmpfs = 0
        for sb in boxes:
            stats = sb.stats()
            tmpfs += sum(stats[k] for k in ("workspace_bytes", "tmp_bytes")) // 1024
        kernel_keys = ("Slab", "PageTables", "KernelStack", "Shmem")
        kernel = {k: after[k] - before[k] for k in kernel_keys}
        used = (before["MemAvailable"] - after["MemAvailable"]) / n
        table = Table(title=f"{n} idle sandboxes: memory per sandbox")
        table.add_column("what")
        table.add_column("KiB / sandbox", justify="right")
        table.add_row(f"PSS of its processes ({len(pids) / n:.1f} per sandbox)", f"{pss / n:.0f}")
        table.add_row("tmpfs pages (root skeleton + workspace upper, /tmp)", f"{tmpfs / n:.0f}")
        for key, value in kernel.items():
            table.add_row(f"kernel: {key} growth (machine-wide)", f"{value / n:.0f}")
        honest = pss / n + kernel["Slab"] / n + kernel["PageTables"] / n
        honest += kernel["KernelStack"] / n + kernel["Shmem"] / n
        table.add_row("total: PSS + slab + page tables + stacks + shmem", f"{honest:.0f}")
        table.add_row("MemAvailable drop / N (machine-wide)", f"{used:.0f}")
        console.print(table)
        lat = Table(title="spawn latency as N grows (create + first command)")
        for col in ("sandboxes live", "p50 ms", "p99 ms"):
            lat.add_column(col, justify="right")
        step = max(1, n // 10)
        for lo in range(0, n, step):
            window = spawn[lo : lo + step]
            lat.add_row(f"{lo}-{lo + len(window)}", *ms(window))
        console.print(lat)
        if plot is not None:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot(range(1, n + 1), [s * 1e3 for s in spawn], ".", markersize=2)
            ax.set_xlabel("sandboxes already live")
            ax.set_ylabel("spawn latency (ms)")
            ax.set_title("envport.sandbox: start latency as N grows")
            fig.tight_layout()
            fig.savefig(plot, dpi=120)
            console.print(f"plot: {plot}")
    finally:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("closing", total=len(boxes))
            t = time.perf_counter()
            for sb in boxes:
                await sb.close()
                progress.advance(task)
        console.print(f"closed {len(boxes)} sandboxes in {time.perf_counter() - t:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--scale", type=int, nargs="?", const=1000, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG for --scale latency")
    args = parser.parse_args()
    isolation = probe()
    if not isolation.isolated:
        raise SystemExit(f"no sandbox isolation here: {isolation.explain()}")
    # Sandboxes go to the default runtime dir ($ENVPORT_SANDBOX_DIR): there, whatever a
    # killed run left behind is swept by the next one (see cleanup_stale).
    if args.scale:
        asyncio.run(scale(args.scale, args.plot))
        return
    with tempfile.TemporaryDirectory(prefix="envport-bench-sandbox-") as tmp:
        asyncio.run(latencies(args.runs, Path(tmp)))


if __name__ == "__main__":
    main()
