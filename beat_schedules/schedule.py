"""Which periodic task runs how often. Each entry expires within its own interval, so a
stalled beat or a busy worker never piles them up."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from tracon_jobs.settings import Settings
from tracon_jobs.worker.app import CONTROL_QUEUE

__all__ = [
    "APPROVAL_EXPIRY_TASK",
    "CONTROL_QUEUE",
    "IDEMPOTENCY_PURGE_TASK",
    "RECONCILE_TASK",
    "REQUEUE_TASK",
    "RUN_RETENTION_TASK",
    "SCHEDULES_TASK",
    "WORKFLOW_TIMERS_TASK",
    "build_schedule",
]

REQUEUE_TASK = "tracon.runs.requeue_unclaimed"
IDEMPOTENCY_PURGE_TASK = "tracon.idempotency.purge"
RECONCILE_TASK = "tracon.reconcile.scan"
APPROVAL_EXPIRY_TASK = "tracon.approvals.expire"
WORKFLOW_TIMERS_TASK = "tracon.workflows.timers"
RUN_RETENTION_TASK = "tracon.runs.retention"
SCHEDULES_TASK = "tracon.schedules.fire"


def requeue_interval(settings: Settings) -> float:
    """A quarter of `RequeueAfter`, between 1 and 5 seconds: the pass also sends again a
    dead worker's runs, as soon as its liveness ends (`coordination.held`)."""
    quarter = settings.runs.requeue_after / 4
    return min(max(quarter, timedelta(seconds=1)), timedelta(seconds=5)).total_seconds()


def idempotency_purge_interval(retention: timedelta) -> float:
    """A twenty-fourth of the retention (an hour for the default day), at least a minute."""
    return min(max(retention / 24, timedelta(minutes=1)), timedelta(hours=1)).total_seconds()


def build_schedule(settings: Settings, tenant_retention: bool = False) -> dict[str, dict[str, Any]]:
    """Every periodic task this configuration runs; `tenant_retention`: some tenant has a
    run retention of its own (`tracon-jobs tenants retention`), which the settings cannot
    tell."""
    interval = requeue_interval(settings)
    schedule = {
        "requeue-unclaimed-runs": {
            "task": REQUEUE_TASK,
            "schedule": interval,
            "options": {"expires": interval, "queue": CONTROL_QUEUE},
        }
    }
    if settings.run_reconciliation.enabled:
        scan = settings.run_reconciliation.scan_interval.total_seconds()
        schedule["reconcile-orphaned-runs"] = {
            "task": RECONCILE_TASK,
            "schedule": scan,
            "options": {"expires": scan, "queue": CONTROL_QUEUE},
        }
    timers = settings.workflows.timer_scan_interval.total_seconds()
    schedule["fire-workflow-timers"] = {
        "task": WORKFLOW_TIMERS_TASK,
        "schedule": timers,
        "options": {"expires": timers, "queue": CONTROL_QUEUE},
    }
    if settings.schedules.enabled:
        scan = settings.schedules.scan_interval.total_seconds()
        schedule["fire-schedules"] = {
            "task": SCHEDULES_TASK,
            "schedule": scan,
            "options": {"expires": scan, "queue": CONTROL_QUEUE},
        }
    expiry = settings.approvals.expiry_scan_interval.total_seconds()
    schedule["expire-approvals"] = {
        "task": APPROVAL_EXPIRY_TASK,
        "schedule": expiry,
        "options": {"expires": expiry, "queue": CONTROL_QUEUE},
    }
    retention = settings.retention.idempotency_retention
    if retention is not None:
        purge = idempotency_purge_interval(retention)
        schedule["purge-idempotency-records"] = {
            "task": IDEMPOTENCY_PURGE_TASK,
            "schedule": purge,
            "options": {"expires": purge, "queue": CONTROL_QUEUE},
        }
    if settings.runs.retention is not None or tenant_retention:
        scan = settings.runs.retention_scan_interval.total_seconds()
        schedule["delete-runs-past-retention"] = {
            "task": RUN_RETENTION_TASK,
            "schedule": scan,
            "options": {"expires": scan, "queue": CONTROL_QUEUE},
        }
    return schedule
