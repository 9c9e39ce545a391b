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

import json
from collections.abc import Mapping
from typing import Any

import openai
from openai import OpenAI

from tracon_jobs.errors import ContentBlockedError, ProviderError
from tracon_jobs.providers.abortable_http import make_abortable
from tracon_jobs.providers.base import ModelRequest, ModelResponse, OnText, ToolCall, Usage
from tracon_jobs.providers.sdk import SdkProvider
from tracon_jobs.providers.wire import (
    count,
    describe,
    json_object,
    malformed,
    parse_retry_after,
    text,
)


class OpenAIProvider(SdkProvider):
    """One OpenAI-compatible endpoint, shared by every thread of the process."""

    path = "/chat/completions"
    sdk_error = openai.OpenAIError

    def _new_client(self) -> OpenAI:
        return OpenAI(
            api_key=self._api_key,
            base_url=self._base_url,
            timeout=self._timeout_seconds,
            max_retries=0,
            http_client=make_abortable(openai.DefaultHttpxClient()),
        )

    def _arguments(self, request: ModelRequest) -> dict[str, Any]:
        return completion_arguments(request)

    def _stream_arguments(self) -> dict[str, Any]:
        return {"stream": True, "stream_options": {"include_usage": True}}

    def _stream_reader(self, request: ModelRequest, on_text: OnText) -> ChunkReader:
        return ChunkReader(self, request, on_text)

    def _map_error(self, exc: Exception) -> ProviderError:
        assert isinstance(exc, openai.OpenAIError)
        return map_openai_error(self.name, exc)

    def _to_response(self, body: bytes, request: ModelRequest) -> ModelResponse:
        """The chat completion's first choice; a body that is not one is the provider's fault
        (`kind="connection"`: the call may be tried again), never a crash of the run."""
        try:
            completion = json.loads(body)
        except ValueError:
            completion = None
        if not isinstance(completion, dict):
            raise malformed(self.name, "an answer that is not a JSON chat completion")
        choices = completion.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            raise malformed(self.name, "a completion without choices")
        choice = choices[0]
        finish_reason = choice.get("finish_reason")
        if finish_reason == "content_filter":
            raise ContentBlockedError(
                f"Provider '{self.name}' blocked the answer (content filter)", provider=self.name
            )
        message = json_object(choice.get("message"))
        try:
            tool_calls = [_tool_call(call) for call in message.get("tool_calls") or []]
        except (AttributeError, KeyError, TypeError):
            raise malformed(self.name, "a tool call without its id, name or arguments") from None
        content = message.get("content")
        return ModelResponse(
            model=text(completion.get("model")) or request.model,
            text=None if content is None else text(content),
            tool_calls=tool_calls,
            usage=_usage(completion.get("usage")),
            finish_reason=text(finish_reason) or "stop",
        )


class ChunkReader:
    """`chat.completion.chunk` events assembled into the completion `complete` would read:
    text deltas joined, tool calls by `index` (id and name first, then argument fragments),
    usage from the final chunk; so the answer is read by the same code either way."""

    def __init__(self, provider: OpenAIProvider, request: ModelRequest, on_text: OnText) -> None:
        self._provider = provider
        self._request = request
        self._on_text = on_text
        self._texts: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._model: Any = None
        self._usage: Any = None
        self._finish_reason: Any = None
        self._done = False

    def line(self, line: str) -> bool:
        if not line.startswith("data:"):
            return False
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self._done = True
            return True
        try:
            chunk = json_object(json.loads(data))
        except ValueError:
            raise malformed(self._provider.name, "a stream chunk that is not JSON") from None
        if isinstance(chunk.get("error"), dict):
            raise ProviderError(
                f"Provider '{self._provider.name}' failed mid-stream: "
                f"{text(chunk['error'].get('message'))}",
                provider=self._provider.name,
                kind="connection",
            )
        self._model = chunk.get("model") or self._model
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            choice = json_object(choice)
            if choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
            delta = json_object(choice.get("delta"))
            piece = delta.get("content")
            if isinstance(piece, str) and piece:
                self._texts.append(piece)
                self._on_text(piece)
            for part in delta.get("tool_calls") or []:
                self._tool_call_delta(json_object(part))
        return False

    def _tool_call_delta(self, part: dict[str, Any]) -> None:
        index = part.get("index", len(self._calls))
        call = self._calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if part.get("id"):
            call["id"] = part["id"]
        function = json_object(part.get("function"))
        if function.get("name"):
            call["function"]["name"] += text(function["name"])
        if function.get("arguments"):
            call["function"]["arguments"] += text(function["arguments"])

    def result(self) -> ModelResponse:
        if not self._done:
            raise malformed(self._provider.name, "a stream that ended before [DONE]")
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self._texts) if self._texts else None,
        }
        if self._calls:
            message["tool_calls"] = [self._calls[index] for index in sorted(self._calls)]
        completion = {
            "model": self._model,
            "choices": [{"index": 0, "message": message, "finish_reason": self._finish_reason}],
            "usage": self._usage,
        }
        return self._provider._to_response(json.dumps(completion).encode(), self._request)


def completion_arguments(request: ModelRequest) -> dict[str, Any]:
    """The chat completion's JSON body, leaving out what the request does not set.

    Unset options are omitted rather than sent as null, because several compatible servers
    reject nulls, and so are an empty `stop` and `logit_bias`; `max_tokens` is used over
    `max_completion_tokens` because more servers know it.
    """
    arguments: dict[str, Any] = {"model": request.model, "messages": request.messages}
    optional = {
        "tools": request.tools or None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_output_tokens,
        "response_format": request.response_format,
        "stop": request.stop or None,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": request.logit_bias or None,
        "reasoning_effort": request.reasoning_effort,
        "verbosity": request.verbosity,
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
        f"Provider '{provider}' could not be reached: {describe(exc)}",
        provider=provider,
        kind="connection",
    )


def _is_content_filter(exc: openai.APIStatusError) -> bool:
    """Azure-style refusals: a 400 whose error code is `content_filter`."""
    return exc.status_code == 400 and getattr(exc, "code", None) == "content_filter"


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


def _tool_call(call: dict[str, Any]) -> ToolCall:
    """A `function` tool call (`custom` ones carry `input` instead of `arguments`)."""
    if call.get("type") == "custom":
        custom = call["custom"]
        return ToolCall(
            id=str(call["id"]), name=str(custom["name"]), arguments=text(custom["input"])
        )
    function = call["function"]
    return ToolCall(
        id=str(call["id"]), name=str(function["name"]), arguments=text(function["arguments"])
    )


def _usage(usage: Any) -> Usage:
    usage = json_object(usage)
    details = json_object(usage.get("prompt_tokens_details"))
    input_tokens = count(usage.get("prompt_tokens"))
    return Usage(
        input_tokens=input_tokens,
        output_tokens=count(usage.get("completion_tokens")),
        cached_input_tokens=min(count(details.get("cached_tokens")), input_tokens),
    )
