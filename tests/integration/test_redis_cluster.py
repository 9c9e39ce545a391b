"""The coordination scripts on a real Redis Cluster of three masters started by the test
(`tests/redis_cluster.py`), through redis-py's `RedisCluster`: every call site of
`tests/coordination_calls.py` that keeps its keys in one slot runs there (a script whose
keys span slots is refused, by redis-py before it is sent and by the server with
`CROSSSLOT`), the call sites named cross-slot are refused by the server itself, and composed
(deferred) calls of several stores go in one EVALSHA a slot.

Skipped when this machine's `redis-server` cannot run in cluster mode."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from decimal import Decimal

import pytest
import redis
from redis.cluster import RedisCluster

from tests.coordination_calls import (
    CALL_SITES,
    CLUSTER_SAFE,
    CROSS_SLOT,
    DAY,
    MONTH,
    POLICY,
    SPLIT_ON_A_CLUSTER,
    Stores,
    recorded,
)
from tests.redis_cluster import ThreeMasters
from tracon_jobs.coordination.scripts import deferring, slot_of, source
from tracon_jobs.limits.budget_store import Totals
from tracon_jobs.limits.quota_store import to_nanos
from tracon_jobs.webhooks.circuits import transitions_key


@pytest.fixture
def client(redis_cluster: ThreeMasters) -> Iterator[RedisCluster]:
    client = RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0], socket_timeout=5)
    client.flushall()  # every master (each test starts from an empty cluster)
    yield client
    client.close()


def test_the_cluster_has_three_masters_and_the_calls_reach_each(client: RedisCluster) -> None:
    masters = {node.name for node in client.get_primaries()}
    assert len(masters) == 3
    # The call sites' keys are spread over the masters: the test below is not one node's
    reached = {
        client.get_node_from_key(keys[0]).name
        for site in CLUSTER_SAFE
        for _name, keys in recorded(site)
    }
    assert len(reached) >= 2, reached


@pytest.mark.parametrize("site", CLUSTER_SAFE)
def test_every_one_slot_call_site_runs_on_the_cluster(
    client: RedisCluster, site: str, caplog: pytest.LogCaptureFixture
) -> None:
    stores = Stores.on(client)
    with caplog.at_level(logging.WARNING):
        CALL_SITES[site](stores)
    # The stores that log a Redis error instead of raising it (cache, feed, live text) did not
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if site in SPLIT_ON_A_CLUSTER:  # one server's call spans slots; the store cut it here
        assert any(len({slot_of(key) for key in keys}) > 1 for _name, keys in recorded(site))
        return
    for _name, keys in recorded(site):
        assert len({slot_of(key) for key in keys}) == 1


@pytest.mark.parametrize("site", sorted(CROSS_SLOT))
def test_a_cross_slot_call_is_refused_by_redis_py_and_by_the_server(
    client: RedisCluster, redis_cluster: ThreeMasters, site: str
) -> None:
    name, keys = next((n, k) for n, k in recorded(site) if len({slot_of(x) for x in k}) > 1)
    with pytest.raises(redis.RedisClusterException, match="same key slot"):
        CALL_SITES[site](Stores.on(client))
    # Sent as it is to the node of its first key, the server refuses it too
    node = client.get_node_from_key(keys[0])
    plain = redis.Redis(host=node.host, port=node.port, socket_timeout=2)
    with pytest.raises(redis.ResponseError, match="hash to the same slot"):  # CROSSSLOT
        plain.eval(source(name), len(keys), *keys)


def test_every_call_site_in_order_on_one_set_of_stores(client: RedisCluster) -> None:
    stores = Stores.on(client)
    for site in CLUSTER_SAFE:
        CALL_SITES[site](stores)
    assert client.exists(stores.budgets.key("run-root")) == 1
    assert client.get(stores.quotas.key("tenant-a", MONTH)) is None  # no gate opened it
    assert stores.leases.owner_of("tracon.requeue") is None  # released
    # A failure, then a success; the views ask TIME of the key's node after their reads
    # (redis-py's cluster pipeline refuses it; docs/reliability.md, "Redis Cluster")
    circuit = stores.breaker.snapshot("openai")
    assert (circuit.state, circuit.failures) == ("closed", 1)  # the moves' store's failure
    assert stores.slots.usage("openai") == (0, 0)
    # Two more open the circuit: its move is listed in the circuit's slot
    for token in ("t3", "t4"):
        stores.breaker_moves.record("openai", POLICY, token, "failure")
    assert stores.breaker.snapshot("openai").state == "open"
    [move] = client.lrange(transitions_key("openai"), 0, -1)
    assert b'"after":"open"' in move


def test_composed_calls_of_several_stores_go_one_evalsha_a_slot(client: RedisCluster) -> None:
    stores = Stores.on(client)
    stores.budgets.open("run-root", Totals())
    stores.quotas.open("tenant-a", DAY, Decimal("0"), DAY.start)
    keys = [stores.budgets.key("run-root"), stores.quotas.key("tenant-a", DAY)]
    keys += stores.breaker.keys("openai")
    assert len({client.get_node_from_key(key).name for key in keys}) >= 2
    admitted = stores.breaker.admit("openai", POLICY, "t1")
    assert admitted.allowed
    with deferring():
        stores.budgets.spend(
            "run-root", released=0, tokens=7, cost=Decimal("0.5"), unknown_price=False
        )
        stores.quotas.spend("tenant-a", [DAY], Decimal("0.5"))
        # The record needs its reply: the two spends go with it, each in its own slot's EVALSHA
        moved = stores.breaker.record("openai", POLICY, "t1", "failure")
    assert moved.failures == 1
    assert int(client.hget(keys[0], "tokens") or 0) == 7
    assert int(client.get(keys[1]) or 0) == to_nanos(Decimal("0.5"))
