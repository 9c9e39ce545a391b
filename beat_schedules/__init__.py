"""The beat schedule and the thin periodic task definitions.

The core never imports this package: whatever starts a worker or beat (the `tracon-jobs`
command, a test) calls `install(runtime.celery, runtime)` to add the periodic tasks and
their schedule to the process's Celery app.
"""

from __future__ import annotations

import weakref

from celery import Celery

from beat_schedules.schedule import build_schedule
from beat_schedules.tasks import register_periodic_tasks
from tracon_jobs.runs.retention import has_any_retention
from tracon_jobs.runtime import Runtime

__all__ = ["build_schedule", "install"]

_installed: weakref.WeakSet[Celery] = weakref.WeakSet()


def install(app: Celery, runtime: Runtime) -> None:
    """Register the periodic tasks on `app` and give its beat their schedule."""
    if app in _installed:
        return
    tenant_retention = has_any_retention(runtime.run_retention)
    app.conf.beat_schedule = build_schedule(runtime.settings, tenant_retention)
    register_periodic_tasks(app, runtime)
    _installed.add(app)
