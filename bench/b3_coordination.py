"""B3: the cost of cluster-wide coordination on the provider-call hot path.

Each provider call takes a breaker admission and a concurrency slot, and records its outcome
and gives the slot back: four Redis calls. Each should be one round trip (one EVALSHA) and
run at no less than half the rate of a bare `PING` on the same connection, so that the
breaker and the slots cost about as much as the network and no more. Round trips are
counted on the client, at the connection's `send_packed_command`, so other clients of the
same server do not disturb the count. See bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tracon_jobs.embedded_redis import EmbeddedRedis, ensure_redis
from tracon_jobs.resilience.breaker import BreakerPolicy, RedisBreakerStore
from tracon_jobs.resilience.concurrency import RedisSlotStore

DEFAULT_REDIS = "redis://127.0.0.1:6379/13"
GOAL_ROUND_TRIPS = 1.0
GOAL_RATIO = 0.5
WARMUP = 200
PROVIDER = "bench-provider"
SLOT_LIMIT = 1_000  # never reached: one slot is held at a time
SLOT_LEASE_MS = 30_000
POLICY = BreakerPolicy(threshold=5, break_ms=30_000, max_probes=1, probe_lease_ms=60_000)


class CountingConnection(redis.Connection):
    """A connection that counts what it writes: one packed send is one round trip."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


@dataclass
class Timing:
    """One kind of call: how many, how long in total, how many round trips."""

    label: str
    calls: int = 0
    seconds: float = 0.0
    round_trips: int = 0

    def time(self, call: Callable[[], object]) -> None:
        sends = CountingConnection.sends
        started = time.perf_counter()
        call()
        self.seconds += time.perf_counter() - started
        self.round_trips += CountingConnection.sends - sends
        self.calls += 1

    @property
    def per_second(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    @property
    def micros(self) -> float:
        return self.seconds / self.calls * 1e6 if self.calls else 0.0

    @property
    def trips_per_call(self) -> float:
        return self.round_trips / self.calls if self.calls else 0.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.b3_coordination", description=__doc__)
    parser.add_argument("--iterations", type=int, default=20_000, help="calls of each kind")
    parser.add_argument(
        "--redis", default=DEFAULT_REDIS, help=f"Redis URL (default {DEFAULT_REDIS})"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tracon-b3-") as workdir:
        url, embedded = ensure_redis(options.redis, Path(workdir) / "redis")
        try:
            return benchmark(url, embedded, options.iterations)
        except KeyboardInterrupt:
            print("b3: interrupted", file=sys.stderr)
            return 130
        finally:
            if embedded is not None:
                embedded.stop()


def benchmark(url: str, embedded: EmbeddedRedis | None, iterations: int) -> int:
    pool = redis.ConnectionPool.from_url(url, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    prefix = f"bench-b3-{uuid.uuid4().hex[:8]}"  # our own keys: the db is not flushed
    try:
        rows = measure(client, prefix, iterations)
    finally:
        cleanup(client, prefix)
        pool.disconnect()
    where = "embedded" if embedded is not None else "local"
    print_report(url, where, iterations, rows)
    return 0


def measure(client: redis.Redis, prefix: str, iterations: int) -> list[Timing]:
    breaker = RedisBreakerStore(client, prefix=prefix)
    slots = RedisSlotStore(client, prefix=prefix)
    for i in range(WARMUP):  # scripts loaded and the connection open before counting
        one_call_of_each(client, breaker, slots, [Timing("") for _ in range(5)], f"w{i}")
    rows = [Timing(label) for label in LABELS]
    for i in range(iterations):
        one_call_of_each(client, breaker, slots, rows, f"t{i}")
    return rows


LABELS = ("PING", "breaker admit", "breaker record", "slot try_acquire", "slot release")


def one_call_of_each(
    client: redis.Redis,
    breaker: RedisBreakerStore,
    slots: RedisSlotStore,
    rows: list[Timing],
    token: str,
) -> None:
    """What one provider call costs, each call timed alone, with PING beside it."""
    ping, admit, record, acquire, release = rows
    ping.time(client.ping)
    admit.time(lambda: check(breaker.admit(PROVIDER, POLICY, token).allowed, "admit"))
    record.time(lambda: breaker.record(PROVIDER, POLICY, token, "success"))
    acquire.time(
        lambda: check(slots.try_acquire(PROVIDER, token, SLOT_LIMIT, SLOT_LEASE_MS), "slot")
    )
    release.time(lambda: slots.release(PROVIDER, token))


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"b3: {what} refused on a healthy provider")


def cleanup(client: redis.Redis, prefix: str) -> None:
    keys = [*RedisBreakerStore(client, prefix).keys(PROVIDER)]
    keys += RedisSlotStore(client, prefix).keys(PROVIDER)
    client.delete(*keys)


def print_report(url: str, where: str, iterations: int, rows: list[Timing]) -> None:
    ping = rows[0]
    print(
        f"B3 coordination: {iterations} calls of each kind, one connection, redis {url} ({where})"
    )
    print()
    print(f"  {'call':<18} {'ops/s':>9} {'us/call':>8} {'trips/call':>11} {'vs PING':>8}")
    for row in rows:
        ratio = row.per_second / ping.per_second if ping.per_second else 0.0
        print(
            f"  {row.label:<18} {row.per_second:>9.0f} {row.micros:>8.1f} "
            f"{row.trips_per_call:>11.2f} {ratio:>7.2f}x"
        )
    calls = rows[1:]
    pair_admit = 1 / (calls[0].seconds / iterations + calls[1].seconds / iterations)
    pair_slot = 1 / (calls[2].seconds / iterations + calls[3].seconds / iterations)
    print()
    print(f"  admit + record per provider call: {pair_admit:.0f}/s")
    print(f"  try_acquire + release per provider call: {pair_slot:.0f}/s")
    trips_met = all(row.trips_per_call <= GOAL_ROUND_TRIPS for row in calls)
    worst = min(row.per_second / ping.per_second for row in calls) if ping.per_second else 0.0
    print(f"  round trips per call: goal {GOAL_ROUND_TRIPS:.0f} each: {verdict(trips_met)}")
    print(
        f"  slowest call vs PING = {worst:.2f}x   "
        f"(goal >= {GOAL_RATIO:.2f}x: {verdict(worst >= GOAL_RATIO)})"
    )


def verdict(met: bool) -> str:
    return "met" if met else "missed"


if __name__ == "__main__":
    sys.exit(main())
