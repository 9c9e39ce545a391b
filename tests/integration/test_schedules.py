"""Schedules' firing pass (beat's `tracon.schedules.fire`) on SQLite and PostgreSQL, with real
Redis: a due slot fires one run and advances the schedule; catch-up after a 5-minute outage
per policy; the overlap policies against a previous run still going; pause, resume and delete;
several passes racing on one due schedule record each slot once with one run; a send lost
between the commit and the message is sent by the requeue scan; run retention takes the
fires of the runs it deletes."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

from tests.helpers import MakeRuntime, hold_queued, scripted_agent
from tracon_jobs.coordination.fair_share import Offered
from tracon_jobs.db.models import Run, Schedule, ScheduleFire
from tracon_jobs.runs.requeue import requeue_unclaimed
from tracon_jobs.runs.retention import RunRetention
from tracon_jobs.runtime import Runtime
from tracon_jobs.schedules.definition import checked
from tracon_jobs.schedules.firing import session_of

MINUTE = timedelta(minutes=1)


@pytest.fixture
def rt(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url, sender=hold_queued, **scripted_agent([{"Text": "ok"}]))


def create(rt: Runtime, tenant: str = "acme", **body: Any) -> str:
    body.setdefault("name", "nightly")
    body.setdefault("target", {"agent": "demo"})
    body.setdefault("input", {"message": "report"})
    if "cron" not in body:
        body.setdefault("interval", 60)
    spec = checked(body, rt.schedule_targets)
    return rt.schedules.create(rt.tenants.ensure_tenant(tenant), spec).id


def set_slots(rt: Runtime, schedule_id: str, anchor: datetime, next_fire: datetime) -> None:
    """As if the schedule had been created at `anchor` and its next slot were `next_fire`."""
    with rt.db.write() as session:
        session.execute(
            update(Schedule)
            .where(Schedule.id == schedule_id)
            .values(anchor_at=anchor, next_fire_at=next_fire)
        )


def fires(rt: Runtime, schedule_id: str) -> list[tuple[datetime, str, str | None]]:
    query = (
        select(ScheduleFire.slot_at, ScheduleFire.outcome, ScheduleFire.run_id)
        .where(ScheduleFire.schedule_id == schedule_id)
        .order_by(ScheduleFire.slot_at)
    )
    with rt.db.read() as session:
        return [(slot, outcome, run) for slot, outcome, run in session.execute(query)]


def runs_of(rt: Runtime, schedule_id: str) -> list[Run]:
    query = select(Run).where(Run.session_id == session_of(schedule_id)).order_by(Run.created_at)
    with rt.db.read() as session:
        found = list(session.scalars(query))
        session.expunge_all()
        return found


def schedule(rt: Runtime, schedule_id: str) -> Schedule:
    with rt.db.read() as session:
        row = session.get(Schedule, schedule_id)
        assert row is not None
        session.expunge(row)
        return row


def end_run(rt: Runtime, run_id: str) -> None:
    with rt.db.write() as session:
        session.execute(
            update(Run).where(Run.id == run_id).values(status="Completed", ended_at=rt.db.now())
        )


def base_time(rt: Runtime) -> datetime:
    return rt.db.now().replace(microsecond=0)


# -- one due slot ---------------------------------------------------------------------------


def test_a_due_slot_fires_one_run_and_advances_the_schedule(rt: Runtime) -> None:
    # Given an interval schedule whose slot came a second ago
    schedule_id = create(rt)
    base = base_time(rt)
    set_slots(rt, schedule_id, base - MINUTE, base)

    # When two passes come
    first = rt.schedule_firing.scan_once(base + timedelta(seconds=1))
    second = rt.schedule_firing.scan_once(base + timedelta(seconds=2))

    # Then the slot fired once: one Queued agent run with the schedule's input
    (run,) = runs_of(rt, schedule_id)
    assert fires(rt, schedule_id) == [(base, "fired", run.id)]
    assert (run.status, run.kind, run.agent, run.input) == (
        "Queued",
        "agent",
        "demo",
        {"message": "report"},
    )
    assert first.runs == [run.id] and second.runs == []
    row = schedule(rt, schedule_id)
    assert (row.next_fire_at, row.last_fire_at, row.last_run_id) == (base + MINUTE, base, run.id)


def test_a_workflow_target_starts_a_workflow_run(make_runtime: MakeRuntime, sql_url: str) -> None:
    rt = make_runtime(sql_url, sender=hold_queued, WorkflowModules=["tests.workflows"])
    schedule_id = create(rt, target={"workflow": "three-nodes"}, input={"order": 7})
    base = base_time(rt)
    set_slots(rt, schedule_id, base - MINUTE, base)

    rt.schedule_firing.scan_once(base)

    (run,) = runs_of(rt, schedule_id)
    assert (run.kind, run.agent, run.input, run.resumable) == (
        "workflow",
        "three-nodes",
        {"order": 7},
        True,
    )


# -- catch-up after an outage ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("catch_up", "max_catch_up", "fired", "missed"),
    [("none", 100, 0, 6), ("latest", 100, 1, 5), ("all", 100, 6, 0), ("all", 4, 4, 2)],
)
def test_catch_up_after_a_five_minute_outage(
    make_runtime: MakeRuntime,
    sql_url: str,
    catch_up: str,
    max_catch_up: int,
    fired: int,
    missed: int,
) -> None:
    # Given a one-minute schedule whose next slot was 5 minutes ago, and a pass 30 s after
    # the latest slot (beyond a 10 s grace): slots -5m ... 0 are all late
    rt = make_runtime(
        sql_url,
        sender=hold_queued,
        Schedules={"MaxCatchUp": max_catch_up, "MisfireGrace": 10},
        **scripted_agent([{"Text": "ok"}]),
    )
    schedule_id = create(rt, catchUp=catch_up, overlap="queue")
    base = base_time(rt)
    set_slots(rt, schedule_id, base - 10 * MINUTE, base - 5 * MINUTE)

    # When one pass comes
    rt.schedule_firing.scan_once(base + timedelta(seconds=30))

    # Then each of the 6 slots is recorded once, fired or missed as the policy says; the
    # newest fire, and the next slot is the first one after the pass
    recorded = fires(rt, schedule_id)
    assert [slot for slot, _, _ in recorded] == [base - k * MINUTE for k in range(5, -1, -1)]
    outcomes = [outcome for _, outcome, _ in recorded]
    assert outcomes == ["missed"] * missed + ["fired"] * fired
    runs = runs_of(rt, schedule_id)
    assert len(runs) == fired
    assert {run for _, _, run in recorded if run} == {run.id for run in runs}
    assert schedule(rt, schedule_id).next_fire_at == base + MINUTE


def test_a_slot_within_the_grace_fires_whatever_the_policy(rt: Runtime) -> None:
    schedule_id = create(rt, catchUp="none")
    base = base_time(rt)
    set_slots(rt, schedule_id, base - 3 * MINUTE, base - 2 * MINUTE)

    rt.schedule_firing.scan_once(base + timedelta(seconds=30))  # grace: 60 s

    outcomes = [outcome for _, outcome, _ in fires(rt, schedule_id)]
    assert outcomes == ["missed", "missed", "fired"]


# -- overlap ----------------------------------------------------------------------------------


def fire_next(rt: Runtime, schedule_id: str) -> None:
    """A pass just after the schedule's next slot."""
    next_fire = schedule(rt, schedule_id).next_fire_at
    assert next_fire is not None
    rt.schedule_firing.scan_once(next_fire + timedelta(seconds=1))


def started(rt: Runtime, schedule_id: str) -> datetime:
    base = base_time(rt)
    set_slots(rt, schedule_id, base - MINUTE, base)
    rt.schedule_firing.scan_once(base + timedelta(seconds=1))
    return base


def test_skip_records_a_slot_skipped_while_the_previous_run_goes_on(rt: Runtime) -> None:
    schedule_id = create(rt, overlap="skip")
    started(rt, schedule_id)

    fire_next(rt, schedule_id)  # the first run is still Queued

    assert [o for _, o, _ in fires(rt, schedule_id)] == ["fired", "skipped"]
    assert len(runs_of(rt, schedule_id)) == 1
    (first,) = runs_of(rt, schedule_id)
    end_run(rt, first.id)
    fire_next(rt, schedule_id)  # it ended: the next slot fires
    assert [o for _, o, _ in fires(rt, schedule_id)] == ["fired", "skipped", "fired"]


def test_queue_starts_one_queued_slot_once_the_previous_run_ended(rt: Runtime) -> None:
    schedule_id = create(rt, overlap="queue")
    base = started(rt, schedule_id)

    fire_next(rt, schedule_id)  # queued behind the first run
    fire_next(rt, schedule_id)  # one is queued already: skipped
    assert [o for _, o, _ in fires(rt, schedule_id)] == ["fired", "queued", "skipped"]
    (first,) = runs_of(rt, schedule_id)

    end_run(rt, first.id)
    rt.schedule_firing.scan_once(rt.db.now())

    _, queued, _ = fires(rt, schedule_id)
    second = [run for run in runs_of(rt, schedule_id) if run.id != first.id]
    assert queued == (base + MINUTE, "fired", second[0].id)
    row = schedule(rt, schedule_id)
    assert (row.queued_slot_at, row.last_run_id) == (None, second[0].id)


def test_cancel_previous_cancels_the_run_still_going_and_fires(rt: Runtime) -> None:
    schedule_id = create(rt, overlap="cancel_previous")
    started(rt, schedule_id)
    (first,) = runs_of(rt, schedule_id)

    fire_next(rt, schedule_id)

    runs = {run.id: run for run in runs_of(rt, schedule_id)}
    assert len(runs) == 2
    assert runs[first.id].status == "Canceled"
    assert [o for _, o, _ in fires(rt, schedule_id)] == ["fired", "fired"]


# -- pause, resume, delete --------------------------------------------------------------------


def test_a_paused_schedule_fires_nothing_and_resumes_after_now(rt: Runtime) -> None:
    schedule_id = create(rt, catchUp="all")
    tenant = schedule(rt, schedule_id).tenant_id
    base = base_time(rt)
    set_slots(rt, schedule_id, base - 10 * MINUTE, base - 5 * MINUTE)

    paused = rt.schedules.pause(tenant, schedule_id)
    rt.schedule_firing.scan_once(base)
    assert (paused.paused, paused.next_fire_at, fires(rt, schedule_id)) == (True, None, [])

    resumed = rt.schedules.resume(tenant, schedule_id)
    assert resumed.next_fire_at is not None and resumed.next_fire_at > rt.db.now()
    rt.schedule_firing.scan_once(rt.db.now())
    assert fires(rt, schedule_id) == []  # the slots missed while paused never fire


def test_deleting_a_schedule_deletes_its_fires_and_keeps_its_runs(rt: Runtime) -> None:
    schedule_id = create(rt)
    started(rt, schedule_id)
    tenant = schedule(rt, schedule_id).tenant_id

    rt.schedules.delete(tenant, schedule_id)

    assert fires(rt, schedule_id) == []
    assert len(runs_of(rt, schedule_id)) == 1


# -- exactly once ---------------------------------------------------------------------------


def test_passes_racing_record_each_slot_once_with_one_run(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a schedule with 10 slots due (catch-up all), and four processes' worth of
    # runtimes (each its own engine and pool) about to run the pass at the same instant
    sections = {"Schedules": {"MisfireGrace": 3600}, **scripted_agent([{"Text": "ok"}])}
    runtimes = [make_runtime(sql_url, sender=hold_queued, **sections) for _ in range(4)]
    rt = runtimes[0]
    schedule_id = create(rt, catchUp="all", overlap="queue")
    base = base_time(rt)
    set_slots(rt, schedule_id, base - 11 * MINUTE, base - 9 * MINUTE)
    barrier = threading.Barrier(len(runtimes))
    errors: list[BaseException] = []

    def fire(runtime: Runtime) -> None:
        try:
            barrier.wait(timeout=10)
            runtime.schedule_firing.scan_once(base + timedelta(seconds=1))
        except BaseException as exc:
            errors.append(exc)

    # When they all run it at once
    threads = [threading.Thread(target=fire, args=(r,)) for r in runtimes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    # Then each of the 10 slots has one fire, and each fired one exactly one run (a pass
    # that recorded slots after another pass's runs may judge them overlapping: queued or
    # skipped, with no run)
    assert errors == []
    recorded = fires(rt, schedule_id)
    assert [slot for slot, _, _ in recorded] == [base - k * MINUTE for k in range(9, -1, -1)]
    assert all((outcome == "fired") == (run is not None) for _, outcome, run in recorded)
    assert recorded[0][1] == "fired"
    runs = runs_of(rt, schedule_id)
    assert sorted(run.id for run in runs) == sorted(str(run) for _, _, run in recorded if run)


def test_a_send_lost_after_the_commit_is_sent_by_the_requeue_scan(rt: Runtime) -> None:
    # Given a pass that dies between its commit and the run's message
    schedule_id = create(rt)
    base = base_time(rt)
    set_slots(rt, schedule_id, base - MINUTE, base)
    offer = rt.dispatcher.offer

    def crash(*args: Any, **kwargs: Any) -> Offered:
        raise KeyboardInterrupt("the process died")

    rt.dispatcher.offer = crash  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        rt.schedule_firing.scan_once(base + timedelta(seconds=1))
    rt.dispatcher.offer = offer  # type: ignore[method-assign]

    # When the requeue scan comes after Runs.RequeueAfter
    (run,) = runs_of(rt, schedule_id)
    after = rt.settings.runs.requeue_after
    result = requeue_unclaimed(rt.runs, rt.dispatcher, after, rt.db.now() + after)

    # Then it sends the scheduled run, and a later pass fires the slot no second time
    assert run.id in result.resent
    rt.schedule_firing.scan_once(base + timedelta(seconds=2))
    assert len(runs_of(rt, schedule_id)) == 1


def test_run_retention_deletes_the_fires_of_the_runs_it_deletes(rt: Runtime) -> None:
    schedule_id = create(rt)
    started(rt, schedule_id)
    (run,) = runs_of(rt, schedule_id)
    with rt.db.write() as session:
        long_ago = rt.db.now() - timedelta(days=3)
        session.execute(
            update(Run).where(Run.id == run.id).values(status="Completed", ended_at=long_ago)
        )

    result = RunRetention(rt.db, timedelta(days=1)).purge_once(rt.db.now())

    assert result.rows["schedule_fires"] == 1
    assert fires(rt, schedule_id) == []
    with rt.db.read() as session:
        assert session.scalar(select(func.count()).select_from(Run)) == 0
