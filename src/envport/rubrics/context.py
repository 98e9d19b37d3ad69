"""What a reward function can see: :class:`ScoringContext` and the :class:`EnvHandle`.

A :class:`ScoringContext` is everything known about one finished run: the task, the
trace, the final observation, the completion (the last assistant message's text), the
parsed final answer, the environment's ``state()`` and a handle to inspect the
environment further. Reward functions do not take the context itself; they name the
parts they want (see :mod:`envport.rubrics.functions`).

An :class:`EnvHandle` is how a rubric looks *into* the environment after the run: read a
file, run a command (a test suite), read the state, call a tool. Three kinds:

* :class:`LocalDirHandle` — a working directory on this machine. Commands run there as
  subprocesses in a process group of their own, killed when the command exits (what it
  left in the background), times out or is cancelled; file access is confined to the
  directory.
* :class:`ClientHandle` — an :class:`~envport.client.client.EnvClient` session: ``state``
  and ``call_tool`` go to the environment; ``run``/``read_file``/``upload`` work only if
  the environment has ``run``/``read_file``/``write_file`` tools (``shell-v1`` does),
  else :class:`NotSupportedError`.
* a sandbox handle (issue 5) that runs inside the task's container.

**Decision:** the handle is a small async protocol, not the environment object itself, so
a rubric written against it runs unchanged against a local directory, a remote session
or a sandbox. It adds ``upload`` to the four operations of the brief, because a
Harbor-style ``test_command`` must place the task's ``tests/`` before running them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import shlex
import shutil
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from envport.errors import ToolError
from envport.procs import CommandOutput
from envport.rubrics.errors import CommandError, CommandTimeoutError, NotSupportedError
from envport.tasks.task import Task
from envport.trace.model import Message, Trace

if TYPE_CHECKING:
    from envport.client.client import EnvClient

#: How much of a command's stdout and stderr is kept (each): its last this many bytes.
MAX_OUTPUT_BYTES = 1_000_000


@dataclass(frozen=True)
class CommandResult:
    """Outcome of a command that ran to completion (whatever its exit status)."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""


@runtime_checkable
class EnvHandle(Protocol):
    """How a reward function inspects the environment after the run.

    ``read_file`` raises :class:`FileNotFoundError` for a missing file; ``run`` returns a
    :class:`CommandResult` for any command that ran, and raises :class:`CommandError`
    for one that could not start, :class:`CommandTimeoutError` (after killing it) for
    one that ran too long; any operation the handle cannot do raises
    :class:`NotSupportedError`.
    """

    async def read_file(self, path: str) -> str: ...

    async def run(self, command: str | Sequence[str], timeout_s: float) -> CommandResult: ...

    async def upload(self, src: Path, dest: str) -> None: ...

    async def state(self) -> dict[str, Any]: ...

    async def call_tool(self, name: str, args: dict[str, Any] | None = None) -> Any: ...


# --- a local working directory ----------------------------------------------------------------


class LocalDirHandle:
    """A working directory on this machine, as an :class:`EnvHandle`.

    ``run`` starts the command in ``workdir`` (a string through ``/bin/sh -c``, a list
    directly), in a new process group, and on timeout or cancellation kills the whole
    group before raising. The result comes when the command itself exits: processes it
    left running in its group (a test server started with ``&``, which holds the output
    pipes open) are killed then, their output so far kept. Paths given to ``read_file``
    and ``upload`` are relative to ``workdir`` (absolute ones must lie inside it) and
    may not escape it, symlinks included. ``state`` returns ``state`` as given; there
    are no tools.
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        env: dict[str, str] | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.env = env
        self._state = dict(state or {})

    def __repr__(self) -> str:
        return f"LocalDirHandle({str(self.workdir)!r})"

    def path(self, path: str) -> Path:
        """``path`` resolved inside the working directory; ``PermissionError`` if outside."""
        candidate = (self.workdir / path).resolve()
        if not candidate.is_relative_to(self.workdir):
            raise PermissionError(
                f"{path!r} is outside the working directory {str(self.workdir)!r}; "
                "LocalDirHandle only reaches files inside it"
            )
        return candidate

    async def read_file(self, path: str) -> str:
        target = self.path(path)
        return await asyncio.to_thread(target.read_text, encoding="utf-8", errors="replace")

    async def upload(self, src: Path, dest: str) -> None:
        target = self.path(dest)

        def copy() -> None:
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)

        await asyncio.to_thread(copy)

    async def run(self, command: str | Sequence[str], timeout_s: float) -> CommandResult:
        if not self.workdir.is_dir():
            raise CommandError(f"working directory {str(self.workdir)!r} does not exist")
        env = None if self.env is None else {**os.environ, **self.env}
        loop = asyncio.get_running_loop()

        def made() -> CommandOutput:
            return CommandOutput(MAX_OUTPUT_BYTES)

        options: dict[str, Any] = {
            "cwd": self.workdir,
            "env": env,
            "stdin": asyncio.subprocess.DEVNULL,
            "stdout": asyncio.subprocess.PIPE,
            "stderr": asyncio.subprocess.PIPE,
            "start_new_session": True,
        }
        try:
            if isinstance(command, str):
                transport, output = await loop.subprocess_shell(made, command, **options)
            else:
                transport, output = await loop.subprocess_exec(made, *command, **options)
        except OSError as exc:
            raise CommandError(f"cannot run {command!r}: {exc}") from exc
        timed_out = False
        try:
            try:
                # The command's own exit, not its pipes' end: a process it left in the
                # background (a test server started with '&') holds them open.
                async with asyncio.timeout(timeout_s):
                    await output.exited.wait()
            except TimeoutError:
                timed_out = True
            await _kill_group(transport, output)  # what it left running ends with it
            # Output still in the pipes arrives once every writer is gone; a process that
            # left the group may still hold one: then keep what we have.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await output.pipes_closed.wait()
        except BaseException:
            await _kill_group(transport, output)
            raise
        finally:
            transport.close()
        if timed_out:
            raise CommandTimeoutError(
                f"command {command!r} ran past its {timeout_s:g} s timeout and was killed",
                timeout_s=timeout_s,
            )
        exit_code = transport.get_returncode()
        assert exit_code is not None
        return CommandResult(
            exit_code=exit_code,
            stdout=output.stdout.text(note=True),
            stderr=output.stderr.text(note=True),
        )

    async def state(self) -> dict[str, Any]:
        return dict(self._state)

    async def call_tool(self, name: str, args: dict[str, Any] | None = None) -> Any:
        raise NotSupportedError(
            f"LocalDirHandle has no tools (asked for {name!r}); use a ClientHandle to call "
            "an environment's tools"
        )


async def _kill_group(transport: asyncio.SubprocessTransport, output: CommandOutput) -> None:
    """SIGKILL the command's process group (the command and what it started) and wait
    for the command to be reaped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(transport.get_pid(), signal.SIGKILL)
    if not output.exited.is_set():  # not reaped yet, so the pid is still its own
        with contextlib.suppress(ProcessLookupError):
            transport.kill()  # it moved to another process group
    # Shielded: a cancelled caller still waits for the child to be reaped.
    await asyncio.shield(output.exited.wait())


# --- a client session -------------------------------------------------------------------------


class ClientHandle:
    """An :class:`~envport.client.client.EnvClient` session, as an :class:`EnvHandle`.

    ``state`` and ``call_tool`` go through the client. ``run``, ``read_file`` and
    ``upload`` use the environment's tools when it has them — ``run(command,
    timeout_s)`` returning ``exit_code``/``stdout``/``stderr`` (and ``timed_out``),
    ``read_file(path)``, and ``write_file(path, content)`` once per uploaded file (a
    file that is not UTF-8 as ``content`` in base64 with ``encoding="base64"``), as
    ``shell-v1`` provides — else raise :class:`NotSupportedError`. Where the ``run`` tool
    takes ``fresh_shell`` (``sandbox-v1``, whose shell persists between the agent's
    commands), ``run`` passes ``fresh_shell=True``: a grader's command must not run in a
    shell the agent prepared (a ``printf`` function there would forge exit statuses). A
    ``read_file`` tool error that says the file is missing becomes
    :class:`FileNotFoundError`. Calls are
    serialised: one session answers one request at a time. The client's own call
    timeout bounds each tool call, so keep it above the commands' ``timeout_s``.
    """

    def __init__(self, client: EnvClient) -> None:
        self.client = client
        self._lock = asyncio.Lock()
        self._tools: set[str] | None = None
        self._fresh_run = False

    def __repr__(self) -> str:
        return f"ClientHandle({self.client!r})"

    async def state(self) -> dict[str, Any]:
        async with self._lock:
            return await self.client.state()

    async def call_tool(self, name: str, args: dict[str, Any] | None = None) -> Any:
        async with self._lock:
            return await self.client.call_tool(name, args or {})

    async def _require(self, tool: str, what: str) -> None:
        if self._tools is None:
            async with self._lock:
                listed = await self.client.list_tools()
            self._tools = {t["name"] for t in listed}
            for spec in listed:
                if spec["name"] == "run":
                    schema = spec.get("input_schema") or spec.get("inputSchema") or {}
                    self._fresh_run = "fresh_shell" in (schema.get("properties") or {})
        if tool not in self._tools:
            known = ", ".join(sorted(self._tools)) or "(none)"
            raise NotSupportedError(
                f"cannot {what} through this environment client: the environment has no "
                f"{tool!r} tool (its tools: {known}). Score with a LocalDirHandle or a "
                f"sandbox handle, or give the environment a {tool!r} tool."
            )

    async def read_file(self, path: str) -> str:
        await self._require("read_file", "read files")
        try:
            result = await self.call_tool("read_file", {"path": path})
        except ToolError as exc:
            if _MISSING.search(exc.message):
                raise FileNotFoundError(f"{path}: {exc.message}") from exc
            raise
        if isinstance(result, dict) and "content" in result:
            result = result["content"]
        return result if isinstance(result, str) else str(result)

    async def upload(self, src: Path, dest: str) -> None:
        await self._require("write_file", "upload files")
        for rel, data in await asyncio.to_thread(_read_tree, src):
            target = dest if not rel else f"{dest.rstrip('/')}/{rel}"
            try:
                args = {"path": target, "content": data.decode("utf-8")}
            except UnicodeDecodeError:  # a binary fixture: base64 (envport's write_file)
                content = base64.b64encode(data).decode("ascii")
                args = {"path": target, "content": content, "encoding": "base64"}
            await self.call_tool("write_file", args)

    async def run(self, command: str | Sequence[str], timeout_s: float) -> CommandResult:
        await self._require("run", "run commands")
        text = command if isinstance(command, str) else _shell_join(command)
        args: dict[str, Any] = {"command": text, "timeout_s": timeout_s}
        if self._fresh_run:  # not in the agent's shell, whose state the agent controls
            args["fresh_shell"] = True
        try:
            result = await self.call_tool("run", args)
        except ToolError as exc:
            raise CommandError(f"the environment could not run {text!r}: {exc}") from exc
        if isinstance(result, dict) and result.get("timed_out"):
            so_far = "".join(str(result.get(k) or "") for k in ("stdout", "stderr")).strip()
            so_far = so_far if len(so_far) <= 2000 else "…" + so_far[-2000:]
            raise CommandTimeoutError(
                f"command {text!r} ran past its {timeout_s:g} s timeout in the environment "
                "and was killed" + (f"; its output so far:\n{so_far}" if so_far else ""),
                timeout_s=timeout_s,
            )
        if not isinstance(result, dict) or not isinstance(result.get("exit_code"), int):
            raise CommandError(
                f"the environment's 'run' tool returned {result!r}; expected an object with "
                "an integer 'exit_code' (and 'stdout', 'stderr')"
            )
        return CommandResult(
            exit_code=result["exit_code"],
            stdout=str(result.get("stdout") or ""),
            stderr=str(result.get("stderr") or ""),
        )


_MISSING = re.compile(r"no such file|not found|does not exist", re.IGNORECASE)


def _read_tree(src: Path) -> list[tuple[str, bytes]]:
    """``(relative path, bytes)`` of ``src`` (``""`` for a file) or each file under it."""
    if src.is_file():
        return [("", src.read_bytes())]
    files = sorted(p for p in src.rglob("*") if p.is_file())
    return [(f.relative_to(src).as_posix(), f.read_bytes()) for f in files]


def _shell_join(argv: Sequence[str]) -> str:
    return shlex.join(argv)


# --- the context ------------------------------------------------------------------------------


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(r"^\s*(?:final\s+)?answer\s*[:=]\s*(.+?)\s*$", re.IGNORECASE | re.M)


def extract_answer(text: str | None) -> str | None:
    """The final answer marked in ``text``, or ``None`` if none is marked.

    Looks, in order, for the last ``<answer>…</answer>``, the last ``\\boxed{…}`` and
    the last line that starts with ``Answer:`` (or ``Final answer:``). Unmarked text is
    not an answer: reward functions that want the whole reply ask for ``completion``.
    """
    if not text:
        return None
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return str(tags[-1]).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return str(lines[-1]).strip()
    return None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def last_assistant(trace: Trace) -> Message | None:
    """The last assistant message on the branch that ends with the trace's last message."""
    if not trace.messages:
        return None
    for message in reversed(trace.path(trace.messages[-1].id)):
        if message.role == "assistant":
            return message
    return None


@dataclass
class ScoringContext:
    """Everything a reward function may ask for about one finished run.

    Left ``None``, ``completion`` is the text of the last assistant message (``None``
    if there is none), ``answer`` is :func:`extract_answer` of the completion, and
    ``observation`` the last step's observation when it is a JSON object. ``state`` is
    fetched from ``env`` the first time a function asks for it (see :meth:`get_state`).
    """

    trace: Trace = field(default_factory=Trace)
    task: Task | None = None
    observation: dict[str, Any] | None = None
    completion: str | None = None
    answer: str | None = None
    state: dict[str, Any] | None = None
    env: EnvHandle | None = None
    _state_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.completion is None:
            message = last_assistant(self.trace)
            self.completion = message.text if message is not None else None
        if self.answer is None:
            self.answer = extract_answer(self.completion)
        if self.observation is None:
            for step in reversed(self.trace.steps):
                if isinstance(step.observation, dict):
                    self.observation = step.observation
                    break

    @property
    def reference(self) -> Any:
        """The task's reference answer (``None`` without a task)."""
        return self.task.answer if self.task is not None else None

    @property
    def metadata(self) -> dict[str, Any]:
        """The task's metadata (empty without a task)."""
        return self.task.metadata if self.task is not None else {}

    async def get_state(self) -> dict[str, Any] | None:
        """``state`` if given, else the handle's ``state()`` (fetched once), else ``None``."""
        if self.state is None and self.env is not None:
            async with self._state_lock:
                if self.state is None:
                    self.state = await self.env.state()
        return self.state
