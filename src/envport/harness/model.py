"""A recording client for any OpenAI-compatible chat endpoint.

Every call becomes a :class:`~envport.trace.ModelCall`: the request as sent, the response
as received (all choices), sampling parameters, finish reasons, usage, latency, and —
when the server returns them, as vLLM does — prompt and completion token ids with
per-token logprobs. The client asks for them (``logprobs: true``,
``return_token_ids: true``); servers that ignore those fields are recorded as missing
token data, not as errors.

Failures are classified here, at the boundary: connection errors, HTTP errors and
malformed responses raise :class:`ModelProviderError`, which the harness records on the
trace with kind ``model_provider``. A reply is malformed when its first choice has no
``message`` object, or when ``message.tool_calls`` is not a list of objects whose
``function`` is an object with a string ``name`` (and whose ``id``, if given, is a string).
Tool-call ``arguments`` sent as a JSON object rather than the string OpenAI specifies
(some servers do) are accepted: the message handed back carries them re-encoded as a JSON
string; the recorded response keeps what the server sent.

``sampling`` is sent as given (OpenAI's forms, e.g. ``stop`` as one string or a list) and
recorded normalised, as the gateway records it (:func:`envport.gateway.capture.sampling_from`:
a string ``stop`` becomes a list, values that do not fit the schema are left out of the
record). The client reads whole responses, so ``stream`` is refused when it is built.

Retryable failures (timeouts, connection errors, HTTP 408, 429 and 5xx) are retried, up to
``max_retries`` times, after an exponential backoff with jitter (``backoff_s`` doubled each
time, each wait scaled by a random factor in [0.5, 1]) or the ``Retry-After`` a 429/503
gives in seconds, whichever is longer; a wait is capped at ``max_backoff_s``. No retry
starts ``retry_window_s`` after the first attempt began, so a slow failure (a timeout at
``timeout_s``) is not retried past a harness's deadline. The call recorded in the end
carries ``metadata["retries"]`` (with ``retry_errors``, what each retried attempt got)
when there were retries; the error raised after the last keeps its ``retryable``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson

from envport.errors import EnvportError
from envport.gateway.capture import parse_response, sampling_from
from envport.trace import ErrorKind, ModelCall, SamplingParams, TraceError

#: Back-off jitter from a generator of our own: never a draw from the global `random`,
#: which a user (or an environment) may have seeded.
_jitter = random.Random()

_KEPT_BODY = 4096  # characters of a failed answer's body kept on its recorded call


class ModelProviderError(EnvportError):
    """The model endpoint was unreachable, failed, or answered something unusable."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        retry_after_s: float | None = None,
    ):
        super().__init__(message, status=status, retryable=retryable)
        self.status = status
        self.retryable = retryable
        #: The wait the server asked for (``Retry-After`` in seconds), if it gave one.
        self.retry_after_s = retry_after_s
        #: The failed call as recorded (request, latency, the body that came back, the
        #: error), for the trace; set by :meth:`ChatModel.complete`.
        self.call: ModelCall | None = None


def _checked_message(message: Any) -> dict[str, Any]:
    """The reply's message, its tool calls checked (``TypeError`` naming what is wrong)
    and object ``arguments`` re-encoded as the JSON string OpenAI specifies."""
    if not isinstance(message, dict):
        raise TypeError("message is not an object")
    if not isinstance(message.get("content"), (str, list, type(None))):
        raise TypeError("message.content is neither a string, a list nor null")
    raw_calls = message.get("tool_calls")
    if raw_calls is None:
        return message
    if not isinstance(raw_calls, list):
        raise TypeError("message.tool_calls is not a list")
    calls = []
    for i, raw in enumerate(raw_calls):
        where = f"message.tool_calls[{i}]"
        if not isinstance(raw, dict):
            raise TypeError(f"{where} is not an object")
        if raw.get("id") is not None and not isinstance(raw["id"], str):
            raise TypeError(f"{where}.id is not a string")
        fn = raw.get("function")
        if not isinstance(fn, dict):
            raise TypeError(f"{where}.function is not an object")
        if not isinstance(fn.get("name"), str):
            raise TypeError(f"{where}.function.name is not a string")
        args = fn.get("arguments")
        if isinstance(args, dict):
            fn = {**fn, "arguments": json.dumps(args, ensure_ascii=False)}
        elif args is not None and not isinstance(args, str):
            raise TypeError(f"{where}.function.arguments is neither a string nor an object")
        calls.append({**raw, "function": fn})
    return {**message, "tool_calls": calls}


def _retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds; an HTTP date or anything else is not honoured."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def _heartbeat() -> None:
    """A failed attempt is a sign of life: tell a rollout controller, if one runs us."""
    from envport.rollout.controller import heartbeat

    heartbeat()


class ChatModel:
    """``POST {base_url}/chat/completions`` with token ids and logprobs requested."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        sampling: dict[str, Any] | None = None,
        request_token_data: bool = True,
        client: httpx.AsyncClient | None = None,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        retry_window_s: float = 60.0,
    ) -> None:
        try:
            parsed = httpx.URL(base_url)
        except httpx.InvalidURL:
            parsed = httpx.URL()
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ModelProviderError(
                f"Model endpoint URL {base_url!r} is not an http(s) URL with a host "
                "(e.g. http://localhost:8000/v1)"
            )
        if max_retries < 0 or backoff_s < 0 or max_backoff_s < 0 or retry_window_s < 0:
            raise ValueError("max_retries and the backoff times cannot be negative")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retry_window_s = retry_window_s
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.sampling = dict(sampling or {})
        if self.sampling.get("stream"):
            raise ModelProviderError(
                "ChatModel reads whole responses: 'stream' cannot be set in its sampling "
                "parameters (drop it, or set it to false)"
            )
        self.request_token_data = request_token_data
        headers = {"Authorization": f"Bearer {api_key or 'envport'}"}
        self._client = client or httpx.AsyncClient(
            timeout=timeout_s, headers=headers, limits=httpx.Limits(max_connections=512)
        )
        self._owns_client = client is None

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    def build_request(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.sampling}
        if tools:
            body["tools"] = tools
        if self.request_token_data:
            body.setdefault("logprobs", True)
            body.setdefault("return_token_ids", True)
        return body

    def _backoff(self, retries: int, retry_after_s: float | None) -> float:
        """The wait before retry number ``retries + 1``."""
        delay = min(self.max_backoff_s, self.backoff_s * 2.0**retries) * _jitter.uniform(0.5, 1.0)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(delay, self.max_backoff_s)

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[ModelCall, dict[str, Any]]:
        """One chat completion; returns the recorded call and the first choice's message.
        Retryable failures are retried (see the module's notes); the last one is raised."""
        body = self.build_request(messages, tools)
        # Recorded as the gateway records it: OpenAI's forms accepted (a string ``stop``).
        sampling = sampling_from(body, "chat")
        first = time.monotonic()
        errors: list[str] = []
        while True:
            try:
                call, message = await self._attempt(body, sampling)
            except ModelProviderError as exc:
                wait = self._backoff(len(errors), exc.retry_after_s)
                late = time.monotonic() - first + wait > self.retry_window_s
                if not exc.retryable or len(errors) >= self.max_retries or late:
                    if errors and exc.call is not None:
                        exc.call.metadata.update(retries=len(errors), retry_errors=errors)
                    raise
                errors.append(str(exc)[:300])
                _heartbeat()
                await asyncio.sleep(wait)
                continue
            if errors:
                call.metadata.update(retries=len(errors), retry_errors=errors)
            return call, message

    async def _attempt(
        self, body: dict[str, Any], sampling: SamplingParams
    ) -> tuple[ModelCall, dict[str, Any]]:
        """One request, recorded; a failure raised as :class:`ModelProviderError`."""
        started = datetime.now(UTC)
        t0 = time.perf_counter()
        url = f"{self.base_url}/chat/completions"

        def failed(
            message: str,
            *,
            status: int | None = None,
            retryable: bool = False,
            got: str = "",
            retry_after_s: float | None = None,
        ) -> ModelProviderError:
            """The error to raise, carrying the call as it went (for the trace)."""
            error = ModelProviderError(
                message, status=status, retryable=retryable, retry_after_s=retry_after_s
            )
            error.call = ModelCall(
                model=self.model,
                endpoint=url,
                api="chat.completions",
                sampling=sampling,
                request=body,
                started_at=started,
                latency_s=time.perf_counter() - t0,
                error=TraceError(
                    kind=ErrorKind.MODEL_PROVIDER,
                    message=message,
                    where="agent",
                    retryable=retryable,
                ),
                metadata={"status": status, "body": got[:_KEPT_BODY]} if status or got else {},
            )
            return error

        try:
            response = await self._client.post(url, content=orjson.dumps(body))
        except httpx.TimeoutException as exc:
            raise failed(f"Model endpoint timed out: {url}", retryable=True) from exc
        except httpx.HTTPError as exc:
            raise failed(
                f"Model endpoint unreachable: {url}: {type(exc).__name__}: {exc}", retryable=True
            ) from exc
        latency = time.perf_counter() - t0
        if response.status_code >= 400:
            raise failed(
                f"Model endpoint answered HTTP {response.status_code}: {response.text[:300]}",
                status=response.status_code,
                retryable=response.status_code in (408, 429) or response.status_code >= 500,
                got=response.text,
                retry_after_s=_retry_after(response),
            )
        try:
            payload = orjson.loads(response.content)
            message = _checked_message(payload["choices"][0]["message"])
            # One parser of vLLM's token fields for the whole project (the gateway's).
            choices, prompt_ids, usage, token_data = parse_response(payload)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            why = f" ({exc})" if isinstance(exc, TypeError) and str(exc) else ""
            raise failed(
                f"Model endpoint returned an invalid completion{why}: {response.text[:300]!r}",
                status=response.status_code,
                got=response.text,
            ) from exc
        call = ModelCall(
            model=self.model,
            response_model=payload.get("model"),
            endpoint=url,
            api="chat.completions",
            sampling=sampling,
            request=body,
            response=payload,
            choices=choices,
            prompt_token_ids=prompt_ids,
            usage=usage,
            metadata=token_data,
            started_at=started,
            latency_s=latency,
        )
        return call, message
