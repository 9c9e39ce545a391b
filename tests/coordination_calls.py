"""Every Lua script call site of the Redis stores, each made through the store's own method
(so its keys are built by the store's real key functions), and the multi-key commands and
pipelines beside them. `tests/unit/test_key_slots.py` records the keys each call sends and
checks they share one Redis Cluster hash slot; `tests/integration/test_redis_cluster.py`
makes the same calls against a real three-master cluster, where a script whose keys span
slots fails with `CROSSSLOT`.

Which stores may live on a cluster, and which stay on `Redis:Url` with the broker, is
docs/reliability.md's "Redis Cluster": `CLUSTER_SAFE` says it here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import redis

from tracon_jobs.coordination.event_feed import RedisEventFeed
from tracon_jobs.coordination.fair_share import RedisFairStore
from tracon_jobs.coordination.leases import RedisLeaseStore
from tracon_jobs.coordination.live_text import APPEND, FORGET, RedisLiveText, TextOp
from tracon_jobs.coordination.streams import StreamPlace, StreamPlaces
from tracon_jobs.limits.budget_store import Limits, RedisBudgetStore, Totals
from tracon_jobs.limits.quota_store import RedisQuotaStore, window_of
from tracon_jobs.limits.tenant_runs import RedisTenantRunStore
from tracon_jobs.resilience.breaker import BreakerPolicy, RedisBreakerStore
from tracon_jobs.resilience.cache import RedisResponseCache
from tracon_jobs.resilience.concurrency import RedisSlotStore
from tracon_jobs.resilience.rate_limits import RateLimit, RedisRateStore, Scope
from tracon_jobs.webhooks.circuits import transitions_key

POLICY = BreakerPolicy(threshold=3, break_ms=1000, max_probes=1, probe_lease_ms=1000)
LIMITS = Limits(depth=3, tokens=1000, cost=Decimal("1"), runs=10, duration=None)
RATE = RateLimit(requests=100, tokens=10_000)
SCOPES = [Scope("openai", RATE), Scope("openai/gpt-4o", RATE)]
"""A provider's limit and one of its models': one admission holds a call to both."""
DAY, MONTH = window_of("day"), window_of("month")


@dataclass
class Stores:
    """One of each Redis store, on one client."""

    breaker: RedisBreakerStore
    breaker_moves: RedisBreakerStore  # with circuit moves pushed for webhooks
    slots: RedisSlotStore
    rates: RedisRateStore
    budgets: RedisBudgetStore
    quotas: RedisQuotaStore
    tenant_runs: RedisTenantRunStore
    leases: RedisLeaseStore
    cache: RedisResponseCache
    streams: StreamPlaces
    feed: RedisEventFeed
    live_text: RedisLiveText
    fair: RedisFairStore

    @classmethod
    def on(cls, client: Any) -> Stores:
        """The stores on `client` (a `redis.Redis` or a `RedisCluster`)."""
        return cls(
            RedisBreakerStore(client),
            RedisBreakerStore(client, transitions=transitions_key),
            RedisSlotStore(client),
            RedisRateStore(client),
            RedisBudgetStore(client),
            RedisQuotaStore(client),
            RedisTenantRunStore(client),
            RedisLeaseStore(client),
            RedisResponseCache(client),
            StreamPlaces(client, limit=5),
            RedisEventFeed(client),
            RedisLiveText(client),
            RedisFairStore(client, lost_after_ms=10_000),
        )


CALL_SITES: dict[str, Callable[[Stores], object]] = {
    "breaker_admit": lambda s: s.breaker.admit("openai", POLICY, "t1"),
    "breaker_record": lambda s: s.breaker.record("openai", POLICY, "t1", "failure"),
    "breaker_record (success, deferred)": lambda s: s.breaker.note_success("openai", POLICY, "t1"),
    "breaker_record (circuit moves for webhooks)": lambda s: s.breaker_moves.record(
        "openai", POLICY, "t2", "failure"
    ),
    "slot_acquire": lambda s: s.slots.try_acquire("openai", "t1", 2, 60_000),
    "slot_renew": lambda s: s.slots.renew("openai", ["t1"], 60_000),
    "slot_release": lambda s: s.slots.release("openai", "t1"),
    "rate_admit (provider and model)": lambda s: s.rates.admit(SCOPES, "c1", 10, 60_000),
    "rate_correct (provider and model)": lambda s: s.rates.correct(SCOPES, "c1", 12),
    "rate_block": lambda s: s.rates.block("openai/gpt-4o", 1000),
    "rate_usage": lambda s: s.rates.usage("openai/gpt-4o", 60_000),
    "budget_open": lambda s: s.budgets.open("run-root", Totals()),
    "budget_gate": lambda s: s.budgets.gate("run-root", "model", LIMITS, reserve=10),
    "budget_spend": lambda s: s.budgets.spend(
        "run-root", released=10, tokens=8, cost=Decimal("0.01"), unknown_price=False
    ),
    "budget_exclude_wait": lambda s: s.budgets.exclude_wait("run-root", 5),
    "quota_gate": lambda s: s.quotas.gate("tenant-a", DAY, Decimal("5"), Decimal("0")),
    "quota_spend (day and month)": lambda s: s.quotas.spend(
        "tenant-a", [DAY, MONTH], Decimal("0.01")
    ),
    "tenant_admit": lambda s: s.tenant_runs.admit("tenant-a", "run-1", 2, 60_000),
    "tenant_renew": lambda s: s.tenant_runs.renew("tenant-a", "run-1", 60_000),
    "tenant_release": lambda s: s.tenant_runs.release("tenant-a", "run-1", 2, 60_000),
    "lease_acquire": lambda s: s.leases.acquire("tracon.requeue", "beat-1", 10_000),
    "lease_renew": lambda s: s.leases.renew("tracon.requeue", "beat-1", 10_000),
    "lease_release": lambda s: s.leases.release("tracon.requeue", "beat-1"),
    "cache_put": lambda s: s.cache.put("support", "request-hash", {"text": "hi"}, 60_000, 10),
    "stream_acquire": lambda s: s.streams.take("tenant-a"),
    "stream_renew": lambda s: s.streams.renew([StreamPlace("tenant-a")]),
    "feed_publish": lambda s: s.feed.publish("run-1", 1),
    "text_send (an append)": lambda s: s.live_text.append("run-1", 1, "Hello"),
    "text_send (a withdrawal)": lambda s: s.live_text.reset("run-1", 1),
    "text_send (ops of two runs)": lambda s: s.live_text.send(
        [TextOp("run-1", 1, APPEND, "Hi"), TextOp("run-2", 1, FORGET)]
    ),
    "fair_share (offer)": lambda s: s.fair.offer("run-1", "tenant-a", 5, None),
    "fair_share (register)": lambda s: s.fair.register("worker-1", 4, {"tenant-a": 1}),
    "fair_share (take)": lambda s: s.fair.take("run-1"),
    "fair_share (done)": lambda s: s.fair.done("run-1"),
    "fair_share (leave)": lambda s: s.fair.leave("worker-1"),
}
"""Call site -> the call, in an order that also makes sense against a real Redis."""

CROSS_SLOT: dict[str, str] = {
    "fair_share (offer)": "the fair lines are untagged keys next to the broker's list",
    "fair_share (register)": "the fair lines are untagged keys next to the broker's list",
    "fair_share (take)": "the fair lines are untagged keys next to the broker's list",
    "fair_share (done)": "the fair lines are untagged keys next to the broker's list",
    "fair_share (leave)": "the fair lines are untagged keys next to the broker's list",
}
"""The call sites whose keys span slots, and why: they stay on `Redis:Url` (one server or a
Sentinel group). The tests check each is still cross-slot, so this list cannot go stale."""

SPLIT_ON_A_CLUSTER: dict[str, str] = {
    "text_send (ops of two runs)": "the live text of a worker's streaming calls, sent together "
    "on `Redis:Url`; a cluster client sends one op a call",
}
"""The call sites whose keys span slots on one server, and which a cluster client cuts into
one call a slot itself: the tests check both."""

ON_REDIS_URL = {"feed_publish", *(site for site in CALL_SITES if site.startswith("text_send"))}
"""One slot each, but they `PUBLISH` to the web's listeners: they stay with the pub/sub
subscribers on `Redis:Url` (in a cluster every publish is broadcast to every node)."""

CLUSTER_SAFE = [name for name in CALL_SITES if name not in CROSS_SLOT]
"""The call sites a cluster runs as they are (`ON_REDIS_URL` too: they work, but stay)."""


class Recorded(Exception):
    """Raised by `Recorder` once it has the call: nothing after it matters."""


class Recorder:
    """Stands for a store's `Scripts` (of one server): keeps each call's script and keys,
    sends nothing."""

    cluster = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, name: str, keys: list[str], args: list[Any], *, reply: bool = True) -> Any:
        self.calls.append((name, list(keys)))
        raise Recorded

    def later(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self(name, keys, args)


def recorded(site: str) -> list[tuple[str, list[str]]]:
    """The script calls `site` makes, with their keys, sent nowhere (no server is needed)."""
    stores = Stores.on(redis.Redis(port=1))  # never connects
    recorder = Recorder()
    for store in vars(stores).values():
        store.scripts = recorder
    with contextlib.suppress(Recorded):
        CALL_SITES[site](stores)
    if not recorder.calls:
        raise AssertionError(f"{site} called no script")
    return recorder.calls
