"""Re-send `Queued` runs that no worker claimed within `Runs.RequeueAfter`.

Always on, whatever `RunReconciliation.Enabled` says: a prefetched message of a killed
worker stays invisible for the broker's whole visibility timeout, and a process can die
between writing a run and sending its message. A duplicate message is harmless: the
guarded claim lets only one delivery execute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.store import RunStore

BATCH = 500


@dataclass(frozen=True)
class RequeueResult:
    resent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def requeue_unclaimed(
    runs: RunStore, dispatcher: RunDispatcher, requeue_after: timedelta, now: datetime
) -> RequeueResult:
    """One pass: every run still `Queued` and unclaimed `requeue_after` after its send."""
    resent: list[str] = []
    failed: list[str] = []
    for run_id in runs.unclaimed(now, requeue_after, BATCH):
        (resent if dispatcher.resend(run_id) else failed).append(run_id)
    return RequeueResult(resent, failed)
