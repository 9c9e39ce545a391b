"""Cancel a run and its descendants, wherever they execute.

The request is persisted first (so it survives a Redis restart and reaches an owner that
is not subscribed yet), `Queued` runs are closed at once through the store, and a notice
goes out to every worker process for the ones already running.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracon_jobs.db.models import Run
from tracon_jobs.runs.lifecycle import RunStatus

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime


def cancel_tree(runtime: Runtime, run: Run) -> list[str]:
    """Cancel `run` (live) and its live descendants; the ids the request reached."""
    live = [r for r in runtime.runs.subtree(run) if not RunStatus(r.status).is_terminal]
    marked = set(runtime.runs.request_cancel(live))
    reached = []
    for target in live:
        if target.status == RunStatus.QUEUED.value and runtime.runs.cancel_queued(target.id):
            reached.append(target.id)
            continue
        runtime.cancel_bus.publish(target.id)
        if target.id in marked or target.cancel_requested_at is not None:
            reached.append(target.id)
    return reached
