"""``envport run``: drive a batch of rollouts through the controller, with a live display.

A thin shell over :class:`envport.rollout.Controller`. The display counts rollouts by
state (pending, running, retrying, succeeded, failed) and shows environment start
latency; the summary table at the end adds attempts, retries, abandoned attempts of a
previous controller and re-adopted instances. Killed midway (Ctrl-C or SIGKILL), a run
is finished by the same command with ``--run-id ID --resume``: every rollout ends up in
the store exactly once.

``--backend`` picks where environments run: in this process, one local server process
each, one server per Linux sandbox (``sandbox``; environments that make sandboxes of
their own, such as ``sandbox-v1``, run their commands unisolated inside it: namespaces
do not nest there, and the outer sandbox is the isolation), Ray actors or Kubernetes
Jobs. A backend that cannot run (no isolation, no Ray cluster, no kubeconfig) is one
clear error before any rollout starts, saying what to do. Sandboxes die with a killed
controller; what they leave (mounts, cgroups) is removed by the next ``run``.

Ctrl-C is taken as mature tools take it (:func:`run_until_interrupted`): the first
cancels the rollouts and stops every environment; a second while that cleanup runs does
not cut it short, it says how many environments are still stopping; a third forces the
exit, killing every environment process group the run started on the way out. No press
leaves an environment server running.
"""

from __future__ import annotations

import asyncio
import enum
import os
import signal
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from envport.cli_runs import (
    DEFAULT_STORE,
    ApiKeyOpt,
    ConcurrencyOpt,
    LimitOpt,
    MaxTurnsOpt,
    ModelNameOpt,
    ModelOpt,
    RolloutsOpt,
    StoreOpt,
    _fail,
    check_new_run,
    check_ws_impl,
    err,
    load_tasks,
    local_scripted_model,
    out,
)
from envport.errors import EnvportError

if TYPE_CHECKING:
    from envport.rollout import Backend, ControllerSummary, RolloutEvent, RolloutSpec

_T = TypeVar("_T")


class BackendName(enum.StrEnum):
    INPROCESS = "inprocess"
    LOCAL = "local"
    SANDBOX = "sandbox"
    RAY = "ray"
    KUBERNETES = "kubernetes"


#: What to do when a backend cannot be reached.
_HINTS = {
    BackendName.RAY: ". Start a cluster with `ray start --head`, or pass --ray-address.",
    BackendName.KUBERNETES: ". Pass --kubeconfig PATH (or set KUBECONFIG), or run in a cluster.",
}

#: Environments that make a sandbox of their own (inside the sandbox backend's sandbox,
#: where namespaces cannot nest, they run their commands unisolated: the outer sandbox
#: is the isolation).
SANDBOXED_ENVS = ("sandbox-v1", "shell-v1")


def run_command(
    taskset: Annotated[
        str,
        typer.Argument(
            help="builtin:NAME, a .jsonl file, a Harbor task dir, hf:PATH, *.parquet, "
            "entrypoint:NAME or module:Class.",
            show_default=False,
        ),
    ],
    backend: Annotated[
        BackendName,
        typer.Option(
            case_sensitive=False,
            help="Where environments run: [bold]inprocess[/] (no sockets), [bold]local[/] "
            "(one envport server process per instance), [bold]sandbox[/] (each server in "
            "its own Linux sandbox, needs bubblewrap), [bold]ray[/] (actors on a running "
            "Ray cluster) or [bold]kubernetes[/] (one Job per instance).",
        ),
    ] = BackendName.INPROCESS,
    allow_unisolated: Annotated[
        bool,
        typer.Option(
            help="Where sandboxes cannot be isolated (no bubblewrap, no user namespaces): "
            "run them as plain local processes instead of failing ([bold]sandbox[/] falls "
            "back to [bold]local[/]; sandbox-v1 runs commands unisolated). Local backends "
            "only: on ray and kubernetes the nodes' own setup decides."
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            envvar="RAY_ADDRESS",
            help="Ray cluster to use (host:port or ray://host:port). Omitted: the cluster "
            "started on this machine with `ray start --head`.",
        ),
    ] = None,
    k8s_namespace: Annotated[
        str, typer.Option(help="Kubernetes namespace for the instances' Jobs.")
    ] = "default",
    k8s_image: Annotated[
        str, typer.Option(help="Container image with envport installed (Kubernetes).")
    ] = "envport:latest",
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            envvar="KUBECONFIG",
            help="Kubeconfig file. Omitted: the in-cluster config, then ~/.kube/config.",
        ),
    ] = None,
    model: ModelOpt = None,
    model_name: ModelNameOpt = "default",
    api_key: ApiKeyOpt = None,
    rollouts: RolloutsOpt = 1,
    concurrency: ConcurrencyOpt = 16,
    attempts: Annotated[
        int, typer.Option(min=1, help="Attempts per rollout (infrastructure retries + 1).")
    ] = 3,
    limit: LimitOpt = None,
    max_turns: MaxTurnsOpt = 10,
    sessions: Annotated[int, typer.Option(min=1, help="Sessions one instance hosts.")] = 1,
    pool_size: Annotated[
        int, typer.Option(min=0, help="Instances kept warm per environment type.")
    ] = 0,
    max_episodes: Annotated[
        int | None, typer.Option(min=1, help="Recycle an instance after N episodes.")
    ] = None,
    hang_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds without a heartbeat before an attempt aborts.")
    ] = 180.0,
    agent_timeout: Annotated[float, typer.Option(min=0.1, help="Agent deadline (s).")] = 300.0,
    store: StoreOpt = DEFAULT_STORE,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where local instances are tracked (default: next to the store)."),
    ] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id (default: new).")] = None,
    resume: Annotated[
        bool,
        typer.Option(help="Finish run --run-id: skip final rollouts, re-run in-flight ones."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run a batch of rollouts through the controller, with a live progress display.

    Kill it midway and rerun with [bold]--run-id ID --resume[/]: each rollout is stored
    exactly once.
    """
    import uuid

    from envport.harness import AgentConfig
    from envport.rollout import ControllerConfig, RolloutSpec
    from envport.rollout.backends import BackendError

    task_list = load_tasks(taskset, limit, resume=resume, run_id=run_id, store=store)
    run_id = run_id or uuid.uuid4().hex[:12]
    env_options: dict[str, dict[str, Any]] = {}
    local = (BackendName.INPROCESS, BackendName.LOCAL, BackendName.SANDBOX)
    if allow_unisolated and backend not in local:
        _fail(
            f"--allow-unisolated applies to the local backends only; on {backend.value} "
            "the nodes' own setup decides whether sandboxes are isolated."
        )
    if backend in local and (allow_unisolated or backend is BackendName.SANDBOX):
        env_options = {env: {"allow_unisolated": True} for env in SANDBOXED_ENVS}
    config = ControllerConfig(
        env_options=env_options,
        concurrency=concurrency,
        max_attempts=attempts,
        hang_timeout_s=hang_timeout,
        agent_timeout_s=agent_timeout,
        scoring_timeout_s=agent_timeout,
        sessions_per_instance=sessions,
        pool_size=pool_size,
        max_episodes=max_episodes,
    )
    specs = [RolloutSpec(task, k) for task in task_list for k in range(rollouts)]
    check_new_run(store, run_id, resume=resume)
    backend_factory = _backend_factory(
        backend,
        state_dir=state_dir or store.parent / "instances",
        allow_unisolated=allow_unisolated,
        ray_address=ray_address,
        k8s_namespace=k8s_namespace,
        k8s_image=k8s_image,
        kubeconfig=kubeconfig,
    )
    made: list[Backend] = []  # the backend, once made: what a forced exit kills

    def make_backend() -> Backend:
        made.append(backend_factory())
        return made[-1]

    resume_hint = (
        f"finish it with [bold]envport run {taskset} --run-id {run_id} --resume --store {store}[/]"
    )
    with ExitStack() as stack:
        if model is None:
            model = stack.enter_context(local_scripted_model())
            if not as_json:
                out.print(
                    f"[yellow]No --model given: using envport's scripted stand-in at {model} "
                    "(rule-based, not a model).[/]"
                )
        try:
            summary, mean_reward = run_until_interrupted(
                _drive(
                    specs,
                    store=store,
                    backend_factory=make_backend,
                    model_url=model,
                    model_name=model_name,
                    api_key=api_key,
                    agent=AgentConfig(max_turns=max_turns),
                    config=config,
                    run_id=run_id,
                    resume=resume,
                    taskset=taskset,
                    quiet=as_json,
                ),
                made,
                forced=lambda: err.print(f"[yellow]forced exit:[/] {resume_hint}"),
            )
        except KeyboardInterrupt:
            err.print(f"[yellow]interrupted:[/] {resume_hint}")
            raise typer.Exit(130) from None
        except BackendError as exc:
            _fail(f"--backend {backend.value}: {exc}{_HINTS.get(backend, '')}")
            return
        except EnvportError as exc:
            _fail(str(exc))
            return
    if as_json:
        out.print_json(data={**summary.model_dump(mode="json"), "mean_reward": mean_reward})
        return
    out.print()
    out.print(summary_table(summary, mean_reward))
    out.print(f"Traces: [bold]envport traces list --run {run_id} --store {store}[/]")


class _Interrupted(Exception):
    """The work was cancelled by Ctrl-C, and has finished stopping."""


def run_until_interrupted(
    work: Coroutine[Any, Any, _T],
    backends: Sequence[Backend],
    *,
    forced: Callable[[], None] = lambda: None,
) -> _T:
    """``asyncio.run(work)``, with Ctrl-C taken in three steps.

    1. The first press cancels ``work``, which stops what it started (rollouts are
       abandoned and requeued, environments stopped); :class:`KeyboardInterrupt` is
       raised once it has finished stopping.
    2. A press while that cleanup runs does not cut it short (asyncio's own handler
       would: a second press tears the loop down mid-stop, and a server whose stop was
       waiting for it to exit is left running). It says how many environments of
       ``backends`` are still stopping, and that a third press forces the exit.
    3. The third press kills every environment ``backends`` have not stopped yet
       (:meth:`~envport.rollout.Backend.kill_now`: SIGKILL to each server's process
       group), calls ``forced`` (a last word) and exits with status 130 at once.

    Whatever ends the run, instances the backends still hold when it returns are
    killed, so none outlives the command.
    """
    try:
        return asyncio.run(_interruptible(work, backends, forced))
    except _Interrupted:
        raise KeyboardInterrupt from None
    finally:
        for backend in backends:
            backend.kill_now()


async def _interruptible(
    work: Coroutine[Any, Any, _T], backends: Sequence[Backend], forced: Callable[[], None]
) -> _T:
    loop = asyncio.get_running_loop()
    job = asyncio.ensure_future(work)
    presses = 0

    def on_sigint() -> None:
        nonlocal presses
        presses += 1
        if presses == 1:
            job.cancel()
            return
        if presses == 2:
            n = sum(b.outstanding() for b in backends)
            what = f"still stopping {n} environment{'s' if n != 1 else ''}" if n else "stopping"
            err.print(f"[yellow]{what}; press Ctrl-C again to force[/]")
            return
        killed = sum(b.kill_now() for b in backends)
        err.print(f"[yellow]forced: killed {killed} environment process group(s)[/]")
        forced()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # no signals here: asyncio's own
        return await job
    try:
        return await job
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if presses and (task is None or not task.cancelling()):
            raise _Interrupted from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _backend_factory(
    name: BackendName,
    *,
    state_dir: Path,
    allow_unisolated: bool,
    ray_address: str | None,
    k8s_namespace: str,
    k8s_image: str,
    kubeconfig: Path | None,
) -> Callable[[], Backend]:
    """What makes the backend, after checks that fail fast with a clear message (exit 1)
    where it cannot run: no isolation for sandboxes, no Ray cluster, no kubeconfig."""
    from envport.rollout import InProcessBackend, LocalProcessBackend

    if name is BackendName.LOCAL:
        check_ws_impl()  # its servers read ENVPORT_WS_IMPL
        return lambda: LocalProcessBackend(state_dir)
    if name is BackendName.SANDBOX:
        from envport.rollout.backends.sandbox import SandboxBackend
        from envport.sandbox import cleanup_stale, probe

        isolation = probe()
        if not isolation.isolated:
            if not allow_unisolated:
                _fail(
                    f"--backend sandbox cannot isolate environments here: "
                    f"{isolation.explain()}. It needs bubblewrap (bwrap) and the right to "
                    "mount in a user namespace. Pass --allow-unisolated to run them as plain "
                    "local processes instead (no namespaces, no limits), or use --backend local."
                )
            err.print(  # on stderr even with --json: it changes what the run means
                "[yellow]No sandbox isolation here; --allow-unisolated: running "
                "environments as local processes (--backend local).[/]"
            )
            check_ws_impl()
            return lambda: LocalProcessBackend(state_dir)
        # Sandboxes die with the controller that made them; a killed controller leaves
        # their mounts and cgroups, which go now (those of live processes are kept).
        cleanup_stale()
        return SandboxBackend
    if name is BackendName.RAY:
        from envport.rollout.backends.ray import RayBackend

        address = _check_ray(ray_address)
        return lambda: RayBackend(address)
    if name is BackendName.KUBERNETES:
        from envport.rollout.backends.kubernetes import KubernetesBackend

        if (
            kubeconfig is not None
            and os.pathsep not in str(kubeconfig)
            and not kubeconfig.is_file()
        ):
            _fail(f"--kubeconfig {kubeconfig}: no such file.")
        return lambda: KubernetesBackend(
            namespace=k8s_namespace, image=k8s_image, kubeconfig=kubeconfig
        )
    return InProcessBackend


def _check_ray(address: str | None) -> str:
    """The Ray address to connect to; exits with a clear message if nothing answers there
    (Ray itself would wait a minute, or start a new local cluster)."""
    import socket

    if address is None:
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        try:
            address = current.read_text().strip()
        except OSError:
            address = ""
        if not address:
            _fail(
                "--backend ray: no Ray cluster is running on this machine. Start one with "
                "`ray start --head`, or pass --ray-address HOST:PORT (or set RAY_ADDRESS)."
            )
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        _fail(f"--ray-address {address!r}: expected HOST:PORT or ray://HOST:PORT.")
    try:
        socket.create_connection((host, int(port)), timeout=3.0).close()
    except OSError as exc:
        _fail(
            f"--backend ray: no Ray cluster answers at {address} ({exc}). Start one with "
            "`ray start --head`, or pass the right --ray-address."
        )
    return address


async def _drive(
    specs: list[RolloutSpec],
    *,
    store: Path,
    backend_factory: Callable[[], Backend],
    model_url: str,
    model_name: str,
    api_key: str | None,
    agent: Any,
    config: Any,
    run_id: str,
    resume: bool,
    taskset: str,
    quiet: bool,
) -> tuple[ControllerSummary, float | None]:
    from envport.harness import ChatModel, ToolCallingAgent
    from envport.rollout import Controller
    from envport.trace import AsyncTraceStore, SQLiteTraceStore

    display = LiveCounts(len(specs))
    chat = ChatModel(model_url, model_name, api_key=api_key)
    try:
        async with (
            AsyncTraceStore(SQLiteTraceStore(store)) as traces,
            backend_factory() as backend,
        ):
            await _preflight(backend)
            controller = Controller(
                traces,
                backend,
                ToolCallingAgent(chat, agent),
                config,
                run_id=run_id,
                taskset=taskset,
                on_event=display.update,
                run_config={"taskset": taskset, **config.model_dump(mode="json")},
            )
            display.env_start = controller.env_start_s  # the summary's samples, as they come
            live = Live(display, console=out, refresh_per_second=8)
            with nullcontext() if quiet else live:
                summary = await controller.run(specs)
    finally:
        await chat.aclose()
    rewards = [r for r in display.rewards if r is not None]
    return summary, (statistics.fmean(rewards) if rewards else None)


async def _preflight(backend: Backend) -> None:
    """Reach the backend once before any rollout starts, so a cluster that cannot be
    reached is one clear error, not a failed attempt per rollout."""
    if backend.name in (BackendName.RAY.value, BackendName.KUBERNETES.value):
        await backend.list()


def env_start_cell(pcts: Mapping[str, float], starts: int) -> str | None:
    """Environment start latency as the live display and the summary both show it:
    percentiles (:func:`~envport.rollout.controller.percentiles`) of ``starts`` samples,
    each an attempt that waited for a new instance to start (warm hits are not samples,
    and instances a warm pool started ahead are not counted). ``None`` without samples."""
    if not pcts:
        return None
    waited = f"{starts} attempt{'s' if starts != 1 else ''} waited for a new instance"
    return f"p50 {pcts['p50']:.2f} s · p99 {pcts['p99']:.2f} s · {waited}"


class LiveCounts:
    """Rollouts by state, updated from controller events; renders as a rich table.

    ``env_start`` is the controller's own list of start samples
    (:attr:`~envport.rollout.Controller.env_start_s`), so the live line and the summary
    are computed from the same samples the same way (:func:`env_start_cell`)."""

    def __init__(self, total: int, env_start: Sequence[float] = ()) -> None:
        self.total = total
        self.states: dict[str, str] = {}
        self.attempt: dict[str, int] = {}
        self.env_start = env_start
        self.rewards: list[float | None] = []
        self.skipped = 0

    def update(self, event: RolloutEvent) -> None:
        self.states[event.rollout_id] = event.state.value
        self.attempt[event.rollout_id] = event.attempt
        if event.skipped:
            self.skipped += 1
        if event.trace is not None and event.trace.status.value == "completed":
            self.rewards.append(event.trace.reward)

    def counts(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for rid, state in self.states.items():
            if state in ("starting_env", "running", "scoring"):
                c["retrying" if self.attempt.get(rid, 0) > 1 else "running"] += 1
            else:
                c[state] += 1
        c["pending"] += self.total - len(self.states)
        return c

    def __rich__(self) -> Group:
        c = self.counts()
        done = c["succeeded"] + c["failed"]
        table = Table.grid(padding=(0, 2))
        for _ in range(7):
            table.add_column(justify="right")
        table.add_row(
            "[bold]rollouts[/]",
            f"{done}/{self.total} done",
            f"[cyan]{c['running']} running[/]",
            f"[yellow]{c['retrying']} retrying[/]",
            f"[green]{c['succeeded']} succeeded[/]",
            f"[red]{c['failed']} failed[/]",
            f"{c['pending']} pending",
        )
        from envport.rollout.controller import percentiles

        starts = list(self.env_start)  # a copy: the controller appends as this renders
        line = Text("env start: ", style="bold")
        line.append(
            env_start_cell(percentiles(starts), len(starts))
            or "no attempt has waited for a new instance yet"
        )
        if self.skipped:
            line.append(f" · {self.skipped} already done (resume)")
        return Group(table, line)


def summary_table(summary: ControllerSummary, mean_reward: float | None) -> Table:
    table = Table(title=f"run {summary.run_id}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("rollouts", str(summary.rollouts)),
        ("succeeded", f"[green]{summary.succeeded}[/]"),
        ("failed", f"[red]{summary.failed}[/]"),
        ("skipped (already final)", str(summary.skipped)),
        ("attempts started", str(summary.attempts)),
        ("retried attempts", str(summary.retried)),
        ("abandoned (previous controller)", str(summary.abandoned)),
        ("instances re-adopted", str(summary.adopted)),
        (
            "errors by kind",
            ", ".join(f"{k}: {v}" for k, v in summary.errors_by_kind.items()) or "-",
        ),
        ("env start", env_start_cell(summary.env_start_s, summary.env_starts) or "-"),
        ("mean reward", "-" if mean_reward is None else f"{mean_reward:.3f}"),
        ("wall", f"{summary.wall_s:.1f} s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
