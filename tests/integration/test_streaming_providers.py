"""Both SDK providers read an answer as it streams, against the stub's server-sent events:
the answer equals `complete`'s for the same scripted reply, and text arrives before the end."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.stub_provider import Reply, StubProvider, StubToolCall, error, stream_then_drop
from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError
from tracon_jobs.providers.anthropic import AnthropicProvider
from tracon_jobs.providers.base import ModelRequest, can_stream
from tracon_jobs.providers.openai import OpenAIProvider
from tracon_jobs.providers.sdk import SdkProvider

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
    assert time.monotonic() - cut_at[0] < 0.5


def test_the_total_timeout_ends_a_trickling_stream(stub: StubProvider) -> None:
    provider = OpenAIProvider("p", base_url=stub.base_url, api_key="k", timeout_seconds=0.5)
    stub.enqueue(Reply("y" * 40, chunks=40, chunk_delay=0.1))
    started = time.monotonic()
    with pytest.raises(ProviderError) as raised:
        provider.stream(REQUEST, AbortSignal(), lambda _: None)
    assert raised.value.kind == "timeout"
    assert time.monotonic() - started < 1.5
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
    stub_provider.enqueue(Reply("one two three", chunks=3, chunk_delay=1.0))
    started = time.monotonic()
    with pytest.raises(ProviderError) as failed:
        provider.stream(
            ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}]),
            AbortSignal(),
            lambda piece: None,
        )
    assert failed.value.kind == "timeout"
    assert time.monotonic() - started < 2.0, "the idle timeout did not end the wait"
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
