"""AnthropicProvider: Anthropic's Messages API (`POST /v1/messages`), with the `anthropic` SDK.

A run's messages are kept in the OpenAI chat shape (`base.py`), so that any link of a fallback
chain can replay them; they are translated here, each way, on every call:

- `system` (and `developer`) messages become the request's `system` text;
- an assistant message's `tool_calls` become `tool_use` blocks (their JSON arguments the
  block's `input`), and `tool` messages become `tool_result` blocks of the next user turn;
  consecutive messages of one role are one turn, as the API requires;
- function tools become `{name, description, input_schema}`;
- `MaxOutputTokens` is `max_tokens`, which the API requires: unset, it is 4,096
  (`DEFAULT_MAX_TOKENS`); a `json_schema` response format is `output_config.format`; `stop`
  is `stop_sequences`; an option the API has no counterpart of (a seed, a penalty, a logit
  bias, a reasoning effort: `capabilities.ANTHROPIC_HAS_NONE`) is refused unless it asks for
  nothing, never dropped;
- the answer's `text` blocks are the reply's text, its `tool_use` blocks the tool calls (each
  `input` as JSON text), the prompt cache's tokens count as input (read and written, each
  priced at its own rate when `Pricing` gives one), and a `refusal` stop is a blocked answer
  (`ContentBlockedError`, never fallen back from).

The call runs as `OpenAIProvider`'s does (`sdk.py`): on the caller's thread, through the
client's `post` with the answer as bytes, on abortable connections, with the SDK never retrying
on its own and its errors mapped to `ProviderError`.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
from anthropic import Anthropic

from tracon_jobs.errors import ContentBlockedError, ProviderError
from tracon_jobs.providers.abortable_http import make_abortable
from tracon_jobs.providers.base import (
    Message,
    ModelRequest,
    ModelResponse,
    OnText,
    ToolCall,
    Usage,
)
from tracon_jobs.providers.capabilities import (
    ANTHROPIC_HAS_NONE,
    anthropic_option_rule,
    anthropic_response_format_rule,
)
from tracon_jobs.providers.sdk import SdkProvider
from tracon_jobs.providers.wire import (
    count,
    describe,
    json_object,
    malformed,
    parse_retry_after,
    text,
)

DEFAULT_MAX_TOKENS = 4096
"""`max_tokens` when the agent sets no `MaxOutputTokens` (the Messages API requires one)."""

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
}


class AnthropicProvider(SdkProvider):
    """One Messages API endpoint, shared by every thread of the process."""

    path = "/v1/messages"
    sdk_error = anthropic.AnthropicError

    def _new_client(self) -> Anthropic:
        return Anthropic(
            api_key=self._api_key,
            base_url=self._base_url,
            timeout=self._timeout_seconds,
            max_retries=0,
            http_client=make_abortable(anthropic.DefaultHttpxClient()),
        )

    def _arguments(self, request: ModelRequest) -> dict[str, Any]:
        try:
            return message_arguments(request)
        except ValueError as exc:  # startup refuses such an agent; one built otherwise ends here
            raise ProviderError(
                f"Provider '{self.name}' cannot take this request: {exc}",
                provider=self.name,
                kind="configuration",
            ) from None

    def _stream_reader(self, request: ModelRequest, on_text: OnText) -> EventReader:
        return EventReader(self, request, on_text)

    def _map_error(self, exc: Exception) -> ProviderError:
        assert isinstance(exc, anthropic.AnthropicError)
        return map_anthropic_error(self.name, exc)

    def _to_response(self, body: bytes, request: ModelRequest) -> ModelResponse:
        try:
            message = json.loads(body)
        except ValueError:
            message = None
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            raise malformed(self.name, "an answer that is not a JSON message")
        stop_reason = message.get("stop_reason")
        if stop_reason == "refusal":
            raise ContentBlockedError(
                f"Provider '{self.name}' refused to answer (stop reason: refusal)",
                provider=self.name,
            )
        texts: list[str] = []
        tool_calls: list[ToolCall] = []
        for block in message["content"]:
            kind = json_object(block).get("type")
            if kind == "text":
                texts.append(text(block.get("text")))
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise malformed(self.name, "a tool use without its id or name")
                arguments = json.dumps(block.get("input") or {})
                tool_calls.append(ToolCall(id=block["id"], name=block["name"], arguments=arguments))
            # other blocks (thinking, server tools' own) are not part of the answer
        usage = json_object(message.get("usage"))
        cache_read = count(usage.get("cache_read_input_tokens"))
        cache_write = count(usage.get("cache_creation_input_tokens"))
        return ModelResponse(
            model=text(message.get("model")) or request.model,
            text="".join(texts) if texts else None,
            tool_calls=tool_calls,
            usage=Usage(
                input_tokens=count(usage.get("input_tokens")) + cache_read + cache_write,
                output_tokens=count(usage.get("output_tokens")),
                cached_input_tokens=cache_read,
                cache_write_input_tokens=cache_write,
            ),
            finish_reason=_FINISH_REASONS.get(text(stop_reason), text(stop_reason) or "stop"),
        )


class EventReader:
    """Messages stream events assembled into the message `complete` would read: blocks from
    `content_block_start`, their text and `input_json_delta` fragments, usage from
    `message_start` updated by `message_delta`; an `error` event fails the call."""

    def __init__(self, provider: AnthropicProvider, request: ModelRequest, on_text: OnText) -> None:
        self._provider = provider
        self._request = request
        self._on_text = on_text
        self._message: dict[str, Any] = {"content": [], "usage": {}}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._inputs: dict[int, list[str]] = {}
        self._done = False

    def line(self, line: str) -> bool:
        if not line.startswith("data:"):
            return False
        try:
            event = json_object(json.loads(line[len("data:") :]))
        except ValueError:
            raise malformed(self._provider.name, "a stream event that is not JSON") from None
        kind = event.get("type")
        index = event.get("index", 0)
        if kind == "message_start":
            started = json_object(event.get("message"))
            self._message.update({key: value for key, value in started.items() if key != "content"})
            self._message["usage"] = dict(json_object(started.get("usage")))
        elif kind == "content_block_start":
            self._blocks[index] = dict(json_object(event.get("content_block")))
            self._inputs[index] = []
        elif kind == "content_block_delta":
            delta = json_object(event.get("delta"))
            block = self._blocks.setdefault(index, {"type": "text", "text": ""})
            if delta.get("type") == "text_delta":
                piece = text(delta.get("text"))
                block["text"] = text(block.get("text")) + piece
                if piece:
                    self._on_text(piece)
            elif delta.get("type") == "input_json_delta":
                self._inputs.setdefault(index, []).append(text(delta.get("partial_json")))
        elif kind == "message_delta":
            delta = json_object(event.get("delta"))
            if "stop_reason" in delta:
                self._message["stop_reason"] = delta["stop_reason"]
            self._message["usage"].update(  # a count the delta reports, zero included
                {k: v for k, v in json_object(event.get("usage")).items() if v is not None}
            )
        elif kind == "message_stop":
            self._done = True
            return True
        elif kind == "error":
            self._error(json_object(event.get("error")))
        return False

    def _error(self, error: dict[str, Any]) -> None:
        """An `error` event: failed as the HTTP status of its error type would have."""
        raise ProviderError(
            f"Provider '{self._provider.name}' failed mid-stream: "
            f"{text(error.get('type'))}: {text(error.get('message'))}",
            provider=self._provider.name,
            status=STREAM_ERROR_STATUS.get(str(error.get("type")), 500),
            kind="http",
        )

    def result(self) -> ModelResponse:
        if not self._done:
            raise malformed(self._provider.name, "a stream that ended before message_stop")
        content = []
        for index in sorted(self._blocks):
            block = self._blocks[index]
            if block.get("type") == "tool_use":
                raw = "".join(self._inputs.get(index, []))
                try:
                    block["input"] = json.loads(raw) if raw else block.get("input") or {}
                except ValueError:
                    raise malformed(
                        self._provider.name, "a tool use whose input is not JSON"
                    ) from None
            content.append(block)
        self._message["content"] = content
        return self._provider._to_response(json.dumps(self._message).encode(), self._request)


def message_arguments(request: ModelRequest) -> dict[str, Any]:
    """The Messages API's JSON body for a request in the OpenAI chat shape."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in request.messages:
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(_plain_text(message.get("content")))
        elif role == "tool":
            result = {
                "type": "tool_result",
                "tool_use_id": str(message.get("tool_call_id") or ""),
                "content": _plain_text(message.get("content")),
            }
            _add_turn(turns, "user", [result])
        elif role == "assistant":
            _add_turn(turns, "assistant", _assistant_blocks(message))
        else:
            _add_turn(turns, "user", _content_blocks(message.get("content")))
    arguments: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_output_tokens or DEFAULT_MAX_TOKENS,
        "messages": turns,
    }
    _refuse_what_it_has_none_of(request)
    optional = {
        "system": "\n\n".join(part for part in system if part) or None,
        "tools": [_tool(spec) for spec in request.tools] or None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop_sequences": request.stop or None,
        "output_config": _output_config(request.response_format),
    }
    arguments.update({key: value for key, value in optional.items() if value is not None})
    return arguments


def _refuse_what_it_has_none_of(request: ModelRequest) -> None:
    for option in ("stop", *ANTHROPIC_HAS_NONE):
        rule = anthropic_option_rule(option, getattr(request, option))
        if rule is not None:
            raise ValueError(rule)


def _output_config(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    rule = anthropic_response_format_rule(response_format)
    if rule is not None:
        raise ValueError(rule)
    if response_format is None or response_format.get("type") == "text":
        return None
    schema = response_format["json_schema"]["schema"]
    return {"format": {"type": "json_schema", "schema": schema}}


def _add_turn(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    """Add `blocks` as a turn of `role`, to the last turn when it is of that role already."""
    if not blocks:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    blocks = _content_blocks(message.get("content"))
    for call in message.get("tool_calls") or []:
        function = json_object(json_object(call).get("function"))
        blocks.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or ""),
                "name": str(function.get("name") or ""),
                "input": _tool_input(function.get("arguments")),
            }
        )
    return blocks


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's JSON arguments as the `input` object; arguments that are not a JSON
    object (a model's broken output, replayed) are kept whole under `arguments`."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


def _content_blocks(content: Any) -> list[dict[str, Any]]:
    """Content as blocks: a string is one text block; OpenAI's parts map part by part."""
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return [{"type": "text", "text": text(content)}]
    blocks: list[dict[str, Any]] = []
    for part in content:
        part = json_object(part)
        if part.get("type") == "image_url":
            blocks.append(_image(json_object(part.get("image_url")).get("url")))
        elif part.get("type") == "text":
            if part.get("text"):
                blocks.append({"type": "text", "text": text(part.get("text"))})
        else:
            blocks.append({"type": "text", "text": json.dumps(part)})
    return blocks


def _image(url: Any) -> dict[str, Any]:
    """An `image_url` part: a `data:` URL carries the image itself, any other is fetched."""
    url = text(url)
    header, _, data = url.partition(",")
    if url.startswith("data:") and header.endswith(";base64"):
        media_type = header[len("data:") : -len(";base64")]
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }
    return {"type": "image", "source": {"type": "url", "url": url}}


def _plain_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(text(json_object(part).get("text")) for part in content)
    return text(content)


def _tool(spec: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function tool as an Anthropic tool."""
    function = json_object(spec.get("function"))
    tool: dict[str, Any] = {
        "name": function.get("name"),
        "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
    }
    if function.get("description"):
        tool["description"] = function["description"]
    return tool


STREAM_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
"""The HTTP status of each error type of the Messages API, for an `error` event sent
mid-stream (after the 200): an unknown type is a 500."""


def map_anthropic_error(provider: str, exc: anthropic.AnthropicError) -> ProviderError:
    """Translate an SDK exception into the one family the policies classify (an `overloaded`
    529 is a 5xx: transient, as the API means it)."""
    if isinstance(exc, anthropic.APIStatusError):
        said = exc.api_message or (exc.body if isinstance(exc.body, str) and exc.body else None)
        return ProviderError(
            f"HTTP {exc.status_code} from provider '{provider}': {said or exc.message}",
            provider=provider,
            status=exc.status_code,
            kind="http",
            retry_after=parse_retry_after(exc.response.headers),
        )
    if isinstance(exc, anthropic.APITimeoutError):  # a subclass of APIConnectionError
        return ProviderError(
            f"Provider '{provider}' timed out: {exc}", provider=provider, kind="timeout"
        )
    return ProviderError(
        f"Provider '{provider}' could not be reached: {describe(exc)}",
        provider=provider,
        kind="connection",
    )
