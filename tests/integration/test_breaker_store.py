"""One contract suite for every BreakerStore (in-memory with a fake clock, Redis with server
time), thread and process races, and the `CircuitBreaker` facade around a store.

Time: the memory store's clock is advanced by hand; Redis reads its own clock, so a test that
needs a break or a lease to end uses a tiny one and polls the snapshot until it shows the end.
Deadlines are checked against bounds read from the store's own clock before and after a call.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tracon_jobs.coordination.scripts import deferring
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.errors import ProviderUnavailableError
from tracon_jobs.resilience.breaker import (
    Admission,
    BreakerPolicy,
    BreakerStore,
    CircuitBreaker,
    CircuitSnapshot,
    MemoryBreakerStore,
    Outcome,
    RedisBreakerStore,
    Transition,
)

P = "openai"
T0 = 5_000_000
POLL_TIMEOUT = 5.0
# Time does not matter: nothing ends during a test.
LONG = BreakerPolicy(threshold=3, break_ms=60_000, max_probes=1, probe_lease_ms=60_000)
# The break ends almost at once; a probe keeps its lease for the whole test.
SHORT = replace(LONG, break_ms=50)
# The break and a probe's lease both end quickly.
SHORT_LEASE = replace(SHORT, probe_lease_ms=300)


class FakeClock:
    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@dataclass
class Harness:
    """A store plus its clock: advanced by hand (memory) or read from Redis."""

    store: BreakerStore
    clock: FakeClock | None = None
    client: redis.Redis | None = None

    def now(self) -> int:
        if self.clock is not None:
            return self.clock()
        assert self.client is not None
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def let_pass(self, ms: int, until: Callable[[CircuitSnapshot], bool]) -> CircuitSnapshot:
        """Let `ms` of the store's time pass, then return the first snapshot `until` accepts."""
        if self.clock is not None:
            self.clock.now += ms
        deadline = time.monotonic() + POLL_TIMEOUT
        while not until(snapshot := self.store.snapshot(P)):
            assert time.monotonic() < deadline, f"still {snapshot} after {POLL_TIMEOUT}s"
            time.sleep(0.005)
        return snapshot

    def open(self, policy: BreakerPolicy, retry_after_ms: int = 0) -> Transition:
        change = Transition("closed", "closed")
        for _ in range(policy.threshold):
            change = self.store.record(P, policy, "opener", "failure", retry_after_ms)
        assert (change.before, change.after) == ("closed", "open")
        return change

    def half_open(self, policy: BreakerPolicy) -> None:
        """Open the circuit and wait out its break; the next admission is a probe."""
        self.open(policy)
        self.let_pass(policy.break_ms, lambda s: s.state == "half_open")

    def timed(self, call: Callable[[], Any]) -> tuple[Any, int, int]:
        """Call and return (result, store time before, store time after)."""
        before = self.now()
        result = call()
        return result, before, self.now()


@pytest.fixture(params=["memory", "redis"])
def h(request: pytest.FixtureRequest) -> Harness:
    if request.param == "memory":
        clock = FakeClock()
        return Harness(MemoryBreakerStore(clock=clock), clock=clock)
    client: redis.Redis = request.getfixturevalue("redis_client")
    return Harness(RedisBreakerStore(client), client=client)


def fail(h: Harness, policy: BreakerPolicy, token: str = "t", retry_ms: int = 0) -> Transition:
    return h.store.record(P, policy, token, "failure", retry_ms)


def record(h: Harness, policy: BreakerPolicy, token: str, outcome: Outcome) -> Transition:
    return h.store.record(P, policy, token, outcome)


# -- the state machine at the store level ---------------------------------------------------


def test_closed_admits_without_a_probe(h: Harness) -> None:
    assert h.store.admit(P, LONG, "a") == Admission(True, False, 0, "closed", "closed")
    assert h.store.snapshot(P) == CircuitSnapshot(P, "closed", 0, 0, 0)


def test_opens_at_exactly_the_threshold(h: Harness) -> None:
    for failures in range(1, LONG.threshold):
        assert fail(h, LONG) == Transition("closed", "closed", failures, 0)
        assert h.store.admit(P, LONG, "a").allowed
    change, before, after = h.timed(lambda: fail(h, LONG))
    assert (change.before, change.after, change.failures) == ("closed", "open", LONG.threshold)
    assert before + LONG.break_ms <= change.open_until_ms <= after + LONG.break_ms
    assert not h.store.admit(P, LONG, "a").allowed


def test_success_resets_the_count(h: Harness) -> None:
    for _ in range(LONG.threshold - 1):
        fail(h, LONG)
    assert record(h, LONG, "t", "success") == Transition("closed", "closed", 0, 0)
    assert h.store.snapshot(P).failures == 0
    for _ in range(LONG.threshold - 1):
        fail(h, LONG)
    assert h.store.snapshot(P).state == "closed"


def test_circuits_are_per_provider(h: Harness) -> None:
    h.open(LONG)
    assert h.store.admit("anthropic", LONG, "a").allowed
    assert h.store.snapshot("anthropic") == CircuitSnapshot("anthropic", "closed", 0, 0, 0)


def test_open_rejects_with_the_remaining_break(h: Harness) -> None:
    opened = h.open(LONG)
    if h.clock is not None:
        h.clock.now += 400
    admission, before, after = h.timed(lambda: h.store.admit(P, LONG, "b"))
    assert not admission.allowed and not admission.probe
    assert (admission.before, admission.after) == ("open", "open")
    assert opened.open_until_ms - after <= admission.retry_after_ms
    assert admission.retry_after_ms <= opened.open_until_ms - before


def test_retry_after_longer_than_the_break_extends_the_opening_failure(h: Harness) -> None:
    for _ in range(LONG.threshold - 1):
        fail(h, LONG)
    change, before, after = h.timed(lambda: fail(h, LONG, retry_ms=600_000))
    assert change.after == "open"
    assert before + 600_000 <= change.open_until_ms <= after + 600_000
    assert h.store.snapshot(P).retry_after_ms > LONG.break_ms


def test_retry_after_shorter_than_the_break_does_not_shorten_it(h: Harness) -> None:
    for _ in range(LONG.threshold - 1):
        fail(h, LONG)
    change, before, _after = h.timed(lambda: fail(h, LONG, retry_ms=10))
    assert change.open_until_ms >= before + LONG.break_ms


def test_retry_after_while_open_only_moves_the_deadline_later(h: Harness) -> None:
    opened = h.open(LONG)
    later, before, after = h.timed(lambda: fail(h, LONG, retry_ms=600_000))
    assert (later.before, later.after) == ("open", "open")
    assert before + 600_000 <= later.open_until_ms <= after + 600_000
    assert later.open_until_ms > opened.open_until_ms
    shorter = fail(h, LONG, retry_ms=1_000)
    assert shorter.open_until_ms == later.open_until_ms
    assert fail(h, LONG).open_until_ms == later.open_until_ms
    assert h.store.snapshot(P).retry_after_ms > LONG.break_ms


def test_after_the_break_one_probe_is_admitted_and_a_second_caller_rejected(h: Harness) -> None:
    h.half_open(SHORT)
    assert h.store.admit(P, SHORT, "probe") == Admission(True, True, 0, "open", "half_open")
    second = h.store.admit(P, SHORT, "other")
    assert not second.allowed and not second.probe
    assert 0 < second.retry_after_ms <= SHORT.probe_lease_ms
    assert (second.before, second.after) == ("half_open", "half_open")
    assert h.store.snapshot(P).probes == 1


def test_probe_success_closes(h: Harness) -> None:
    h.half_open(SHORT)
    assert h.store.admit(P, SHORT, "probe").probe
    assert record(h, SHORT, "probe", "success") == Transition("half_open", "closed", 0, 0)
    assert h.store.snapshot(P) == CircuitSnapshot(P, "closed", 0, 0, 0)
    assert h.store.admit(P, SHORT, "next") == Admission(True, False, 0, "closed", "closed")


def test_probe_failure_reopens_for_a_new_break(h: Harness) -> None:
    h.half_open(SHORT)
    assert h.store.admit(P, SHORT, "probe").probe
    change, before, after = h.timed(lambda: fail(h, SHORT, "probe", retry_ms=600_000))
    assert (change.before, change.after) == ("half_open", "open")
    assert before + 600_000 <= change.open_until_ms <= after + 600_000
    snapshot = h.store.snapshot(P)
    assert (snapshot.state, snapshot.probes) == ("open", 0)
    assert not h.store.admit(P, SHORT, "next").allowed


def test_probe_failure_reopens_for_break_duration(h: Harness) -> None:
    policy = replace(LONG, break_ms=50)
    h.half_open(policy)
    assert h.store.admit(P, policy, "probe").probe
    change, before, after = h.timed(lambda: fail(h, policy, "probe"))
    assert change.after == "open"
    assert before + 50 <= change.open_until_ms <= after + 50


def test_expired_probe_lease_lets_another_probe_in(h: Harness) -> None:
    # Given a probe admitted after the break whose process then crashed
    h.half_open(SHORT_LEASE)
    assert h.store.admit(P, SHORT_LEASE, "crashed").probe
    assert not h.store.admit(P, SHORT_LEASE, "b").allowed
    # When its lease ends
    h.let_pass(SHORT_LEASE.probe_lease_ms, lambda s: s.probes == 0)
    # Then the next caller becomes the probe, and the crashed one reporting late changes nothing
    assert h.store.admit(P, SHORT_LEASE, "b") == Admission(True, True, 0, "half_open", "half_open")
    assert not fail(h, SHORT_LEASE, "crashed").changed
    assert record(h, SHORT_LEASE, "b", "success").after == "closed"


def test_release_frees_the_probe(h: Harness) -> None:
    h.half_open(SHORT)
    assert h.store.admit(P, SHORT, "probe").probe
    assert not record(h, SHORT, "probe", "release").changed
    assert h.store.snapshot(P).probes == 0
    assert h.store.admit(P, SHORT, "next").probe


def test_late_non_probe_failure_in_half_open_changes_nothing(h: Harness) -> None:
    h.half_open(SHORT)
    assert h.store.admit(P, SHORT, "probe").probe
    late = fail(h, SHORT, "admitted-while-closed", retry_ms=600_000)
    assert (late.before, late.after) == ("half_open", "half_open")
    assert record(h, SHORT, "late-success", "success").after == "half_open"
    snapshot = h.store.snapshot(P)
    assert (snapshot.state, snapshot.probes) == ("half_open", 1)
    assert record(h, SHORT, "probe", "success").after == "closed"


def test_max_probes_two_admits_two(h: Harness) -> None:
    policy = replace(SHORT, max_probes=2)
    h.half_open(policy)
    assert [h.store.admit(P, policy, t).probe for t in ("p1", "p2")] == [True, True]
    assert not h.store.admit(P, policy, "p3").allowed
    assert h.store.snapshot(P).probes == 2


def test_snapshot_reports_state_failures_and_retry_after(h: Harness) -> None:
    fail(h, LONG)
    fail(h, LONG)
    assert h.store.snapshot(P) == CircuitSnapshot(P, "closed", 2, 0, 0)
    opened = h.open(replace(LONG, threshold=1))
    snapshot, before, after = h.timed(lambda: h.store.snapshot(P))
    assert (snapshot.state, snapshot.failures, snapshot.probes) == ("open", 3, 0)
    assert opened.open_until_ms - after <= snapshot.retry_after_ms <= opened.open_until_ms - before


def test_snapshot_shows_half_open_once_the_break_is_over(h: Harness) -> None:
    h.open(SHORT)
    snapshot = h.let_pass(SHORT.break_ms, lambda s: s.state != "open")
    assert snapshot == CircuitSnapshot(P, "half_open", SHORT.threshold, 0, 0)
    h.store.admit(P, SHORT, "probe")
    assert h.store.snapshot(P) == CircuitSnapshot(P, "half_open", SHORT.threshold, 0, 1)


# -- races ----------------------------------------------------------------------------------


def race(threads: int, call: Callable[[int], Any]) -> list[Any]:
    """Run `call(i)` on `threads` threads released together by a barrier."""
    barrier = threading.Barrier(threads)

    def run(i: int) -> Any:
        barrier.wait(timeout=10)
        return call(i)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(run, range(threads)))


def test_thread_race_opens_the_circuit_exactly_once(h: Harness) -> None:
    # Given 16 threads that each record one failure, threshold 5
    policy = replace(LONG, threshold=5)
    changes: list[Transition] = race(16, lambda i: fail(h, policy, f"t{i}"))
    # Then exactly one of them moved the circuit from closed to open
    openings = [c for c in changes if (c.before, c.after) == ("closed", "open")]
    assert len(openings) == 1
    assert openings[0].failures == 5
    assert sorted(c.failures for c in changes if c.before == "closed") == [1, 2, 3, 4, 5]
    snapshot = h.store.snapshot(P)
    assert snapshot.state == "open"
    assert snapshot.failures == 5  # failures recorded while open are not counted


def test_thread_race_admits_exactly_one_probe(h: Harness) -> None:
    h.half_open(SHORT)
    admissions: list[Admission] = race(16, lambda i: h.store.admit(P, SHORT, f"t{i}"))
    assert sum(a.allowed for a in admissions) == 1
    assert sum(a.probe for a in admissions) == 1
    assert sum(a.before == "open" for a in admissions) == 1  # one moved it to half-open
    assert h.store.snapshot(P).probes == 1


def _record_failures(url: str, start: Any, failures: int, out: Any) -> None:
    """A child process: wait for the others, record failures, report its opening transitions."""
    store = RedisBreakerStore(redis.Redis.from_url(url))
    policy = replace(LONG, threshold=20)
    start.wait(timeout=30)
    changes = [store.record(P, policy, "p", "failure") for _ in range(failures)]
    out.put(sum((c.before, c.after) == ("closed", "open") for c in changes))


@pytest.mark.timeout(90)
def test_process_race_opens_the_circuit_exactly_once(
    redis_client: redis.Redis, redis_url: str
) -> None:
    # Given 4 spawned processes that each record 15 failures against one provider, threshold 20
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_record_failures, args=(redis_url, start, 15, out)) for _ in range(4)
    ]
    for proc in procs:
        proc.start()
    # When they have all finished
    openings = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    # Then exactly one failure, across every process, opened the circuit
    assert sum(openings) == 1
    snapshot = RedisBreakerStore(redis_client).snapshot(P)
    assert (snapshot.state, snapshot.failures) == ("open", 20)


# -- the CircuitBreaker facade --------------------------------------------------------------


class UntouchableStore:
    """A store that fails the test if anything calls it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was called: {name}")


class CountingStore:
    """Forwards to a real store and keeps the outcomes recorded."""

    def __init__(self, inner: BreakerStore) -> None:
        self.inner = inner
        self.outcomes: list[Outcome] = []

    def admit(self, provider: str, policy: BreakerPolicy, token: str) -> Admission:
        return self.inner.admit(provider, policy, token)

    def admit_later(
        self, provider: str, policy: BreakerPolicy, token: str
    ) -> Callable[[], Admission]:
        return self.inner.admit_later(provider, policy, token)

    def record(
        self,
        provider: str,
        policy: BreakerPolicy,
        token: str,
        outcome: Outcome,
        retry_after_ms: int = 0,
    ) -> Transition:
        self.outcomes.append(outcome)
        return self.inner.record(provider, policy, token, outcome, retry_after_ms)

    def note_success(self, provider: str, policy: BreakerPolicy, token: str) -> None:
        self.outcomes.append("success")
        self.inner.note_success(provider, policy, token)

    def snapshot(self, provider: str) -> CircuitSnapshot:
        return self.inner.snapshot(provider)


@pytest.fixture
def unreachable() -> Iterator[RedisBreakerStore]:
    # no retries: redis-py's default retry policy alone takes seconds to give up
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    yield RedisBreakerStore(client)
    client.close()


def test_disabled_breaker_lets_everything_through_without_the_store() -> None:
    breaker = CircuitBreaker(UntouchableStore(), LONG, enabled=False)
    for _ in range(LONG.threshold + 2):
        ticket = breaker.admit(P)
        assert not ticket.tracked
        assert breaker.failure(ticket, retry_after=30) is None
        assert breaker.success(ticket) is None
        breaker.release(ticket)


def test_store_unavailable_allow_admits_untracked(unreachable: RedisBreakerStore) -> None:
    breaker = CircuitBreaker(unreachable, LONG, on_store_unavailable="allow")
    ticket = breaker.admit(P)
    assert not ticket.tracked and not ticket.probe
    assert breaker.failure(ticket) is None
    assert breaker.success(ticket) is None


def test_store_unavailable_reject_raises_provider_unavailable(
    unreachable: RedisBreakerStore,
) -> None:
    breaker = CircuitBreaker(unreachable, LONG, on_store_unavailable="reject")
    with pytest.raises(ProviderUnavailableError) as raised:
        breaker.admit(P)
    assert raised.value.provider_name == P
    assert raised.value.retry_after is None
    assert isinstance(raised.value.__cause__, redis.RedisError)


def test_record_with_an_unreachable_store_is_swallowed(unreachable: RedisBreakerStore) -> None:
    # Given a ticket admitted while the store answered, and a store that then went away
    breaker = CircuitBreaker(MemoryBreakerStore(clock=FakeClock()), LONG)
    ticket = breaker.admit(P)
    breaker.store = unreachable
    # Then recording its outcome neither raises nor reports a transition
    assert breaker.failure(ticket) is None


def test_ticket_records_at_most_one_success_and_one_failure(h: Harness) -> None:
    # Given a breaker with threshold 2 and one admitted ticket
    store = CountingStore(h.store)
    breaker = CircuitBreaker(store, replace(LONG, threshold=2))
    ticket = breaker.admit(P)
    # When its failure and success are each reported twice
    breaker.failure(ticket)
    breaker.failure(ticket)
    breaker.success(ticket)
    breaker.success(ticket)
    # Then one of each reached the store, and the second failure did not open the circuit
    assert store.outcomes == ["failure", "success"]
    assert h.store.snapshot(P).state == "closed"


def test_facade_opens_and_rejects_with_retry_after_in_seconds(h: Harness) -> None:
    breaker = CircuitBreaker(h.store, LONG)
    changes = [breaker.failure(breaker.admit(P)) for _ in range(LONG.threshold)]
    assert changes[:-1] == [None] * (LONG.threshold - 1)
    assert changes[-1] is not None and changes[-1].after == "open"
    with pytest.raises(ProviderUnavailableError) as raised:
        breaker.admit(P)
    assert raised.value.retry_after is not None
    assert 50 < raised.value.retry_after <= LONG.break_ms / 1000


def test_facade_release_frees_an_unfinished_probe(h: Harness) -> None:
    breaker = CircuitBreaker(h.store, SHORT)
    h.half_open(SHORT)
    probe = breaker.admit(P)
    assert probe.probe and probe.change is not None
    with pytest.raises(ProviderUnavailableError):
        breaker.admit(P)
    breaker.release(probe)
    assert breaker.admit(P).probe


def test_a_success_that_was_no_probe_goes_with_the_next_call_and_a_probes_at_once(
    h: Harness,
) -> None:
    # Given a closed circuit that counted one failure
    breaker = CircuitBreaker(h.store, replace(SHORT, threshold=3))
    breaker.failure(breaker.admit(P))
    assert h.store.snapshot(P).failures == 1

    # When a call admitted while it was closed succeeds, in a block that defers
    with deferring():
        assert breaker.success(breaker.admit(P)) is None  # nothing to report: it stays closed
        if h.client is not None:  # Redis: it waits for the block's end or the next call
            assert h.store.snapshot(P).failures == 1

    # Then the circuit forgot its failure once the block ended
    assert h.store.snapshot(P).failures == 0

    # And a probe's success closes the circuit at once, with its transition
    h.half_open(SHORT)
    probe = breaker.admit(P)
    assert probe.probe
    with deferring():
        change = breaker.success(probe)
        assert change is not None and (change.before, change.after) == ("half_open", "closed")
        assert h.store.snapshot(P).state == "closed"
