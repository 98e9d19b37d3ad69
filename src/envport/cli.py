"""The ``envport`` command: environments (serve, check, init, envs), rollouts (eval, run,
gateway, traces) and a training demo (train-demo).

Each command is a thin shell over a library function (``envport.server.serve``,
:func:`envport.check.check`, :func:`envport.scaffold.scaffold`,
:func:`envport.registry.registered`) so everything the CLI does is scriptable from
Python too. Heavy imports happen inside the command that needs them, which keeps
``envport --help`` fast and lets the CLI work while optional pieces are missing.

Exit codes: 0 success, 1 a check failed, 2 a usage error (unknown environment id, bad
option value, existing directory).
"""

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from envport import __version__
from envport.errors import EnvportError
from envport.server.sessions import ServerConfig  # cheap: the web stack loads with a server
from envport.tools import _TOOL_ATTR

if TYPE_CHECKING:
    from envport.registry import EnvSpec

app = typer.Typer(
    name="envport",
    epilog="Examples: [bold]envport envs[/] · [bold]envport check echo-v1[/] · "
    "[bold]envport serve echo-v1 --port 8000[/] · [bold]envport init my-env[/]",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
# No emoji codes: user text such as "mymodule:Parrot: passed" must print as written.
out = Console(emoji=False)
err = Console(stderr=True, emoji=False)

EnvArg = Annotated[
    str,
    typer.Argument(
        help="A registered id ([bold]echo-v1[/]; [bold]echo[/] takes the newest version) "
        "or an import path ([bold]package.module:Class[/]; modules in the current "
        "directory import too).",
        show_default=False,
    ),
]


class LogLevel(enum.StrEnum):
    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"
    TRACE = "trace"


def _fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _fail_env(exc: Exception) -> NoReturn:
    """Fail with an environment error's message, and its cause where it does not say it."""
    message = exc.message if isinstance(exc, EnvportError) else str(exc)
    cause = exc.__cause__
    if cause is not None and str(cause) not in message:
        message += f"\n  caused by {type(cause).__name__}: {cause}"
    _fail(message)


def _version(value: bool) -> None:
    if value:
        out.print(f"envport {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """The environment layer for agentic RL: serve, check and create environments; run and
    score rollouts; record agents' model calls; inspect traces; train on them.

    Environments: [bold]serve[/], [bold]check[/], [bold]init[/] (a new one), [bold]envs[/].

    Rollouts: [bold]eval[/] (a taskset, built-in agent), [bold]run[/] (the controller, any backend).

    Traces: [bold]gateway[/] (records unmodified agents' model calls), [bold]traces[/].

    Training: [bold]train-demo[/] (GRPO on this CPU, end to end).
    """
    from envport.registry import import_from_cwd

    import_from_cwd()  # as uvicorn's default --app-dir . does


# --- serve ----------------------------------------------------------------------------


def _server_default(field: str) -> Any:
    """``ServerConfig``'s default for ``field``: what ``serve --help`` shows and uses."""
    return ServerConfig.model_fields[field].default


@app.command()
def serve(
    env: EnvArg,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port to listen on.")] = 8000,
    max_sessions: Annotated[
        int, typer.Option(help="Live sessions (environment instances) at once.")
    ] = _server_default("max_sessions"),
    max_queue: Annotated[
        int, typer.Option(help="Connections that may wait for a free session.")
    ] = _server_default("max_queue"),
    queue_timeout: Annotated[
        float, typer.Option(help="Seconds a queued connection waits for a session.")
    ] = _server_default("queue_timeout_s"),
    call_timeout: Annotated[
        float,
        typer.Option(help="Deadline in seconds of one environment call; 0 means none."),
    ] = _server_default("call_timeout_s"),
    idle_timeout: Annotated[
        float, typer.Option(help="Seconds before an unattached idle session is reaped.")
    ] = _server_default("idle_timeout_s"),
    resume_grace: Annotated[
        float,
        typer.Option(help="Seconds a dropped WebSocket may reconnect and resume its session."),
    ] = _server_default("resume_grace_s"),
    max_frame_bytes: Annotated[
        int, typer.Option(help="Largest WebSocket frame or HTTP body accepted, in bytes.")
    ] = _server_default("max_frame_bytes"),
    request_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds an HTTP request may take to arrive whole (from its first byte, or "
            "the connection's opening); a slower connection is closed."
        ),
    ] = _server_default("request_timeout_s"),
    mcp_max_sessions: Annotated[
        int,
        typer.Option(
            help="Live MCP sessions at once on /mcp; at the limit a new one replaces the "
            "oldest that has not used a tool yet."
        ),
    ] = _server_default("mcp_max_sessions"),
    stall_warn: Annotated[
        float,
        typer.Option(
            help="Log an event-loop stall (an async env method running blocking code) "
            "longer than this many seconds, with its stack; 0 turns the watchdog off."
        ),
    ] = _server_default("stall_warn_s"),
    stall_exit: Annotated[
        float,
        typer.Option(
            help="Exit with status 70 when an environment call interrupted at its deadline "
            "for blocking the event loop still holds it this many seconds later, and with "
            "status 1 (faulthandler's stack dump) when C code holds the GIL so that no "
            "Python runs for this long (at least 5 s); 0: never."
        ),
    ] = _server_default("stall_exit_s"),
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="A web origin (scheme://host[:port]; scheme://host:* for any port) whose "
            "browser requests and WebSocket handshakes are accepted; repeatable. By default "
            "every request carrying an Origin header (a web page's) is refused."
        ),
    ] = None,
    log_level: Annotated[
        LogLevel, typer.Option(case_sensitive=False, help="Server log verbosity.")
    ] = LogLevel.INFO,
) -> None:
    """Serve ENV over WebSocket (/ws), HTTP and MCP (/mcp); OpenEnv clients can connect.

    The defaults shown are ServerConfig's.
    """
    _resolve_or_fail(env)
    config = _server_config(
        max_sessions=max_sessions,
        max_queue=max_queue,
        queue_timeout_s=queue_timeout,
        call_timeout_s=call_timeout,
        idle_timeout_s=idle_timeout,
        resume_grace_s=resume_grace,
        max_frame_bytes=max_frame_bytes,
        request_timeout_s=request_timeout,
        mcp_max_sessions=mcp_max_sessions,
        stall_warn_s=stall_warn,
        stall_exit_s=stall_exit,
        allowed_origins=allow_origin or None,
    )
    from envport.server import serve as run_server  # heavy; only this command needs it
    from envport.server import ws_impl

    try:
        ws_impl()  # ENVPORT_WS_IMPL, checked before uvicorn would fail on it
    except ValueError as exc:
        _fail(str(exc))
    run_server(env, host=host, port=port, config=config, log_level=log_level.value)


#: ServerConfig fields whose ``serve`` option is not the field's name, less any ``_s``.
_SERVER_OPTION_NAMES = {"allowed_origins": "allow-origin"}


def _server_config(**options: Any) -> ServerConfig:
    from pydantic import ValidationError

    given = {k: v for k, v in options.items() if v is not None}
    for zero_is_none in ("call_timeout_s", "stall_warn_s", "stall_exit_s"):
        if given.get(zero_is_none) == 0:
            given[zero_is_none] = None
    try:
        return ServerConfig(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{_SERVER_OPTION_NAMES.get(field, field.removesuffix('_s').replace('_', '-'))}"
            f": {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False)
            for field in [str(e["loc"][0])]
        )
        _fail(f"invalid server option: {problems}")


def _resolve_or_fail(env: str) -> None:
    from envport.registry import spec

    try:
        spec(env).load()
    except (EnvportError, ValueError, TypeError) as exc:
        _fail_env(exc)


# --- check ----------------------------------------------------------------------------


@app.command()
def check(
    env: EnvArg,
    seed: Annotated[int, typer.Option(help="Seed passed to reset().")] = 0,
    steps: Annotated[int, typer.Option(min=1, help="Steps each runtime check takes.")] = 3,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON instead of a table.")
    ] = False,
) -> None:
    """Check that ENV keeps the environment contract; exit 1 if any check fails.

    Static checks (types, JSON Schemas, actions, tools), runtime checks (reset, seeding,
    step, step_count, reward_range, errors before reset and after close) and a leak
    check (threads, processes, file descriptors, tasks, temp files after close).
    Declare [bold]check_actions[/] on the class to let the checker step the environment.
    """
    from envport.check import check as run_check

    try:
        report = run_check(env, seed=seed, steps=steps)
    except (EnvportError, ValueError, TypeError) as exc:
        _fail_env(exc)
    if as_json:
        out.print_json(report.model_dump_json())
    else:
        out.print(report.table())
        style = "green" if report.ok else "bold red"
        out.print(f"[{style}]{escape(report.summary())}[/]", soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


# --- init -----------------------------------------------------------------------------


@app.command()
def init(
    name: Annotated[
        str,
        typer.Argument(
            help="Environment name, e.g. [bold]guess-number[/]; registered as NAME-v1.",
            show_default=False,
        ),
    ],
    directory: Annotated[
        Path,
        typer.Option(
            "--dir", file_okay=False, help="Parent directory; the project goes in DIR/NAME."
        ),
    ] = Path("."),
) -> None:
    """Create a new environment package that passes [bold]envport check[/] as generated."""
    from envport.scaffold import ScaffoldError, names_for, scaffold

    try:
        root = scaffold(name, directory)
    except ScaffoldError as exc:
        _fail(str(exc))
    names = names_for(name)
    out.print(f"Created [bold]{escape(str(root))}[/] ({names.env_id}):")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        out.print(f"  {escape(str(path.relative_to(root)))}")
    steps = (  # plain text: "[test]" would be read as markup
        f"\nNext:\n  cd {root}\n  pip install -e '.[test]'\n"
        f"  envport check {names.env_id}\n  pytest"
    )
    out.print(escape(steps), soft_wrap=True)


# --- envs -----------------------------------------------------------------------------


@app.command()
def envs() -> None:
    """List registered environments: built-ins and installed packages' entry points."""
    from envport.registry import registered

    table = Table(title="envport environments", title_justify="left")
    table.add_column("id", no_wrap=True, style="bold")
    table.add_column("description")
    table.add_column("tools")
    for env_id, env_spec in sorted(registered().items()):
        description, tools = _describe(env_spec)
        table.add_row(env_id, escape(description), escape(tools))
    out.print(table)


def _describe(env_spec: "EnvSpec") -> tuple[str, str]:
    """Description and tool names of a spec, read from its class without building it."""
    try:
        factory = env_spec.load()
    except Exception as exc:
        return f"(cannot load: {type(exc).__name__}: {exc})", "?"
    description = env_spec.description
    metadata = getattr(factory, "metadata", None)
    if not description and callable(metadata):
        description = metadata().description
    if not isinstance(factory, type):
        return description, "?"
    names = sorted(
        str(getattr(member, _TOOL_ATTR))
        for member in (getattr(factory, attr, None) for attr in dir(factory))
        if getattr(member, _TOOL_ATTR, None) is not None
    )
    return description, ", ".join(names) or "-"


def main() -> None:
    """Console-script entry point."""
    app()


def _register_run_commands() -> None:
    from envport.cli_rollout import register as register_rollout
    from envport.cli_runs import register
    from envport.cli_train import register as register_train

    register(app)
    register_train(app)
    register_rollout(app)


_register_run_commands()


if __name__ == "__main__":
    main()
