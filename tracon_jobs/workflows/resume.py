"""Starting the run that continues a workflow chain: a person's answer, an operator's resume,
or the recovery of a run a job owned when its process died.

Each continuation is a new run in the same session whose `continuedFromRunId` names the run
it continues; its budget starts from everything the chain spent, and its replay answers
every checkpointed node without running it.
"""

from __future__ import annotations

import logging
from typing import Any

from tracon_jobs.db.models import Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.store import NewRun
from tracon_jobs.settings import Settings
from tracon_jobs.workflows.store import WorkflowStore

log = logging.getLogger(__name__)


class WorkflowResumes:
    """Answers, operator resumes and recoveries of workflow runs."""

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

    def respond(self, run: Run, answer: Any) -> Run:
        """Answer the question `run` waits on; the answer returns from `ctx.ask` in the run
        that continues it (`RequestConflict` when it waits for nothing)."""
        return self._send(self.store.answer(run, answer, continuation(run)))

    def resume(self, run: Run) -> Run:
        """Resume a `Failed` workflow run from its latest checkpoint (`ResumeConflict` else)."""
        return self._send(self.store.resume(run, continuation(run)))

    def _send(self, run: Run) -> Run:
        try:
            self.dispatcher.send(run.id)
        except EnqueueError as exc:  # the row is Queued: the requeue scan sends it
            log.warning("continuation %s not sent now (%s); the requeue scan sends it", run.id, exc)
        return run


def continuation(run: Run) -> NewRun:
    """The run that continues `run`: same workflow, input, session, owner of the job."""
    return NewRun(
        tenant_id=run.tenant_id,
        agent=run.agent,
        kind="workflow",
        input=run.input,
        session_id=run.session_id,
        continued_from_run_id=run.id,
        attempt=run.attempt + 1,
        currency=run.cost_currency,
        resumable=run.resumable,
    )
