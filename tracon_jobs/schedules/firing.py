"""The firing pass (beat's `tracon.schedules.fire`, under its singleton lease): every slot of
every schedule, once.

Exactly once per slot: each slot is recorded in its own transaction, which (1) locks the
schedule row and checks it still expects that slot (not paused, not deleted, `next_fire_at`
not past it), (2) inserts the slot's `schedule_fires` row, insert-or-nothing on the primary
key (schedule, slot), (3) writes the slot's run through the run store, with an id derived from
(schedule, slot), and (4) advances `next_fire_at`. A conflicting insert means another pass
recorded the slot: that transaction changes nothing. Two passes racing (two beats, a lease
that moved, a pass that outlived its lease) therefore record each slot once, and a slot's run
exists exactly when its fire says `fired`. Only after the commit is the run's message sent; a
crash in between leaves a `Queued` run with its enqueue time set, which the requeue scan of
unclaimed runs sends after `Runs.RequeueAfter`, as for any submission.

The pass reads the time from the database (`now`), so every host judges slots by one clock,
and tests pass any `now` to simulate an outage. What is due, and what an overlap does, are
the pure rules of `policies`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, and_, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, Schedule, ScheduleFire
from tracon_jobs.errors import EnqueueError
from tracon_jobs.limits.tree import MAX_CHAIN
from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import Event, NewRun, RunStore
from tracon_jobs.schedules.definition import ScheduleTargets
from tracon_jobs.schedules.policies import CatchUp, Outcome, Overlap, plan, window
from tracon_jobs.schedules.store import cadence_of

log = logging.getLogger(__name__)

SCHEDULES = cast(Table, Schedule.__table__)
FIRES = cast(Table, ScheduleFire.__table__)
RUNS = cast(Table, Run.__table__)

DUE_BATCH = 200
"""Schedules one pass reads at a time; it reads again while a batch comes back full."""
DUE_BATCHES = 20
"""The most batches one pass handles; the next pass takes the rest."""
FIRES_KEPT = 1000
"""Fires without a run (skipped, missed, failed) kept per schedule, the newest; fires with a
run are deleted with their run by run retention."""
RUN_IDS = uuid.UUID("7b1f4a52-3c1e-4d55-9a55-6f1d3c0e9b21")
"""The namespace of the run ids derived from (schedule, slot)."""

Cancel = Callable[[str], object]
"""`cancel(run_id)`: request the cancel of a live run (its tree), as `POST .../cancel` does."""


def run_id_of(schedule_id: str, slot: datetime) -> str:
    """The id of a slot's run: one per (schedule, slot), whoever writes it."""
    return str(uuid.uuid5(RUN_IDS, f"schedule:{schedule_id}:{slot.isoformat()}"))


def session_of(schedule_id: str) -> str:
    """The session of a schedule's runs (`GET /api/runs?sessionId=schedule:<id>`)."""
    return f"schedule:{schedule_id}"


@dataclass
class FiringResult:
    """What one pass recorded, per outcome, and the runs it started."""

    outcomes: dict[str, int] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    finished: bool = True

    def count(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1

    def as_json(self) -> dict[str, Any]:
        return {"outcomes": dict(self.outcomes), "runs": len(self.runs), "finished": self.finished}


@dataclass(frozen=True)
class _Recorded:
    """A slot's transaction committed: its outcome, and what to do after the commit."""

    outcome: Outcome
    run: Run | None = None
    event: Event | None = None
    cancel: str | None = None


@dataclass
class _Batch:
    """The slots one pass fires for one schedule (a catch-up) are judged together against
    the run before them, not against each other: `previous(row)` is that run, unless another
    pass changed the schedule's last run meanwhile (then that one)."""

    before: str | None
    started: set[str] = field(default_factory=set)

    def previous(self, row: Schedule) -> str | None:
        return self.before if row.last_run_id in self.started else row.last_run_id


@dataclass(frozen=True)
class FiringPolicy:
    max_catch_up: int
    misfire_grace: timedelta
    currency: str = "USD"


class ScheduleFiring:
    """Fires the due slots of every schedule (module docstring)."""

    def __init__(
        self,
        db: Database,
        runs: RunStore,
        dispatcher: RunDispatcher,
        targets: ScheduleTargets,
        cancel: Cancel,
        policy: FiringPolicy,
        workflow_version: Callable[[str], str | None] = lambda name: None,
    ) -> None:
        self.db = db
        self.runs = runs
        self.dispatcher = dispatcher
        self.targets = targets
        self.cancel = cancel
        self.policy = policy
        self.workflow_version = workflow_version

    def scan_once(
        self, now: datetime, still_owner: Callable[[], bool] = lambda: True
    ) -> FiringResult:
        """Start the queued slots whose previous run ended, then fire every due slot."""
        result = FiringResult()
        for schedule_id in self._ids(SCHEDULES.c.queued_slot_at.is_not(None), now):
            self._deliver(self._start_queued(schedule_id, now), result)
        for _ in range(DUE_BATCHES):
            due = self._ids(SCHEDULES.c.next_fire_at <= now, now)
            for schedule_id in due:
                if not still_owner():
                    result.finished = False
                    return result
                self.fire_due(schedule_id, now, result)
            if len(due) < DUE_BATCH:
                break
        return result

    def _ids(self, condition: Any, now: datetime) -> list[str]:
        query = (
            select(SCHEDULES.c.id)
            .where(condition, SCHEDULES.c.paused.is_(False))
            .order_by(SCHEDULES.c.next_fire_at)
            .limit(DUE_BATCH)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def fire_due(self, schedule_id: str, now: datetime, result: FiringResult) -> None:
        """Record each due slot of the schedule, oldest first, one transaction each."""
        with self.db.read() as session:
            row = session.get(Schedule, schedule_id)
            if row is None or row.next_fire_at is None or row.paused:
                return
            session.expunge(row)
        cadence = cadence_of(row)
        assert row.next_fire_at is not None
        due = cadence.latest(row.next_fire_at, now, window(self.policy.max_catch_up))
        slots = plan(
            due,
            now,
            CatchUp(row.catch_up),
            self.policy.misfire_grace,
            self.policy.max_catch_up,
        ).slots()
        if not slots:  # nothing due after all (its next slot moved): look again after now
            self._advance_only(row.id, row.next_fire_at, cadence.next_after(now))
            return
        recorded_without_run = False
        batch = _Batch(row.last_run_id)
        for slot, fires in slots:
            following = cadence.next_after(slot)
            recorded = self._record(row.id, slot, fires, following, now, batch)
            if recorded is None:
                break  # paused, deleted, or another pass is ahead: it records the rest
            self._deliver(recorded, result)
            recorded_without_run |= recorded.run is None
            if recorded.run is not None:
                batch.started.add(recorded.run.id)
        if recorded_without_run:
            self._prune(row.id)

    # -- one slot, one transaction ------------------------------------------------------------

    def _record(
        self,
        schedule_id: str,
        slot: datetime,
        fires: bool,
        following: datetime | None,
        now: datetime,
        batch: _Batch,
    ) -> _Recorded | None:
        """Record `slot` (module docstring); None when the schedule no longer expects it or
        another pass recorded it."""
        with self.db.write() as session:
            row = self._lock(session, schedule_id)
            if row is None or row.paused or row.next_fire_at is None or row.next_fire_at > slot:
                return None
            outcome, detail, cancel = self._decide(session, row, fires, batch.previous(row))
            run_id = run_id_of(row.id, slot) if outcome is Outcome.FIRED else None
            if not self._insert_fire(session, row, slot, outcome, run_id, now, detail):
                return None
            changes: dict[str, Any] = {"next_fire_at": following, "updated_at": now}
            run = event = None
            if outcome is Outcome.FIRED:
                run, event = self.runs.create_in(session, self._new_run(row, slot))
                changes.update(last_run_id=run.id, last_fire_at=slot)
            elif outcome is Outcome.QUEUED:
                changes.update(queued_slot_at=slot)
            session.execute(update(SCHEDULES).where(SCHEDULES.c.id == row.id).values(**changes))
        return _Recorded(outcome, run, event, cancel)

    def _decide(
        self, session: Session, row: Schedule, fires: bool, previous: str | None
    ) -> tuple[Outcome, str | None, str | None]:
        """(outcome, detail, run to cancel) of a slot of `row` whose previous run is
        `previous`."""
        if not fires:
            return Outcome.MISSED, "late beyond Schedules.MisfireGrace", None
        if not self.targets.knows(row.target_kind, row.target_name):
            return Outcome.FAILED, f"no {row.target_kind} named '{row.target_name}' now", None
        live = _live_run(session, previous)
        if live is None:
            return Outcome.FIRED, None, None
        overlap = Overlap(row.overlap)
        if overlap is Overlap.CANCEL_PREVIOUS:
            return Outcome.FIRED, f"asked run {live} to cancel", live
        if overlap is Overlap.QUEUE and row.queued_slot_at is None:
            return Outcome.QUEUED, f"waits for run {live} to end", None
        return Outcome.SKIPPED, f"run {live} has not ended", None

    def _start_queued(self, schedule_id: str, now: datetime) -> _Recorded | None:
        """Start the slot queued behind the previous run, once that run ended."""
        with self.db.write() as session:
            row = self._lock(session, schedule_id)
            if row is None or row.paused or row.queued_slot_at is None:
                return None
            if _live_run(session, row.last_run_id) is not None:
                return None
            slot = row.queued_slot_at
            if not self.targets.knows(row.target_kind, row.target_name):
                detail = f"no {row.target_kind} named '{row.target_name}' now"
                self._settle_queued(session, row, slot, Outcome.FAILED, None, now, detail)
                return _Recorded(Outcome.FAILED)
            run, event = self.runs.create_in(session, self._new_run(row, slot))
            self._settle_queued(session, row, slot, Outcome.FIRED, run.id, now, None)
        return _Recorded(Outcome.FIRED, run, event)

    def _settle_queued(
        self,
        session: Session,
        row: Schedule,
        slot: datetime,
        outcome: Outcome,
        run_id: str | None,
        now: datetime,
        detail: str | None,
    ) -> None:
        session.execute(
            update(FIRES)
            .where(FIRES.c.schedule_id == row.id, FIRES.c.slot_at == slot)
            .values(outcome=outcome.value, run_id=run_id, fired_at=now, detail=detail)
        )
        changes: dict[str, Any] = {"queued_slot_at": None, "updated_at": now}
        if run_id is not None:
            changes.update(last_run_id=run_id, last_fire_at=slot)
        session.execute(update(SCHEDULES).where(SCHEDULES.c.id == row.id).values(**changes))

    def _lock(self, session: Session, schedule_id: str) -> Schedule | None:
        """The schedule row, locked until the commit (PostgreSQL: `FOR UPDATE`; SQLite's
        write transaction holds the whole database)."""
        query = select(Schedule).where(Schedule.id == schedule_id)
        if not self.db.is_sqlite:
            query = query.with_for_update()
        return cast(Schedule | None, session.scalars(query).first())

    def _insert_fire(
        self,
        session: Session,
        row: Schedule,
        slot: datetime,
        outcome: Outcome,
        run_id: str | None,
        now: datetime,
        detail: str | None,
    ) -> bool:
        """Insert-or-nothing on (schedule, slot): True when this transaction recorded it."""
        dialect_insert = sqlite.insert if self.db.is_sqlite else postgresql.insert
        statement = (
            dialect_insert(FIRES)
            .values(
                schedule_id=row.id,
                slot_at=slot,
                tenant_id=row.tenant_id,
                outcome=outcome.value,
                run_id=run_id,
                fired_at=now,
                detail=detail,
            )
            .on_conflict_do_nothing(index_elements=[FIRES.c.schedule_id, FIRES.c.slot_at])
            .returning(FIRES.c.slot_at)
        )
        return session.execute(statement).first() is not None

    def _new_run(self, row: Schedule, slot: datetime) -> NewRun:
        workflow = row.target_kind == "workflow"
        return NewRun(
            tenant_id=row.tenant_id,
            agent=row.target_name,
            kind=row.target_kind,
            input=dict(row.input),
            session_id=session_of(row.id),
            currency=self.policy.currency,
            resumable=True,  # a job owns it: bound to no connection
            workflow_version=self.workflow_version(row.target_name) if workflow else None,
            id=run_id_of(row.id, slot),
        )

    def _advance_only(
        self, schedule_id: str, expected: datetime, following: datetime | None
    ) -> None:
        with self.db.write() as session:
            session.execute(
                update(SCHEDULES)
                .where(SCHEDULES.c.id == schedule_id, SCHEDULES.c.next_fire_at == expected)
                .values(next_fire_at=following)
            )

    # -- after the commit -----------------------------------------------------------------------

    def _deliver(self, recorded: _Recorded | None, result: FiringResult) -> None:
        """Publish the run's first event, cancel the previous run, send the new one."""
        if recorded is None:
            return
        result.count(recorded.outcome)
        if recorded.event is not None:
            self.runs.publish(recorded.event)
        if recorded.cancel is not None:
            try:
                self.cancel(recorded.cancel)
            except Exception:  # the new run goes ahead; the old one ends on its own
                log.exception("schedule: cancel of run %s failed", recorded.cancel)
        run = recorded.run
        if run is None:
            return
        result.runs.append(run.id)
        try:
            self.dispatcher.offer_run(run)
        except EnqueueError as exc:  # the row is Queued: the requeue scan sends it
            log.warning(
                "scheduled run %s not sent now (%s); the requeue scan sends it", run.id, exc
            )

    def _prune(self, schedule_id: str) -> None:
        """Keep the newest `FIRES_KEPT` fires without a run of the schedule."""
        oldest_kept = (
            select(FIRES.c.slot_at)
            .where(FIRES.c.schedule_id == schedule_id)
            .order_by(FIRES.c.slot_at.desc())
            .offset(FIRES_KEPT)
            .limit(1)
            .scalar_subquery()
        )
        with self.db.write() as session:
            session.execute(
                delete(FIRES).where(
                    and_(
                        FIRES.c.schedule_id == schedule_id,
                        FIRES.c.run_id.is_(None),
                        FIRES.c.slot_at <= oldest_kept,
                    )
                )
            )


def _live_run(session: Session, run_id: str | None) -> str | None:
    """The run of the previous slot that has not ended (its chain's latest, for a workflow
    continued in a new run); None when it ended, or is gone (deleted by retention)."""
    for _ in range(MAX_CHAIN):
        if run_id is None:
            return None
        found = session.execute(
            select(RUNS.c.status, RUNS.c.output).where(RUNS.c.id == run_id)
        ).first()
        if found is None:
            return None
        status, output = found
        if not RunStatus(status).is_terminal:
            return run_id
        following = (output or {}).get("continuedIn") if status == "Completed" else None
        if not following:
            return None
        run_id = str(following)
    return None
