"""The Provider protocol and the values that cross it.

Messages use the OpenAI chat shape (`{"role", "content", "tool_calls"?, "tool_call_id"?}`)
because every provider kind tracon-jobs speaks can be mapped to it, and because a run's
stored messages must be replayable on any link of a fallback chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

from tracon_jobs.abort import AbortSignal

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the raw JSON text the model produced

    def as_message_part(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Usage:
    """Tokens of one call. `input_tokens` counts every input token; of those, the provider's
    prompt cache served `cached_input_tokens` and wrote `cache_write_input_tokens` (each
    priced at its own rate when `Pricing` gives one)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_input_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class ModelRequest:
    model: str
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI "function" tool specs
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    # a run's own options (`runs.request_options`): None, or for `stop` and `logit_bias` empty,
    # asks for nothing; a provider that cannot honour one that asks for something refuses it
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, int] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


@dataclass(frozen=True)
class ModelResponse:
    model: str  # the model that answered, as the provider reports it
    text: str | None
    tool_calls: list[ToolCall]
    usage: Usage
    finish_reason: str = "stop"
    provider_wait: float | None = None
    """Seconds until the provider takes calls again, when its answer said a rate limit of
    its own has nothing left (OpenAI's `x-ratelimit-*`, Anthropic's `anthropic-ratelimit-*`)."""

    def as_message(self) -> Message:
        message: Message = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.as_message_part() for call in self.tool_calls]
        return message


class Provider(Protocol):
    """One configured provider. Implementations are thread-safe and shared per process.

    `complete` raises `ProviderError` (with `status`, or `kind` "connection"/"timeout") on
    failure, and returns promptly with `ProviderError(kind="cancelled")` when `signal` fires:
    an in-flight HTTP call is aborted, not waited out.
    """

    name: str

    def complete(self, request: ModelRequest, signal: AbortSignal) -> ModelResponse: ...

    def close(self) -> None: ...


OnText = Callable[[str], None]
"""Called with each piece of an answer's text as a streaming call reads it."""


class StreamingProvider(Provider, Protocol):
    """A provider that can read an answer as it arrives. `streams` is False when its
    settings turn streaming off (`Providers.<name>.Stream: false`): then only `complete`.

    `stream` returns the same `ModelResponse` as `complete` would for the same answer (text
    and tool calls assembled from their deltas, usage from the stream's own report), calls
    `on_text` with each piece of text as it arrives, and fails as `complete` does; a cancel
    cuts the stream at once, and a wait between chunks longer than the provider's idle
    timeout fails the call (`kind="timeout"`)."""

    streams: bool

    def stream(
        self, request: ModelRequest, signal: AbortSignal, on_text: OnText
    ) -> ModelResponse: ...


def can_stream(provider: Provider) -> TypeGuard[StreamingProvider]:
    return bool(getattr(provider, "streams", False)) and hasattr(provider, "stream")
