"""OpenAIProvider over real HTTP against the stub server: replies, options and its own errors.
What it shares with AnthropicProvider (error statuses, timeouts, aborts, threads, forks) is
tested on both in test_provider_transport.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from tests.stub_provider import (
    Raw,
    Reply,
    StubProvider,
    StubToolCall,
    error,
    reply,
    tool_call,
    tool_calls,
)
from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ContentBlockedError, ProviderError
from tracon_jobs.providers.base import ModelRequest
from tracon_jobs.providers.openai import OpenAIProvider, parse_retry_after

pytestmark = pytest.mark.timeout(20)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def stub() -> Iterator[StubProvider]:
    with StubProvider() as server:
        yield server


@pytest.fixture
def provider(stub: StubProvider) -> Iterator[OpenAIProvider]:
    provider = OpenAIProvider("stub", base_url=stub.base_url, api_key="", timeout_seconds=5)
    yield provider
    provider.close()


def request(**options: object) -> ModelRequest:
    return ModelRequest(
        model="gpt-test",
        messages=[{"role": "user", "content": "hello"}],
        **options,  # type: ignore[arg-type]
    )


def failure(provider: OpenAIProvider, signal: AbortSignal | None = None) -> ProviderError:
    with pytest.raises(ProviderError) as raised:
        provider.complete(request(), signal or AbortSignal())
    return raised.value


def test_text_reply_with_usage(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.enqueue(reply("hi there", input_tokens=12, output_tokens=3, model="gpt-test-0613"))

    response = provider.complete(request(), AbortSignal())

    assert response.text == "hi there"
    assert response.model == "gpt-test-0613"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (12, 3)
    assert response.finish_reason == "stop"
    assert response.tool_calls == []


def test_an_empty_api_key_is_sent_as_a_placeholder(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    provider.complete(request(), AbortSignal())

    headers = {k.lower(): v for k, v in stub.request_headers[0].items()}
    assert headers["authorization"] == "Bearer not-needed"


def test_cached_input_tokens_are_read(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.enqueue(Reply("hi", input_tokens=1000, cached_input_tokens=768))

    usage = provider.complete(request(), AbortSignal()).usage

    assert (usage.input_tokens, usage.cached_input_tokens, usage.cache_write_input_tokens) == (
        1000,
        768,
        0,
    )


def test_tool_calls_are_parsed(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.enqueue(tool_call("weather", {"city": "Oslo"}, call_id="call_abc"))

    response = provider.complete(request(tools=[WEATHER_TOOL]), AbortSignal())

    assert response.finish_reason == "tool_calls"
    [call] = response.tool_calls
    assert (call.id, call.name, call.arguments) == ("call_abc", "weather", '{"city": "Oslo"}')


def test_several_tool_calls_keep_their_order(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.enqueue(tool_calls(StubToolCall("a", {}), StubToolCall("b", {"x": 1})))

    response = provider.complete(request(), AbortSignal())

    assert [call.name for call in response.tool_calls] == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "content_type", "says"),
    [
        (b"<html>bad gateway</html>", "text/html", "not a JSON chat completion"),
        (b'{"choices": [', "application/json", "not a JSON chat completion"),
        (b'{"id": "x", "choices": []}', "application/json", "a completion without choices"),
        (
            b'{"choices": [{"message": {"tool_calls": [{"id": "c1", "type": "function"}]}}]}',
            "application/json",
            "a tool call without its id, name or arguments",
        ),
    ],
)
def test_an_answer_that_is_no_completion_is_a_connection_error(
    stub: StubProvider, provider: OpenAIProvider, body: bytes, content_type: str, says: str
) -> None:
    stub.enqueue(Raw(body, content_type))

    error = failure(provider)

    assert error.kind == "connection" and says in str(error)


def test_a_minimal_completion_and_a_custom_tool_call_are_read(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    # Given a server that leaves out usage, model and finish reason, and calls a custom tool
    call = {"id": "c9", "type": "custom", "custom": {"name": "grep", "input": "needle"}}
    stub.enqueue(Raw(json.dumps({"choices": [{"message": {"tool_calls": [call]}}]}).encode()))

    response = provider.complete(request(), AbortSignal())

    assert response.model == "gpt-test" and response.finish_reason == "stop"
    assert response.text is None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (0, 0)
    [tool] = response.tool_calls
    assert (tool.id, tool.name, tool.arguments) == ("c9", "grep", "needle")


def test_an_answer_stopped_by_the_content_filter_is_blocked(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    choice = {"message": {"content": None}, "finish_reason": "content_filter"}
    stub.enqueue(Raw(json.dumps({"choices": [choice]}).encode()))

    with pytest.raises(ContentBlockedError, match="content filter"):
        provider.complete(request(), AbortSignal())


def test_request_carries_the_options_as_given(stub: StubProvider, provider: OpenAIProvider) -> None:
    provider.complete(
        request(
            tools=[WEATHER_TOOL],
            temperature=0.2,
            top_p=0.9,
            max_output_tokens=64,
            response_format={"type": "json_object"},
        ),
        AbortSignal(),
    )

    [body] = stub.requests
    assert body["model"] == "gpt-test"
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["tools"] == [WEATHER_TOOL]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.2, 0.9, 64)
    assert body["response_format"] == {"type": "json_object"}


def test_a_runs_own_options_are_sent_as_chat_completions_names_them(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    provider.complete(
        request(
            stop=["END"],
            seed=0,
            presence_penalty=0.5,
            frequency_penalty=0,
            logit_bias={"50256": -100},
            reasoning_effort="low",
            verbosity="high",
        ),
        AbortSignal(),
    )

    [body] = stub.requests
    assert (body["stop"], body["seed"], body["logit_bias"]) == (["END"], 0, {"50256": -100})
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.5, 0)
    assert (body["reasoning_effort"], body["verbosity"]) == ("low", "high")


def test_unset_options_are_left_out(stub: StubProvider, provider: OpenAIProvider) -> None:
    provider.complete(request(stop=[], logit_bias={}), AbortSignal())

    [body] = stub.requests
    for option in (
        "tools",
        "temperature",
        "top_p",
        "max_tokens",
        "response_format",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "reasoning_effort",
        "verbosity",
    ):
        assert option not in body


def test_404_is_an_http_error(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.enqueue(error(404, message="model gpt-test does not exist"))

    raised = failure(provider)

    assert (raised.status, raised.kind) == (404, "http")
    assert "model gpt-test does not exist" in str(raised)


@pytest.mark.timeout(10)
def test_retry_after_accepts_seconds_milliseconds_and_dates() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)

    assert parse_retry_after({"Retry-After": "7"}) == 7
    assert parse_retry_after({"retry-after-ms": "1500", "Retry-After": "9"}) == 1.5
    assert parse_retry_after({"Retry-After": "Wed, 01 Jan 2025 12:00:30 GMT"}, now) == 30
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({}) is None
