"""SQL persistence of workflow runs: checkpoints, human requests, and continuing a chain.

Every write is one transaction with its events: a checkpoint is one fenced insert; a
request puts the run `Waiting`; an answer closes the waiting run and writes the run that
continues it together, so a crash can never leave an answered request without its run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, insert, select, update

from tracon_jobs.db.engine import StatementClock
from tracon_jobs.db.models import Run, WorkflowNode
from tracon_jobs.db.outages import rides_out_outages
from tracon_jobs.limits.tree import MAX_CHAIN, ChainUnreadable
from tracon_jobs.runs.lifecycle import Claim, RunStatus
from tracon_jobs.runs.reconcile import JOB_RESTARTED
from tracon_jobs.runs.store import Event, NewRun, RunStore

NODES = cast(Table, WorkflowNode.__table__)
RUNS = cast(Table, Run.__table__)
_NOW = StatementClock()


@dataclass(frozen=True)
class Recorded:
    """A node a run of the chain finished (or a request a person answered)."""

    node: str
    kind: str
    value: Any
    run_id: str


class RequestConflict(Exception):
    """The run is not waiting for an answer (or another answer won): the caller says 409."""


class ResumeConflict(Exception):
    """The run cannot be resumed (live, waiting, completed, or resumed already): 409."""


class WorkflowStore:
    """Checkpoints and requests of workflow runs, and the runs that continue a chain."""

    def __init__(self, runs: RunStore) -> None:
        self.runs = runs
        self.db = runs.db

    # -- reading a chain ---------------------------------------------------------------------

    @rides_out_outages
    def chain(self, run: Run) -> list[str]:
        """The run and the runs it continues, newest first; all of them or `ChainUnreadable`."""
        ids = [run.id]
        current = run.continued_from_run_id
        with self.db.read() as session:
            while current is not None and len(ids) <= MAX_CHAIN:
                ids.append(current)
                current = session.scalar(
                    select(RUNS.c.continued_from_run_id).where(RUNS.c.id == current)
                )
        if current is not None or len(ids) > MAX_CHAIN:
            raise ChainUnreadable(f"the chain of run {run.id} is longer than {MAX_CHAIN} runs")
        return ids

    @rides_out_outages
    def recorded(self, run_ids: Sequence[str]) -> dict[str, Recorded]:
        """Every finished node and answered request of the chain, by node (newest wins)."""
        order = {run_id: position for position, run_id in enumerate(run_ids)}
        query = select(NODES.c.run_id, NODES.c.node, NODES.c.kind, NODES.c.result).where(
            NODES.c.run_id.in_(list(run_ids)), NODES.c.status.in_(["completed", "answered"])
        )
        with self.db.read() as session:
            rows = session.execute(query).all()
        found: dict[str, Recorded] = {}
        for row in sorted(rows, key=lambda r: order[r.run_id], reverse=True):
            found[row.node] = Recorded(
                row.node, row.kind, (row.result or {}).get("value"), row.run_id
            )
        return found

    @rides_out_outages
    def since_restart(self, run_ids: Sequence[str]) -> list[str]:
        """The runs of the chain (newest first) whose checkpoints a replay answers from: those
        after the newest run whose job attempted the workflow again from its first node."""
        if len(run_ids) < 2:
            return list(run_ids)
        query = select(RUNS.c.id).where(
            RUNS.c.id.in_(list(run_ids[1:])), RUNS.c.error_type == JOB_RESTARTED
        )
        with self.db.read() as session:
            restarted = set(session.scalars(query))
        for position, run_id in enumerate(run_ids):
            if run_id in restarted:
                return list(run_ids[:position])
        return list(run_ids)

    def request_of(self, run_id: str) -> WorkflowNode | None:
        query = select(WorkflowNode).where(
            WorkflowNode.run_id == run_id, WorkflowNode.status == "asked"
        )
        with self.db.read() as session:
            return session.scalar(query)

    # -- the runner's writes ---------------------------------------------------------------

    @rides_out_outages
    def checkpoint(
        self, claim: Claim, node: str, kind: str, value: Any, data: dict[str, Any]
    ) -> None:
        """Commit a finished node's result with its `WorkflowNodeCompleted` event."""
        with self.db.write() as session:
            event = self.runs.append_in(session, claim, "WorkflowNodeCompleted", data)
            session.execute(
                insert(NODES).values(
                    run_id=claim.run_id,
                    node=node,
                    kind=kind,
                    status="completed",
                    result={"value": value},
                    created_at=event.at,
                )
            )
        self.runs.publish(event)

    @rides_out_outages
    def ask(self, claim: Claim, node: str, payload: Any) -> None:
        """Record a question for a person and put the run `Waiting`, in one transaction."""
        events: list[Event] = []
        with self.db.write() as session:
            data = {"node": node, "payload": payload}
            events.append(self.runs.append_in(session, claim, "WorkflowRequestCreated", data))
            events.append(self.runs.append_in(session, claim, "RunWaiting", {"request": node}))
            session.execute(
                insert(NODES).values(
                    run_id=claim.run_id,
                    node=node,
                    kind="ask",
                    status="asked",
                    payload={"value": payload},
                    created_at=events[0].at,
                )
            )
            self.runs.wait_in(session, claim, events[-1].at)
        for event in events:
            self.runs.publish(event)

    # -- continuing a chain ------------------------------------------------------------------

    def answer(self, run: Run, answer: Any, new: NewRun) -> Run:
        """Answer the waiting run's request, close it, and write the run that continues it."""
        events: list[Event] = []
        with self.db.write() as session:
            now = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
            answered = session.execute(
                update(NODES)
                .where(NODES.c.run_id == run.id, NODES.c.status == "asked")
                .values(status="answered", result={"value": answer}, answered_at=now)
                .returning(NODES.c.node)
            ).scalar_one_or_none()
            if answered is None:
                raise RequestConflict(f"run '{run.id}' is not waiting for an answer")
            waited = self.runs.complete_waiting_in(session, run.id, now, {"continuedIn": new.id})
            if waited is None:
                raise RequestConflict(f"run '{run.id}' is no longer waiting")
            data = {"node": answered, "continuationRunId": new.id}
            events.append(self.runs.append_in(session, None, "RunContinued", data, run_id=run.id))
            closed = {"status": "Completed", "output": {"continuedIn": new.id}}
            events.append(self.runs.append_in(session, None, "RunCompleted", closed, run_id=run.id))
            created, queued = self.runs.create_in(session, new)
            events.append(queued)
        for event in events:
            self.runs.publish(event)
        return created

    def resume(self, run: Run, new: NewRun) -> Run:
        """Start the run that resumes a failed workflow run, at most once per failed run."""
        events: list[Event] = []
        with self.db.write() as session:
            status = session.execute(
                select(RUNS.c.status).where(RUNS.c.id == run.id).with_for_update()
            ).scalar_one()
            if status != RunStatus.FAILED.value:
                raise ResumeConflict(f"run '{run.id}' is {status}; only a Failed run is resumed")
            already = session.scalar(
                select(RUNS.c.id).where(RUNS.c.continued_from_run_id == run.id).limit(1)
            )
            if already is not None:
                raise ResumeConflict(f"run '{run.id}' was resumed already by run '{already}'")
            data = {"continuationRunId": new.id}
            events.append(self.runs.append_in(session, None, "RunContinued", data, run_id=run.id))
            created, queued = self.runs.create_in(session, new)
            events.append(queued)
        for event in events:
            self.runs.publish(event)
        return created
