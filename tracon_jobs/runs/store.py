"""SQL persistence of runs and their events, every executor write guarded by its fence.

The run row hands out event sequence numbers (`event_seq`), so appending an event is one
guarded `UPDATE ... RETURNING` plus an insert in the same transaction: the fence check and
the ordering come from the same statement, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, case, func, insert, literal, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, RunEvent
from tracon_jobs.errors import RunTakenAway
from tracon_jobs.runs.lifecycle import TERMINAL_EVENT, Claim, ErrorClass, RunError, RunStatus

LIVE = [RunStatus.QUEUED.value, RunStatus.RUNNING.value, RunStatus.WAITING.value]


@dataclass(frozen=True)
class Event:
    run_id: str
    seq: int
    type: str
    at: datetime
    data: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, "at": iso(self.at), "data": self.data}


@dataclass(frozen=True)
class NewRun:
    tenant_id: str
    agent: str
    input: dict[str, Any]
    kind: str = "agent"
    session_id: str | None = None
    parameters: dict[str, Any] | None = None
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int = 0
    continued_from_run_id: str | None = None
    attempt: int = 1
    currency: str = "USD"
    id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass(frozen=True)
class TurnSpend:
    """What one model call cost, priced at the model that answered."""

    model_id: str
    input_tokens: int
    output_tokens: int
    cost: Decimal
    cost_source: str


@dataclass(frozen=True)
class RunFilter:
    status: str | None = None
    agent: str | None = None
    session_id: str | None = None


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat(timespec="milliseconds") + "Z"


class RunStore:
    def __init__(self, db: Database, feed: EventFeed | None = None) -> None:
        self.db = db
        self.feed = feed

    def publish(self, event: Event | None) -> Event | None:
        if event is not None and self.feed is not None:
            self.feed.publish(event.run_id, event.seq)
        return event

    # -- creating and enqueueing -------------------------------------------------------

    def create(self, new: NewRun) -> Run:
        """Write the `Queued` row and its `RunQueued` event before any message is sent."""
        now = self.db.now()
        run = Run(
            id=new.id,
            tenant_id=new.tenant_id,
            agent=new.agent,
            kind=new.kind,
            status=RunStatus.QUEUED.value,
            input=new.input,
            parameters=new.parameters,
            session_id=new.session_id,
            parent_run_id=new.parent_run_id,
            root_run_id=new.root_run_id or new.id,
            depth=new.depth,
            continued_from_run_id=new.continued_from_run_id,
            attempt=new.attempt,
            turns_completed=0,
            input_tokens=0,
            output_tokens=0,
            cost_amount=Decimal(0),
            cost_currency=new.currency,
            cost_source="Configured",
            fence=0,
            event_seq=1,
            enqueued_at=now,  # the caller sends right after; the requeue scan covers a crash
            enqueue_count=1,
            created_at=now,
        )
        with self.db.write() as session:
            session.add(run)
            session.flush()
            _insert_event(session, run.id, 1, "RunQueued", now, {"agent": new.agent})
        self.publish(Event(run.id, 1, "RunQueued", now, {"agent": new.agent}))
        return run

    def mark_enqueued(self, run_id: str) -> None:
        with self.db.write() as session:
            session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(enqueued_at=self.db.now(), enqueue_count=Run.enqueue_count + 1)
            )

    def fail_unsent(self, run_id: str, error: RunError) -> bool:
        """Close a run whose message the broker refused, unless a worker has it already."""
        return (
            self._close(run_id, RunStatus.QUEUED, None, RunStatus.FAILED, error=error) is not None
        )

    def unclaimed(self, now: datetime, older_than: timedelta, limit: int) -> list[str]:
        """`Queued` runs nobody claimed: sent before the deadline, or never recorded as sent."""
        deadline = now - older_than
        query = (
            select(Run.id)
            .where(
                Run.status == RunStatus.QUEUED.value,
                or_(
                    Run.enqueued_at < deadline,
                    and_(Run.enqueued_at.is_(None), Run.created_at < deadline),
                ),
            )
            .order_by(Run.created_at)
            .limit(limit)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    # -- the executor's fenced writes --------------------------------------------------

    def claim(self, run_id: str, owner: str) -> Claim | None:
        """`Queued` -> `Running` with a new fence; None when the row is in any other state."""
        claimed = self.claim_and_load(run_id, owner)
        return None if claimed is None else claimed[0]

    def claim_and_load(self, run_id: str, owner: str) -> tuple[Claim, Run] | None:
        """The claim and the claimed row, from the one guarded UPDATE ... RETURNING."""
        now = self.db.now()
        with self.db.write() as session:
            run = session.scalars(
                update(Run)
                .where(Run.id == run_id, Run.status == RunStatus.QUEUED.value)
                .values(
                    status=RunStatus.RUNNING.value,
                    fence=Run.fence + 1,
                    owner=owner,
                    started_at=func.coalesce(Run.started_at, now),
                    heartbeat_at=now,
                    event_seq=Run.event_seq + 1,
                )
                .returning(Run)
                .execution_options(synchronize_session=False)
            ).one_or_none()
            if run is None:
                return None
            _insert_event(session, run_id, run.event_seq, "RunStarted", now, {"owner": owner})
        self.publish(Event(run_id, run.event_seq, "RunStarted", now, {"owner": owner}))
        return Claim(run_id=run_id, fence=run.fence, owner=owner), run

    def append(
        self, claim: Claim | None, type_: str, data: dict[str, Any], *, run_id: str | None = None
    ) -> Event:
        """Append and publish one event (fenced when `claim` is given)."""
        with self.db.write() as session:
            event = self.append_in(session, claim, type_, data, run_id=run_id)
        self.publish(event)
        return event

    def append_in(
        self,
        session: Session,
        claim: Claim | None,
        type_: str,
        data: dict[str, Any],
        *,
        run_id: str | None = None,
    ) -> Event:
        """Append one event inside `session`; guarded by the fence when a claim is given."""
        target = claim.run_id if claim else run_id
        assert target is not None
        statement = update(Run).where(Run.id == target)
        if claim is not None:
            statement = statement.where(
                Run.fence == claim.fence, Run.status == RunStatus.RUNNING.value
            )
        seq = session.execute(
            statement.values(event_seq=Run.event_seq + 1).returning(Run.event_seq)
        ).scalar_one_or_none()
        if seq is None:
            raise RunTakenAway(f"run {target} is no longer owned by fence {claim and claim.fence}")
        at = self.db.now()
        _insert_event(session, target, seq, type_, at, data)
        return Event(run_id=target, seq=seq, type=type_, at=at, data=data)

    def record_spend(self, claim: Claim, spend: TurnSpend, event_data: dict[str, Any]) -> Event:
        """Add a model call's tokens and cost to the run, with its `ModelCallCompleted`."""
        with self.db.write() as session:
            event = self.append_in(session, claim, "ModelCallCompleted", event_data)
            self._add_spend(session, claim, spend)
        self.publish(event)
        return event

    def _add_spend(self, session: Session, claim: Claim, spend: TurnSpend) -> None:
        session.execute(
            update(Run)
            .where(Run.id == claim.run_id, Run.fence == claim.fence)
            .values(
                model_id=spend.model_id,
                input_tokens=Run.input_tokens + spend.input_tokens,
                output_tokens=Run.output_tokens + spend.output_tokens,
                cost_amount=Run.cost_amount + spend.cost,
                cost_source=_worst_source(spend.cost_source),
            )
        )

    def add_cost(self, claim: Claim, amount: Decimal, data: dict[str, Any]) -> None:
        """Spend a tool reported beyond tokens, with its `UsageReported` event."""
        with self.db.write() as session:
            event = self.append_in(session, claim, "UsageReported", data)
            session.execute(
                update(Run)
                .where(Run.id == claim.run_id, Run.fence == claim.fence)
                .values(cost_amount=Run.cost_amount + amount)
            )
        self.publish(event)

    def save_turn(self, claim: Claim, messages: Sequence[dict[str, Any]], turns: int) -> None:
        """Persist the conversation after a finished turn, so the run resumes from SQL."""
        with self.db.write() as session:
            changed = session.execute(
                update(Run)
                .where(
                    Run.id == claim.run_id,
                    Run.fence == claim.fence,
                    Run.status == RunStatus.RUNNING.value,
                )
                .values(messages=list(messages), turns_completed=turns)
                .returning(Run.id)
            ).scalar_one_or_none()
            if changed is None:
                raise RunTakenAway(f"run {claim.run_id} was taken away")

    def finish(
        self,
        claim: Claim,
        status: RunStatus,
        *,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
        attempts: list[dict[str, Any]] | None = None,
    ) -> Event | None:
        """The one fenced final write; None when the run was taken away meanwhile."""
        return self._close(claim.run_id, RunStatus.RUNNING, claim, status, output, error, attempts)

    def _close(
        self,
        run_id: str,
        expected: RunStatus,
        claim: Claim | None,
        status: RunStatus,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
        attempts: list[dict[str, Any]] | None = None,
        extra_guard: Sequence[ColumnElement[bool]] = (),
    ) -> Event | None:
        now = self.db.now()
        guard = [Run.id == run_id, Run.status == expected.value, *extra_guard]
        if claim is not None:
            guard.append(Run.fence == claim.fence)
        with self.db.write() as session:
            seq = session.execute(
                update(Run)
                .where(*guard)
                .values(
                    status=status.value,
                    output=output,
                    ended_at=now,
                    error_type=error.type if error else None,
                    error_class=error.error_class.value if error else None,
                    error_message=error.message if error else None,
                    error_retry_after=error.retry_after if error else None,
                    model_attempts=attempts,
                    event_seq=Run.event_seq + 1,
                )
                .returning(Run.event_seq)
            ).scalar_one_or_none()
            if seq is None:
                return None
            data: dict[str, Any] = {"status": status.value}
            if output is not None:
                data["output"] = output
            if error is not None:
                data["error"] = error.as_json()
            type_ = TERMINAL_EVENT[status]
            _insert_event(session, run_id, seq, type_, now, data)
        return self.publish(Event(run_id=run_id, seq=seq, type=type_, at=now, data=data))

    # -- liveness, cancellation, reconciliation ----------------------------------------

    def heartbeat(self, owned: dict[str, int]) -> set[str]:
        """One bulk heartbeat for the runs this process executes (run id -> fence).

        Returns the ids still owned: a run missing from the answer was closed or claimed
        by someone else, and its executor must stop.
        """
        if not owned:
            return set()
        still_ours = or_(*(and_(Run.id == rid, Run.fence == fence) for rid, fence in owned.items()))
        with self.db.write() as session:
            rows = session.execute(
                update(Run)
                .where(
                    still_ours, Run.status.in_([RunStatus.RUNNING.value, RunStatus.QUEUED.value])
                )
                .values(heartbeat_at=self.db.now())
                .returning(Run.id)
            ).scalars()
            return set(rows)

    def cancel_requested(self, run_ids: Sequence[str]) -> set[str]:
        if not run_ids:
            return set()
        query = select(Run.id).where(Run.id.in_(run_ids), Run.cancel_requested_at.is_not(None))
        with self.db.read() as session:
            return set(session.scalars(query))

    def request_cancel(self, runs: Sequence[Run]) -> list[str]:
        """Persist the cancel request of every live run given (before anyone is told)."""
        now = self.db.now()
        marked: list[str] = []
        events: list[Event] = []
        with self.db.write() as session:
            for run in runs:
                changed = session.execute(
                    update(Run)
                    .where(
                        Run.id == run.id, Run.status.in_(LIVE), Run.cancel_requested_at.is_(None)
                    )
                    .values(cancel_requested_at=now)
                    .returning(Run.id)
                ).scalar_one_or_none()
                if changed is not None:
                    marked.append(run.id)
                    events.append(
                        self.append_in(session, None, "CancelRequested", {}, run_id=run.id)
                    )
        for event in events:
            self.publish(event)
        return marked

    def cancel_queued(self, run_id: str) -> bool:
        """Close a run no worker claimed yet; its message, when delivered, is dropped."""
        error = RunError("canceled", ErrorClass.CANCELLATION, "canceled before it started")
        return (
            self._close(run_id, RunStatus.QUEUED, None, RunStatus.CANCELED, error=error) is not None
        )

    def subtree(self, run: Run) -> list[Run]:
        """The run and all its descendants, by parent links (breadth first)."""
        found, frontier = [run], [run.id]
        with self.db.read() as session:
            while frontier:
                children = list(session.scalars(select(Run).where(Run.parent_run_id.in_(frontier))))
                found += children
                frontier = [child.id for child in children]
        return found

    def orphans(self, now: datetime, threshold: timedelta, limit: int) -> list[Run]:
        """`Running` runs, and `Queued` runs that heartbeated, silent for `threshold`."""
        query = (
            select(Run)
            .where(
                Run.status.in_([RunStatus.RUNNING.value, RunStatus.QUEUED.value]),
                Run.heartbeat_at < now - threshold,
            )
            .order_by(Run.heartbeat_at)
            .limit(limit)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def close_orphan(
        self, run: Run, status: RunStatus, error: RunError, silent_since: datetime
    ) -> Event | None:
        """Close a silent run, unless it heartbeated or changed hands since it was read."""
        guard = [Run.fence == run.fence, Run.heartbeat_at < silent_since]
        return self._close(
            run.id, RunStatus(run.status), None, status, error=error, extra_guard=guard
        )

    # -- reads -------------------------------------------------------------------------

    def get(self, run_id: str, tenant_id: str | None = None) -> Run | None:
        with self.db.read() as session:
            run = session.get(Run, run_id)
        if run is None or (tenant_id is not None and run.tenant_id != tenant_id):
            return None
        return run

    def events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        query = (
            select(RunEvent)
            .where(RunEvent.run_id == run_id, RunEvent.seq > after_seq)
            .order_by(RunEvent.seq)
            .limit(limit)
        )
        with self.db.read() as session:
            rows = session.scalars(query).all()
        return [Event(r.run_id, r.seq, r.type, r.at, r.data) for r in rows]

    def page(
        self, tenant_id: str, filters: RunFilter, *, limit: int, before: tuple[datetime, str] | None
    ) -> list[Run]:
        """Newest first; `before` is the (created_at, id) of the last row of the prior page."""
        query = select(Run).where(Run.tenant_id == tenant_id)
        if filters.status:
            query = query.where(Run.status == filters.status)
        if filters.agent:
            query = query.where(Run.agent == filters.agent)
        if filters.session_id:
            query = query.where(Run.session_id == filters.session_id)
        if before is not None:
            created, run_id = before
            query = query.where(
                or_(Run.created_at < created, and_(Run.created_at == created, Run.id < run_id))
            )
        query = query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
        with self.db.read() as session:
            return list(session.scalars(query))

    def tree(self, root_run_id: str, tenant_id: str) -> list[Run]:
        query = (
            select(Run)
            .where(Run.root_run_id == root_run_id, Run.tenant_id == tenant_id)
            .order_by(Run.depth, Run.created_at)
        )
        with self.db.read() as session:
            return list(session.scalars(query))


def _worst_source(source: str) -> Any:
    """Once any call of a run had no price, the run's cost is `Unknown` for good."""
    if source == "Unknown":
        return literal("Unknown")
    return case((Run.cost_source == "Unknown", literal("Unknown")), else_=literal(source))


def _insert_event(
    session: Session, run_id: str, seq: int, type_: str, at: datetime, data: dict[str, Any]
) -> None:
    """A Core insert: events are append-only, they never need the ORM's unit of work."""
    session.execute(insert(RunEvent).values(run_id=run_id, seq=seq, type=type_, at=at, data=data))
