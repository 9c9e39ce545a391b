"""Approvals: a person between the model and a tool call, decided once and consumed once.

    Running ──request (one transaction: approvals, events, run Waiting)──> Waiting
    Pending ──decide | expire (one conditional UPDATE)──> Approved | Rejected | Expired
    Waiting ──last pending approval decided──> Queued ──claim (new fence)──> Running
    Approved ──consume (one conditional UPDATE, with the ledger's `started` row)──> used

Every transition is a guarded UPDATE, so among any number of web and worker processes
exactly one decision wins and an approval authorizes at most one execution of its call
(runtime retries of that execution included). A model that calls the tool again makes a
new execution, which asks again. A waiting run holds no thread, slot, heartbeat or lease:
only a decision, an expiry or a cancel moves it on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, cast

from sqlalchemy import Table, func, insert, select, tuple_, update
from sqlalchemy.orm import Session

from tracon_jobs.db import Database
from tracon_jobs.db.engine import StatementClock
from tracon_jobs.db.models import Approval, Run
from tracon_jobs.db.outages import rides_out_outages
from tracon_jobs.errors import EnqueueError
from tracon_jobs.limits.budget_store import BudgetStore
from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.lifecycle import Claim, ErrorClass, RunError, RunStatus
from tracon_jobs.runs.store import Event, RunStore, iso

log = logging.getLogger(__name__)

APPROVALS = cast(Table, Approval.__table__)
RUNS = cast(Table, Run.__table__)
_NOW = StatementClock()


class ApprovalStatus(StrEnum):
    PENDING = "Pending"
    APPROVED = "Approved"
    REJECTED = "Rejected"
    EXPIRED = "Expired"
    CANCELED = "Canceled"


@dataclass(frozen=True)
class ApprovalRequest:
    """One tool call that needs a person, as the executor asks for it."""

    turn: int
    call_id: str
    tool: str
    arguments: dict[str, Any]
    args_hash: str


@dataclass(frozen=True)
class Decided:
    """A decision (or expiry) that took effect, and whether it put its run back in the queue."""

    approval: Approval
    resumed: bool
    root_run_id: str
    waited_ms: int


class ApprovalNotFound(LookupError):
    """Unknown, or another tenant's: the caller answers 404."""


class ApprovalConflict(Exception):
    """Already decided, expired, or its run ended: the caller answers 409."""

    def __init__(self, approval: Approval, reason: str) -> None:
        super().__init__(reason)
        self.approval = approval


class ApprovalStore:
    """SQL persistence of approvals, and the run transitions they drive."""

    def __init__(self, runs: RunStore, timeout: timedelta) -> None:
        self.runs = runs
        self.db: Database = runs.db
        self.timeout = timeout

    # -- the executor's side -------------------------------------------------------------

    @rides_out_outages
    def wait_for(
        self,
        claim: Claim,
        requests: Sequence[ApprovalRequest],
        messages: list[dict[str, Any]],
        turns: int,
    ) -> list[str]:
        """Record the requests and put the run `Waiting`, in one fenced transaction."""
        ids = [str(uuid.uuid4()) for _ in requests]
        events: list[Event] = []
        with self.db.write() as session:
            now = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
            tenant = session.execute(
                select(RUNS.c.tenant_id).where(RUNS.c.id == claim.run_id)
            ).scalar_one()
            for approval_id, request in zip(ids, requests, strict=True):
                events.append(self._request(session, claim, tenant, approval_id, request, now))
            events.append(self.runs.append_in(session, claim, "RunWaiting", {"approvals": ids}))
            since = events[-1].at
            self.runs.wait_in(session, claim, since, messages=messages, turns_completed=turns)
        for event in events:
            self.runs.publish(event)
        return ids

    def _request(
        self,
        session: Session,
        claim: Claim,
        tenant: str,
        approval_id: str,
        request: ApprovalRequest,
        now: datetime,
    ) -> Event:
        execution_id = str(uuid.uuid4())
        expires_at = now + self.timeout
        data = {
            "approvalId": approval_id,
            "tool": request.tool,
            "callId": request.call_id,
            "arguments": request.arguments,
            "executionId": execution_id,
            "expiresAt": iso(expires_at),
        }
        event = self.runs.append_in(session, claim, "ApprovalRequested", data)
        session.execute(
            insert(APPROVALS).values(
                id=approval_id,
                tenant_id=tenant,
                run_id=claim.run_id,
                turn=request.turn,
                call_id=request.call_id,
                tool=request.tool,
                arguments=request.arguments,
                args_hash=request.args_hash,
                execution_id=execution_id,
                status=ApprovalStatus.PENDING.value,
                requested_at=now,
                expires_at=expires_at,
            )
        )
        return event

    @rides_out_outages
    def for_call(self, run_id: str, turn: int, call_id: str) -> Approval | None:
        query = select(Approval).where(
            Approval.run_id == run_id, Approval.turn == turn, Approval.call_id == call_id
        )
        with self.db.read() as session:
            return session.scalar(query)

    @rides_out_outages
    def approved_in_chain(
        self, run_ids: Sequence[str], tool: str, args_hash: str
    ) -> Approval | None:
        """An approval a crashed run of the chain got and never used, for the same call."""
        query = (
            select(Approval)
            .where(
                Approval.run_id.in_(list(run_ids)),
                Approval.tool == tool,
                Approval.args_hash == args_hash,
                Approval.status == ApprovalStatus.APPROVED.value,
                Approval.consumed_at.is_(None),
            )
            .order_by(Approval.requested_at)
            .limit(1)
        )
        with self.db.read() as session:
            return session.scalar(query)

    @rides_out_outages
    def pending_turn(self, run_id: str) -> int | None:
        """The ledger turn the run was waiting in, read back when it resumes."""
        query = select(func.max(Approval.turn)).where(Approval.run_id == run_id)
        with self.db.read() as session:
            return session.scalar(query)

    def consume_in(self, session: Session, approval: Approval) -> bool:
        """Use an approval: once, only while approved, only for the arguments it was for."""
        changed = session.execute(
            update(APPROVALS)
            .where(
                APPROVALS.c.id == approval.id,
                APPROVALS.c.status == ApprovalStatus.APPROVED.value,
                APPROVALS.c.consumed_at.is_(None),
                APPROVALS.c.args_hash == approval.args_hash,
            )
            .values(consumed_at=_NOW)
            .returning(APPROVALS.c.id),
            self.db.clock_params(),
        ).scalar_one_or_none()
        return changed is not None

    # -- the person's side ---------------------------------------------------------------

    def decide(
        self,
        tenant_id: str,
        approval_id: str,
        approve: bool,
        comment: str | None,
        decided_by: str | None,
    ) -> Decided:
        status = ApprovalStatus.APPROVED if approve else ApprovalStatus.REJECTED
        guard = (APPROVALS.c.tenant_id == tenant_id, APPROVALS.c.expires_at > _NOW)
        decided = self._decide(approval_id, status, guard, comment, decided_by)
        if decided is not None:
            return decided
        approval = self.get(approval_id, tenant_id)
        if approval is None:
            raise ApprovalNotFound(approval_id)
        if approval.status == ApprovalStatus.PENDING.value:
            raise ApprovalConflict(approval, "the approval expired")
        raise ApprovalConflict(approval, f"the approval is already {approval.status.lower()}")

    def overdue(self, now: datetime, limit: int) -> list[str]:
        query = (
            select(Approval.id)
            .where(
                Approval.status == ApprovalStatus.PENDING.value,
                Approval.expires_at <= now,
            )
            .order_by(Approval.expires_at)
            .limit(limit)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def expire(self, approval_id: str) -> Decided | None:
        guard = (APPROVALS.c.expires_at <= _NOW,)
        return self._decide(approval_id, ApprovalStatus.EXPIRED, guard, None, None)

    def _decide(
        self,
        approval_id: str,
        status: ApprovalStatus,
        guard: Sequence[Any],
        comment: str | None,
        decided_by: str | None,
    ) -> Decided | None:
        """One conditional UPDATE from `Pending`; the run goes back to the queue when its
        last pending approval is decided. None when the approval was not pending."""
        params = self.db.clock_params()
        with self.db.write() as session:
            row = session.execute(
                update(APPROVALS)
                .where(
                    APPROVALS.c.id == approval_id,
                    APPROVALS.c.status == ApprovalStatus.PENDING.value,
                    *guard,
                )
                .values(
                    status=status.value,
                    decided_at=_NOW,
                    decided_by=decided_by,
                    comment=comment,
                )
                .returning(*APPROVALS.c),
                params,
            ).one_or_none()
            if row is None:
                return None
            approval = _detached(row._asdict())
            run = session.execute(
                select(RUNS.c.root_run_id, RUNS.c.waiting_since, RUNS.c.status)
                .where(RUNS.c.id == approval.run_id)
                .with_for_update()  # decisions of one run's approvals take turns
            ).one()
            data = {
                "approvalId": approval.id,
                "tool": approval.tool,
                "outcome": status.value.lower(),
                "decidedBy": decided_by,
                "comment": comment,
            }
            event = self.runs.append_in(
                session, None, "ApprovalDecided", data, run_id=approval.run_id
            )
            events = [event]
            waited = 0
            resumed = False
            if run.status == RunStatus.WAITING.value and not _pending(session, approval.run_id):
                waited = _ms_between(run.waiting_since, event.at)
                resumed = self.runs.requeue_in(session, approval.run_id, waited, event.at)
                if resumed:
                    events.append(
                        self.runs.append_in(
                            session,
                            None,
                            "RunQueued",
                            {"after": "approvals"},
                            run_id=approval.run_id,
                        )
                    )
        for published in events:
            self.runs.publish(published)
        return Decided(approval, resumed, run.root_run_id, waited)

    def cancel_waiting(self, run_id: str) -> bool:
        """Cancel a `Waiting` run at once: its pending approvals first, then the run."""
        with self.db.write() as session:
            ids = session.scalars(
                update(APPROVALS)
                .where(
                    APPROVALS.c.run_id == run_id,
                    APPROVALS.c.status == ApprovalStatus.PENDING.value,
                )
                .values(status=ApprovalStatus.CANCELED.value, decided_at=_NOW)
                .returning(APPROVALS.c.id),
                self.db.clock_params(),
            ).all()
            events = [
                self.runs.append_in(
                    session,
                    None,
                    "ApprovalDecided",
                    {"approvalId": approval_id, "outcome": "canceled"},
                    run_id=run_id,
                )
                for approval_id in ids
            ]
        for event in events:
            self.runs.publish(event)
        error = RunError("canceled", ErrorClass.CANCELLATION, "canceled while waiting for a person")
        return self.runs.close_waiting(run_id, error)

    # -- reads -----------------------------------------------------------------------------

    def get(self, approval_id: str, tenant_id: str | None = None) -> Approval | None:
        with self.db.read() as session:
            approval = session.get(Approval, approval_id)
        if approval is None or (tenant_id is not None and approval.tenant_id != tenant_id):
            return None
        return approval

    def pending_ids(self, run_id: str) -> list[str]:
        query = (
            select(Approval.id)
            .where(Approval.run_id == run_id, Approval.status == ApprovalStatus.PENDING.value)
            .order_by(Approval.requested_at, Approval.id)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def page(
        self,
        tenant_id: str | None,
        *,
        status: str | None,
        run_id: str | None,
        limit: int,
        before: tuple[datetime, str] | None,
    ) -> list[Approval]:
        """Newest first; `before` is the (requested_at, id) of the last row of the prior page.
        A `tenant_id` of None lists every tenant's (operators only, never the web)."""
        query = select(Approval)
        if tenant_id is not None:
            query = query.where(Approval.tenant_id == tenant_id)
        if status:
            query = query.where(Approval.status == status)
        if run_id:
            query = query.where(Approval.run_id == run_id)
        if before is not None:  # a row comparison, so the index seeks to the cursor
            query = query.where(tuple_(Approval.requested_at, Approval.id) < tuple_(*before))
        query = query.order_by(Approval.requested_at.desc(), Approval.id.desc()).limit(limit)
        with self.db.read() as session:
            return list(session.scalars(query))


class Approvals:
    """Decisions and expiry with their effects: the run re-sent, its wait off the budget."""

    def __init__(
        self, store: ApprovalStore, dispatcher: RunDispatcher, budgets: BudgetStore
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.budgets = budgets

    def decide(
        self,
        tenant_id: str,
        approval_id: str,
        approve: bool,
        comment: str | None = None,
        decided_by: str | None = None,
    ) -> Decided:
        decided = self.store.decide(tenant_id, approval_id, approve, comment, decided_by)
        self._resume(decided)
        return decided

    def expire_once(self, now: datetime, limit: int = 500) -> list[Decided]:
        """One expiry pass: every overdue pending approval expires, its run goes on."""
        expired = []
        for approval_id in self.store.overdue(now, limit):
            decided = self.store.expire(approval_id)
            if decided is not None:
                self._resume(decided)
                expired.append(decided)
        return expired

    def _resume(self, decided: Decided) -> None:
        if not decided.resumed:
            return
        try:
            self.budgets.exclude_wait(decided.root_run_id, decided.waited_ms)
        except Exception as exc:  # a lost budget is rebuilt from SQL, which knows the wait
            log.warning(
                "wait of tree %s not excluded from its budget: %s", decided.root_run_id, exc
            )
        try:
            self.dispatcher.send(decided.approval.run_id)
        except EnqueueError as exc:  # the run is Queued: the requeue scan sends it
            log.warning("run %s not sent after its approval: %s", decided.approval.run_id, exc)


def _pending(session: Session, run_id: str) -> int:
    query = select(func.count()).where(
        APPROVALS.c.run_id == run_id, APPROVALS.c.status == ApprovalStatus.PENDING.value
    )
    return int(session.scalar(query) or 0)


def _ms_between(start: datetime | None, end: datetime) -> int:
    return 0 if start is None else max(int((end - start).total_seconds() * 1000), 0)


def _detached(values: dict[str, Any]) -> Approval:
    return Approval(**values)
