"""Environments that misbehave on purpose, for fault tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from envport.env import Env
from envport.envs.echo import EchoAction, EchoEnv, EchoObservation
from envport.sandbox import SandboxFailure
from envport.tools import tool
from envport.types import Action, StepResult


def _first_time(marker: str) -> bool:
    try:
        with open(marker, "x"):
            return True
    except FileExistsError:
        return False


class FaultyEnv(Env[EchoAction, EchoObservation]):
    """Echo, except: "crash" raises, "hang" never returns (async), "block" blocks a thread."""

    action_type = EchoAction
    observation_type = EchoObservation
    instances: ClassVar[list[FaultyEnv]] = []
    release: ClassVar[threading.Event] = threading.Event()

    def __init__(self) -> None:
        super().__init__()
        self.closed_calls = 0
        FaultyEnv.instances.append(self)

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[EchoObservation]:
        return StepResult(observation=EchoObservation(echoed_message="ready"))

    async def on_step(self, action: EchoAction) -> StepResult[EchoObservation]:
        if action.message == "crash":
            raise RuntimeError("boom: the environment crashed")
        if action.message == "hang":
            await asyncio.sleep(3600)
        if action.message == "block":
            await asyncio.to_thread(FaultyEnv.release.wait, 30)
        if action.message.startswith(("hang_once:", "die_once:")):
            # The first instance to see this (across processes) hangs or is killed; the
            # marker file makes a retry on a fresh instance succeed.
            kind, _, marker = action.message.partition(":")
            if _first_time(marker):
                if kind == "die_once":  # only ever sent to a server process
                    os.kill(os.getpid(), signal.SIGKILL)
                await asyncio.sleep(3600)
        # "sandbox_once:MARKER": the first instance to see it fails as a broken sandbox would
        if action.message.startswith("sandbox_once:") and _first_time(action.message[13:]):
            raise SandboxFailure("the sandbox's shell died; it was restarted")
        if action.message.startswith("sleep:"):
            await asyncio.sleep(float(action.message.split(":", 1)[1]))
        # A bug the loop watchdog is there for: blocking code in an async method.
        if action.message.startswith("loop_sleep:"):
            time.sleep(float(action.message.split(":", 1)[1]))  # noqa: ASYNC251
        if action.message.startswith("loop_spin:"):
            end = time.monotonic() + float(action.message.split(":", 1)[1])
            while time.monotonic() < end:
                pass
        if action.message == "loop_stuck":  # blocks, and swallows every interrupt
            while True:
                with contextlib.suppress(BaseException):
                    time.sleep(3600)  # noqa: ASYNC251
        if action.message == "gil_stuck":  # C code that holds the GIL, for years
            re.fullmatch(r"(a|aa)+b", "a" * 100)
        if action.message == "unserialisable":  # a set has no JSON form
            return StepResult(observation=EchoObservation(echoed_message="x"), info={"ids": {1}})
        return StepResult(observation=EchoObservation(echoed_message=action.message), reward=0.0)

    async def on_close(self) -> None:
        self.closed_calls += 1


class SyncBlockingEnv(Env[EchoAction, EchoObservation]):
    """A synchronous env (plain def hooks) whose step blocks its worker thread."""

    action_type = EchoAction
    observation_type = EchoObservation

    def on_reset(self, seed: int | None, **options: Any) -> StepResult[EchoObservation]:
        return StepResult(observation=EchoObservation(echoed_message="ready"))

    def on_step(self, action: EchoAction) -> StepResult[EchoObservation]:
        if action.message == "block":
            time.sleep(2.0)
        return StepResult(observation=EchoObservation(echoed_message=action.message))


class BrokenFactoryEnv(Env[EchoAction, EchoObservation]):
    created: ClassVar[int] = 0

    def __init__(self) -> None:
        BrokenFactoryEnv.created += 1
        if BrokenFactoryEnv.created > 1:  # the server's metadata probe is the first
            raise OSError("cannot allocate the environment")
        super().__init__()


class CommandAction(Action):
    """``sleep:SECONDS`` as a command, with the timeout it declares (as shell envs do)."""

    command: str
    timeout_s: float | None = Field(default=None, gt=0)


class LongCommandEnv(Env[CommandAction, EchoObservation]):
    """Commands that take as long as they say, killed at their own ``timeout_s``."""

    action_type = CommandAction
    observation_type = EchoObservation

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[EchoObservation]:
        return StepResult(observation=EchoObservation(echoed_message="ready"))

    async def on_step(self, action: CommandAction) -> StepResult[EchoObservation]:
        seconds = float(action.command.removeprefix("sleep:"))
        if action.timeout_s is not None and seconds > action.timeout_s:
            await asyncio.sleep(action.timeout_s)
            return StepResult(observation=EchoObservation(echoed_message="killed"))
        await asyncio.sleep(seconds)
        return StepResult(observation=EchoObservation(echoed_message=f"slept {seconds:g}"))

    @tool
    async def run(self, command: str, timeout_s: float | None = None) -> str:
        """Run a ``sleep:SECONDS`` command.

        Args:
            command: ``sleep:SECONDS``.
            timeout_s: Seconds before it is killed.
        """
        result = await self.on_step(CommandAction(command=command, timeout_s=timeout_s))
        return result.observation.echoed_message


class SlowToBuildEnv(EchoEnv):
    """Echo that takes ``build_s`` seconds to construct (a big image, a dataset load)."""

    def __init__(self, build_s: float = 0.0, max_steps: int | None = None) -> None:
        time.sleep(build_s)
        super().__init__(max_steps=max_steps)


#: What a :class:`StubbornEnv` starts: a helper that records that it got SIGTERM, and
#: carries on (until SIGKILL, or ten minutes).
_STUBBORN_CHILD = """
import pathlib, signal, sys, time
marks = pathlib.Path(sys.argv[1])
def term(*_):
    with open(marks / "sigterm", "a") as f:
        f.write("SIGTERM\\n")
signal.signal(signal.SIGTERM, term)
time.sleep(600)
"""


class StubbornEnv(FaultyEnv):
    """An environment slow to stop: each one starts a helper process (in its server's
    process group) that outlives SIGTERM, and closing one takes ``close_s`` (a minute;
    the server's metadata probe, the first, closes at once as the server starts), so its
    server is still shutting down long after SIGTERM.

    ``$STUBBORN_DIR`` (required) receives one ``child-PID`` file per helper, and a
    line in ``sigterm`` each time a helper gets SIGTERM: the server's stop has begun."""

    created: ClassVar[int] = 0

    def __init__(self, close_s: float = 60.0) -> None:
        super().__init__()
        StubbornEnv.created += 1
        self.close_s = 0.0 if StubbornEnv.created == 1 else close_s
        marks = Path(os.environ["STUBBORN_DIR"])
        child = subprocess.Popen([sys.executable, "-c", _STUBBORN_CHILD, str(marks)])
        (marks / f"child-{child.pid}").touch()

    async def on_close(self) -> None:
        await asyncio.sleep(self.close_s)
