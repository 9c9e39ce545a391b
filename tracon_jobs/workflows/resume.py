"""Starting the run that continues a workflow chain: a person's answer, a timer's firing, an
event delivered (or its wait's timeout), an operator's resume, or the job's next attempt at a
run whose process died.

Each continuation is a new run in the same session whose `continuedFromRunId` names the run
it continues; its budget starts from everything the chain spent. An answer, a resume, and
a job attempt with `Workflows.ResumeInterruptedRuns` replay every checkpointed node without
running it; a job attempt without it starts the workflow again from its first node (only
the people's answers of the chain are kept: they are input, not results).

`attempt` counts the job's attempts only: an answer and an operator's resume keep the
attempt of the run they continue, so they never use up the job's automatic attempts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tracon_jobs.db.models import Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.limits.tree import MAX_CHAIN
from tracon_jobs.runs.dispatch import RunDispatcher, submission
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import NewRun
from tracon_jobs.settings import Settings
from tracon_jobs.workflows.fanout import OnFailure
from tracon_jobs.workflows.registry import WorkflowRegistry
from tracon_jobs.workflows.store import Due, FanOut, RequestConflict, WorkflowStore

log = logging.getLogger(__name__)


DUE_BATCH = 200
"""Waits the timer scan answers per query; a pass reads again until fewer come back."""
DUE_BATCHES = 50
"""The most batches one pass answers (10,000 waits); the next pass takes the rest."""
CANCELED = "canceled: another branch failed first"
"""The outcome of a fail-fast fan-out's branch still running when another one failed."""
STRANDED_AFTER = timedelta(seconds=2)
"""How old an event wait must be before the scan looks for an event kept for it: younger,
its own worker's look after its commit is still on its way."""


@dataclass(frozen=True)
class Delivered:
    """Where an event went: the run that continues the chain with it, or (`kept`) the run
    it waits for, to be taken by its chain's next `ctx.wait_for` of that name."""

    run: Run
    kept: bool


class WorkflowResumes:
    """Answers, operator resumes and job attempts of workflow runs."""

    def __init__(
        self,
        settings: Settings,
        store: WorkflowStore,
        dispatcher: RunDispatcher,
        registry: WorkflowRegistry | None = None,
        cancel: Callable[[Run], object] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.dispatcher = dispatcher
        self.registry = registry  # the code here: the version a continuation is created with
        self.cancel = cancel  # cancels a run and its tree (a fail-fast fan-out's other children)

    def has_attempts_left(self, run: Run) -> bool:
        """Whether the job of an interrupted queued run may start another run of the chain.

        With `Workflows.ResumeInterruptedRuns`, a chain has at most `MaxResumeAttempts`
        continuations; without it the job has `AsyncRun.MaxAttempts` attempts in all.
        """
        workflows = self.settings.workflows
        if workflows.resume_interrupted_runs:
            return run.attempt - 1 < workflows.max_resume_attempts
        return run.attempt < self.settings.async_run.max_attempts

    @property
    def resumes_from_checkpoints(self) -> bool:
        """Whether the job's next attempt continues from the latest checkpoint (else it starts
        the workflow again from its first node)."""
        return self.settings.workflows.resume_interrupted_runs

    def respond(self, run: Run, answer: Any, *, resumable: bool) -> Run:
        """Answer the question `run` waits on; the answer returns from `ctx.ask` in the run
        that continues it (`RequestConflict` when it waits for nothing). `resumable`: the
        request that answers is bound to no connection (`Prefer: respond-async`)."""
        with submission(self._continuation(run, run.attempt, resumable)) as new:
            return self._send(self.store.answer(run, answer, new))

    def respond_many(
        self, answers: Sequence[tuple[Run, Any]], *, resumable: bool
    ) -> list[Run | RequestConflict]:
        """`respond` to several waiting runs at once: one transaction for all their answers
        (`WorkflowStore.answer_many`), then each continuation sent. For each, in order: the
        run that continues it, or the `RequestConflict` that left it unanswered."""
        if not answers:
            return []
        with ExitStack() as spans:
            news = [
                spans.enter_context(submission(self._continuation(run, run.attempt, resumable)))
                for run, _ in answers
            ]
            outcomes = self.store.answer_many(
                [(run, answer, new) for (run, answer), new in zip(answers, news, strict=True)]
            )
            for outcome in outcomes:
                if isinstance(outcome, Run):
                    self._send(outcome)
        return outcomes

    def fire_due(self, now: datetime, ahead: timedelta = timedelta(0)) -> int:
        """Answer every timer and event timeout due by `now` (of runs still `Waiting`), each
        in the run that continues its chain, and each event wait whose event was kept before
        it and stranded (`WorkflowStore.stranded`); how many were answered here. Two passes
        racing answer each wait once: the loser's answer is a `RequestConflict`.

        `ahead`: then the waits due within that much after `now` are answered each at its
        time, the pass waiting for it (`now` being the database's time as the pass began),
        so a timer is late by the answer's own time, not by up to a scan interval."""
        began = time.monotonic()
        fired = 0
        for _ in range(DUE_BATCHES):
            due = self.store.due(now, DUE_BATCH)
            fired += sum(self._fire(wait) for wait in due)
            if len(due) < DUE_BATCH:
                break
        for run_id in self.store.stranded(now - STRANDED_AFTER, DUE_BATCH):
            if self.give_kept_event(run_id) is not None:
                log.warning("run %s: its kept event answered its wait late", run_id)
                fired += 1
        for run_id, node in self.store.fanouts_due(now, DUE_BATCH):
            if self.answer_fanout(run_id) is not None:
                log.info("run %s: the scan answered its fan-out %s", run_id, node)
                fired += 1
        if ahead > timedelta(0):
            for wait in self.store.due(now + ahead, DUE_BATCHES * DUE_BATCH):
                if wait.at is not None:  # its time, on the pass's clock
                    lead = (_naive(wait.at) - _naive(now)).total_seconds()
                    lead -= time.monotonic() - began
                    if lead > 0:
                        time.sleep(lead)
                fired += self._fire(wait)
        return fired

    def _fire(self, wait: Due) -> bool:
        """Answer one due wait; False when it was answered meanwhile."""
        run = self.store.runs.get(wait.run_id)
        if run is None:
            return False
        timed_out = wait.kind == "event"
        try:
            with submission(self._continuation(run, run.attempt, run.resumable)) as new:
                answered = self.store.answer(
                    run, None, new, kind=wait.kind, node=wait.node, timed_out=timed_out
                )
        except RequestConflict:
            return False  # answered meanwhile (an event, a cancel, another pass)
        self._send(answered)
        return True

    def deliver(self, run: Run, name: str, payload: Any) -> Delivered:
        """Deliver the event `name` to the chain of `run` (any run of it): it answers the
        chain's wait for it, else it is kept for the chain's next `ctx.wait_for(name)` with
        `Workflows.BufferEvents` (`RequestConflict` without it, or when the chain ended)."""
        latest = self.latest(run)
        waiting = self.store.request_of(latest.id)
        if waiting is not None and waiting.kind == "event" and _event_of(waiting.payload) == name:
            try:
                with submission(
                    self._continuation(latest, latest.attempt, latest.resumable)
                ) as new:
                    answered = self.store.answer(
                        latest, payload, new, kind="event", node=waiting.node
                    )
                return Delivered(self._send(answered), kept=False)
            except RequestConflict:  # its timeout (or a cancel) answered first: as below
                latest = self.latest(self.store.runs.get(latest.id) or latest)
        if not self.settings.workflows.buffer_events:
            raise RequestConflict(
                f"run '{latest.id}' is not waiting for event '{name}' "
                "(Workflows.BufferEvents is off: nothing is kept)"
            )
        if RunStatus(latest.status).is_terminal:
            raise RequestConflict(f"run '{latest.id}' is {latest.status}: nothing will wait")
        chain_id = self.store.chain(latest)[-1]
        self.store.keep_event(latest.tenant_id, chain_id, name, payload)
        taken = self.give_kept_event(latest.id)  # its wait was written meanwhile: take it now
        return Delivered(taken or latest, kept=taken is None)

    def give_kept_event(self, run_id: str) -> Run | None:
        """If the run waits for an event its chain was sent already, answer the wait with
        the oldest one (the run that continues the chain); None otherwise. Called by both
        sides after their own commit, the wait's and the delivery's, so the later one finds
        the other."""
        waiting = self.store.request_of(run_id)
        run = self.store.runs.get(run_id)
        if waiting is None or waiting.kind != "event" or run is None:
            return None
        kept = (self.store.chain(run)[-1], _event_of(waiting.payload))
        try:
            with submission(self._continuation(run, run.attempt, run.resumable)) as new:
                answered = self.store.answer(
                    run, None, new, kind="event", node=waiting.node, buffered=kept
                )
        except RequestConflict:
            return None  # nothing kept, or answered meanwhile
        return self._send(answered)

    def child_ended(self, child: Run) -> Run | None:
        """A run ended on this worker: if it is a branch of a fan-out that now has all it
        waits for, answer the fan-out (the run that continues its chain); None otherwise.
        The parent found is the newest run of its chain: one that resumed a fan-out its
        process died in reuses that fan-out's children."""
        if child.parent_run_id is None:
            return None
        parent = self.store.runs.get(child.parent_run_id)  # one read for an agent's child
        if parent is None or parent.kind != "workflow":
            return None
        if parent.status != RunStatus.WAITING.value:  # continued since, or ended
            parent = self.store.newest(parent.id)
            if parent is None or parent.status != RunStatus.WAITING.value:
                return None
        return self.answer_fanout(parent.id)

    def answer_fanout(self, run_id: str) -> Run | None:
        """Answer the fan-out the run waits on when its branches are over (all of them, or
        with `fail_fast` the first that failed: the others are canceled then); the run that
        continues the chain, or None (not over, not waiting, answered by another)."""
        fanout = self.store.fanout_of(run_id)
        if fanout is None or not _over(fanout):
            return None
        run = self.store.runs.get(run_id)
        if run is None or run.status != RunStatus.WAITING.value:
            return None
        outcomes = [
            outcome or {"ok": False, "error": CANCELED, "canceled": True, "name": b["name"]}
            for outcome, b in zip(fanout.outcomes, fanout.branches, strict=True)
        ]
        try:
            with submission(self._continuation(run, run.attempt, run.resumable)) as new:
                answered = self.store.answer(run, outcomes, new, kind="fanout", node=fanout.node)
        except RequestConflict:
            return None  # answered meanwhile (another branch's worker, the scan, a cancel)
        for live in fanout.live:  # a fail-fast fan-out's children still running
            child = self.store.runs.get(live)
            if child is not None and self.cancel is not None:
                self.cancel(child)
        return self._send(answered)

    def latest(self, run: Run) -> Run:
        """The run of `run`'s chain that is last now (it, or the run that continues it...)."""
        for _ in range(MAX_CHAIN):
            following = (run.output or {}).get("continuedIn") if run.status == "Completed" else None
            if not following:
                return run
            found = self.store.runs.get(str(following))
            if found is None:
                return run
            run = found
        return run

    def resume(self, run: Run, *, resumable: bool) -> Run:
        """Resume a `Failed` workflow run from its latest checkpoint (`ResumeConflict` else)."""
        with submission(self._continuation(run, run.attempt, resumable)) as new:
            return self._send(self.store.resume(run, new))

    def attempt_again(self, run: Run) -> Run:
        """The job's next attempt at `run`, just closed after its process died: from the
        latest checkpoint with `ResumeInterruptedRuns`, else from the start."""
        with submission(self._continuation(run, run.attempt + 1, True)) as new:
            return self._send(self.store.resume(run, new))

    def _continuation(self, run: Run, attempt: int, resumable: bool) -> NewRun:
        version = None if self.registry is None else self.registry.version_of(run.agent)
        return continuation(run, attempt, resumable, version)

    def _send(self, run: Run) -> Run:
        try:
            self.dispatcher.offer_run(run)
        except EnqueueError as exc:  # the row is Queued: the requeue scan sends it
            log.warning("continuation %s not sent now (%s); the requeue scan sends it", run.id, exc)
        return run


def _over(fanout: FanOut) -> bool:
    """Whether a fan-out has what it waits for: every branch's outcome, or (`fail_fast`) a
    failed one."""
    if all(outcome is not None for outcome in fanout.outcomes):
        return True
    return fanout.policy == OnFailure.FAIL_FAST and any(
        outcome is not None and not outcome.get("ok") for outcome in fanout.outcomes
    )


def _naive(when: datetime) -> datetime:
    """`when` in UTC without a zone, as the database keeps times."""
    return when if when.tzinfo is None else when.astimezone(UTC).replace(tzinfo=None)


def continuation(
    run: Run, attempt: int, resumable: bool, workflow_version: str | None = None
) -> NewRun:
    """The run that continues `run`: same workflow, input and session, and the same place in
    its tree (a child workflow's continuation is its parent's child still); it records
    `workflow_version`, the version of the code that creates it (the worker that executes it
    records its own instead when it runs other code)."""
    child = run.parent_run_id is not None
    return NewRun(
        tenant_id=run.tenant_id,
        agent=run.agent,
        kind="workflow",
        input=run.input,
        session_id=run.session_id,
        continued_from_run_id=run.id,
        parent_run_id=run.parent_run_id,
        root_run_id=run.root_run_id if child else None,
        depth=run.depth,
        attempt=attempt,
        currency=run.cost_currency,
        priority=run.priority,
        resumable=resumable,
        continues_trace=run.traceparent,
        workflow_version=workflow_version,
    )


def _event_of(payload: dict[str, Any] | None) -> str:
    """The event name an `event` node waits for (its payload's `event`)."""
    return str((payload or {}).get("event") or "")
