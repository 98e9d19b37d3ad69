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
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import uuid4

import anyio
import httpx
import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

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
    StreamAssembler,
    model_provider_error,
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
    UpstreamError,
    UpstreamTimeoutError,
)
from envport.gateway.upstream import (
    RETRY_STATUSES,
    Opened,
    PauseGate,
    RetryPolicy,
    UpstreamFailure,
    UpstreamPool,
)
from envport.trace.model import ErrorKind, Trace, TraceError
from envport.trace.store import AsyncTraceStore, TraceStore

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
        client: httpx.AsyncClient | None = None,
        timeout: httpx.Timeout | None = None,
        upstream_api_key: str | None = None,
        token_ttl_s: float | None = 24 * 3600.0,
        pause_wait_s: float = 600.0,
        finish_wait_s: float = 30.0,
        public_url: str | None = None,
        policy_version: int | str | None = None,
        keep_finished: int = 1024,
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
        self.policy = policy or GatewayPolicy()
        self.gate = PauseGate(policy_version)
        self.token_ttl_s = token_ttl_s
        self.pause_wait_s = pause_wait_s
        self.finish_wait_s = finish_wait_s
        self.public_url = public_url
        self.keep_finished = keep_finished
        self.rollouts: dict[str, Rollout] = {}
        self._finished: OrderedDict[str, Trace] = OrderedDict()
        self.counters = {"calls": 0, "call_errors": 0, "denied": 0, "rollouts_finished": 0}

    @property
    def orchestrator_token(self) -> str:
        return self.tokens.orchestrator_token

    @property
    def policy_version(self) -> int | str | None:
        return self.gate.policy_version

    # --- rollouts ---------------------------------------------------------------------

    def create_rollout(self, info: RolloutInfo | None = None) -> RolloutGrant:
        info = info or RolloutInfo()
        rollout_id = info.rollout_id or uuid4().hex
        if rollout_id in self.rollouts or rollout_id in self._finished:
            raise RolloutConflictError(
                f"Rollout {rollout_id!r} already exists; pick another id or omit it.",
                error_code="rollout_exists",
            )
        ttl = info.ttl_s if info.ttl_s is not None else self.token_ttl_s
        token, grant = self.tokens.issue_agent(rollout_id, ttl)
        self.rollouts[rollout_id] = Rollout(rollout_id, info, grant.expires_at)
        return RolloutGrant(rollout_id, token, grant.expires_at)

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
        """Close the rollout: no more calls, wait for those in flight, store its trace."""
        rollout = self.rollout(rollout_id)
        if rollout.state is not RolloutState.LIVE:
            raise RolloutFinishedError(
                f"Rollout {rollout_id!r} is already finishing.", error_code="rollout_finished"
            )
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
        trace = rollout.to_trace(finish or FinishRequest())
        if self.store is not None:
            await self.store.put(trace)
        rollout.state = RolloutState.FINISHED
        del self.rollouts[rollout_id]
        self.pool.forget(rollout_id)
        self._finished[rollout_id] = trace
        while len(self._finished) > self.keep_finished:
            self._finished.popitem(last=False)
        self.counters["rollouts_finished"] += 1
        return trace

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
        await self.pool.aclose()

    # --- model calls ------------------------------------------------------------------

    def _rollout_for_call(self, request: Request, grant: Grant) -> Rollout:
        rollout_id = (
            request.path_params.get("rollout_id")
            or request.headers.get(ROLLOUT_HEADER)
            or grant.rollout_id
        )
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

    async def handle_call(self, request: Request, api: Api) -> Response:
        rollout: Rollout | None = None
        try:
            grant = self.tokens.check(token_from_headers(request.headers))
            rollout = self._rollout_for_call(request, grant)
            raw = await request.body()
            body = _json_object(raw)
        except GatewayError as exc:
            if rollout is None:
                self.counters["denied"] += 1
            else:
                rollout.errors.append(_harness_error(exc))
            return exc.response(api.dialect)
        return await self._forward(request, api, rollout, raw, body)

    async def _forward(
        self, request: Request, api: Api, rollout: Rollout, raw: bytes, body: dict[str, Any]
    ) -> Response:
        try:
            chat_body = api.to_chat(body) if api.to_chat is not None else body
        except (EnvportError, KeyError, TypeError, ValueError) as exc:
            error = BadRequestError(
                f"Cannot translate this {api.name} request: {exc}",
                param=getattr(exc, "param", None),
                error_code="untranslatable_request",
            )
            rollout.errors.append(_harness_error(error))
            return error.response(api.dialect)
        forwarded = self.policy.apply(chat_body, api.parse_as)
        stream = forwarded.get("stream") is True
        try:
            version = await self.gate.enter(self.pause_wait_s)
        except PausedError as exc:
            rollout.errors.append(
                TraceError(kind=ErrorKind.INFRASTRUCTURE, message=exc.message, where="gateway")
            )
            return exc.response(api.dialect)
        rollout.begin()
        call = _Call(
            gateway=self,
            rollout=rollout,
            api=api,
            record=CallRecord(
                api=api.name,
                agent_request=body,
                request=forwarded,
                policy_version=version,
                streamed=stream,
            ),
            digest=request_digest(raw),
            client_retry=_int_header(request.headers.get(SDK_RETRY_HEADER)),
        )
        payload = raw if forwarded is body else orjson.dumps(forwarded)
        try:
            opened = await self.pool.send(
                api.upstream_path, payload, rollout_id=rollout.rollout_id, stream=stream
            )
        except UpstreamFailure as failure:
            call.record.attempts = [a.to_json() for a in failure.attempts]
            call.fail(failure.error)
            call.done()
            return failure.error.response(api.dialect)
        except BaseException:
            call.done()
            raise
        call.record.endpoint = opened.upstream.url(api.upstream_path)
        call.record.attempts = [a.to_json() for a in opened.attempts]
        call.record.status = opened.response.status_code
        if stream and opened.response.status_code < 400:
            return _Relay(call, opened)
        try:
            await opened.response.aread()
        except httpx.HTTPError as exc:
            broken = UpstreamError(f"Upstream body could not be read: {exc}")
            call.fail(broken)
            call.done()
            return broken.response(api.dialect)
        finally:
            await opened.aclose()
        try:
            return call.answer(opened.response)
        finally:
            call.done()


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


def _upstream_message(content: bytes) -> str:
    try:
        body = orjson.loads(content)
        message = body["error"]["message"]
        if isinstance(message, str):
            return message
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    return content[:300].decode("utf-8", "replace")


@dataclasses.dataclass
class _Call:
    """One call in progress; :meth:`done` records it and releases its slots, once."""

    gateway: Gateway
    rollout: Rollout
    api: Api
    record: CallRecord
    digest: str
    client_retry: int
    _done: bool = False

    def fail(self, error: GatewayError, *, retryable: bool = True) -> None:
        if self.record.error is None:
            self.record.error = model_provider_error(
                error.message, type=type(error).__name__, retryable=retryable
            )

    def done(self) -> None:
        if self._done:
            return
        self._done = True
        gw = self.gateway
        try:
            call = self.record.build(self.api.parse_as)
            self.rollout.record(call, self.digest, self.client_retry)
            gw.counters["calls"] += 1
            if call.error is not None:
                gw.counters["call_errors"] += 1
        finally:
            self.rollout.end()
            gw.gate.leave()

    def answer(self, response: httpx.Response) -> Response:
        """The agent's answer to a non-streamed call; notes the outcome on the record."""
        status, content = response.status_code, response.content
        headers = {CALL_ID_HEADER: self.record.call_id}
        if status >= 400:
            message = f"Upstream answered HTTP {status}: {_upstream_message(content)}"
            self.record.error = model_provider_error(
                message, type="UpstreamStatusError", retryable=status in RETRY_STATUSES
            )
            if self.api.dialect == "openai" and not self.api.translated:
                if "retry-after" in response.headers:
                    headers["retry-after"] = response.headers["retry-after"]
                media = response.headers.get("content-type", "application/json")
                return Response(content, status, headers=headers, media_type=media)
            error = GatewayError(message)
            error.status = status
            return error.response(self.api.dialect)
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
        return Response(content, status, headers=headers, media_type="application/json")


# --- streams ------------------------------------------------------------------------------


class _StreamBroken(Exception):
    """The upstream stream failed after it started; told to the agent in-band."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(error.message)
        self.error = error


def _sse_data(event: bytes) -> bytes | None:
    """The ``data`` of one SSE event (lines joined), or None for a comment/keep-alive."""
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


class _Relay(Response):
    """Relays an upstream SSE stream to the agent event by event, recording as it goes.

    Each event is sent on as soon as its terminating blank line arrives; nothing waits
    for the rest of the stream. If upstream fails midway (dropped connection, read
    timeout, a chunk that is not JSON, an error event, no ``[DONE]``), the agent gets an
    error event and the stream ends; the call is recorded with the error. If the agent
    goes away, the upstream request is closed and the call recorded as cut by the client.
    """

    def __init__(self, call: _Call, opened: Opened) -> None:
        super().__init__(status_code=opened.response.status_code)
        # Exactly these headers (Response would declare "content-length: 0").
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (CALL_ID_HEADER.encode(), call.record.call_id.encode()),
        ]
        self.call = call
        self.opened = opened
        self.assembler = StreamAssembler(call.api.parse_as)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_gone = False
        try:
            start = {"status": self.status_code, "headers": self.raw_headers}
            await send({"type": "http.response.start", **start})
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    nonlocal client_gone
                    while True:
                        message: Message = await receive()
                        if message["type"] == "http.disconnect":
                            client_gone = True
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                await self._pump(send)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.opened.aclose()
            if client_gone and self.call.record.error is None:
                self.call.record.error = TraceError(
                    kind=ErrorKind.HARNESS,
                    message="The agent disconnected before the stream ended.",
                    where="gateway",
                )
            self._record()
        if not client_gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _record(self) -> None:
        """Record the call (once): before [DONE] is relayed, or when the stream fails."""
        if self.assembler.events:
            self.call.record.response = self.assembler.response()
        self.call.done()

    async def _pump(self, send: Send) -> None:
        api = self.call.api
        try:
            if api.stream_from_chat is None:
                async for raw, _ in self._events():
                    await send({"type": "http.response.body", "body": raw, "more_body": True})
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

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        async for _, chunk in self._events():
            if chunk is not None:
                yield chunk

    async def _events(self) -> AsyncIterator[tuple[bytes, dict[str, Any] | None]]:
        """Each upstream event as (its bytes, its JSON data or None); stops after [DONE]."""
        buf = b""
        url = self.opened.upstream.base_url
        try:
            async for piece in self.opened.response.aiter_bytes():
                buf += piece.replace(b"\r\n", b"\n") if b"\r" in piece else piece
                while (end := buf.find(b"\n\n")) >= 0:
                    raw, buf = buf[: end + 2], buf[end + 2 :]
                    data = _sse_data(raw)
                    if data is None:
                        yield raw, None
                        continue
                    if data.strip() == b"[DONE]":
                        self._record()
                        yield raw, None
                        return
                    yield raw, self._chunk(data)
        except httpx.TimeoutException as exc:
            raise _StreamBroken(
                UpstreamTimeoutError(f"Upstream {url} stalled mid-stream: {exc!r}")
            ) from exc
        except httpx.TransportError as exc:
            raise _StreamBroken(
                UpstreamError(f"Upstream {url} broke the stream midway: {exc}")
            ) from exc
        raise _StreamBroken(UpstreamError(f"Upstream {url} ended the stream before [DONE]."))

    def _chunk(self, data: bytes) -> dict[str, Any]:
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
        if self.assembler.feed(chunk):
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
        grant = self.gw.create_rollout(info)
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
    dialect: Dialect = "anthropic" if request.url.path.endswith("/messages") else "openai"
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


def create_gateway_app(gateway: Gateway) -> Starlette:
    """The ASGI app serving ``gateway``; ``app.state.gateway`` is the gateway."""
    messages, responses = _translated_apis()
    routes: list[Route] = []

    def call_route(api: Api) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await gateway.handle_call(request, api)

        return endpoint

    model_routes: list[tuple[str, Callable[[Request], Any]]] = [
        ("/v1/chat/completions", call_route(CHAT)),
        ("/v1/completions", call_route(COMPLETIONS)),
        ("/v1/messages", call_route(messages) if messages else _unavailable("messages")),
        ("/v1/responses", call_route(responses) if responses else _unavailable("responses")),
    ]
    for path, endpoint in model_routes:
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
            yield
        finally:
            await gateway.aclose()

    app = Starlette(
        routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=lifespan
    )
    app.state.gateway = gateway
    return app


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
    "RolloutGrant",
    "create_gateway_app",
]
