"""OpenAIProvider: any OpenAI-compatible chat completions endpoint (OpenAI, vLLM, Ollama, ...).

The call runs on the caller's thread with the blocking `OpenAI` client, whose connections are
abortable (`abortable_http.py`): an abort shuts the socket the call waits on, so the request
ends at once instead of waiting for the socket. No event loop and no hand-off between threads
per call: with a hundred runs in one worker process, every hand-off is a GIL switch and a
wake-up, and they cost more than the call itself. The SDK never retries (`max_retries=0`):
whether and when to retry is the policies' decision, and they need to see every failure. SDK
exceptions become `ProviderError` with a `status` or a `kind`, so nothing above this module
knows which SDK raised them.

The request goes through the client's `post`, the SDK's own path under `chat.completions.create`
(same request, headers and errors) without `create`'s transform of its arguments: that walks
every message of the conversation through the typed-dict schema, 1-1.5 ms of CPU per call
before the request leaves, for arguments that are plain JSON already. The answer comes back as
its bytes and is read here into a `ModelResponse`, without the SDK's `ChatCompletion` built
first (its typed models cost about 0.2 ms a call, more with a hundred threads). A hundred runs
of one process share one GIL, so that CPU delays every other run's call.
"""

from __future__ import annotations

import email.utils
import json
import os
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import openai
from openai import OpenAI

from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ContentBlockedError, ProviderError
from tracon_jobs.providers.abortable_http import abortable, make_abortable
from tracon_jobs.providers.base import ModelRequest, ModelResponse, ToolCall, Usage

# Local servers (vLLM, Ollama) ignore the key, but the SDK refuses to start without one.
PLACEHOLDER_API_KEY = "not-needed"

_client_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    """A lock held by another thread at the fork stays held in the child: replace it."""
    global _client_lock
    _client_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


class OpenAIProvider:
    """One OpenAI-compatible endpoint, shared by every thread of the process."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout_seconds: float,
    ) -> None:
        self.name = name
        self._base_url = base_url or None
        self._api_key = api_key or PLACEHOLDER_API_KEY
        self._timeout_seconds = timeout_seconds
        self._client: OpenAI | None = None
        self._client_pid: int | None = None

    def complete(self, request: ModelRequest, signal: AbortSignal) -> ModelResponse:
        """One chat completion; `ProviderError(kind="cancelled")` when `signal` fired first."""
        if signal.aborted:
            raise self._cancelled(signal)
        client = self._client_here()
        try:
            with abortable(signal):
                body = client.post(
                    "/chat/completions", body=completion_arguments(request), cast_to=bytes
                )
        except openai.OpenAIError as exc:
            if signal.aborted:
                raise self._cancelled(signal) from None
            raise map_openai_error(self.name, exc) from exc
        return self._to_response(body, request)

    def close(self) -> None:
        """Close this process's client and its connections (a forked child's are its parent's)."""
        client, self._client = self._client, None
        if client is not None and self._client_pid == os.getpid():
            client.close()

    def _client_here(self) -> OpenAI:
        """The client of this process, built on first use; a forked child builds its own,
        because the connections in its copy of the pool belong to its parent."""
        client = self._client
        if client is not None and self._client_pid == os.getpid():
            return client
        with _client_lock:
            client = self._client
            if client is None or self._client_pid != os.getpid():
                client = OpenAI(
                    api_key=self._api_key,
                    base_url=self._base_url,
                    timeout=self._timeout_seconds,
                    max_retries=0,
                    http_client=make_abortable(openai.DefaultHttpxClient()),
                )
                self._client, self._client_pid = client, os.getpid()
            return client

    def _cancelled(self, signal: AbortSignal) -> ProviderError:
        return ProviderError(
            f"Call to provider '{self.name}' cancelled ({signal.reason or 'cancelled'})",
            provider=self.name,
            kind="cancelled",
        )

    def _to_response(self, body: bytes, request: ModelRequest) -> ModelResponse:
        """The chat completion's first choice; a body that is not one is the provider's fault
        (`kind="connection"`: the call may be tried again), never a crash of the run."""
        try:
            completion = json.loads(body)
        except ValueError:
            completion = None
        if not isinstance(completion, dict):
            raise self._malformed("an answer that is not a JSON chat completion")
        choices = completion.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            raise self._malformed("a completion without choices")
        choice = choices[0]
        finish_reason = choice.get("finish_reason")
        if finish_reason == "content_filter":
            raise ContentBlockedError(
                f"Provider '{self.name}' blocked the answer (content filter)", provider=self.name
            )
        message = _object(choice.get("message"))
        try:
            tool_calls = [_tool_call(call) for call in message.get("tool_calls") or []]
        except (AttributeError, KeyError, TypeError):
            raise self._malformed("a tool call without its id, name or arguments") from None
        content = message.get("content")
        return ModelResponse(
            model=_text(completion.get("model")) or request.model,
            text=None if content is None else _text(content),
            tool_calls=tool_calls,
            usage=_usage(completion.get("usage")),
            finish_reason=_text(finish_reason) or "stop",
        )

    def _malformed(self, what: str) -> ProviderError:
        return ProviderError(
            f"Provider '{self.name}' returned {what}", provider=self.name, kind="connection"
        )


def completion_arguments(request: ModelRequest) -> dict[str, Any]:
    """The chat completion's JSON body, leaving out what the request does not set.

    Unset options are omitted rather than sent as null, because several compatible servers
    reject nulls; `max_tokens` is used over `max_completion_tokens` because more servers know it.
    """
    arguments: dict[str, Any] = {"model": request.model, "messages": request.messages}
    optional = {
        "tools": request.tools or None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_output_tokens,
        "response_format": request.response_format,
    }
    arguments.update({key: value for key, value in optional.items() if value is not None})
    return arguments


def map_openai_error(provider: str, exc: openai.OpenAIError) -> ProviderError:
    """Translate an SDK exception into the one family the policies classify."""
    if isinstance(exc, openai.APIStatusError) and _is_content_filter(exc):
        return ContentBlockedError(
            f"HTTP {exc.status_code} from provider '{provider}': content filter: "
            f"{_body_message(exc)}",
            provider=provider,
        )
    if isinstance(exc, openai.APIStatusError):
        return ProviderError(
            f"HTTP {exc.status_code} from provider '{provider}': {_body_message(exc)}",
            provider=provider,
            status=exc.status_code,
            kind="http",
            retry_after=parse_retry_after(exc.response.headers),
        )
    # APITimeoutError subclasses APIConnectionError, so it is tested first.
    if isinstance(exc, openai.APITimeoutError):
        return ProviderError(
            f"Provider '{provider}' timed out: {exc}", provider=provider, kind="timeout"
        )
    return ProviderError(
        f"Provider '{provider}' could not be reached: {_describe(exc)}",
        provider=provider,
        kind="connection",
    )


def _is_content_filter(exc: openai.APIStatusError) -> bool:
    """Azure-style refusals: a 400 whose error code is `content_filter`."""
    return exc.status_code == 400 and getattr(exc, "code", None) == "content_filter"


def parse_retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms`, or `Retry-After` as seconds or an HTTP date."""
    lowered = {key.lower(): value for key, value in headers.items()}
    milliseconds = _float_or_none(lowered.get("retry-after-ms"))
    if milliseconds is not None:
        return max(milliseconds / 1000.0, 0.0)
    value = lowered.get("retry-after")
    if value is None:
        return None
    seconds = _float_or_none(value)
    if seconds is not None:
        return max(seconds, 0.0)
    return _seconds_until_http_date(value, now or datetime.now(UTC))


def _seconds_until_http_date(value: str, now: datetime) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - now).total_seconds(), 0.0)


def _float_or_none(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _body_message(exc: openai.APIStatusError) -> str:
    """The provider's own words: `error.message` in OpenAI's shape, else the raw body."""
    body = exc.body
    if isinstance(body, Mapping):
        message = body.get("message")
        if isinstance(message, str) and message:
            return message
    if isinstance(body, str) and body:
        return body
    return exc.message


def _describe(exc: BaseException) -> str:
    """The SDK's message plus its cause, which says what actually went wrong on the wire."""
    cause = exc.__cause__
    if cause is None or str(cause) in str(exc):
        return str(exc)
    return f"{exc} ({type(cause).__name__}: {cause})"


def _tool_call(call: dict[str, Any]) -> ToolCall:
    """A `function` tool call (`custom` ones carry `input` instead of `arguments`)."""
    if call.get("type") == "custom":
        custom = call["custom"]
        return ToolCall(
            id=str(call["id"]), name=str(custom["name"]), arguments=_text(custom["input"])
        )
    function = call["function"]
    return ToolCall(
        id=str(call["id"]), name=str(function["name"]), arguments=_text(function["arguments"])
    )


def _usage(usage: Any) -> Usage:
    usage = _object(usage)
    return Usage(
        input_tokens=_count(usage.get("prompt_tokens")),
        output_tokens=_count(usage.get("completion_tokens")),
    )


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    return json.dumps(value)  # a server that sent structured content: kept, as JSON


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0
