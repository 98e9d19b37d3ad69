"""The verifiers half of ``bench/eval_throughput.py``: N single-turn arithmetic rollouts.

Run with the isolated venv's interpreter (``bench/eval_throughput.py`` creates it at
``bench/.venvs/verifiers`` and launches this script with the right environment)::

    bench/.venvs/verifiers/bin/python bench/verifiers_side.py \\
        --base-url http://127.0.0.1:PORT/v1 --model scripted --n 48 --concurrency 16

Prints one JSON line on stdout::

    {"wall_s": ..., "setup_s": ..., "total_s": ..., "n": ..., "mean_reward": ...,
     "verifiers_version": ..., ...}

``wall_s`` is the evaluation call alone (``verifiers.v1.cli.eval.runner.run_eval``: env
and interception server up, N episodes, scoring, ``traces.jsonl`` written, teardown);
``setup_s`` is everything before it in this process (imports, config); ``total_s`` is
from interpreter start to the end of the evaluation, so it includes Python start-up.

What this runs is verifiers' own local eval path (what ``vf-eval`` does), with the
settings a plain local single-turn eval needs: verifiers >= 0.4 (``verifiers.v1``) has no
``SingleTurnEnv``; a plain taskset runs in ``SingleAgentEnv`` and the ``null`` harness is
its no-tools chat agent. Each rollout therefore runs that chat program as a subprocess
(a PEP 723 script whose environment ``uv`` prepares once per process) in a ``subprocess``
runtime, and the program's model calls go through verifiers' interception server
(127.0.0.1) to ``--base-url``. The rubric is a ``@vf.reward`` exact match on the last reply.

Nothing here leaves loopback: the Prime platform push is off (``push=False``), and the
runtime is the local ``subprocess`` one (the default, ``prime``, is a remote sandbox).
``HOME`` is pointed at ``bench/.venvs/verifiers-home`` (unless ``--home`` says otherwise)
so verifiers' and uv's caches stay out of the real home directory.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
TASKSET_MODULE = "envport_bench_arith"


BUILTIN = Path(__file__).resolve().parents[1] / "src/envport/tasks/builtin/arithmetic.jsonl"


def questions(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """The benchmark's workload: the first ``n`` tasks of envport's ``builtin:arithmetic``.

    Both sides answer exactly the same (question, answer) pairs; ``seed`` is unused and
    kept for the command line's compatibility.
    """
    out = []
    with BUILTIN.open() as fh:
        for line in fh:
            task = json.loads(line)
            out.append((task["prompt"], str(task["answer"])))
            if len(out) == n:
                break
    if len(out) < n:
        raise SystemExit(f"builtin:arithmetic has only {len(out)} tasks, {n} asked")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base-url",
        required=True,
        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1",
    )
    p.add_argument("--model", default="scripted")
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the evaluation this many times in this process; wall_s is the first "
        "(it includes the per-process uv check), wall_s_runs lists all",
    )
    p.add_argument(
        "--harness",
        choices=["null", "inproc"],
        default="null",
        help="null: verifiers' stock no-tools chat agent (a subprocess per rollout); "
        "inproc: the same env/interception/scoring, but the one chat call is made "
        "in-process (a lower bound on verifiers' own overhead)",
    )
    p.add_argument("--home", default=str(HERE / ".venvs" / "verifiers-home"))
    p.add_argument(
        "--output-dir", default=None, help="where run dirs go (default: a temp dir, removed)"
    )
    p.add_argument("--verbose", action="store_true", help="verifiers' logs on stderr")
    return p.parse_args(argv)


def install_taskset(items: list[tuple[str, str]]) -> None:
    """Register the arithmetic taskset as an importable module, the way verifiers
    resolves a taskset id (``import <id>``, exporting one ``Taskset`` via ``__all__``)."""
    import verifiers.v1 as vf

    class ArithData(vf.TaskData):
        answer: str

    class ArithTask(vf.Task[ArithData]):
        @vf.reward
        async def exact_match(self, task: ArithData, trace: vf.Trace) -> float:
            return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
        def load(self):
            for i, (question, answer) in enumerate(items):
                yield ArithTask(
                    ArithData(id=f"arith-{i}", prompt=question, answer=answer), self.config.task
                )

    module = types.ModuleType(TASKSET_MODULE)
    module.ArithTaskset = ArithTaskset
    module.__all__ = ["ArithTaskset"]
    sys.modules[TASKSET_MODULE] = module


def install_inproc_harness() -> str:
    """A harness whose agent is one in-process chat call through verifiers'
    interception endpoint (what the ``null`` harness's subprocess does, minus the
    process). Registered like a harness plugin; returns its id."""
    import verifiers.v1 as vf
    from openai import AsyncOpenAI
    from verifiers.v1.runtimes import ProgramResult

    clients: dict[tuple[str, str], AsyncOpenAI] = {}

    class InprocHarness(vf.Harness[vf.HarnessConfig]):
        APPENDS_SYSTEM_PROMPT = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def setup(self, runtime) -> None:
            return None

        async def launch(
            self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
        ):
            system_prompt, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": prompt})
            key = (endpoint, secret)
            if key not in clients:
                clients[key] = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            reply = await clients[key].chat.completions.create(model=ctx.model, messages=messages)
            return ProgramResult(
                exit_code=0, stdout=reply.choices[0].message.content or "", stderr=""
            )

    module = types.ModuleType("envport_bench_inproc")
    module.InprocHarness = InprocHarness
    module.__all__ = ["InprocHarness"]
    sys.modules["envport_bench_inproc"] = module
    return "envport_bench_inproc"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Caches (verifiers' runtimes dir, uv's script envs) go under an isolated HOME.
    home = Path(args.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"] = str(home)
    # The uv that prepares the chat program's environment: the one in this venv.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("VF_BENCH_API_KEY", "EMPTY")

    import logging

    import verifiers
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    if args.verbose:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    items = questions(args.n, args.seed)
    install_taskset(items)
    harness_id = install_inproc_harness() if args.harness == "inproc" else "null"

    tmp = None
    if args.output_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="vf-bench-")
        output_dir = Path(tmp.name)
    else:
        output_dir = Path(args.output_dir)

    def config(i: int) -> EvalConfig:
        return EvalConfig.model_validate(
            {
                "env": {
                    "taskset": {"id": TASKSET_MODULE},
                    "agent": {"harness": {"id": harness_id}, "runtime": {"type": "subprocess"}},
                },
                "model": args.model,
                "client": {
                    "type": "eval",
                    "base_url": args.base_url,
                    "api_key_var": "VF_BENCH_API_KEY",
                },
                "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens},
                "num_rollouts": 1,
                "max_concurrent": args.concurrency,
                "rich": None,
                "push": False,
                "output_dir": str(output_dir),
                "run": {"name": f"bench-{i}"},
            }
        )

    import asyncio

    setup_s = time.perf_counter() - _T0
    walls: list[float] = []
    episodes = []
    for i in range(max(1, args.repeats)):
        cfg = config(i)
        t = time.perf_counter()
        episodes = asyncio.run(run_eval(cfg))
        walls.append(time.perf_counter() - t)
    total_s = time.perf_counter() - _T0

    rewards, errors = [], 0
    for episode in episodes:
        for trace in episode.traces:
            rewards.append(float(trace.reward))
            if trace.has_error:
                errors += 1
    result = {
        "wall_s": round(walls[0], 4),
        "wall_s_runs": [round(w, 4) for w in walls],
        "setup_s": round(setup_s, 4),
        "total_s": round(total_s, 4),
        "n": len(rewards),
        "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "errors": errors,
        "concurrency": args.concurrency,
        "verifiers_version": verifiers.__version__,
        "harness": args.harness,
        "runtime": "subprocess",
    }
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(result), flush=True)
    return 0 if rewards else 1


if __name__ == "__main__":
    sys.exit(main())
