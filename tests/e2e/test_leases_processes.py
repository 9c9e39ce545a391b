"""Three real processes compete for one singleton lease (TTL 600 ms, renewed every 200 ms).

What is checked, on Redis server time (see `lease_contender` for the records):

1. The leases Redis granted never overlap between processes: a process's lease period runs
   from a grant to its last renewal plus the TTL.
2. A process believes it is the owner only inside its own lease: for every tick where
   `still_owner` said True, the server time read *before* asking is no later than the
   expiry of the latest grant it could have been based on. Together with 1, no two
   processes ever believe at overlapping times.
3. A stalled owner (SIGSTOP) stops believing on its own clock when it wakes up, and an
   owner whose renewals hang stops believing at its deadline, with no answer from Redis,
   while a second process already owns the lease.
4. A killed owner (`kill -9`) is replaced within one lease duration plus one renewal
   interval (plus a small tolerance for process scheduling).

The checks are pure functions, tested on made-up records first, so they are known to fail.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests.e2e.cluster import REPO, Process, wait_for_log, wait_until
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.coordination.leases import RedisLeaseStore
from tracon_jobs.embedded_redis import start_embedded

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LEASE = "tracon.test.singleton"
TTL = 600
RENEW = TTL // 3
TOLERANCE = 500
ROUNDING = 2  # ms: TIME and PX both round to the millisecond
LOG_KEY = "test:lease-log"
WAIT = 15.0


@dataclass(frozen=True)
class Op:
    pid: int
    script: str
    at: int
    granted: bool


@dataclass(frozen=True)
class Tick:
    pid: int
    before: int
    after: int
    believed: bool


@dataclass(frozen=True)
class Period:
    pid: int
    start: int
    end: int


# -- the checks ----------------------------------------------------------------------------


def lease_periods(ops: list[Op], ttl: int) -> list[Period]:
    """Each process's continuous leases: a grant that comes before the previous expiry
    extends the period, a later one starts a new period."""
    periods: list[Period] = []
    for pid in sorted({op.pid for op in ops}):
        current: Period | None = None
        for op in sorted((o for o in ops if o.pid == pid and o.granted), key=lambda o: o.at):
            if current is not None and op.at <= current.end:
                current = Period(pid, current.start, op.at + ttl)
                continue
            if current is not None:
                periods.append(current)
            current = Period(pid, op.at, op.at + ttl)
        if current is not None:
            periods.append(current)
    return periods


def overlapping(periods: list[Period]) -> list[tuple[Period, Period]]:
    return [
        (a, b)
        for i, a in enumerate(periods)
        for b in periods[i + 1 :]
        if a.pid != b.pid and min(a.end, b.end) - max(a.start, b.start) > ROUNDING
    ]


def beliefs_outside_leases(ticks: list[Tick], ops: list[Op], ttl: int) -> list[Tick]:
    """Believed ticks that provably fall after the expiry of every grant they could rest on."""
    bad = []
    for tick in (t for t in ticks if t.believed):
        grants = [op.at for op in ops if op.pid == tick.pid and op.granted and op.at <= tick.after]
        if not grants or tick.before > max(grants) + ttl + ROUNDING:
            bad.append(tick)
    return bad


def assert_never_two_owners(ops: list[Op], ticks: list[Tick], ttl: int) -> None:
    assert not overlapping(lease_periods(ops, ttl))
    assert not beliefs_outside_leases(ticks, ops, ttl)
    assert any(t.believed for t in ticks), "nobody ever believed: the check proved nothing"


def test_the_checks_reject_overlapping_leases() -> None:
    ops = [Op(1, "lease_acquire", 1000, True), Op(2, "lease_acquire", 1500, True)]

    after_expiry = [ops[0], Op(2, "lease_acquire", 1601, True)]

    assert overlapping(lease_periods(ops, 600))
    assert not overlapping(lease_periods(after_expiry, 600))


def test_the_checks_reject_a_belief_after_the_last_expiry() -> None:
    ops = [Op(1, "lease_acquire", 1000, True), Op(1, "lease_renew", 1200, True)]

    late = Tick(1, 1850, 1851, True)
    assert beliefs_outside_leases([late], ops, 600) == [late]
    assert not beliefs_outside_leases([Tick(1, 1790, 1791, True)], ops, 600)
    assert beliefs_outside_leases([Tick(2, 1100, 1101, True)], ops, 600)  # never granted


# -- the processes ---------------------------------------------------------------------------


@dataclass
class Contenders:
    client: redis.Redis
    children: Supervisor
    processes: dict[int, Process] = field(default_factory=dict)  # by pid, as in lease owners

    def start(self, redis_url: str, index: int) -> Process:
        module = "tests.e2e.lease_contender"
        argv = [sys.executable, "-m", module, redis_url, LEASE, str(TTL), LOG_KEY]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        process = self.children.start(f"contender{index}", argv, env)
        self.processes[process.popen.pid] = process
        return process

    def server_ms(self) -> int:
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def owner(self) -> int | None:
        token = RedisLeaseStore(self.client).owner_of(LEASE)
        return None if token is None else int(token.split("/")[1])

    def wait_for_owner(self, other_than: int | None = None) -> int:
        def found() -> bool:
            return self.owner() not in (None, other_than)

        wait_until(found, timeout=WAIT, what=f"an owner other than {other_than}")
        owner = self.owner()
        assert owner is not None
        return owner

    def wait_for_renewals(self, pid: int, count: int) -> None:
        def renewed() -> bool:
            ops = self.records()[0]
            return sum(1 for o in ops if o.pid == pid and o.script == "lease_renew") >= count

        wait_until(renewed, timeout=WAIT, what=f"{count} renewals by {pid}")

    def first_grant_after(self, pid: int, since: int) -> int:
        """When `pid` was first granted the lease after `since`. A contender logs a grant
        after its script returned, so the lease can name it before its record is in the
        log: wait for the record."""

        def grants() -> list[int]:
            return [o.at for o in self.records()[0] if o.pid == pid and o.granted and o.at > since]

        wait_until(lambda: bool(grants()), timeout=WAIT, what=f"the grant {pid} logged")
        return min(grants())

    def signal(self, pid: int, sig: signal.Signals) -> int:
        """Send `sig` to one contender; the server time just before it."""
        at = self.server_ms()
        self.processes[pid].send(sig)
        return at

    def records(self) -> tuple[list[Op], list[Tick]]:
        ops: list[Op] = []
        ticks: list[Tick] = []
        for raw in self.client.lrange(LOG_KEY, 0, -1):
            kind, *fields = json.loads(raw)
            if kind == "op":
                ops.append(Op(*fields))
            else:
                ticks.append(Tick(*fields))
        return ops, ticks

    def stop(self) -> None:
        """`kill -9` of every contender (a stalled one too), each reaped."""
        for process in self.children.running():
            process.kill9()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[redis.Redis, str]]:
    """A Redis server of this test's own: the shared test databases can be flushed by
    another test session at any moment, which would erase the log and the lease mid-test."""
    server = start_embedded(tmp_path / "redis")
    client = redis.Redis.from_url(server.url)
    try:
        yield client, server.url
    finally:
        client.close()
        server.stop()


@pytest.fixture
def contenders(tmp_path: Path, private_redis: tuple[redis.Redis, str]) -> Iterator[Contenders]:
    client, url = private_redis
    group = Contenders(client, Supervisor(cwd=REPO, log_dir=tmp_path))
    try:
        for process in [group.start(url, i) for i in range(3)]:
            wait_for_log(process, "ready", timeout=30)
        yield group
    finally:
        group.stop()


def test_a_stalled_owner_stops_believing_before_another_takes_over(
    contenders: Contenders,
) -> None:
    # Given an owner that has renewed a few times
    first = contenders.wait_for_owner()
    contenders.wait_for_renewals(first, 3)

    # When it stalls (its renewer too), another process takes over after the expiry
    stopped_at = contenders.signal(first, signal.SIGSTOP)
    second = contenders.wait_for_owner(other_than=first)
    delay = contenders.first_grant_after(second, stopped_at) - stopped_at
    assert delay <= TTL + RENEW + TOLERANCE, delay

    # And when it wakes up, it believes nothing on its own clock
    resumed_at = contenders.signal(first, signal.SIGCONT)

    def woke() -> bool:
        return (
            sum(1 for t in contenders.records()[1] if t.pid == first and t.before > resumed_at) > 20
        )

    wait_until(woke, timeout=WAIT, what="ticks of the resumed owner")
    ops, ticks = contenders.records()
    contenders.stop()

    after_wake = [t for t in ticks if t.before > resumed_at]
    assert not [t for t in after_wake if t.pid == first and t.believed]
    assert [t for t in after_wake if t.pid == second and t.believed]
    assert_never_two_owners(ops, ticks, TTL)


def test_a_killed_owner_is_replaced_within_a_lease_and_a_renewal(
    contenders: Contenders,
) -> None:
    delays = []
    for _ in range(2):
        # Given an owner that has renewed
        owner = contenders.wait_for_owner()
        contenders.wait_for_renewals(owner, 2)
        # When it is killed with no chance to release
        killed_at = contenders.signal(owner, signal.SIGKILL)
        # Then another process owns the lease within one lease plus one renewal interval
        successor = contenders.wait_for_owner(other_than=owner)
        delays.append(contenders.first_grant_after(successor, killed_at) - killed_at)

    ops, ticks = contenders.records()
    contenders.stop()
    assert all(delay <= TTL + RENEW + TOLERANCE for delay in delays), delays
    assert_never_two_owners(ops, ticks, TTL)


def test_an_owner_whose_renewals_hang_stops_believing_at_its_deadline(
    contenders: Contenders,
) -> None:
    # Given an owner that has renewed
    first = contenders.wait_for_owner()
    contenders.wait_for_renewals(first, 2)

    # When its renewals hang (a dead socket) while its task thread keeps asking
    hung_at = contenders.server_ms()
    contenders.client.set(f"{LOG_KEY}:hang:{first}", 1)
    second = contenders.wait_for_owner(other_than=first)
    taken_at = contenders.first_grant_after(second, hung_at)
    assert taken_at - hung_at <= TTL + RENEW + TOLERANCE, taken_at - hung_at

    def ticked_on() -> bool:
        ticks = contenders.records()[1]
        return sum(1 for t in ticks if t.pid == first and t.before > taken_at) > 20

    wait_until(ticked_on, timeout=WAIT, what="ticks of the hung owner after the takeover")
    ops, ticks = contenders.records()
    contenders.client.delete(f"{LOG_KEY}:hang:{first}")
    contenders.stop()

    # Then it stopped believing on its own clock, with no answer from Redis
    assert not [t for t in ticks if t.pid == first and t.believed and t.before > taken_at]
    assert_never_two_owners(ops, ticks, TTL)
