"""Schedules in SQL: creating, reading, pausing, resuming and deleting a tenant's schedules,
and reading the slots each one recorded (`schedule_fires`).

Every read and change names the tenant: another tenant's schedule is not found. Times are the
database's (`Database.now`), as the firing pass's are. Deleting a schedule deletes its fires
in the same transaction; the runs it started stay (they are runs like any other).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, cast
from zoneinfo import ZoneInfo

from sqlalchemy import Table, delete, select, update
from sqlalchemy.exc import IntegrityError

from tracon_jobs.db import Database
from tracon_jobs.db.models import Schedule, ScheduleFire
from tracon_jobs.runs.store import iso
from tracon_jobs.schedules.cadence import Cadence, CronCadence, IntervalCadence
from tracon_jobs.schedules.cron import parse_cron
from tracon_jobs.schedules.definition import ScheduleSpec
from tracon_jobs.schedules.policies import Outcome

SCHEDULES = cast(Table, Schedule.__table__)
FIRES = cast(Table, ScheduleFire.__table__)


class ScheduleNotFound(LookupError):
    """No such schedule of the tenant."""


class ScheduleExists(ValueError):
    """The tenant has a schedule of that name already."""


def cadence_of(schedule: Schedule) -> Cadence:
    """When the schedule's slots are."""
    if schedule.cron is not None:
        return CronCadence(parse_cron(schedule.cron), ZoneInfo(schedule.timezone))
    assert schedule.interval_ms is not None
    return IntervalCadence(schedule.anchor_at, timedelta(milliseconds=schedule.interval_ms))


class ScheduleStore:
    """A tenant's schedules and their fires."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, tenant_id: str, spec: ScheduleSpec) -> Schedule:
        """A new schedule; its first slot is the first after now (`ScheduleExists` when the
        tenant has one of that name)."""
        now = self.db.now()
        interval_ms = None if spec.interval is None else spec.interval // timedelta(milliseconds=1)
        row = Schedule(
            id=str(uuid.uuid4()),
            tenant_id=tenant_id,
            name=spec.name,
            cron=spec.cron,
            timezone=spec.timezone,
            interval_ms=interval_ms,
            anchor_at=now,
            target_kind=spec.target_kind,
            target_name=spec.target_name,
            input=spec.input,
            overlap=spec.overlap.value,
            catch_up=spec.catch_up.value,
            paused=spec.paused,
            created_at=now,
            updated_at=now,
        )
        row.next_fire_at = None if spec.paused else cadence_of(row).next_after(now)
        try:
            with self.db.write() as session:
                session.add(row)
        except IntegrityError:
            raise ScheduleExists(f"a schedule named '{spec.name}' exists already") from None
        return row

    def get(self, tenant_id: str, schedule_id: str) -> Schedule:
        query = select(Schedule).where(Schedule.id == schedule_id, Schedule.tenant_id == tenant_id)
        with self.db.read() as session:
            found = session.scalars(query).first()
            if found is None:
                raise ScheduleNotFound(schedule_id)
            session.expunge(found)
            return found

    def find(self, tenant_id: str, name_or_id: str) -> Schedule:
        """By id or by name (the command line's way)."""
        query = select(Schedule).where(
            Schedule.tenant_id == tenant_id,
            (Schedule.id == name_or_id) | (Schedule.name == name_or_id),
        )
        with self.db.read() as session:
            found = session.scalars(query).first()
            if found is None:
                raise ScheduleNotFound(name_or_id)
            session.expunge(found)
            return found

    def page(
        self, tenant_id: str, limit: int, before: tuple[datetime, str] | None = None
    ) -> list[Schedule]:
        """The tenant's schedules, newest first, after the cursor `before`."""
        query = select(Schedule).where(Schedule.tenant_id == tenant_id)
        if before is not None:
            at, last = before
            query = query.where(
                (Schedule.created_at < at) | ((Schedule.created_at == at) & (Schedule.id < last))
            )
        query = query.order_by(Schedule.created_at.desc(), Schedule.id.desc()).limit(limit)
        with self.db.read() as session:
            rows = list(session.scalars(query))
            session.expunge_all()
            return rows

    def pause(self, tenant_id: str, schedule_id: str) -> Schedule:
        """No slot fires until it is resumed; a slot queued behind a running run is dropped
        (recorded `skipped`)."""
        now = self.db.now()  # before the transaction: one connection at a time per thread
        with self.db.write() as session:
            row = _locked(session, tenant_id, schedule_id, self.db.is_sqlite)
            if row.queued_slot_at is not None:
                session.execute(
                    update(FIRES)
                    .where(FIRES.c.schedule_id == row.id, FIRES.c.slot_at == row.queued_slot_at)
                    .values(outcome=Outcome.SKIPPED.value, detail="the schedule was paused")
                )
            row.paused, row.next_fire_at, row.queued_slot_at = True, None, None
            row.updated_at = now
            session.flush()
            session.expunge(row)
            return row

    def resume(self, tenant_id: str, schedule_id: str) -> Schedule:
        """Fires again from the first slot after now: the slots missed while paused do not
        fire. Resuming a schedule that is not paused changes nothing."""
        now = self.db.now()  # before the transaction: one connection at a time per thread
        with self.db.write() as session:
            row = _locked(session, tenant_id, schedule_id, self.db.is_sqlite)
            if row.paused:
                row.paused, row.next_fire_at = False, cadence_of(row).next_after(now)
                row.updated_at = now
                session.flush()
            session.expunge(row)
            return row

    def delete(self, tenant_id: str, schedule_id: str) -> None:
        """The schedule and its fires, in one transaction; its runs stay."""
        with self.db.write() as session:
            row = _locked(session, tenant_id, schedule_id, self.db.is_sqlite)
            session.execute(delete(FIRES).where(FIRES.c.schedule_id == row.id))
            session.execute(delete(SCHEDULES).where(SCHEDULES.c.id == row.id))

    def fires(
        self, tenant_id: str, schedule_id: str, limit: int, before: datetime | None = None
    ) -> list[ScheduleFire]:
        """The schedule's recorded slots, newest first, before the slot `before`."""
        self.get(tenant_id, schedule_id)
        query = select(ScheduleFire).where(ScheduleFire.schedule_id == schedule_id)
        if before is not None:
            query = query.where(ScheduleFire.slot_at < before)
        query = query.order_by(ScheduleFire.slot_at.desc()).limit(limit)
        with self.db.read() as session:
            rows = list(session.scalars(query))
            session.expunge_all()
            return rows


def _locked(session: Any, tenant_id: str, schedule_id: str, sqlite: bool) -> Schedule:
    """The tenant's schedule, locked against the firing pass (PostgreSQL; SQLite's write
    transaction holds the whole database)."""
    query = select(Schedule).where(Schedule.id == schedule_id, Schedule.tenant_id == tenant_id)
    if not sqlite:
        query = query.with_for_update()
    row = cast(Schedule | None, session.scalars(query).first())
    if row is None:
        raise ScheduleNotFound(schedule_id)
    return row


def schedule_json(row: Schedule) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "cron": row.cron,
        "timezone": row.timezone if row.cron is not None else None,
        "interval": None if row.interval_ms is None else row.interval_ms / 1000,
        "target": {row.target_kind: row.target_name},
        "input": row.input,
        "overlap": row.overlap,
        "catchUp": row.catch_up,
        "paused": row.paused,
        "nextFireAt": iso(row.next_fire_at),
        "lastFireAt": iso(row.last_fire_at),
        "lastRunId": row.last_run_id,
        "createdAt": iso(row.created_at),
    }


def fire_json(row: ScheduleFire) -> dict[str, Any]:
    return {
        "slotAt": iso(row.slot_at),
        "outcome": row.outcome,
        "runId": row.run_id,
        "firedAt": iso(row.fired_at),
        "detail": row.detail,
    }
