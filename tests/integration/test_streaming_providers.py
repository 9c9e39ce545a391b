"""Both SDK providers read an answer as it streams, against the stub's server-sent events:
the answer equals `complete`'s for the same scripted reply, and text arrives before the end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.stub_provider import (
    Exchange,
    Reply,
    StubProvider,
    StubToolCall,
    error,
    stream_then_drop,
    stream_then_error,
)
from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ContentBlockedError, ProviderError
from tracon_jobs.providers.anthropic import AnthropicProvider
from tracon_jobs.providers.base import ModelRequest, can_stream
from tracon_jobs.providers.openai import OpenAIProvider
from tracon_jobs.providers.sdk import SdkProvider
from tracon_jobs.resilience.classify import Verdict, classify

pytestmark = pytest.mark.timeout(20)

REQUEST = ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}])


@pytest.fixture
def stub() -> Iterator[StubProvider]:
    with StubProvider() as server:
        yield server


@pytest.fixture(params=["openai", "anthropic"])
def provider(request: pytest.FixtureRequest, stub: StubProvider) -> Iterator[SdkProvider]:
    made: SdkProvider
    if request.param == "openai":
        made = OpenAIProvider("p", base_url=stub.base_url, api_key="k", timeout_seconds=5)
    else:
        made = AnthropicProvider("p", base_url=stub.root_url, api_key="k", timeout_seconds=5)
    yield made
    made.close()


ANSWERS = [
    Reply("hello there, streaming world", cached_input_tokens=4),
    Reply(None, tool_calls=(StubToolCall("weather", {"city": "Oslo"}, "c1"),)),
    Reply(
        "two calls",
        tool_calls=(StubToolCall("a", {"x": 1}, "c1"), StubToolCall("b", {"y": [2]}, "c2")),
    ),
]


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_streamed_answer_equals_the_completed_one(
    stub: StubProvider, provider: SdkProvider, answer: Reply
) -> None:
    stub.enqueue(answer, answer)
    completed = provider.complete(REQUEST, AbortSignal())
    pieces: list[str] = []
    streamed = provider.stream(REQUEST, AbortSignal(), pieces.append)
    assert streamed == completed
    assert "".join(pieces) == (completed.text or "")
    assert stub.requests[1]["stream"] is True
    assert can_stream(provider)


def test_text_arrives_before_the_call_ends(stub: StubProvider, provider: SdkProvider) -> None:
    stub.enqueue(Reply("abcdefghij", chunks=5, chunk_delay=0.05))
    arrivals: list[float] = []
    started = time.monotonic()
    response = provider.stream(REQUEST, AbortSignal(), lambda _: arrivals.append(time.monotonic()))
    ended = time.monotonic()
    assert response.text == "abcdefghij"
    assert len(arrivals) == 5
    assert arrivals[0] - started < (ended - started) - 0.1


def test_a_cancel_cuts_the_stream(stub: StubProvider, provider: SdkProvider) -> None:
    stub.enqueue(Reply("x" * 40, chunks=40, chunk_delay=0.2))
    signal = AbortSignal()
    cut_at: list[float] = []

    def on_text(_: str) -> None:
        if not cut_at:
            cut_at.append(time.monotonic())
            signal.abort("test")

    with pytest.raises(ProviderError) as raised:
        provider.stream(REQUEST, signal, on_text)
    assert raised.value.kind == "cancelled"
    assert time.monotonic() - cut_at[0] < 4  # not the stream's 8 s


def test_the_total_timeout_ends_a_trickling_stream(stub: StubProvider) -> None:
    provider = OpenAIProvider("p", base_url=stub.base_url, api_key="k", timeout_seconds=0.5)
    stub.enqueue(Reply("y" * 40, chunks=40, chunk_delay=0.1))
    started = time.monotonic()
    with pytest.raises(ProviderError) as raised:
        provider.stream(REQUEST, AbortSignal(), lambda _: None)
    assert raised.value.kind == "timeout"
    assert time.monotonic() - started < 3  # not the stream's 4 s
    provider.close()


def test_a_stream_cut_mid_answer_is_a_connection_failure(
    stub: StubProvider, provider: SdkProvider
) -> None:
    stub.enqueue(stream_then_drop("some text that never ends", after_chunks=3))
    with pytest.raises(ProviderError) as raised:
        provider.stream(REQUEST, AbortSignal(), lambda _: None)
    assert raised.value.kind == "connection"


def test_an_http_error_before_the_stream_keeps_its_status(
    stub: StubProvider, provider: SdkProvider
) -> None:
    stub.enqueue(error(429, retry_after=3))
    with pytest.raises(ProviderError) as raised:
        provider.stream(REQUEST, AbortSignal(), lambda _: None)
    assert (raised.value.status, raised.value.retry_after) == (429, 3.0)


@pytest.fixture
def anthropic_provider(stub: StubProvider) -> Iterator[AnthropicProvider]:
    made = AnthropicProvider("p", base_url=stub.root_url, api_key="k", timeout_seconds=5)
    yield made
    made.close()


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("max_tokens", "length"),
        ("model_context_window_exceeded", "length"),
        ("stop_sequence", "stop"),
        ("pause_turn", "stop"),
        ("a_reason_of_tomorrow", "a_reason_of_tomorrow"),
    ],
)
def test_an_anthropic_stream_keeps_any_stop_reason_as_complete_does(
    stub: StubProvider,
    anthropic_provider: AnthropicProvider,
    stop_reason: str,
    finish_reason: str,
) -> None:
    answer = Reply("cut short at the", output_tokens=7, stop_reason=stop_reason, chunks=4)
    stub.enqueue(answer, answer)
    completed = anthropic_provider.complete(REQUEST, AbortSignal())
    pieces: list[str] = []
    streamed = anthropic_provider.stream(REQUEST, AbortSignal(), pieces.append)
    assert completed.finish_reason == finish_reason
    assert (completed.text, completed.usage.input_tokens, completed.usage.output_tokens) == (
        "cut short at the",
        10,
        7,
    )
    assert streamed == completed
    assert "".join(pieces) == "cut short at the" and len(pieces) == 4


def test_an_anthropic_refusal_is_blocked_content_streamed_or_not(
    stub: StubProvider, anthropic_provider: AnthropicProvider
) -> None:
    answer = Reply("I will not", stop_reason="refusal")
    stub.enqueue(answer, answer)
    with pytest.raises(ContentBlockedError) as completed:
        anthropic_provider.complete(REQUEST, AbortSignal())
    pieces: list[str] = []
    with pytest.raises(ContentBlockedError) as streamed:
        anthropic_provider.stream(REQUEST, AbortSignal(), pieces.append)
    assert completed.value.kind == streamed.value.kind == "content_blocked"
    assert classify(streamed.value) == classify(completed.value) == Verdict(False, False)
    assert "".join(pieces) == "I will not"


@pytest.mark.parametrize(
    ("error_type", "status"),
    [
        ("overloaded_error", 529),
        ("api_error", 500),
        ("rate_limit_error", 429),
        ("invalid_request_error", 400),
        ("some_new_error", 500),
    ],
)
def test_an_anthropic_error_event_mid_stream_fails_as_that_status_would(
    stub: StubProvider, anthropic_provider: AnthropicProvider, error_type: str, status: int
) -> None:
    stub.enqueue(error(status, message="Overloaded"))
    with pytest.raises(ProviderError) as answered:
        anthropic_provider.complete(REQUEST, AbortSignal())
    # message_start, content_block_start, two of the three text deltas, then the error event
    stub.enqueue(stream_then_error("abcdefghijkl", after_chunks=4, error_type=error_type))
    pieces: list[str] = []
    with pytest.raises(ProviderError) as streamed:
        anthropic_provider.stream(REQUEST, AbortSignal(), pieces.append)
    failure = streamed.value
    assert (failure.kind, failure.status, failure.retry_after) == ("http", status, None)
    assert (failure.kind, failure.status) == (answered.value.kind, answered.value.status)
    assert classify(failure) == classify(answered.value)
    if status >= 500:
        assert classify(failure) == Verdict(counts=True, transient=True)
    assert error_type in str(failure) and "Overloaded" in str(failure)
    assert pieces == ["abcd", "efgh"]  # "ijkl" never came


def test_a_provider_set_not_to_stream_cannot(stub: StubProvider) -> None:
    provider = OpenAIProvider(
        "p", base_url=stub.base_url, api_key="k", timeout_seconds=5, stream=False
    )
    assert not can_stream(provider)


def test_a_stream_that_goes_quiet_ends_at_its_idle_timeout(stub_provider: StubProvider) -> None:
    provider = OpenAIProvider(
        "quiet",
        base_url=stub_provider.base_url,
        api_key=None,
        timeout_seconds=10,
        idle_timeout_seconds=0.3,
    )
    stub_provider.enqueue(Reply("one two three", chunks=3, chunk_delay=5.0))
    started = time.monotonic()
    with pytest.raises(ProviderError) as failed:
        provider.stream(
            ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}]),
            AbortSignal(),
            lambda piece: None,
        )
    assert failed.value.kind == "timeout"
    assert time.monotonic() - started < 4.0, "the idle timeout did not end the wait"
    provider.close()


@pytest.mark.parametrize(
    ("provider", "named"),
    [
        ({"Kind": "scripted", "Stream": True, "Script": [{"Text": "hi"}]}, "Stream"),
        ({"Kind": "openai", "TimeoutSeconds": 5, "IdleTimeoutSeconds": 6}, "IdleTimeoutSeconds"),
    ],
)
def test_stream_settings_that_cannot_hold_are_refused(provider: dict, named: str) -> None:
    from pydantic import ValidationError

    from tracon_jobs.settings import Settings

    with pytest.raises(ValidationError) as refused:
        Settings.model_validate({"Providers": {"p": provider}})
    assert named in str(refused.value)


def test_streamed_calls_one_after_another_share_one_connection(
    stub: StubProvider, provider: SdkProvider
) -> None:
    # the body's end is read after the last event, so the connection goes back to the pool
    for _ in range(3):
        stub.enqueue(Reply("one two three four", chunks=4))
        answer = provider.stream(REQUEST, AbortSignal(), lambda piece: None)
        assert answer.text == "one two three four"

    assert len(stub.peers) == 3 and len(set(stub.peers)) == 1


@dataclass(frozen=True)
class DoneButOpen:
    """A whole stream whose body the server then keeps open (no end of body)."""

    reply: Reply

    def respond(self, exchange: Exchange) -> None:
        reply = self.reply
        anthropic = exchange.api == "anthropic"
        events = (
            reply.message_events(exchange.body)
            if anthropic
            else reply.completion_chunks(exchange.body)
        )
        exchange.send_events(events, end=False)
        exchange.stopping.wait(5)


def test_a_body_kept_open_after_the_last_event_costs_a_moment_not_the_call(
    stub: StubProvider, provider: SdkProvider
) -> None:
    stub.enqueue(DoneButOpen(Reply("all of it", chunks=2)))
    started = time.monotonic()

    answer = provider.stream(REQUEST, AbortSignal(), lambda piece: None)

    assert answer.text == "all of it"
    assert time.monotonic() - started < 4.0  # not the body's 5 s
