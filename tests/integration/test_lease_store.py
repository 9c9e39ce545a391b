"""One contract suite for every LeaseStore (in-memory and Redis), with a thread race, plus
what only Redis has: its scripts, a server-side TTL, and an unreachable server.

The memory store runs on a fake clock; Redis leases run on Redis server time, so the Redis
side uses 100 ms leases and polls for their expiry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.helpers import wait_until
from tracon_jobs.coordination.leases import (
    LeaseStore,
    MemoryLeaseStore,
    RedisLeaseStore,
    Singleton,
)
from tracon_jobs.coordination.scripts import source
from tracon_jobs.embedded_redis import free_port

NAME = "tracon.reconcile.scan"
SHORT = 100
LONG = 30_000
POLL_TIMEOUT = 5.0


@dataclass
class Harness:
    """A store and a way to let time pass: moving a fake clock, or waiting on Redis."""

    store: LeaseStore
    clock: list[int] | None = None

    def let_pass(self, ms: int) -> None:
        if self.clock is not None:
            self.clock[0] += ms
        else:
            time.sleep(ms / 1000)

    def expire(self, name: str = NAME) -> None:
        """Until the lease is gone: one step past its TTL in memory, polled on Redis."""
        if self.clock is not None:
            self.clock[0] += SHORT + 1
            return
        store = self.store
        wait_until(lambda: store.owner_of(name) is None, what="lease expiry", timeout=POLL_TIMEOUT)


@pytest.fixture(params=["memory", "redis"])
def harness(request: pytest.FixtureRequest) -> Harness:
    if request.param == "memory":
        clock = [1_000_000]
        return Harness(MemoryLeaseStore(clock=lambda: clock[0]), clock)
    return Harness(RedisLeaseStore(request.getfixturevalue("redis_client")))


# -- the contract ---------------------------------------------------------------------------


def test_one_owner_takes_a_free_lease_and_others_are_refused(harness: Harness) -> None:
    store = harness.store

    assert store.owner_of(NAME) is None
    assert store.acquire(NAME, "a", LONG)
    assert not store.acquire(NAME, "b", LONG)
    assert store.owner_of(NAME) == "a"


def test_the_owner_acquiring_again_keeps_and_extends_its_lease(harness: Harness) -> None:
    store = harness.store
    assert store.acquire(NAME, "a", SHORT)

    assert store.acquire(NAME, "a", LONG)
    harness.let_pass(SHORT + 50)

    assert store.owner_of(NAME) == "a"
    assert not store.acquire(NAME, "b", LONG)


def test_only_the_owner_can_renew(harness: Harness) -> None:
    store = harness.store
    # a second, not SHORT: on a loaded machine 100 ms could pass before the owner's renewal
    assert store.acquire(NAME, "a", 1000)

    assert not store.renew(NAME, "b", LONG)
    assert store.renew(NAME, "a", LONG)
    harness.let_pass(1000 + 50)

    assert store.owner_of(NAME) == "a"


def test_a_renewal_never_revives_an_expired_lease(harness: Harness) -> None:
    store = harness.store
    assert store.acquire(NAME, "a", SHORT)
    harness.expire()

    assert not store.renew(NAME, "a", LONG)
    assert store.owner_of(NAME) is None


def test_only_the_owner_can_release(harness: Harness) -> None:
    store = harness.store
    assert store.acquire(NAME, "a", LONG)

    assert not store.release(NAME, "b")
    assert store.owner_of(NAME) == "a"
    assert store.release(NAME, "a")
    assert store.owner_of(NAME) is None
    assert store.acquire(NAME, "b", LONG)


def test_expiry_lets_another_owner_in(harness: Harness) -> None:
    store = harness.store
    assert store.acquire(NAME, "a", SHORT)
    assert not store.acquire(NAME, "b", SHORT)

    harness.expire()

    assert store.acquire(NAME, "b", LONG)
    assert store.owner_of(NAME) == "b"


def test_a_late_owner_can_neither_renew_nor_release_the_next_owners_lease(
    harness: Harness,
) -> None:
    # Given a lease that expired and was taken by b
    store = harness.store
    assert store.acquire(NAME, "a", SHORT)
    harness.expire()
    assert store.acquire(NAME, "b", LONG)
    # When a, unaware, renews and releases
    renewed = store.renew(NAME, "a", LONG)
    released = store.release(NAME, "a")
    # Then b still owns it
    assert not renewed and not released
    assert store.owner_of(NAME) == "b"


def test_leases_of_different_names_are_independent(harness: Harness) -> None:
    store = harness.store

    assert store.acquire("scan", "a", LONG)
    assert store.acquire("purge", "b", LONG)
    assert store.release("scan", "a")

    assert (store.owner_of("scan"), store.owner_of("purge")) == (None, "b")


def test_sixteen_threads_racing_for_one_lease_make_one_owner(harness: Harness) -> None:
    store = harness.store
    start = threading.Barrier(16)
    winners: list[str] = []
    lock = threading.Lock()

    def race(owner: str) -> None:
        start.wait(timeout=10)
        if store.acquire(NAME, owner, LONG):
            with lock:
                winners.append(owner)

    threads = [threading.Thread(target=race, args=(f"owner-{i}",)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert len(winners) == 1, winners
    assert store.owner_of(NAME) == winners[0]


# -- Redis only -----------------------------------------------------------------------------


@pytest.fixture
def redis_store(redis_client: redis.Redis) -> RedisLeaseStore:
    return RedisLeaseStore(redis_client)


def test_a_redis_lease_carries_a_server_side_ttl(redis_store: RedisLeaseStore) -> None:
    assert redis_store.acquire(NAME, "a", LONG)
    first = redis_store.client.pttl(redis_store.key(NAME))

    assert redis_store.renew(NAME, "a", LONG)

    assert 0 < first <= LONG
    assert 0 < redis_store.client.pttl(redis_store.key(NAME)) <= LONG


@pytest.mark.parametrize("script", ["lease_acquire", "lease_renew", "lease_release"])
def test_each_script_opens_with_the_keys_and_arguments_it_takes(script: str) -> None:
    opening = "\n".join(line for line in source(script).splitlines() if line.startswith("--"))

    assert "KEYS[1]" in opening and "ARGV[1]" in opening


@pytest.fixture
def unreachable() -> Iterator[redis.Redis]:
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    yield client
    client.close()


def test_an_unreachable_redis_raises_and_the_elector_says_not_owner(
    unreachable: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisLeaseStore(unreachable)
    with pytest.raises(redis.ConnectionError):
        store.acquire(NAME, "a", LONG)

    singleton = Singleton(store, "a", LONG, background=False)

    assert not singleton.is_owner(NAME)
    assert not singleton.still_owner(NAME)
    assert "acquire failed" in caplog.text


def test_an_elector_on_redis_renews_in_the_background(redis_store: RedisLeaseStore) -> None:
    # Given an owner with a 1.5 s lease renewed every 0.5 s by its own thread (a second of
    # slack: a 600 ms lease once ran out on a machine busy with real-process tests)
    owner = Singleton(redis_store, "a", 1500)
    other = Singleton(redis_store, "b", 1500, background=False)
    assert owner.is_owner(NAME)
    # When two lease durations pass
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert owner.still_owner(NAME)
        assert not other.is_owner(NAME)
        time.sleep(0.02)
    # Then it kept the lease all along, and gives it back at shutdown
    owner.release_all()
    assert redis_store.owner_of(NAME) is None
    assert other.is_owner(NAME)
