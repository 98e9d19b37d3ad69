"""``envport eval`` and ``envport traces``: whole runs, from the command line.

Thin shells over :mod:`envport.evaluate`, :mod:`envport.trace` and :mod:`envport.report`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from envport.errors import EnvportError

# No emoji codes: user text (task ids, paths, messages) prints as written.
out = Console(emoji=False)
err = Console(stderr=True, emoji=False)

DEFAULT_STORE = Path("runs/envport.db")
# Commands that write traces create the store; those that read them need it to exist.
StoreOpt = Annotated[Path, typer.Option("--store", help="SQLite trace store (created if missing).")]
ExistingStoreOpt = Annotated[
    Path, typer.Option("--store", help="SQLite trace store to read (it must exist).")
]

# Options `eval` and `run` share.
ModelOpt = Annotated[
    str | None,
    typer.Option(
        help="OpenAI-compatible base URL (…/v1). Omitted: start envport's local "
        "[bold]scripted[/] model server (a stand-in, not a model)."
    ),
]
ModelNameOpt = Annotated[str, typer.Option(help="Model name sent upstream.")]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        envvar="OPENAI_API_KEY",
        help="API key for --model, sent as Authorization: Bearer KEY (omitted: a placeholder).",
        show_default=False,
    ),
]
RolloutsOpt = Annotated[int, typer.Option("--rollouts", "-k", min=1, help="Per task.")]
ConcurrencyOpt = Annotated[
    int, typer.Option("--concurrency", "-c", min=1, help="Rollouts in flight at once.")
]
LimitOpt = Annotated[int | None, typer.Option(min=1, help="Only the first N tasks.")]
MaxTurnsOpt = Annotated[int, typer.Option(min=1, help="Model calls per rollout, at most.")]


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def load_tasks(
    taskset: str,
    limit: int | None,
    *,
    resume: bool,
    run_id: str | None,
    store: Path,
    invalid: list[Any] | None = None,
) -> list[Any]:
    """The tasks a run command works on; exits with a clear error on a bad taskset.

    With ``invalid`` (a list), a JSONL file's malformed lines go there (as
    ``TaskFileError``) instead of stopping the command: each becomes a failed trace."""
    from envport.tasks import TasksetError, load

    if resume and not run_id:
        _fail("--resume needs --run-id (see `envport traces runs`).")
    lenient = invalid is not None and Path(taskset).suffix == ".jsonl" and Path(taskset).is_file()
    try:
        tasks = load(taskset, invalid=invalid) if lenient else load(taskset)
        task_list = list(tasks.head(limit) if limit else tasks)
    except (TasksetError, EnvportError, OSError, ValueError) as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits
    if not task_list and not invalid:
        _fail(f"{taskset} has no tasks.")
    store.parent.mkdir(parents=True, exist_ok=True)
    return task_list


def check_new_run(store: Path, run_id: str | None, *, resume: bool) -> None:
    """Exit with a clear error if ``run_id`` already has traces in ``store`` and this is
    not a ``--resume``: before any server starts or any progress shows."""
    if resume or run_id is None or not store.exists():
        return
    from envport.trace import SQLiteTraceStore

    with SQLiteTraceStore(store) as db:
        n = db.count(run_id=run_id)
    if n:
        _fail(
            f"run {run_id!r} already has {n} traces in {store}; finish it with --resume "
            "or choose another --run-id"
        )


def check_ws_impl() -> None:
    """Exit with one line if ``ENVPORT_WS_IMPL`` names no WebSocket implementation, before
    an environment server that would read it starts."""
    from envport.server import ws_impl

    try:
        ws_impl()
    except ValueError as exc:
        _fail(str(exc))


@contextmanager
def local_scripted_model() -> Iterator[str]:
    """Start envport's scripted OpenAI-compatible server; yields its ``/v1`` base URL."""
    from envport.policy import create_policy_app
    from envport.serving import serve_in_thread

    with serve_in_thread(create_policy_app()) as url:
        yield url + "/v1"


@contextmanager
def env_servers(
    env_ids: set[str], host_dirs: Mapping[str, frozenset[str]] | None = None
) -> Iterator[dict[str, str]]:
    """One envport server per environment id, on loopback; yields id -> URL. An id's
    ``host_dirs`` (the directories its tasks name) are granted as ``workspace_roots``."""
    from envport.registry import resolve
    from envport.server import ServerConfig, create_app
    from envport.serving import serve_in_thread

    urls: dict[str, str] = {}
    with ExitStack() as stack:
        for env_id in sorted(env_ids):
            config = ServerConfig()
            roots = sorted((host_dirs or {}).get(env_id, ()))
            try:
                factory, _ = resolve(env_id, {"workspace_roots": roots} if roots else None)
                app = create_app(factory, config, host="127.0.0.1")
            except EnvportError as exc:  # its tasks fail, in-process, as environment errors
                note = escape(f"not serving {env_id!r}: {exc}")
                err.print(f"[yellow]note:[/] {note}", soft_wrap=True)
                continue
            urls[env_id] = stack.enter_context(serve_in_thread(app, config=config))
        yield urls


def eval_command(
    taskset: Annotated[
        str,
        typer.Argument(
            help="builtin:NAME, a .jsonl file, a Harbor task dir, hf:PATH, *.parquet, "
            "entrypoint:NAME or module:Class.",
            show_default=False,
        ),
    ],
    model: ModelOpt = None,
    model_name: ModelNameOpt = "default",
    api_key: ApiKeyOpt = None,
    rollouts: RolloutsOpt = 1,
    concurrency: ConcurrencyOpt = 16,
    limit: LimitOpt = None,
    max_turns: MaxTurnsOpt = 10,
    serve_envs: Annotated[
        bool,
        typer.Option(
            "--serve-envs/--in-process",
            help="Drive each environment through a real envport server over WebSocket, "
            "or in-process (no sockets).",
        ),
    ] = False,
    store: StoreOpt = DEFAULT_STORE,
    run_id: Annotated[str | None, typer.Option(help="Run id (default: new).")] = None,
    resume: Annotated[
        bool, typer.Option(help="Finish run --run-id without redoing finished rollouts.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run a taskset: tasks x rollouts through the built-in agent, scored and stored."""
    from envport.evaluate import EvalConfig
    from envport.harness import AgentConfig
    from envport.harness.agent import task_host_dirs
    from envport.report import summary_table
    from envport.rollout.controller import takes_workspace_roots

    invalid: list[Any] = []
    task_list = load_tasks(
        taskset, limit, resume=resume, run_id=run_id, store=store, invalid=invalid
    )
    check_new_run(store, run_id, resume=resume)
    if serve_envs:
        check_ws_impl()
    if invalid and not as_json:
        err.print(
            "[yellow]note:[/] "
            + escape(
                f"{len(invalid)} malformed task(s) in {taskset}, each recorded as a failed "
                f"trace (kind 'task'); first: {invalid[0]}"
            ),
            soft_wrap=True,
        )
    with ExitStack() as stack:
        if model is None:
            model = stack.enter_context(local_scripted_model())
            if not as_json:
                out.print(
                    f"[yellow]No --model given: using envport's scripted stand-in at {model} "
                    "(rule-based, not a model).[/]"
                )
        env_urls: dict[str, str] = {}
        if serve_envs:
            ids = {t.env_id for t in task_list if t.env_id}
            dirs: dict[str, frozenset[str]] = {}
            for t in task_list:
                if t.env_id and (named := task_host_dirs(t)) and takes_workspace_roots(t.env_id):
                    dirs[t.env_id] = dirs.get(t.env_id, frozenset()) | named
            env_urls = stack.enter_context(env_servers(ids, dirs))
        config = EvalConfig(
            rollouts=rollouts,
            concurrency=concurrency,
            env_urls=env_urls,
            agent=AgentConfig(max_turns=max_turns),
        )
        try:
            summary = asyncio.run(
                _run(
                    model,
                    model_name,
                    api_key,
                    store,
                    config,
                    task_list,
                    taskset,
                    run_id,
                    resume,
                    quiet=as_json,
                    invalid=invalid,
                )
            )
        except EnvportError as exc:  # e.g. a run id already used, without --resume
            _fail(exc.message)
            return
    if as_json:
        out.print_json(summary.model_dump_json())
        return
    out.print(summary_table(summary))
    out.print(
        f"Traces in [bold]{store}[/]: [bold]envport traces list --run {summary.run_id}"
        f" --store {store}[/], then [bold]envport traces show TRACE_ID --store {store}[/]"
    )


async def _run(
    base_url: str,
    model_name: str,
    api_key: str | None,
    store_path: Path,
    config: Any,
    tasks: list[Any],
    taskset: str,
    run_id: str | None,
    resume: bool,
    *,
    quiet: bool,
    invalid: list[Any] | None = None,
) -> Any:
    from envport.evaluate import Evaluator
    from envport.harness import ChatModel
    from envport.report import EvalProgress
    from envport.trace import AsyncTraceStore, SQLiteTraceStore, Trace

    model = ChatModel(base_url, model_name, api_key=api_key)
    progress = Progress(
        TextColumn("[bold]eval[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=out,
        disable=quiet,
        transient=False,
    )
    bar = progress.add_task("rollouts", total=None, stats="")
    tally = EvalProgress()

    def started(n: int) -> None:
        progress.update(bar, total=n)

    def done(trace: Trace) -> None:
        tally.add(trace)
        progress.update(bar, advance=1, stats=tally.markup())

    try:
        with progress:
            async with AsyncTraceStore(SQLiteTraceStore(store_path)) as store:
                evaluator = Evaluator(model, store, config, taskset_name=taskset)
                return await evaluator.run(
                    tasks,
                    run_id=run_id,
                    resume=resume,
                    on_done=done,
                    on_start=started,
                    invalid=invalid or (),
                )
    finally:
        await model.aclose()


traces_app = typer.Typer(
    help="Stored traces: list them and their runs, show one, export and import them.",
    no_args_is_help=True,
)


def _open(store: Path) -> Any:
    """The existing store at ``store``, or a one-line error (exit 2) saying why not."""
    from envport.trace import SQLiteTraceStore, TraceStoreError

    if not store.exists():
        _fail(f"No trace store at {store}; run `envport eval` first or pass --store.")
    if not store.is_file():
        _fail(f"{store} is not a trace store file (it is a directory?); pass --store FILE.")
    try:
        return SQLiteTraceStore(store)
    except TraceStoreError as exc:  # not SQLite, a newer schema, locked, unreadable
        _fail(str(exc))


def _warn_if_no_traces(db: Any, run: str | None, store: Path) -> None:
    """Warn on stderr when ``--run`` names a run with no traces in the store (a typo reads
    as an empty result otherwise), naming the runs it holds; the exit status stays 0."""
    if run is None or any(db.count_by_status(run_id=run).values()):
        return
    runs = [r.run_id for r in db.list_runs()]
    shown = ", ".join(runs[-10:]) or "(none)"
    if len(runs) > 10:
        shown = f"{shown} and {len(runs) - 10} older (envport traces runs)"
    err.print(
        f"[yellow]warning:[/] no traces of run {escape(repr(run))} in {escape(str(store))}; "
        f"runs there: {escape(shown)}",
        soft_wrap=True,
    )


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix) that replaces it on success.

    A failed export leaves no half-written file and an earlier file untouched."""
    import os

    if not path.parent.is_dir():
        _fail(f"Cannot export to {path}: directory {path.parent} does not exist.")
    if path.is_dir():
        _fail(f"Cannot export to {path}: it is a directory.")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial{path.suffix}")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


@traces_app.command("list")
def traces_list(
    store: ExistingStoreOpt = DEFAULT_STORE,
    run: Annotated[str | None, typer.Option(help="Only this run id.")] = None,
    task: Annotated[str | None, typer.Option(help="Only this task id.")] = None,
    status: Annotated[str | None, typer.Option(help="completed, failed, …")] = None,
    min_reward: Annotated[float | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1)] = 50,
) -> None:
    """A table of the newest --limit traces, newest last."""
    from envport.report import traces_table

    db = _open(store)
    try:
        traces = db.query(
            run_id=run,
            task_id=task,
            status=status,
            min_reward=min_reward,
            limit=limit,
            descending=True,
        )
        _warn_if_no_traces(db, run, store)
    except (EnvportError, ValueError) as exc:  # an unknown --status, a trace that won't parse
        _fail(str(exc))
        return
    finally:
        db.close()
    out.print(traces_table(traces[::-1]))


@traces_app.command("runs")
def traces_runs(store: ExistingStoreOpt = DEFAULT_STORE) -> None:
    """The runs in the store, with counts by status."""
    from rich.table import Table

    db = _open(store)
    try:
        table = Table("run", "created", "traces by status", title="runs", title_justify="left")
        for run in db.list_runs():
            counts = db.count_by_status(run_id=run.run_id)
            cells = ", ".join(f"{k.value}: {v}" for k, v in counts.items())
            table.add_row(run.run_id, run.created_at.isoformat(timespec="seconds"), cells)
    except EnvportError as exc:
        _fail(str(exc))
    finally:
        db.close()
    out.print(table)


@traces_app.command("show")
def traces_show(
    trace_id: Annotated[str, typer.Argument(show_default=False)],
    store: ExistingStoreOpt = DEFAULT_STORE,
    as_json: Annotated[bool, typer.Option("--json", help="The raw trace as JSON.")] = False,
    tokens: Annotated[
        bool, typer.Option("--tokens", help="Every token id and logprob of every model call.")
    ] = False,
) -> None:
    """One trace as a readable transcript, model calls with token ids included."""
    from envport.report import transcript

    db = _open(store)
    try:
        trace = db.get(trace_id)
    except EnvportError as exc:  # no such trace, or one that does not parse
        _fail(str(exc))
        return
    finally:
        db.close()
    if as_json:
        out.print_json(trace.to_json())
    else:
        out.print(transcript(trace, all_tokens=tokens))


EXPORT_FORMATS = ("trace", "rows", "prime-rl", "art")


@traces_app.command("export")
def traces_export(
    path: Annotated[Path, typer.Argument(help="Output file: .jsonl or .parquet.")],
    store: ExistingStoreOpt = DEFAULT_STORE,
    run: Annotated[str | None, typer.Option(help="Only this run id.")] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="trace (whole traces), rows (token-exact training rows), prime-rl (rows in "
            "prime-rl's TrainingSample columns) or art (OpenPipe ART TrajectoryGroups, JSONL).",
        ),
    ] = "trace",
) -> None:
    """Export traces, or the training data made from them, to JSONL or Parquet."""
    if fmt not in EXPORT_FORMATS:
        _fail(f"Unknown --format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}.")
    if fmt == "art" and path.suffix != ".jsonl":
        _fail("--format art writes JSONL (one TrajectoryGroup a line): use a .jsonl path.")
    if path.suffix not in (".jsonl", ".parquet"):
        _fail(f"Cannot export to {path}: use a .jsonl or .parquet path.")
    db = _open(store)
    try:
        _warn_if_no_traces(db, run, store)
        with _replacing(path) as tmp:
            if fmt == "trace":
                from envport.trace import export_traces

                n = export_traces(db, tmp, run_id=run)
            else:
                traces = db.query(run_id=run, limit=None)
                n = _export_training(traces, tmp, fmt)
    except (EnvportError, OSError, ImportError) as exc:  # a bad trace, no pyarrow, a full disk
        _fail(f"Cannot export to {path}: {exc}")
        return
    finally:
        db.close()
    if fmt == "trace":
        out.print(f"wrote {n} traces to {path}")
    elif fmt == "art":
        out.print(f"wrote {n} trajectory groups ({len(traces)} traces) to {path}")
    else:
        shape = "prime-rl" if fmt == "prime-rl" else "envport"
        out.print(f"wrote {n} rows ({shape}) to {path}")


def _export_training(traces: list[Any], path: Path, fmt: str) -> int:
    """Write the training data ``fmt`` names, made from ``traces``, to ``path``."""
    from envport import train

    if fmt == "art":
        return train.write_art_jsonl(traces, path)
    result = train.build_all(traces)
    rows = train.assign_advantages(result.rows)
    shape: train.export.Shape = "prime-rl" if fmt == "prime-rl" else "envport"
    if shape == "prime-rl":
        rows = [r for r in rows if r.logprobs is not None]
    writer = train.write_rows_parquet if path.suffix == ".parquet" else train.write_rows_jsonl
    n = writer(rows, path, shape=shape)
    out.print(train.summary_table(train.summarise([result])))
    return n


@traces_app.command("import")
def traces_import(
    path: Annotated[Path, typer.Argument(help="A .jsonl or .parquet export.")],
    store: StoreOpt = DEFAULT_STORE,
) -> None:
    """Import traces from JSONL or Parquet into the store."""
    from envport.trace import SQLiteTraceStore, TraceStoreError, import_traces
    from envport.trace.export import format_of

    # Everything about the input that can be checked is, before the store is touched.
    if not path.exists():
        _fail(f"Cannot import {path}: no such file.")
    if not path.is_file():
        _fail(f"Cannot import {path}: it is not a file.")
    try:
        format_of(path)
    except ValueError:
        _fail(f"Cannot import {path}: cannot tell its format; use a .jsonl or .parquet file.")
    if store.is_dir():
        _fail(f"{store} is not a trace store file (it is a directory); pass --store FILE.")
    created = [p for p in (store, *store.parents) if not p.exists()]  # removed on failure
    store.parent.mkdir(parents=True, exist_ok=True)
    try:
        db = SQLiteTraceStore(store)
    except TraceStoreError as exc:
        _undo(created)
        _fail(str(exc))
        return
    try:
        n = import_traces(db, path)
    except (EnvportError, ValueError, OSError, ImportError) as exc:  # a bad record, I/O
        db.close()
        _undo(created)
        _fail(str(exc))
        return
    db.close()
    out.print(f"imported {n} traces into {store}")


def _undo(created: list[Path]) -> None:
    """Remove a store (with its WAL files) and folders that a failed import created."""
    if not created:
        return
    store = created[0]
    for p in (store, store.with_name(store.name + "-wal"), store.with_name(store.name + "-shm")):
        if p.is_file():
            p.unlink(missing_ok=True)
    for folder in created[1:]:
        try:
            folder.rmdir()
        except OSError:
            break


def gateway_command(
    upstream: Annotated[
        list[str],
        typer.Option(
            "--upstream", "-u", help="OpenAI-compatible base URL (…/v1); repeat for several."
        ),
    ],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8100,
    store: StoreOpt = DEFAULT_STORE,
    token_ids: Annotated[
        bool,
        typer.Option(
            "--token-ids/--as-is",
            help="Ask upstreams for token ids and logprobs (the trace records the agent's "
            "request and the rewritten one), or forward every request unchanged.",
        ),
    ] = False,
    max_attempts: Annotated[int, typer.Option(min=1, help="Tries per call (429/5xx).")] = 3,
    public_url: Annotated[
        str | None, typer.Option(help="URL agents reach the gateway at (default: bound).")
    ] = None,
    upstream_api_key: Annotated[
        str | None, typer.Option(envvar="ENVPORT_UPSTREAM_API_KEY", help="Key for upstreams.")
    ] = None,
) -> None:
    """Run the model gateway: records every call of unmodified agents into traces.

    The orchestrator token comes from ENVPORT_GATEWAY_TOKEN (else one is printed).
    Create a rollout with POST /admin/rollouts; give the agent the returned base_url and
    token as OPENAI_BASE_URL / OPENAI_API_KEY (or ANTHROPIC_*).
    """
    from envport.gateway import serve_gateway
    from envport.gateway.upstream import check_base_url

    for url in upstream:
        try:
            check_base_url(url)
        except ValueError as exc:
            _fail(str(exc))
    store.parent.mkdir(parents=True, exist_ok=True)
    serve_gateway(
        upstream,
        host=host,
        port=port,
        store=store,
        public_url=public_url,
        request_token_ids=token_ids,
        max_attempts=max_attempts,
        upstream_api_key=upstream_api_key,
    )


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
    app.command("gateway")(gateway_command)
    app.add_typer(traces_app, name="traces")
