"""The runs workers hold (`coordination.held`) and the requeue pass, over real Redis and SQL:
a worker's records are written in order, in batches, with its liveness; once its liveness
ends, the pass sends its still-`Queued` runs again at once (a claimed one is left to the
orphan scan) and forgets it; a live worker's runs are left alone past `RequeueAfter`."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import redis

from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.coordination import held as held_module
from tracon_jobs.coordination.held import HeldRuns, Holders
from tracon_jobs.runs.requeue import requeue_unclaimed
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime


def queued(runtime: Runtime, count: int) -> list[str]:
    tenant = runtime.tenants.ensure_tenant("acme")
    return [
        runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": str(i)})).id
        for i in range(count)
    ]


def test_records_follow_took_and_let_go_in_order(redis_client: redis.Redis) -> None:
    held = HeldRuns(redis_client, "w1")
    held.took("a")
    held.took("b")
    held.let_go("a")
    held.let_go("c")  # never held: nothing to undo
    held.flush()

    dead, live = Holders(redis_client).read()
    assert (dead, live) == ({}, {"b"})


def test_a_dead_worker_s_queued_runs_are_sent_again_at_once_and_a_live_one_s_never(
    make_runtime: MakeRuntime, sqlite_url: str, redis_client: redis.Redis
) -> None:
    sent: list[str] = []
    runtime = make_runtime(sqlite_url, sender=sent.append, **scripted_agent([{"Text": "-"}]))
    mine, claimed, theirs = queued(runtime, 3)
    opened = runtime.runs.open_claim(claimed, "w-dead")
    assert opened is not None
    runtime.runs.settle(opened[0])  # its claim committed: `Running`
    sent.clear()

    # Given a worker holding two runs that died (its liveness ended), and a live one
    dead_worker = HeldRuns(redis_client, "w-dead", alive_ms=200)
    dead_worker.took(mine)
    dead_worker.took(claimed)
    dead_worker.flush()
    live_worker = HeldRuns(redis_client, "w-live")
    live_worker.took(theirs)
    live_worker.flush()
    time.sleep(0.3)

    # When a requeue pass runs, long past RequeueAfter for all of them
    later = runtime.db.now() + timedelta(minutes=5)
    holders = Holders(redis_client)
    result = requeue_unclaimed(
        runtime.runs, runtime.dispatcher, timedelta(seconds=60), later, holders
    )

    # Then only the dead worker's unclaimed run went out again; the worker is forgotten
    assert result.resent == [mine] and sent == [mine]
    assert holders.read() == ({}, {theirs})
    soon = runtime.db.now() + timedelta(seconds=30)  # within RequeueAfter of the re-send
    again = requeue_unclaimed(
        runtime.runs, runtime.dispatcher, timedelta(seconds=60), soon, holders
    )
    assert again.resent == []


def test_a_worker_that_cannot_reach_sql_is_not_live(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(held_module, "HEALTH_SECONDS", 0.2)
    stuck = threading.Event()

    def unreachable() -> None:
        raise OSError("no route to the database")

    def hanging() -> None:  # a link that drops packets: the check never returns by itself
        stuck.wait(5)

    for check in (unreachable, hanging):
        worker = HeldRuns(redis_client, "w-cut", healthy=check)
        worker.took("held-by-cut")
        worker.flush(True)
        assert Holders(redis_client).read() == ({}, {"held-by-cut"})

        # When its check of the database fails (or hangs past HEALTH_SECONDS)
        assert worker._can_reach_sql() is False
        worker.flush(False)

        # Then it counts as dead: the pass sends its runs to the others
        assert Holders(redis_client).read() == ({"w-cut": {"held-by-cut"}}, set())
        Holders(redis_client).forget(["w-cut"])
    stuck.set()
    assert HeldRuns(redis_client, "w-ok", healthy=lambda: None)._can_reach_sql() is True


def test_a_run_nobody_holds_is_sent_again_by_age_while_the_fair_lines_still_count_it_sent(
    make_runtime: MakeRuntime, sqlite_url: str, redis_client: redis.Redis
) -> None:
    """The lines count a run on its way from its send, a moment after its row was written, so
    a pass that finds it unclaimed for `RequeueAfter` by SQL's clock may come before the lines
    let go of it: it is sent all the same (it used to wait for the next pass, `RequeueAfter`
    more)."""
    sent: list[str] = []
    runtime = make_runtime(sqlite_url, sender=sent.append, **scripted_agent([{"Text": "-"}]))
    runtime.fair_store.register("w1", 4, {})
    [run_id] = queued(runtime, 1)
    assert sent == [run_id] and runtime.fair_store.depth().sent == 1
    sent.clear()

    # When a pass runs past RequeueAfter by SQL's clock, the run held by no worker
    later = runtime.db.now() + timedelta(seconds=61)
    result = requeue_unclaimed(
        runtime.runs, runtime.dispatcher, timedelta(seconds=60), later, Holders(redis_client)
    )

    # Then its message goes out again at once, though the lines still count it sent
    assert result.resent == [run_id] and sent == [run_id]
    assert runtime.fair_store.depth().sent == 1
