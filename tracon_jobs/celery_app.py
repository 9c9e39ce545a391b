"""The Celery app: queues, reliability settings, tasks.

Correctness never rests on the broker: prefetch is 1, messages are acknowledged when a
task starts (a crashed run is reconciled from SQL, not redelivered), duplicates are
dropped by the guarded claim, and unclaimed runs are re-sent by the requeue task.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from celery import Celery, Task
from kombu import Queue

from beat_schedules import build_schedule, reconcile, retention
from beat_schedules.requeue import scan_once
from beat_schedules.schedule import (
    CONTROL_QUEUE,
    IDEMPOTENCY_PURGE_TASK,
    RECONCILE_TASK,
    REQUEUE_TASK,
)
from tracon_jobs.coordination.periodic import run_periodic
from tracon_jobs.drain import install_worker_drain
from tracon_jobs.runs.dispatch import EXECUTE_TASK, RUNS_QUEUE

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime

log = logging.getLogger(__name__)


def create_celery(runtime: Runtime) -> Celery:
    settings = runtime.settings
    app = Celery("tracon", broker=settings.redis.url, set_as_current=False)
    app.conf.update(
        task_queues=[Queue(RUNS_QUEUE), Queue(CONTROL_QUEUE)],
        task_default_queue=RUNS_QUEUE,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=False,
        worker_prefetch_multiplier=settings.worker.prefetch_multiplier,
        worker_pool="threads",
        worker_concurrency=settings.worker.concurrency,
        worker_send_task_events=True,
        worker_direct=True,  # a queue per worker: operators (and tests) can address one
        # Flower follows tasks from the worker's events; a `task-sent` event per run would
        # cost the web a second publish on every submission.
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        beat_schedule=build_schedule(settings),
        timezone="UTC",
    )
    app.tracon = runtime
    register_tasks(app, runtime)
    install_worker_drain(app, runtime, [RUNS_QUEUE, CONTROL_QUEUE])
    return app


def register_tasks(app: Celery, runtime: Runtime) -> None:
    # shared=False everywhere: a shared task is copied into every Celery app created later
    # in the process, so a second Runtime's app would run these closures over the first.
    @app.task(name=EXECUTE_TASK, ignore_result=True, shared=False)
    def execute(run_id: str) -> str:
        return runtime.executor.execute(run_id)

    @app.task(name=REQUEUE_TASK, ignore_result=True, shared=False)
    def requeue_unclaimed() -> dict[str, Any]:
        result = scan_once(runtime, runtime.db.now())
        if result.resent:
            log.info("re-sent %d unclaimed runs", len(result.resent))
        return {"resent": len(result.resent), "failed": len(result.failed)}

    @app.task(name=RECONCILE_TASK, ignore_result=True, shared=False, bind=True)
    def reconcile_orphaned_runs(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, RECONCILE_TASK, forwarded, reconcile_pass)

    def reconcile_pass() -> dict[str, Any]:
        still_owner = functools.partial(runtime.leases.still_owner, RECONCILE_TASK)
        result = reconcile.scan_once(runtime, runtime.db.now(), still_owner)
        return {
            "orphaned": len(result.orphaned),
            "canceled": len(result.canceled),
            "continued": len(result.continued),
        }

    @app.task(name=IDEMPOTENCY_PURGE_TASK, ignore_result=True, shared=False, bind=True)
    def purge_idempotency_records(task: Task, forwarded: bool = False) -> Any:
        return run_periodic(runtime, task, IDEMPOTENCY_PURGE_TASK, forwarded, purge_pass)

    def purge_pass() -> dict[str, Any]:
        result = retention.scan_once(runtime, runtime.db.now())
        if result.deleted:
            log.info("deleted %d idempotency records past retention", result.deleted)
        return {"enabled": result.enabled, "deleted": result.deleted}
