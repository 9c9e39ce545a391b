"""Provider rate limits: the store's rules (in memory and in real Redis, the same tests),
exact under a race of real processes, and the providers' headers read."""

from __future__ import annotations

import multiprocessing
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from tests.helpers import MakeRuntime, run_once, scripted_agent
from tests.stub_provider import Reply, StubProvider, error
from tracon_jobs.abort import AbortSignal
from tracon_jobs.cli.operations import rate_line
from tracon_jobs.errors import ProviderError
from tracon_jobs.providers.rate_headers import (
    exhausted_for,
    openai_reset_seconds,
    rfc3339_seconds,
)
from tracon_jobs.resilience.rate_limits import (
    MemoryRateStore,
    RateLimit,
    RateLimits,
    RateStore,
    RedisRateStore,
    Scope,
)
from web import create_app

WINDOW = 1000  # ms: the rules do not depend on the window's length (60 s in production)


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, redis_client: redis.Redis) -> RateStore:
    return MemoryRateStore() if request.param == "memory" else RedisRateStore(redis_client)


def scope(requests: int | None = None, tokens: int | None = None, name: str = "p") -> Scope:
    return Scope(name, RateLimit(requests, tokens))


def test_no_more_requests_start_in_a_window_than_its_limit(store: RateStore) -> None:
    limited = [scope(requests=3)]
    first, first_at = store.admit(limited, "c0", 1, WINDOW)
    time.sleep(0.3)
    admitted = [first] + [store.admit(limited, f"c{i}", 1, WINDOW)[0] for i in (1, 2)]
    assert admitted == [0, 0, 0]

    wait, now = store.admit(limited, "c3", 1, WINDOW)
    assert wait == first_at + WINDOW - now  # until the oldest start leaves the window
    assert wait < WINDOW - 250  # and not the later starts
    time.sleep(wait / 1000 + 0.02)
    assert store.admit(limited, "c3", 1, WINDOW)[0] == 0
    assert store.admit(limited, "c4", 1, WINDOW)[0] > 0  # the other two are still in it


def test_tokens_count_what_a_call_may_use_corrected_by_its_answer(store: RateStore) -> None:
    limited = [scope(tokens=1000)]
    assert store.admit(limited, "a", 600, WINDOW)[0] == 0
    assert store.admit(limited, "b", 600, WINDOW)[0] > 0  # 1200 would pass the limit
    store.correct(limited, "a", 150)  # the answer used less than it reserved

    assert store.admit(limited, "b", 600, WINDOW)[0] == 0
    assert store.admit(limited, "c", 300, WINDOW)[0] > 0  # 150 + 600 + 300


def test_a_call_bigger_than_the_token_limit_starts_on_an_empty_window(store: RateStore) -> None:
    limited = [scope(tokens=100)]
    assert store.admit(limited, "big", 500, WINDOW)[0] == 0
    wait, _ = store.admit(limited, "next", 500, WINDOW)
    assert 0 < wait <= WINDOW


def test_a_start_is_recorded_under_every_limit_or_none(store: RateStore) -> None:
    provider, model = scope(requests=10, name="p"), scope(requests=1, name="p/m")
    assert store.admit([provider, model], "a", 1, WINDOW)[0] == 0
    assert store.admit([provider, model], "b", 1, WINDOW)[0] > 0  # the model's limit

    # the refused call took none of the provider's limit: nine more start on another model
    other = scope(requests=100, name="p/other")
    assert [store.admit([provider, other], f"o{i}", 1, WINDOW)[0] for i in range(9)] == [0] * 9
    assert store.admit([provider, other], "o9", 1, WINDOW)[0] > 0


def test_the_providers_word_blocks_starts_until_then(store: RateStore) -> None:
    limited = [scope(requests=100)]
    began = time.monotonic()
    store.block("p", 300)
    store.block("p", 100)  # an earlier end does not shorten it

    wait, _ = store.admit(limited, "a", 1, WINDOW)
    elapsed_ms = (time.monotonic() - began) * 1000
    assert 300 - elapsed_ms - 5 <= wait <= 300
    time.sleep(wait / 1000 + 0.02)
    assert store.admit(limited, "a", 1, WINDOW)[0] == 0


def test_a_waiting_call_starts_when_the_window_moves_and_a_cancel_ends_its_wait() -> None:
    limits = RateLimits(MemoryRateStore(), {"p": RateLimit(requests=1)}, window_ms=300)
    limits.admit("p", "m", 1, AbortSignal())
    started = time.monotonic()
    limits.admit("p", "m", 1, AbortSignal())
    assert 0.25 < time.monotonic() - started < 3.0

    canceled = AbortSignal()
    canceled.abort("cancelled")
    with pytest.raises(ProviderError) as waited:
        limits.admit("p", "m", 1, canceled)
    assert waited.value.kind == "cancelled"
    assert limits.admit("other", "m", 1, canceled).scopes == []  # no limit: no wait, no call


def _race(url: str, starts: multiprocessing.Queue, seconds: float) -> None:
    store = RedisRateStore(redis.Redis.from_url(url))
    until = time.time() + seconds  # from here: a spawned process takes a while to start
    limited = [scope(requests=20, name="race")]
    index = 0
    while time.time() < until:
        index += 1
        wait, now = store.admit(
            limited, f"{multiprocessing.current_process().pid}-{index}", 1, 2000
        )
        if wait == 0:
            starts.put(now)
        else:
            time.sleep(min(wait, 50) / 1000)


def test_three_processes_racing_never_start_more_than_the_limit_in_any_window(
    redis_url: str,
) -> None:
    context = multiprocessing.get_context("spawn")
    starts: multiprocessing.Queue = context.Queue()
    racers = [context.Process(target=_race, args=(redis_url, starts, 5.5)) for _ in range(3)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=30)
    seen = []
    while not starts.empty():
        seen.append(starts.get())
    seen.sort()

    # at least two full windows' worth started, and no 2 s window holds more than 20
    assert len(seen) >= 40
    for index, at in enumerate(seen):
        in_window = [s for s in seen[index:] if s < at + 2000]
        assert len(in_window) <= 20, f"{len(in_window)} starts in the window from {at}"


def test_openai_and_anthropic_headers_say_when_calls_are_available_again() -> None:
    assert openai_reset_seconds("1s") == 1.0
    assert openai_reset_seconds("6m0s") == 360.0
    assert openai_reset_seconds("20ms") == 0.02
    assert openai_reset_seconds("1h2m3.5s") == 3723.5
    assert openai_reset_seconds("soon") is None
    later = datetime.now(UTC) + timedelta(seconds=30)
    seconds = rfc3339_seconds(later.isoformat().replace("+00:00", "Z"))
    assert seconds is not None and 28 < seconds <= 30

    assert (
        exhausted_for({"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "1s"})
        is None
    )
    openai_empty = {
        "X-RateLimit-Remaining-Requests": "0",
        "X-RateLimit-Reset-Requests": "2s",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert exhausted_for(openai_empty) == 360.0
    anthropic_empty = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": later.isoformat(),
    }
    found = exhausted_for(anthropic_empty)
    assert found is not None and 28 < found <= 30


# -- in a run: the executor waits, learns from the provider's word ---------------------


def limited_agent(stub: StubProvider, **limits: Any) -> dict[str, Any]:
    config = scripted_agent([])
    config["Providers"] = {"a": {"Kind": "openai", "BaseUrl": stub.base_url, **limits}}
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    return config


def test_a_run_over_its_providers_requests_a_minute_waits_for_the_window(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **limited_agent(stub_provider, RequestsPerMinute=2))
    runtime.executor.rate_limits.window_ms = 1000  # the rules are the same at 60 s
    started = time.monotonic()

    runs = [run_once(runtime) for _ in range(3)]

    assert [run.status for run in runs] == ["Completed"] * 3
    assert time.monotonic() - started >= 0.95  # the third call waited for the first to age out
    assert len(stub_provider.requests) == 3


def test_a_429_with_retry_after_holds_every_later_call_of_the_provider(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **limited_agent(stub_provider, RequestsPerMinute=1000))
    stub_provider.enqueue(error(429, retry_after=1))
    first = run_once(runtime)
    assert first.status == "Failed"

    second = run_once(runtime)

    assert second.status == "Completed"
    # it did not start before the provider said (counted where the provider saw the calls:
    # a busy machine's slow final write of the first run would shorten the test's own clock)
    the_429, the_next = stub_provider.arrivals
    assert the_next - the_429 >= 0.95


def test_an_answer_saying_no_requests_remain_holds_the_next_call_until_the_reset(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **limited_agent(stub_provider, TokensPerMinute=100_000))
    spent = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}
    stub_provider.enqueue(Reply("ok", headers=spent), Reply("again"))
    assert run_once(runtime).status == "Completed"
    answered = time.monotonic()

    assert run_once(runtime).status == "Completed"
    assert time.monotonic() - answered >= 0.9


def test_a_provider_without_limits_makes_no_rate_limit_call(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **limited_agent(stub_provider))
    assert runtime.executor.rate_limits.limits == {}
    spent = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "30s"}
    stub_provider.enqueue(Reply("ok", headers=spent))
    assert run_once(runtime).status == "Completed"
    started = time.monotonic()
    assert run_once(runtime).status == "Completed"
    assert time.monotonic() - started < 10  # nothing learned where nothing is limited (30 s)


def test_a_cached_answer_takes_no_place_in_the_rate_limit(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    config = limited_agent(stub_provider, RequestsPerMinute=1)
    config["Agents"]["demo"]["Cache"] = {"Enabled": True, "Ttl": "00:10:00"}
    runtime = make_runtime(sql_url, **config)
    assert run_once(runtime).status == "Completed"
    started = time.monotonic()

    again = run_once(runtime)  # the same request: answered from the cache

    assert again.status == "Completed" and time.monotonic() - started < 20  # not the 60 s window
    assert len(stub_provider.requests) == 1


def test_the_circuits_route_metrics_and_cli_show_each_limits_window(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    config = limited_agent(stub_provider, RequestsPerMinute=5, TokensPerMinute=10_000)
    config["Providers"]["a"]["Models"] = {"gpt-a": {"RequestsPerMinute": 3}}
    runtime = make_runtime(sql_url, **config)
    stub_provider.enqueue(Reply("ok", input_tokens=10, output_tokens=5))
    assert run_once(runtime).status == "Completed"
    runtime.rate_limits.learn("a", "gpt-a", 30)
    http = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret

    body = http.get("/api/circuits", headers={"Authorization": f"Bearer {key}"}).get_json()

    [item] = [i for i in body["items"] if i["provider"] == "a"]
    provider, model = item["rateLimits"]
    assert {k: provider[k] for k in provider if k != "blockedFor"} == {
        "scope": "a",
        "requestsPerMinute": 5,
        "requests": 1,
        "tokensPerMinute": 10_000,
        "tokens": 15,  # the answer's usage, in place of what the call reserved
    }
    assert 28 < provider["blockedFor"] <= 30 and 28 < model["blockedFor"] <= 30
    assert (model["scope"], model["requests"], model["requestsPerMinute"]) == ("a/gpt-a", 1, 3)
    assert rate_line(model).startswith("a/gpt-a requests 1/3 held by the provider for ")
    text = http.get("/metrics").get_data(as_text=True)
    assert 'tracon_rate_limit_used{kind="requests",scope="a"} 1.0' in text
    assert 'tracon_rate_limit_used{kind="tokens",scope="a"} 15.0' in text
    assert 'tracon_rate_limit{kind="requests",scope="a/gpt-a"} 3.0' in text
