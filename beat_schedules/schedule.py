"""Which periodic task runs how often. Each entry expires within its own interval, so a
stalled beat or a busy worker never piles them up."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from tracon_jobs.settings import Settings

REQUEUE_TASK = "tracon.runs.requeue_unclaimed"
CONTROL_QUEUE = "tracon.control"


def requeue_interval(settings: Settings) -> float:
    """A quarter of `RequeueAfter`, between 1 and 30 seconds."""
    quarter = settings.runs.requeue_after / 4
    return min(max(quarter, timedelta(seconds=1)), timedelta(seconds=30)).total_seconds()


def build_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    interval = requeue_interval(settings)
    return {
        "requeue-unclaimed-runs": {
            "task": REQUEUE_TASK,
            "schedule": interval,
            "options": {"expires": interval, "queue": CONTROL_QUEUE},
        }
    }
