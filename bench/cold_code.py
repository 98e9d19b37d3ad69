"""How much slower the gateway's per-event work runs when it has not run for a while.

The gateway's added latency at low load is mostly Python executing code that other
work has pushed out of the CPU's caches since it last ran: one read of a stream (split
its SSE events, parse and check each chunk, as ``_Relay._take`` does) costs ~10 µs in a
tight loop on the benchmark machine, and several times that when the same work last ran
a millisecond or more ago, whether the CPU slept or spun meanwhile (a shared VM: other
tenants evict our working set). This prints the cost after each gap, so figures taken
at different loads (a stream's events 2 ms apart, a burst of 32 streams back to back)
can be read against it.

    .venv/bin/python bench/cold_code.py [--cpu 1] [--rounds 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import orjson
from gateway_overhead import stream_events
from rich.console import Console
from rich.table import Table

from envport.gateway.app import _sse_data
from envport.gateway.capture import has_output

GAPS_MS = (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 20.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", type=int, default=None, help="pin to this CPU")
    parser.add_argument("--rounds", type=int, default=60, help="samples per gap and mode")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    events = stream_events(8)[:3]  # the first read of the benchmark's stream, and one more

    def work() -> None:
        for event in events:
            data = _sse_data(event)
            if data is not None and data != b"[DONE]":
                chunk = orjson.loads(data)
                if not isinstance(chunk, dict) or chunk.get("error"):
                    raise ValueError("bad chunk")
                has_output(chunk)

    for _ in range(500):
        work()
    hot = []
    for _ in range(args.rounds * 4):
        t0 = time.perf_counter_ns()
        work()
        hot.append(time.perf_counter_ns() - t0)
    table = Table(title="One stream read's checks (3 events), µs: p50 after a gap")
    table.add_column("gap ms", justify="right")
    table.add_column("slept", justify="right")
    table.add_column("spun", justify="right")
    table.add_column("slept / hot", justify="right")
    hot_us = statistics.median(hot) / 1000
    table.add_row("none (hot loop)", f"{hot_us:.1f}", f"{hot_us:.1f}", "1.0")
    for gap_ms in GAPS_MS:
        gap = gap_ms / 1000
        got: dict[str, float] = {}
        for mode in ("slept", "spun"):
            samples = []
            for _ in range(args.rounds):
                if mode == "slept":
                    time.sleep(gap)
                else:
                    end = time.perf_counter() + gap
                    while time.perf_counter() < end:
                        pass
                t0 = time.perf_counter_ns()
                work()
                samples.append(time.perf_counter_ns() - t0)
            got[mode] = statistics.median(samples) / 1000
        table.add_row(
            f"{gap_ms:g}",
            f"{got['slept']:.1f}",
            f"{got['spun']:.1f}",
            f"{got['slept'] / hot_us:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
