"""The periodic tasks: thin bodies around each `scan_once(now)` pass, under singleton leases.

Beat sends each tick to whichever worker takes it from the control queue. With
`SingletonExecution` on, only the lease owner runs the body; a worker that is not the
owner forwards the tick to the owner's own queue (Celery's `worker_direct`), named by the
route the owner advertises next to its lease, so every tick runs once, in the owner. A
tick is forwarded at most once; with no known owner it is skipped (the next tick elects
one). With `SingletonExecution` off, every worker that receives a tick runs it. The
requeue of unclaimed runs is never leased: a duplicate re-send is harmless, a missed one
is not.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from celery import Celery, Task
from celery.utils.nodenames import worker_direct

from beat_schedules.schedule import (
    APPROVAL_EXPIRY_TASK,
    IDEMPOTENCY_PURGE_TASK,
    RECONCILE_TASK,
    REQUEUE_TASK,
    RUN_RETENTION_TASK,
    SCHEDULES_TASK,
    WORKFLOW_TIMERS_TASK,
)
from tracon_jobs.coordination.periodic import LeaseRoutes
from tracon_jobs.idempotency import IdempotencyStore, purge_past_retention
from tracon_jobs.runs.requeue import requeue_unclaimed
from tracon_jobs.runtime import Runtime

log = logging.getLogger(__name__)

T = TypeVar("T")

LOOK_AHEAD = 0.9
"""The share of `Workflows.TimerScanInterval` a timers pass looks ahead: it answers each wait
due in that time at its time, and ends before the next tick."""


def run_periodic(
    runtime: Runtime, task: Task, name: str, forwarded: bool, body: Callable[[], T]
) -> T | dict[str, Any] | None:
    """Run `body` in the lease owner only; forward a tick that reached another worker."""
    leases = runtime.leases
    routes = LeaseRoutes(runtime.redis)
    if leases.is_owner(name):
        hostname = task.request.hostname
        if hostname and leases.enabled:
            routes.advertise(name, hostname, leases.ttl_ms)
        return body()
    owner = None if forwarded else routes.owner_address(name)
    if owner is None:
        log.debug("%s: not the owner and no owner to forward to; pass skipped", name)
        return None
    task.apply_async(
        kwargs={"forwarded": True}, queue=worker_direct(owner), expires=leases.ttl_ms / 1000
    )
    return {"forwardedTo": owner}


PERIODIC: dict[str, Any] = {
    "ignore_result": True,
    # A shared task is copied into every Celery app created later in the process, so a
    # second Runtime's app would run these closures over the first one's services.
    "shared": False,
    # No task events: Flower's task list is the runs' (a tick every few seconds would bury
    # them). Each tick still logs in the worker that runs it.
    "send_events": False,
}


def register_periodic_tasks(app: Celery, runtime: Runtime) -> None:
    @app.task(name=REQUEUE_TASK, **PERIODIC)
    def requeue_unclaimed_runs() -> dict[str, Any]:
        after = runtime.settings.runs.requeue_after
        result = requeue_unclaimed(
            runtime.runs, runtime.dispatcher, after, runtime.db.now(), runtime.holders
        )
        if result.resent:
            log.info("re-sent %d unclaimed runs", len(result.resent))
        return {"resent": len(result.resent), "failed": len(result.failed)}

    @app.task(name=RECONCILE_TASK, bind=True, **PERIODIC)
    def reconcile_orphaned_runs(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, RECONCILE_TASK, forwarded, reconcile_pass)

    def reconcile_pass() -> dict[str, Any]:
        still_owner = functools.partial(runtime.leases.still_owner, RECONCILE_TASK)
        result = runtime.reconciler.scan_once(runtime.db.now(), still_owner)
        return {
            "orphaned": len(result.orphaned),
            "canceled": len(result.canceled),
            "continued": len(result.continued),
        }

    @app.task(name=IDEMPOTENCY_PURGE_TASK, bind=True, **PERIODIC)
    def purge_idempotency_records(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, IDEMPOTENCY_PURGE_TASK, forwarded, purge_pass)

    def purge_pass() -> dict[str, Any]:
        retention = runtime.settings.retention.idempotency_retention
        store = IdempotencyStore(runtime.db)
        result = purge_past_retention(store, retention, runtime.db.now())
        if result.deleted:
            log.info("deleted %d idempotency records past retention", result.deleted)
        return {"enabled": result.enabled, "deleted": result.deleted}

    @app.task(name=RUN_RETENTION_TASK, bind=True, **PERIODIC)
    def delete_runs_past_retention(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, RUN_RETENTION_TASK, forwarded, run_retention_pass)

    def run_retention_pass() -> dict[str, Any]:
        still_owner = functools.partial(runtime.leases.still_owner, RUN_RETENTION_TASK)
        budget = runtime.settings.runs.retention_scan_interval / 2
        result = runtime.run_retention.purge_once(runtime.db.now(), still_owner, budget)
        if result.groups:
            log.info(
                "deleted %d run trees (%d runs) past retention%s",
                result.trees,
                result.runs,
                "" if result.finished else "; the next pass goes on",
            )
        return result.as_json()

    @app.task(name=WORKFLOW_TIMERS_TASK, bind=True, **PERIODIC)
    def fire_workflow_timers(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, WORKFLOW_TIMERS_TASK, forwarded, timers_pass)

    def timers_pass() -> dict[str, Any]:
        # The waits due before the next tick are answered each at its time, in this pass
        ahead = runtime.settings.workflows.timer_scan_interval * LOOK_AHEAD
        fired = runtime.workflow_resumes.fire_due(runtime.db.now(), ahead)
        if fired:
            log.info("continued %d workflow runs whose timer or event timeout was due", fired)
        return {"fired": fired}

    @app.task(name=SCHEDULES_TASK, bind=True, **PERIODIC)
    def fire_schedules(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, SCHEDULES_TASK, forwarded, schedules_pass)

    def schedules_pass() -> dict[str, Any]:
        still_owner = functools.partial(runtime.leases.still_owner, SCHEDULES_TASK)
        result = runtime.schedule_firing.scan_once(runtime.db.now(), still_owner)
        if result.runs:
            log.info("started %d scheduled runs", len(result.runs))
        return result.as_json()

    @app.task(name=APPROVAL_EXPIRY_TASK, bind=True, **PERIODIC)
    def expire_approvals(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, APPROVAL_EXPIRY_TASK, forwarded, expiry_pass)

    def expiry_pass() -> dict[str, Any]:
        expired = runtime.approvals.expire_once(runtime.db.now())
        if expired:
            log.info("expired %d approvals", len(expired))
        return {"expired": len(expired), "resumed": sum(1 for d in expired if d.resumed)}
