"""SQL persistence of runs and their events, every executor write guarded by its fence.

One store, `RunStore`, in modules along its parts: the SQL built once (`statements`), what it
reads and writes besides the row (`values`), creating runs and the executor's fenced writes with
the claim they make (`writes`), every way into and out of `Waiting` (`waiting`), heartbeats,
cancel requests and reconciliation (`liveness`), and the reads (`queries`). The webhook
messages that events cause are written with them, in their transaction, when an `Outbox` is
given (`writes`).
"""

from __future__ import annotations

from tracon_jobs.db.models import Run
from tracon_jobs.runs.store.liveness import RunLiveness
from tracon_jobs.runs.store.queries import RunQueries
from tracon_jobs.runs.store.values import (
    Event,
    ModelUsage,
    NewRun,
    RunFilter,
    RunStatistics,
    TurnSpend,
    iso,
)
from tracon_jobs.runs.store.waiting import WaitingRuns
from tracon_jobs.runs.store.writes import Message, Outbox, Tries, Typed

__all__ = [
    "Event",
    "Message",
    "ModelUsage",
    "NewRun",
    "Outbox",
    "Run",
    "RunFilter",
    "RunStatistics",
    "RunStore",
    "Tries",
    "TurnSpend",
    "Typed",
    "iso",
]


class RunStore(WaitingRuns, RunLiveness, RunQueries):
    """Runs and their events in SQL; every executor write is guarded by the claim's fence."""
