"""Starting the run that continues a workflow chain: a person's answer, an operator's resume,
or the job's next attempt at a run whose process died.

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
from typing import Any

from tracon_jobs.db.models import Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.dispatch import RunDispatcher, submission
from tracon_jobs.runs.store import NewRun
from tracon_jobs.settings import Settings
from tracon_jobs.workflows.store import WorkflowStore

log = logging.getLogger(__name__)


class WorkflowResumes:
    """Answers, operator resumes and job attempts of workflow runs."""

    def __init__(self, settings: Settings, store: WorkflowStore, dispatcher: RunDispatcher) -> None:
        self.settings = settings
        self.store = store
        self.dispatcher = dispatcher

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
        with submission(continuation(run, run.attempt, resumable)) as new:
            return self._send(self.store.answer(run, answer, new))

    def resume(self, run: Run, *, resumable: bool) -> Run:
        """Resume a `Failed` workflow run from its latest checkpoint (`ResumeConflict` else)."""
        with submission(continuation(run, run.attempt, resumable)) as new:
            return self._send(self.store.resume(run, new))

    def attempt_again(self, run: Run) -> Run:
        """The job's next attempt at `run`, just closed after its process died: from the
        latest checkpoint with `ResumeInterruptedRuns`, else from the start."""
        with submission(continuation(run, run.attempt + 1, True)) as new:
            return self._send(self.store.resume(run, new))

    def _send(self, run: Run) -> Run:
        try:
            self.dispatcher.offer(run.id, run.tenant_id, run.priority)
        except EnqueueError as exc:  # the row is Queued: the requeue scan sends it
            log.warning("continuation %s not sent now (%s); the requeue scan sends it", run.id, exc)
        return run


def continuation(run: Run, attempt: int, resumable: bool) -> NewRun:
    """The run that continues `run`: same workflow, input and session."""
    return NewRun(
        tenant_id=run.tenant_id,
        agent=run.agent,
        kind="workflow",
        input=run.input,
        session_id=run.session_id,
        continued_from_run_id=run.id,
        attempt=attempt,
        currency=run.cost_currency,
        priority=run.priority,
        resumable=resumable,
        continues_trace=run.traceparent,
    )
