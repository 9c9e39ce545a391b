"""Cancel a run and its descendants, wherever they execute.

The request is persisted first (so it survives a Redis restart and reaches an owner that
is not subscribed yet), `Queued` and `Waiting` runs are closed at once through the store
(a waiting run's pending approvals are canceled first), and a notice goes out to every
worker process for the ones already running.
"""

from __future__ import annotations

from collections.abc import Callable

from tracon_jobs.coordination.cancellation import CancelBus
from tracon_jobs.db.models import Run
from tracon_jobs.runs.approvals import ApprovalStore
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import RunStore


def cancel_tree(
    runs: RunStore,
    bus: CancelBus,
    approvals: ApprovalStore,
    run: Run,
    left: Callable[[str], None] | None = None,
) -> list[str]:
    """Cancel `run` (live) and its live descendants; the ids the request reached. `left(id)`
    hears of each `Queued` run closed (it leaves its tenant's fair line)."""
    live = [r for r in runs.subtree(run) if not RunStatus(r.status).is_terminal]
    marked = set(runs.request_cancel(live))
    reached = []
    for target in live:
        if target.status == RunStatus.QUEUED.value and runs.cancel_queued(target.id):
            reached.append(target.id)
            if left is not None:
                left(target.id)
            continue
        if target.status == RunStatus.WAITING.value and approvals.cancel_waiting(target.id):
            reached.append(target.id)
            continue
        bus.publish(target.id)
        if target.id in marked or target.cancel_requested_at is not None:
            reached.append(target.id)
    return reached
