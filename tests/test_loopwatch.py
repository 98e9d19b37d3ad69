"""The event-loop watchdog: an async environment method that blocks the server's loop.

Every wait below is a generous bound on a reply that, without the watchdog, would not
come for a minute or an hour (the stalled call's sleep or spin): not a speed assertion.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from envport.errors import EnvTimeoutError
from envport.loopwatch import EXIT_STALLED, LoopWatchdog
from envport.server import ServerConfig
from envport.session import Session
from tests.support.cli import CLI_ENV, ENVPORT
from tests.support.faulty_envs import FaultyEnv
from tests.support.servers import free_port, run_env_server


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/ws"


async def ask(ws: ClientConnection, frame: dict[str, Any], wait_s: float = 20) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    reply: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), wait_s))
    return reply


def step(message: str) -> dict[str, Any]:
    return {"type": "step", "data": {"message": message}}


async def blocked_call_is_interrupted_and_others_go_on(url: str, block: str) -> None:
    """Session A's step blocks the loop; B's step waits behind it; A's deadline frees both."""
    async with connect(ws_url(url)) as a, connect(ws_url(url)) as b:
        await ask(a, {"type": "reset"})
        await ask(b, {"type": "reset"})
        await a.send(json.dumps(step(block)))
        await asyncio.sleep(0.2)  # A's step has the loop
        served = await ask(b, step("meanwhile"))
        assert served["data"]["observation"]["echoed_message"] == "meanwhile"
        err = json.loads(await asyncio.wait_for(a.recv(), 20))
        assert err["type"] == "error"
        assert err["data"]["code"] == "TIMEOUT", err
        assert "blocking the server's event loop" in err["data"]["message"]
        assert "plain def" in err["data"]["message"]
        # A's environment was discarded, as for any call past its deadline; reset is fresh.
        assert (await ask(a, step("x")))["data"]["code"] == "NOT_RESET"
        assert (await ask(a, {"type": "reset"}))["type"] == "observation"
        fresh = await ask(a, step("fresh"))
        assert fresh["data"]["observation"]["echoed_message"] == "fresh"


async def test_in_a_thread_a_busy_loop_past_its_deadline_is_interrupted() -> None:
    config = ServerConfig(call_timeout_s=0.5, stall_warn_s=0.2)
    with run_env_server(FaultyEnv, config, mcp=False) as (url, app):
        await blocked_call_is_interrupted_and_others_go_on(url, "loop_spin:60")
        stats = app.state.watchdog.stats()
        assert stats["loop_stalls"] >= 1
        assert stats["loop_stall_interrupts"] == 1
        assert stats["longest_loop_stall_s"] >= 0.2
        async with httpx.AsyncClient(base_url=url) as http:
            body = (await http.get("/stats")).json()
        assert body["loop_stall_interrupts"] == 1


async def test_a_short_stall_is_logged_with_its_stack_and_the_call_still_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ServerConfig(call_timeout_s=30, stall_warn_s=0.2)
    caplog.set_level(logging.WARNING, logger="envport.server")
    with run_env_server(FaultyEnv, config, mcp=False) as (url, app):
        async with connect(ws_url(url)) as ws:
            await ask(ws, {"type": "reset"})
            reply = await ask(ws, step("loop_sleep:0.8"))
            assert reply["data"]["observation"]["echoed_message"] == "loop_sleep:0.8"
        stats = app.state.watchdog.stats()
    # A loaded machine can stall the loop for 0.2 s by itself (a late heartbeat, logged
    # with some other stack): every stall is logged once, and one of them is the step's.
    warnings = [r.getMessage() for r in caplog.records if "has been blocked" in r.getMessage()]
    assert stats["loop_stalls"] == len(warnings)
    (warning,) = (w for w in warnings if "faulty_envs.py" in w)
    assert "on_step" in warning
    assert "time.sleep" in warning
    assert stats["loop_stall_interrupts"] == 0


def test_the_watchdog_is_off_when_asked() -> None:
    with run_env_server("echo-v1", ServerConfig(stall_warn_s=None), mcp=False) as (_, app):
        assert app.state.watchdog is None


async def test_on_the_main_thread_a_blocking_sleep_is_woken_by_the_signal() -> None:
    """The loop of this test runs on the main thread, as ``envport serve``'s does: the
    interrupt comes as a signal, which wakes ``time.sleep`` itself."""
    watchdog = LoopWatchdog(warn_s=0.1, exit_after_s=None)
    watchdog.start()
    try:
        session = Session(FaultyEnv, call_timeout_s=0.3)
        await session.reset()
        with pytest.raises(EnvTimeoutError, match="blocking the server's event loop"):
            await session.step({"message": "loop_sleep:3600"})
        assert watchdog.stats()["loop_stall_interrupts"] == 1
        await session.close()
    finally:
        watchdog.stop()


async def test_calls_that_block_one_after_another_in_one_stall_are_each_interrupted() -> None:
    """Two sessions' steps queued on the loop run back to back with no heartbeat between
    them: the second is interrupted at its own deadline too."""
    watchdog = LoopWatchdog(warn_s=0.1, exit_after_s=None)
    watchdog.start()
    try:
        a, b = (Session(FaultyEnv, call_timeout_s=0.3) for _ in range(2))
        await a.reset()
        await b.reset()
        results = await asyncio.gather(
            a.step({"message": "loop_spin:60"}),
            b.step({"message": "loop_spin:60"}),
            return_exceptions=True,
        )
        assert [type(r) for r in results] == [EnvTimeoutError, EnvTimeoutError]
        assert watchdog.stats()["loop_stall_interrupts"] == 2
        await a.close()
        await b.close()
    finally:
        watchdog.stop()


async def test_an_interrupted_environment_is_not_kept_alive_by_the_watchdog() -> None:
    watchdog = LoopWatchdog(warn_s=0.1, exit_after_s=None)
    watchdog.start()
    try:
        session = Session(FaultyEnv, call_timeout_s=0.3)
        await session.reset()
        interrupted = weakref.ref(session.env)
        with suppress(EnvTimeoutError):
            await session.step({"message": "loop_sleep:3600"})
        await session.close()
        del session
        FaultyEnv.instances.clear()
        # The loop beats again: the stall is over, and the watchdog's next check (from
        # its thread, which a loaded machine may run late) lets go of the stuck frame.
        for _ in range(100):
            await asyncio.sleep(0.1)
            gc.collect()
            if interrupted() is None:
                break
        assert interrupted() is None  # the watchdog holds no frame of it
    finally:
        watchdog.stop()


async def test_a_call_without_a_deadline_is_only_logged() -> None:
    watchdog = LoopWatchdog(warn_s=0.1, exit_after_s=0.1)
    watchdog.start()
    try:
        session = Session(FaultyEnv, call_timeout_s=None)  # --call-timeout 0
        await session.reset()
        reply = await session.step({"message": "loop_sleep:1"})
        assert reply.observation.echoed_message == "loop_sleep:1"  # type: ignore[attr-defined]
        assert watchdog.stats()["loop_stall_interrupts"] == 0  # and the process lives
        await session.close()
    finally:
        watchdog.stop()


async def test_two_watchdogs_on_the_main_thread_share_the_signal_handler() -> None:
    """One server stopping leaves the other its handler: its interrupt still raises in
    the stuck call instead of the signal's default action ending the process."""
    first, second = LoopWatchdog(warn_s=0.1, exit_after_s=None), LoopWatchdog(warn_s=0.1)
    first.start()
    second.start()
    first.stop()
    try:
        session = Session(FaultyEnv, call_timeout_s=0.3)
        await session.reset()
        with pytest.raises(EnvTimeoutError):
            await session.step({"message": "loop_sleep:3600"})
        await session.close()
    finally:
        second.stop()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # put back by the last


async def test_a_stall_outside_any_environment_call_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watchdog = LoopWatchdog(warn_s=0.1, exit_after_s=None)
    watchdog.start()
    try:
        time.sleep(0.6)  # noqa: ASYNC251 - this test's own code blocks the loop: nothing to interrupt
        await asyncio.sleep(0.3)  # the loop beats again: the stall is over
    finally:
        watchdog.stop()
    stats = watchdog.stats()
    # A loaded machine can stall the loop for 0.1 s by itself (a late heartbeat, logged
    # with some other stack): every stall is logged once, and one of them is this sleep.
    warnings = [r.getMessage() for r in caplog.records if "has been blocked" in r.getMessage()]
    assert stats["loop_stalls"] == len(warnings)
    assert len([w for w in warnings if "test_loopwatch.py" in w]) == 1
    assert stats["loop_stall_interrupts"] == 0
    assert stats["longest_loop_stall_s"] >= 0.2


@contextmanager
def envport_serve(tmp_path: Path, *options: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``envport serve`` (loop on the main thread, uvloop) serving FaultyEnv."""
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    argv = [ENVPORT, "serve", "tests.support.faulty_envs:FaultyEnv", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--log-level", "warning", *options],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=CLI_ENV,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 45
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def test_envport_serve_interrupts_a_blocked_step_and_serves_the_others(
    tmp_path: Path,
) -> None:
    options = ("--call-timeout", "1", "--stall-warn", "0.2")
    with envport_serve(tmp_path, *options) as (url, proc):
        await blocked_call_is_interrupted_and_others_go_on(url, "loop_sleep:3600")
        async with httpx.AsyncClient() as http:
            stats = (await http.get(f"{url}/stats", timeout=5)).json()
        assert stats["loop_stalls"] >= 1
        assert stats["loop_stall_interrupts"] == 1
        assert proc.poll() is None  # the server lives on
    log = (tmp_path / "serve.log").read_text()
    assert "has been blocked" in log
    assert "faulty_envs.py" in log
    assert "Interrupting the environment call that blocks the loop" in log


async def serve_until_a_step_ends_it(tmp_path: Path, message: str, wait_s: float) -> int:
    """``envport serve`` with short stall limits, sent one step that blocks for good: the
    process's exit status once it is gone (within ``wait_s``: no hang)."""
    options = ("--call-timeout", "0.5", "--stall-warn", "0.2", "--stall-exit", "1")
    with envport_serve(tmp_path, *options) as (url, proc):
        async with connect(ws_url(url)) as ws:
            await ask(ws, {"type": "reset"})
            await ws.send(json.dumps(step(message)))
            with pytest.raises(ConnectionClosed):  # the process is gone: no hang
                await asyncio.wait_for(ws.recv(), wait_s)
        return proc.wait(30)


async def test_envport_serve_exits_when_a_stalled_call_will_not_let_go(tmp_path: Path) -> None:
    assert await serve_until_a_step_ends_it(tmp_path, "loop_stuck", 30) == EXIT_STALLED
    log = (tmp_path / "serve.log").read_text()
    assert "did not let go when interrupted; exiting (status 70)" in log
    assert "loop_stuck" in log or "faulty_envs.py" in log


async def test_envport_serve_exits_when_c_code_holds_the_gil(tmp_path: Path) -> None:
    """C code that never lets go of the GIL stops the watchdog thread too; faulthandler's
    timer (a C thread) notices that no Python ran and ends the process with the stacks."""
    assert await serve_until_a_step_ends_it(tmp_path, "gil_stuck", 60) == 1
    log = (tmp_path / "serve.log").read_text()
    assert "Timeout (0:00:0" in log  # faulthandler's dump, from BACKSTOP_MIN_S + 0.25 s
    assert "in on_step" in log
    assert "faulty_envs.py" in log
    assert "in fullmatch" in log


async def test_the_backstop_is_armed_on_the_main_thread_and_cancelled_at_stop() -> None:
    watchdog = LoopWatchdog(exit_after_s=60, interval_s=0.05)
    watchdog.start()
    try:
        assert watchdog._backstop
        armed = watchdog._backstop_armed
        await asyncio.sleep(0.3)
        assert watchdog._backstop_armed == armed  # moved on every 5 s, not every check
    finally:
        watchdog.stop()
    assert not watchdog._backstop
    # Cancelled: nothing fires in this (pytest's) process. A second stop is harmless.
    watchdog.stop()
    armed_in_thread: list[bool] = []

    def run() -> None:
        async def main() -> None:
            in_thread = LoopWatchdog(exit_after_s=60)
            in_thread.start()
            armed_in_thread.append(in_thread._backstop)
            in_thread.stop()

        asyncio.run(main())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert armed_in_thread == [False]  # a server in someone else's thread never exits it
