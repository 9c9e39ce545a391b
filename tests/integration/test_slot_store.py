"""One contract suite for every SlotStore (in-memory and Redis), a thread race through
`Slots.hold`, cancellation of a waiter, and the Redis leases that free crashed holders and
drop waiters that stopped polling.

Leases run on Redis server time, so the Redis-only lease tests use short leases and poll.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from tests.helpers import wait_until
from tracon_jobs.abort import AbortSignal
from tracon_jobs.errors import ProviderError
from tracon_jobs.resilience.concurrency import (
    MemorySlotStore,
    RedisSlotStore,
    Slots,
    SlotStore,
    SlotUsage,
)

P = "openai"
LEASE = 30_000
POLL_TIMEOUT = 5.0


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> SlotStore:
    if request.param == "memory":
        return MemorySlotStore()
    return RedisSlotStore(request.getfixturevalue("redis_client"))


@pytest.fixture
def redis_store(redis_client: redis.Redis) -> RedisSlotStore:
    return RedisSlotStore(redis_client)


def acquire(store: SlotStore, token: str, limit: int = 1, lease_ms: int = LEASE) -> bool:
    return store.try_acquire(P, token, limit, lease_ms)


# -- the contract ---------------------------------------------------------------------------


def test_limit_is_respected(store: SlotStore) -> None:
    assert [acquire(store, t, limit=2) for t in ("a", "b", "c", "d")] == [
        True,
        True,
        False,
        False,
    ]
    assert store.usage(P) == (2, 2)


def test_a_holder_asking_again_keeps_its_slot(store: SlotStore) -> None:
    assert acquire(store, "a")
    assert acquire(store, "a")
    assert store.usage(P) == (1, 0)


def test_waiters_get_slots_first_come_first_served(store: SlotStore) -> None:
    # Given one slot held and three waiters queued in the order w1, w2, w3
    assert acquire(store, "holder")
    assert [acquire(store, w) for w in ("w1", "w2", "w3")] == [False, False, False]
    # When slots free one at a time, whatever order the waiters poll in
    order: list[str] = []
    previous = "holder"
    for _ in range(3):
        store.release(P, previous)
        winners = [w for w in ("w3", "w2", "w1") if w not in order and acquire(store, w)]
        assert len(winners) == 1, winners
        order.append(previous := winners[0])
    # Then they got them in the order they queued
    assert order == ["w1", "w2", "w3"]


def test_a_late_caller_does_not_jump_the_queue(store: SlotStore) -> None:
    assert acquire(store, "holder")
    assert not acquire(store, "w1")
    store.release(P, "holder")
    assert not acquire(store, "newcomer")
    assert acquire(store, "w1")


def test_releasing_a_waiter_removes_it_from_the_queue(store: SlotStore) -> None:
    # Given a holder and two waiters
    assert acquire(store, "holder")
    assert not acquire(store, "w1")
    assert not acquire(store, "w2")
    # When the first waiter gives up
    store.release(P, "w1")
    assert store.usage(P) == (1, 1)
    # Then the second is next in line once the slot frees
    store.release(P, "holder")
    assert acquire(store, "w2")
    assert store.usage(P) == (1, 0)


def test_usage_counts_holders_and_waiters(store: SlotStore) -> None:
    assert store.usage(P) == (0, 0)
    for token in ("a", "b", "c", "d", "e"):
        acquire(store, token, limit=3)
    assert store.usage(P) == (3, 2)
    assert store.usage("anthropic") == (0, 0)
    store.release(P, "a")
    store.release(P, "b")
    assert store.usage(P) == (1, 2)
    assert acquire(store, "d", limit=3) and acquire(store, "e", limit=3)
    assert store.usage(P) == (3, 0)


def test_releasing_an_unknown_token_changes_nothing(store: SlotStore) -> None:
    assert acquire(store, "a")
    store.release(P, "stranger")
    assert store.usage(P) == (1, 0)


def test_renew_counts_only_tokens_still_held(store: SlotStore) -> None:
    assert acquire(store, "a", limit=2)
    assert acquire(store, "b", limit=2)
    store.release(P, "b")
    assert store.renew(P, ["a", "b", "stranger"], LEASE) == 1


def test_providers_have_separate_slots(store: SlotStore) -> None:
    assert acquire(store, "a")
    assert store.try_acquire("anthropic", "b", 1, LEASE)


# -- Slots.hold -----------------------------------------------------------------------------


def test_thread_race_never_exceeds_the_limit(store: SlotStore) -> None:
    # Given 24 threads, limit 3, each holding a slot around a section that counts holders
    slots = Slots(store, 3, LEASE)
    lock = threading.Lock()
    inside, most, finished = 0, 0, 0
    barrier = threading.Barrier(24)

    def call(_i: int) -> None:
        nonlocal inside, most, finished
        barrier.wait(timeout=10)
        with slots.hold(P, AbortSignal()):
            with lock:
                inside += 1
                most = max(most, inside)
            time.sleep(0.005)  # the provider call
            with lock:
                inside -= 1
                finished += 1

    # When they all run at once
    with ThreadPoolExecutor(24) as pool:
        list(pool.map(call, range(24)))
    # Then no more than 3 were ever inside, all finished, and every slot came back
    assert most <= 3
    assert most >= 2  # they did overlap: the race was real
    assert finished == 24
    assert store.usage(P) == (0, 0)


class UntouchableStore:
    """A store that fails the test if anything calls it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was called: {name}")


def test_no_limit_makes_no_store_call() -> None:
    slots = Slots(UntouchableStore(), None, LEASE)
    for _ in range(3):
        with slots.hold(P, AbortSignal()):
            pass
    assert slots.usage(P) == SlotUsage(P, None, 0, 0)


def test_slots_hold_releases_on_error(store: SlotStore) -> None:
    slots = Slots(store, 1, LEASE)
    with pytest.raises(RuntimeError), slots.hold(P, AbortSignal()):
        raise RuntimeError("provider blew up")
    assert store.usage(P) == (0, 0)
    assert slots.usage(P) == SlotUsage(P, 1, 0, 0)


def test_a_blocked_waiter_is_cancelled_promptly(store: SlotStore) -> None:
    # Given the only slot held elsewhere and a caller waiting for it in another thread
    assert acquire(store, "blocker")
    slots = Slots(store, 1, LEASE)
    signal = AbortSignal()
    raised: list[BaseException] = []
    entered = threading.Event()

    def wait_for_slot() -> None:
        try:
            with slots.hold(P, signal):
                entered.set()
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait_for_slot)
    waiter.start()
    wait_until(lambda: store.usage(P) == (1, 1), what="the waiter queued", timeout=POLL_TIMEOUT)
    # When its run's signal fires
    fired = time.monotonic()
    signal.abort("run cancelled")
    waiter.join(timeout=10)
    # Then it stops waiting at once with a cancelled ProviderError, and leaves the queue
    assert not waiter.is_alive()
    assert time.monotonic() - fired < 5  # the slot is never given back: the wait had no end
    assert not entered.is_set()
    assert len(raised) == 1 and isinstance(raised[0], ProviderError)
    assert raised[0].kind == "cancelled" and raised[0].provider == P
    assert store.usage(P) == (1, 0)


# -- Redis leases ---------------------------------------------------------------------------


def test_a_crashed_holder_frees_its_slot_after_the_lease(redis_store: RedisSlotStore) -> None:
    # Given a holder with a 300 ms lease that will never release or renew
    started = time.monotonic()
    assert acquire(redis_store, "crashed", lease_ms=300)
    assert not acquire(redis_store, "next")
    # Then the slot frees once the lease ends, not before
    wait_until(
        lambda: acquire(redis_store, "next"),
        what="the crashed holder's slot freed",
        timeout=POLL_TIMEOUT,
    )
    assert time.monotonic() - started >= 0.25
    assert redis_store.usage(P) == (1, 0)


def test_usage_ignores_a_holder_whose_lease_ended(redis_store: RedisSlotStore) -> None:
    assert acquire(redis_store, "crashed", lease_ms=300)
    assert redis_store.usage(P) == (1, 0)
    wait_until(
        lambda: redis_store.usage(P) == (0, 0),
        what="the expired holder left usage",
        timeout=POLL_TIMEOUT,
    )


def test_a_live_holder_keeps_its_slot_past_the_lease(redis_store: RedisSlotStore) -> None:
    # Given a holder inside Slots.hold with a 1 s lease, renewed in the background
    slots = Slots(redis_store, 1, 1000)
    with slots.hold(P, AbortSignal()):
        # When three leases' worth of time passes
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            # Then nobody else gets the slot
            assert not acquire(redis_store, "other")
            time.sleep(0.02)
    assert acquire(redis_store, "other")


def test_a_waiter_that_stopped_polling_is_dropped(
    redis_client: redis.Redis,
) -> None:
    # Given waiter leases of 300 ms, a holder, a waiter that crashed, and a live waiter
    redis_store = RedisSlotStore(redis_client, waiter_lease_ms=300)
    assert acquire(redis_store, "holder")
    assert not acquire(redis_store, "crashed-waiter")
    assert not acquire(redis_store, "alive")
    # When the slot frees and only the live waiter keeps polling
    redis_store.release(P, "holder")
    assert redis_store.usage(P) == (0, 2)
    # Then the crashed waiter's place expires and the live one gets the slot
    wait_until(
        lambda: acquire(redis_store, "alive"),
        what="the live waiter got the slot",
        timeout=POLL_TIMEOUT,
    )
    assert redis_store.usage(P) == (1, 0)


def test_usage_ignores_a_waiter_that_stopped_polling(
    redis_client: redis.Redis,
) -> None:
    # Given waiter leases of 300 ms, a live holder and a waiter that crashed while queued
    redis_store = RedisSlotStore(redis_client, waiter_lease_ms=300)
    assert acquire(redis_store, "holder")
    assert not acquire(redis_store, "crashed-waiter")
    assert redis_store.usage(P) == (1, 1)
    # Then once its waiter lease ends it is no longer reported as waiting, as an expired
    # holder is no longer reported in use, even while no other caller polls this provider
    wait_until(
        lambda: redis_store.usage(P) == (1, 0),
        what="the crashed waiter left usage",
        timeout=POLL_TIMEOUT,
    )


class FlakyRenewals(MemorySlotStore):
    """Its first renewal fails as no Redis error does (a client closed under the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals = 0

    def renew(self, provider: str, tokens: list[str], lease_ms: int) -> int:
        self.renewals += 1
        if self.renewals == 1:
            raise TypeError("argument must be an int, or have a fileno() method.")
        return super().renew(provider, tokens, lease_ms)


def test_the_renewer_outlives_an_unexpected_error() -> None:
    """Before: the renewer caught Redis errors only; a TypeError from a closed client ended
    its thread, and every slot held after that let its lease lapse mid-call."""
    store = FlakyRenewals()
    slots = Slots(store, 1, 300)  # renewed every 100 ms
    with slots.hold(P, AbortSignal()):
        wait_until(
            lambda: store.renewals >= 3, what="renewals after the failed one", timeout=POLL_TIMEOUT
        )
    assert store.usage(P) == (0, 0)
