"""The plain-Celery yardstick for B1: a no-op task on the same broker settings as ours.

It mirrors `tracon_jobs.celery_app.create_celery` (JSON, no results, early acks, task and
sent events) so that the ratio measures tracon's own work per run, not a Celery setting.
Each task INCRs a Redis counter: the only way the benchmark can see it finish.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

BROKER_ENV = "BENCH_REDIS_URL"
QUEUE = "bench.noop"
TASK = "bench.noop"
COUNTER_KEY = "bench:noop:done"

broker_url = os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/14")

app = Celery("bench", broker=broker_url, set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    worker_send_task_events=True,
    task_send_sent_event=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600},
)

counter = redis.Redis.from_url(broker_url)


@app.task(name=TASK, ignore_result=True)
def noop() -> None:
    counter.incr(COUNTER_KEY)
