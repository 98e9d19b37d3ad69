"""The server over real sockets: OpenEnv's frames, envport's extensions, every bad input."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from envport.server import ServerConfig
from tests.support.faulty_envs import BrokenFactoryEnv, FaultyEnv, SyncBlockingEnv
from tests.support.servers import run_env_server


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    with run_env_server("echo-v1", mcp=False) as (url, _):
        yield url


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/ws"


async def ask(ws: ClientConnection, frame: dict[str, Any] | str) -> dict[str, Any]:
    await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
    reply: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10))
    return reply


# --- OpenEnv's frames ---------------------------------------------------------------


async def test_reset_step_state_close(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as ws:
        reply = await ask(ws, {"type": "reset", "data": {"seed": 1}})
        assert reply["type"] == "observation"
        assert reply["data"]["observation"]["echoed_message"] == "Echo environment ready!"
        assert reply["data"]["done"] is False
        assert "id" not in reply
        assert "terminated" not in reply["data"]  # extensions only after hello
        for i, msg in enumerate(["a", "bb", "ccc"], start=1):
            reply = await ask(ws, {"type": "step", "data": {"message": msg}})
            assert reply["data"]["observation"] == {"echoed_message": msg, "message_length": i}
            assert reply["data"]["reward"] == pytest.approx(0.1 * i)
        state = await ask(ws, {"type": "state"})
        assert state["type"] == "state"
        assert state["data"]["step_count"] == 3
        await ws.send(json.dumps({"type": "close"}))
        await asyncio.wait_for(ws.recv(), 5)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        assert ws.close_code == 1000


async def test_sessions_never_share_state(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as a, connect(ws_url(echo_url)) as b:
        await ask(a, {"type": "reset"})
        await ask(b, {"type": "reset"})
        for _ in range(3):
            await ask(a, {"type": "step", "data": {"message": "x"}})
        assert (await ask(a, {"type": "state"}))["data"]["step_count"] == 3
        state_b = await ask(b, {"type": "state"})
        assert state_b["data"]["step_count"] == 0
        assert (
            state_b["data"]["episode_id"] != (await ask(a, {"type": "state"}))["data"]["episode_id"]
        )


async def test_tools_as_openenv_actions(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as ws:
        await ask(ws, {"type": "reset"})
        listed = await ask(ws, {"type": "step", "data": {"type": "list_tools"}})
        names = [t["name"] for t in listed["data"]["observation"]["tools"]]
        assert names == ["echo", "reverse"]
        called = await ask(
            ws,
            {
                "type": "step",
                "data": {
                    "type": "call_tool",
                    "tool_name": "reverse",
                    "arguments": {"message": "abc"},
                },
            },
        )
        result = called["data"]["observation"]["result"]  # OpenEnv's CallToolResult
        assert result["data"] == "cba"
        assert result["content"] == [
            {"type": "text", "text": "cba", "annotations": None, "meta": None}
        ]
        assert result["structured_content"] == {"result": "cba"}
        assert result["is_error"] is False
        assert called["data"]["observation"]["error"] is None
        bad = await ask(
            ws,
            {"type": "step", "data": {"type": "call_tool", "tool_name": "nope", "arguments": {}}},
        )
        assert bad["data"]["observation"]["error"]["error_type"] == "tool_not_found"
        bad_args = await ask(
            ws,
            {"type": "step", "data": {"type": "call_tool", "tool_name": "echo", "arguments": {}}},
        )
        assert bad_args["data"]["observation"]["error"]["error_type"] == "invalid_args"
        assert "message" in bad_args["data"]["observation"]["error"]["message"]


# --- bad input ----------------------------------------------------------------------


async def test_malformed_json_keeps_session(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as ws:
        await ask(ws, {"type": "reset"})
        await ask(ws, {"type": "step", "data": {"message": "x"}})
        err = await ask(ws, "{not json")
        assert err["type"] == "error"
        assert err["data"]["code"] == "INVALID_JSON"
        err = await ask(ws, "[1, 2]")
        assert err["data"]["code"] == "UNKNOWN_TYPE"
        err = await ask(ws, {"type": "dance"})
        assert err["data"]["code"] == "UNKNOWN_TYPE"
        assert "dance" in err["data"]["message"]
        state = await ask(ws, {"type": "state"})
        assert state["data"]["step_count"] == 1  # nothing lost


async def test_a_frame_refused_after_it_parsed_echoes_its_id(echo_url: str) -> None:
    """An unknown type or bad ``data`` is answered with the frame's id (a client that
    matches replies by id must not mistake it for another request's)."""
    async with connect(ws_url(echo_url)) as ws:
        await ask(ws, {"type": "hello", "id": 1})
        err = await ask(ws, {"type": "bogus", "id": 42})
        assert (err["type"], err["id"], err["data"]["code"]) == ("error", 42, "UNKNOWN_TYPE")
        err = await ask(ws, {"type": "step", "id": 43, "data": "str"})
        assert (err["type"], err["id"]) == ("error", 43)
        err = await ask(ws, "{not json")  # no id to echo: none is made up
        assert err["type"] == "error"
        assert "id" not in err


@pytest.mark.parametrize("extended", [False, True], ids=["openenv", "envport"])
async def test_a_type_that_is_not_a_string_is_an_unknown_type_and_the_session_stays(
    echo_url: str, extended: bool
) -> None:
    async with connect(ws_url(echo_url)) as ws:
        if extended:
            await ask(ws, {"type": "hello", "id": 1})
        await ask(ws, {"type": "reset", "id": 2})
        await ask(ws, {"type": "step", "id": 3, "data": {"message": "a"}})
        for bad in (["step"], {"step": 1}):
            err = await ask(ws, {"type": bad, "id": 4})
            assert err["type"] == "error"
            assert err["data"]["code"] == "UNKNOWN_TYPE"
            assert err["id"] == 4
        assert (await ask(ws, {"type": "state", "id": 5}))["data"]["step_count"] == 1


async def test_an_unexpected_error_decoding_a_frame_is_answered_and_logged(
    echo_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from envport.server import ws as ws_module

    def broken(raw: str | bytes, max_bytes: int) -> dict[str, Any]:
        raise RuntimeError("a bug in decoding")

    async with connect(ws_url(echo_url)) as ws:
        await ask(ws, {"type": "reset"})
        with monkeypatch.context() as patch:
            patch.setattr(ws_module, "decode_frame", broken)
            err = await ask(ws, {"type": "state"})
        assert err["type"] == "error"
        assert "a bug in decoding" in err["data"]["message"]
        assert "a bug in decoding" in caplog.text
        assert (await ask(ws, {"type": "state"}))["type"] == "state"


@pytest.mark.parametrize("impl", ["envport", "websockets-sansio"])
async def test_a_close_frame_sent_while_a_step_runs_ends_the_session(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gives up on a slow step, sends ``close`` and hangs up before the server
    read it: the session is closed when the step ends, not kept for a resume (holding a
    capacity slot for the resume grace)."""
    monkeypatch.setenv("ENVPORT_WS_IMPL", impl)
    config = ServerConfig(resume_grace_s=60)
    with run_env_server(FaultyEnv, config, mcp=False) as (url, app):
        manager = app.state.manager
        # The client hangs up at most 0.5 s after its close (it does not wait for the
        # server's close frame, which may come only once the step ends): well before it.
        async with connect(ws_url(url), close_timeout=0.5) as ws:
            await ask(ws, {"type": "hello", "id": 1})
            await ask(ws, {"type": "reset", "id": 2})
            await ws.send(json.dumps({"type": "step", "id": 3, "data": {"message": "sleep:4"}}))
            await ws.send(json.dumps({"type": "close"}))
        assert manager.sessions  # the step still runs
        for _ in range(500):
            if not manager.sessions:
                break
            await asyncio.sleep(0.02)
        assert not manager.sessions


async def test_invalid_action_names_the_field(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as ws:
        await ask(ws, {"type": "reset"})
        err = await ask(ws, {"type": "step", "data": {"mesage": "typo"}})
        assert err["data"]["code"] == "VALIDATION_ERROR"
        fields = {e["field"] for e in err["data"]["errors"]}
        assert fields == {"message", "mesage"}
        assert err["data"]["schema"]["properties"]["message"]["type"] == "string"
        err = await ask(ws, {"type": "step", "data": {"message": 12}})
        assert err["data"]["code"] == "VALIDATION_ERROR"
        ok = await ask(ws, {"type": "step", "data": {"message": "fine"}})
        assert ok["type"] == "observation"
        assert (await ask(ws, {"type": "state"}))["data"]["step_count"] == 1


async def test_step_before_reset(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as ws:
        err = await ask(ws, {"type": "step", "data": {"message": "x"}})
        assert err["data"]["code"] == "NOT_RESET"
        assert "reset" in err["data"]["message"]
        assert (await ask(ws, {"type": "reset"}))["type"] == "observation"


async def test_oversize_frame_is_refused_and_session_survives() -> None:
    config = ServerConfig(max_frame_bytes=4096)
    with run_env_server("echo-v1", config, mcp=False) as (url, _):
        async with connect(ws_url(url), max_size=None) as ws:
            await ask(ws, {"type": "reset"})
            err = await ask(ws, {"type": "step", "data": {"message": "x" * 5000}})
            assert err["data"]["code"] == "PAYLOAD_TOO_LARGE"
            assert err["data"]["limit_bytes"] == 4096
            ok = await ask(ws, {"type": "step", "data": {"message": "small"}})
            assert ok["data"]["observation"]["echoed_message"] == "small"
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/step", json={"action": {"message": "x" * 5000}})
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"


async def test_crashing_env_reports_and_stays_usable() -> None:
    with run_env_server(FaultyEnv, mcp=False) as (url, _):
        async with connect(ws_url(url)) as ws, connect(ws_url(url)) as other:
            await ask(ws, {"type": "reset"})
            await ask(other, {"type": "reset"})
            err = await ask(ws, {"type": "step", "data": {"message": "crash"}})
            assert err["data"]["code"] == "EXECUTION_ERROR"
            assert "boom" in err["data"]["message"]
            ok = await ask(ws, {"type": "step", "data": {"message": "after"}})
            assert ok["data"]["observation"]["echoed_message"] == "after"
            ok = await ask(other, {"type": "step", "data": {"message": "unaffected"}})
            assert ok["type"] == "observation"


async def test_hanging_step_times_out_without_blocking_others() -> None:
    config = ServerConfig(call_timeout_s=0.5)
    with run_env_server(FaultyEnv, config, mcp=False) as (url, _app):
        async with connect(ws_url(url)) as ws, connect(ws_url(url)) as other:
            await ask(ws, {"type": "reset"})
            await ask(other, {"type": "reset"})
            await ws.send(json.dumps({"type": "step", "data": {"message": "hang"}}))
            # While one session hangs, another is served promptly.
            ok = await ask(other, {"type": "step", "data": {"message": "meanwhile"}})
            assert ok["data"]["observation"]["echoed_message"] == "meanwhile"
            err = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert err["data"]["code"] == "TIMEOUT"
            assert err["data"]["timeout_s"] == 0.5
            err = await ask(ws, {"type": "step", "data": {"message": "x"}})
            assert err["data"]["code"] == "NOT_RESET"  # the hung env was discarded
            assert (await ask(ws, {"type": "reset"}))["type"] == "observation"
            ok = await ask(ws, {"type": "step", "data": {"message": "fresh"}})
            assert ok["data"]["observation"]["echoed_message"] == "fresh"


async def test_sync_env_runs_off_the_event_loop() -> None:
    with run_env_server(SyncBlockingEnv, mcp=False) as (url, _):
        async with connect(ws_url(url)) as ws, connect(ws_url(url)) as other:
            await ask(ws, {"type": "reset"})
            await ask(other, {"type": "reset"})
            await ws.send(json.dumps({"type": "step", "data": {"message": "block"}}))
            await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await ask(other, {"type": "step", "data": {"message": "quick"}})
            # The other session's answer did not wait for the 2 s block to finish.
            assert loop.time() - started < 1.5
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert reply["data"]["observation"]["echoed_message"] == "block"


async def test_factory_error() -> None:
    BrokenFactoryEnv.created = 0
    with run_env_server(BrokenFactoryEnv, mcp=False) as (url, _):
        async with connect(ws_url(url)) as ws:
            err = await ask(ws, {"type": "reset"})
            assert err["data"]["code"] == "FACTORY_ERROR"
            assert "cannot allocate" in err["data"]["message"]


# --- capacity, queue, reaper ---------------------------------------------------------


async def test_capacity_reached_frame_then_close() -> None:
    config = ServerConfig(max_sessions=2, max_queue=0, queue_timeout_s=0)
    with run_env_server("echo-v1", config, mcp=False) as (url, _app):
        async with connect(ws_url(url)) as a, connect(ws_url(url)) as b:
            await ask(a, {"type": "reset"})
            await ask(b, {"type": "reset"})
            async with connect(ws_url(url)) as c:
                err = await ask(c, {"type": "reset"})
                assert err["data"]["code"] == "CAPACITY_REACHED"
                assert err["data"]["max_sessions"] == 2
                assert err["data"]["retry_after_s"] >= 1
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(c.recv(), 5)
                assert c.close_code == 1000
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/sessions")
                assert r.status_code == 503
                assert "Retry-After" in r.headers
            # The two admitted sessions are untouched.
            assert (await ask(a, {"type": "step", "data": {"message": "ok"}}))[
                "type"
            ] == "observation"


async def test_wait_queue_admits_when_a_slot_frees() -> None:
    config = ServerConfig(max_sessions=1, max_queue=4, queue_timeout_s=10)
    with run_env_server("echo-v1", config, mcp=False) as (url, app):
        a = await connect(ws_url(url))
        await ask(a, {"type": "reset"})
        async with connect(ws_url(url)) as b:
            await b.send(json.dumps({"type": "reset"}))
            # the server (another thread) queues b's reset when it gets to it
            await _until(lambda: app.state.manager.stats()["queued"] == 1)
            await a.close()  # frees the slot
            reply = json.loads(await asyncio.wait_for(b.recv(), 10))
            assert reply["type"] == "observation"


async def test_reaper_spares_attached_sessions_and_reaps_detached() -> None:
    config = ServerConfig(
        idle_timeout_s=0.3, resume_grace_s=0.3, reap_interval_s=0.05, call_timeout_s=5
    )
    with run_env_server(FaultyEnv, config, mcp=False) as (url, app):
        manager = app.state.manager
        async with connect(ws_url(url)) as ws:
            await ask(ws, {"type": "hello"})
            await ask(ws, {"type": "reset"})
            # A long step on an open connection: far past idle_timeout_s, not reaped.
            reply = await ask(ws, {"type": "step", "data": {"message": "sleep:1.0"}})
            assert reply["type"] == "observation"
            await asyncio.sleep(0.6)  # idle, but the connection is open
            assert manager.active == 1
        # Detached (hello'd) session: kept for the grace period, then reaped.
        await _until(lambda: manager.active == 0, within_s=30.0)
        assert manager.reaped >= 1


async def test_http_use_of_a_dropped_websocket_session_keeps_its_resume_grace() -> None:
    """A session a WebSocket dropped expires by resume_grace_s; an HTTP request with its
    token must not turn it into an HTTP session that lives for idle_timeout_s."""
    # The grace must outlast the drop, a new HTTP connection and the check below on a
    # loaded machine: the session is reaped before then if it does not.
    config = ServerConfig(idle_timeout_s=60, resume_grace_s=1.0, reap_interval_s=0.05)
    with run_env_server("echo-v1", config, mcp=False) as (url, app):
        manager = app.state.manager
        async with connect(ws_url(url)) as ws:
            token = (await ask(ws, {"type": "hello"}))["data"]["token"]
            await ask(ws, {"type": "reset"})
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.get("/state", headers={"X-Envport-Session": token})
            assert r.status_code == 200
        assert manager.active == 1
        await _until(lambda: manager.active == 0, within_s=30.0)  # not 60 s

        # A plain HTTP session still lives by idleness after its requests.
        async with httpx.AsyncClient(base_url=url) as http:
            made = (await http.post("/sessions")).json()
            headers = {"X-Envport-Session": made["token"]}
            assert (await http.post("/reset", json={}, headers=headers)).status_code == 200
            await asyncio.sleep(1.5)  # past the resume grace (and a reap pass)
            assert (await http.get("/state", headers=headers)).status_code == 200


async def _until(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    for _ in range(int(within_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition still false after {within_s} s")


class SlowCloseEnv(FaultyEnv):
    """Echo whose teardown takes a while (a container or sandbox being removed)."""

    close_s = 0.6
    closing: ClassVar[list[SlowCloseEnv]] = []  # teardowns running now

    def __init__(self) -> None:
        super().__init__()
        self.closed_alongside: list[SlowCloseEnv] = []  # others whose teardown overlapped

    async def on_close(self) -> None:
        for other in SlowCloseEnv.closing:
            other.closed_alongside.append(self)
            self.closed_alongside.append(other)
        SlowCloseEnv.closing.append(self)
        try:
            await asyncio.sleep(self.close_s)
        finally:
            SlowCloseEnv.closing.remove(self)


async def test_reaper_never_closes_a_session_used_during_its_pass() -> None:
    """One reaper pass finds two expired sessions and A's teardown is slow. B must not
    be findable, attached and then closed under its user meanwhile: either it is gone
    (reaped) by the time it is looked up, or it is left alone."""
    from envport.errors import SessionNotFoundError
    from envport.server.sessions import SessionManager

    config = ServerConfig(idle_timeout_s=0.2, reap_interval_s=0.05, call_timeout_s=5)
    manager = SessionManager(SlowCloseEnv, config)
    a, b = await manager.create(), await manager.create()
    await a.reset()
    await b.reset()
    await asyncio.sleep(0.3)  # both idle past the timeout
    reaper = asyncio.create_task(manager.reaper())
    try:
        await _until(lambda: a.closed)  # the pass has started closing A
        try:
            found = manager.by_token(b.token)
        except SessionNotFoundError:
            found = None  # reaped in the same pass: never handed out again
        if found is not None:
            found.attach()  # a request uses it now
            await asyncio.sleep(SlowCloseEnv.close_s * 2)
            assert not found.closed, "an attached session was reaped"
            found.detach()
        else:
            assert b.closed
        await _until(lambda: not manager._reaping)  # that pass is over
        # The closes of one pass run together, not one after another (judged by their
        # overlap, not by the clock, which a loaded machine stretches).
        c, d = await manager.create(), await manager.create()
        c.last_active = d.last_active = 0.0
        await _until(lambda: c.closed and d.closed and not manager._reaping)
        assert any(other is d.env for other in c.env.closed_alongside)
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await manager.close_all()


# --- envport extensions ----------------------------------------------------------------


async def test_request_ids_and_resume(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as ws:
        hello = await ask(ws, {"type": "hello", "id": "h"})
        assert hello["id"] == "h"
        assert hello["data"]["protocol"] == "envport/1"
        token = hello["data"]["token"]
        reply = await ask(ws, {"type": "reset", "id": 1})
        assert reply["id"] == 1
        assert reply["data"]["terminated"] is False
        await ask(ws, {"type": "step", "id": 2, "data": {"message": "one"}})
    # Connection dropped; the session lives on for the grace period.
    async with connect(ws_url(echo_url)) as ws:
        resumed = await ask(ws, {"type": "hello", "data": {"resume": token}})
        assert resumed["data"]["resumed"] is True
        # Resending the last frame (same id) is answered from cache: applied once.
        again = await ask(ws, {"type": "step", "id": 2, "data": {"message": "one"}})
        assert again["id"] == 2
        state = await ask(ws, {"type": "state", "id": 3})
        assert state["data"]["step_count"] == 1
    async with connect(ws_url(echo_url)) as ws:
        err = await ask(ws, {"type": "hello", "data": {"resume": "not-a-token"}})
        assert err["data"]["code"] == "SESSION_NOT_FOUND"


async def test_a_step_resent_while_it_still_runs_is_applied_once() -> None:
    """The connection drops during a slow step; the client resumes and resends the frame
    with the same id while the first one is still running: the resend waits for it and
    gets its reply, and the environment stepped once. A resent failed step gets its error
    again, without stepping again."""
    with run_env_server("tests.support.faulty_envs:FaultyEnv", mcp=False) as (url, _):
        async with connect(ws_url(url)) as ws:
            token = (await ask(ws, {"type": "hello"}))["data"]["token"]
            await ask(ws, {"type": "reset", "id": 1})
            await ws.send(json.dumps({"type": "step", "id": 2, "data": {"message": "sleep:1"}}))
            await asyncio.sleep(0.2)  # the step is running; the connection drops
        async with connect(ws_url(url)) as ws:
            resumed = await ask(ws, {"type": "hello", "data": {"resume": token}})
            assert resumed["data"]["resumed"] is True
            again = await ask(ws, {"type": "step", "id": 2, "data": {"message": "sleep:1"}})
            assert again["id"] == 2
            assert again["type"] == "observation"
            state = await ask(ws, {"type": "state", "id": 3})
            assert state["data"]["step_count"] == 1  # once, not twice
            failed = await ask(ws, {"type": "step", "id": 4, "data": {"message": "crash"}})
            assert failed["type"] == "error"
            resent = await ask(ws, {"type": "step", "id": 4, "data": {"message": "crash"}})
            assert resent == failed
            state = await ask(ws, {"type": "state", "id": 5})
            assert state["data"]["step_count"] == 2


async def test_replies_that_cannot_be_json_and_bad_reset_options_get_clear_errors() -> None:
    """An environment that puts a set in its info, a seed that is not an integer, an
    episode id that is not a string: an error reply each (WebSocket frame, HTTP status),
    and the session goes on."""
    with run_env_server("tests.support.faulty_envs:FaultyEnv", mcp=False) as (url, _):
        async with connect(ws_url(url)) as ws:
            await ask(ws, {"type": "hello"})
            bad_seed = await ask(ws, {"type": "reset", "id": 1, "data": {"seed": [1]}})
            assert bad_seed["data"]["code"] == "VALIDATION_ERROR"
            assert "seed" in bad_seed["data"]["message"]
            bad_id = await ask(ws, {"type": "reset", "id": 2, "data": {"episode_id": 7}})
            assert bad_id["data"]["code"] == "VALIDATION_ERROR"
            await ask(ws, {"type": "reset", "id": 3})
            reply = await ask(ws, {"type": "step", "id": 4, "data": {"message": "unserialisable"}})
            assert reply["type"] == "error"
            assert reply["id"] == 4
            assert "could not be sent as JSON" in reply["data"]["message"]
            fine = await ask(ws, {"type": "step", "id": 5, "data": {"message": "hi"}})
            assert fine["data"]["observation"]["echoed_message"] == "hi"  # still connected
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/reset", json={"seed": "one"})
            assert r.status_code == 422
            assert r.json()["error"]["code"] == "VALIDATION_ERROR"
            headers = {"X-Envport-Session": (await http.post("/sessions")).json()["token"]}
            await http.post("/reset", json={}, headers=headers)
            r = await http.post(
                "/step", json={"action": {"message": "unserialisable"}}, headers=headers
            )
            assert r.status_code == 500
            assert r.json()["error"]["code"] == "EXECUTION_ERROR"
            r = await http.post("/step", json={"action": {"message": "ok"}}, headers=headers)
            assert r.status_code == 200


async def test_http_statuses_for_a_crashing_a_hanging_and_a_closed_environment() -> None:
    config = ServerConfig(call_timeout_s=0.3)
    with run_env_server("tests.support.faulty_envs:FaultyEnv", config, mcp=False) as (url, _):
        async with httpx.AsyncClient(base_url=url) as http:
            headers = {"X-Envport-Session": (await http.post("/sessions")).json()["token"]}
            await http.post("/reset", json={}, headers=headers)
            crash = await http.post("/step", json={"action": {"message": "crash"}}, headers=headers)
            assert crash.status_code == 500
            assert crash.json()["error"]["code"] == "EXECUTION_ERROR"
            assert "boom" in crash.json()["error"]["message"]
            hang = await http.post("/step", json={"action": {"message": "hang"}}, headers=headers)
            assert hang.status_code == 504
            assert hang.json()["error"]["code"] == "TIMEOUT"
            after = await http.post("/step", json={"action": {"message": "x"}}, headers=headers)
            assert after.status_code == 409  # discarded: reset() starts a fresh one
            assert (await http.post("/reset", json={}, headers=headers)).status_code == 200
            assert (await http.delete("/sessions", headers=headers)).status_code == 204
            gone = await http.post("/step", json={"action": {"message": "x"}}, headers=headers)
            assert gone.status_code == 404


async def test_a_frame_over_the_limit_in_bytes_is_refused_though_its_characters_fit() -> None:
    from envport.errors import PayloadTooLargeError
    from envport.protocol.codec import decode_frame

    frame = json.dumps({"type": "step", "data": {"message": "é" * 600}}, ensure_ascii=False)
    assert len(frame) < 1024 < len(frame.encode())
    with pytest.raises(PayloadTooLargeError):
        decode_frame(frame, 1024)
    assert decode_frame(frame, 4096)["type"] == "step"


async def test_batch_steps_many_sessions_in_one_frame(echo_url: str) -> None:
    async with connect(ws_url(echo_url)) as ws:
        await ask(ws, {"type": "hello"})
        opened = [await ask(ws, {"type": "open"}) for _ in range(4)]
        ids = [o["data"]["session_id"] for o in opened]
        resets = await ask(
            ws, {"type": "batch", "data": [{"session_id": s, "type": "reset"} for s in ids]}
        )
        assert [r["type"] for r in resets["data"]] == ["observation"] * 4
        steps = await ask(
            ws,
            {
                "type": "batch",
                "id": 9,
                "data": [
                    {"session_id": s, "type": "step", "data": {"message": "m" * (i + 1)}}
                    for i, s in enumerate(ids)
                ]
                + [{"session_id": "unknown", "type": "step", "data": {"message": "x"}}],
            },
        )
        assert steps["id"] == 9
        lengths = [r["data"]["observation"]["message_length"] for r in steps["data"][:4]]
        assert lengths == [1, 2, 3, 4]
        assert [r["session_id"] for r in steps["data"][:4]] == ids
        assert steps["data"][4]["data"]["code"] == "SESSION_NOT_FOUND"
        err = await ask(ws, {"type": "batch", "data": {"not": "a list"}})
        assert err["data"]["code"] == "UNKNOWN_TYPE"


# --- HTTP ------------------------------------------------------------------------------


async def test_http_info_routes(echo_url: str) -> None:
    async with httpx.AsyncClient(base_url=echo_url) as http:
        assert (await http.get("/health")).json() == {"status": "healthy"}
        meta = (await http.get("/metadata")).json()
        assert meta["name"] == "EchoEnv"
        assert meta["tools"] == ["echo", "reverse"]
        schema = (await http.get("/schema")).json()
        assert {"action", "observation", "state"} <= set(schema)
        assert [t["name"] for t in schema["tools"]] == ["echo", "reverse"]
        assert "message" in schema["action"]["properties"]


async def test_http_stateless_like_openenv(echo_url: str) -> None:
    async with httpx.AsyncClient(base_url=echo_url) as http:
        r = await http.post("/reset", json={"seed": 3})
        assert r.status_code == 200
        assert r.json()["done"] is False
        r = await http.post("/step", json={"action": {"message": "hey"}, "request_id": "r1"})
        assert r.json()["observation"]["echoed_message"] == "hey"
        assert r.json()["request_id"] == "r1"
        assert (await http.get("/state")).json()["step_count"] == 0  # a fresh env each time


async def test_http_stateful_session(echo_url: str) -> None:
    async with httpx.AsyncClient(base_url=echo_url) as http:
        created = await http.post("/sessions")
        assert created.status_code == 201
        headers = {"X-Envport-Session": created.json()["token"]}
        await http.post("/reset", json={"seed": 1}, headers=headers)
        for _ in range(3):
            await http.post("/step", json={"action": {"message": "a"}}, headers=headers)
        state = (await http.get("/state", headers=headers)).json()
        assert state["step_count"] == 3
        assert (await http.delete("/sessions", headers=headers)).status_code == 204
        gone = await http.get("/state", headers=headers)
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "SESSION_NOT_FOUND"
        assert "600 s unused (an HTTP session)" in gone.json()["error"]["message"]


async def test_a_tools_only_token_cannot_control_its_session_over_http(echo_url: str) -> None:
    """The token for an agent (``tools_token``) is refused by every control route with
    403, and the session is untouched: the trainer's episode goes on."""
    async with httpx.AsyncClient(base_url=echo_url) as http:
        created = (await http.post("/sessions")).json()
        control = {"X-Envport-Session": created["token"]}
        agent = {"X-Envport-Session": created["tools_token"]}
        assert created["tools_token"] != created["token"]
        await http.post("/reset", json={"seed": 1}, headers=control)
        await http.post("/step", json={"action": {"message": "a"}}, headers=control)
        denied = [
            await http.post("/reset", json={}, headers=agent),
            await http.post("/step", json={"action": {"message": "x"}}, headers=agent),
            await http.get("/state", headers=agent),
            await http.delete("/sessions", headers=agent),
        ]
        for r in denied:
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "FORBIDDEN"
            assert "tools-only" in r.json()["error"]["message"]
        state = (await http.get("/state", headers=control)).json()
        assert state["step_count"] == 1  # no reset, no step, not closed
        assert (await http.delete("/sessions", headers=control)).status_code == 204
        gone = await http.get("/state", headers=agent)  # closed: its tools token too
        assert gone.status_code == 404


async def test_a_tools_only_token_cannot_resume_or_drive_a_session_over_websocket(
    echo_url: str,
) -> None:
    async with connect(ws_url(echo_url)) as ws:
        hello = await ask(ws, {"type": "hello"})
        tools_token = hello["data"]["tools_token"]
        await ask(ws, {"type": "reset"})
        await ask(ws, {"type": "step", "data": {"message": "one"}})
        async with connect(ws_url(echo_url)) as other:
            err = await ask(other, {"type": "hello", "data": {"resume": tools_token}})
            assert err["type"] == "error"
            assert err["data"]["code"] == "FORBIDDEN"
            await ask(other, {"type": "hello"})
            items = [
                {"token": tools_token, "type": kind, "data": data}
                for kind, data in (("reset", {}), ("step", {"message": "x"}), ("state", None))
            ]
            replies = await ask(other, {"type": "batch", "data": items})
            assert [r["data"]["code"] for r in replies["data"]] == ["FORBIDDEN"] * 3
        state = await ask(ws, {"type": "state"})
        assert state["data"]["step_count"] == 1


async def test_http_bad_input(echo_url: str) -> None:
    async with httpx.AsyncClient(base_url=echo_url) as http:
        r = await http.post("/step", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "INVALID_JSON"
        r = await http.post("/step", json={"action": {"bad": 1}})
        assert r.status_code == 422
        assert r.json()["error"]["code"] == "VALIDATION_ERROR"
        r = await http.post("/step", json={"no_action": 1})
        assert r.status_code == 422
        r = await http.post("/reset", json=[1, 2])
        assert r.status_code == 422
        headers = {"X-Envport-Session": "bogus"}
        r = await http.post("/step", json={"action": {"message": "x"}}, headers=headers)
        assert r.status_code == 404
        created = (await http.post("/sessions")).json()
        r = await http.post(
            "/step",
            json={"action": {"message": "x"}},
            headers={"X-Envport-Session": created["token"]},
        )
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "NOT_RESET"


@pytest.mark.parametrize(
    ("value", "message"),
    [("{nope", "--env-options is not JSON"), ("[1]", "must be a JSON object")],
)
def test_server_module_refuses_bad_env_options(value: str, message: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "envport.server", "echo-v1", "--env-options", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize("value", ["bogus", ""])
def test_uvicorn_config_refuses_an_unknown_ws_impl(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from envport.server import create_app, uvicorn_config

    config = ServerConfig()
    app = create_app("echo-v1", config)
    monkeypatch.setenv("ENVPORT_WS_IMPL", value)
    with pytest.raises(ValueError, match=rf"ENVPORT_WS_IMPL={value!r} .*use one of: envport, "):
        uvicorn_config(app, host="127.0.0.1", port=0, config=config)
    for name in (
        "envport",
        "websockets-sansio",
        "websockets-sansio-stock",
        "websockets",
        "wsproto",
    ):
        monkeypatch.setenv("ENVPORT_WS_IMPL", name)
        assert uvicorn_config(app, host="127.0.0.1", port=0, config=config).ws is not None


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    """A port found free for a server to bind later is never one the kernel may hand to
    an outgoing connection meanwhile (or to a connection to itself)."""
    import socket

    from envport.serving import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), (low, ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
