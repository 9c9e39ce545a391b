"""Schedules with real processes: a 1-second interval schedule, two beats sending every tick
(each one twice, so passes race) and a worker running the firing pass under its singleton
lease: every slot has exactly one fire and a fired slot exactly one run, before and after one
beat is killed with kill -9."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import datetime

import pytest
from sqlalchemy import select

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.db.models import Run, ScheduleFire
from tracon_jobs.runtime import Runtime
from tracon_jobs.schedules.definition import checked
from tracon_jobs.schedules.firing import session_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SECTIONS = scripted_agent([{"Text": "done"}]) | {
    "SingletonExecution": {"Enabled": True, "LeaseDuration": "00:00:03"},
    "Schedules": {"ScanInterval": "00:00:00.500"},
}


def fires(runtime: Runtime, schedule_id: str) -> list[tuple[datetime, str, str | None]]:
    query = (
        select(ScheduleFire.slot_at, ScheduleFire.outcome, ScheduleFire.run_id)
        .where(ScheduleFire.schedule_id == schedule_id)
        .order_by(ScheduleFire.slot_at)
    )
    with runtime.db.read() as session:
        return [(slot, outcome, run) for slot, outcome, run in session.execute(query)]


def runs(runtime: Runtime, schedule_id: str) -> list[str]:
    query = select(Run.id).where(Run.session_id == session_of(schedule_id))
    with runtime.db.read() as session:
        return list(session.scalars(query))


def assert_once_per_slot(runtime: Runtime, schedule_id: str) -> int:
    """Every slot between the first and the last recorded one is there once (no gap, no
    double), and the fired ones are exactly the schedule's runs; how many slots. (A slot fires
    every second while this reads: its fire and its run are one transaction, so the runs read
    before the fires all have one, and the fires' runs are all among the runs read after.)"""
    runs_before = set(runs(runtime, schedule_id))
    recorded = fires(runtime, schedule_id)
    slots = [slot for slot, _, _ in recorded]
    seconds = [round((b - a).total_seconds(), 3) for a, b in itertools.pairwise(slots)]
    assert set(seconds) <= {1.0}, f"slots not one second apart: {seconds}"
    fired = [run for _, outcome, run in recorded if outcome == "fired"]
    assert all(fired) and len(set(fired)) == len(fired)
    fired_runs = {str(run) for run in fired}
    assert runs_before <= fired_runs <= set(runs(runtime, schedule_id))
    return len(recorded)


@pytest.mark.timeout(180)  # three processes to start; slow on a loaded machine
def test_two_racing_beats_fire_each_slot_once_even_when_one_is_killed(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    # Given a worker, two beats, and a schedule every second
    cluster = make_cluster(sqlite_url, **SECTIONS)
    cluster.worker("w1")
    first_beat = cluster.start("beat-1", "beat")
    cluster.start("beat-2", "beat")
    runtime = make_runtime(sqlite_url, **SECTIONS)
    tenant = runtime.tenants.ensure_tenant("acme")
    body = {"name": "tick", "interval": 1, "target": {"agent": "demo"}, "input": {"message": "x"}}
    schedule_id = runtime.schedules.create(tenant, checked(body, runtime.schedule_targets)).id

    # When a few slots have passed
    wait_until(lambda: len(fires(runtime, schedule_id)) >= 4, timeout=60, what="4 slots")

    # Then each slot was recorded once, each fired one with one run
    before = assert_once_per_slot(runtime, schedule_id)

    # When one beat is killed with kill -9 and a few more slots pass
    first_beat.kill9()
    wait_until(
        lambda: len(fires(runtime, schedule_id)) >= before + 4, timeout=45, what="4 more slots"
    )

    # Then still one fire per slot, one run per fired slot
    assert_once_per_slot(runtime, schedule_id)
    wait_until(
        lambda: all(
            r.status in ("Completed", "Failed", "Canceled")
            for r in (runtime.runs.get(i) for i in runs(runtime, schedule_id)[:3])
            if r is not None
        ),
        timeout=30,
        what="the first scheduled runs ended",
    )
