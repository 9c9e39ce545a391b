"""The Celery app: queues, reliability settings, and the task that executes a run.

Correctness never rests on the broker: prefetch is 1, messages are acknowledged when a
task starts (a crashed run is reconciled from SQL, not redelivered), duplicates are
dropped by the guarded claim, and unclaimed runs are re-sent by the requeue task. The
periodic tasks are added by `beat_schedules.install` in the processes that run them.
"""

from __future__ import annotations

from collections.abc import Callable

from celery import Celery
from kombu import Queue

from tracon_jobs.runs.dispatch import EXECUTE_TASK, RUNS_QUEUE
from tracon_jobs.settings import Settings

CONTROL_QUEUE = "tracon.control"
"""The queue of the periodic tasks, apart from runs so a backlog never delays a scan."""


def create_celery(settings: Settings, execute: Callable[[str], str]) -> Celery:
    """The app of one process; `execute(run_id)` is the body of `tracon.runs.execute`."""
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
        timezone="UTC",
    )

    # shared=False: a shared task is copied into every Celery app created later in the
    # process, so a second app would run this closure over the first one's services.
    @app.task(name=EXECUTE_TASK, ignore_result=True, shared=False)
    def execute_run(run_id: str) -> str:
        return execute(run_id)

    return app
