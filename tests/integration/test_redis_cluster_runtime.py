"""`Redis:ClusterUrl`: a real `Runtime` whose coordination state is on a Redis Cluster of three
masters started by the test (`tests/redis_cluster.py`), everything else on a Redis of its own
(`Redis:Url`). Runs go end to end in this process against the stub OpenAI-compatible provider,
through every coordination store a run touches (a concurrency limit, a rate limit, a tree's
budget, a tenant's quota and running places, the response cache, the circuit and its moves),
and the keys are found on the cluster only. A circuit opened by failing calls is told to the
operator's endpoint from its provider's list of moves on the cluster, and shown by the view
that asks `TIME` of the circuit's node.

Skipped when this machine's `redis-server` cannot run in cluster mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from redis.cluster import RedisCluster

from tests.helpers import MakeRuntime, auth, run_once, scripted_agent, wait_until
from tests.redis_cluster import ClusterUnsupported, ThreeMasters
from tests.stub_provider import StubProvider, error, reply
from tracon_jobs.db.models import WebhookMessage
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.resilience.breaker import BreakerPolicy, RedisBreakerStore
from tracon_jobs.resilience.views import circuits_view
from tracon_jobs.runtime import Runtime
from tracon_jobs.webhooks.circuits import TRANSITIONS_KEY, transitions_key
from web import create_app

OPERATOR = {"Url": "https://ops.example/hook", "SecretEnv": "OPS_SECRET"}
COORDINATION = ("breaker", "slots", "rate", "budget", "quota", "tenant-runs", "cache")
"""The families of `tracon:<family>:{tag}...` keys the runs below write."""


@pytest.fixture(autouse=True)
def _operator_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPS_SECRET", "whsec_" + "b3BlcmF0b3Itc2VjcmV0LWZvci10ZXN0cw==")


def on_the_cluster(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    cluster_url: str,
    stub: StubProvider,
    **sections: Any,
) -> Runtime:
    """A runtime whose agent `demo` calls provider `a` (the stub) under every coordination
    rule a run goes through, its coordination state on the cluster."""
    config = scripted_agent([])
    config["Providers"] = {
        "a": {"Kind": "openai", "BaseUrl": stub.base_url, "RequestsPerMinute": 1000}
    }
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    config["Agents"]["demo"]["Cache"] = {"Enabled": True}
    config["Pricing"] = {"Models": {"gpt-a": {"InputPerMillion": 1, "OutputPerMillion": 2}}}
    config |= {
        "Redis": {"Url": redis_url, "ClusterUrl": cluster_url},
        "ModelConcurrency": {"MaxConcurrentCallsPerProvider": 2},
        "AgentGraph": {"MaxTotalTokens": 1_000_000},
        "Tenants": {"DefaultQuota": {"CostLimit": 100}, "MaxConcurrentRuns": 2},
        "CircuitBreaker": {"FailureThreshold": 2, "BreakDuration": "00:00:30"},
        **sections,
    }
    return make_runtime(sqlite_url, sender=lambda _run_id: None, **config)


def cluster_keys(runtime: Runtime) -> set[str]:
    """Every key on every master of the cluster."""
    client = runtime.coordination
    assert isinstance(client, RedisCluster)
    return {
        key.decode()
        for node in client.get_primaries()
        for key in node.redis_connection.scan_iter(count=1000)
    }


def client_of(store: Any) -> object:
    """The Redis client a store sends its commands or scripts to."""
    client = getattr(store, "client", None)
    return client if client is not None else store.scripts.client


def families(keys: set[str]) -> set[str]:
    """`breaker` of `tracon:breaker:{a}`, for the coordination keys among `keys`."""
    return {key.split(":")[1] for key in keys if key.startswith("tracon:")} & set(COORDINATION)


def circuit_messages(runtime: Runtime) -> list[WebhookMessage]:
    with runtime.db.read() as session:
        query = sa.select(WebhookMessage).where(WebhookMessage.type.like("circuit.%"))
        return list(session.scalars(query))


def test_the_coordination_stores_are_on_the_cluster_and_the_rest_on_redis_url(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    cluster_url: str,
    stub_provider: StubProvider,
) -> None:
    runtime = on_the_cluster(
        make_runtime,
        sqlite_url,
        redis_url,
        cluster_url,
        stub_provider,
        Webhooks={"Operator": OPERATOR},
    )

    moved = [
        runtime.breaker.store,
        runtime.slots.store,
        runtime.rate_limits.store,
        runtime.budgets,
        runtime.quotas.store,
        runtime.executor.tenant_runs.store,
        runtime.executor.cache,
        runtime.leases.store,
    ]
    assert isinstance(runtime.coordination, RedisCluster)
    assert [client_of(store) for store in moved] == [runtime.coordination] * len(moved)
    assert client_of(runtime.circuit_events) is runtime.coordination
    stay = [runtime.cancel_bus, runtime.fair_store, runtime.holders, runtime.outbox]
    assert [client_of(store) for store in stay] == [runtime.redis] * len(stay)
    # And readiness checks the cluster beside Redis:Url and SQL
    ready = create_app(runtime, {"TESTING": True}).test_client().get("/readyz")
    assert ready.status_code == 200
    assert ready.get_json()["checks"] == {"sql": True, "redis": True, "redisCluster": True}


def test_a_process_whose_cluster_does_not_answer_stops_at_startup_naming_the_setting(
    make_runtime: MakeRuntime, sqlite_url: str, redis_url: str, stub_provider: StubProvider
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigurationError) as refused:
        on_the_cluster(make_runtime, sqlite_url, redis_url, dead, stub_provider)
    assert refused.value.setting == "Redis.ClusterUrl"
    assert "no node of it gives the cluster's map" in refused.value.rule


def test_readiness_says_so_when_the_cluster_stops_answering(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    stub_provider: StubProvider,
    tmp_path: Path,
) -> None:
    # Given a web node whose coordination state is on a cluster of its own
    masters = ThreeMasters(tmp_path / "stopped-cluster")
    try:
        masters.start()
    except ClusterUnsupported as exc:
        masters.stop()
        pytest.skip(f"no Redis Cluster here: {exc}")
    url = f"redis://127.0.0.1:{masters.ports[0]}"
    try:
        runtime = on_the_cluster(make_runtime, sqlite_url, redis_url, url, stub_provider)
        web = create_app(runtime, {"TESTING": True}).test_client()
        assert web.get("/readyz").status_code == 200
    finally:
        # When the cluster stops
        masters.stop()

    # Then /readyz is 503 naming the cluster; SQL and Redis:Url are still fine
    ready = web.get("/readyz")
    assert ready.status_code == 503
    assert ready.get_json()["checks"] == {"sql": True, "redis": True, "redisCluster": False}


def test_runs_complete_with_their_coordination_keys_on_the_cluster_only(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    cluster_url: str,
    stub_provider: StubProvider,
    redis_client: redis.Redis,
) -> None:
    # Given a runtime with a concurrency limit, a rate limit, a tree budget, a tenant quota and
    # running places, and the response cache, its coordination state on the cluster
    runtime = on_the_cluster(make_runtime, sqlite_url, redis_url, cluster_url, stub_provider)
    stub_provider.default = reply("It shipped.")

    # When three runs go, two of them the same request
    runs = [run_once(runtime, "same"), run_once(runtime, "same"), run_once(runtime, "other")]

    # Then each completed, the second from the cache (the provider saw two calls)
    assert [run.status for run in runs] == ["Completed"] * 3
    assert len(stub_provider.requests) == 2
    # And the coordination keys are on the cluster's masters, none on Redis:Url
    on_cluster = cluster_keys(runtime)
    assert families(on_cluster) >= {"slots", "rate", "budget", "quota", "cache"}, on_cluster
    single = {key.decode() for key in redis_client.scan_iter(count=1000)}
    assert not families(single), single
    assert not any("circuit-transitions" in key for key in single)
    # spread over the masters, as the tags place them
    client = runtime.coordination
    assert isinstance(client, RedisCluster)
    nodes = {client.get_node_from_key(key).name for key in on_cluster if key.startswith("tracon:")}
    assert len(nodes) >= 2, nodes


def test_a_circuit_opened_by_failures_is_told_from_its_list_on_the_cluster(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    cluster_url: str,
    stub_provider: StubProvider,
    redis_client: redis.Redis,
) -> None:
    # Given the operator's endpoint wants circuit events, and the provider answers 500 twice
    runtime = on_the_cluster(
        make_runtime,
        sqlite_url,
        redis_url,
        cluster_url,
        stub_provider,
        Webhooks={"Operator": OPERATOR, "PollInterval": "00:00:00.100"},
    )
    assert runtime.circuit_events is not None
    stub_provider.enqueue(error(500), error(500))
    stub_provider.default = reply("never asked")

    # When two runs' calls fail (the threshold), and a third is sent
    failed = [run_once(runtime, "first"), run_once(runtime, "second")]
    refused = run_once(runtime, "third")

    # Then the circuit is open: the runs failed, the third without calling the provider
    assert [run.status for run in [*failed, refused]] == ["Failed"] * 3
    assert len(stub_provider.requests) == 2
    # And the circuit.opened message is in the outbox, moved from the provider's list
    wait_until(lambda: len(circuit_messages(runtime)) == 1, what="circuit.opened", timeout=5)
    [opened] = circuit_messages(runtime)
    assert (opened.type, opened.subject_id) == ("circuit.opened", "a")
    assert opened.data["state"] == "open" and opened.data["consecutiveFailures"] == 2
    assert opened.dedupe_key is not None and opened.dedupe_key.startswith("circuit:a:")
    client = runtime.coordination
    assert isinstance(client, RedisCluster)
    assert client.hget("tracon:breaker:{a}", "transitions") == b"1"  # the move, counted
    assert client.exists(transitions_key("a"), TRANSITIONS_KEY) == 0  # drained; no old list
    assert redis_client.exists(transitions_key("a"), TRANSITIONS_KEY) == 0
    # And the view (reads, then TIME of the circuit's node) and GET /api/circuits show it open
    [view] = circuits_view(runtime.breaker, runtime.slots, ["a"], runtime.rate_limits)
    assert view["state"] == "open" and 25 < view["retryAfter"] <= 30
    web = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    [shown] = web.get("/api/circuits", headers=auth(key)).get_json()["items"]
    assert (shown["provider"], shown["state"]) == ("a", "open")
    assert shown["slots"]["limit"] == 2


def test_the_moves_of_providers_taken_out_of_the_configuration_are_found_on_every_node(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    cluster_url: str,
    stub_provider: StubProvider,
) -> None:
    # Given circuits opened for providers the configuration no longer names, their moves on
    # lists in several hash slots (so on several of the masters)
    before = on_the_cluster(make_runtime, sqlite_url, redis_url, cluster_url, stub_provider)
    client = before.coordination
    assert isinstance(client, RedisCluster)
    gone = [f"gone-{i}" for i in range(6)]
    store = RedisBreakerStore(client, transitions=transitions_key)
    policy = BreakerPolicy(threshold=1, break_ms=5000, max_probes=1, probe_lease_ms=1000)
    for provider in gone:
        assert store.admit(provider, policy, "t").allowed
        assert store.record(provider, policy, "t", "failure").after == "open"
    nodes = {client.get_node_from_key(transitions_key(provider)).name for provider in gone}
    assert len(nodes) > 1

    # When a process with a breaker and the operator's endpoint starts
    runtime = on_the_cluster(
        make_runtime,
        sqlite_url,
        redis_url,
        cluster_url,
        stub_provider,
        Webhooks={"Operator": OPERATOR, "PollInterval": "00:00:00.100"},
    )
    assert runtime.breaker is not None  # built, as a worker builds it: its mover starts

    # Then every one of those moves is told, and every list is drained
    wait_until(lambda: len(circuit_messages(runtime)) == len(gone), what="the moves", timeout=5)
    assert sorted(m.subject_id or "" for m in circuit_messages(runtime)) == gone
    assert client.exists(*(transitions_key(provider) for provider in gone)) == 0
