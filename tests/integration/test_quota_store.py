"""One contract suite for every QuotaStore (in-memory and Redis): seeding once, the gate,
spend into the day's and the month's counters, a lost counter, and a 16-thread race in
which no spend is lost. Plus the windows themselves."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from decimal import Decimal

import pytest
import redis

from tracon_jobs.limits.quota_store import (
    MemoryQuotaStore,
    QuotaStore,
    RedisQuotaStore,
    window_of,
)

NOW = datetime(2026, 11, 30, 17, 45, 10)
DAY = window_of("day", NOW)
MONTH = window_of("month", NOW)
T = "tenant-a"


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> QuotaStore:
    if request.param == "memory":
        return MemoryQuotaStore()
    return RedisQuotaStore(request.getfixturevalue("redis_client"))


def test_windows_are_utc_days_and_calendar_months() -> None:
    assert (DAY.label, DAY.start, DAY.end) == (
        "2026-11-30",
        datetime(2026, 11, 30),
        datetime(2026, 12, 1),
    )
    assert (MONTH.label, MONTH.end) == ("2026-11", datetime(2026, 12, 1))
    december = window_of("month", datetime(2026, 12, 31, 23, 59))
    assert (december.label, december.end) == ("2026-12", datetime(2027, 1, 1))
    assert DAY.seconds_left(NOW) == 6 * 3600 + 14 * 60 + 50
    assert DAY.seconds_left(datetime(2026, 11, 30, 23, 59, 59, 500_000)) == 1


def test_a_counter_that_is_not_there_is_lost_until_seeded(store: QuotaStore) -> None:
    assert store.gate(T, DAY, Decimal(1), Decimal(0)).lost
    assert store.used(T, DAY) is None
    assert store.spend(T, [DAY, MONTH], Decimal("0.5")) == 0  # nothing to add to yet
    assert store.open(T, DAY, Decimal("0.25"), NOW) is True
    assert store.open(T, DAY, Decimal("9"), NOW) is False  # the first seed wins
    assert store.used(T, DAY) == Decimal("0.25")


def test_the_gate_refuses_once_the_limit_is_reached(store: QuotaStore) -> None:
    store.open(T, DAY, Decimal(0), NOW)
    assert store.gate(T, DAY, Decimal(1), Decimal(0)).allowed
    store.spend(T, [DAY], Decimal("0.6"))
    verdict = store.gate(T, DAY, Decimal(1), Decimal(0))
    assert verdict.allowed and verdict.used == Decimal("0.6")
    assert store.gate(T, DAY, Decimal(1), Decimal("0.4")).refused == "CostLimit"  # unseen counts
    store.spend(T, [DAY], Decimal("0.4"))
    verdict = store.gate(T, DAY, Decimal(1), Decimal(0))
    assert (verdict.refused, verdict.used) == ("CostLimit", Decimal(1))
    assert store.gate(T, DAY, Decimal(0), Decimal(0)).refused == "CostLimit"  # 0: nothing


def test_a_spend_counts_in_every_window_that_exists(store: QuotaStore) -> None:
    store.open(T, DAY, Decimal(0), NOW)
    store.open(T, MONTH, Decimal(3), NOW)
    assert store.spend(T, [DAY, MONTH], Decimal("0.000000001")) == 2
    assert store.used(T, DAY) == Decimal("0.000000001")
    assert store.used(T, MONTH) == Decimal("3.000000001")
    assert store.used("tenant-b", DAY) is None  # another tenant has its own counters


def test_large_amounts_stay_exact(store: QuotaStore) -> None:
    store.open(T, MONTH, Decimal("1234567.123456789"), NOW)
    store.spend(T, [MONTH], Decimal("0.000000001"))
    assert store.used(T, MONTH) == Decimal("1234567.123456790")
    assert store.gate(T, MONTH, Decimal("1234567.12345679"), Decimal(0)).refused


def test_sixteen_threads_spending_at_once_lose_nothing(store: QuotaStore) -> None:
    store.open(T, DAY, Decimal(0), NOW)
    store.open(T, MONTH, Decimal(0), NOW)

    def spend(_: int) -> None:
        for _ in range(50):
            store.spend(T, [DAY, MONTH], Decimal("0.001"))
            store.gate(T, DAY, Decimal(1000), Decimal(0))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(spend, range(16)))
    assert store.used(T, DAY) == Decimal("0.8")  # 16 x 50 x 0.001
    assert store.used(T, MONTH) == Decimal("0.8")


def test_the_redis_counter_expires_after_its_window(redis_client: redis.Redis) -> None:
    store = RedisQuotaStore(redis_client)
    store.open(T, DAY, Decimal(0), NOW)
    ttl = redis_client.pttl(store.key(T, DAY))
    assert isinstance(ttl, int)
    assert DAY.ttl_ms(NOW) - 5_000 < ttl <= DAY.ttl_ms(NOW)
    assert store.key(T, DAY) == "tracon:quota:{tenant-a}:2026-11-30"
