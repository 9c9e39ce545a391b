"""OpenAIProvider over real HTTP against the stub server: replies, errors, timeouts, aborts."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from multiprocessing.queues import Queue

import pytest

from tests.stub_provider import (
    Raw,
    StubProvider,
    StubToolCall,
    drop,
    error,
    hang,
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


def test_unset_options_are_left_out(stub: StubProvider, provider: OpenAIProvider) -> None:
    provider.complete(request(), AbortSignal())

    [body] = stub.requests
    for option in ("tools", "temperature", "top_p", "max_tokens", "response_format"):
        assert option not in body


def test_503_is_an_http_error_sent_exactly_once(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    stub.enqueue(error(503, message="overloaded, try later"))

    raised = failure(provider)

    assert (raised.status, raised.kind, raised.provider) == (503, "http", "stub")
    assert str(raised) == "HTTP 503 from provider 'stub': overloaded, try later"
    assert raised.retry_after is None
    assert len(stub.requests) == 1  # max_retries=0: the SDK did not retry on its own


def test_429_carries_retry_after(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.enqueue(error(429, retry_after=7, message="slow down"))

    raised = failure(provider)

    assert (raised.status, raised.kind, raised.retry_after) == (429, "http", 7)
    assert len(stub.requests) == 1


def test_404_is_an_http_error(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.enqueue(error(404, message="model gpt-test does not exist"))

    raised = failure(provider)

    assert (raised.status, raised.kind) == (404, "http")
    assert "model gpt-test does not exist" in str(raised)


def test_a_dropped_connection_is_a_connection_error(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    stub.enqueue(drop())

    raised = failure(provider)

    assert (raised.kind, raised.status) == ("connection", None)
    assert len(stub.requests) == 1


def test_nothing_listening_is_a_connection_error() -> None:
    with StubProvider() as gone:
        base_url = gone.base_url
    provider = OpenAIProvider("gone", base_url=base_url, api_key=None, timeout_seconds=2)

    raised = failure(provider)

    assert raised.kind == "connection"


def test_a_hang_past_the_timeout_is_a_timeout(stub: StubProvider) -> None:
    provider = OpenAIProvider("stub", base_url=stub.base_url, api_key="k", timeout_seconds=0.5)
    stub.enqueue(hang(10))
    started = time.monotonic()

    raised = failure(provider)

    assert raised.kind == "timeout"
    assert time.monotonic() - started < 5
    provider.close()


@pytest.mark.timeout(10)
def test_an_abort_ends_a_blocked_call_promptly(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    # Given a call that the server will not answer for 30 s
    stub.enqueue(hang(30))
    signal = AbortSignal()
    threading.Timer(0.2, signal.abort, args=("cancelled",)).start()
    started = time.monotonic()

    # When another thread aborts it
    raised = failure(provider, signal)

    # Then it ends at once, and the request is really closed on the wire
    assert raised.kind == "cancelled"
    assert time.monotonic() - started < 1.5
    assert _eventually(lambda: stub.in_progress == 0)


def test_the_provider_still_works_after_an_abort(
    stub: StubProvider, provider: OpenAIProvider
) -> None:
    stub.enqueue(hang(30), reply("after abort"))
    signal = AbortSignal()

    def abort_once_the_server_holds_it() -> None:
        # not after a fixed delay: a cold client may not have sent the call yet, and the
        # next call would then be the one that hangs
        _eventually(lambda: stub.in_progress == 1, timeout=10)
        signal.abort()

    threading.Thread(target=abort_once_the_server_holds_it, daemon=True).start()
    assert failure(provider, signal).kind == "cancelled"

    assert provider.complete(request(), AbortSignal()).text == "after abort"


def test_an_abort_cuts_only_its_own_call(stub: StubProvider, provider: OpenAIProvider) -> None:
    # Given two calls of two threads in flight on one provider (one pool of connections)
    stub.default = hang(1.0, reply("undisturbed"))
    doomed = AbortSignal()
    outcomes: dict[str, object] = {}

    def call(name: str, signal: AbortSignal) -> None:
        try:
            outcomes[name] = provider.complete(request(), signal).text
        except ProviderError as exc:
            outcomes[name] = exc.kind

    threads = [
        threading.Thread(target=call, args=("doomed", doomed)),
        threading.Thread(target=call, args=("other", AbortSignal())),
    ]
    for thread in threads:
        thread.start()
    assert _eventually(lambda: stub.in_progress == 2, timeout=10)

    # When one of them is aborted
    doomed.abort("cancelled")
    for thread in threads:
        thread.join(timeout=10)

    # Then only that one ends cancelled; the other gets its answer
    assert outcomes == {"doomed": "cancelled", "other": "undisturbed"}


def test_an_aborted_signal_sends_nothing(stub: StubProvider, provider: OpenAIProvider) -> None:
    signal = AbortSignal()
    signal.abort("deadline")

    raised = failure(provider, signal)

    assert raised.kind == "cancelled"
    assert "deadline" in str(raised)
    assert stub.requests == []


def test_concurrent_calls_share_one_provider(stub: StubProvider, provider: OpenAIProvider) -> None:
    stub.default = hang(0.5, reply("together"))
    texts: list[str | None] = []

    def call() -> None:
        texts.append(provider.complete(request(), AbortSignal()).text)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert texts == ["together"] * 4
    assert stub.peak_in_progress == 4


def _complete_in_child(provider: OpenAIProvider, results: Queue[str | None]) -> None:
    results.put(provider.complete(request(), AbortSignal()).text)


def test_a_forked_child_gets_its_own_client(stub: StubProvider, provider: OpenAIProvider) -> None:
    # Given a provider whose client already holds a connection of the parent
    stub.default = reply("from somewhere")
    provider.complete(request(), AbortSignal())
    context = multiprocessing.get_context("fork")
    results: Queue[str | None] = context.Queue()

    # When a forked child (whose copy of that connection is its parent's) uses the provider
    child = context.Process(target=_complete_in_child, args=(provider, results))
    child.start()
    child.join(timeout=10)
    if child.is_alive():  # a stuck child must not outlive the test
        child.kill()
        child.join()

    # Then it answers through a client and a connection of its own
    assert child.exitcode == 0
    assert results.get(timeout=1) == "from somewhere"
    assert len(stub.requests) == 2


def test_retry_after_accepts_seconds_milliseconds_and_dates() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)

    assert parse_retry_after({"Retry-After": "7"}) == 7
    assert parse_retry_after({"retry-after-ms": "1500", "Retry-After": "9"}) == 1.5
    assert parse_retry_after({"Retry-After": "Wed, 01 Jan 2025 12:00:30 GMT"}, now) == 30
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({}) is None


def _eventually(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Poll a condition the server reaches on its own thread (no fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
