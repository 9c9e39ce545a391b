"""Close runs left behind by a crash, and continue the ones that can be continued.

`Running` runs (and `Queued` runs that wrote a heartbeat) silent for `OrphanThreshold` are
closed: `Canceled` when a cancel was requested (never continued), else `Failed` with error
type `orphaned`. Each close is guarded by the fence and the heartbeat it was read with, so
a run that heartbeated meanwhile is left alone. Right after an orphaned root agent run
closes, `RunContinuation` may start a new run in the same session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from tracon_jobs.db.models import Run
from tracon_jobs.runs.continuation import Continuations
from tracon_jobs.runs.lifecycle import ErrorClass, RunError, RunStatus
from tracon_jobs.runs.store import RunStore
from tracon_jobs.settings import RunReconciliationSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileResult:
    orphaned: list[str] = field(default_factory=list)
    canceled: list[str] = field(default_factory=list)
    continued: dict[str, str] = field(default_factory=dict)  # orphan -> continuation


class Reconciler:
    """The orphan scan: closes silent runs and hands orphans to `Continuations`."""

    def __init__(
        self,
        config: RunReconciliationSettings,
        runs: RunStore,
        continuations: Continuations,
        jobs: JobRecovery | None = None,
    ) -> None:
        self.config = config
        self.runs = runs
        self.continuations = continuations
        self.jobs = jobs  # the owner of queued workflow runs: it resumes or fails them

    def scan_once(
        self, now: datetime, still_owner: Callable[[], bool] = lambda: True
    ) -> ReconcileResult:
        """One pass; stops between runs as soon as this process is no longer the lease owner.

        Nothing at all while `RunReconciliation.Enabled` is off: a tick that still reaches a
        worker (a beat of another configuration, a hand-sent task) must not close runs that
        write no heartbeats."""
        if not self.config.enabled:
            return ReconcileResult()
        threshold = self.config.orphan_threshold
        silent_since = now - threshold
        result = ReconcileResult()
        for run in self.runs.orphans(now, threshold, self.config.max_runs_per_scan):
            if not still_owner():
                break
            if run.cancel_requested_at is not None:
                self._close_canceled(run, silent_since, result)
            else:
                self._close_orphaned(run, silent_since, result)
        return result

    def _close_canceled(self, run: Run, silent_since: datetime, result: ReconcileResult) -> None:
        error = RunError(
            "canceled", ErrorClass.CANCELLATION, "canceled; its process died before it stopped"
        )
        if self.runs.close_orphan(run, RunStatus.CANCELED, error, silent_since):
            result.canceled.append(run.id)

    def _close_orphaned(self, run: Run, silent_since: datetime, result: ReconcileResult) -> None:
        if self.jobs is not None and run.kind == "workflow" and run.resumable:
            self._recover_job(run, silent_since, result)
            return
        error = RunError(
            "orphaned",
            ErrorClass.INFRASTRUCTURE,
            f"no heartbeat since {run.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC; its process is gone",
        )
        if not self.runs.close_orphan(run, RunStatus.FAILED, error, silent_since):
            return
        log.warning("run %s closed as orphaned", run.id)
        result.orphaned.append(run.id)
        continuation = self.continuations.continue_orphan(run)
        if continuation is not None:
            result.continued[run.id] = continuation

    def _recover_job(self, run: Run, silent_since: datetime, result: ReconcileResult) -> None:
        """A queued workflow run's job outlives its process: while it has attempts left it
        attempts the run again, from the latest checkpoint with
        `Workflows.ResumeInterruptedRuns`, else from the first node; then it fails."""
        assert self.jobs is not None
        if not self.jobs.has_attempts_left(run):
            self._close_exhausted(run, silent_since, result)
            return
        if not self.runs.close_orphan(run, RunStatus.FAILED, self._interrupted(), silent_since):
            return
        result.orphaned.append(run.id)
        closed = self.runs.get(run.id)
        assert closed is not None
        attempt = self.jobs.attempt_again(closed)
        log.warning(
            "workflow run %s interrupted; the job attempts it again in %s", run.id, attempt.id
        )
        result.continued[run.id] = attempt.id

    def _interrupted(self) -> RunError:
        assert self.jobs is not None
        if self.jobs.resumes_from_checkpoints:
            message = "its process stopped mid-run; the job continues it from its latest checkpoint"
            return RunError("interrupted", ErrorClass.INFRASTRUCTURE, message)
        message = "its process stopped mid-run; the job attempts the workflow again from the start"
        return RunError(JOB_RESTARTED, ErrorClass.INFRASTRUCTURE, message)

    def _close_exhausted(self, run: Run, silent_since: datetime, result: ReconcileResult) -> None:
        error = RunError(
            "orphaned",
            ErrorClass.INFRASTRUCTURE,
            f"no heartbeat since {run.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC; its process is gone "
            "and its job has no attempts left",
        )
        if not self.runs.close_orphan(run, RunStatus.FAILED, error, silent_since):
            return
        result.orphaned.append(run.id)
        data = {"error": JOB_ATTEMPTS_EXHAUSTED, "attempts": run.attempt}
        self.runs.append(None, "JobFailed", data, run_id=run.id)
        log.error(
            "workflow run %s: %s after %d attempts", run.id, JOB_ATTEMPTS_EXHAUSTED, run.attempt
        )
        self.continuations.continue_orphan(run)  # records why it is not continued


JOB_ATTEMPTS_EXHAUSTED = "tracon.job.attempts-exhausted"
JOB_RESTARTED = "restarted"  # the error type of a run whose job starts it again from the start


class JobRecovery(Protocol):
    """Who owns a queued workflow run's job (the workflow package)."""

    @property
    def resumes_from_checkpoints(self) -> bool: ...

    def has_attempts_left(self, run: Run) -> bool: ...

    def attempt_again(self, run: Run) -> Run: ...
