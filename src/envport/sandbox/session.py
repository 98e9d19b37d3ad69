"""A persistent bash driven over pipes: one process per sandbox, no process per command.

**Protocol.** Each command is sent on the shell's stdin as one top-level line::

    eval '<command, single-quoted>' </dev/null
    \\builtin printf '%s%d\\n' <MARK> "$?"; \\builtin printf '%s\\n' <MARK> >&2

``eval`` at top level keeps what the command does to the shell (``cd``, variables,
functions) for the next one; stdin is ``/dev/null``. ``<MARK>`` is a fresh random token
per command, so no output forges it by chance: everything before it on stdout (stderr)
is the command's stdout (stderr), and the number after it on stdout is ``$?``. Each
stream keeps its first ``cap`` bytes and drains the rest while still looking for the
marker. ``\\builtin printf`` is immune to a ``printf`` function or alias.

**The shell is the agent's, not a trusted reporter.** A command can still make later
markers lie: a function named ``builtin``, a ``DEBUG`` trap under ``extdebug``, reading
the next marker from the shell's own input pipe. No line sent to a shell whose state a
command controls can prevent that, so whatever must be believed (a grader's test run)
runs in a fresh shell instead (``Sandbox.exec(..., fresh_shell=True)``).

What the shell's state is (:data:`CAPTURE_SCRIPT`) is a few builtins (``declare -p``,
``declare -f``, ``alias -p``, ``shopt -p``, ``set +o``, ``$PWD``) printed as bash source;
:func:`replay_script` filters out bash's own read-only and dynamic variables, so
evaluating it in another shell reproduces cwd, variables (exported or not, arrays),
functions, aliases and options.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import secrets
import shlex
import subprocess
from typing import IO

#: Variables bash owns (read-only or dynamic); never replayed into another shell.
_BASH_OWN = frozenset(
    [
        "BASH",
        "BASHOPTS",
        "BASHPID",
        "BASH_ALIASES",
        "BASH_ARGC",
        "BASH_ARGV",
        "BASH_ARGV0",
        "BASH_CMDS",
        "BASH_COMMAND",
        "BASH_EXECUTION_STRING",
        "BASH_LINENO",
        "BASH_LOADABLES_PATH",
        "BASH_REMATCH",
        "BASH_SOURCE",
        "BASH_SUBSHELL",
        "BASH_VERSINFO",
        "BASH_VERSION",
        "COMP_WORDBREAKS",
        "DIRSTACK",
        "EPOCHREALTIME",
        "EPOCHSECONDS",
        "EUID",
        "FUNCNAME",
        "GROUPS",
        "HISTCMD",
        "HOSTNAME",
        "HOSTTYPE",
        "LINENO",
        "MACHTYPE",
        "OLDPWD",
        "OPTERR",
        "OPTIND",
        "OSTYPE",
        "PIPESTATUS",
        "PPID",
        "PWD",
        "RANDOM",
        "SECONDS",
        "SHELLOPTS",
        "SHLVL",
        "SRANDOM",
        "UID",
        "_",
    ]
)
_SECTION = "__ENVPORT_SECTION__"
CAPTURE_SCRIPT = (
    f"declare -p; printf '%s\\n' {_SECTION}; declare -f; printf '%s\\n' {_SECTION}; "
    f"alias -p; shopt -p; set +o; umask -p; printf 'cd -- %q\\n' \"$PWD\""
)
#: The options part of a fresh shell's state (``shopt``, ``set``, ``umask``).
OPTIONS_SCRIPT = "shopt -p; set +o; umask -p"
_FUNCTION = re.compile(r"^(\S+) \(\) $")
_TRAPS = "EXIT HUP INT QUIT TERM USR1 USR2 ERR DEBUG RETURN"
_DECLARE = re.compile(r"^declare -([-a-zA-Z]+) ([A-Za-z_][A-Za-z0-9_]*)(=|$)")


def replay_script(captured: str) -> str:
    """Bash source that recreates, in a fresh shell, the state :data:`CAPTURE_SCRIPT` printed."""
    parts = captured.split(_SECTION + "\n")
    if len(parts) != 3:
        raise ValueError("not a captured shell state")
    variables, functions, rest = parts
    keep = []
    for line in variables.splitlines():
        match = _DECLARE.match(line)
        if match is None or match.group(3) != "=":  # unset, or a continuation we skip
            continue
        flags, name = match.group(1), match.group(2)
        if name in _BASH_OWN or "r" in flags:
            continue
        keep.append(line.replace("declare ", "declare -g ", 1))
    opts = [line for line in rest.splitlines() if "monitor" not in line]
    return "\n".join([*keep, functions.rstrip("\n"), *opts]) + "\n"


def clean_script(captured: str, env: dict[str, str], options: str, cwd: str) -> str | None:
    """Bash builtins that return a shell whose state :data:`CAPTURE_SCRIPT` printed to a
    fresh shell's: every variable and function unset, aliases, traps and directory stack
    cleared, ``options`` (a fresh shell's :data:`OPTIONS_SCRIPT`) and ``env`` restored,
    in ``cwd``. ``None`` if that cannot be done in place (a read-only variable of the
    user's): then start a fresh shell instead."""
    parts = captured.split(_SECTION + "\n")
    if len(parts) != 3:
        raise ValueError("not a captured shell state")
    variables, functions, _rest = parts
    names = []
    for line in variables.splitlines():
        match = _DECLARE.match(line)
        if match is None or match.group(2) in _BASH_OWN:
            continue
        if "r" in match.group(1):
            return None
        names.append(match.group(2))
    funcs = [m.group(1) for m in map(_FUNCTION.match, functions.splitlines()) if m]
    lines = []
    if names:
        lines.append("unset -v " + " ".join(names))
    if funcs:
        lines.append("unset -f " + " ".join(shlex.quote(f) for f in funcs))
    lines += ["unalias -a", f"trap - {_TRAPS}", "dirs -c", "hash -r", "unset OLDPWD"]
    lines += [line for line in options.splitlines() if "monitor" not in line]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f"cd -- {shlex.quote(cwd)}")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class Capture:
    """The first ``cap`` bytes of one stream; how many more were dropped."""

    cap: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    dropped: int = 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


class ShellDied(Exception):
    """The shell's stdout or stderr closed before the command's marker came."""


async def _read_until(reader: asyncio.StreamReader, marker: bytes, into: Capture) -> bytes:
    """Feed ``into`` until ``marker``; return what follows it up to the next newline."""
    window = bytearray()
    keep_back = len(marker) - 1
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            into.add(bytes(window))
            raise ShellDied
        window += chunk
        at = window.find(marker)
        if at >= 0:
            into.add(bytes(window[:at]))
            tail = window[at + len(marker) :]
            while b"\n" not in tail:
                more = await reader.read(64)
                if not more:
                    raise ShellDied
                tail += more
            return bytes(tail[: tail.index(b"\n")])
        cut = len(window) - keep_back
        if cut > 0:
            into.add(bytes(window[:cut]))
            del window[:cut]


class ShellProcess:
    """One bash (maybe inside ``bwrap``), its pipes, and the marker protocol."""

    def __init__(self, proc: subprocess.Popen[bytes], *, cap: int) -> None:
        self.proc = proc
        self.cap = cap
        self._stdout: asyncio.StreamReader | None = None
        self._stderr: asyncio.StreamReader | None = None
        self._stdin: asyncio.WriteTransport | None = None
        self._transports: list[asyncio.BaseTransport] = []

    async def attach(self) -> None:
        """Connect the pipes to the running event loop.

        The transports get their own duplicates of the pipes' descriptors: uvloop's (the
        default under uvicorn) close the descriptor they were given when they are closed,
        while the ``Popen``'s file object still holds that number; closing the object
        later closed whatever had reused the number (a restarted shell's pipe), and libuv
        aborted the whole server."""
        loop = asyncio.get_running_loop()
        proc = self.proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stderr is not None
        self._stdout = await self._reader(loop, _dup(proc.stdout, "rb"))
        self._stderr = await self._reader(loop, _dup(proc.stderr, "rb"))
        transport, _ = await loop.connect_write_pipe(asyncio.Protocol, _dup(proc.stdin, "wb"))
        self._transports.append(transport)
        self._stdin = transport

    async def _reader(
        self, loop: asyncio.AbstractEventLoop, pipe: IO[bytes]
    ) -> asyncio.StreamReader:
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        self._transports.append(transport)
        return reader

    def send(
        self, script: str, *, cap: int | None = None
    ) -> tuple[asyncio.Future[bytes], asyncio.Future[bytes], Capture, Capture]:
        """Write ``script`` then the markers; return the two reader tasks and captures."""
        assert self._stdin is not None
        assert self._stdout is not None
        assert self._stderr is not None
        mark = "__ENVPORT_" + secrets.token_hex(12) + "__"
        line = (
            f"{script}\n\\builtin printf '%s%d\\n' {mark} \"$?\"; "
            f"\\builtin printf '%s\\n' {mark} >&2\n"
        )
        if self._stdin.is_closing():
            raise ShellDied
        self._stdin.write(line.encode())
        out, err = Capture(cap or self.cap), Capture(cap or self.cap)
        marker = mark.encode()
        t_out = asyncio.ensure_future(_read_until(self._stdout, marker, out))
        t_err = asyncio.ensure_future(_read_until(self._stderr, marker, err))
        return t_out, t_err, out, err

    async def run_internal(
        self, script: str, *, timeout_s: float = 10.0, cap: int | None = None
    ) -> tuple[int, str]:
        """Run trusted ``script`` raw (no eval); ``(status, stdout)``; raises
        :class:`ShellDied` or ``TimeoutError`` if the markers do not come."""
        t_out, t_err, out, err = self.send(script, cap=cap)
        try:
            async with asyncio.timeout(timeout_s):
                status = await t_out
                await t_err
        except ShellDied:
            await asyncio.gather(t_out, t_err, return_exceptions=True)
            raise ShellDied(err.text().strip()) from None  # what it (or bwrap) said last
        finally:
            for task in (t_out, t_err):
                task.cancel()
            await asyncio.gather(t_out, t_err, return_exceptions=True)
        return int(status or b"-1"), out.text()

    def close(self) -> None:
        for transport in self._transports:
            with contextlib.suppress(RuntimeError):  # the event loop may be gone already
                transport.close()
        self._transports.clear()


def _dup(pipe: IO[bytes], mode: str) -> IO[bytes]:
    return open(os.dup(pipe.fileno()), mode, buffering=0)  # the transport owns it


def eval_line(command: str) -> str:
    """``command`` as the protocol's top-level ``eval`` line."""
    return f"eval {shlex.quote(command)} </dev/null"


def close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
