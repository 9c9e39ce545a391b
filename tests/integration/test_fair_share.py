"""Fair dispatch's store (`coordination.fair_share`): the same rules in memory and in real
Redis (the same tests), and the Redis store pushing the messages it keeps to the run queue."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.helpers import MakeRuntime, as_the_command_line, scripted_agent
from tracon_jobs.cli import main
from tracon_jobs.coordination.fair_share import (
    FairStore,
    MemoryFairStore,
    Offered,
    RedisFairStore,
)
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.store import NewRun

LOST_MS = 60_000


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(store_kind: str, redis_client: redis.Redis) -> FairStore:
    if store_kind == "memory":
        return MemoryFairStore(LOST_MS)
    return RedisFairStore(redis_client, LOST_MS)


def offer(store: FairStore, run: str, tenant: str, priority: int = 5) -> Offered:
    return store.offer(run, tenant, priority, None).outcome


def test_with_no_worker_registered_every_run_is_sent_at_once(store: FairStore) -> None:
    outcomes = [store.offer(f"a{i}", "A", 5, None) for i in range(20)]
    assert all(o.outcome is Offered.SENT for o in outcomes)
    assert [o.to_send for o in outcomes] == [[f"a{i}"] for i in range(20)]


def test_a_backlog_lines_up_behind_the_slots_and_another_tenant_goes_next(
    store: FairStore,
) -> None:
    # Given a worker with 2 slots and tenant A's 10 runs submitted
    store.register("w1", 2, {})
    outcomes = [offer(store, f"a{i}", "A") for i in range(10)]
    assert outcomes == [Offered.SENT] * 2 + [Offered.LINED] * 8
    # When tenant B submits one run
    assert offer(store, "b0", "B") is Offered.LINED
    # Then the next place that frees goes to B's run, not to A's 8 lined before it
    assert store.done("a0") == ["b0"]
    assert store.done("a1") == ["a2"]
    assert store.done("b0") == ["a3"]
    depth = store.depth()
    assert (depth.sent, depth.lined, depth.tenants, depth.slots) == (2, 6, 1, 2)


def test_weights_divide_the_places_among_tenants_with_lines(store: FairStore) -> None:
    store.register("w1", 1, {"A": 3})
    for i in range(40):
        offer(store, f"a{i}", "A")
        offer(store, f"b{i}", "B")
    started: list[str] = []
    run = "a0"  # the one sent at once
    for _ in range(40):
        (run,) = store.done(run)
        started.append(run)
    by_tenant = Counter(r[0] for r in started)
    assert by_tenant == {"a": 30, "b": 10}


def test_a_higher_priority_goes_first_within_its_tenants_share(store: FairStore) -> None:
    store.register("w1", 1, {})
    assert offer(store, "a0", "A") is Offered.SENT
    for i in range(1, 5):
        offer(store, f"a{i}", "A", priority=5)
    offer(store, "urgent", "A", priority=9)
    offer(store, "later", "A", priority=0)
    order = []
    run = "a0"
    for _ in range(6):
        (run,) = store.done(run)
        order.append(run)
    assert order == ["urgent", "a1", "a2", "a3", "a4", "later"]


def test_a_tenant_back_after_an_idle_spell_keeps_what_it_used(store: FairStore) -> None:
    """Stride scheduling: a tenant starts again at the pass last served, not at zero, so a
    tenant that comes and goes gets no more than its share."""
    store.register("w1", 1, {})
    offer(store, "a0", "A")
    for i in range(1, 6):
        offer(store, f"a{i}", "A")
    for i in range(3):
        offer(store, f"b{i}", "B")
    run, started = "a0", []
    for _ in range(8):
        (run,) = store.done(run)
        started.append(run)
    # a0 was A's (sent at once): B's runs go first, then they alternate
    assert started == ["b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]


def test_a_resent_run_keeps_its_place_and_a_lost_one_is_sent_again(
    redis_client: redis.Redis,
) -> None:
    store = RedisFairStore(redis_client, lost_after_ms=300)
    store.register("w1", 1, {})
    assert offer(store, "a0", "A") is Offered.SENT
    assert offer(store, "a1", "A") is Offered.LINED
    # the requeue scan sending both again: each keeps its place, nothing is sent twice
    assert offer(store, "a0", "A") is Offered.ALREADY
    assert offer(store, "a1", "A") is Offered.IN_LINE
    # a0's message was lost (no worker claimed it): its place frees after the time allowed
    time.sleep(0.4)
    assert store.register("w1", 1, {}) == ["a1"]
    assert offer(store, "a0", "A") is Offered.LINED


def test_a_run_claimed_from_a_stale_message_leaves_its_line(store: FairStore) -> None:
    store.register("w1", 1, {})
    offer(store, "a0", "A")
    offer(store, "a1", "A")
    offer(store, "a2", "A")
    assert store.take("a2") == []  # an old message of a2 reached a worker first: it runs
    assert store.depth().lined == 1 and store.depth().running == 1
    assert store.done("a2") == []  # a0 still holds the one place
    assert store.take("a0") == []
    assert store.done("a0") == ["a1"]
    assert store.done("a1") == []
    assert store.depth().lined == 0


def test_a_worker_that_leaves_takes_its_slots_with_it(store: FairStore) -> None:
    store.register("w1", 1, {})
    store.register("w2", 1, {})
    assert [offer(store, f"a{i}", "A") for i in range(3)] == [
        Offered.SENT,
        Offered.SENT,
        Offered.LINED,
    ]
    store.leave("w2")
    assert store.done("a0") == []  # one slot left, a1 still on its way
    assert store.done("a1") == ["a2"]
    store.leave("w1")  # no worker: the lines wait for one
    offer(store, "a3", "A")
    assert store.depth().slots is None
    assert offer(store, "b0", "B") is Offered.SENT  # nothing to be fair about


def test_the_redis_store_pushes_the_messages_it_kept_to_the_run_queue(
    redis_client: redis.Redis,
) -> None:
    store = RedisFairStore(redis_client, LOST_MS, queue="q")
    store.register("w1", 1, {})
    first = store.offer("a0", "A", 5, "message a0")
    second = store.offer("a1", "A", 5, "message a1")
    assert (first.outcome, first.to_send) == (Offered.SENT, [])
    assert (second.outcome, second.to_send) == (Offered.LINED, [])
    assert redis_client.lrange("q", 0, -1) == [b"message a0"]
    assert store.done("a0") == []
    assert redis_client.lrange("q", 0, -1) == [b"message a1", b"message a0"]
    assert redis_client.hlen("tracon:fair:messages") == 0


def test_lines_count_each_tenants_lined_runs_and_change_nothing(store: FairStore) -> None:
    # Given no runs lined, then a worker with 1 slot, A's 4 runs and B's 2
    assert store.lines() == {}
    store.register("w1", 1, {})
    for i in range(4):
        offer(store, f"a{i}", "A")
    for i in range(2):
        offer(store, f"b{i}", "B", priority=9)
    # Then each tenant's line counts its runs waiting (A's first went at once)
    assert store.lines() == {"A": 3, "B": 2}
    assert store.lines() == {"A": 3, "B": 2}  # reading changes nothing
    depth = store.depth()
    assert (depth.sent, depth.lined, depth.tenants) == (1, 5, 2)
    # and a run that leaves its line (sent, or claimed from a stale message) leaves the count
    assert store.done("a0") == ["b0"]
    assert store.lines() == {"A": 3, "B": 1}
    store.take("a3")  # a stale message of a run still lined, claimed first
    assert store.lines() == {"A": 2, "B": 1}


def test_a_tenant_whose_line_emptied_is_not_in_the_lines(store: FairStore) -> None:
    store.register("w1", 1, {})
    offer(store, "a0", "A")
    offer(store, "b0", "B")
    assert store.lines() == {"B": 1}
    assert store.done("a0") == ["b0"]
    assert store.lines() == {}
    assert store.depth().lined == 0


def test_tenants_weight_sets_shows_and_clears_in_sql_and_in_the_lines(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url})
    as_the_command_line(monkeypatch, tmp_path, path)
    runtime = make_runtime(sqlite_url)
    acme = runtime.tenants.ensure_tenant("acme")

    assert main(["tenants", "weight", "acme"]) == 0
    assert "weight 1" in capsys.readouterr().out
    assert main(["tenants", "weight", "acme", "3"]) == 0
    assert "weight 3" in capsys.readouterr().out
    assert runtime.tenants.weight(acme) == 3 and runtime.tenants.weights() == {acme: 3}
    assert redis_client.hget("tracon:fair:state", f"w:{acme}") == b"3"
    assert main(["tenants", "weight", "acme", "--clear"]) == 0
    assert runtime.tenants.weight(acme) == 1
    assert redis_client.hget("tracon:fair:state", f"w:{acme}") == b"1"
    for bad in ("0", "101", "x"):
        with pytest.raises(SystemExit):
            main(["tenants", "weight", "acme", bad])
    assert main(["tenants", "weight", "acme", "3", "--clear"]) != 0


def test_a_lined_run_canceled_leaves_its_line(
    make_runtime: MakeRuntime, sqlite_url: str, redis_client: redis.Redis
) -> None:
    runtime = make_runtime(sqlite_url, **scripted_agent([{"Text": "hi"}]))
    sent: list[str] = []
    runtime.send_runs_with(sent.append)
    store = runtime.dispatcher.fair
    assert store is not None
    store.store.register("w1", 1, {})
    tenant = runtime.tenants.ensure_tenant("acme")
    first, second, third = (
        runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": m})).id for m in "abc"
    )
    assert sent == [first] and store.store.depth().lined == 2
    # When the second, waiting in its line, is canceled
    run = runtime.runs.get(second)
    assert run is not None
    cancel_tree(
        runtime.runs, runtime.cancel_bus, runtime.approval_store, run, runtime.dispatcher.done
    )
    # Then it left the line (nothing of it is ever sent) and the third keeps its turn
    assert store.store.depth().lined == 1
    canceled = runtime.runs.get(second)
    assert canceled is not None and canceled.status == "Canceled"
    runtime.dispatcher.taken(first)  # the first one's claim: it runs, its place taken
    assert sent == [first]
    runtime.dispatcher.done(first)  # and its end
    assert sent == [first, third]


def test_a_claimed_run_keeps_its_place_until_it_is_done(store: FairStore) -> None:
    store.register("w1", 1, {})
    assert offer(store, "a0", "A") is Offered.SENT
    assert offer(store, "a1", "A") is Offered.LINED
    # claimed: running, no longer on its way, but its place is still taken
    assert store.take("a0") == []
    depth = store.depth()
    assert (depth.sent, depth.running, depth.lined) == (0, 1, 1)
    assert store.done("a0") == ["a1"]
    assert store.depth().running == 0


def test_a_tenant_without_a_line_whose_turn_it_is_starts_on_a_reserve_thread(
    store: FairStore,
) -> None:
    # Given a worker with 1 slot and 1 reserve thread, busy with A's run, A's next lined
    store.register("w1", 1, {}, reserve=1)
    assert offer(store, "a0", "A") is Offered.SENT
    assert [offer(store, f"a{i}", "A") for i in (1, 2)] == [Offered.LINED] * 2
    assert store.depth().reserve == 1
    # When B, with no line, submits: it is its turn, and it goes at once (the reserve)
    assert offer(store, "b0", "B") is Offered.SENT
    # Then the reserve is taken: B's next run waits its turn in a line
    assert offer(store, "b1", "B") is Offered.LINED
    # and lined runs never get the reserve: B's run ending frees no slot
    assert store.done("b0") == []
    assert store.done("a0") == ["a1"]  # (A and B tie on their pass; A's name sorts first)
    assert store.done("a1") == ["b1"]


def test_the_reserve_goes_to_a_tenant_only_while_it_is_not_ahead_of_its_share(
    store: FairStore,
) -> None:
    store.register("w1", 1, {}, reserve=1)
    assert offer(store, "a0", "A") is Offered.SENT
    assert offer(store, "a1", "A") is Offered.LINED
    # C, with no line, takes the reserve run after run while its pass is not ahead of A's
    assert offer(store, "c0", "C") is Offered.SENT
    store.done("c0")
    assert offer(store, "c1", "C") is Offered.SENT
    store.done("c1")
    # once ahead of A's line it lines up like anyone (a free reserve notwithstanding)
    assert offer(store, "c2", "C") is Offered.LINED
    assert store.done("a0") == ["a1"]


def test_a_running_run_its_worker_stops_naming_frees_its_place(
    store_kind: str, redis_client: redis.Redis
) -> None:
    """A worker's registration names the runs it still runs: those keep their places as long
    as it does; a killed worker's runs free theirs once no registration names them."""
    store: FairStore = (
        MemoryFairStore(LOST_MS, gone_after_ms=1000)
        if store_kind == "memory"
        else RedisFairStore(redis_client, LOST_MS, gone_after_ms=1000)
    )
    store.register("w1", 2, {})
    assert [offer(store, f"a{i}", "A") for i in range(3)] == [Offered.SENT] * 2 + [Offered.LINED]
    store.take("a0")
    store.take("a1")
    for _ in range(3):  # long runs, named at each registration: their places stay taken
        time.sleep(0.4)
        assert store.register("w1", 2, {}, running=["a0", "a1"]) == []
    time.sleep(0.4)
    assert store.register("w1", 2, {}, running=["a0"]) == []  # a1 named 0.4 s ago: kept
    time.sleep(0.7)  # a1 last named 1.1 s ago, a0 0.7 s ago
    assert store.register("w1", 2, {}, running=["a0", "ghost"]) == ["a2"]
    depth = store.depth()
    assert (depth.running, depth.sent) == (1, 1)  # a name of a run not running adds nothing
