"""Eval throughput: N trivial single-turn rollouts end to end, envport vs verifiers.

Run from the repository root::

    .venv/bin/python bench/eval_throughput.py              # 48 rollouts, both sides
    .venv/bin/python bench/eval_throughput.py --quick      # 8 rollouts (smoke run)
    .venv/bin/python bench/eval_throughput.py --sides envport
    .venv/bin/python bench/eval_throughput.py --json       # one JSON object on stdout

One invocation starts envport's scripted OpenAI-compatible model server once
(``python -m envport.policy.server --port P --p-correct 1.0`` on a free loopback port,
waited for on ``/health``) and runs the same workload through:

* **envport**: ``envport eval TASKS.jsonl --model URL ...`` (agent, env, rubric, SQLite
  trace store) -- see ``run_envport``.
* **verifiers** (PyPI, latest): ``bench/verifiers_side.py`` under an isolated venv at
  ``bench/.venvs/verifiers`` (created and ``pip install verifiers uv`` on first run;
  git-ignored). ``--vf-harness null`` (default) is verifiers' stock no-tools chat agent,
  a subprocess per rollout; ``inproc`` makes the one chat call in-process (a lower bound
  on verifiers' own overhead); ``both`` runs both.

The workload: task ``k`` asks "What is {a} + {b}?" with ``a, b`` = ``randint(1, 99)``
twice from ``random.Random(k)`` (``verifiers_side.questions``); the reward is an exact
match of the reply against ``a + b``. Everything talks over 127.0.0.1 only; every wait
is bounded.

Target (issue 3): envport's wall time <= verifiers' / 10, and envport's own run under 2 s
on the 2-core machine. ``ratio`` in the table is the side's wall time / envport's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
VENVS = BENCH / ".venvs"
VF_VENV = VENVS / "verifiers"
VF_PYTHON = VF_VENV / "bin" / "python"
VF_HOME = VENVS / "verifiers-home"
PYTHON = ROOT / ".venv" / "bin" / "python"
ENVPORT = ROOT / ".venv" / "bin" / "envport"

sys.path.insert(0, str(BENCH))

# --- helpers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def policy_server(timeout_s: float = 30.0) -> Iterator[str]:
    """Start envport's scripted model server (always right: ``--p-correct 1.0``);
    yield its ``…/v1`` base URL; stop it."""
    port = free_port()
    logf = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [str(PYTHON), "-m", "envport.policy.server", "--port", str(port), "--p-correct", "1.0"],
        cwd=ROOT,
        stdout=logf,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                logf.seek(0)
                raise RuntimeError(
                    f"policy server exited {proc.returncode}: {logf.read()[-2000:]!r}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"policy server not healthy after {timeout_s:.0f}s")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        logf.close()


def last_json_line(text: str) -> dict:
    """The output's JSON object: the whole stdout if it is one (pretty-printed or not),
    else its last line that parses as one."""
    with contextlib.suppress(json.JSONDecodeError):
        whole = json.loads(text)
        if isinstance(whole, dict):
            return whole
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise ValueError(f"no JSON line in output: {text[-2000:]!r}")


# --- verifiers side ---------------------------------------------------------------------------


def ensure_verifiers_venv(spec: str = "verifiers") -> dict:
    """Create ``bench/.venvs/verifiers`` and install ``verifiers`` (+ ``uv``, which
    verifiers' subprocess runtime uses to prepare its chat program) on first use."""
    if VF_PYTHON.exists():
        probe = subprocess.run(
            [str(VF_PYTHON), "-c", "import verifiers, sys; print(verifiers.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if probe.returncode == 0 and (VF_VENV / "bin" / "uv").exists():
            return {"installed_now": False, "version": probe.stdout.strip()}
    log(f"creating {VF_VENV.relative_to(ROOT)} and installing {spec} (about 1.5 min, ~570 MB)…")
    t = time.perf_counter()
    VENVS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(VF_VENV)], check=True, timeout=300)
    subprocess.run(
        [str(VF_PYTHON), "-m", "pip", "install", "-q", spec, "uv"], check=True, timeout=1200
    )
    return {"installed_now": True, "install_s": round(time.perf_counter() - t, 1)}


def run_verifiers(base_url: str, n: int, concurrency: int, harness: str, timeout_s: float) -> dict:
    """Run ``bench/verifiers_side.py`` in the isolated venv; its JSON line, plus the
    subprocess's own wall time (``process_s``: interpreter start to exit)."""
    cmd = [
        str(VF_PYTHON),
        str(BENCH / "verifiers_side.py"),
        "--base-url", base_url,
        "--model", "scripted",
        "--n", str(n),
        "--concurrency", str(concurrency),
        "--harness", harness,
        "--home", str(VF_HOME),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    process_s = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"verifiers side failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = last_json_line(proc.stdout)
    result["process_s"] = round(process_s, 4)
    return result


# --- envport side -----------------------------------------------------------------------------


# ============================================================================================
# ENVPORT SIDE: `envport eval builtin:arithmetic --limit N` (the same N questions the
# verifiers side reads from that taskset's file).
# Expected contract: `envport eval TASKSET --model URL --rollouts 1 --concurrency C
# --store PATH --json` runs every task through the built-in agent against URL, scores and
# stores them, and prints a JSON summary (last JSON line on stdout). Adjust the argv and
# the summary keys read below (`mean_reward`/`n`) to whatever the command really prints.
# ============================================================================================
def run_envport(
    base_url: str, n: int = 48, concurrency: int = 16, timeout_s: float = 300.0
) -> dict:
    with tempfile.TemporaryDirectory(prefix="envport-bench-") as tmp:
        cmd = [
            str(ENVPORT), "eval", "builtin:arithmetic", "--limit", str(n),
            "--model", base_url,
            "--model-name", "scripted",
            "--rollouts", "1",
            "--concurrency", str(concurrency),
            "--store", str(Path(tmp) / "bench.db"),
            "--json",
        ]  # fmt: skip
        env = {**os.environ, "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "EMPTY")}
        t = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        process_s = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"envport eval failed ({proc.returncode}): {proc.stderr[-3000:]}")
    summary = last_json_line(proc.stdout)
    if summary.get("failed"):
        raise RuntimeError(
            f"envport: {summary['failed']} rollouts failed: {summary.get('errors_by_kind')}"
        )
    return {
        # The whole command (interpreter start, import, run, store) is what is timed here;
        # if the summary reports its own eval-only wall time, use it for `wall_s`.
        "wall_s": round(float(summary.get("wall_s", process_s)), 4),
        "process_s": round(process_s, 4),
        "n": summary.get("n", summary.get("rollouts", n)),
        "mean_reward": summary.get("mean_reward", summary.get("reward")),
        "summary": summary,
    }


# --- main -------------------------------------------------------------------------------------


def render(rows: list[dict], n: int) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    base = next((r for r in rows if r["side"] == "envport" and "wall_s" in r), None)
    table = Table(title=f"eval throughput: {n} single-turn rollouts, same local model server")
    for col in ("side", "n", "mean reward", "eval wall s", "process s", "rollouts/s", "x envport"):
        table.add_column(col, justify="left" if col == "side" else "right")
    for r in rows:
        if "error" in r:
            table.add_row(
                escape(r["side"]), "-", "-", "-", "-", "-", f"[red]{escape(r['error'][:60])}[/red]"
            )
            continue
        ratio = f"{r['wall_s'] / base['wall_s']:.1f}x" if base else "-"
        table.add_row(
            escape(r["side"]),
            str(r.get("n")),
            f"{r['mean_reward']:.3f}" if isinstance(r.get("mean_reward"), (int, float)) else "-",
            f"{r['wall_s']:.3f}",
            f"{r.get('process_s', float('nan')):.2f}",
            f"{(r.get('n') or n) / r['wall_s']:.1f}",
            ratio,
        )
    Console(width=max(100, shutil.get_terminal_size().columns)).print(table)
    if base:
        verdicts = []
        for r in rows:
            if r["side"].startswith("verifiers") and "wall_s" in r:
                ok = r["wall_s"] >= 10 * base["wall_s"]
                verdicts.append(f"{r['side']}: {'met' if ok else 'MISSED'} (≥10x)")
        verdicts.append(f"envport < 2 s: {'met' if base['wall_s'] < 2 else 'MISSED'}")
        print("targets: " + "; ".join(verdicts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="n=8")
    p.add_argument("--sides", default="envport,verifiers", help="comma list of envport, verifiers")
    p.add_argument("--vf-harness", choices=["null", "inproc", "both"], default="null")
    p.add_argument("--vf-spec", default="verifiers", help="pip requirement for the verifiers venv")
    p.add_argument("--timeout", type=float, default=540.0, help="per side, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    n = 8 if args.quick else args.n
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]

    install = None
    if "verifiers" in sides:
        if (
            shutil.which("git")
            and subprocess.run(["git", "check-ignore", "-q", str(VF_VENV)], cwd=ROOT).returncode
            != 0
        ):
            log("warning: bench/.venvs/ is not git-ignored")
        install = ensure_verifiers_venv(args.vf_spec)

    rows: list[dict] = []
    with policy_server() as base_url:
        log(f"model server: {base_url}")
        if "envport" in sides:
            log("envport …")
            try:
                rows.append(
                    {"side": "envport", **run_envport(base_url, n, args.concurrency, args.timeout)}
                )
            except Exception as exc:
                rows.append({"side": "envport", "error": str(exc)})
        if "verifiers" in sides:
            harnesses = ["null", "inproc"] if args.vf_harness == "both" else [args.vf_harness]
            for harness in harnesses:
                log(f"verifiers ({harness}) …")
                try:
                    res = run_verifiers(base_url, n, args.concurrency, harness, args.timeout)
                    rows.append(
                        {
                            "side": f"verifiers {res.get('verifiers_version', '?')} [{harness}]",
                            **res,
                        }
                    )
                except Exception as exc:
                    rows.append({"side": f"verifiers [{harness}]", "error": str(exc)})

    if args.json:
        print(
            json.dumps(
                {
                    "n": n,
                    "concurrency": args.concurrency,
                    "verifiers_install": install,
                    "rows": rows,
                }
            )
        )
    else:
        render(rows, n)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
