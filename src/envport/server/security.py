"""Keeping web pages out: the Origin allow-list, JSON-only bodies, the MCP host check.

An envport server runs environments that act on the machine (a reset may name a host
directory as the workspace), and it usually listens on a local port, which any web page
the user opens can reach. Three rules keep such pages out:

* **Origin.** Browsers put an ``Origin`` header on every cross-site request, on every
  ``POST`` and on every WebSocket handshake; non-browser clients (envport's, OpenEnv's,
  the MCP SDK's) send none. A request or handshake whose ``Origin`` is not in
  ``ServerConfig.allowed_origins`` (``envport serve --allow-origin``; empty by default)
  is refused: ``403`` with the protocol's error body, or a refused handshake (``403``).
* **JSON bodies.** A ``POST`` body must be declared ``application/json`` (or a
  ``+json`` type): ``text/plain``, form types and undeclared bodies, which a page can
  send without a CORS preflight, get ``415``.
* **Host (MCP).** A server bound to a loopback address gives the MCP Streamable HTTP
  transport the SDK's DNS-rebinding protection: a ``Host`` other than ``127.0.0.1``,
  ``localhost`` or ``[::1]`` (any port) is refused (``421``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from envport.errors import ForbiddenError, InvalidJSONError

if TYPE_CHECKING:
    from mcp.server.transport_security import TransportSecuritySettings

#: Bind addresses that get the MCP transport's DNS-rebinding protection (as the SDK's
#: own servers decide it).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_LOOPBACK_HOST_HEADERS = [
    "127.0.0.1:*",
    "localhost:*",
    "[::1]:*",
    "127.0.0.1",
    "localhost",
    "[::1]",
]


class UnsupportedMediaTypeError(InvalidJSONError):
    """A ``POST`` body not declared as JSON (HTTP ``415``; wire code ``INVALID_JSON``)."""

    http_status = 415


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or an ``application/*+json`` type, parameters ignored."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def check_json_body(content_type: str | None, body: bytes) -> None:
    """Raise :class:`UnsupportedMediaTypeError` unless ``body`` is declared JSON. A
    request with no body and no ``Content-Type`` passes (there is nothing to read)."""
    if content_type is None and not body.strip():
        return
    if not is_json_media_type(content_type):
        declared = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise UnsupportedMediaTypeError(
            f"The request body must be sent as application/json (got {declared})."
        )


def origin_allowed(origin: str, allowed: Sequence[str]) -> bool:
    """Whether ``origin`` matches an entry: exactly, or ``scheme://host:*`` for any port
    (the syntax of the MCP SDK's ``allowed_origins``)."""
    for entry in allowed:
        if origin == entry:
            return True
        if entry.endswith(":*"):
            prefix = entry[:-1]  # "http://localhost:"
            if origin.startswith(prefix) and origin[len(prefix) :].isdigit():
                return True
    return False


def mcp_security(
    host: str | None, allowed_origins: Sequence[str]
) -> TransportSecuritySettings | None:
    """The MCP transport's settings for a server bound to ``host``: DNS-rebinding
    protection (``Host`` must name the loopback interface) when ``host`` is a loopback
    address, else ``None`` (any ``Host``; the Origin rule still applies)."""
    if host not in LOOPBACK_HOSTS:
        return None
    from mcp.server.transport_security import TransportSecuritySettings

    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=list(_LOOPBACK_HOST_HEADERS),
        allowed_origins=list(allowed_origins),
    )


class OriginGuard:
    """ASGI middleware: refuse HTTP requests and WebSocket handshakes whose ``Origin``
    header is not in ``allowed`` (requests without one pass)."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str] = ()) -> None:
        self.app = app
        self.allowed = tuple(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" or kind == "websocket":
            for name, value in scope.get("headers") or ():
                if name == b"origin":
                    origin = value.decode("latin-1")
                    if not origin_allowed(origin, self.allowed):
                        await self._refuse(scope, receive, send, origin)
                        return
                    break
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, origin: str) -> None:
        if scope["type"] == "websocket":
            # Closing before accepting refuses the handshake: the client gets HTTP 403.
            if (await receive())["type"] == "websocket.connect":
                await send({"type": "websocket.close", "code": 1008})
            return
        from envport.server.http import error_response

        exc = ForbiddenError(
            f"Requests from the web origin {origin!r} are not allowed: this server accepts "
            "browser requests only from origins it was started with (envport serve "
            "--allow-origin ORIGIN)."
        )
        await error_response(exc)(scope, receive, send)
