"""Response caching over real Redis (and its in-memory twin), and the executor over real HTTP
to the OpenAI-compatible stub: a hit answers without the provider and spends nothing, its
tool calls still go through the ledger, and an open circuit blocks even a cached answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import redis
from sqlalchemy import select

from tests.helpers import MakeRuntime, scripted_agent
from tests.stub_provider import Reply, StubProvider, StubToolCall, error, reply
from tracon_jobs.db.models import ToolCallRecord
from tracon_jobs.providers.base import ModelRequest
from tracon_jobs.resilience.cache import (
    MemoryResponseCache,
    RedisResponseCache,
    ResponseCache,
    request_key,
)
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

# -- the store contract, on both implementations -------------------------------------------------


@pytest.fixture(params=["redis", "memory"])
def cache(request: pytest.FixtureRequest, redis_client: redis.Redis) -> Iterator[ResponseCache]:
    yield RedisResponseCache(redis_client) if request.param == "redis" else MemoryResponseCache()


def test_a_stored_answer_is_found_by_its_key(cache: ResponseCache) -> None:
    cache.put("a", "k1", {"text": "hi"}, 60_000, 10)

    assert cache.get("a", "k1") == {"text": "hi"}
    assert cache.get("a", "k2") is None
    assert cache.get("b", "k1") is None  # one agent's cache is not another's


def test_an_answer_expires_with_its_ttl(cache: ResponseCache) -> None:
    cache.put("a", "k1", {"text": "hi"}, 50, 10)
    time.sleep(0.1)

    assert cache.get("a", "k1") is None


def test_the_oldest_answers_go_first_past_the_bound(cache: ResponseCache) -> None:
    for number in range(5):
        cache.put("a", f"k{number}", {"n": number}, 60_000, 3)
        time.sleep(0.002)  # distinct store times

    assert [cache.get("a", f"k{n}") for n in range(5)] == [None, None, {"n": 2}, {"n": 3}, {"n": 4}]


def test_the_redis_cache_is_shared_by_every_client(
    redis_url: str, redis_client: redis.Redis
) -> None:
    other = redis.Redis.from_url(redis_url)
    RedisResponseCache(redis_client).put("a", "k", {"text": "shared"}, 60_000, 10)

    assert RedisResponseCache(other).get("a", "k") == {"text": "shared"}
    other.close()


def test_a_runs_own_options_are_part_of_the_key_and_options_that_ask_for_nothing_are_not() -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = request_key("stub", ModelRequest("m", messages))

    own: list[dict[str, Any]] = [
        {"stop": ["END"]},
        {"seed": 1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"logit_bias": {"1": 1}},
        {"reasoning_effort": "low"},
        {"verbosity": "low"},
    ]
    keys = {request_key("stub", ModelRequest("m", messages, **option)) for option in own}

    assert plain not in keys and len(keys) == len(own)
    assert request_key("stub", ModelRequest("m", messages, stop=[], logit_bias={})) == plain


def test_an_unreachable_redis_is_a_miss() -> None:
    dead = RedisResponseCache(redis.Redis(port=1, socket_connect_timeout=0.2))

    dead.put("a", "k", {"text": "x"}, 1000, 1)
    assert dead.get("a", "k") is None


# -- the executor ---------------------------------------------------------------------------


def cached_agent(stub: StubProvider, **extra: Any) -> dict[str, Any]:
    sections = scripted_agent([], ["lookup_order"])
    sections["Providers"] = {"stub": {"Kind": "openai", "BaseUrl": stub.base_url}}
    sections["Agents"]["demo"]["Model"] = {"provider": "stub", "model": "gpt-test"}
    sections["Agents"]["demo"]["Cache"] = {"Enabled": True, "Ttl": "00:10:00"}
    sections["Pricing"] = {"Models": {"gpt-test": {"InputPerMillion": 1, "OutputPerMillion": 1}}}
    return sections | extra


def run(runtime: Runtime, message: str = "where is B-7?") -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(
        NewRun(tenant_id=tenant, agent="demo", input={"message": message})
    ).id
    runtime.executor.execute(run_id)
    return run_id


def completed_calls(runtime: Runtime, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in runtime.runs.events(run_id) if e.type == "ModelCallCompleted"]


def test_a_repeated_request_is_answered_from_the_cache_without_the_provider(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **cached_agent(stub_provider))
    stub_provider.enqueue(
        Reply(
            None, tool_calls=(StubToolCall("lookup_order", {"order_id": "B-7"}),), input_tokens=40
        ),
        reply("B-7 shipped.", input_tokens=60, output_tokens=6),
    )
    first = run(runtime)
    calls_after_first = len(stub_provider.requests)

    second = run(runtime)

    assert len(stub_provider.requests) == calls_after_first == 2  # nothing new reached it
    done = runtime.runs.get(second)
    assert done is not None and done.output == {"text": "B-7 shipped."}
    assert (done.input_tokens, done.output_tokens, Decimal(done.cost_amount)) == (0, 0, 0)
    assert [c["cached"] for c in completed_calls(runtime, second)] == [True, True]
    assert [c["cached"] for c in completed_calls(runtime, first)] == [False, False]
    # the cached turn's tool call still ran, through the ledger
    with runtime.db.read() as session:
        rows = session.scalars(select(ToolCallRecord).where(ToolCallRecord.run_id == second)).all()
    assert [(r.tool, r.status) for r in rows] == [("lookup_order", "succeeded")]


def test_another_question_is_not_a_hit(
    make_runtime: MakeRuntime, sqlite_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sqlite_url, **cached_agent(stub_provider))
    stub_provider.enqueue(reply("one"), reply("two"))

    run(runtime, "first question")
    second = run(runtime, "second question")

    assert len(stub_provider.requests) == 2
    assert [c["cached"] for c in completed_calls(runtime, second)] == [False]


def test_an_open_circuit_blocks_a_call_even_when_its_answer_is_cached(
    make_runtime: MakeRuntime, sqlite_url: str, stub_provider: StubProvider
) -> None:
    breaker = {"FailureThreshold": 1, "BreakDuration": "00:01:00"}
    runtime = make_runtime(sqlite_url, **cached_agent(stub_provider, CircuitBreaker=breaker))
    stub_provider.enqueue(reply("cached answer"), error(500))
    run(runtime, "cached question")  # fills the cache
    run(runtime, "another question")  # a 500: the circuit opens
    assert runtime.breaker.snapshot("stub").state == "open"

    blocked = run(runtime, "cached question")

    failed = runtime.runs.get(blocked)
    assert failed is not None and failed.error_type == "provider_unavailable"
    assert completed_calls(runtime, blocked) == []
    assert len(stub_provider.requests) == 2


def test_caching_is_off_by_default(
    make_runtime: MakeRuntime, sqlite_url: str, stub_provider: StubProvider
) -> None:
    sections = cached_agent(stub_provider)
    del sections["Agents"]["demo"]["Cache"]
    runtime = make_runtime(sqlite_url, **sections)
    stub_provider.enqueue(reply("a"), reply("a"))

    run(runtime)
    run(runtime)

    assert len(stub_provider.requests) == 2
