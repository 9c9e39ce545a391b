"""Circuit breaker, fallback chain and concurrency slots inside the executor, against the
OpenAI-compatible stub over real HTTP, with the breaker and slots in real Redis."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests import tools
from tests.helpers import MakeRuntime, ThreadWorker, run_once, scripted_agent
from tests.stub_provider import (
    Behaviour,
    Reply,
    StubProvider,
    StubToolCall,
    drop,
    error,
    hang,
    reply,
)
from tracon_jobs.db.models import Run
from tracon_jobs.runtime import Runtime


@pytest.fixture
def backup() -> Iterator[StubProvider]:
    with StubProvider() as server:
        yield server


def chain(
    primary: StubProvider, secondary: StubProvider | None = None, **sections: Any
) -> dict[str, Any]:
    """Agent `demo` on provider `a` (model gpt-a), falling back to `b` (gpt-b) if given."""
    config = scripted_agent([], ["charge_card", "lookup_order"])
    config["Providers"] = {
        "a": {"Kind": "openai", "BaseUrl": primary.base_url, "TimeoutSeconds": 1}
    }
    model: dict[str, Any] = {"provider": "a", "model": "gpt-a", "temperature": 0.3}
    if secondary is not None:
        config["Providers"]["b"] = {"Kind": "openai", "BaseUrl": secondary.base_url}
        model["fallbacks"] = [{"provider": "b", "model": "gpt-b"}]
    config["Agents"]["demo"]["Model"] = model
    config["Pricing"] = {
        "Models": {
            "gpt-a": {"InputPerMillion": 1, "OutputPerMillion": 1},
            "gpt-b": {"InputPerMillion": 10, "OutputPerMillion": 20},
        }
    }
    return config | sections


def types(runtime: Runtime, run: Run) -> list[str]:
    return [event.type for event in runtime.runs.events(run.id)]


def charge(amount: int) -> Reply:
    return Reply(None, tool_calls=(StubToolCall("charge_card", {"amount_cents": amount}),))


def test_fallback_after_a_side_effecting_tool_runs_its_body_once(
    make_runtime: MakeRuntime,
    sql_url: str,
    stub_provider: StubProvider,
    backup: StubProvider,
) -> None:
    runtime = make_runtime(sql_url, **chain(stub_provider, backup))
    before = len(tools.charges)
    # Given the primary asks for a charge, then fails before answering
    stub_provider.enqueue(charge(500), error(503))
    # And the fallback model asks for the very same charge, then answers
    backup.enqueue(charge(500), reply("charged once", input_tokens=100, output_tokens=10))

    run = run_once(runtime)

    assert run.status == "Completed" and run.output == {"text": "charged once"}
    assert len(tools.charges) - before == 1, "the charge ran exactly once"
    events = types(runtime, run)
    assert events.count("ToolCallStarted") == 1
    assert "ToolCallAnsweredFromLedger" in events and "ModelFallbackUsed" in events
    fallback = next(e for e in runtime.runs.events(run.id) if e.type == "ModelFallbackUsed")
    assert fallback.data["primary"] == {"provider": "a", "model": "gpt-a"}
    assert fallback.data["fallback"] == {"provider": "b", "model": "gpt-b"}
    assert run.model_id == "gpt-b"
    assert [(a["provider"], a["outcome"], a.get("status")) for a in run.model_attempts or []] == [
        ("a", "failed", 503),
        ("b", "succeeded", None),
    ]
    assert backup.requests[0]["temperature"] == 0.3, "same request options on the fallback"


TRANSIENT: list[tuple[str, Callable[[], Behaviour]]] = [
    ("500", lambda: error(500)),
    ("502", lambda: error(502)),
    ("429", lambda: error(429)),
    ("408", lambda: error(408)),
    ("timeout", lambda: hang(5)),
    ("dropped", drop),
]
PERMANENT: list[tuple[str, Callable[[], Behaviour], int]] = [
    ("401", lambda: error(401), 401),
    ("403", lambda: error(403), 403),
    ("404", lambda: error(404), 404),
    ("400", lambda: error(400), 400),
]


@pytest.mark.parametrize(("name", "failure"), TRANSIENT, ids=[t[0] for t in TRANSIENT])
def test_transient_failures_fall_back(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    backup: StubProvider,
    name: str,
    failure: Callable[[], Behaviour],
) -> None:
    runtime = make_runtime(sqlite_url, **chain(stub_provider, backup))
    stub_provider.enqueue(failure())
    backup.enqueue(reply("from b"))

    run = run_once(runtime)

    assert run.status == "Completed" and run.output == {"text": "from b"}
    assert run.model_id == "gpt-b"


@pytest.mark.parametrize(("name", "failure", "status"), PERMANENT, ids=[p[0] for p in PERMANENT])
def test_permanent_failures_never_fall_back(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    backup: StubProvider,
    name: str,
    failure: Callable[[], Behaviour],
    status: int,
) -> None:
    runtime = make_runtime(sqlite_url, **chain(stub_provider, backup))
    stub_provider.enqueue(failure())

    run = run_once(runtime)

    assert run.status == "Failed" and run.error_type == "provider_error"
    assert f"HTTP {status}" in (run.error_message or "")
    assert backup.requests == []


def test_when_every_link_fails_the_first_failure_names_every_provider(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    backup: StubProvider,
) -> None:
    runtime = make_runtime(sqlite_url, **chain(stub_provider, backup))
    stub_provider.enqueue(error(503))
    backup.enqueue(error(500))

    run = run_once(runtime)

    assert run.status == "Failed"
    message = run.error_message or ""
    assert message.startswith("HTTP 503 from provider 'a'")
    assert "a (gpt-a)" in message and "b (gpt-b)" in message


def test_circuit_opens_at_the_threshold_and_rejects_without_calling(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    breaker = {"FailureThreshold": 2, "BreakDuration": "00:01:00"}
    runtime = make_runtime(sqlite_url, **chain(stub_provider, CircuitBreaker=breaker))
    stub_provider.default = error(500)

    first, second, third = run_once(runtime), run_once(runtime), run_once(runtime)

    assert [r.error_type for r in (first, second, third)] == [
        "provider_error",
        "provider_error",
        "provider_unavailable",
    ]
    assert len(stub_provider.requests) == 2, "the rejected run never reached the provider"
    assert 55 < (third.error_retry_after or 0) <= 60
    opened = [e.data for e in runtime.runs.events(second.id) if e.type == "CircuitStateChanged"]
    assert opened == [{"provider": "a", "from": "closed", "to": "open", "failures": 2}]
    assert runtime.breaker.snapshot("a").state == "open"


def test_open_circuit_moves_to_the_fallback_without_calling_the_primary(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    backup: StubProvider,
) -> None:
    runtime = make_runtime(
        sqlite_url, **chain(stub_provider, backup, CircuitBreaker={"FailureThreshold": 1})
    )
    stub_provider.default = error(500)
    backup.default = reply("b answers")
    run_once(runtime)  # opens a's circuit (and falls back)
    calls = len(stub_provider.requests)

    run = run_once(runtime)

    assert run.status == "Completed" and run.model_id == "gpt-b"
    assert len(stub_provider.requests) == calls
    assert (run.model_attempts or [])[0]["outcome"] == "rejected"


def test_a_rejected_link_hands_back_the_tokens_its_first_gate_reserved(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    # Given a tree token budget (each model call reserves tokens at its gate) and an open circuit
    sections = chain(stub_provider, CircuitBreaker={"FailureThreshold": 1})
    sections["AgentGraph"] = {"MaxTotalTokens": 100_000}
    runtime = make_runtime(sqlite_url, **sections)
    stub_provider.default = error(500)
    run_once(runtime)  # opens the circuit

    # When a run's link is rejected (its admission is read with its first gate's reservation)
    run = run_once(runtime)

    # Then it failed without calling, and its tree holds no reservation for the call not made
    assert run.error_type == "provider_unavailable"
    assert len(stub_provider.requests) == 1
    budget = runtime.budgets.key(run.id)
    assert runtime.redis.hget(budget, "reserved") == b"0"
    assert "ModelCallStarted" not in types(runtime, run)


def test_retry_after_longer_than_the_break_extends_it(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    breaker = {"FailureThreshold": 1, "BreakDuration": "00:00:30"}
    runtime = make_runtime(sqlite_url, **chain(stub_provider, CircuitBreaker=breaker))
    stub_provider.enqueue(error(429, retry_after=120))
    run_once(runtime)

    rejected = run_once(runtime)

    assert rejected.error_type == "provider_unavailable"
    assert 115 < (rejected.error_retry_after or 0) <= 120


def test_half_open_admits_one_probe_that_closes_the_circuit(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    breaker = {"FailureThreshold": 1, "BreakDuration": "00:00:01"}
    runtime = make_runtime(sqlite_url, **chain(stub_provider, CircuitBreaker=breaker))
    stub_provider.enqueue(error(500))
    run_once(runtime)
    assert runtime.breaker.snapshot("a").state == "open"
    threading.Event().wait(1.05)  # the break itself is the behaviour under test

    probe = run_once(runtime)

    assert probe.status == "Completed"
    changes = [
        (e.data["from"], e.data["to"])
        for e in runtime.runs.events(probe.id)
        if e.type == "CircuitStateChanged"
    ]
    assert changes == [("open", "half_open"), ("half_open", "closed")], types(runtime, probe)
    assert runtime.breaker.snapshot("a").state == "closed"


def test_disabled_breaker_lets_every_call_through(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    breaker = {"Enabled": False, "FailureThreshold": 1}
    runtime = make_runtime(sqlite_url, **chain(stub_provider, CircuitBreaker=breaker))
    stub_provider.default = error(500)

    runs = [run_once(runtime) for _ in range(4)]

    assert {r.error_type for r in runs} == {"provider_error"}
    assert len(stub_provider.requests) == 4


@pytest.mark.parametrize(
    ("policy", "status", "calls"), [("allow", "Completed", 1), ("reject", "Failed", 0)]
)
def test_unreachable_redis_follows_on_store_unavailable(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    policy: str,
    status: str,
    calls: int,
) -> None:
    dead_redis = {"Url": "redis://127.0.0.1:1/0"}
    runtime = make_runtime(
        sqlite_url,
        Redis=dead_redis,
        **chain(stub_provider, CircuitBreaker={"OnStoreUnavailable": policy}),
    )
    stub_provider.default = reply("fine")

    run = run_once(runtime)

    assert run.status == status
    assert len(stub_provider.requests) == calls
    if status == "Failed":
        assert run.error_type == "provider_unavailable"


def test_slots_bound_calls_in_flight_to_a_provider(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    runtime = make_runtime(
        sqlite_url, ModelConcurrency={"MaxConcurrentCallsPerProvider": 2}, **chain(stub_provider)
    )
    stub_provider.default = hang(0.2, reply("done"))

    threads = [threading.Thread(target=run_once, args=(runtime,)) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(stub_provider.requests) == 6
    assert stub_provider.peak_in_progress == 2
    assert runtime.slots.usage("a").in_use == 0


def test_a_buffered_response_for_an_open_circuit_is_503_with_retry_after(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    thread_worker: ThreadWorker,
) -> None:
    from web import create_app

    breaker = {"FailureThreshold": 1, "BreakDuration": "00:02:00"}
    runtime = make_runtime(sqlite_url, **chain(stub_provider, CircuitBreaker=breaker))
    runtime.send_runs_with(thread_worker.sender(runtime))
    stub_provider.default = error(500)
    run_once(runtime)  # opens the circuit
    client = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret

    response = client.post(
        "/api/agents/demo/run",
        json={"message": "go"},
        headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "k-1"},
    )

    assert response.status_code == 503
    assert 100 < int(response.headers["Retry-After"]) <= 120
    assert response.get_json()["error"]["type"] == "provider_unavailable"
