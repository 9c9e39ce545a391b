"""The elector on the in-memory store and a fake clock: who is the owner, when ownership
ends, and that a disabled elector changes nothing. Background renewal is driven by calling
`refresh()`, as the renewer thread would every third of the TTL."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from tracon_jobs.coordination.leases import MemoryLeaseStore, Singleton

NAME = "tracon.idempotency.purge"
TTL = 60_000
INTERVAL = TTL // 3


class Clock:
    def __init__(self) -> None:
        self.now = 5_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


class FlakyStore(MemoryLeaseStore):
    """A memory store whose renewals can be refused or fail like an unreachable Redis."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.refuse = False
        self.down = False

    def acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        self._maybe_down()
        return super().acquire(name, owner, ttl_ms)

    def renew(self, name: str, owner: str, ttl_ms: int) -> bool:
        self._maybe_down()
        return not self.refuse and super().renew(name, owner, ttl_ms)

    def _maybe_down(self) -> None:
        if self.down:
            raise redis.ConnectionError("Connection refused")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> FlakyStore:
    return FlakyStore(clock)


def elector(store: MemoryLeaseStore, clock: Clock, owner: str, enabled: bool = True) -> Singleton:
    return Singleton(store, owner, TTL, enabled, clock=clock, background=False)


# -- is_owner / still_owner ------------------------------------------------------------------


def test_the_first_to_ask_becomes_the_owner_and_stays_it(store: FlakyStore, clock: Clock) -> None:
    a, b = elector(store, clock, "a"), elector(store, clock, "b")

    assert not a.still_owner(NAME)  # never asked: owns nothing
    assert a.is_owner(NAME)
    assert not b.is_owner(NAME)
    assert a.is_owner(NAME)  # confirmed, not refused by its own lease
    assert a.still_owner(NAME) and not b.still_owner(NAME)
    assert a.held() == [NAME] and b.held() == []


def test_belief_ends_before_the_store_would_expire_the_lease(
    store: FlakyStore, clock: Clock
) -> None:
    # Given an owner that is never renewed (its renewer stalled)
    a = elector(store, clock, "a")
    assert a.is_owner(NAME)
    # When the TTL less the drift margin has passed
    clock.advance(TTL - a.drift_ms)
    # Then it no longer believes, while the store still holds its lease: no overlap
    assert not a.still_owner(NAME)
    assert store.owner_of(NAME) == "a"


def test_renewals_every_third_of_the_ttl_keep_the_lease(store: FlakyStore, clock: Clock) -> None:
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.is_owner(NAME) and not b.is_owner(NAME)

    for _ in range(10):  # ten intervals: more than three TTLs
        clock.advance(INTERVAL)
        a.refresh()
        b.refresh()
        assert a.still_owner(NAME) and not b.still_owner(NAME)


def test_a_refused_renewal_stops_ownership_at_once(
    store: FlakyStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a = elector(store, clock, "a")
    assert a.is_owner(NAME)

    store.refuse = True
    a.refresh()  # no time passes

    assert not a.still_owner(NAME)
    assert "renewal refused" in caplog.text


def test_a_failed_renewal_stops_ownership_at_once_and_is_logged(
    store: FlakyStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a = elector(store, clock, "a")
    assert a.is_owner(NAME)

    store.down = True
    with caplog.at_level(logging.WARNING):
        a.refresh()

    assert not a.still_owner(NAME)
    assert not a.is_owner(NAME)
    assert "renewal failed" in caplog.text and "Connection refused" in caplog.text


def test_ownership_comes_back_once_the_store_does(store: FlakyStore, clock: Clock) -> None:
    a = elector(store, clock, "a")
    assert a.is_owner(NAME)
    store.down = True
    a.refresh()
    assert not a.still_owner(NAME)

    store.down = False
    a.refresh()  # a wanted lease is retried in the background, and it is still ours

    assert a.still_owner(NAME)


def test_a_dead_owner_is_replaced_within_one_lease_and_one_renewal(
    store: FlakyStore, clock: Clock
) -> None:
    # Given a asked and owns; b asked once and wants it
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.is_owner(NAME) and not b.is_owner(NAME)
    # When a dies right after a renewal, and only b's background passes run
    a.refresh()
    died_at = clock.now
    while not b.still_owner(NAME):
        clock.advance(INTERVAL)
        b.refresh()
        assert clock.now - died_at <= TTL + INTERVAL, "no takeover within TTL + interval"
    # Then b took over, and not before a's lease ran out
    assert clock.now - died_at > TTL
    assert store.owner_of(NAME) == "b"


def test_release_all_hands_the_lease_over_at_once(store: FlakyStore, clock: Clock) -> None:
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.is_owner(NAME)

    a.release_all()

    assert not a.still_owner(NAME)
    assert b.is_owner(NAME)
    a.refresh()  # no longer wanted: a does not compete again on its own
    assert store.owner_of(NAME) == "b"


def test_a_renewal_in_flight_during_release_all_does_not_bring_ownership_back(
    clock: Clock,
) -> None:
    class ReleasingStore(MemoryLeaseStore):
        """Shutdown happens while the renewal is on the wire."""

        elector: Singleton

        def renew(self, name: str, owner: str, ttl_ms: int) -> bool:
            granted = super().renew(name, owner, ttl_ms)
            self.elector.release_all()
            return granted

    store = ReleasingStore(clock)
    a = store.elector = elector(store, clock, "a")
    assert a.is_owner(NAME)

    a.refresh()

    assert not a.still_owner(NAME)
    assert a.held() == []


# -- disabled ---------------------------------------------------------------------------------


def test_disabled_everyone_is_the_owner_and_the_store_is_never_touched(
    store: FlakyStore, clock: Clock
) -> None:
    a, b = elector(store, clock, "a", False), elector(store, clock, "b", False)
    store.down = True  # any store call would raise

    assert a.is_owner(NAME) and b.is_owner(NAME)
    clock.advance(10 * TTL)
    assert a.still_owner(NAME) and b.still_owner(NAME)
    assert a.is_owner(NAME) and b.is_owner(NAME)  # each runs every pass


# -- validation and the real thread ------------------------------------------------------------


@pytest.mark.parametrize(("owner", "ttl"), [("a", 0), ("a", -5), ("", 1000)])
def test_a_lease_needs_an_owner_and_a_positive_ttl(owner: str, ttl: int) -> None:
    with pytest.raises(ValueError):
        Singleton(MemoryLeaseStore(), owner, ttl)


def test_the_background_thread_renews_on_its_own() -> None:
    # Given a 300 ms lease on the real monotonic clock, renewed every 100 ms by its thread
    store = MemoryLeaseStore()
    a = Singleton(store, "a", 300)
    b = Singleton(store, "b", 300, background=False)
    assert a.is_owner(NAME)
    try:
        # Then it stays the owner over three TTLs, and b is refused all along
        until = time.monotonic() + 0.9
        while time.monotonic() < until:
            assert not b.is_owner(NAME)
            time.sleep(0.01)
    finally:
        a.release_all()
    assert b.is_owner(NAME)
