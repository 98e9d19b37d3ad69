"""Upstream model servers: routing, retries, and pause/drain for weight updates.

**Routing.** :class:`UpstreamPool` holds several base URLs (``http://host:8000/v1``).
A rollout's first call goes to the least-loaded upstream (fewest calls in flight; ties go
to the one with fewer rollouts assigned, then to the earliest listed) and the rollout
stays there (sticky, so a server's prefix cache keeps serving it) until that upstream
fails to connect, when it moves to the next-least-loaded one and stays there instead.

**Retries.** One logical call may take several attempts, bounded by a
:class:`RetryPolicy`: at most ``max_attempts`` tries and ``deadline_s`` seconds in all.
Retried: connect errors, timeouts, a connection dropped before the response was
complete, and HTTP 408/429/5xx. Between tries the pool sleeps with exponential backoff
and jitter (``Retry-After`` is honoured when it fits in the budget). A streaming call is
retried only until upstream answers with its status line: from then on bytes may have
reached the agent, and a retry would show it a second, different answer.

**Pause/drain.** :class:`PauseGate` is the door every call passes. ``pause()`` closes it:
new calls wait (at most ``wait_s``, then 503 with ``Retry-After``); calls already
through finish; ``drain()`` waits for them. ``resume(policy_version)`` opens it and every
call that passes afterwards is stamped with that version.

**Transport.** One keep-alive :class:`~envport.gateway.http1.Http1Pool` (or one handed
in). It replaced ``httpx.AsyncClient`` on this hop because the gateway's added latency
is mostly the CPU this hop's client spends, and it spends a fraction of what httpx or
aiohttp do (``bench/GATEWAY_RESULTS.md``). Its exceptions are mapped here, once, to the
gateway's: :class:`UpstreamFailure` before an answer, and :data:`STREAM_ERRORS` for what
may break a stream later.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import random
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from envport.gateway.errors import PausedError, UpstreamError, UpstreamTimeoutError
from envport.gateway.http1 import (
    ConnectError,
    EarlySink,
    Http1Pool,
    HTTPError,
    Response,
    Timeouts,
)

#: Back-off jitter from a generator of our own: never a draw from the global `random`,
#: which a user (or an environment) may have seeded.
_jitter = random.Random()

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
STREAM_ERRORS = (HTTPError, OSError, TimeoutError)
"""What reading an upstream stream may raise once it started (all mapped by the relay)."""

Timeout = httpx.Timeout | Timeouts | float


def client_timeout(timeout: Timeout | None) -> Timeouts:
    """The client's timeouts: ``connect`` to open a connection, ``read`` between bytes.

    Accepts an ``httpx.Timeout`` (its ``connect`` and ``read``), :class:`Timeouts`, or
    seconds (both). Default: 10 s to connect, 600 s per read.
    """
    if timeout is None:
        return Timeouts()
    if isinstance(timeout, Timeouts):
        return timeout
    if isinstance(timeout, httpx.Timeout):
        return Timeouts(connect=timeout.connect, read=timeout.read)
    return Timeouts(connect=float(timeout), read=float(timeout))


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """The budget of one logical call: tries, total seconds, and the backoff between."""

    max_attempts: int = 3
    deadline_s: float = 600.0
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {self.max_attempts}")
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, not {self.deadline_s}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (1-based)."""
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        return _jitter.uniform(delay / 2, delay) if self.jitter else delay


def check_base_url(url: str) -> None:
    """Raise ``ValueError`` unless ``url`` is an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"upstream {url!r} is not an http(s) URL with a host "
            "(an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1)"
        )


@dataclasses.dataclass
class Upstream:
    """One upstream base URL and its load."""

    base_url: str
    in_flight: int = 0
    assigned: int = 0
    requests: int = 0
    failures: int = 0
    down_until: float = 0.0

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"

    def stats(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "in_flight": self.in_flight,
            "rollouts": self.assigned,
            "requests": self.requests,
            "failures": self.failures,
            "down": self.down_until > time.monotonic(),
        }


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try of a call: where it went and how it ended."""

    upstream: str
    status: int | None
    error: str | None
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "upstream": self.upstream,
            "status": self.status,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
        }


class UpstreamFailure(Exception):
    """Every try failed without an HTTP answer; ``error`` is what the agent is told."""

    def __init__(self, error: UpstreamError, attempts: list[Attempt]) -> None:
        super().__init__(error.message)
        self.error = error
        self.attempts = attempts


@dataclasses.dataclass
class Opened:
    """An upstream answer and its tries: status, headers, and the body (read unless
    streaming; then :meth:`chunks` reads it as it comes).

    Holds its upstream's in-flight slot until :meth:`aclose`.
    """

    response: Response
    upstream: Upstream
    attempts: list[Attempt]
    body: bytes = b""
    _closed: bool = False

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self.response.headers

    def ready(self) -> bool:
        """Whether some of the body arrived already (reading it will not wait)."""
        return self.response.ready()

    def chunks(self) -> AsyncGenerator[bytes, None]:
        """The streamed body as it arrives: all that one read brought, as one piece."""
        return self.response.chunks(batch=True)

    async def finish(self, timeout_s: float = 1.0) -> None:
        """Read what is left of a stream after its last event (the end of the chunked
        body, normally already on its way) so the connection is reused; then close."""
        try:
            await self.response.drain(timeout_s)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.upstream.in_flight -= 1
            self.response.release()  # back to the pool if read to the end, else closed


class UpstreamPool:
    """Several upstreams, least-loaded + sticky routing, retries within a budget."""

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        client: Http1Pool | None = None,
        timeout: Timeout | None = None,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        down_cooldown_s: float = 5.0,
    ) -> None:
        if not base_urls:
            raise ValueError("an UpstreamPool needs at least one upstream base URL")
        for url in base_urls:
            check_base_url(url)
        self.upstreams = [Upstream(u.rstrip("/")) for u in base_urls]
        self.retry = retry or RetryPolicy()
        self.timeout = client_timeout(timeout)
        self.down_cooldown_s = down_cooldown_s
        fields = {"content-type": "application/json", "accept-encoding": "identity"}
        if api_key:
            fields["authorization"] = f"Bearer {api_key}"
        fields.update({k.lower(): v for k, v in (headers or {}).items()})
        self._headers = tuple(fields.items())
        self._client = client
        self._owns_client = client is None
        self._sticky: dict[str, Upstream] = {}

    @property
    def client(self) -> Http1Pool:
        """The HTTP client (made on first use)."""
        if self._client is None:
            self._client = Http1Pool(self.timeout)
            self._owns_client = True
        return self._client

    async def aclose(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- routing ----------------------------------------------------------------------

    def assigned(self, rollout_id: str) -> Upstream | None:
        return self._sticky.get(rollout_id)

    def pick(self, rollout_id: str, avoid: Sequence[Upstream] = ()) -> Upstream:
        """The rollout's upstream: its sticky one if usable, else the least loaded."""
        now = time.monotonic()
        current = self._sticky.get(rollout_id)
        if current is not None and current not in avoid and current.down_until <= now:
            return current
        candidates = [u for u in self.upstreams if u not in avoid and u.down_until <= now]
        candidates = candidates or [u for u in self.upstreams if u not in avoid] or self.upstreams
        best = min(candidates, key=lambda u: (u.in_flight, u.assigned))
        if current is not best:
            if current is not None:
                current.assigned -= 1
            best.assigned += 1
            self._sticky[rollout_id] = best
        return best

    def forget(self, rollout_id: str) -> None:
        """Drop a finished rollout's sticky assignment."""
        upstream = self._sticky.pop(rollout_id, None)
        if upstream is not None:
            upstream.assigned -= 1

    # --- calls ------------------------------------------------------------------------

    async def send(
        self,
        path: str,
        body: bytes,
        *,
        rollout_id: str,
        stream: bool = False,
        early: EarlySink | None = None,
        sent: Callable[[], object] | None = None,
    ) -> Opened:
        """POST ``body`` to ``path`` on the rollout's upstream, retrying within budget.

        Returns the answer once upstream gave a final one: a success, a status that is
        not retried (400, 404, …), or the last retried status when the budget ran out.
        Raises :class:`UpstreamFailure` when no try got an HTTP answer. The caller owns
        the returned :class:`Opened` and must ``aclose()`` it. ``early`` (a stream's
        relay) is offered each try's answer as its head arrives (:meth:`Http1Pool.post`);
        it takes only one it will relay (a success), so a retried answer never reaches it.
        ``sent`` is called each time a try's request has been written (see
        :meth:`Http1Pool.post`).
        """
        policy = self.retry
        start = time.monotonic()
        deadline = start + policy.deadline_s
        attempts: list[Attempt] = []
        avoid: list[Upstream] = []
        last_exc: UpstreamError | None = None
        for number in range(1, policy.max_attempts + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            upstream = self.pick(rollout_id, avoid)
            upstream.in_flight += 1
            upstream.requests += 1
            t0 = time.monotonic()
            wait: float | None = None
            try:
                response, content = await self._try(
                    upstream, path, body, stream, remaining, early, sent
                )
            except TimeoutError as exc:  # ConnectTimeout and ReadTimeout are TimeoutErrors
                detail = _describe(exc)
                last_exc = UpstreamTimeoutError(
                    f"Upstream {upstream.base_url} timed out ({detail}).",
                    error_code="upstream_timeout",
                )
            except (HTTPError, OSError) as exc:
                if isinstance(exc, ConnectError):
                    upstream.down_until = time.monotonic() + self.down_cooldown_s
                    avoid.append(upstream)
                detail = _describe(exc)
                last_exc = UpstreamError(
                    f"Upstream {upstream.base_url} failed: {detail}.",
                    error_code="upstream_unreachable",
                )
            except BaseException:
                upstream.in_flight -= 1
                raise
            else:
                status = response.status
                attempts.append(Attempt(upstream.base_url, status, None, time.monotonic() - t0))
                if status not in RETRY_STATUSES or number == policy.max_attempts:
                    return Opened(response, upstream, attempts, content)
                wait = _retry_after(response.headers.get("retry-after"))
                wait = policy.backoff(number) if wait is None else wait
                if time.monotonic() + wait >= deadline:
                    return Opened(response, upstream, attempts, content)  # no time to retry
                upstream.failures += 1
                upstream.in_flight -= 1
                response.close()
                await asyncio.sleep(wait)
                continue
            # An exception: no HTTP answer from this try.
            upstream.in_flight -= 1
            upstream.failures += 1
            attempts.append(Attempt(upstream.base_url, None, detail, time.monotonic() - t0))
            if number < policy.max_attempts:
                wait = policy.backoff(number)
                if time.monotonic() + wait >= deadline:
                    break  # no time for another try after the backoff
                await asyncio.sleep(wait)
        error = last_exc or UpstreamTimeoutError(
            f"The call's budget ({policy.deadline_s:g} s) ran out.",
            error_code="upstream_deadline",
        )
        error.message = f"{error.message} Gave up after {len(attempts)} attempt(s)."
        error.args = (error.message,)
        raise UpstreamFailure(error, attempts)

    async def _try(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        stream: bool,
        remaining: float,
        early: EarlySink | None = None,
        sent: Callable[[], object] | None = None,
    ) -> tuple[Response, bytes]:
        """One POST: the response, and its body unless streaming (then ``b""``).

        ``remaining`` bounds the try up to its answer's headers (a stream) or its whole
        body; the client keeps it with the same timer as its read timeout."""
        deadline = asyncio.get_running_loop().time() + remaining
        response = await self.client.post(
            upstream.url(path), body, self._headers, deadline=deadline, early=early, sent=sent
        )
        if stream and response.status < 400:
            return response, b""
        content = await response.read(deadline=deadline)  # closes the connection if it fails
        return response, content

    def stats(self) -> list[dict[str, Any]]:
        return [u.stats() for u in self.upstreams]


class PauseGate:
    """The door every model call passes; closed while the trainer swaps weights."""

    def __init__(self, policy_version: int | str | None = None) -> None:
        self.policy_version = policy_version
        self.in_flight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.waiting = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self, wait_s: float) -> int | str | None:
        """Pass the door (waiting at most ``wait_s`` while paused); returns the version."""
        if not self._open.is_set():
            self.waiting += 1
            try:
                async with asyncio.timeout(wait_s):
                    await self._open.wait()
            except TimeoutError:
                raise PausedError(
                    f"The gateway is paused for a policy update and did not resume within "
                    f"{wait_s:g} s; retry later.",
                    error_code="paused",
                    retry_after_s=5.0,
                ) from None
            finally:
                self.waiting -= 1
        self.in_flight += 1
        self._idle.clear()
        return self.policy_version

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def pause(self) -> None:
        self._open.clear()

    async def drain(self, timeout_s: float | None) -> bool:
        """Wait until no call is in flight; ``False`` if ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def resume(self, policy_version: int | str | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        self._open.set()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
