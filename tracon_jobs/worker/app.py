"""The Celery app: queues, reliability settings, and the task that executes a run.

Correctness never rests on the broker: prefetch is 1, messages are acknowledged when a
task starts (a crashed run is reconciled from SQL, not redelivered), duplicates are
dropped by the guarded claim, and unclaimed runs are re-sent by the requeue task. The
periodic tasks are added by `beat_schedules.install` in the processes that run them.

What Flower shows is the run's truth: the message carries `run_id`, `agent` and `tenant`
as keyword arguments (positional `[run_id]` messages still work), a run that ends `Failed`
makes its task fail with the run's error (`RunEndedFailed`, an expected exception: no
retry, no traceback in the log), and one that ends `Canceled` shows as revoked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task
from celery.exceptions import Ignore
from celery.signals import after_setup_logger, worker_init
from sqlalchemy import select

from tracon_jobs import logs, metrics, tracing
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, Tenant
from tracon_jobs.settings import Settings
from tracon_jobs.worker.brokers import broker_of
from tracon_jobs.worker.envelope import EXECUTE_TASK, RUNS_QUEUE, TRACEPARENT, label_runs_with
from tracon_jobs.worker.pool import PoolRoom

log = logging.getLogger(__name__)

RECEIVED_LOGGER = "celery.worker.strategy"
"""Celery's logger of `Task ... received`, a line per message at INFO, silenced in our
workers: each run already has its `succeeded` line, its `RunStarted` event and the
`task-received` event. It cost about 4% of a busy worker's CPU (B2); the logger's
errors still show."""

QUIET_LOGGERS = (RECEIVED_LOGGER, "httpx", "httpx2")
"""Loggers held at WARNING in a worker unless `TRACON_LOG_LEVEL` is `DEBUG`: Celery's
`received` line, and the HTTP client's `HTTP Request: POST ...` line per model call, which
says what the run's `ModelCallStarted` and `ModelCallCompleted` events say."""

DELAYED_DELIVERY_LOGGER = "kombu.transport.native_delayed_delivery"
"""Held at ERROR in a worker: on quorum queues (RabbitMQ, `brokers`) Celery sets up its native
delayed delivery as the worker starts, and this logger then warns, for each direct exchange
(the run and control queues', the worker's own queue's), that an ETA task sent there would
wait in the worker. No task of tracon-jobs is sent with an ETA or a countdown."""

CONTROL_QUEUE = "tracon.control"
"""The queue of the periodic tasks, apart from runs so a backlog never delays a scan."""
WORKER_POOL = "tracon_jobs.worker.pool:StartedTaskPool"
"""Celery's thread pool, its threads started with it (`pool.py`)."""


@dataclass(frozen=True)
class RunSummary:
    """What the task and the sender need to know of a run: its labels and its outcome."""

    run_id: str
    agent: str
    tenant: str  # the tenant's name
    status: str
    error_type: str | None = None
    error_message: str | None = None

    @property
    def error(self) -> str:
        if self.error_type and self.error_message:
            return f"{self.error_type}: {self.error_message}"
        return self.error_type or self.error_message or self.status


Describe = Callable[[str], RunSummary | None]


def describe_runs(db: Database) -> Describe:
    """`describe(run_id)`: one primary-key read of the run and its tenant's name."""

    def describe(run_id: str) -> RunSummary | None:
        query = (
            select(Run.agent, Tenant.name, Run.status, Run.error_type, Run.error_message)
            .join(Tenant, Tenant.id == Run.tenant_id)
            .where(Run.id == run_id)
        )
        with db.read() as session:
            row = session.execute(query).first()
        if row is None:
            return None
        agent, tenant, status, error_type, error_message = row
        return RunSummary(run_id, agent, tenant, status, error_type, error_message)

    return describe


class RunEndedFailed(Exception):
    """The run this task executed ended `Failed`; the message is the run's error."""


class RunEndedCanceled(Exception):
    """The run this task executed ended `Canceled` (reported as a revoked task)."""


def run_task(
    execute: Callable[[str], str],
    describe: Describe | None,
    run_id: str,
    agent: str | None = None,
    tenant: str | None = None,
) -> str:
    """The body of `tracon.runs.execute`: execute the run under its log context, record
    its metrics, and raise `RunEndedFailed`/`RunEndedCanceled` once the run is closed."""
    started = time.monotonic()
    with logs.run_context(run_id, tenant, agent):
        status = execute(run_id)
    seconds = time.monotonic() - started
    summary: RunSummary | None = None
    if status in ("Failed", "Canceled") or (agent is None and status in ("Completed", "Waiting")):
        summary = _describe(describe, run_id)
    metrics.run_finished(status, agent or (summary.agent if summary else "unknown"), seconds)
    if status == "Failed":
        raise RunEndedFailed(summary.error if summary else "the run failed")
    if status == "Canceled":
        raise RunEndedCanceled(summary.error if summary else "the run was canceled")
    return status


def _describe(describe: Describe | None, run_id: str) -> RunSummary | None:
    if describe is None:
        return None
    try:
        return describe(run_id)
    except Exception as exc:  # the run is closed already: a failed read only loses detail
        log.warning("run %s: could not read its outcome for the task: %s", run_id, exc)
        return None


def create_celery(
    settings: Settings,
    execute: Callable[[str], str],
    *,
    describe: Describe | None = None,
    draining: threading.Event | None = None,
) -> Celery:
    """The app of one process; `execute(run_id)` is the body of `tracon.runs.execute`.

    `describe(run_id)` (e.g. `describe_runs(db)`) gives a failed run's error to its task,
    and each sent message its agent and tenant; `draining` is reported by the worker's
    metrics endpoint (`TRACON_WORKER_METRICS_PORT`).
    """
    # Redis:Url (one server or a Sentinel group), or Broker:Url's RabbitMQ (`brokers`)
    broker = broker_of(settings)
    app = Celery("tracon", broker=broker.url, set_as_current=False)
    app.conf.update(
        task_queues=broker.queues([RUNS_QUEUE, CONTROL_QUEUE]),  # quorum queues on RabbitMQ
        task_default_queue=RUNS_QUEUE,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=False,
        worker_prefetch_multiplier=settings.worker.prefetch_multiplier,
        worker_pool=WORKER_POOL,
        worker_concurrency=settings.worker.threads,
        # Task events only once a monitor asks for them: Flower turns them on in every worker
        # as it starts (its `enable_events` broadcast, again every 5 s), and they stay on.
        # Without a monitor nobody reads them, and they were 14% of a worker's CPU for a
        # workflow without steps (three publishes a task).
        worker_send_task_events=False,
        worker_direct=True,  # a queue per worker: operators (and tests) can address one
        # Flower follows tasks from the worker's events; a `task-sent` event per run would
        # cost the web a second publish on every submission.
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        # Redis: one Redis client per channel; RabbitMQ: publisher confirms, short heartbeats
        **broker.celery_options(),
    )
    if not broker.amqp and settings.worker.prefetch_multiplier == 1:
        app.steps["consumer"].add(PoolRoom)  # a message only for an idle thread (`pool`)
    if describe is not None:
        label_runs_with(app, lambda run_id: _labels(describe, run_id))

    # shared=False: a shared task is copied into every Celery app created later in the
    # process, so a second app would run this closure over the first one's services.
    # throws: a run that ended Failed is an expected outcome, logged without a traceback.
    @app.task(
        name=EXECUTE_TASK,
        ignore_result=True,
        shared=False,
        bind=True,
        throws=(RunEndedFailed,),
        max_retries=0,
    )
    def execute_run(
        task: Task, run_id: str, agent: str | None = None, tenant: str | None = None
    ) -> str:
        try:
            with tracing.delivered(getattr(task.request, TRACEPARENT, None)):
                return run_task(execute, describe, run_id, agent, tenant)
        except RunEndedCanceled as canceled:
            _report_revoked(task, str(canceled))
            raise Ignore() from None  # no task-succeeded/-failed event after the revoked one

    _install_worker_hooks(app, draining)
    return app


def _labels(describe: Describe, run_id: str) -> tuple[str, str] | None:
    summary = describe(run_id)
    return None if summary is None else (summary.agent, summary.tenant)


def _report_revoked(task: Task, reason: str) -> None:
    """A `task-revoked` event, as Celery sends for a revoked task, with the run's reason."""
    if task.request.called_directly or not task.request.id:
        return
    try:
        task.send_event(
            "task-revoked",
            terminated=False,
            signum=None,
            expired=False,
            exception=f"RunEndedCanceled({reason!r})",
        )
    except Exception as exc:  # the run is closed: a lost event only costs Flower's view
        log.warning("task-revoked event not sent: %s", exc)


def _install_worker_hooks(app: Celery, draining: threading.Event | None) -> None:
    """In a worker of `app` only: run-aware logging, tracing (its pool is threads: no fork
    after this), and the metrics port when configured."""

    def on_init(sender: Any = None, **_kwargs: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        tracing.start("worker")
        logs.install()
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            for name in QUIET_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger(DELAYED_DELIVERY_LOGGER).setLevel(logging.ERROR)
        metrics.start_worker_server(draining)

    worker_init.connect(on_init, weak=False)


@after_setup_logger.connect
def _on_logging_setup(**_kwargs: Any) -> None:
    """Celery's logging setup may add a root handler after ours: give it the run fields."""
    logs.install()
