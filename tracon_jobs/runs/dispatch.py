"""Submitting runs: the row first (with its enqueue time), then the message.

A crash between the row and the message leaves a `Queued` run that the requeue scan sends
after `Runs.RequeueAfter`; a broker that refuses the message closes the run `Failed`
(`enqueue_failed`) and the caller gets a 503, so nothing accepted is silently lost.

How a message is sent is the `Sender` the dispatcher is given: the Celery one is
`tracon_jobs.worker.envelope.celery_sender`; tests send runs to threads of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tracon_jobs.db.models import Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.lifecycle import ErrorClass, RunError
from tracon_jobs.runs.store import NewRun, RunStore

log = logging.getLogger(__name__)

Sender = Callable[[str], None]
"""`send(run_id)`: the run's message; raises `EnqueueError` when the broker refuses it."""


class RunDispatcher:
    """Submits runs: the row first, then the message; a refused message fails the run."""

    def __init__(self, store: RunStore, send: Sender) -> None:
        self.store = store
        self.send = send
        self._submitting: dict[str, tuple[str, str]] = {}  # run id -> (agent, tenant id)

    def submitting(self, run_id: str) -> tuple[str, str] | None:
        """(agent, tenant id) of a run this process is sending right now: what its message
        is labelled with, without reading the row back."""
        return self._submitting.get(run_id)

    def submit(self, new: NewRun) -> Run:
        run = self.store.create(new)
        self._submitting[run.id] = (new.agent, new.tenant_id)
        try:
            self.send(run.id)
        except EnqueueError as exc:
            log.error("enqueue failed for run %s: %s", run.id, exc)
            error = RunError("enqueue_failed", ErrorClass.INFRASTRUCTURE, str(exc))
            self.store.fail_unsent(run.id, error)
            raise
        finally:
            self._submitting.pop(run.id, None)
        return run

    def resend(self, run_id: str) -> bool:
        """Send a run's message again; False (logged) when the broker refused."""
        try:
            self.send(run_id)
        except EnqueueError as exc:
            log.warning("re-send of run %s failed, next scan retries: %s", run_id, exc)
            return False
        self.store.mark_enqueued(run_id)
        return True
