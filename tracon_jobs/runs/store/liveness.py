"""The run store's liveness: one bulk heartbeat per process, cancel requests, runs given back to
the queue, and the orphans reconciliation closes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    and_,
    or_,
    select,
    update,
)

from tracon_jobs.db.models import Run
from tracon_jobs.db.outages import rides_out_outages
from tracon_jobs.runs.lifecycle import (
    AnyClaim,
    ErrorClass,
    RunError,
    RunStatus,
)
from tracon_jobs.runs.store.statements import (
    _NOW,
    _OWNED,
    EVENTS,
    LIVE,
    RUNS,
)
from tracon_jobs.runs.store.values import Event
from tracon_jobs.runs.store.writes import RunWrites

MODEL_CALL_EVENTS = ("ModelCallStarted", "ModelCallCompleted", "ModelCallFailed")


class RunLiveness(RunWrites):
    """Heartbeats, cancel requests, the runs given back, and the reconciliation of silent runs."""

    def heartbeat(self, owned: dict[str, int]) -> set[str]:
        """One bulk heartbeat for the runs this process executes (run id -> fence).

        Returns the ids still owned: a run missing from the answer was closed or claimed
        by someone else, and its executor must stop. A run whose executor is making its last
        change is still its own: that change is fenced, and tells it if it is too late.

        A claim is ours in either of its two states, judged on the row itself, never on
        this process's memory of which state the claim is in: read and not made yet (the
        row still waits `Queued` with the fence read; the claim's next write makes it) or
        made (the row is `Running`, or `Queued` again, with the fence; its heartbeat is
        written). A claim only ever goes from the first state to the second, so asking for
        the first and then for the second finds every claim of ours in one of them, however
        the claim's write falls between the two; asked the other way round (or split by
        which state this process believes), a claim made in between matches neither, and a
        live executor is told its run was taken away.
        """
        # a claim that another process made first is not ours, whatever its fence number
        owned = {
            run_id: fence
            for run_id, fence in owned.items()
            if (taken := self._taken.get(run_id)) is None or taken.fence != fence
        }
        if not owned:
            return set()
        read = or_(
            *(and_(RUNS.c.id == rid, RUNS.c.fence == fence - 1) for rid, fence in owned.items())
        )
        with self.db.read() as session:
            held = set(
                session.scalars(
                    select(RUNS.c.id).where(read, RUNS.c.status == RunStatus.QUEUED.value)
                )
            )
        made = {rid: fence for rid, fence in owned.items() if rid not in held}
        if made:
            held |= self._beat(made)
        return held | {rid for rid, fence in owned.items() if self._ending.get(rid) == fence}

    def _beat(self, made: dict[str, int]) -> set[str]:
        """Write the heartbeat of claims made (run id -> fence); the ids it found."""
        still_ours = or_(
            *(and_(RUNS.c.id == rid, RUNS.c.fence == fence) for rid, fence in made.items())
        )
        statement = (
            update(RUNS)
            .where(still_ours, RUNS.c.status.in_([RunStatus.RUNNING.value, RunStatus.QUEUED.value]))
            .values(heartbeat_at=_NOW)
            .returning(RUNS.c.id)
        )
        with self.db.write() as session:
            return set(session.execute(statement, self.db.clock_params()).scalars())

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

    @rides_out_outages
    def still_owned(self, claim: AnyClaim) -> str | None:
        """Why the claim may no longer start work (`taken_away`, `canceled`), or None: read
        right before a tool body starts, so a paused owner never starts one late."""
        claim = self._settle(claim)  # a claim not made yet is made here, or RunTakenAway
        query = select(RUNS.c.status, RUNS.c.fence, RUNS.c.cancel_requested_at).where(
            RUNS.c.id == claim.run_id
        )
        with self.db.read() as session:
            row = session.execute(query).one_or_none()
        if row is None or row.fence != claim.fence or row.status != RunStatus.RUNNING.value:
            return "taken_away"
        return "canceled" if row.cancel_requested_at is not None else None

    @rides_out_outages
    def release(self, claim: AnyClaim, reason: str) -> bool:
        """Give a claimed run back to the queue untouched, for a worker that can run it.

        Its send time is kept, so the requeue scan re-sends it once `Runs.RequeueAfter`
        has passed since then; nothing of the run itself changed.
        """
        claim = self._settle(claim)
        with self.db.write() as session:
            event = self.append_in(session, claim, "RunReleased", {"reason": reason})
            session.execute(
                update(RUNS)
                .where(RUNS.c.id == claim.run_id, *_OWNED)
                .values(status=RunStatus.QUEUED.value, owner=None, heartbeat_at=None),
                {"p_fence": claim.fence},
            )
        self.publish(event)
        return True

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
        """Close a silent run, unless it heartbeated or changed hands since it was read.

        A model call its process was making when it went silent ends first, in the same
        write (`ModelCallFailed`, kind `interrupted`): no follower sees it go on. That
        close also needs the run to have written no event since it was read."""
        guard = [RUNS.c.fence == run.fence, RUNS.c.heartbeat_at < silent_since]
        cut = self._interrupted_call(run)
        if cut is not None:
            guard.append(RUNS.c.event_seq == run.event_seq)
        return self._close(
            run.id,
            RunStatus(run.status),
            None,
            status,
            error=error,
            extra_guard=guard,
            before=[] if cut is None else [("ModelCallFailed", cut)],
        )

    def _interrupted_call(self, run: Run) -> dict[str, Any] | None:
        """The end of the run's model call still open (its `ModelCallStarted` is its last
        model-call event, up to the run's `event_seq` as read), or None."""
        query = (
            select(EVENTS.c.type, EVENTS.c.data)
            .where(
                EVENTS.c.run_id == run.id,
                EVENTS.c.seq <= run.event_seq,
                EVENTS.c.type.in_(MODEL_CALL_EVENTS),
            )
            .order_by(EVENTS.c.seq.desc())
            .limit(1)
        )
        with self.db.read() as session:
            last = session.execute(query).one_or_none()
        if last is None or last.type != "ModelCallStarted":
            return None
        return {
            "provider": last.data.get("provider"),
            "model": last.data.get("model"),
            "status": None,
            "kind": "interrupted",
            "message": "the call's process stopped before it answered",
            "counted": False,
        }
