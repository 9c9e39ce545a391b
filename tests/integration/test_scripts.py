"""Deferred script calls: they run with the next call that needs its reply, in one EVALSHA,
each with the semantics it has alone (real Redis)."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
import redis

from tracon_jobs.coordination.scripts import Call, Scripts, deferring
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.limits.budget_store import Limits, RedisBudgetStore, Totals
from tracon_jobs.limits.quota_store import RedisQuotaStore, window_of
from tracon_jobs.resilience.breaker import BreakerPolicy, RedisBreakerStore

POLICY = BreakerPolicy(threshold=3, break_ms=1000, max_probes=1, probe_lease_ms=1000)


HANDSHAKE = {"HELLO", "CLIENT", "SELECT", "AUTH"}
"""What a new connection sends before its first command: not counted."""


class CountingRedis(redis.Redis):
    """Counts the commands this client's connections send (a script's own commands are not
    sent), whichever way they go: `execute_command` or a thread's held connection."""

    sent: Counter[str]


@pytest.fixture
def client(redis_client: redis.Redis, redis_url: str) -> CountingRedis:
    sent: Counter[str] = Counter()
    base = redis.ConnectionPool.from_url(redis_url).connection_class

    class CountingConnection(base):  # type: ignore[valid-type,misc]
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            packed = command if isinstance(command, bytes) else b"".join(command)
            name = packed.split(b"\r\n", 3)[2].decode().upper()  # *<n> $<len> <name> ...
            if name not in HANDSHAKE:
                sent[name] += 1
            super().send_packed_command(command, check_health)

    pool = redis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection)
    counting = CountingRedis(connection_pool=pool)
    counting.sent = sent
    return counting


def test_spends_go_in_the_circuits_record_in_one_evalsha(client: CountingRedis) -> None:
    # Given a tree budget and a tenant's day counter that exist, and an admitted call
    budgets, quotas, breaker = (
        RedisBudgetStore(client),
        RedisQuotaStore(client),
        RedisBreakerStore(client),
    )
    day = window_of("day")
    budgets.open("root", Totals())
    quotas.open("acme", day, Decimal(0), day.start)
    assert breaker.admit("p", POLICY, "t1").allowed
    breaker.record("p", POLICY, "t1", "failure")  # one failure, which a success resets

    def spend_and_succeed() -> Any:
        with deferring():
            budgets.spend("root", released=0, tokens=7, cost=Decimal("0.5"), unknown_price=False)
            assert quotas.spend("acme", [day], Decimal("0.5")) is None  # not run yet
            return breaker.record("p", POLICY, "t1", "success")

    spend_and_succeed()  # loads the composed script
    client.sent.clear()

    # When the spends are deferred and the circuit's record follows
    change = spend_and_succeed()

    # Then one round trip ran all three, each as it would alone
    assert dict(client.sent) == {"EVALSHA": 1}
    assert (change.before, change.after, change.failures) == ("closed", "closed", 0)
    assert client.hget(budgets.key("root"), "tokens") == b"14"
    assert quotas.used("acme", day) == Decimal("1")


def test_deferred_calls_run_when_the_block_ends(client: CountingRedis) -> None:
    budgets = RedisBudgetStore(client)
    budgets.open("root", Totals())

    def spend_twice() -> None:
        with deferring():
            budgets.spend("root", released=0, tokens=3, cost=Decimal(0), unknown_price=False)
            budgets.spend("root", released=0, tokens=4, cost=Decimal(0), unknown_price=False)
            assert client.hget(budgets.key("root"), "tokens") in (b"0", b"7")  # not yet run

    spend_twice()  # loads the composed script
    client.sent.clear()
    spend_twice()

    assert dict(client.sent) == {"HGET": 1, "EVALSHA": 1}
    assert client.hget(budgets.key("root"), "tokens") == b"14"


def test_outside_the_block_a_call_runs_at_once(client: CountingRedis) -> None:
    quotas = RedisQuotaStore(client)
    day = window_of("day")
    quotas.open("acme", day, Decimal(0), day.start)

    assert quotas.spend("acme", [day], Decimal("0.25")) == 1
    assert quotas.used("acme", day) == Decimal("0.25")


def test_each_script_gets_its_own_keys_and_arguments_and_nil_replies_keep_their_place(
    client: CountingRedis,
) -> None:
    scripts = Scripts(client)
    budgets = RedisBudgetStore(client)
    budgets.open("b", Totals(tokens=1))
    day = window_of("day")

    # budget_spend on a lost tree replies nil; quota_spend counts the counters it found
    replies = scripts.run_all(
        [
            Call("budget_spend", [budgets.key("gone")], [0, 5, 0, "0"]),
            Call("budget_spend", [budgets.key("b")], [0, 5, 0, "0"]),
            Call("quota_spend", [RedisQuotaStore(client).key("acme", day), "missing"], [10]),
        ]
    )

    assert replies == [None, b"6", 0]


def test_a_failed_round_trip_says_which_deferred_scripts_it_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given stores on a Redis that does not answer
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    budgets, breaker = RedisBudgetStore(dead), RedisBreakerStore(dead)

    # When a deferred spend goes with a record that fails
    with deferring(), pytest.raises(redis.ConnectionError):
        budgets.spend("root", released=0, tokens=1, cost=Decimal(0), unknown_price=False)
        breaker.record("p", POLICY, "t1", "success")

    # Then the caller sees its own failure, and the log names what went with it
    assert "deferred scripts not run (budget_spend)" in caplog.text


def test_an_admission_sent_later_goes_with_the_budget_gate_in_one_evalsha(
    client: CountingRedis,
) -> None:
    # Given a closed circuit and a tree budget with a token limit
    breaker, budgets = RedisBreakerStore(client), RedisBudgetStore(client)
    budgets.open("root", Totals())
    limits = Limits(depth=3, tokens=1000, cost=None, runs=None, duration=None)
    with deferring():  # loads the composed script
        admission = breaker.admit_later("p", POLICY, "warm")
        budgets.gate("root", "model", limits, reserve=1)
        admission()
    client.sent.clear()

    with deferring():
        # When the admission is asked for, then the gate runs
        admission = breaker.admit_later("p", POLICY, "t1")
        assert not client.sent  # nothing sent yet
        verdict = budgets.gate("root", "model", limits, reserve=100)

        # Then both went in one round trip, and the admission's reply is there without another
        assert dict(client.sent) == {"EVALSHA": 1}
        assert admission().allowed and verdict.allowed
        assert dict(client.sent) == {"EVALSHA": 1}


def test_an_admission_nobody_sent_on_goes_when_its_reply_is_read(client: CountingRedis) -> None:
    breaker = RedisBreakerStore(client)
    with deferring():
        admission = breaker.admit_later("p", POLICY, "t1")
        assert not client.sent

        assert admission().allowed  # read before any other call: sent on its own

        assert dict(client.sent) == {"EVALSHA": 1}
    assert dict(client.sent) == {"EVALSHA": 1}  # and not again when the block ends
