"""The gateway: an ASGI app that forwards an agent's model calls and records each one.

Routes (``{p}`` is empty or ``/rollouts/{rollout_id}``):

===============================  ==============  =======================================
route                            token           what
===============================  ==============  =======================================
POST {p}/v1/chat/completions     agent or orch.  forwarded; SSE streams relayed chunk by
POST {p}/v1/completions                          chunk as they arrive (no buffering)
POST {p}/v1/messages             agent or orch.  Anthropic Messages, via ``translate``
POST {p}/v1/responses            agent or orch.  OpenAI Responses, via ``translate``
POST /admin/rollouts             orchestrator    new rollout: id, agent token, base URLs
GET  /admin/rollouts             orchestrator    live rollouts, in brief
GET  /admin/rollouts/{id}        orchestrator    the calls recorded so far (or its trace)
POST /admin/rollouts/{id}/finish orchestrator    outcome + rewards; stored as a Trace
POST /admin/pause                orchestrator    close the door; optionally drain
POST /admin/resume               orchestrator    open it; stamp a new policy version
GET  /admin/stats                orchestrator    load, upstreams, counters
GET  /health                     none            liveness
===============================  ==============  =======================================

The rollout of a model call comes from the path, else the ``X-Envport-Rollout`` header,
else the agent token's own rollout. Errors are OpenAI-shaped, except on
``/v1/messages`` where they are Anthropic-shaped.

**Status codes.** 400 malformed request; 401/403 see :mod:`envport.gateway.auth`;
404 unknown rollout; 410 finished rollout; 503 paused past the wait. An upstream HTTP
error (after retries, when retryable) reaches the agent with upstream's own status and
body, as a direct call would; a failure with no HTTP answer is 502 (connect error,
dropped connection, invalid JSON) or 504 (timeout). Once a stream has started, a failure
can only be told in-band: the agent gets an SSE error event (which the openai SDK raises
as ``APIError``) and the stream ends. Every one of these failures on a known rollout is
recorded on it: upstream ones as the call's error with kind ``model_provider``, malformed
requests as rollout errors with kind ``harness``.

**The hot path.** A model call costs the agent only what it must: :class:`GatewayApp`
sends a ``POST`` to a model path straight to its endpoint (raw ASGI: no middleware, no
route scan, no ``Request``); the request is parsed once; the upstream hop goes through
a lean keep-alive client (:mod:`envport.gateway.http1`); a JSON answer is sent as
upstream's bytes, and a stream event by event as it arrives. The call is *noted* on its
rollout after the answer is sent, and the pydantic :class:`~envport.trace.ModelCall`
(choices, token ids, logprobs, usage) is built only when someone reads the rollout.
Traces are written by a background :class:`~envport.gateway.writer.TraceWriter`, never
by a model call. ``bench/gateway_overhead.py`` measures what this costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Sequence,
)
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envport.coro import as_coroutine, resume
from envport.errors import EnvportError
from envport.gateway.auth import Grant, TokenRegistry, token_from_headers
from envport.gateway.capture import (
    CallRecord,
    FinishRequest,
    GatewayPolicy,
    Rollout,
    RolloutInfo,
    RolloutState,
    RolloutView,
    has_output,
    model_provider_error,
    new_id,
    request_digest,
)
from envport.gateway.errors import (
    BadRequestError,
    Dialect,
    GatewayError,
    NotImplementedRouteError,
    PausedError,
    RolloutConflictError,
    RolloutFinishedError,
    RolloutNotFoundError,
    TraceNotStoredError,
    UpstreamError,
    UpstreamTimeoutError,
    openai_type,
)
from envport.gateway.front import CLIENT, SEND_NOWAIT
from envport.gateway.http1 import Http1Pool, HTTPError
from envport.gateway.http1 import Response as UpstreamResponse
from envport.gateway.registry import Registration, RolloutRegistry
from envport.gateway.upstream import (
    RETRY_STATUSES,
    STREAM_ERRORS,
    Opened,
    PauseGate,
    RetryPolicy,
    Timeout,
    UpstreamFailure,
    UpstreamPool,
)
from envport.gateway.writer import TraceWriter
from envport.trace.model import ErrorKind, Trace, TraceError, TraceStatus
from envport.trace.store import AsyncTraceStore, SQLiteTraceStore, TraceStore

_log = logging.getLogger("envport.gateway")

ROLLOUT_HEADER = "x-envport-rollout"
CALL_ID_HEADER = "x-envport-call-id"
SDK_RETRY_HEADER = "x-stainless-retry-count"


JSON = dict[str, Any]
StreamTranslator = Callable[[AsyncIterator[JSON], str, JSON], AsyncIterator[bytes]]

# --- the APIs served --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Api:
    """One client-facing API: where it goes upstream and how it is translated.

    Translators get the agent's request too (the Responses API echoes parts of it).
    """

    name: str  # recorded as ModelCall.api
    upstream_path: str
    parse_as: str  # the upstream API whose responses are recorded
    dialect: Dialect = "openai"
    to_chat: Callable[[JSON], JSON] | None = None
    from_chat: Callable[[JSON, str, JSON], JSON] | None = None
    stream_from_chat: StreamTranslator | None = None

    @property
    def translated(self) -> bool:
        return self.to_chat is not None

    @property
    def early(self) -> bool:
        """Whether its streams are passed through as upstream sends them (relayed from
        upstream's read callback, :class:`_Relay`)."""
        return self.stream_from_chat is None


CHAT = Api("chat.completions", "chat/completions", "chat.completions")
COMPLETIONS = Api("completions", "completions", "completions")


def _translated_apis() -> tuple[Api | None, Api | None]:
    """Messages and Responses, if ``envport.gateway.translate`` is there."""
    try:
        tr: Any = importlib.import_module("envport.gateway.translate")
    except ImportError:
        return None, None
    messages = Api(
        "messages",
        "chat/completions",
        "chat.completions",
        "anthropic",
        tr.anthropic_to_chat,
        lambda resp, model, req: tr.chat_to_anthropic(resp, model),
        lambda chunks, model, req: tr.chat_stream_to_anthropic(chunks, model),
    )
    responses = Api(
        "responses",
        "chat/completions",
        "chat.completions",
        "openai",
        tr.responses_to_chat,
        lambda resp, model, req: tr.chat_to_responses(resp, model, request=req),
        lambda chunks, model, req: tr.chat_stream_to_responses(chunks, model, request=req),
    )
    return messages, responses


# --- the gateway --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RolloutGrant:
    """A new rollout: its id, its agent's token, and when that token expires."""

    rollout_id: str
    token: str
    expires_at: float | None

    def urls(self, public_url: str) -> dict[str, Any]:
        root = f"{public_url.rstrip('/')}/rollouts/{self.rollout_id}"
        return {
            "rollout_id": self.rollout_id,
            "token": self.token,
            "expires_at": self.expires_at,
            "base_url": f"{root}/v1",
            "anthropic_base_url": root,
            "env": {
                "OPENAI_BASE_URL": f"{root}/v1",
                "OPENAI_API_KEY": self.token,
                "ANTHROPIC_BASE_URL": root,
                "ANTHROPIC_API_KEY": self.token,
            },
        }


class Gateway:
    """Rollouts, tokens, upstreams and the pause gate; :func:`create_gateway_app` serves it.

    >>> gw = Gateway(["http://127.0.0.1:8000/v1"], store=SQLiteTraceStore("t.db"))  # doctest: +SKIP
    >>> grant = gw.create_rollout(RolloutInfo(task_id="t1"))
    >>> # … the agent calls {public_url}/rollouts/{grant.rollout_id}/v1 with grant.token …
    >>> trace = await gw.finish_rollout(grant.rollout_id, FinishRequest(reward=1.0))
    """

    def __init__(
        self,
        upstreams: Sequence[str] | UpstreamPool,
        *,
        orchestrator_token: str | None = None,
        store: TraceStore | AsyncTraceStore | None = None,
        policy: GatewayPolicy | None = None,
        retry: RetryPolicy | None = None,
        client: Http1Pool | None = None,
        timeout: Timeout | None = None,
        upstream_api_key: str | None = None,
        token_ttl_s: float | None = 24 * 3600.0,
        pause_wait_s: float = 600.0,
        finish_wait_s: float = 30.0,
        public_url: str | None = None,
        policy_version: int | str | None = None,
        keep_finished: int = 1024,
        expiry_check_s: float = 1.0,
    ) -> None:
        if isinstance(upstreams, UpstreamPool):
            self.pool = upstreams
        else:
            self.pool = UpstreamPool(
                upstreams, retry=retry, client=client, timeout=timeout, api_key=upstream_api_key
            )
        self.tokens = TokenRegistry(orchestrator_token)
        if store is None or isinstance(store, AsyncTraceStore):
            self.store = store
        else:
            self.store = AsyncTraceStore(store)
        self.registry: RolloutRegistry | None = None
        backing = self.store.store if self.store is not None else None
        if isinstance(backing, SQLiteTraceStore) and backing.path != ":memory:":
            self.registry = RolloutRegistry(backing.path)
        self.writer: TraceWriter | None = None
        if self.store is not None:
            # A finished rollout's registration goes once its trace is stored, in the
            # writer's thread (one transaction per batch), not on the event loop.
            after = self._unregister if self.registry is not None else None
            self.writer = TraceWriter(self.store.store, after_write=after)
        self.policy = policy or GatewayPolicy()
        self.gate = PauseGate(policy_version)
        self.token_ttl_s = token_ttl_s
        self.pause_wait_s = pause_wait_s
        self.finish_wait_s = finish_wait_s
        self.public_url = public_url
        self.keep_finished = keep_finished
        self.expiry_check_s = expiry_check_s
        self._next_expiry = math.inf  # the earliest expiry of a live rollout (time.time())
        self.rollouts: dict[str, Rollout] = {}
        # Finished rollouts (their ids answer 410). Their traces are kept here only when
        # there is no store; with one they are read back from it: thousands of traces
        # held in memory would make every full garbage collection pause the event loop
        # for 100+ ms (measured with streams carrying logprobs).
        self._finished: OrderedDict[str, Trace | None] = OrderedDict()
        self.counters = {"calls": 0, "call_errors": 0, "denied": 0, "rollouts_finished": 0}
        self.restored = self._restore_rollouts()

    def _restore_rollouts(self) -> int:
        """Take back the live rollouts a previous gateway on the same file registered."""
        if self.registry is None:
            return 0
        registrations = self.registry.live()
        for reg in registrations:
            info = RolloutInfo.model_validate_json(reg.info_json)
            self.tokens.restore_agent(reg.rollout_id, reg.token_digest, reg.expires_at)
            rollout = Rollout(reg.rollout_id, info, reg.expires_at)
            rollout.created_at = datetime.fromtimestamp(reg.created_at, UTC)
            rollout.errors.append(
                TraceError(
                    kind=ErrorKind.INFRASTRUCTURE,
                    message="The gateway restarted while this rollout was live; the model "
                    f"calls recorded before {datetime.now(UTC).isoformat()} were lost.",
                    where="gateway",
                )
            )
            self.rollouts[reg.rollout_id] = rollout
            self._expires(reg.expires_at)
        return len(registrations)

    @property
    def orchestrator_token(self) -> str:
        return self.tokens.orchestrator_token

    @property
    def policy_version(self) -> int | str | None:
        return self.gate.policy_version

    # --- rollouts ---------------------------------------------------------------------

    def create_rollout(self, info: RolloutInfo | None = None) -> RolloutGrant:
        """A new live rollout (registered in the SQLite file, if any, before it returns)."""
        grant, registration = self._new_rollout(info)
        if registration is not None and self.registry is not None:
            try:
                self.registry.add(registration)
            except Exception:
                self._drop_new(grant.rollout_id)
                raise
        return grant

    async def open_rollout(self, info: RolloutInfo | None = None) -> RolloutGrant:
        """:meth:`create_rollout` for the event loop (``POST /admin/rollouts``): the
        registration is written in a worker thread, so the loop relaying streams never
        waits on SQLite (whose write may wait for the trace writer's transaction on the
        same file). If the caller is cancelled meanwhile, the write still completes and
        the rollout stays, as the file says."""
        grant, registration = self._new_rollout(info)
        registry = self.registry
        if registration is not None and registry is not None:
            try:
                await asyncio.shield(asyncio.to_thread(registry.add, registration))
            except asyncio.CancelledError:
                raise
            except Exception:
                self._drop_new(grant.rollout_id)
                raise
        return grant

    def _new_rollout(self, info: RolloutInfo | None) -> tuple[RolloutGrant, Registration | None]:
        """Take the id, issue the agent's token, hold the rollout; and what to register."""
        info = info or RolloutInfo()
        rollout_id = info.rollout_id or new_id()
        if rollout_id in self.rollouts or rollout_id in self._finished:
            raise RolloutConflictError(
                f"Rollout {rollout_id!r} already exists; pick another id or omit it.",
                error_code="rollout_exists",
            )
        ttl = info.ttl_s if info.ttl_s is not None else self.token_ttl_s
        token, grant = self.tokens.issue_agent(rollout_id, ttl)
        rollout = Rollout(rollout_id, info, grant.expires_at)
        self.rollouts[rollout_id] = rollout
        self._expires(grant.expires_at)
        registration = None
        if self.registry is not None:
            digest = self.tokens.digest_of(rollout_id)
            assert digest is not None
            registration = Registration(
                rollout_id,
                digest,
                grant.expires_at,
                rollout.created_at.timestamp(),
                info.model_dump_json(),
            )
        return RolloutGrant(rollout_id, token, grant.expires_at), registration

    def _expires(self, at: float | None) -> None:
        if at is not None and at < self._next_expiry:
            self._next_expiry = at

    async def expire_rollouts(self) -> int:
        """Finish every live rollout whose agent token expired before the orchestrator
        finished it (its agent can make no more calls); returns how many. Each trace is
        stored as ``failed`` (stop reason ``expired``, no reward) with an
        ``infrastructure`` error saying so, its calls kept. Checked every
        ``expiry_check_s`` by the app's lifespan; costs nothing until one is due."""
        now = time.time()
        if now < self._next_expiry:
            return 0
        self.tokens.prune()
        due: list[Rollout] = []
        upcoming = math.inf
        for rollout in self.rollouts.values():
            at = rollout.expires_at
            if at is None or rollout.state is not RolloutState.LIVE:
                continue
            if at <= now:
                due.append(rollout)
            elif at < upcoming:
                upcoming = at
        self._next_expiry = upcoming
        for rollout in due:
            expired = datetime.fromtimestamp(rollout.expires_at or now, UTC).isoformat()
            rollout.errors.append(
                TraceError(
                    kind=ErrorKind.INFRASTRUCTURE,
                    message=f"The rollout expired at {expired} (its agent token's TTL) "
                    "before the orchestrator finished it; the gateway finished it.",
                    where="gateway",
                    type="RolloutExpired",
                )
            )
        outcome = FinishRequest(status=TraceStatus.FAILED, stop_reason="expired")
        async with asyncio.TaskGroup() as group:  # each waits for its calls in flight
            for rollout in due:
                group.create_task(self._finish_expired(rollout.rollout_id, outcome))
        return len(due)

    async def _finish_expired(self, rollout_id: str, outcome: FinishRequest) -> None:
        try:
            await self.finish_rollout(rollout_id, outcome)
        except GatewayError as exc:  # not stored (kept: a finish stores it), or finished
            _log.warning("expired rollout %s: %s", rollout_id, exc.message)

    def _drop_new(self, rollout_id: str) -> None:
        """Undo :meth:`_new_rollout` (its registration could not be written)."""
        self.rollouts.pop(rollout_id, None)
        self.tokens.revoke_rollout(rollout_id)

    def rollout(self, rollout_id: str) -> Rollout:
        """A live rollout; 410 if it was finished, 404 if it never was."""
        rollout = self.rollouts.get(rollout_id)
        if rollout is not None:
            return rollout
        if rollout_id in self._finished:
            raise RolloutFinishedError(
                f"Rollout {rollout_id!r} is finished; it takes no more calls.",
                error_code="rollout_finished",
            )
        raise RolloutNotFoundError(
            f"No rollout {rollout_id!r} on this gateway ({len(self.rollouts)} live). "
            "Create one with POST /admin/rollouts.",
            error_code="rollout_not_found",
        )

    async def finish_rollout(self, rollout_id: str, finish: FinishRequest | None = None) -> Trace:
        """Close the rollout: no more calls, wait for those in flight, store its trace.

        If the store fails, the rollout stays closed to calls (``finishing``) with its
        trace kept, and :class:`TraceNotStoredError` (503) is raised: finishing it again
        stores it (the same ``trace_id``, with that finish's outcome) once the store is
        back."""
        rollout = self.rollout(rollout_id)
        kept = rollout.unstored
        if kept is not None:
            rollout.unstored = None  # this finish stores it; another one meanwhile is 410
        elif rollout.state is not RolloutState.LIVE:
            raise RolloutFinishedError(
                f"Rollout {rollout_id!r} is already finishing.", error_code="rollout_finished"
            )
        else:
            rollout.state = RolloutState.FINISHING
            self.tokens.revoke_rollout(rollout_id)
            if not await rollout.wait_idle(self.finish_wait_s):
                rollout.errors.append(
                    TraceError(
                        kind=ErrorKind.INFRASTRUCTURE,
                        message=f"{rollout.in_flight} model call(s) still in flight after "
                        f"{self.finish_wait_s:g} s when the rollout was finished; not recorded.",
                        where="gateway",
                    )
                )
            await rollout.build()  # a slice at a time: streams go on meanwhile
        trace = rollout.to_trace(finish or FinishRequest())
        if kept is not None:
            trace.trace_id = kept.trace_id  # one trace, however many finishes it took
        if self.writer is not None:
            try:
                await self.writer.put(trace)  # stored, and unregistered (see _unregister)
            except Exception as exc:
                rollout.unstored = trace
                _log.error("the trace of rollout %s was not stored: %r", rollout_id, exc)
                raise TraceNotStoredError(
                    f"The trace of rollout {rollout_id!r} could not be stored ({exc}); it is "
                    "kept: finish the rollout again to store it.",
                    error_code="trace_not_stored",
                    retry_after_s=1.0,
                ) from exc
        self._finished_now(rollout, trace)
        return trace

    def _finished_now(self, rollout: Rollout, trace: Trace) -> None:
        """``rollout``'s trace is stored (or there is no store): it is finished."""
        rollout.state = RolloutState.FINISHED
        self.rollouts.pop(rollout.rollout_id, None)
        self.pool.forget(rollout.rollout_id)
        self._finished[rollout.rollout_id] = trace if self.store is None else None
        while len(self._finished) > self.keep_finished:
            self._finished.popitem(last=False)
        self.counters["rollouts_finished"] += 1

    async def _store_kept(self, rollout: Rollout) -> None:
        """Store the trace a failed store left on ``rollout``, as its finish built it."""
        assert self.writer is not None
        assert rollout.unstored is not None
        try:
            await self.writer.put(rollout.unstored)
        except Exception as exc:
            _log.error(
                "the trace of rollout %s could not be stored at shutdown either; lost: %r",
                rollout.rollout_id,
                exc,
            )
            return
        trace, rollout.unstored = rollout.unstored, None
        self._finished_now(rollout, trace)

    def _unregister(self, traces: list[Trace]) -> None:
        """In the trace writer's thread, after ``traces`` were stored: their rollouts are
        no longer live, so a restarted gateway must not take them back."""
        registry = self.registry
        if registry is not None:
            registry.remove_many([t.rollout_id for t in traces])

    async def finished_trace(self, rollout_id: str) -> Trace | None:
        trace = self._finished.get(rollout_id)
        if trace is None and self.store is not None:
            found = await self.store.query(rollout_id=rollout_id, descending=True, limit=1)
            trace = found[0] if found else None
        return trace

    # --- pause / resume ---------------------------------------------------------------

    async def pause(self, *, drain_timeout_s: float | None = None) -> bool:
        """New calls wait from now on; returns once in-flight calls finished (``True``)
        or ``drain_timeout_s`` passed (``False``). ``drain_timeout_s=0``: do not wait."""
        self.gate.pause()
        if drain_timeout_s == 0:
            return self.gate.in_flight == 0
        return await self.gate.drain(drain_timeout_s)

    def resume(self, policy_version: int | str | None = None) -> None:
        """Let calls through again; calls from now on are stamped ``policy_version``."""
        self.gate.resume(policy_version)

    def stats(self) -> dict[str, Any]:
        return {
            "paused": self.gate.paused,
            "policy_version": self.gate.policy_version,
            "in_flight": self.gate.in_flight,
            "waiting": self.gate.waiting,
            "rollouts_live": len(self.rollouts),
            **self.counters,
            "upstreams": self.pool.stats(),
        }

    async def aclose(self) -> None:
        """Store the traces a failed store left kept (one more try each: the gateway is
        going, and they with it), write the traces still queued, then close the upstream
        connections."""
        try:
            if self.writer is not None:
                for rollout in list(self.rollouts.values()):
                    if rollout.unstored is not None:
                        await self._store_kept(rollout)
                await self.writer.aclose()
        finally:
            if self.registry is not None:
                self.registry.close()
                self.registry = None
            await self.pool.aclose()

    # --- model calls ------------------------------------------------------------------

    def _rollout_for_call(
        self, path_rollout: str | None, headers: dict[str, str], grant: Grant
    ) -> Rollout:
        rollout_id = path_rollout or headers.get(ROLLOUT_HEADER) or grant.rollout_id
        if not rollout_id:
            raise BadRequestError(
                "Which rollout? Call /rollouts/{rollout_id}/v1/..., or send the "
                "X-Envport-Rollout header.",
                error_code="missing_rollout",
            )
        grant.require_rollout(rollout_id)
        rollout = self.rollout(rollout_id)
        if rollout.state is not RolloutState.LIVE:
            raise RolloutFinishedError(
                f"Rollout {rollout_id!r} is finishing; it takes no more calls.",
                error_code="rollout_finished",
            )
        return rollout

    def _denied(self, exc: GatewayError, grant: Grant | None, scope: Scope) -> None:
        """A model call refused before it reached a rollout: counted, logged (never the
        token), and, when a valid agent token was refused (another rollout's path or
        header), recorded on its own rollout's trace: an agent probing other rollouts
        shows in its own."""
        self.counters["denied"] += 1
        own = self.rollouts.get(grant.rollout_id) if grant and grant.rollout_id else None
        _log.info(
            "model call refused: %s %s (%s%s)", scope["method"], scope["path"], exc.error_code,
            f", an agent token of rollout {own.rollout_id}" if own is not None else "",
        )  # fmt: skip
        if own is not None:
            own.errors.append(_harness_error(exc))

    async def serve_call(
        self, api: Api, path_rollout: str | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Serve one model call (raw ASGI): answer the agent, then record the call."""
        call: _Call | None = None
        try:
            outcome, call = await self.handle_call(api, path_rollout, scope, receive, send)
        except Exception as exc:  # a bug: log it, answer 500 in the API's shape
            _log.exception("model call on %s failed inside the gateway", scope["path"])
            internal = GatewayError(f"Internal gateway error: {type(exc).__name__}: {exc}")
            await internal.response(api.dialect)(scope, receive, send)
            return
        try:
            await outcome(scope, receive, send)
        finally:
            if call is not None:
                call.done()

    async def handle_call(
        self,
        api: Api,
        path_rollout: str | None,
        scope: Scope,
        receive: Receive,
        send: Send | None = None,
    ) -> tuple[ASGIApp, _Call | None]:
        """What to answer a model call, and the call to record once it is answered.

        With ``send`` (the agent's), a pass-through stream starts to be relayed from
        upstream's read callback the moment its head arrives (the answer's head and
        first events are sent before this returns): the rest of the answer follows when
        the returned app is run with the same ``send``."""
        headers = _call_headers(scope)
        rollout: Rollout | None = None
        grant: Grant | None = None
        try:
            grant = self.tokens.check(token_from_headers(headers))
            rollout = self._rollout_for_call(path_rollout, headers, grant)
            raw = await _read_body(receive)
            body = _json_object(raw)
        except GatewayError as exc:
            if rollout is None:
                self._denied(exc, grant, scope)
            else:
                rollout.errors.append(_harness_error(exc))
            return exc.response(api.dialect), None
        nowait = _nowait(scope, send)
        return await self._forward(api, rollout, headers, raw, body, send, nowait, scope, receive)

    async def _forward(
        self,
        api: Api,
        rollout: Rollout,
        headers: dict[str, str],
        raw: bytes,
        body: JSON,
        send: Send | None,
        nowait: SendNowait | None = None,
        scope: Scope | None = None,
        receive: Receive | None = None,
    ) -> tuple[ASGIApp, _Call | None]:
        try:
            chat_body = api.to_chat(body) if api.to_chat is not None else body
        except (EnvportError, KeyError, TypeError, ValueError) as exc:
            error = BadRequestError(
                f"Cannot translate this {api.name} request: {exc}",
                param=getattr(exc, "param", None),
                error_code="untranslatable_request",
            )
            rollout.errors.append(_harness_error(error))
            return error.response(api.dialect), None
        forwarded = self.policy.apply(chat_body, api.parse_as)
        stream = forwarded.get("stream") is True
        # Paused, a call may wait long: an agent that leaves meanwhile takes its call
        # out of the queue (forwarded after the resume, it would enter the trace unseen).
        gate_watch = _AgentWatch(scope, receive) if self.gate.paused and scope else None
        try:
            version = await self.gate.enter(self.pause_wait_s)
        except PausedError as exc:
            rollout.errors.append(
                TraceError(kind=ErrorKind.INFRASTRUCTURE, message=exc.message, where="gateway")
            )
            return exc.response(api.dialect), None
        except asyncio.CancelledError as exc:
            if gate_watch is None or not gate_watch.left(exc):
                raise
            rollout.errors.append(
                TraceError(
                    kind=ErrorKind.HARNESS,
                    message="The agent disconnected while its call waited for the paused "
                    "gateway to resume; the call was not forwarded.",
                    where="gateway",
                )
            )
            return _nothing, None
        finally:
            if gate_watch is not None:
                gate_watch.stop()
        if rollout.state is not RolloutState.LIVE:
            # finished while this call waited at the gate: its trace is closed (and
            # stored), its token revoked; forwarding it would record it nowhere
            self.gate.leave()
            finished = RolloutFinishedError(
                f"Rollout {rollout.rollout_id!r} was finished while this call waited for "
                "the gateway to resume; it takes no more calls.",
                error_code="rollout_finished",
            )
            return finished.response(api.dialect), None
        rollout.begin()
        t0, started = time.perf_counter(), time.time()
        call_id = new_id()
        payload = raw if forwarded is body else orjson.dumps(forwarded)
        # A pass-through stream is relayed from the moment upstream's head arrives, from
        # that read callback: a burst of answers does not queue behind the bookkeeping
        # of each one (done by this task afterwards) before its first token goes out.
        relay = _Relay(api, call_id, send, nowait) if stream else None
        early = relay if relay is not None and send is not None and api.early else None
        made: _Call | None = None

        def the_call() -> _Call:
            """The call and its record, made once upstream has the request (``sent``): on
            the way to the first token, the request is written before any bookkeeping."""
            nonlocal made
            if made is None:
                record = CallRecord(
                    api=api.name,
                    agent_request=body,
                    request=forwarded,
                    policy_version=version,
                    streamed=stream,
                    started_at=datetime.fromtimestamp(started, UTC),
                    t0=t0,
                    call_id=call_id,
                )
                client_retry = _int_header(headers.get(SDK_RETRY_HEADER))
                made = _Call(self, rollout, api, record, raw, client_retry)
                if relay is not None:
                    relay.call = made
            return made

        # A non-streamed call waits for upstream's whole answer: an agent leaving
        # meanwhile cancels it (a stream hears it in its relay, _Relay.__call__).
        watch = None if stream or scope is None else _AgentWatch(scope, receive)
        try:
            opened = await self.pool.send(
                api.upstream_path,
                payload,
                rollout_id=rollout.rollout_id,
                stream=stream,
                early=early,
                sent=the_call,
            )
        except UpstreamFailure as failure:
            call = the_call()
            call.record.attempts = [a.to_json() for a in failure.attempts]
            call.fail(failure.error)
            return failure.error.response(api.dialect), call
        except BaseException as exc:
            try:
                call = the_call()
            except BaseException:  # a bug in making it: still free the call's slots
                rollout.end()
                self.gate.leave()
                raise
            if watch is not None and watch.left(exc):  # upstream's request is closed
                call.record.error = TraceError(
                    kind=ErrorKind.HARNESS,
                    message="The agent disconnected before the answer came.",
                    where="gateway",
                )
                return _nothing, call
            call.done()
            raise
        finally:
            if watch is not None:
                watch.stop()
        call = the_call()
        call.opened = opened  # its endpoint and tries are noted on the record in done()
        if relay is not None and opened.status < 400:
            relay.bind(opened)
            return relay, call
        await opened.aclose()  # the body is read already
        return call.answer(opened), call


_CALL_ID = CALL_ID_HEADER.encode()
_WANTED_HEADERS = frozenset(
    {b"authorization", b"x-api-key", ROLLOUT_HEADER.encode(), SDK_RETRY_HEADER.encode()}
)


SendNowait = Callable[[Message], bool]


def _nowait(scope: Scope, send: Send | None) -> SendNowait | None:
    """The server's synchronous send (envport's own server offers one, ``SEND_NOWAIT``),
    if ``send`` is that server's own (no middleware wraps it)."""
    nowait = (scope.get("extensions") or {}).get(SEND_NOWAIT)
    owner = getattr(nowait, "__self__", None)
    if owner is None or owner is not getattr(send, "__self__", None):
        return None
    return nowait


def _call_headers(scope: Scope) -> dict[str, str]:
    """The few request headers a model call reads (names lower-case, as ASGI gives them)."""
    return {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in scope["headers"]
        if k in _WANTED_HEADERS
    }


async def _read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
    return b"".join(parts)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(
            f"The request body is not valid JSON: {exc}", error_code="invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.", error_code="invalid_json")
    return body


def _int_header(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def _harness_error(exc: GatewayError) -> TraceError:
    return TraceError(
        kind=ErrorKind.HARNESS,
        message=f"HTTP {exc.status}: {exc.message}",
        where="gateway",
        type=type(exc).__name__,
    )


_MAX_UPSTREAM_MESSAGE = 2000  # characters of upstream's error message kept


def _upstream_status_error(status: int, content: bytes) -> tuple[GatewayError, bool]:
    """Upstream's error answer as the agent's error (its status, and the message, type,
    param and code it gave, in OpenAI's ``{"error": {...}}`` or vLLM's flat shape), and
    whether its body is a JSON object (an OpenAI-style client reads it as it is)."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    fields: dict[str, Any] = {}
    message: Any = None
    if isinstance(body, dict):
        inner = body.get("error")
        fields = inner if isinstance(inner, dict) else body
        message = inner if isinstance(inner, str) else fields.get("message")
    if not isinstance(message, str) or not message:
        message = content[:300].decode("utf-8", "replace").strip() or "(no body)"
    elif len(message) > _MAX_UPSTREAM_MESSAGE:
        message = message[:_MAX_UPSTREAM_MESSAGE] + "..."
    param, code = fields.get("param"), fields.get("code")
    error = GatewayError(
        f"Upstream answered HTTP {status}: {message}",
        param=param if isinstance(param, str) else None,
        error_code=str(code) if type(code) in (str, int) else None,  # not a bool, a dict
    )
    error.status = status
    kind = fields.get("type")
    error.type = kind if isinstance(kind, str) and kind else openai_type(status)
    return error, isinstance(body, dict)


class _AgentWatch:
    """Hears the agent leave while its call's task waits (for upstream's answer), and
    cancels that task. On envport's server the exchange's ``on_lost`` hook does it (no
    task, no future, no coroutine per call: nothing happens unless the agent leaves);
    on another server a :class:`_Listener` on ``receive()``."""

    __slots__ = ("_client", "_heard", "_listener", "_task")

    def __init__(self, scope: Scope, receive: Receive | None) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._heard = False
        self._listener: _Listener | None = None
        self._client = (scope.get("extensions") or {}).get(CLIENT)
        if self._client is not None:
            self._client.on_lost = self._lost
        elif receive is not None:
            self._listener = _Listener(receive, self._message)

    def _lost(self) -> None:
        self._heard = True
        self._task.cancel()

    def _message(self, message: Message) -> None:
        if message["type"] == "http.disconnect":
            self._lost()

    def left(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the cancellation this watch made (then it is taken back)."""
        if self._heard and isinstance(exc, asyncio.CancelledError):
            self._task.uncancel()
            return True
        return False

    def stop(self) -> None:
        if self._client is not None:
            self._client.on_lost = None
        if self._listener is not None:
            self._listener.stop()


async def _nothing(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to an agent that left: none."""


class _Answer:
    """A whole JSON answer, sent as is (raw ASGI: two messages, nothing else)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, call_id: str) -> None:
        self.status = status
        self.body = body
        self.headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (_CALL_ID, call_id.encode()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


@dataclasses.dataclass
class _Call:
    """One call in progress; :meth:`done` records it and releases its slots, once."""

    gateway: Gateway
    rollout: Rollout
    api: Api
    record: CallRecord
    raw: bytes  # the request as the agent sent it (its digest is taken in done())
    client_retry: int
    opened: Opened | None = None  # upstream's answer, once it came
    _done: bool = False

    def fail(self, error: GatewayError, *, retryable: bool = True) -> None:
        if self.record.error is None:
            self.record.error = model_provider_error(
                error.message, type=type(error).__name__, retryable=retryable
            )

    def done(self) -> None:
        """Note the call on its rollout (built later, when read) and free its slots."""
        if self._done:
            return
        self._done = True
        gw = self.gateway
        opened, record = self.opened, self.record
        if opened is not None:  # noted now: nothing for the path to the first token
            record.endpoint = opened.upstream.url(self.api.upstream_path)
            record.attempts = [a.to_json() for a in opened.attempts]
            record.status = opened.status
        try:
            # The digest (to tell an SDK's retry of this request) is taken now, after the
            # answer: hashing a long prompt is no work for the path to the first token.
            digest = request_digest(self.raw)
            self.rollout.add(self.record, self.api.parse_as, digest, self.client_retry)
            gw.counters["calls"] += 1
            if self.record.error is not None:
                gw.counters["call_errors"] += 1
        finally:
            self.rollout.end()
            gw.gate.leave()

    def answer(self, opened: Opened) -> ASGIApp:
        """The agent's answer to a non-streamed call; notes the outcome on the record."""
        status, content = opened.status, opened.body
        if status >= 400:
            error, is_object = _upstream_status_error(status, content)
            self.record.error = model_provider_error(
                error.message, type="UpstreamStatusError", retryable=status in RETRY_STATUSES
            )
            headers = {CALL_ID_HEADER: self.record.call_id}
            if "retry-after" in opened.headers:
                headers["retry-after"] = opened.headers["retry-after"]
            if is_object and self.api.dialect == "openai" and not self.api.translated:
                return Response(content, status, headers=headers, media_type="application/json")
            # Not JSON (a proxy's HTML page), or another API's shape: the API's own.
            body = orjson.dumps(error.body(self.api.dialect))
            return Response(body, status, headers=headers, media_type="application/json")
        try:
            parsed = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            error = UpstreamError(
                f"Upstream answered with invalid JSON: {content[:200]!r}",
                error_code="upstream_invalid_json",
            )
            self.fail(error, retryable=False)
            return error.response(self.api.dialect)
        self.record.response = parsed
        if self.api.from_chat is not None:
            model = str(self.record.agent_request.get("model") or "")
            try:
                content = orjson.dumps(self.api.from_chat(parsed, model, self.record.agent_request))
            except (EnvportError, KeyError, TypeError, ValueError) as exc:
                error = UpstreamError(
                    f"The upstream answer cannot be expressed in the {self.api.name} API: {exc}",
                    error_code="untranslatable_response",
                )
                self.fail(error, retryable=False)
                return error.response(self.api.dialect)
        return _Answer(status, content, self.record.call_id)


# --- streams ------------------------------------------------------------------------------


class _StreamBroken(Exception):
    """The upstream stream failed after it started; told to the agent in-band."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(error.message)
        self.error = error
        self.before = b""  # the events of the same read before the failure (relayed first)
        self.chunks: list[dict[str, Any]] = []  # their chunks, for a translator


def _sse_data(event: bytes) -> bytes | None:
    """The ``data`` of one SSE event (lines joined), or None for a comment/keep-alive."""
    if event.startswith(b"data: ") and event.find(b"\n") == len(event) - 2:
        return event[6:-2]  # the usual case: one data line
    parts = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(parts) if parts else None


def _error_event(dialect: Dialect, message: str) -> bytes:
    if dialect == "anthropic":
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": None}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


_DRAINED: Message = {"type": "http.response.body", "body": b"", "more_body": True}


def _no_watch() -> None:
    pass


class _Listener:
    """``receive()`` awaited without a task of its own: the coroutine is stepped from
    the callback of the future it waits on (as a task would step it, less the task's
    creation, scheduling and cancellation), and ``heard`` gets the message it returns.
    :meth:`stop` closes it. Used to hear an agent leave while its stream is relayed."""

    __slots__ = ("_call", "_heard", "_waiting")

    def __init__(self, receive: Receive, heard: Callable[[Message], None]) -> None:
        call = receive()
        self._call: Coroutine[Any, Any, Message] = as_coroutine(call)
        self._heard = heard
        self._waiting: asyncio.Future[Any] | None = None
        self._step()

    def _step(self, _: object = None) -> None:
        self._waiting = None
        try:
            waiting = self._call.send(None)
        except StopIteration as done:
            self._heard(done.value)
            return
        except (Exception, asyncio.CancelledError):  # a failed receive(): nothing heard
            return
        if isinstance(waiting, asyncio.Future):
            waiting._asyncio_future_blocking = False  # taken, as a task takes it
            self._waiting = waiting
            waiting.add_done_callback(self._step)
        else:  # a bare yield (one turn of the loop)
            asyncio.get_running_loop().call_soon(self._step)

    def stop(self) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.remove_done_callback(self._step)
        self._call.close()


class _Relay:
    """Relays an upstream SSE stream to the agent event by event, recording as it goes.

    Each event is sent on, as the upstream's bytes, as soon as its terminating blank line
    arrives; nothing waits for the rest of the stream (all the events of one upstream
    read go in one write; ``[DONE]`` and the end of the answer in one). Each chunk is
    parsed to catch errors and the first token, and only its bytes are kept: parsing
    them again, all in one call, and folding them into the recorded response wait until
    the rollout is read. If upstream fails midway (dropped connection, read timeout, a
    chunk that is not JSON, an error event, no ``[DONE]``), the agent gets an error
    event and the stream ends; the call is recorded with the error. If the agent goes
    away (one waiting ``receive()`` hears it), the relay is cancelled, the upstream
    request closed and the call recorded as cut by the client. That ``receive()`` starts
    once the first events are relayed, or as soon as the relay has to wait for upstream:
    when the first events arrived with the answer's head, they go out first.

    A pass-through stream is relayed from upstream's read callback
    (:meth:`_tapped_relay`); a translated or compressed one by this task reading it
    piece by piece (:meth:`_relay`, :meth:`_chunks`). Made with the agent's ``send``,
    the relay is offered upstream's answer the moment its head arrives (:meth:`head`,
    an :class:`~envport.gateway.http1.EarlySink`): the agent's head and the first events
    go out from that read callback, before the call's task even wakes up; the task
    binds the relay to the answer (:meth:`bind`) and runs it as usual from there.
    """

    __slots__ = (
        "_begun",
        "_bound",
        "_buf",
        "_complete",
        "_ended",
        "_final",
        "_first",
        "_held",
        "_nowait",
        "_poke",
        "_relaying",
        "_send",
        "_stalled",
        "_tap_broken",
        "_tap_cut",
        "_tap_ended",
        "_tap_error",
        "_translating",
        "_watch",
        "call",
        "datas",
        "headers",
        "opened",
        "response",
        "status",
    )
    call: _Call  # set once upstream has the request (see Gateway._forward)
    opened: Opened  # set by bind()

    def __init__(
        self,
        api: Api,
        call_id: str,
        send: Send | None = None,
        nowait: SendNowait | None = None,
    ) -> None:
        self.status = 200
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (_CALL_ID, call_id.encode()),
        ]
        self.response: UpstreamResponse | None = None  # upstream's answer
        self._bound = False  # bind() was called: the call's task has the answer
        self._begun = False  # the agent's head went out from upstream's read callback
        self.datas: list[bytes] = []  # each chunk's JSON, as upstream sent it
        self._first = False
        self._complete = False  # [DONE] arrived
        self._translating = api.stream_from_chat is not None
        self._relaying = True  # a disconnect heard now cuts the stream
        self._ended = False  # the agent's answer was ended (with [DONE])
        self._watch: Callable[[], None] = _no_watch  # starts listening for a disconnect
        self._buf = b""  # the start of an event whose end has not arrived yet
        # the tapped relay (_tapped_relay): what its task is woken for
        self._send: Send | None = send
        self._nowait = nowait  # the server's synchronous send, when it has one
        self._poke: asyncio.Future[None] | None = None
        self._stalled: tuple[Coroutine[Any, Any, None], Any] | None = None  # a send waiting
        self._held = b""  # events read while a send waited, sent after it
        self._tap_broken: _StreamBroken | None = None
        self._tap_cut: HTTPError | None = None  # the tap's read failed
        self._tap_ended = False  # the body ended (maybe before [DONE])
        self._tap_error: BaseException | None = None
        self._final = b""  # the events up to [DONE], for the task to send

    def bind(self, opened: Opened) -> None:
        """The call's task has upstream's answer (the one :meth:`head` took, if any)."""
        self.opened = opened
        self.response = opened.response
        self.status = opened.status
        self._bound = True

    def head(self, response: UpstreamResponse) -> bool:
        """Upstream's answer arrived (called from its read callback): take a success
        that can be tapped, and send the agent's head now; its events follow from
        :meth:`piece`, as they arrive."""
        if self._send is None or not 200 <= response.status < 300 or not response.tappable():
            return False
        self.response = response
        self.status = response.status
        self._poke = response.loop.create_future()
        self._begun = True
        self._push(self._start())
        return True

    def _start(self) -> Message:
        """The agent's ``http.response.start``."""
        return {"type": "http.response.start", "status": self.status, "headers": self.headers}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task(self.opened.response.loop)
        assert task is not None
        client_gone = False

        def heard(message: Message) -> None:
            nonlocal client_gone
            if message["type"] == "http.disconnect" and self._relaying:
                client_gone = True
                task.cancel()

        listener: _Listener | None = None

        def watch() -> None:
            nonlocal listener
            if listener is None:
                listener = _Listener(receive, heard)

        self._watch = watch
        relayed = False  # to its end, or to an error event: no exception escaped
        try:
            if not self._begun:
                await send(self._start())
            await self._pump(send)
            self._relaying = False
            relayed = True
        except asyncio.CancelledError:
            self._relaying = False
            if not client_gone:
                raise
            task.uncancel()
        finally:
            self._relaying = False
            self._watch = _no_watch
            if listener is not None:
                listener.stop()
            if client_gone or not self._complete or not relayed:
                await self.opened.aclose()
            if client_gone and self.call.record.error is None:
                self.call.record.error = TraceError(
                    kind=ErrorKind.HARNESS,
                    message="The agent disconnected before the stream ended.",
                    where="gateway",
                )
            self._record()
        try:
            if not client_gone and not self._ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # After [DONE] and the agent's answer is complete: read the end of upstream's
            # body so its connection is reused (a new connection per stream costs more).
            await self.opened.finish()

    def _record(self) -> None:
        """Record the call (once): before [DONE] is relayed, or when the stream fails."""
        if self.datas:
            self.call.record.raw_chunks = self.datas
        self.call.done()

    async def _pump(self, send: Send) -> None:
        api = self.call.api
        try:
            if api.stream_from_chat is None:
                if not await self._tapped_relay(send):
                    await self._relay(send)
            else:
                request = self.call.record.agent_request
                model = str(request.get("model") or "")
                async for out in api.stream_from_chat(self._chunks(), model, request):
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except _StreamBroken as exc:
            self.call.fail(exc.error)
            self._record()
            if api.stream_from_chat is None:  # translators send their own error event
                event = _error_event(api.dialect, exc.error.message)
                await send({"type": "http.response.body", "body": event, "more_body": True})

    async def _relay(self, send: Send) -> None:
        """The pass-through relay: each upstream read's complete events, sent on as one
        write (no generator between the read and the write: one hop less for every piece
        of every stream)."""
        pieces = self._pieces()
        try:
            while True:
                try:
                    got = await self._read(pieces)
                except _StreamBroken as exc:
                    if exc.before:  # pass on the events before the bad one
                        await send(
                            {"type": "http.response.body", "body": exc.before, "more_body": True}
                        )
                    raise
                events = got[0]
                if self._complete:  # [DONE] ends the agent's answer too: one write
                    self._relaying = False
                    self._ended = True
                    await send({"type": "http.response.body", "body": events})
                    return
                if events:
                    await send({"type": "http.response.body", "body": events, "more_body": True})
                self._watch()  # the first events are relayed (or a wait): hear a disconnect
        finally:
            await pieces.aclose()

    async def _tapped_relay(self, send: Send) -> bool:
        """The pass-through relay, run from upstream's read callback (the response is
        tapped, :meth:`Response.tap`): each read's events are checked and written to the
        agent right there (:meth:`piece`), with no task woken per read. This task only
        waits, and steps in for what is not routine: a write that has to wait for the
        agent to read (upstream is not read meanwhile), a broken stream, the end. False
        (nothing done) when the body cannot be tapped (then :meth:`_relay` reads it)."""
        response = self.opened.response
        loop = response.loop
        self._send = send
        if self._begun:  # tapped when the head arrived (head()): maybe woken already
            poke = self._poke
            assert poke is not None
        else:
            poke = self._poke = loop.create_future()
            if not response.tap(self):  # the events that came with the head are relayed
                return False
        try:
            while True:
                if not poke.done():
                    self._watch()  # the first events are relayed: hear a disconnect
                    await poke
                poke = self._poke = loop.create_future()
                if self._stalled is not None:
                    call, pending = self._stalled
                    await resume(call, pending)  # what is read meanwhile is held behind it
                    self._stalled = None
                    held, self._held = self._held, b""
                    if held:
                        await send({"type": "http.response.body", "body": held, "more_body": True})
                    response.resume()
                if self._tap_error is not None:
                    raise self._tap_error
                if self._tap_broken is None and not self._complete:
                    if self._tap_cut is not None:
                        self._tap_broken = self._broken(self._tap_cut)
                    elif self._tap_ended:
                        self._tap_broken = self._ended_early()
                broken = self._tap_broken
                if broken is not None:
                    if broken.before:  # pass on the events before the bad one
                        await send(
                            {"type": "http.response.body", "body": broken.before, "more_body": True}
                        )
                    raise broken
                if self._complete:
                    # [DONE] ends the agent's answer too (one write), sent from this task
                    # like the end of any answer: its cleanup follows at once, before
                    # the agent, told it is done, sends its next request.
                    self._relaying = False
                    self._ended = True
                    self._record()  # before the agent hears [DONE]
                    await send({"type": "http.response.body", "body": self._final})
                    return True
        finally:
            response.untap()
            if self._stalled is not None:
                self._stalled[0].close()
                self._stalled = None

    def _wake(self) -> None:
        poke = self._poke
        if poke is not None and not poke.done():
            poke.set_result(None)

    def _push(self, message: Message) -> None:
        """Send ``message`` to the agent from a callback: the send runs up to its end,
        which it normally reaches at once; one that has to wait (the agent's socket is
        full) is finished by the relay's task, and upstream is not read until it is
        (events read meanwhile wait behind it)."""
        assert self._send is not None
        assert self.response is not None
        if self._stalled is not None:
            self._held += message["body"]
            self.response.pause()  # (it may have been untapped when that send stalled)
            return
        nowait = self._nowait
        if nowait is not None:  # no coroutine per message
            try:
                full = nowait(message)
            except BaseException as exc:
                self._failed(exc)
                return
            if not full:
                return
            message = _DRAINED  # written; the task waits for the socket to drain
        sent = self._send(message)
        call = as_coroutine(sent)
        try:
            pending = call.send(None)
        except StopIteration:
            return
        except BaseException as exc:
            self._failed(exc)
            return
        self.response.pause()
        self._stalled = (call, pending)
        self._wake()

    def _failed(self, exc: BaseException) -> None:
        """A broken stream, or a bug, met in a read callback: the tap ends and the task
        is woken to end the stream (a bug is raised there, where it belongs)."""
        assert self.response is not None
        if isinstance(exc, _StreamBroken):
            self._tap_broken = exc
        else:
            self._tap_error = exc
        self.response.untap()
        self._wake()

    # BodySink: called from upstream's read callback while tapped

    def piece(self, data: bytes) -> None:
        if self._complete or self._tap_broken is not None or self._tap_error is not None:
            return
        try:
            events, _ = self._take(data)
        except BaseException as exc:
            self._failed(exc)
            return
        if self._complete:  # the task sends [DONE] with the end of the agent's answer
            self._final = events
            self._wake()
        elif events:
            self._push({"type": "http.response.body", "body": events, "more_body": True})

    def end(self) -> None:
        self._tap_ended = True  # before [DONE]: told by the task (it knows the upstream)
        self._wake()

    def fail(self, exc: HTTPError) -> None:
        if self._tap_cut is None:
            self._tap_cut = exc
        self._wake()

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The chunks of the stream, checked, for a translator; stops after [DONE].
        Chunks before a bad one are passed on before it fails."""
        pieces = self._pieces()
        try:
            while True:
                try:
                    _, chunks = await self._read(pieces)
                except _StreamBroken as exc:
                    for chunk in exc.chunks:
                        yield chunk
                    raise
                for chunk in chunks:
                    yield chunk
                if self._complete:
                    return
                self._watch()  # the first events are relayed (or a wait): hear a disconnect
        finally:
            await pieces.aclose()

    def _pieces(self) -> AsyncGenerator[bytes, None]:
        """Upstream's body, a read at a time; if the first must be waited for, a
        disconnect is listened for from now on."""
        if not self.opened.ready():
            self._watch()
        return self.opened.chunks()

    async def _read(
        self, pieces: AsyncGenerator[bytes, None]
    ) -> tuple[bytes, list[dict[str, Any]]]:
        """The complete events of the next read (see :meth:`_take`); a failed read, or
        the body's end before [DONE], raises :class:`_StreamBroken`."""
        try:
            piece = await anext(pieces)
        except StopAsyncIteration:
            raise self._ended_early() from None
        except STREAM_ERRORS as exc:
            raise self._broken(exc) from exc
        return self._take(piece)

    def _take(self, piece: bytes) -> tuple[bytes, list[dict[str, Any]]]:
        """The complete events of what arrived (``piece`` and what was left over from
        the last read), as (their bytes, their chunks), each chunk checked and kept for
        the record. At ``[DONE]`` the call is recorded and the events end with it. A bad
        event raises :class:`_StreamBroken` carrying the events before it.

        The chunks (parsed) are given only to a translator; a pass-through relay gets an
        empty list, and each chunk's bytes are kept for the record instead."""
        buf = self._buf
        if buf:
            piece = buf + piece
        if b"\r" in piece:  # CRLF line ends (valid SSE), made LF over the joined bytes: a
            # CRLF split between two reads is one (a trailing CR waits in the leftover)
            piece = piece.replace(b"\r\n", b"\n")
        if piece.endswith(b"\n\n"):
            events = piece  # the usual read: whole events, nothing left over
            if buf:
                self._buf = b""
        else:
            last = piece.rfind(b"\n\n")
            if last < 0:
                self._buf = piece
                return b"", []
            events, self._buf = piece[: last + 2], piece[last + 2 :]
        chunks: list[dict[str, Any]] = []
        start = good = 0
        try:
            while start < len(events):
                good = start  # the events before this one are fine
                end = events.find(b"\n\n", start) + 2
                data = _sse_data(events[start:end])
                start = end
                if data is None:
                    continue
                if data[-1:] != b"}" and data.strip() == b"[DONE]":
                    self._complete = True
                    if self._bound:  # else the task records it before [DONE] goes out
                        self._record()
                    return events[:end], chunks
                chunk = self._check(data)
                if self._translating:
                    chunks.append(chunk)
        except _StreamBroken as exc:
            exc.before, exc.chunks = events[:good], chunks
            raise
        return events, chunks

    def _broken(self, exc: BaseException) -> _StreamBroken:
        """A failed read of the upstream stream, as told to the agent."""
        url = self.opened.upstream.base_url
        if isinstance(exc, TimeoutError):
            return _StreamBroken(
                UpstreamTimeoutError(f"Upstream {url} stalled mid-stream: {exc!r}")
            )
        return _StreamBroken(UpstreamError(f"Upstream {url} broke the stream midway: {exc!r}"))

    def _ended_early(self) -> _StreamBroken:
        url = self.opened.upstream.base_url
        return _StreamBroken(UpstreamError(f"Upstream {url} ended the stream before [DONE]."))

    def _check(self, data: bytes) -> dict[str, Any]:
        """Parse one chunk: it must be a JSON object and no error; keep its bytes (the
        parsed chunk is dropped at once unless a translator takes it: objects that live
        on until the record is built cost the garbage collector on every later call)."""
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            raise _StreamBroken(
                UpstreamError(f"Upstream sent a stream chunk that is not JSON: {data[:200]!r}")
            )
        if chunk.get("error"):
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise _StreamBroken(UpstreamError(f"Upstream reported an error mid-stream: {message}"))
        self.datas.append(data)
        if not self._first and has_output(chunk):
            self._first = True
            self.call.record.mark_first_token()
        return chunk


# --- admin routes -----------------------------------------------------------------------


_M = TypeVar("_M", bound=BaseModel)


class _PauseRequest(BaseModel):
    drain: bool = True
    timeout_s: float | None = 60.0


class _ResumeRequest(BaseModel):
    policy_version: int | str | None = None


async def _optional_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return _json_object(raw) if raw.strip() else {}


def _validated(model: type[_M], data: dict[str, Any]) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise BadRequestError(
            f"{param}: {first['msg']}", param=param, error_code="invalid_value"
        ) from exc


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status, media_type="application/json")


class _Admin:
    """The orchestrator's routes; each checks the orchestrator token first."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def _orchestrator(self, request: Request, what: str) -> None:
        try:
            grant = self.gw.tokens.check(token_from_headers(request.headers))
            grant.require_orchestrator(what)
        except GatewayError:
            self.gw.counters["denied"] += 1
            raise

    async def create_rollout(self, request: Request) -> Response:
        self._orchestrator(request, "Creating a rollout")
        info = _validated(RolloutInfo, await _optional_body(request))
        grant = await self.gw.open_rollout(info)
        public = self.gw.public_url or str(request.base_url)
        return JSONResponse(grant.urls(public), status_code=201)

    async def list_rollouts(self, request: Request) -> Response:
        self._orchestrator(request, "Listing rollouts")
        rows = [
            {
                "rollout_id": r.rollout_id,
                "state": r.state.value,
                "model_calls": len(r.calls),
                "in_flight": r.in_flight,
                "task_id": r.info.task_id,
            }
            for r in self.gw.rollouts.values()
        ]
        return JSONResponse({"rollouts": rows})

    async def get_rollout(self, request: Request) -> Response:
        self._orchestrator(request, "Reading a rollout")
        rollout_id = request.path_params["rollout_id"]
        live = self.gw.rollouts.get(rollout_id)
        if live is not None:
            assigned = self.gw.pool.assigned(rollout_id)
            await live.build()  # a slice at a time: streams go on meanwhile
            return _json(live.view(assigned.base_url if assigned else None))
        trace = await self.gw.finished_trace(rollout_id)
        if trace is None:
            self.gw.rollout(rollout_id)  # raises the 404 that lists what to do
            raise AssertionError("unreachable")
        view = RolloutView(
            rollout_id=rollout_id,
            state=RolloutState.FINISHED,
            created_at=trace.started_at or trace.created_at,
            expires_at=None,
            in_flight=0,
            upstream=None,
            info=RolloutInfo(task_id=trace.task_id, run_id=trace.run_id, group_id=trace.group_id),
            model_calls=trace.model_calls,
            errors=trace.errors,
            trace_id=trace.trace_id,
        )
        return _json(view)

    async def finish_rollout(self, request: Request) -> Response:
        self._orchestrator(request, "Finishing a rollout")
        finish = _validated(FinishRequest, await _optional_body(request))
        trace = await self.gw.finish_rollout(request.path_params["rollout_id"], finish)
        return JSONResponse(
            {
                "rollout_id": trace.rollout_id,
                "trace_id": trace.trace_id,
                "status": trace.status.value,
                "reward": trace.reward,
                "model_calls": len(trace.model_calls),
                "stored": self.gw.store is not None,
            }
        )

    async def pause(self, request: Request) -> Response:
        self._orchestrator(request, "Pausing the gateway")
        req = _validated(_PauseRequest, await _optional_body(request))
        drained = await self.gw.pause(drain_timeout_s=req.timeout_s if req.drain else 0)
        return JSONResponse(
            {"paused": True, "drained": drained, "in_flight": self.gw.gate.in_flight}
        )

    async def resume(self, request: Request) -> Response:
        self._orchestrator(request, "Resuming the gateway")
        req = _validated(_ResumeRequest, await _optional_body(request))
        self.gw.resume(req.policy_version)
        return JSONResponse({"paused": False, "policy_version": self.gw.policy_version})

    async def stats(self, request: Request) -> Response:
        self._orchestrator(request, "Reading the stats")
        return JSONResponse(self.gw.stats())


def _admin_route(path: str, handler: Callable[[Request], Any], methods: list[str]) -> Route:
    async def endpoint(request: Request) -> Response:
        try:
            response: Response = await handler(request)
        except GatewayError as exc:
            return exc.response("openai")
        return response

    return Route(path, endpoint, methods=methods)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error = GatewayError(message, error_code="not_found" if exc.status_code == 404 else None)
    error.status = exc.status_code
    error.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    # Anthropic's paths (/v1/messages/count_tokens, /v1/messages/batches) answered in
    # Anthropic's shape, so its SDK reads the refusal
    dialect: Dialect = "anthropic" if "/v1/messages" in request.url.path else "openai"
    return error.response(dialect)


def _unavailable(name: str) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        dialect: Dialect = "anthropic" if name == "messages" else "openai"
        return NotImplementedRouteError(
            f"The {name} API is not available on this gateway yet (no translator installed); "
            "use /v1/chat/completions.",
            error_code="not_implemented",
        ).response(dialect)

    return endpoint


class _ModelRoute:
    """The ASGI endpoint of one model API, on its plain and rollout-scoped paths."""

    def __init__(self, gateway: Gateway, api: Api) -> None:
        self.gateway = gateway
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rollout_id = scope.get("path_params", {}).get("rollout_id")
        await self.gateway.serve_call(self.api, rollout_id, scope, receive, send)


class GatewayApp(Starlette):
    """Starlette for the admin routes, with model calls dispatched before its routing.

    A ``POST`` to a model path goes straight to its :class:`_ModelRoute` (no middleware
    stack, no route scan, no ``Request``); the same endpoints are Starlette routes too,
    so anything else about those paths (a ``GET``: 405; a ``root_path``) is answered as
    before.
    """

    def __init__(self, model_routes: dict[str, _ModelRoute], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_routes = model_routes

    def _model_route(self, scope: Scope) -> tuple[_ModelRoute, str | None] | None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        path: str = scope["path"]
        if path.startswith("/rollouts/"):
            rollout_id, slash, rest = path[10:].partition("/")
            route = self.model_routes.get(slash + rest) if rollout_id else None
            return (route, rollout_id) if route is not None else None
        route = self.model_routes.get(path)
        return (route, None) if route is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hit = self._model_route(scope)
        if hit is None:
            await super().__call__(scope, receive, send)
            return
        route, rollout_id = hit
        await route.gateway.serve_call(route.api, rollout_id, scope, receive, send)


def create_gateway_app(gateway: Gateway) -> GatewayApp:
    """The ASGI app serving ``gateway``; ``app.state.gateway`` is the gateway."""
    messages, responses = _translated_apis()
    routes: list[Route] = []
    model_routes: dict[str, _ModelRoute] = {}
    for path, api in [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETIONS),
        ("/v1/messages", messages),
        ("/v1/responses", responses),
    ]:
        endpoint: Any
        if api is None:
            endpoint = _unavailable(path.rsplit("/", 1)[1])
        else:
            endpoint = model_routes[path] = _ModelRoute(gateway, api)
        routes.append(Route(path, endpoint, methods=["POST"]))
        routes.append(Route("/rollouts/{rollout_id}" + path, endpoint, methods=["POST"]))
    admin = _Admin(gateway)
    routes += [
        _admin_route("/admin/rollouts", admin.create_rollout, ["POST"]),
        _admin_route("/admin/rollouts", admin.list_rollouts, ["GET"]),
        _admin_route("/admin/rollouts/{rollout_id}", admin.get_rollout, ["GET"]),
        _admin_route("/admin/rollouts/{rollout_id}/finish", admin.finish_rollout, ["POST"]),
        _admin_route("/admin/pause", admin.pause, ["POST"]),
        _admin_route("/admin/resume", admin.resume, ["POST"]),
        _admin_route("/admin/stats", admin.stats, ["GET"]),
        Route("/health", _health(gateway), methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with asyncio.TaskGroup() as group:
                expiry = group.create_task(_expire_rollouts(gateway))
                try:
                    yield
                finally:
                    expiry.cancel()
        finally:
            await gateway.aclose()

    app = GatewayApp(
        model_routes,
        routes=routes,
        exception_handlers={HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app


async def _expire_rollouts(gateway: Gateway) -> None:
    """Every ``expiry_check_s``: finish the rollouts that expired (the app's lifespan
    owns this loop)."""
    while True:
        await asyncio.sleep(gateway.expiry_check_s)
        try:
            await gateway.expire_rollouts()
        except Exception:
            _log.exception("expiring rollouts failed")


def _health(gateway: Gateway) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "healthy",
                "paused": gateway.gate.paused,
                "policy_version": gateway.policy_version,
                "upstreams": len(gateway.pool.upstreams),
                "time": datetime.now(UTC).isoformat(),
            }
        )

    return endpoint


__all__ = [
    "CHAT",
    "COMPLETIONS",
    "Api",
    "Gateway",
    "GatewayApp",
    "RolloutGrant",
    "create_gateway_app",
]
