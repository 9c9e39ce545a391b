"""What every SDK-backed provider (`openai`, `anthropic`) does the same way over real HTTP
against the stub server, each test run on both: error statuses, dropped connections,
timeouts, aborts, threads and forks."""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue

import pytest

from tests.helpers import wait_until
from tests.stub_provider import StubProvider, drop, error, hang, reply
from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError
from tracon_jobs.providers.anthropic import AnthropicProvider
from tracon_jobs.providers.base import ModelRequest
from tracon_jobs.providers.openai import OpenAIProvider
from tracon_jobs.providers.sdk import SdkProvider

pytestmark = pytest.mark.timeout(20)

Make = Callable[..., SdkProvider]


@pytest.fixture(params=["openai", "anthropic"])
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """A provider of the kind under test, named `stub`, on `server`'s route for that kind."""
    made: list[SdkProvider] = []

    def build(server: StubProvider, *, timeout_seconds: float = 5) -> SdkProvider:
        kind = OpenAIProvider if request.param == "openai" else AnthropicProvider
        url = server.base_url if request.param == "openai" else server.root_url
        provider = kind("stub", base_url=url, api_key="k", timeout_seconds=timeout_seconds)
        made.append(provider)
        return provider

    yield build
    for provider in made:
        provider.close()


@pytest.fixture
def stub() -> Iterator[StubProvider]:
    with StubProvider() as server:
        yield server


@pytest.fixture
def provider(stub: StubProvider, make: Make) -> SdkProvider:
    return make(stub)


def request() -> ModelRequest:
    return ModelRequest(model="test-model", messages=[{"role": "user", "content": "hello"}])


def failure(provider: SdkProvider, signal: AbortSignal | None = None) -> ProviderError:
    with pytest.raises(ProviderError) as raised:
        provider.complete(request(), signal or AbortSignal())
    return raised.value


def test_503_is_an_http_error_sent_exactly_once(stub: StubProvider, provider: SdkProvider) -> None:
    stub.enqueue(error(503, message="overloaded, try later"))

    raised = failure(provider)

    assert (raised.status, raised.kind, raised.provider) == (503, "http", "stub")
    assert str(raised) == "HTTP 503 from provider 'stub': overloaded, try later"
    assert raised.retry_after is None
    assert len(stub.requests) == 1  # max_retries=0: the SDK did not retry on its own


def test_429_carries_retry_after(stub: StubProvider, provider: SdkProvider) -> None:
    stub.enqueue(error(429, retry_after=7, message="slow down"))

    raised = failure(provider)

    assert (raised.status, raised.kind, raised.retry_after) == (429, "http", 7)
    assert len(stub.requests) == 1


def test_a_dropped_connection_is_a_connection_error(
    stub: StubProvider, provider: SdkProvider
) -> None:
    stub.enqueue(drop())

    raised = failure(provider)

    assert (raised.kind, raised.status) == ("connection", None)
    assert len(stub.requests) == 1


def test_nothing_listening_is_a_connection_error(make: Make) -> None:
    with StubProvider() as gone:
        provider = make(gone, timeout_seconds=2)

    raised = failure(provider)

    assert raised.kind == "connection"


def test_a_hang_past_the_timeout_is_a_timeout(stub: StubProvider, make: Make) -> None:
    provider = make(stub, timeout_seconds=0.5)
    stub.enqueue(hang(10))
    started = time.monotonic()

    raised = failure(provider)

    assert raised.kind == "timeout"
    assert time.monotonic() - started < 5


def test_an_abort_ends_a_blocked_call_promptly(stub: StubProvider, provider: SdkProvider) -> None:
    # Given a call that the server will not answer for 30 s
    stub.enqueue(hang(30))
    signal = AbortSignal()
    threading.Timer(0.2, signal.abort, args=("cancelled",)).start()
    started = time.monotonic()

    # When another thread aborts it
    raised = failure(provider, signal)

    # Then it ends at once, and the request is really closed on the wire
    assert raised.kind == "cancelled"
    assert time.monotonic() - started < 10  # not the server's 30 s
    wait_until(lambda: stub.in_progress == 0, what="no call in progress", timeout=5)


def test_the_provider_still_works_after_an_abort(stub: StubProvider, provider: SdkProvider) -> None:
    stub.enqueue(hang(30), reply("after abort"))
    signal = AbortSignal()

    def abort_once_the_server_holds_it() -> None:
        # not after a fixed delay: a cold client may not have sent the call yet, and the
        # next call would then be the one that hangs
        with contextlib.suppress(TimeoutError):  # abort all the same: the test then fails
            wait_until(lambda: stub.in_progress == 1, what="one call in progress", timeout=10)
        signal.abort()

    threading.Thread(target=abort_once_the_server_holds_it, daemon=True).start()
    assert failure(provider, signal).kind == "cancelled"

    assert provider.complete(request(), AbortSignal()).text == "after abort"


def test_an_abort_cuts_only_its_own_call(stub: StubProvider, provider: SdkProvider) -> None:
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
    wait_until(lambda: stub.in_progress == 2, what="two calls in progress", timeout=10)

    # When one of them is aborted
    doomed.abort("cancelled")
    for thread in threads:
        thread.join(timeout=10)

    # Then only that one ends cancelled; the other gets its answer
    assert outcomes == {"doomed": "cancelled", "other": "undisturbed"}


def test_an_aborted_signal_sends_nothing(stub: StubProvider, provider: SdkProvider) -> None:
    signal = AbortSignal()
    signal.abort("deadline")

    raised = failure(provider, signal)

    assert raised.kind == "cancelled"
    assert "deadline" in str(raised)
    assert stub.requests == []


def test_concurrent_calls_share_one_provider(stub: StubProvider, provider: SdkProvider) -> None:
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


def _complete_in_child(provider: SdkProvider, results: Queue[str | None]) -> None:
    results.put(provider.complete(request(), AbortSignal()).text)


def test_a_forked_child_gets_its_own_client(stub: StubProvider, provider: SdkProvider) -> None:
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
