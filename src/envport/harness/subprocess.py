"""Run any CLI agent, unmodified, as a subprocess: the "unmodified harness" cut.

A :class:`SubprocessHarness` starts an agent program the way its users start it. It
changes nothing in the agent; it only controls what the agent is given:

* **the model endpoint**, through the environment variables agents already read
  (``OPENAI_BASE_URL``/``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``,
  and their variants).
  Point them at the gateway's rollout-scoped URL and every model call lands in the
  trace without the agent knowing (:class:`ModelEndpoint`);
* **the task**, in the argv (``{task}``), on stdin, or in a file (``{task_file}``);
* **a working directory**, initialised with the task's files (``{workdir}``), and a
  private state directory outside it for the harness's own files (``{state_dir}``:
  trajectories, config) so they neither distract the agent nor reach the scorer;
* **a clean environment**: only a short allowlist of the parent's variables (``PATH``,
  ``HOME``, locale, …) is passed on, and never the parent's provider credentials, so an
  agent cannot reach a real provider, or read an orchestrator token, by accident;
* **a deadline**: the agent runs in a session of its own; on expiry every process of
  the session gets SIGTERM, then SIGKILL after a grace period, whatever process group
  it is in (a shell's background job with ``set -m``, a child started with
  ``process_group=0``). Stragglers left in the session when the agent exits by itself
  are ended the same way, so nothing outlives a run (a process that calls ``setsid``
  itself escapes; sandboxes are the answer to that).

stdin is ``/dev/null`` unless the task goes there, so an agent that would ask a
question fails fast instead of hanging. stdout and stderr are captured through pipes,
keeping only the last ``output_limit`` bytes of each: memory stays bounded whatever
the agent prints.

The result is a :class:`HarnessResult`: exit code, output tails, whether the deadline
hit, duration, the files left in the working directory and, when the harness has an
``outcome`` reader, what the agent itself reported (:class:`HarnessOutcome`; exit code
0 does not mean the task was done; after a timeout, what it had saved so far, marked
``partial``). :meth:`SubprocessHarness.run_into` records all of
it on a :class:`~envport.trace.Trace`: a timeout, a crash or an unreadable outcome is a
``harness`` :class:`~envport.trace.TraceError`, data rather than an exception.

:func:`mini_swe_agent` is a ready-made harness for ``mini-swe-agent`` (PyPI); its
docstring lists the flags and variables it needs to run unattended, and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from envport.deadlines import stage_time_left
from envport.gateway.serve import TOKEN_ENV as GATEWAY_TOKEN_ENV
from envport.procs import CommandOutput, OutputTail
from envport.tasks import Task
from envport.trace import ErrorKind, Trace, TraceError

__all__ = [
    "DEFAULT_ENV_PASSTHROUGH",
    "ControllerHarness",
    "EndpointFor",
    "HarnessOutcome",
    "HarnessResult",
    "ModelEndpoint",
    "SubprocessHarness",
    "mini_swe_agent",
    "read_mini_swe_agent_outcome",
    "task_text",
]

#: Variables of the parent's environment an agent gets by default.
DEFAULT_ENV_PASSTHROUGH: tuple[str, ...] = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "TERM",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
)

#: Prefixes of variables never inherited from the parent: provider credentials and
#: endpoints come only from the :class:`ModelEndpoint` of the run.
_PROVIDER_PREFIXES = ("OPENAI_", "ANTHROPIC_")
#: Variables never inherited from the parent either: the gateway's orchestrator token,
#: which creates, reads and *finishes* rollouts, rewards included (an agent holding it
#: could score its own run).
_NEVER_INHERITED = frozenset({GATEWAY_TOKEN_ENV})

TaskInput = Literal["argv", "stdin", "file"]


@dataclass(frozen=True)
class ModelEndpoint:
    """Where the agent's model calls go: usually the gateway's rollout-scoped URL.

    ``base_url`` is an OpenAI-style base URL, ``/v1`` included
    (``http://gw/rollouts/r1/v1``); ``anthropic_base_url`` is the root that Anthropic's
    SDK appends ``/v1/messages`` to, by default ``base_url`` less its trailing ``/v1``
    (the gateway serves both dialects under one rollout root). ``api_key`` is the
    rollout's agent token; ``anthropic_api_key`` defaults to it. Both dialects' variables
    are always set, so an agent on an Anthropic model never falls back to the real
    provider's URL.
    """

    base_url: str
    api_key: str
    anthropic_base_url: str | None = None
    anthropic_api_key: str | None = None
    #: The environment's tools for harnesses that speak MCP: an envport server's ``/mcp``
    #: URL, and headers (``X-Envport-Session: TOKEN`` binds the tools to the rollout's
    #: live environment session; give the session's tools-only token,
    #: ``EnvClient.tools_token``, so the agent cannot reset, step or close it).
    mcp_url: str | None = None
    mcp_headers: tuple[tuple[str, str], ...] = ()

    def env(self) -> dict[str, str]:
        """The variables an OpenAI or Anthropic SDK reads to reach this endpoint."""
        anthropic_url = self.anthropic_base_url
        if anthropic_url is None:
            anthropic_url = self.base_url.rstrip("/").removesuffix("/v1")
        anthropic_key = self.anthropic_api_key or self.api_key
        out = {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_BASE": self.base_url,  # the older name (litellm reads both)
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": anthropic_url,
            "ANTHROPIC_API_KEY": anthropic_key,
            "ANTHROPIC_AUTH_TOKEN": anthropic_key,  # a bearer token (Claude Code)
        }
        if self.mcp_url is not None:
            out["ENVPORT_MCP_URL"] = self.mcp_url
            out["ENVPORT_MCP_HEADERS"] = json.dumps(dict(self.mcp_headers))
        return out

    def mcp_config(self) -> dict[str, Any]:
        """The tools as an ``mcpServers`` config file, the format MCP-speaking CLIs read."""
        server = {"type": "http", "url": self.mcp_url, "headers": dict(self.mcp_headers)}
        return {"mcpServers": {"envport": server}}


@dataclass(frozen=True)
class HarnessOutcome:
    """What the agent reported about its own run (read from its files after exit).

    ``status`` is the agent's word for how it ended (mini-swe-agent: ``"Submitted"``,
    ``"LimitsExceeded"``, …); ``success`` says whether that means it finished the task.
    ``partial`` marks what was read after the agent was stopped at its deadline: the
    files it had written by then (mini-swe-agent saves its trajectory after each step).
    """

    status: str | None
    success: bool
    info: dict[str, Any] = field(default_factory=dict)
    partial: bool = False


@dataclass(frozen=True)
class HarnessResult:
    """How one run of a CLI agent went.

    ``exit_code`` is the process's exit status, negative for a signal (``-9``: SIGKILL),
    as :mod:`subprocess` reports it. ``files`` lists the working directory's files after
    the run (relative paths, sorted, at most ``max_listed_files``); ``workdir`` is
    ``None`` once the harness has removed a temporary working directory.
    """

    argv: tuple[str, ...]
    exit_code: int | None
    stdout_tail: str
    stderr_tail: str
    timed_out: bool
    duration_s: float
    files: tuple[str, ...] = ()
    workdir: Path | None = None
    outcome: HarnessOutcome | None = None
    outcome_error: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exited 0 in time, and (when there is an outcome) the agent reports success."""
        if self.timed_out or self.exit_code != 0 or self.outcome_error is not None:
            return False
        return self.outcome.success if self.outcome is not None else True

    @property
    def stop_reason(self) -> str:
        """``timeout``, ``error`` (crash or unreadable outcome), the agent's own status in
        snake case (``submitted``, ``limits_exceeded``), or ``exited``."""
        if self.timed_out:
            return "timeout"
        if self.exit_code != 0 or self.outcome_error is not None:
            return "error"
        if self.outcome is not None and self.outcome.status:
            return _snake(self.outcome.status)
        return "exited"


#: Reads the agent's outcome after it exited: ``(state_dir, workdir) -> outcome``.
#: Raise (any exception) when the agent left nothing readable; it is recorded.
OutcomeReader = Callable[[Path, Path], HarnessOutcome]


def task_text(task: Task | str) -> str:
    """The instruction a CLI agent gets: the prompt text, or its user messages joined."""
    if isinstance(task, str):
        return task
    if isinstance(task.prompt, str):
        return task.prompt
    parts = []
    for message in task.prompt:
        if message.role != "user":
            continue
        content = message.content
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(str(p.get("text", "")) for p in content if p.get("type") == "text")
    return "\n\n".join(parts)


class SubprocessHarness:
    """Start a CLI agent unmodified, give it a task, a workdir and a deadline.

    ``command`` is an argv template; each element may use ``{task}`` (the instruction),
    ``{workdir}``, ``{state_dir}``, ``{task_file}`` (only with ``task_input="file"``) and
    ``{mcp_config}`` (only when the endpoint offers the environment's tools over MCP: an
    ``mcpServers`` JSON file, also named by ``ENVPORT_MCP_CONFIG``).
    ``env`` values may use the same placeholders; they are added after the endpoint's
    variables, so they can override them. ``task_input`` says how the instruction is
    given besides any ``{task}`` in the argv: ``"stdin"`` pipes it in (then closes
    stdin), ``"file"`` writes it to ``task_file_name`` in the state directory.

    ``inherit_env`` names the parent's variables passed on (default
    :data:`DEFAULT_ENV_PASSTHROUGH`); ``True`` passes all of them. Either way the
    parent's ``OPENAI_*``/``ANTHROPIC_*`` variables and the gateway's orchestrator token
    (``ENVPORT_GATEWAY_TOKEN``) are never passed.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        inherit_env: Sequence[str] | Literal[True] = DEFAULT_ENV_PASSTHROUGH,
        task_input: TaskInput = "argv",
        task_file_name: str = "TASK.md",
        timeout_s: float = 600.0,
        kill_grace_s: float = 5.0,
        output_limit: int = 64 * 1024,
        outcome: OutcomeReader | None = None,
        keep_workdir: bool = False,
        max_listed_files: int = 1000,
    ) -> None:
        if not command:
            raise ValueError("command is empty: give the agent's argv, e.g. ['mini', ...]")
        if timeout_s <= 0 or kill_grace_s < 0:
            raise ValueError(
                f"timeout_s must be > 0 and kill_grace_s >= 0, got {timeout_s}, {kill_grace_s}"
            )
        if output_limit < 1:
            raise ValueError(f"output_limit must be at least 1 byte, got {output_limit}")
        self.command = tuple(command)
        self.name = name or Path(self.command[0]).name
        self.env = dict(env or {})
        self.inherit_env = inherit_env
        self.task_input: TaskInput = task_input
        self.task_file_name = task_file_name
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.output_limit = output_limit
        self.outcome = outcome
        self.keep_workdir = keep_workdir
        self.max_listed_files = max_listed_files

    # --- running ----------------------------------------------------------------------------

    async def run(
        self,
        task: Task | str,
        endpoint: ModelEndpoint | None = None,
        *,
        workdir: Path | str | None = None,
        timeout_s: float | None = None,
        on_output: Callable[[], None] | None = None,
    ) -> HarnessResult:
        """Run the agent once on ``task`` and wait for it (at most the deadline).

        ``workdir`` is used as it is (created if missing, the task's files written into
        it, kept afterwards); without it a temporary directory is made and removed after
        the run unless ``keep_workdir``. ``endpoint`` ``None`` runs the agent with no
        model endpoint at all (for agents that need none, and for tests).
        ``on_output`` is called each time the agent completes a line of output.
        """
        return await self._run(task, endpoint, workdir, timeout_s, on_output, _Progress())

    async def _run(
        self,
        task: Task | str,
        endpoint: ModelEndpoint | None,
        workdir: Path | str | None,
        timeout_s: float | None,
        on_output: Callable[[], None] | None,
        progress: _Progress,
    ) -> HarnessResult:
        owned = workdir is None
        remove_workdir = owned and not self.keep_workdir
        root, state = await _made_dirs(workdir, remove_workdir)
        try:
            text = task_text(task)
            values = {"task": text, "workdir": str(root), "state_dir": str(state)}
            if self.task_input == "file":
                values["task_file"] = str(state / self.task_file_name)
            if endpoint is not None and endpoint.mcp_url is not None:
                config_path = state / "mcp.json"
                config_path.write_text(json.dumps(endpoint.mcp_config(), indent=2))
                values["mcp_config"] = str(config_path)
            await asyncio.to_thread(_populate, task, root, values.get("task_file"), text)
            argv = tuple(_fill(part, values) for part in self.command)
            progress.argv = argv
            env = self._environment(endpoint, values)
            stdin = text.encode("utf-8") if self.task_input == "stdin" else None
            deadline = self.timeout_s if timeout_s is None else timeout_s
            started = progress.started = time.perf_counter()
            proc = await _run_process(
                argv,
                cwd=root,
                env=env,
                stdin=stdin,
                timeout_s=deadline,
                grace_s=self.kill_grace_s,
                limit=self.output_limit,
                on_line=on_output,
                progress=progress,
            )
            duration = time.perf_counter() - started
            outcome, outcome_error = None, None
            if self.outcome is not None:  # after a timeout too: what it saved so far
                try:
                    outcome = await asyncio.to_thread(self.outcome, state, root)
                except Exception as exc:  # the agent's files are data: record, don't raise
                    outcome_error = f"{type(exc).__name__}: {exc}"
                else:
                    if proc.timed_out:
                        outcome = replace(outcome, partial=True)
            files = await asyncio.to_thread(_list_files, root, self.max_listed_files)
        finally:
            await asyncio.shield(
                asyncio.to_thread(_remove_dirs, state, root if remove_workdir else None)
            )
        return HarnessResult(
            argv=argv,
            exit_code=proc.returncode,
            stdout_tail=proc.stdout.text(),
            stderr_tail=proc.stderr.text(),
            stdout_truncated=proc.stdout.truncated,
            stderr_truncated=proc.stderr.truncated,
            timed_out=proc.timed_out,
            duration_s=duration,
            files=files,
            workdir=None if remove_workdir else root,
            outcome=outcome,
            outcome_error=outcome_error,
        )

    async def run_into(
        self,
        trace: Trace,
        task: Task | str,
        endpoint: ModelEndpoint | None = None,
        *,
        workdir: Path | str | None = None,
        timeout_s: float | None = None,
        on_output: Callable[[], None] | None = None,
    ) -> HarnessResult:
        """Run the agent and record the run on ``trace``.

        Sets ``trace.harness``, ``trace.stop_reason`` (see :attr:`HarnessResult.stop_reason`),
        ``trace.timings["agent"]`` and ``trace.metadata["harness"]`` (argv, exit code,
        output tails, outcome); appends a ``harness`` :class:`TraceError` for a timeout,
        a non-zero exit or an unreadable outcome. The trace's status is left to the
        caller (a controller also has scoring to do). Model calls are not recorded
        here: the gateway the agent talks to records them.

        A run cut from outside (cancelled: a controller's hang detection or stage
        deadline) or one that failed to start is recorded too, before the exception
        goes on: ``metadata["harness"]`` then holds the argv, the output tails and
        exit code as far as they got, and ``cancelled``; the caller records the error.
        """
        trace.harness = self.name
        if trace.started_at is None:
            trace.started_at = datetime.now(UTC)
        progress = _Progress()
        try:
            result = await self._run(task, endpoint, workdir, timeout_s, on_output, progress)
        except BaseException as exc:
            self._record_cut(trace, progress, isinstance(exc, asyncio.CancelledError))
            raise
        trace.stop_reason = result.stop_reason
        trace.timings["agent"] = result.duration_s
        trace.metadata["harness"] = {
            "name": self.name,
            "argv": list(result.argv),
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "cancelled": False,
            "duration_s": result.duration_s,
            "stdout_tail": result.stdout_tail,
            "stderr_tail": result.stderr_tail,
            "files": list(result.files),
            "outcome": None
            if result.outcome is None
            else {
                "status": result.outcome.status,
                "success": result.outcome.success,
                "info": result.outcome.info,
                "partial": result.outcome.partial,
            },
            "outcome_error": result.outcome_error,
        }
        error = _harness_error(self.name, result, timeout_s or self.timeout_s)
        if error is not None:
            trace.errors.append(error)
        return result

    def _record_cut(self, trace: Trace, progress: _Progress, cancelled: bool) -> None:
        """``metadata["harness"]`` for a run that raised: what it had got to."""
        capture, transport = progress.capture, progress.transport
        duration = None if progress.started is None else time.perf_counter() - progress.started
        if duration is not None:
            trace.timings["agent"] = duration
        trace.metadata["harness"] = {
            "name": self.name,
            "argv": list(progress.argv),
            "exit_code": None if transport is None else transport.get_returncode(),
            "timed_out": False,
            "cancelled": cancelled,
            "duration_s": duration,
            "stdout_tail": "" if capture is None else capture.stdout.text(),
            "stderr_tail": "" if capture is None else capture.stderr.text(),
            "files": [],
            "outcome": None,
            "outcome_error": None,
        }

    def for_controller(
        self, endpoint: ModelEndpoint | EndpointFor | None = None
    ) -> ControllerHarness:
        """This harness as a rollout controller's harness (see :class:`ControllerHarness`)."""
        return ControllerHarness(self, endpoint)

    # --- helpers ----------------------------------------------------------------------------

    def _environment(
        self, endpoint: ModelEndpoint | None, values: Mapping[str, str]
    ) -> dict[str, str]:
        if self.inherit_env is True:
            env = dict(os.environ)
        else:
            env = {k: os.environ[k] for k in self.inherit_env if k in os.environ}
        env = {
            k: v
            for k, v in env.items()
            if not k.startswith(_PROVIDER_PREFIXES) and k not in _NEVER_INHERITED
        }
        if endpoint is not None:
            env.update(endpoint.env())
        if "mcp_config" in values:
            env["ENVPORT_MCP_CONFIG"] = values["mcp_config"]
        env.update({k: _fill(v, values) for k, v in self.env.items()})
        return env


#: The endpoint of one rollout, made when it starts: ``(task, trace) -> endpoint``
#: (e.g. a gateway grant for ``trace.rollout_id``); ``None`` for an agent without one.
EndpointFor = Callable[[Task, Trace], Awaitable[ModelEndpoint | None]]


class ControllerHarness:
    """A :class:`SubprocessHarness` as the :class:`~envport.rollout.Controller`'s harness.

    ``run(task, env, trace)`` starts the CLI agent exactly as
    :meth:`SubprocessHarness.run_into` does (endpoint variables, workdir, deadline,
    session kill) and records the run on the trace. Every line the agent prints,
    on stdout or stderr, is a :func:`~envport.rollout.heartbeat`, so the controller's
    hang detection covers CLI agents: one that goes silent for ``hang_timeout_s`` is
    cut (a ``harness`` failure) and, like on any cancellation, every process of its
    session is killed; what it printed until then stays on the trace. A timeout, crash
    or unreadable outcome of the agent is a ``harness`` error on the trace, which fails
    the rollout unscored.

    The agent's deadline is the harness's ``timeout_s``, or less: it ends the harness's
    ``kill_grace_s`` and 2 s more (at most half the time left) before the controller's
    agent stage must end, so the harness stops the agent itself (SIGTERM, then
    SIGKILL), reads its outcome, and records a timeout instead of being cancelled. The
    stage's end is read from :data:`envport.deadlines.stage_deadline` when the
    controller sets it, else from the task's own ``resources.timeouts.agent``.

    The agent works in its own working directory; ``env`` (the leased environment
    session) is not handed to the process; rubrics still score through it.
    """

    def __init__(
        self, harness: SubprocessHarness, endpoint: ModelEndpoint | EndpointFor | None = None
    ) -> None:
        self.harness = harness
        self.endpoint = endpoint
        self.name = harness.name

    def timeout_for(self, task: Task, started: float) -> float:
        """The agent's deadline for a run of ``task`` that started at ``started``
        (:func:`time.monotonic`): the harness's own, or less to end before the stage."""
        left = stage_time_left()
        if left is None and task.resources.timeouts.agent is not None:
            left = task.resources.timeouts.agent - (time.monotonic() - started)
        if left is None:
            return self.harness.timeout_s
        # Time to stop the agent (SIGTERM, the kill grace, SIGKILL) and read its files.
        reserve = min(self.harness.kill_grace_s + 2.0, left / 2)
        return max(min(self.harness.timeout_s, left - reserve), 0.001)

    async def run(self, task: Task, env: Any, trace: Trace) -> None:
        from envport.rollout import heartbeat  # the controller imports this module

        started = time.monotonic()
        endpoint = self.endpoint
        if endpoint is not None and not isinstance(endpoint, ModelEndpoint):
            endpoint = await endpoint(task, trace)
        # Output arrives in event-loop callbacks, outside this task's context: beat in
        # a copy of it, which holds the controller's heartbeat for this attempt.
        context = contextvars.copy_context()

        def beat() -> None:
            context.run(heartbeat)

        timeout_s = self.timeout_for(task, started)
        await self.harness.run_into(trace, task, endpoint, timeout_s=timeout_s, on_output=beat)


def _make_dirs(workdir: Path | str | None) -> tuple[Path, Path]:
    """The working directory (made if missing) and a fresh private state directory."""
    if workdir is None:
        root = Path(tempfile.mkdtemp(prefix="envport-workdir-"))
    else:
        root = Path(workdir)
        root.mkdir(parents=True, exist_ok=True)
    return root, Path(tempfile.mkdtemp(prefix="envport-harness-"))


async def _made_dirs(workdir: Path | str | None, remove_workdir: bool) -> tuple[Path, Path]:
    """:func:`_make_dirs` in a worker thread; cancelled meanwhile, what it made (once it
    has) is removed before the cancellation goes on."""
    making = asyncio.ensure_future(asyncio.to_thread(_make_dirs, workdir))
    try:
        return await asyncio.shield(making)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            root, state = await making
            await asyncio.to_thread(_remove_dirs, state, root if remove_workdir else None)
        raise


def _populate(task: Task | str, root: Path, task_file: str | None, text: str) -> None:
    if isinstance(task, Task):
        write_task_files(task, root)
    if task_file is not None:
        Path(task_file).write_text(text, encoding="utf-8")


def _remove_dirs(state: Path, workdir: Path | None) -> None:
    shutil.rmtree(state, ignore_errors=True)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def write_task_files(task: Task, root: Path) -> None:
    """Place the task's files under ``root`` (inline content, or copied from ``source``)."""
    for rel, spec in task.files.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if spec.content is not None:
            dest.write_text(spec.content, encoding="utf-8")
        else:
            assert spec.source is not None  # TaskFile guarantees one of the two
            source = task.resolve(spec.source)
            if source.is_dir():
                shutil.copytree(source, dest, dirs_exist_ok=True)
            else:
                shutil.copyfile(source, dest)
        if spec.executable:
            dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _fill(template: str, values: Mapping[str, str]) -> str:
    """Replace ``{name}`` placeholders in one pass; unknown braces (shell, JSON) are left
    alone, and so is anything in a substituted value (a task that mentions ``{workdir}``
    keeps it)."""
    if not values:
        return template
    names = "|".join(re.escape(key) for key in values)
    return re.sub(r"\{(" + names + r")\}", lambda m: values[m.group(1)], template)


def _snake(status: str) -> str:
    out = []
    for i, ch in enumerate(status):
        if ch.isupper() and i and not status[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out).replace(" ", "_")


def _list_files(root: Path, limit: int) -> tuple[str, ...]:
    found: list[str] = []
    if not root.is_dir():
        return ()
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            found.append(str((Path(dirpath) / n).relative_to(root)))
            if len(found) >= limit:
                return tuple(sorted(found))
    return tuple(sorted(found))


def _harness_error(name: str, result: HarnessResult, deadline: float) -> TraceError | None:
    if result.timed_out:
        message = (
            f"{name} ran past its {round(deadline, 2):g} s deadline; its processes were killed"
        )
        return TraceError(kind=ErrorKind.HARNESS, message=message, where=name, type="Timeout")
    if result.exit_code != 0:
        code = result.exit_code
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited {code}"
        tail = (result.stderr_tail or result.stdout_tail).strip()[-500:]
        message = f"{name} {how}" + (f": {tail}" if tail else "")
        return TraceError(kind=ErrorKind.HARNESS, message=message, where=name, type="ExitStatus")
    if result.outcome_error is not None:
        message = f"{name} exited 0 but its outcome could not be read: {result.outcome_error}"
        return TraceError(kind=ErrorKind.HARNESS, message=message, where=name, type="Outcome")
    return None


# --- the process ------------------------------------------------------------------------------


@dataclass
class _Progress:
    """How far a run got, for the record of one that is cut: filled in as it goes."""

    argv: tuple[str, ...] = ()
    started: float | None = None
    capture: CommandOutput | None = None
    transport: asyncio.SubprocessTransport | None = None


@dataclass
class _Finished:
    returncode: int | None
    timed_out: bool
    stdout: OutputTail
    stderr: OutputTail


async def _run_process(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdin: bytes | None,
    timeout_s: float,
    grace_s: float,
    limit: int,
    on_line: Callable[[], None] | None = None,
    progress: _Progress | None = None,
) -> _Finished:
    """Run ``argv`` in a new session; kill the session's processes on deadline or after.

    ``on_line`` is called from the event loop whenever output completes a line (on
    stdout or stderr): the controller's heartbeat for CLI agents. ``progress`` is given
    the output tails and the process as soon as it starts.
    """
    loop = asyncio.get_running_loop()
    transport, capture = await loop.subprocess_exec(
        lambda: CommandOutput(limit, on_line),
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=dict(env),
        start_new_session=True,
    )
    if progress is not None:
        progress.capture, progress.transport = capture, transport
    sid = transport.get_pid()  # a new session: its leader's pid is the session id
    timed_out = False
    ended = False
    try:
        if stdin is not None:
            pipe = transport.get_pipe_transport(0)
            assert isinstance(pipe, asyncio.WriteTransport)
            pipe.write(stdin)
            pipe.close()
        try:  # asyncio.timeout: wait_for (3.11) may drop a cancellation that lands at exit
            async with asyncio.timeout(timeout_s):
                await capture.exited.wait()
        except TimeoutError:
            timed_out = True
        await _end_session(sid, capture, grace_s)
        # Output still buffered in the pipes arrives once every writer is gone.
        # A process that left the session may still hold a pipe: then keep what we have.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(grace_s, 1.0)):
                await capture.pipes_closed.wait()
        ended = True
    finally:
        if not ended:  # cancelled: nothing may outlive the run, stragglers included
            _signal_session(sid, signal.SIGKILL)
            if not capture.exited.is_set():
                await asyncio.shield(capture.exited.wait())
            await asyncio.shield(_session_gone(sid))
            with contextlib.suppress(TimeoutError):  # what is left in the pipes, briefly
                async with asyncio.timeout(0.5):
                    await asyncio.shield(capture.pipes_closed.wait())
        transport.close()
    return _Finished(transport.get_returncode(), timed_out, capture.stdout, capture.stderr)


def _session_members(sid: int) -> list[int] | None:
    """The live (not zombie) processes of session ``sid``, every process group of it;
    ``None`` where there is no ``/proc`` to tell.

    A process's session is the fourth field after the ``)`` that closes its name in
    ``/proc/PID/stat``. ``kill(0)`` also succeeds for zombies, which linger where PID 1
    does not reap orphans; the state field tells them apart.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    wanted = str(sid)
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_line = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat_line.rpartition(")")[2].split()
        if len(fields) > 3 and fields[3] == wanted and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_session(sid: int, sig: int) -> bool:
    """Send ``sig`` to every process of the session (a child that moved to a process
    group of its own included); ``False`` when no live process is left in it."""
    members = _session_members(sid)
    if members is None:  # no /proc: the leader's process group is what can be reached
        try:
            os.killpg(sid, sig)
        except (ProcessLookupError, PermissionError):  # EPERM: only zombies, on some systems
            return False
        return True
    sent = False
    for pid in members:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        sent = True
    return sent


def _session_alive(sid: int) -> bool:
    """Whether a live (not zombie) process is left in the session."""
    members = _session_members(sid)
    if members is None:
        return _signal_session(sid, 0)
    return bool(members)


async def _end_session(sid: int, capture: CommandOutput, grace_s: float) -> None:
    """SIGTERM the whole session, wait up to ``grace_s`` for it to go, then SIGKILL.

    Each scan of the session reads every process's ``/proc/PID/stat``: on a host with
    thousands of processes that is tens of milliseconds, repeated every 20 ms, so the
    scans run in a worker thread, never on the event loop (other rollouts, a gateway)."""
    if not await asyncio.to_thread(_signal_session, sid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if capture.exited.is_set() and not await asyncio.to_thread(_session_alive, sid):
            return
        await asyncio.sleep(0.02)
    await asyncio.to_thread(_signal_session, sid, signal.SIGKILL)
    await capture.exited.wait()
    await _session_gone(sid)


async def _session_gone(sid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL the session until no live process is left in it (one forked between a
    scan and the signals is caught by the next round; SIGKILL takes effect when the
    process is next scheduled, which on a busy machine is not at once). Scans run in a
    worker thread, as in :func:`_end_session`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not await asyncio.to_thread(_signal_session, sid, signal.SIGKILL):
            return
        await asyncio.sleep(0.02)


# --- mini-swe-agent -----------------------------------------------------------------------------


def read_mini_swe_agent_outcome(state_dir: Path, workdir: Path) -> HarnessOutcome:
    """``info.exit_status`` of mini-swe-agent's trajectory file; ``Submitted`` is success.

    Exit code 0 does not mean success: hitting the step limit also exits 0, with
    ``LimitsExceeded``. The info kept: exit status, submission, model stats (API calls).
    """
    path = state_dir / "trajectory.json"
    if not path.is_file():
        raise FileNotFoundError(f"mini-swe-agent wrote no trajectory at {path}")
    data = json.loads(path.read_text(encoding="utf-8"))
    info = data.get("info") if isinstance(data, dict) else None
    if not isinstance(info, dict):
        raise ValueError(f"{path} has no 'info' object; is it a mini-swe-agent trajectory?")
    status = info.get("exit_status")
    status = str(status) if status else None
    messages = data.get("messages")
    kept = {
        "exit_status": status,
        "submission": info.get("submission"),
        "model_stats": info.get("model_stats"),
        "mini_version": info.get("mini_version"),
        "n_messages": len(messages) if isinstance(messages, list) else None,
    }
    return HarnessOutcome(status=status, success=status == "Submitted", info=kept)


def mini_swe_agent(
    *,
    model: str = "openai/envport-scripted",
    step_limit: int = 10,
    executable: str | Path = "mini",
    timeout_s: float = 600.0,
    config: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> SubprocessHarness:
    """A :class:`SubprocessHarness` running ``mini-swe-agent`` unattended.

    ``model`` is mini's ``-m``: ``openai/NAME`` calls ``$OPENAI_BASE_URL`` (the server
    sees ``NAME``), ``anthropic/NAME`` calls ``$ANTHROPIC_BASE_URL``. ``executable`` is
    the ``mini`` script (e.g. ``.venvs/mini-swe-agent/bin/mini``); ``config`` adds
    ``-c`` specs after ``mini.yaml`` (``"environment.timeout=60"``). Other keyword
    arguments go to :class:`SubprocessHarness`.

    What makes it run without a person (measured on mini-swe-agent 2.4.6):
    ``MSWEA_CONFIGURED=true`` (no setup wizard), ``-y`` and ``--exit-immediately`` (no
    confirmations), stdin ``/dev/null``, ``MSWEA_COST_TRACKING=ignore_errors`` (unknown
    model names), ``LITELLM_LOCAL_MODEL_COST_MAP=True`` (no cost-map download),
    ``MSWEA_SILENT_STARTUP=1``, a private ``MSWEA_GLOBAL_CONFIG_DIR``, and
    ``-c mini.yaml`` before any other ``-c`` (else the default config is dropped). The
    trajectory goes to the state directory, not the workdir; its ``info.exit_status``
    is the outcome (:func:`read_mini_swe_agent_outcome`).
    """
    if step_limit < 1:
        raise ValueError(f"step_limit must be at least 1, got {step_limit}")
    command = [str(executable), "-m", model, "-c", "mini.yaml"]
    command += ["-c", f"agent.step_limit={step_limit}"]
    for spec in config:
        command += ["-c", spec]
    command += ["-y", "--exit-immediately", "-t", "{task}", "-o", "{state_dir}/trajectory.json"]
    variables = {
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": "{state_dir}/mswea-config",
        **(env or {}),
    }
    options.setdefault("name", "mini-swe-agent")
    return SubprocessHarness(
        command,
        env=variables,
        timeout_s=timeout_s,
        outcome=read_mini_swe_agent_outcome,
        **options,
    )
