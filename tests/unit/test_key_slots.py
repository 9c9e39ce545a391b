"""Every Lua script call keeps its keys in one Redis Cluster hash slot (they carry the same
`{tag}`), checked on the keys the stores' own methods send (`tests/coordination_calls.py`),
with redis-py's `key_slot`, the cluster's own CRC16 of the tag. The few call sites whose keys
span slots are named, with the reason they stay on `Redis:Url`; composed (deferred) calls
are cut into one EVALSHA a slot on a cluster client (`slot_runs`)."""

from __future__ import annotations

import pytest
import redis
from redis.crc import key_slot

from tests.coordination_calls import (
    CALL_SITES,
    CROSS_SLOT,
    POLICY,
    SPLIT_ON_A_CLUSTER,
    recorded,
)
from tracon_jobs.coordination.held import _alive, _held
from tracon_jobs.coordination.scripts import LUA, Call, slot_of, slot_runs
from tracon_jobs.limits.budget_store import RedisBudgetStore
from tracon_jobs.limits.quota_store import RedisQuotaStore, window_of
from tracon_jobs.resilience.breaker import RedisBreakerStore
from tracon_jobs.resilience.concurrency import RedisSlotStore
from tracon_jobs.resilience.rate_limits import RedisRateStore
from tracon_jobs.webhooks.circuits import TRANSITIONS_KEY, transitions_key


def slots(keys: list[str]) -> set[int]:
    return {key_slot(key.encode()) for key in keys}


@pytest.mark.parametrize(
    "site", [s for s in CALL_SITES if s not in CROSS_SLOT and s not in SPLIT_ON_A_CLUSTER]
)
def test_every_script_calls_keys_share_one_slot(site: str) -> None:
    for name, keys in recorded(site):
        assert keys, f"{site}: {name} sends no keys (a cluster could not route it)"
        assert len(slots(keys)) == 1, f"{site}: {name} keys span slots: {keys}"


@pytest.mark.parametrize("site", sorted(CROSS_SLOT))
def test_the_cross_slot_call_sites_are_the_ones_named(site: str) -> None:
    # Named in CROSS_SLOT with the reason they stay on Redis:Url; fixed, they leave the list
    assert any(len(slots(keys)) > 1 for _name, keys in recorded(site)), site


@pytest.mark.parametrize("site", sorted(SPLIT_ON_A_CLUSTER))
def test_the_call_sites_a_cluster_client_cuts_span_slots_on_one_server(site: str) -> None:
    # Named with the reason; the cluster's own test runs them there, one call a slot
    assert any(len(slots(keys)) > 1 for _name, keys in recorded(site)), site


def test_every_lua_script_has_a_call_site() -> None:
    called = {name for site in CALL_SITES for name, _keys in recorded(site)}
    shipped = {path.stem for path in LUA.glob("*.lua")}
    assert called == shipped


def test_a_providers_and_its_models_rate_keys_share_the_providers_tag() -> None:
    store = RedisRateStore(redis.Redis(port=1))
    provider, model = store.keys("openai"), store.keys("openai/gpt-4o")
    assert slots(provider + model) == {key_slot(b"openai")}
    assert len(set(provider + model)) == 6  # tagged alike, still apart
    # A provider whose name has a slash is cut the same way in both scopes
    assert len(slots(store.keys("acme/eu") + store.keys("acme/eu/big"))) == 1


def test_a_providers_circuit_moves_are_listed_in_its_circuits_slot() -> None:
    client = redis.Redis(port=1)
    store = RedisBreakerStore(client, transitions=transitions_key)
    assert slots([*store.keys("openai"), transitions_key("openai")]) == {key_slot(b"openai")}
    assert store.transitions_key("openai") != store.transitions_key("anthropic")
    # The one list of earlier versions is a slot of its own: a cluster refuses the script that
    # writes it beside a circuit; it is only read (and drained) alone
    earlier = RedisBreakerStore(client, transitions=TRANSITIONS_KEY)
    assert earlier.transitions_key("openai") == TRANSITIONS_KEY
    assert len(slots([*store.keys("openai"), TRANSITIONS_KEY])) == 2


def test_multi_key_commands_outside_scripts_share_a_slot() -> None:
    client = redis.Redis(port=1)
    breaker, slot_store = RedisBreakerStore(client), RedisSlotStore(client)
    sites = {
        "held: DEL a worker's record and liveness": [_held("w1"), _alive("w1")],
        "breaker snapshot pipeline": breaker.keys("openai"),
        "slots usage pipeline": slot_store.keys("openai")[0:3:2],
    }
    for site, keys in sites.items():
        assert len(slots(keys)) == 1, f"{site}: {keys}"


def test_composed_calls_are_cut_into_one_run_a_slot_in_order() -> None:
    client = redis.Redis(port=1)
    budget, quota = RedisBudgetStore(client).key("root"), RedisQuotaStore(client)
    days = [quota.key("tenant-a", window_of("day")), quota.key("tenant-a", window_of("month"))]
    breaker = RedisBreakerStore(client).keys("openai")
    calls = [
        Call("budget_spend", [budget], [0, 1, 1, "0"]),
        Call("budget_exclude_wait", [budget], [5]),
        Call("quota_spend", days, [1]),
        Call("breaker_record", breaker, ["success", "t", POLICY.threshold, 1000, 0]),
        Call("budget_spend", [budget], [0, 1, 1, "0"]),
    ]
    runs = slot_runs(calls)
    assert [[c.name for c in run] for run in runs] == [
        ["budget_spend", "budget_exclude_wait"],
        ["quota_spend"],
        ["breaker_record"],
        ["budget_spend"],
    ]
    for run in runs:
        assert len({slot_of(key) for call in run for key in call.keys}) == 1
    # A call with no keys goes with the run before it; one that spans slots goes alone
    keyless, spanning = Call("x", [], []), Call("y", [budget, breaker[0]], [])
    assert [len(run) for run in slot_runs([calls[0], keyless, spanning, calls[1]])] == [2, 1, 1]
    assert len(slot_runs([keyless, calls[0]])) == 1
