"""Runs waiting for a person: `Running` -> `Waiting` in the transaction that records what they
wait for, and each exit from it (queued again after the last approval, completed by the answer
that continues its chain, canceled)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tracon_jobs.errors import RunTakenAway
from tracon_jobs.runs.lifecycle import (
    AnyClaim,
    Claim,
    RunError,
    RunStatus,
)
from tracon_jobs.runs.store.statements import (
    _CLOSE_ANSWERED,
    _NOW,
    _OWNED,
    RUNS,
    _close_answered_many,
    _insert_events,
    _numbered,
)
from tracon_jobs.runs.store.values import Event, iso
from tracon_jobs.runs.store.writes import RunWrites


@dataclass(frozen=True)
class Answered:
    """A waiting run answered at its node `node`: it completes, its chain going on in the run
    `continuation_id`. Its output and its two closing events follow from that alone, so a
    batch of them closes in one statement (every run the same events)."""

    node: str
    continuation_id: str

    @property
    def output(self) -> dict[str, Any]:
        return {"continuedIn": self.continuation_id}

    def events(self) -> list[tuple[str, dict[str, Any]]]:
        return [
            ("RunContinued", {"node": self.node, "continuationRunId": self.continuation_id}),
            ("RunCompleted", {"status": "Completed", "output": self.output}),
        ]


_ANSWERED_EVENTS = 2
"""How many closing events an `Answered` run has (`Answered.events`)."""


class WaitingRuns(RunWrites):
    """Every way into and out of `Waiting`: a run that waits for a person holds no worker,
    owner or heartbeat, and only a decision, an answer, an expiry or a cancel moves it on."""

    def wait_in(self, session: Session, claim: Claim, since: datetime, **saved: Any) -> None:
        """`Running` -> `Waiting` inside the caller's transaction: the run lets go of its
        owner and heartbeat, remembers when it started waiting, and saves `saved` (its
        conversation) for whoever continues it; `RunTakenAway` when it is no longer ours."""
        self._let_go_in(session, claim, RunStatus.WAITING, waiting_since=since, **saved)

    def _let_go_in(self, session: Session, claim: Claim, status: RunStatus, **values: Any) -> None:
        """`Running` -> `status` by the run's own hand, fenced: it lets go of its owner and
        heartbeat and sets `values`; `RunTakenAway` when it is no longer ours."""
        self._ending[claim.run_id] = claim.fence
        changed = session.execute(
            update(RUNS)
            .where(RUNS.c.id == claim.run_id, *_OWNED)
            .values(status=status.value, owner=None, heartbeat_at=None, **values)
            .returning(RUNS.c.id),
            {"p_id": claim.run_id, "p_fence": claim.fence},
        ).scalar_one_or_none()
        if changed is None:
            raise RunTakenAway(f"run {claim.run_id} was taken away")

    def park(
        self,
        claim: AnyClaim,
        seconds: float,
        reason: str,
        messages: list[dict[str, Any]],
        turns: int,
    ) -> Event:
        """`Running` -> `Queued` until `seconds` from now, with its conversation saved, and
        `RunParked` (reason, until) in the same fenced transaction: the run lets go of its
        owner and heartbeat (a parked run is no orphan). Whoever parks it sends it again at
        that time; the requeue scan counts from it (`enqueued_at` is set to it), so a worker
        that died meanwhile loses it for at most `Runs.RequeueAfter` more."""
        claim = self._settle(claim)
        with self.db.write() as session:
            now = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
            until = now + timedelta(seconds=seconds)
            data = {"reason": reason, "until": iso(until), "turn": turns}
            event = self.append_in(session, claim, "RunParked", data)
            saved = {"messages": messages, "turns_completed": turns}
            self._let_go_in(session, claim, RunStatus.QUEUED, enqueued_at=until, **saved)
        self.publish(event)
        return event

    def requeue_in(self, session: Session, run_id: str, waited_ms: int, now: datetime) -> bool:
        """`Waiting` -> `Queued` inside the caller's transaction (its last approval decided),
        counting `waited_ms` as time waited; False when the run no longer waits. It is sent
        right after the commit, and the requeue scan covers a lost send."""
        changed = session.execute(
            update(RUNS)
            .where(RUNS.c.id == run_id, RUNS.c.status == RunStatus.WAITING.value)
            .values(
                status=RunStatus.QUEUED.value,
                enqueued_at=now,
                waiting_since=None,
                waited_ms=RUNS.c.waited_ms + waited_ms,
            )
            .returning(RUNS.c.id)
        ).scalar_one_or_none()
        return changed is not None

    def close_answered_in(
        self, session: Session, run_id: str, now: datetime, answered: Answered
    ) -> list[Event] | None:
        """`Waiting` -> `Completed` inside the caller's transaction, `answered`: a workflow
        run whose chain goes on in a new run. One update (its status, the time it waited, the
        events' seqs) and one insert of its closing events; None when it no longer waits
        (another answer, a cancel, came first)."""
        params = {
            "p_id": run_id,
            "p_output": answered.output,
            "p_ended_at": now,
            "p_count": _ANSWERED_EVENTS,
            **self.db.clock_params(),
        }
        row = session.execute(_CLOSE_ANSWERED, params).one_or_none()
        if row is None:
            return None
        events = answered.events()
        return self._insert_numbered(session, run_id, row, events, self._messages(run_id, events))

    def close_answered_many_in(
        self,
        session: Session,
        now: datetime,
        answered: Mapping[str, Answered],
        queued: list[Event],
    ) -> list[Event] | None:
        """`close_answered_in` of several runs (`answered` by run id) in one update, and
        their closing events with `queued` (already numbered: the `RunQueued` of the runs that
        continue them) in one insert; None, having written nothing, when one of them no longer
        waits: the caller rolls back and answers them one at a time."""
        ids = list(answered)
        params: dict[str, Any] = {"p_ended_at": now, "p_count": _ANSWERED_EVENTS}
        for i, run_id in enumerate(ids):
            params |= {f"p_id_{i}": run_id, f"p_output_{i}": answered[run_id].output}
        params |= self.db.clock_params()
        rows = session.execute(_close_answered_many(len(ids)), params).all()
        if len(rows) != len(ids):
            return None
        written: list[Event] = []
        messages = []
        for run_id, last, at in rows:
            events = answered[str(run_id)].events()
            numbered = _numbered(str(run_id), last, at, events)
            written += numbered
            messages.append((numbered, self._messages(str(run_id), events)))
        _insert_events(session, [*written, *queued])
        for numbered, of_run in messages:
            if of_run:
                self._write_messages(session, numbered, of_run)
        return written

    def close_waiting(self, run_id: str, error: RunError) -> bool:
        """Close a run that waits for a person; it holds no worker, so nothing else stops."""
        closed = self._close(run_id, RunStatus.WAITING, None, RunStatus.CANCELED, error=error)
        return closed is not None
