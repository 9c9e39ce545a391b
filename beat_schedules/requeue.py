"""Re-send `Queued` runs that no worker claimed within `Runs.RequeueAfter`.

Always on, whatever `RunReconciliation.Enabled` says: a prefetched message of a killed
worker stays invisible for the broker's whole visibility timeout, and a process can die
between writing a run and sending its message. A duplicate message is harmless: the
guarded claim lets only one delivery execute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime

BATCH = 500


@dataclass(frozen=True)
class RequeueResult:
    resent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def scan_once(runtime: Runtime, now: datetime) -> RequeueResult:
    stale = runtime.runs.unclaimed(now, runtime.settings.runs.requeue_after, BATCH)
    resent: list[str] = []
    failed: list[str] = []
    for run_id in stale:
        (resent if runtime.dispatcher.resend(run_id) else failed).append(run_id)
    return RequeueResult(resent, failed)
