"""Re-send `Queued` runs whose message is lost: at once when the worker that held it died,
else when no worker claimed it within `Runs.RequeueAfter`.

Always on, whatever `RunReconciliation.Enabled` says: on Redis a prefetched message of a
killed worker stays invisible for the broker's whole visibility timeout (RabbitMQ gives it
back at once, and the pass's re-send is then one more duplicate), and a process can die
between writing a run and sending its message. The workers' records of the runs they hold
(`coordination.held`) tell a dead worker's runs, sent again as soon as its liveness ends, from
a live worker's, never sent twice however long they wait for its threads. A duplicate
message stays harmless: the guarded claim lets only one delivery execute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import redis

from tracon_jobs.coordination.held import Holders
from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import RunStore

log = logging.getLogger(__name__)

BATCH = 500


@dataclass(frozen=True)
class RequeueResult:
    resent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def requeue_unclaimed(
    runs: RunStore,
    dispatcher: RunDispatcher,
    requeue_after: timedelta,
    now: datetime,
    holders: Holders | None = None,
) -> RequeueResult:
    """One pass: the `Queued` runs dead workers held, then every run still `Queued` and
    unclaimed `requeue_after` after its send that no live worker holds."""
    resent: list[str] = []
    failed: list[str] = []
    held_live: set[str] = set()
    if holders is not None:
        try:
            dead, held_live = holders.read()
        except redis.RedisError as exc:  # without the records, as before: by age alone
            log.warning("held runs unreadable; re-sending by age alone: %s", exc)
            dead = {}
        for worker, held in dead.items():
            lost = [run_id for run_id in sorted(held) if _lost(runs, run_id, now)]
            for run_id in lost:  # a claimed one is the orphan scan's
                (resent if dispatcher.resend(run_id, lost=True) else failed).append(run_id)
            log.warning(
                "worker %s is gone: the %d runs it held unclaimed sent again", worker, len(lost)
            )
        if dead:
            holders.forget(dead)
    for run_id in runs.unclaimed(now, requeue_after, BATCH):
        if run_id not in held_live and run_id not in resent and run_id not in failed:
            (resent if dispatcher.resend(run_id) else failed).append(run_id)
    return RequeueResult(resent, failed)


def _lost(runs: RunStore, run_id: str, now: datetime) -> bool:
    """Whether a dead worker's run is still to be sent: `Queued`, and not parked to go on
    later (its time, `enqueued_at`, still ahead: the age rule sends it after that)."""
    run = runs.get(run_id)
    if run is None or run.status != RunStatus.QUEUED.value:
        return False
    return run.enqueued_at is None or run.enqueued_at <= now
