"""AnthropicProvider over real HTTP against the stub's Messages API: the translation each way
and its own errors; and runs through the executor on it, alone and in a fallback chain with an
OpenAI-compatible link. What it shares with OpenAIProvider (timeouts, aborts, threads, forks)
is tested on both in test_provider_transport.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import tools
from tests.helpers import MakeRuntime, event_types, run_once, scripted_agent
from tests.stub_provider import (
    Raw,
    Reply,
    StubProvider,
    StubToolCall,
    error,
    reply,
    tool_call,
)
from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ContentBlockedError, ProviderError
from tracon_jobs.providers.anthropic import DEFAULT_MAX_TOKENS, AnthropicProvider
from tracon_jobs.providers.base import ModelRequest

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
def provider(stub: StubProvider) -> Iterator[AnthropicProvider]:
    provider = AnthropicProvider(
        "claude", base_url=stub.root_url, api_key="sk-ant-test", timeout_seconds=5
    )
    yield provider
    provider.close()


def request(**options: Any) -> ModelRequest:
    options.setdefault("messages", [{"role": "user", "content": "hello"}])
    return ModelRequest(model="claude-test", **options)


def failure(provider: AnthropicProvider, signal: AbortSignal | None = None) -> ProviderError:
    with pytest.raises(ProviderError) as raised:
        provider.complete(request(), signal or AbortSignal())
    return raised.value


def test_a_text_reply_with_its_usage(stub: StubProvider, provider: AnthropicProvider) -> None:
    stub.enqueue(reply("hi there", input_tokens=12, output_tokens=3, model="claude-test-1"))

    response = provider.complete(request(), AbortSignal())

    assert response.text == "hi there"
    assert response.model == "claude-test-1"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (12, 3)
    assert (response.finish_reason, response.tool_calls) == ("stop", [])
    headers = {key.lower(): value for key, value in stub.request_headers[0].items()}
    sent_key = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
    assert sent_key == "sk-ant-test"  # the SDK's header of the day: x-api-key or a bearer
    assert headers["anthropic-version"]


def test_tool_use_blocks_are_tool_calls(stub: StubProvider, provider: AnthropicProvider) -> None:
    stub.enqueue(tool_call("weather", {"city": "Oslo"}, call_id="toolu_1", text="Let me look."))

    response = provider.complete(request(tools=[WEATHER_TOOL]), AbortSignal())

    assert response.finish_reason == "tool_calls"
    assert response.text == "Let me look."
    [call] = response.tool_calls
    assert (call.id, call.name, call.arguments) == ("toolu_1", "weather", '{"city": "Oslo"}')
    assert response.as_message()["tool_calls"][0]["function"]["name"] == "weather"


def test_a_conversation_is_sent_in_the_messages_shape(
    stub: StubProvider, provider: AnthropicProvider
) -> None:
    # Given a run's conversation in the OpenAI chat shape: instructions, a question, a turn of
    # two tool calls and their results
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "t2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "not json"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "3 C"},
        {"role": "tool", "tool_call_id": "t2", "content": "5 C"},
    ]

    provider.complete(
        request(messages=messages, tools=[WEATHER_TOOL], temperature=0.2, top_p=0.9),
        AbortSignal(),
    )

    [body] = stub.requests
    assert body["system"] == "You are terse."
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Bergen?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
                {
                    "type": "tool_use",
                    "id": "t2",
                    "name": "weather",
                    "input": {"arguments": "not json"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "3 C"},
                {"type": "tool_result", "tool_use_id": "t2", "content": "5 C"},
            ],
        },
    ]
    assert body["tools"] == [
        {
            "name": "weather",
            "description": "Current weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    assert (body["temperature"], body["top_p"]) == (0.2, 0.9)
    assert body["max_tokens"] == DEFAULT_MAX_TOKENS


def test_options_are_sent_as_the_messages_api_names_them(
    stub: StubProvider, provider: AnthropicProvider
) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}

    provider.complete(
        request(max_output_tokens=300, response_format=response_format), AbortSignal()
    )

    [body] = stub.requests
    assert body["max_tokens"] == 300
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    for option in ("system", "tools", "temperature", "top_p"):
        assert option not in body


def test_a_format_the_api_cannot_honour_sends_nothing(
    stub: StubProvider, provider: AnthropicProvider
) -> None:
    with pytest.raises(ProviderError) as raised:
        provider.complete(request(response_format={"type": "json_object"}), AbortSignal())

    assert raised.value.kind == "configuration"
    assert "json_schema or text" in str(raised.value)
    assert stub.requests == []


def test_stop_is_sent_as_stop_sequences_and_options_that_ask_for_nothing_are_left_out(
    stub: StubProvider, provider: AnthropicProvider
) -> None:
    provider.complete(
        request(stop=["END"], presence_penalty=0, frequency_penalty=0, logit_bias={}),
        AbortSignal(),
    )

    [body] = stub.requests
    assert body["stop_sequences"] == ["END"]
    for option in ("stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed"):
        assert option not in body


@pytest.mark.parametrize(
    "option",
    [
        {"seed": 0},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -1.0},
        {"logit_bias": {"50256": 1}},
        {"reasoning_effort": "low"},
        {"verbosity": "low"},
        {"stop": ["   "]},
    ],
)
def test_an_option_the_api_has_none_of_is_refused_and_nothing_is_sent(
    stub: StubProvider, provider: AnthropicProvider, option: dict[str, Any]
) -> None:
    with pytest.raises(ProviderError) as raised:
        provider.complete(request(**option), AbortSignal())

    assert raised.value.kind == "configuration"
    assert str(raised.value).startswith("Provider 'claude' cannot take this request: an anthropic")
    assert stub.requests == []


def test_an_image_part_is_an_image_block(stub: StubProvider, provider: AnthropicProvider) -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
    ]

    provider.complete(request(messages=[{"role": "user", "content": content}]), AbortSignal())

    [turn] = stub.requests[0]["messages"]
    assert turn["content"] == [
        {"type": "text", "text": "What is this?"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
    ]


def test_cached_input_counts_as_input(stub: StubProvider, provider: AnthropicProvider) -> None:
    body = (
        b'{"type": "message", "model": "claude-test", "content": [{"type": "text", "text": "ok"}],'
        b' "stop_reason": "max_tokens", "usage": {"input_tokens": 5, "output_tokens": 7,'
        b' "cache_creation_input_tokens": 20, "cache_read_input_tokens": 100}}'
    )
    stub.enqueue(Raw(body))

    response = provider.complete(request(), AbortSignal())

    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (125, 7)
    assert (usage.cached_input_tokens, usage.cache_write_input_tokens) == (100, 20)
    assert response.finish_reason == "length"


def test_a_refusal_is_a_blocked_answer(stub: StubProvider, provider: AnthropicProvider) -> None:
    stub.enqueue(Raw(b'{"type": "message", "content": [], "stop_reason": "refusal"}'))

    with pytest.raises(ContentBlockedError):
        provider.complete(request(), AbortSignal())


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"<html>bad gateway</html>", "not a JSON message"),
        (b'{"type": "message"}', "not a JSON message"),
        (b'{"content": [{"type": "tool_use", "input": {}}]}', "a tool use without its id or name"),
    ],
)
def test_an_answer_that_is_no_message_is_a_connection_error(
    stub: StubProvider, provider: AnthropicProvider, body: bytes, says: str
) -> None:
    stub.enqueue(Raw(body))

    raised = failure(provider)

    assert raised.kind == "connection"
    assert says in str(raised)


def test_overloaded_is_a_5xx_sent_exactly_once(
    stub: StubProvider, provider: AnthropicProvider
) -> None:
    stub.enqueue(error(529, message="Overloaded"))

    raised = failure(provider)

    assert (raised.status, raised.kind, raised.provider) == (529, "http", "claude")
    assert str(raised) == "HTTP 529 from provider 'claude': Overloaded"
    assert len(stub.requests) == 1  # max_retries=0: the SDK did not retry on its own


def _agent(primary: dict[str, Any], backup: dict[str, Any] | None = None) -> dict[str, Any]:
    config = scripted_agent([], ["charge_card", "lookup_order"])
    config["Providers"] = {"a": primary}
    model: dict[str, Any] = {"provider": "a", "model": "claude-a"}
    if backup is not None:
        config["Providers"]["b"] = backup
        model["fallbacks"] = [{"provider": "b", "model": "gpt-b"}]
    config["Agents"]["demo"]["Model"] = model
    config["Pricing"] = {
        "Models": {
            "claude-a": {
                "InputPerMillion": 3,
                "OutputPerMillion": 15,
                "CachedInputPerMillion": 0.3,
            },
            "gpt-b": {"InputPerMillion": 10, "OutputPerMillion": 20},
        }
    }
    return config


def test_a_run_calls_a_tool_and_answers_through_the_messages_api(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    anthropic = {"Kind": "anthropic", "BaseUrl": stub_provider.root_url, "ApiKey": "sk-ant-x"}
    runtime = make_runtime(sql_url, **_agent(anthropic))
    stub_provider.enqueue(
        tool_call("lookup_order", {"order_id": "A-1"}, call_id="toolu_9"),
        Reply("It shipped.", input_tokens=1000, output_tokens=100, cached_input_tokens=800),
    )

    run = run_once(runtime, "Where is A-1?")

    assert run.status == "Completed" and run.output == {"text": "It shipped."}
    events = event_types(runtime, run.id)
    assert events.count("ToolCallCompleted") == 1 and events[-1] == "RunCompleted"
    first, second = stub_provider.requests
    assert first["tools"][0]["name"] in ("charge_card", "lookup_order")
    assert second["messages"][-2]["content"][-1]["type"] == "tool_use"
    result = second["messages"][-1]["content"][-1]
    assert (result["type"], result["tool_use_id"]) == ("tool_result", "toolu_9")
    assert (run.input_tokens, run.output_tokens) == (10 + 1000, 5 + 100)
    # the 800 tokens read from the prompt cache at CachedInputPerMillion 0.3
    assert float(run.cost_amount) == pytest.approx((210 * 3 + 800 * 0.3 + 105 * 15) / 1_000_000)
    completed = [e for e in runtime.runs.events(run.id) if e.type == "ModelCallCompleted"]
    assert completed[-1].data["usage"]["cachedInputTokens"] == 800
    assert completed[0].data["usage"]["cachedInputTokens"] == 0
    assert run.model_id == "claude-a"


def test_an_overloaded_anthropic_link_falls_back_and_a_charge_runs_once(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    with StubProvider() as backup:
        anthropic = {"Kind": "anthropic", "BaseUrl": stub_provider.root_url, "ApiKey": "k"}
        runtime = make_runtime(
            sql_url, **_agent(anthropic, {"Kind": "openai", "BaseUrl": backup.base_url})
        )
        charge = Reply(None, tool_calls=(StubToolCall("charge_card", {"amount_cents": 700}),))
        before = len(tools.charges)
        # Given the Anthropic link asks for a charge, then is overloaded
        stub_provider.enqueue(charge, error(529, message="Overloaded"))
        # And the OpenAI-compatible fallback asks for the very same charge, then answers
        backup.enqueue(charge, reply("charged once"))

        run = run_once(runtime)

    assert run.status == "Completed" and run.output == {"text": "charged once"}
    assert len(tools.charges) - before == 1, "the charge ran exactly once"
    events = event_types(runtime, run.id)
    assert "ToolCallAnsweredFromLedger" in events and "ModelFallbackUsed" in events
    assert [(a["provider"], a["outcome"], a.get("status")) for a in run.model_attempts or []] == [
        ("a", "failed", 529),
        ("b", "succeeded", None),
    ]
