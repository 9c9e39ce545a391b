"""SQL persistence of workflow runs: checkpoints, waits, and continuing a chain.

Every write is one transaction with its events: a checkpoint is one fenced insert; a
wait (a question for a person, a timer, an event) puts the run `Waiting`; an answer (the
person's, the timer's firing, the event) closes the waiting run and writes the run that
continues it together, so a crash can never leave an answered wait without its run, and
two answers racing (a delivery and a timeout, two beats) leave one: the node moves from
`asked` to `answered` once.

An event delivered before its workflow waits for it is kept in `workflow_events` (with
`Workflows.BufferEvents`), keyed by the chain's first run; a wait takes the oldest of its
name, once. Both sides look at the other after their own commit (`pump`): whichever commits
second finds the first, so an event racing its wait is never lost.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, cast

from sqlalchemy import Select, Table, bindparam, case, func, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Update

from tracon_jobs.db.engine import StatementClock
from tracon_jobs.db.models import Run, WorkflowEvent, WorkflowNode
from tracon_jobs.db.outages import rides_out_outages
from tracon_jobs.errors import RunTakenAway
from tracon_jobs.limits.tree import MAX_CHAIN, ChainUnreadable, chain_cte
from tracon_jobs.runs.lifecycle import Claim, RunStatus
from tracon_jobs.runs.reconcile import JOB_RESTARTED
from tracon_jobs.runs.store import Event, NewRun, RunStore, iso
from tracon_jobs.runs.store.waiting import Answered
from tracon_jobs.runs.store.writes import Tries, events_written_once

NODES = cast(Table, WorkflowNode.__table__)
EVENTS = cast(Table, WorkflowEvent.__table__)
WAITS = ("ask", "timer", "event", "fanout")
"""The kinds of node a run waits on; their answers are the chain's input, replayed always
(a fan-out's answer holds every branch's outcome: the children ran once, in their runs)."""
TIMED = ("timer", "event")
"""The kinds of wait the timer scan answers at their time (`due`)."""
FANOUT = "fanout"
BRANCH = "branch"
"""The kind of a fan-out's function branch's outcome (`<node>/<index>`), written always."""
FANOUT_RECHECK = timedelta(seconds=5)
"""How long a fan-out waits before the timer scan looks at its branches (then again each
time this passes): a branch ended by a cancel or a recovery tells no worker; the worker
that finishes a child answers at once (`WorkflowResumes.child_ended`)."""
PATCH = "patch"
"""The kind of node that records a `ctx.patched` decision; replayed always, like answers."""
RUNS = cast(Table, Run.__table__)
_NOW = StatementClock()


@dataclass(frozen=True)
class Recorded:
    """A node a run of the chain finished (or a request a person answered)."""

    node: str
    kind: str
    value: Any
    run_id: str
    timed_out: bool = False  # an event wait whose timeout came first
    version: str | None = None  # the workflow version of the run that wrote it (None: unknown)


@dataclass(frozen=True)
class Due:
    """A waiting node whose time has come: a timer, or an event wait's timeout."""

    run_id: str
    node: str
    kind: str
    at: datetime | None = None  # its time (UTC, naive, as the database keeps it)


@dataclass(frozen=True)
class FanOut:
    """A fan-out node a run waits on (or runs): its branches and what each came to."""

    run_id: str
    node: str
    policy: str
    branches: list[dict[str, Any]]  # `fanout.layout`
    outcomes: list[dict[str, Any] | None]  # per branch; None while it runs
    live: list[str]  # the children (the newest runs of their chains) still running


@dataclass(frozen=True)
class Started:
    """A fan-out an earlier run of the chain started (its process died before the answer):
    its children and the function branches it finished, reused by the run that resumes."""

    branches: list[dict[str, Any]]
    steps: dict[int, dict[str, Any]]


class RequestConflict(Exception):
    """The run is not waiting for an answer (or another answer won): the caller says 409."""


@dataclass(frozen=True)
class Lineage:
    """A run's chain, newest first (the run, then the run it continues, and so on), and the
    runs of it whose checkpoints a replay answers from: those after the newest run whose job
    attempted the workflow again from its first node."""

    ids: list[str]
    since_restart: list[str]


def _since_restart(ids: list[str], restarted: set[str]) -> list[str]:
    for position, run_id in enumerate(ids):
        if run_id in restarted:
            return ids[:position]
    return ids


def _lineage() -> Select[Any]:
    """From `:first` (the run a run continues), each run of the chain in order, up to the
    longest chain a run may continue, with what it continues and how it ended."""
    chain = chain_cte("first", 2, "error_type")  # the run itself is the first of its chain
    return select(chain.c.id, chain.c.next, chain.c.error_type).order_by(chain.c.n)


_LINEAGE: Final = _lineage()


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
        return self.lineage(run).ids

    @rides_out_outages
    def lineage(self, run: Run) -> Lineage:
        """The chain (`chain`) and which of its runs a replay answers from, in one statement
        (`_LINEAGE`), none for a run that continues nothing."""
        ids, restarted = [run.id], set()
        following = run.continued_from_run_id
        if following is not None:
            with self.db.read() as session:
                rows = session.execute(_LINEAGE, {"first": following}).all()
            ids += [row.id for row in rows]
            restarted = {row.id for row in rows if row.error_type == JOB_RESTARTED}
            following = rows[-1].next if rows else following
            if following is not None and len(ids) <= MAX_CHAIN:
                ids.append(following)  # a run it names that is gone: the chain ends there
        if len(ids) > MAX_CHAIN:
            raise ChainUnreadable(f"the chain of run {run.id} is longer than {MAX_CHAIN} runs")
        return Lineage(ids, _since_restart(ids, restarted))

    @rides_out_outages
    def recorded(self, run_ids: Sequence[str]) -> dict[str, Recorded]:
        """Every finished node and answered request of the chain, by node (newest wins)."""
        order = {run_id: position for position, run_id in enumerate(run_ids)}
        query = (
            select(
                NODES.c.run_id,
                NODES.c.node,
                NODES.c.kind,
                NODES.c.result,
                RUNS.c.workflow_version,
            )
            .join(RUNS, RUNS.c.id == NODES.c.run_id)
            .where(NODES.c.run_id.in_(list(run_ids)), NODES.c.status.in_(["completed", "answered"]))
        )
        with self.db.read() as session:
            rows = session.execute(query).all()
        found: dict[str, Recorded] = {}
        for row in sorted(rows, key=lambda r: order[r.run_id], reverse=True):
            result = row.result or {}
            found[row.node] = Recorded(
                row.node,
                row.kind,
                result.get("value"),
                row.run_id,
                bool(result.get("timedOut")),
                row.workflow_version,
            )
        return found

    def request_of(self, run_id: str) -> WorkflowNode | None:
        query = select(WorkflowNode).where(
            WorkflowNode.run_id == run_id, WorkflowNode.status == "asked"
        )
        with self.db.read() as session:
            return session.scalar(query)

    # -- the runner's writes ---------------------------------------------------------------

    @rides_out_outages
    def record_version(self, claim: Claim, version: str) -> None:
        """Record on the claimed run the workflow version that executes it (the process that
        created it may have run other code); `RunTakenAway` when the claim is gone."""
        with self.db.write() as session:
            done = session.execute(
                update(RUNS)
                .where(
                    RUNS.c.id == claim.run_id,
                    RUNS.c.fence == claim.fence,
                    RUNS.c.status == RunStatus.RUNNING.value,
                )
                .values(workflow_version=version)
                .returning(RUNS.c.id)
            ).scalar_one_or_none()
        if done is None:
            raise RunTakenAway(f"run {claim.run_id} is no longer owned by fence {claim.fence}")

    @events_written_once
    def checkpoint(
        self,
        claim: Claim,
        node: str,
        kind: str,
        value: Any,
        data: dict[str, Any],
        event_type: str = "WorkflowNodeCompleted",
    ) -> None:
        """Commit a finished node's result (or a `ctx.patched` decision) with its event."""
        with self.db.write() as session:
            event = self.runs.append_in(session, claim, event_type, data)
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

    @events_written_once
    def ask(self, claim: Claim, node: str, payload: Any) -> None:
        """Record a question for a person and put the run `Waiting`, in one transaction."""
        data = {"node": node, "payload": payload}
        self._wait(claim, node, "ask", {"value": payload}, None, "WorkflowRequestCreated", data)

    @events_written_once
    def sleep(self, claim: Claim, node: str, until: datetime | timedelta) -> None:
        """Put the run `Waiting` until `until` (a time in UTC, or a delay from the database's
        now): the timer scan continues it then (`due`)."""
        self._wait(claim, node, "timer", None, until, "WorkflowTimerStarted", {"node": node})

    @events_written_once
    def await_event(
        self, claim: Claim, node: str, name: str, timeout: timedelta | None, chain: str
    ) -> None:
        """Put the run `Waiting` for the event `name` kept for `chain` (its timeout, if any,
        fires as the timer scan's `due`)."""
        data = {"node": node, "event": name}
        payload = {"event": name, "chain": chain}
        self._wait(claim, node, "event", payload, timeout, "WorkflowEventAwaited", data)

    def _wait(
        self,
        claim: Claim,
        node: str,
        kind: str,
        payload: dict[str, Any] | None,
        until: datetime | timedelta | None,
        type_: str,
        data: dict[str, Any],
    ) -> None:
        events: list[Event] = []
        with self.db.write() as session:
            now = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
            due = now + until if isinstance(until, timedelta) else _naive_utc(until)
            if due is not None:
                data = {**data, "until": iso(due)}
            events.append(self.runs.append_in(session, claim, type_, data))
            waiting = {"request": node, "reason": kind}
            events.append(self.runs.append_in(session, claim, "RunWaiting", waiting))
            session.execute(
                insert(NODES).values(
                    run_id=claim.run_id,
                    node=node,
                    kind=kind,
                    status="asked",
                    payload=payload,
                    created_at=events[0].at,
                    due_at=due,
                )
            )
            self.runs.wait_in(session, claim, events[-1].at)
        for event in events:
            self.runs.publish(event)

    def take_event(self, claim: Claim, node: str, chain_id: str, name: str) -> Recorded | None:
        """The oldest event `name` delivered to the chain before it waited, taken once and
        recorded as `node`'s answer (one fenced transaction); None when none is kept. A try
        whose commit landed though its caller saw it fail is not made again: its answer is
        the node's row (`RunWrites.retried`)."""
        tries = Tries()

        def once() -> Recorded | None:
            with self.runs.recording(tries):
                return self._take_event(claim, node, chain_id, name)

        outcome = self.runs.retried("take_event", once, tries)
        if isinstance(outcome, Event):  # the landed try's event: the answer it recorded
            taken = self.recorded([claim.run_id])[node]
            return Recorded(node, "event", taken.value, claim.run_id)
        return cast(Recorded | None, outcome)

    def _take_event(self, claim: Claim, node: str, chain_id: str, name: str) -> Recorded | None:
        with self.db.write() as session:
            now = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
            value = _take_buffered(session, chain_id, name, claim.run_id, now)
            if value is None:
                return None
            data = {"node": node, "event": name, "buffered": True}
            event = self.runs.append_in(session, claim, "WorkflowEventReceived", data)
            session.execute(
                insert(NODES).values(
                    run_id=claim.run_id,
                    node=node,
                    kind="event",
                    status="answered",
                    payload={"event": name},
                    result={"value": value[0]},
                    created_at=event.at,
                    answered_at=now,
                )
            )
        self.runs.publish(event)
        return Recorded(node, "event", value[0], claim.run_id)

    @rides_out_outages
    def keep_event(self, tenant_id: str, chain_id: str, name: str, payload: Any) -> int:
        """Keep an event for the chain's `ctx.wait_for(name)`; its id."""
        with self.db.write() as session:
            now = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
            return int(
                session.execute(
                    insert(EVENTS)
                    .values(
                        tenant_id=tenant_id,
                        chain_id=chain_id,
                        name=name,
                        payload={"value": payload},
                        created_at=now,
                    )
                    .returning(EVENTS.c.id)
                ).scalar_one()
            )

    def kept_events(self, chain_id: str, name: str | None = None) -> int:
        """How many events the chain was sent that no wait has taken yet."""
        query = select(func.count()).where(
            EVENTS.c.chain_id == chain_id, EVENTS.c.consumed_at.is_(None)
        )
        if name is not None:
            query = query.where(EVENTS.c.name == name)
        with self.db.read() as session:
            return int(session.execute(query).scalar_one())

    # -- fan-out ----------------------------------------------------------------------------

    @rides_out_outages
    def start_fanout(
        self,
        claim: Claim,
        node: str,
        policy: str,
        branches: list[dict[str, Any]],
        children: Sequence[NewRun],
        steps: dict[int, dict[str, Any]],
    ) -> list[Run]:
        """Record the fan-out node `node` (running: `asked`) with its child runs, and the
        function branches `steps` an earlier run of the chain finished, in one fenced
        transaction; the children, `Queued`, for the caller to send."""
        events: list[Event] = []
        with self.db.write() as session:
            data = {"node": node, "onFailure": policy, "branches": branches}
            started = self.runs.append_in(session, claim, "WorkflowFanOutStarted", data)
            events.append(started)
            created: list[Run] = []
            for new in children:
                child, queued = self.runs.create_in(session, new)
                created.append(child)
                events.append(queued)
            payload = {"onFailure": policy, "branches": branches}
            session.execute(
                insert(NODES).values(
                    run_id=claim.run_id,
                    node=node,
                    kind=FANOUT,
                    status="asked",
                    payload=payload,
                    created_at=started.at,
                )
            )
            for index, outcome in steps.items():
                session.execute(_branch_row(claim.run_id, node, index, outcome, started.at))
        for event in events:
            self.runs.publish(event)
        return created

    @events_written_once
    def branch_done(
        self, claim: Claim, node: str, index: int, outcome: dict[str, Any], data: dict[str, Any]
    ) -> None:
        """Commit a function branch's outcome (`fanout.succeeded`/`failed`) with its event."""
        type_ = "WorkflowNodeCompleted" if outcome.get("ok") else "WorkflowNodeFailed"
        with self.db.write() as session:
            event = self.runs.append_in(session, claim, type_, data)
            session.execute(_branch_row(claim.run_id, node, index, outcome, event.at))
        self.runs.publish(event)

    @events_written_once
    def wait_fanout(self, claim: Claim, node: str) -> None:
        """Put the run `Waiting` for the branches of its fan-out `node` (which it started)."""
        with self.db.write() as session:
            now = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
            waiting = {"request": node, "reason": FANOUT}
            event = self.runs.append_in(session, claim, "RunWaiting", waiting)
            session.execute(
                update(NODES)
                .where(NODES.c.run_id == claim.run_id, NODES.c.node == node, NODES.c.kind == FANOUT)
                .values(due_at=now + FANOUT_RECHECK)
            )
            self.runs.wait_in(session, claim, event.at)
        self.runs.publish(event)

    @rides_out_outages
    def started_fanout(self, run_ids: Sequence[str], node: str) -> Started | None:
        """The fan-out `node` as the newest of `run_ids` that started it left it (None when
        none did): reused, its children are not started twice."""
        order = {run_id: position for position, run_id in enumerate(run_ids)}
        with self.db.read() as session:
            rows = session.execute(
                select(NODES.c.run_id, NODES.c.payload).where(
                    NODES.c.run_id.in_(list(run_ids)), NODES.c.node == node, NODES.c.kind == FANOUT
                )
            ).all()
            if not rows:
                return None
            newest = min(rows, key=lambda row: order[row.run_id])
            steps = _branch_outcomes(session, newest.run_id, node)
        return Started(list((newest.payload or {}).get("branches") or []), steps)

    @rides_out_outages
    def fanout_of(self, run_id: str) -> FanOut | None:
        """The fan-out the run waits on (or runs), with its branches' outcomes so far; None
        when it has none open."""
        with self.db.read() as session:
            row = session.execute(
                select(NODES.c.node, NODES.c.payload).where(
                    NODES.c.run_id == run_id, NODES.c.kind == FANOUT, NODES.c.status == "asked"
                )
            ).first()
            if row is None:
                return None
            payload = row.payload or {}
            branches = list(payload.get("branches") or [])
            steps = _branch_outcomes(session, run_id, row.node)
            children = [str(b["runId"]) for b in branches if b.get("runId")]
            ends = _newest_of(session, children)
        outcomes: list[dict[str, Any] | None] = []
        live: list[str] = []
        for index, branch in enumerate(branches):
            if not branch.get("runId"):
                found = steps.get(index)
                outcomes.append(None if found is None else {**found, "name": branch["name"]})
                continue
            newest = ends[str(branch["runId"])]
            outcome = _child_outcome(branch, newest)
            if outcome is None:
                live.append(str(newest.id))
            outcomes.append(outcome)
        policy = str(payload.get("onFailure") or "fail_fast")
        return FanOut(run_id, row.node, policy, branches, outcomes, live)

    @rides_out_outages
    def failed_children(self, run_ids: Sequence[str]) -> set[str]:
        """Which of these child runs ended (the newest run of each one's chain) other than
        `Completed`: a fan-out resumed after them starts those branches again."""
        with self.db.read() as session:
            newest = _newest_of(session, run_ids)
        return {
            first
            for first, run in newest.items()
            if RunStatus(run.status).is_terminal and run.status != RunStatus.COMPLETED.value
        }

    @rides_out_outages
    def newest(self, run_id: str) -> Run | None:
        """The newest run of the chain `run_id` belongs to, from it on (a continuation, a
        resume, a job's next attempt); None when `run_id` is no run."""
        with self.db.read() as session:
            return _newest_of(session, [run_id]).get(run_id)

    @rides_out_outages
    def fanouts_due(self, now: datetime, limit: int) -> list[tuple[str, str]]:
        """(run, node) of the fan-outs of `Waiting` runs whose look is due (`FANOUT_RECHECK`),
        each then put off by that much: the scan looks again later if it is not over."""
        query = (
            select(NODES.c.run_id, NODES.c.node)
            .join(RUNS, RUNS.c.id == NODES.c.run_id)
            .where(
                NODES.c.status == "asked",
                NODES.c.due_at <= now,
                NODES.c.kind == FANOUT,
                RUNS.c.status == RunStatus.WAITING.value,
            )
            .order_by(NODES.c.due_at)
            .limit(limit)
        )
        with self.db.write() as session:
            found = [(str(row.run_id), str(row.node)) for row in session.execute(query)]
            for run_id, node in found:
                session.execute(
                    update(NODES)
                    .where(NODES.c.run_id == run_id, NODES.c.node == node)
                    .values(due_at=now + FANOUT_RECHECK)
                )
        return found

    @rides_out_outages
    def due(self, now: datetime, limit: int) -> list[Due]:
        """Waiting nodes whose time came (timers, event timeouts) of runs still `Waiting`,
        the earliest first."""
        query = (
            select(NODES.c.run_id, NODES.c.node, NODES.c.kind, NODES.c.due_at)
            .join(RUNS, RUNS.c.id == NODES.c.run_id)
            .where(
                NODES.c.status == "asked",
                NODES.c.due_at <= now,
                NODES.c.kind.in_(TIMED),
                RUNS.c.status == RunStatus.WAITING.value,
            )
            .order_by(NODES.c.due_at)
            .limit(limit)
        )
        with self.db.read() as session:
            return [
                Due(row.run_id, row.node, row.kind, row.due_at) for row in session.execute(query)
            ]

    @rides_out_outages
    def stranded(self, before: datetime, limit: int) -> list[str]:
        """Runs `Waiting` (since before `before`) for an event their chain was sent and keeps.

        Each side of a wait and its event looks at the other after its own commit, so one of
        them always finds the other; but a worker that dies between committing the wait and
        that look leaves an event kept before the wait with nobody to find it. The timer
        scan answers these (`WorkflowResumes.give_kept_event`)."""
        query = (
            select(NODES.c.run_id)
            .join(RUNS, RUNS.c.id == NODES.c.run_id)
            .join(
                EVENTS,
                (EVENTS.c.chain_id == NODES.c.payload["chain"].as_string())
                & (EVENTS.c.name == NODES.c.payload["event"].as_string())
                & EVENTS.c.consumed_at.is_(None),
            )
            .where(
                NODES.c.status == "asked",
                NODES.c.kind == "event",
                NODES.c.created_at < before,
                RUNS.c.status == RunStatus.WAITING.value,
            )
            .distinct()
            .limit(limit)
        )
        with self.db.read() as session:
            return [str(run_id) for run_id in session.execute(query).scalars()]

    # -- continuing a chain ------------------------------------------------------------------

    def answer(
        self,
        run: Run,
        answer: Any,
        new: NewRun,
        *,
        kind: str = "ask",
        node: str | None = None,
        timed_out: bool = False,
        buffered: tuple[str, str] | None = None,
    ) -> Run:
        """Answer what the waiting run waits on (a `kind` node; `node` when named), close it,
        and write the run that continues it. `timed_out`: an event wait's timeout answers
        it; `buffered` (chain id, name): the answer is the oldest event kept for the chain
        under that name, taken in the same transaction (`RequestConflict` when none is)."""
        with self.db.write() as session:
            if buffered is not None:
                clock = session.execute(select(_NOW), self.db.clock_params()).scalar_one()
                taken = _take_buffered(session, *buffered, new.id, clock)
                if taken is None:
                    raise RequestConflict(f"no event '{buffered[1]}' is kept for run '{run.id}'")
                answer = taken[0]
            created, events = self._answer_in(session, run, answer, new, kind, node, timed_out)
        self.runs.publish_all(events)
        return created

    def answer_many(
        self, answers: Sequence[tuple[Run, Any, NewRun]]
    ) -> list[Run | RequestConflict]:
        """The people's answers to the questions of several waiting runs (`ask` nodes), in one
        transaction: all together in a few statements (`_answer_together`), or, when that
        cannot be, each as `answer` writes it, in a savepoint of its own. Either way one that
        conflicts (its run waits for nothing, another answer won) changes nothing and the
        others are written. For each, in order: the run that continues it, or the conflict.
        Rows are locked in run id order, whatever the request's (as `_answer_together` does),
        so two batches over the same runs wait for each other instead of deadlocking."""
        together = self._answer_together(answers)
        if together is not None:
            return together
        outcomes: dict[int, Run | RequestConflict] = {}
        events: list[Event] = []
        by_run = sorted(range(len(answers)), key=lambda index: (answers[index][0].id, index))
        with self.db.write() as session:
            for index in by_run:
                run, answer, new = answers[index]
                try:
                    with session.begin_nested():
                        created, written = self._answer_in(
                            session, run, answer, new, "ask", None, False
                        )
                except RequestConflict as conflict:
                    outcomes[index] = conflict
                    continue
                outcomes[index] = created
                events += written
        self.runs.publish_all(events)
        return [outcomes[index] for index in range(len(answers))]

    def _answer_together(
        self, answers: Sequence[tuple[Run, Any, NewRun]]
    ) -> list[Run | RequestConflict] | None:
        """`answer_many` in a few statements for the whole batch, where one each took seven:
        the `asked` nodes answered in one update (a run's first answer in the batch; another
        one, or a run that waits for no answer, is a conflict), the runs closed in one, the
        runs that continue them in one insert, every event in one. None, with nothing
        written, when a run whose node it answered no longer waits (a cancel came between):
        `answer_many` then answers them one at a time, each in a savepoint."""
        first: dict[str, int] = {}
        for index, (run, _, _) in enumerate(answers):
            first.setdefault(run.id, index)
        ids = sorted(first)
        params: dict[str, Any] = self.db.clock_params()
        for i, run_id in enumerate(ids):
            params |= {f"p_id_{i}": run_id, f"p_result_{i}": {"value": answers[first[run_id]][1]}}
        try:
            created, events = self._write_together(ids, params, answers, first)
        except _Uneven:
            return None
        self.runs.publish_all(events)
        return [
            created[run.id]
            if first[run.id] == index and run.id in created
            else RequestConflict(f"run '{run.id}' is not waiting for {_WAITED['ask']}")
            for index, (run, _, _) in enumerate(answers)
        ]

    def _write_together(
        self,
        ids: list[str],
        params: dict[str, Any],
        answers: Sequence[tuple[Run, Any, NewRun]],
        first: dict[str, int],
    ) -> tuple[dict[str, Run], list[Event]]:
        """`_answer_together`'s transaction: the runs that continue the answered ones, by the
        id of the run each continues, and the events to publish; `_Uneven` rolls it back."""
        with self.db.write() as session:
            rows = session.execute(_answer_asked(len(ids)), params).all()
            answered = {str(run_id): node for run_id, node, _ in rows}
            if len(answered) != len(rows):
                raise _Uneven  # a run with two open questions: answered one at a time
            if not rows:
                return {}, []
            now = rows[0][2]
            news = {run_id: answers[first[run_id]][2] for run_id in answered}
            made = self.runs.create_many_in(session, list(news.values()), now)
            closing = {run_id: Answered(node, news[run_id].id) for run_id, node in answered.items()}
            queued = [event for _, event in made]
            closed = self.runs.close_answered_many_in(session, now, closing, queued)
            if closed is None:
                raise _Uneven  # one no longer waits (a cancel came between)
        created = {str(run.continued_from_run_id): run for run, _ in made}
        return created, [*closed, *queued]

    def _answer_in(
        self,
        session: Session,
        run: Run,
        answer: Any,
        new: NewRun,
        kind: str,
        node: str | None,
        timed_out: bool,
    ) -> tuple[Run, list[Event]]:
        """`answer`'s writes in `session`: the node answered, the run closed, its continuation
        written; the continuation and the events to publish once committed."""
        result: dict[str, Any] = {"value": answer}
        if timed_out:
            result["timedOut"] = True
        where = [NODES.c.run_id == run.id, NODES.c.status == "asked", NODES.c.kind == kind]
        if node is not None:
            where.append(NODES.c.node == node)
        found = session.execute(
            update(NODES)
            .where(*where)
            .values(status="answered", result=result, answered_at=_NOW)
            .returning(NODES.c.node, NODES.c.answered_at),
            self.db.clock_params(),
        ).one_or_none()
        if found is None:
            raise RequestConflict(f"run '{run.id}' is not waiting for {_WAITED[kind]}")
        node_name, now = found  # the database's time, read by the update itself
        events = self.runs.close_answered_in(session, run.id, now, Answered(node_name, new.id))
        if events is None:
            raise RequestConflict(f"run '{run.id}' is no longer waiting")
        created, queued = self.runs.create_in(session, new)
        return created, [*events, queued]

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
        self.runs.publish_all(events)
        return created


class _Uneven(Exception):
    """A batch of answers that cannot be written together (`_answer_together`)."""


@functools.cache
def _answer_asked(count: int) -> Update:
    """The `ask` nodes of `count` runs answered (`p_id_<i>`, `p_result_<i>`) in one update,
    of those still asked; it returns (run id, node, time) of each. Built once per count.

    The rows are locked first, in run id order (a sub-select `FOR UPDATE` with `ORDER BY`:
    PostgreSQL's update would lock them in the order it scans them), as `answer_many`'s
    one-at-a-time path does: two batches over the same runs then wait for each other, where
    they would deadlock."""
    ids = [bindparam(f"p_id_{i}", type_=NODES.c.run_id.type) for i in range(count)]
    results = [bindparam(f"p_result_{i}", type_=NODES.c.result.type) for i in range(count)]
    asked = (
        select(NODES.c.id)
        .where(NODES.c.run_id.in_(ids), NODES.c.status == "asked", NODES.c.kind == "ask")
        .order_by(NODES.c.run_id, NODES.c.node)
        .with_for_update()
    )
    return (
        update(NODES)
        .where(NODES.c.id.in_(asked), NODES.c.status == "asked")
        .values(
            status="answered",
            result=case(*[(NODES.c.run_id == i, r) for i, r in zip(ids, results, strict=True)]),
            answered_at=_NOW,
        )
        .returning(NODES.c.run_id, NODES.c.node, NODES.c.answered_at)
    )


_WAITED = {"ask": "an answer", "timer": "a timer", "event": "an event", FANOUT: "its branches"}


def _branch_row(run_id: str, node: str, index: int, outcome: dict[str, Any], at: datetime) -> Any:
    return insert(NODES).values(
        run_id=run_id,
        node=f"{node}/{index}",
        kind=BRANCH,
        status="completed",
        result=outcome,
        created_at=at,
    )


def _branch_outcomes(session: Session, run_id: str, node: str) -> dict[int, dict[str, Any]]:
    """The function branches of the fan-out `node` the run finished, by index."""
    rows = session.execute(
        select(NODES.c.node, NODES.c.result).where(
            NODES.c.run_id == run_id,
            NODES.c.kind == BRANCH,
            NODES.c.node.startswith(f"{node}/", autoescape=True),
        )
    ).all()
    return {int(row.node.rsplit("/", 1)[1]): dict(row.result or {}) for row in rows}


def _newest_of(session: Session, run_ids: Sequence[str]) -> dict[str, Run]:
    """For each run, the newest run of its chain from it on: the runs that continue it
    (an answer, a resume, a job's next attempt), followed a hop per query for all at once."""
    rows = {run.id: run for run in session.scalars(select(Run).where(Run.id.in_(list(run_ids))))}
    newest = {run_id: rows[run_id] for run_id in run_ids if run_id in rows}
    for _ in range(MAX_CHAIN):
        tips = {run.id: first for first, run in newest.items()}
        following = list(
            session.scalars(select(Run).where(Run.continued_from_run_id.in_(list(tips))))
        )
        if not following:
            break
        for run in sorted(following, key=lambda r: r.created_at):
            newest[tips[str(run.continued_from_run_id)]] = run
    return newest


def _child_outcome(branch: dict[str, Any], newest: Run) -> dict[str, Any] | None:
    """What a child branch came to, from the newest run of its chain; None while it runs."""
    status = RunStatus(newest.status)
    if not status.is_terminal:
        return None
    output = newest.output or {}
    if status is RunStatus.COMPLETED and "continuedIn" not in output:
        value = output.get("text", "") if branch["kind"] == "agent" else output.get("result")
        return {"ok": True, "value": value, "name": branch["name"], "runId": newest.id}
    if status is RunStatus.COMPLETED:  # its continuation is being written: still running
        return None
    error = f"{branch['kind']} '{branch.get('target')}' run {newest.id} ended {newest.status}"
    if newest.error_message:
        error += f": {newest.error_message}"
    return {"ok": False, "error": error, "name": branch["name"], "runId": newest.id}


def _naive_utc(when: datetime | None) -> datetime | None:
    """`when` as the database keeps times: UTC, without a zone (a naive one is UTC)."""
    if when is None or when.tzinfo is None:
        return when
    return when.astimezone(UTC).replace(tzinfo=None)


def _take_buffered(
    session: Session, chain_id: str, name: str, taker: str, now: datetime
) -> tuple[Any] | None:
    """Mark the oldest kept event `name` of the chain taken by `taker`, inside the caller's
    transaction; `(payload,)`, or None when none is kept (a racing taker's is not taken
    twice: the update is guarded by `consumed_at IS NULL`)."""
    for _ in range(3):
        oldest = session.execute(
            select(EVENTS.c.id)
            .where(
                EVENTS.c.chain_id == chain_id,
                EVENTS.c.name == name,
                EVENTS.c.consumed_at.is_(None),
            )
            .order_by(EVENTS.c.id)
            .limit(1)
        ).scalar_one_or_none()
        if oldest is None:
            return None
        taken = session.execute(
            update(EVENTS)
            .where(EVENTS.c.id == oldest, EVENTS.c.consumed_at.is_(None))
            .values(consumed_at=now, consumed_by=taker)
            .returning(EVENTS.c.payload)
        ).first()
        if taken is not None:
            return ((taken.payload or {}).get("value"),)
    return None
