"""One environment's tools as a spec-compliant MCP server over Streamable HTTP.

Built on the official SDK (``mcp`` 2.x): a low-level :class:`mcp.server.lowlevel.Server`
answers ``initialize``, ``ping``, ``tools/list`` and ``tools/call``, and the SDK's
:class:`~mcp.server.streamable_http_manager.StreamableHTTPSessionManager` owns the
transport (``Mcp-Session-Id``, SSE or JSON responses, ``DELETE`` to end a session, idle
expiry). envport adds only the mapping from MCP sessions to envport sessions:

* **Own session.** An MCP session gets its own fresh envport :class:`~envport.session.Session`
  from the :class:`~envport.server.sessions.SessionManager` on its first ``tools/*``
  request (reset once), held attached so the envport reaper leaves it alone. It is
  closed, and its capacity slot freed, when the MCP session ends: a client ``DELETE``,
  the SDK's idle timeout (set to the server's ``idle_timeout_s``), or shutdown. The hook
  is the SDK's per-connection exit stack, so every way a session can end goes through
  the same code.
* **Session cap.** The SDK holds at most ``ServerConfig.mcp_max_sessions`` MCP sessions.
  A bare ``initialize`` costs a client nothing (no envport session until the first
  ``tools/*``) and would otherwise live ``idle_timeout_s``, so one client looping on it
  could fill the cap and lock every other agent out. At the cap, a new session therefore
  replaces the oldest one that has not yet had a ``tools/*`` request answered
  (:class:`_SessionManager`); sessions in use are never evicted, and only when every one
  is in use is a new one refused (503, the SDK's answer).
* **Shared session.** A request with header ``X-Envport-Session: <token>`` acts on that
  existing envport session instead (an agent using MCP on the environment a trainer
  drives over WebSocket). The token to give an agent is the session's tools-only one
  (``tools_token``): it calls tools here and nothing else; the control token the
  trainer holds works here too. The endpoint never closes a shared session.

* **Plain JSON-RPC.** A ``POST`` that accepts no event stream and names no MCP session
  is OpenEnv's way: one JSON-RPC request, one JSON answer
  (:func:`~envport.mcp.jsonrpc.handle_jsonrpc`, OpenEnv's result shapes), on the session
  the header names or on a fresh environment for that request alone.

Eras. ``ClientSession.initialize()`` (and ``Client(mode="legacy")``) speak the
handshake protocol, where an MCP session spans many requests. The 2026-07-28 protocol
has no sessions: a request pinned to it is its own connection, so without the header it
gets a one-request environment. Because envport environments are stateful, the endpoint
does not answer ``server/discover``; a ``Client(mode="auto")`` therefore falls back to
the handshake and gets a real session.

Mounting: ``.asgi`` is a plain ASGI callable object (not a function, so Starlette's
``Route`` passes requests through untouched). Route it exactly, so ``POST /mcp`` is
served without a trailing-slash redirect, and run the endpoint in the app's lifespan::

    endpoint = MCPEndpoint(manager, name="echo-v1")

    @asynccontextmanager
    async def lifespan(app):
        async with endpoint.running():
            yield

    app = Starlette(
        routes=[Route("/mcp", endpoint.asgi, methods=["GET", "POST", "DELETE"])],
        lifespan=lifespan,
    )

(``Mount("/mcp", app=endpoint.asgi)`` also works, but Starlette then answers ``POST
/mcp`` with a 307 redirect to ``/mcp/``.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import mcp_types as types
from mcp.server.auth.middleware.bearer_auth import AuthorizationContext
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER, StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from envport import __version__
from envport.errors import (
    CapacityError,
    EnvportError,
    ForbiddenError,
    SessionNotFoundError,
    ToolError,
)
from envport.mcp.jsonrpc import (
    SESSION_CLOSE,
    SESSION_CREATE,
    JsonRpcCode,
    handle_jsonrpc,
    jsonrpc_error,
)
from envport.mcp.results import ToolOutcome, call_tool
from envport.server.security import is_json_media_type
from envport.server.sessions import SessionManager
from envport.session import Session, SessionStatus

#: Request header naming an existing envport session: its tools-only token (the one to
#: give an agent) or its control token.
SESSION_HEADER = "x-envport-session"

_log = logging.getLogger("envport.mcp")

_OWN = "envport.session"
_LOCK = "envport.session_lock"

Context = ServerRequestContext[Any, Any]


class MCPEndpoint:
    """Serves one environment's tools at ``/mcp``. See the module docstring."""

    def __init__(
        self,
        manager: SessionManager,
        *,
        name: str,
        security: TransportSecuritySettings | None = None,
    ) -> None:
        self.manager = manager
        self.name = name
        self.security = security
        self.server: Server[Any] = Server(
            name,
            version=__version__,
            instructions=f"Tools of the envport environment {name!r}.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        # Stateful environments need the handshake era; see the module docstring.
        self.server.add_request_handler("server/discover", types.RequestParams, _no_discover)
        self._sdk: _SessionManager | None = None
        # OpenEnv's plain-HTTP MCP sessions (openenv/session/create), by tools-only token
        self._openenv_sessions: dict[str, Session] = {}
        self.asgi = _EndpointApp(self)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the SDK's session manager; enter this in the app's lifespan.

        On exit every MCP session ends, which closes the envport sessions they own.
        May be entered again after it exits (each run gets a fresh SDK manager).
        """
        config = self.manager.config
        sdk = _SessionManager(
            app=self.server,
            security_settings=self.security,
            session_idle_timeout=config.idle_timeout_s,
            max_sessions=config.mcp_max_sessions,
        )
        async with sdk.run():
            self._sdk = sdk
            try:
                yield
            finally:
                self._sdk = None

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._sdk is None:
            response = JSONResponse(
                {"message": "The MCP endpoint is not running (enter MCPEndpoint.running())."},
                status_code=503,
            )
            await response(scope, receive, send)
            return
        if _plain_jsonrpc(scope):
            await self._plain(scope, receive, send)
            return
        await self._sdk.handle_request(scope, receive, send)

    async def _plain(self, scope: Scope, receive: Receive, send: Send) -> None:
        """OpenEnv's plain JSON-RPC ``POST /mcp`` (no handshake, a JSON answer): one
        request answered against the session ``X-Envport-Session`` names, or a fresh
        environment for this request alone (OpenEnv's stateless HTTP)."""
        request = Request(scope, receive)
        # The checks the SDK makes on its own requests: Host and Origin (DNS rebinding),
        # when configured; and a JSON body, which no web page can post without a CORS
        # preflight (a text/plain one it can).
        refusal = await TransportSecurityMiddleware(self.security).validate_request(request)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if not is_json_media_type(request.headers.get("content-type")):
            message = "Unsupported Media Type: the request body must be application/json."
            bad = jsonrpc_error(None, JsonRpcCode.INVALID_REQUEST, message)
            await JSONResponse(bad, status_code=415)(scope, receive, send)
            return
        body = await _body_within(request, self.manager.config.max_frame_bytes)
        if body is None:
            large = jsonrpc_error(None, JsonRpcCode.INVALID_REQUEST, "Request too large.")
            await JSONResponse(large, status_code=413)(scope, receive, send)
            return
        answer = await self._plain_answer(request.headers.get(SESSION_HEADER), body)
        await JSONResponse(answer)(scope, receive, send)

    async def _plain_answer(self, token: str | None, body: bytes) -> dict[str, Any]:
        parsed = _parse(body)
        request_id = parsed.get("id") if parsed is not None else None
        params = parsed.get("params") if parsed is not None else None
        params = params if isinstance(params, dict) else {}
        method = parsed.get("method") if parsed is not None else None
        try:
            if token:
                return await handle_jsonrpc(self.manager.for_tools(token), body)
            if parsed is not None and parsed.get("jsonrpc") == "2.0":
                if method == SESSION_CREATE:
                    return await self._openenv_create(request_id)
                if method == SESSION_CLOSE:
                    return await self._openenv_close(request_id, params.get("session_id"))
            named = params.get("session_id")
            if named is not None:  # OpenEnv's MCPToolClient, production mode
                session = self._openenv_session(named)
                if session is None:
                    code = JsonRpcCode.INVALID_PARAMS
                    return jsonrpc_error(request_id, code, f"Unknown session_id: {named}")
                if session.status is SessionStatus.POISONED and named in self._openenv_sessions:
                    await session.reset()  # a call timed out; MCP has no reset (as _session_for)
                return await handle_jsonrpc(session, body)
            session = await self.manager.create()
            try:
                await session.reset()
                return await handle_jsonrpc(session, body)
            finally:
                await self.manager.close(session)
        except EnvportError as exc:  # no such session, or none to be had
            code = JsonRpcCode.INTERNAL_ERROR
            return jsonrpc_error(request_id, code, exc.message, exc.to_wire())

    # --- OpenEnv's MCP sessions over plain HTTP ----------------------------------------

    async def _openenv_create(self, request_id: Any) -> dict[str, Any]:
        """``openenv/session/create``: a new envport session (reset once) whose
        ``session_id`` (its tools-only token) later requests name in their params."""
        for key in [k for k, s in self._openenv_sessions.items() if s.closed]:
            del self._openenv_sessions[key]  # reaped or shut down meanwhile
        try:
            session = await self.manager.create()
        except EnvportError as exc:  # capacity, or the environment cannot be built
            return jsonrpc_error(request_id, JsonRpcCode.SERVER_ERROR, exc.message, exc.to_wire())
        try:
            await session.reset()
        except BaseException as exc:
            await self.manager.close(session)
            if not isinstance(exc, EnvportError):
                raise
            return jsonrpc_error(request_id, JsonRpcCode.SERVER_ERROR, exc.message, exc.to_wire())
        self._openenv_sessions[session.tools_token] = session
        return {"jsonrpc": "2.0", "id": request_id, "result": {"session_id": session.tools_token}}

    async def _openenv_close(self, request_id: Any, named: Any) -> dict[str, Any]:
        """``openenv/session/close``: end a session ``openenv/session/create`` made."""
        if not isinstance(named, str) or not named:
            message = "Invalid params - 'session_id' is required"
            return jsonrpc_error(request_id, JsonRpcCode.INVALID_PARAMS, message)
        session = self._openenv_sessions.pop(named, None)
        if session is None or session.closed:
            if self._openenv_session(named) is not None:
                message = (
                    "That session was not created by openenv/session/create: close it with "
                    "its control token (DELETE /sessions, or its WebSocket's close frame)."
                )
                return jsonrpc_error(request_id, JsonRpcCode.INVALID_REQUEST, message)
            message = f"Unknown session_id: {named}"
            return jsonrpc_error(request_id, JsonRpcCode.INVALID_PARAMS, message)
        await self.manager.close(session)
        result = {"session_id": named, "closed": True}
        return {"jsonrpc": "2.0", "id": request_id, "result": result}

    def _openenv_session(self, named: Any) -> Session | None:
        """The live session a request's ``params.session_id`` names (a tools-only or
        control token, as the header takes), touched so it counts as in use."""
        if not isinstance(named, str) or not named:
            return None
        try:
            session = self.manager.for_tools(named)
        except EnvportError:
            return None
        session.touch()
        return session

    # --- MCP handlers ------------------------------------------------------------------

    async def _list_tools(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        session = await self._session_for(ctx)
        tools = [
            types.Tool(name=s.name, description=s.description, input_schema=s.input_schema)
            for s in session.env.tool_specs()
        ]
        return types.ListToolsResult(tools=tools)

    async def _call_tool(
        self, ctx: Context, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        session = await self._session_for(ctx)
        try:
            outcome = await call_tool(session, params.name, dict(params.arguments or {}))
        except ToolError as exc:  # unknown tool: a protocol error, as the MCP spec shows
            raise MCPError(types.INVALID_PARAMS, exc.message, exc.to_wire()) from exc
        except EnvportError as exc:
            raise MCPError(types.INTERNAL_ERROR, exc.message, exc.to_wire()) from exc
        return _result(outcome)

    # --- session mapping ---------------------------------------------------------------

    async def _session_for(self, ctx: Context) -> Session:
        session = await self._resolve(ctx)
        # In use: no longer one a flood of new sessions may evict (see _SessionManager).
        mcp_session_id = _header(ctx, MCP_SESSION_ID_HEADER)
        if mcp_session_id and self._sdk is not None:
            self._sdk.mark_in_use(mcp_session_id)
        return session

    async def _resolve(self, ctx: Context) -> Session:
        token = _header(ctx, SESSION_HEADER)
        if token:
            try:
                return self.manager.for_tools(token)
            except (SessionNotFoundError, ForbiddenError) as exc:
                raise MCPError(
                    types.INVALID_REQUEST, f"{SESSION_HEADER}: {exc.message}", exc.to_wire()
                ) from exc
        connection = _connection(ctx)
        lock = connection.state.setdefault(_LOCK, asyncio.Lock())
        async with lock:
            session: Session | None = connection.state.get(_OWN)
            if session is None:
                session = await self._open(connection)
            elif session.status is SessionStatus.POISONED:
                # A call timed out; nobody but this MCP session uses the environment,
                # and MCP has no reset, so start the fresh one the session offers.
                await self._guarded(session.reset())
            return session

    async def _open(self, connection: Connection) -> Session:
        try:
            session = await self.manager.create()
        except CapacityError as exc:
            raise MCPError(types.INTERNAL_ERROR, exc.message, exc.to_wire()) from exc
        try:
            await self._guarded(session.reset())
        except BaseException:
            await self.manager.close(session)
            raise
        session.attach()
        connection.exit_stack.push_async_callback(self._release, session)
        connection.state[_OWN] = session
        return session

    async def _release(self, session: Session) -> None:
        session.detach()
        await self.manager.close(session)

    @staticmethod
    async def _guarded(call: Awaitable[Any]) -> None:
        try:
            await call
        except EnvportError as exc:
            raise MCPError(types.INTERNAL_ERROR, exc.message, exc.to_wire()) from exc


class _SessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager, which at its session cap evicts the oldest MCP session
    that has not yet had a ``tools/*`` request answered instead of refusing the new one.

    Why: a session that only sent ``initialize`` holds no envport session, so nothing but
    this cap limits how many one client can open, and each lives ``idle_timeout_s``. The
    sessions in use are bounded by the envport sessions they hold (``max_sessions``), or
    need a session's token (``X-Envport-Session``); a bare ``initialize`` flood now only
    evicts its own kind. A real agent lists or calls tools right after ``initialize``, so
    only a flood of more than the cap in that moment could evict its session (it then
    gets 404, as after an idle expiry).

    Hooks: ``_admit_session`` (sync, under the SDK's session-creation lock) and
    ``_discard_session`` (every way a session ends), with ``_server_instances`` (insertion
    order: oldest first) -- private in ``mcp`` 2.3, so checked on construction.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("_admit_session", "_discard_session", "_server_instances"):
            if not hasattr(self, name):
                raise RuntimeError(
                    f"This mcp SDK's session manager has no {name}; envport needs mcp>=2.3,<3."
                )
        self._in_use: set[str] = set()

    def mark_in_use(self, session_id: str) -> None:
        if session_id in self._server_instances:  # not one already ended
            self._in_use.add(session_id)

    def _admit_session(
        self, requestor: AuthorizationContext | None
    ) -> StreamableHTTPServerTransport | None:
        if self.max_sessions is not None and len(self._server_instances) >= self.max_sessions:
            self._evict_unused()
        return super()._admit_session(requestor)

    def _evict_unused(self) -> None:
        """End the oldest session not in use, forgetting it at once (its ID answers 404
        from now) so the caller can admit a new one."""
        for session_id, transport in self._server_instances.items():
            scope = transport.idle_scope
            # No idle scope yet: its server task is starting (its opening request is
            # being served); the SDK discards it itself if that fails.
            if session_id not in self._in_use and scope is not None:
                break
        else:
            return
        del self._server_instances[session_id]
        self._session_owners.pop(session_id, None)
        # What the idle timeout does: the session's server task leaves its loop, closes
        # the connection (its exit stack) and terminates the transport.
        scope.cancel()
        _log.info("MCP session cap reached: evicted unused session %s", session_id)

    async def _discard_session(
        self, session_id: str, transport: StreamableHTTPServerTransport
    ) -> None:
        self._in_use.discard(session_id)
        await super()._discard_session(session_id, transport)


def _plain_jsonrpc(scope: Scope) -> bool:
    """A POST from a client that is no Streamable HTTP one: it does not accept an event
    stream and names no MCP session (OpenEnv's clients post JSON-RPC this way)."""
    if scope.get("method") != "POST":
        return False
    accept = b""
    for name, value in scope.get("headers") or ():
        if name == b"mcp-session-id":
            return False
        if name == b"accept":
            accept += value
    return b"text/event-stream" not in accept


async def _body_within(request: Request, limit: int) -> bytes | None:
    """The request's body, or ``None`` as soon as it is known to be over ``limit`` bytes:
    by its ``Content-Length``, or, for a chunked body, which has none, counted as it
    arrives (never more than ``limit`` and one chunk held)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _parse(body: bytes) -> dict[str, Any] | None:
    """The request object ``body`` holds, if it is one (else ``handle_jsonrpc`` says what
    is wrong with it)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # nested too deep: handle_jsonrpc says so
        return None
    return parsed if isinstance(parsed, dict) else None


class _EndpointApp:
    """The ASGI callable behind ``MCPEndpoint.asgi`` (an object, so ``Route`` keeps it raw)."""

    def __init__(self, endpoint: MCPEndpoint) -> None:
        self._endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._endpoint.handle(scope, receive, send)


async def _no_discover(ctx: Context, params: types.RequestParams) -> types.DiscoverResult:
    raise MCPError(
        types.METHOD_NOT_FOUND,
        "envport environments are stateful: connect with the initialize handshake.",
        "server/discover",
    )


def _result(outcome: ToolOutcome) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=outcome.text)],
        structured_content=outcome.structured,
        is_error=outcome.is_error,
    )


def _header(ctx: Context, name: str) -> str | None:
    request = ctx.request
    if isinstance(request, Request):
        return request.headers.get(name)
    return None


def _connection(ctx: Context) -> Connection:
    """The SDK connection a request arrived on.

    ``mcp`` 2.3 gives handlers no public path to it yet (its ``Context`` rework, "L54",
    will add ``ctx.connection``); until then it is read off the per-request session.
    Per-connection cleanup on ``connection.exit_stack`` is the SDK's documented hook.
    """
    connection = getattr(ctx.session, "connection", None) or getattr(
        ctx.session, "_connection", None
    )
    if not isinstance(connection, Connection):
        raise MCPError(
            types.INTERNAL_ERROR,
            "This mcp SDK version exposes no per-connection state; envport needs mcp>=2.3,<3.",
        )
    return connection
