"""The plain-Celery yardstick of B1 and B2: tasks on the same broker settings as ours.

It mirrors `tracon_jobs.worker.app.create_celery` (JSON, no results, early acks, no task or
sent events until a monitor asks) so that the ratio measures tracon's own work per run, not a
Celery setting.

- `bench.noop` (B1) INCRs a Redis counter: the only way the benchmark can see it finish.
- `bench.chat` (B2) makes one chat completion with the official `openai` client, one client
  shared by the pool's threads, and `bench.sleep` (B2's reference) sleeps as long as the
  model takes; `bench.chat_stream` (B2 `--stream`) makes the same call with `stream=True`
  and reads every chunk. Each pushes its start and end times (this host's clock) and counts itself
  done or failed, so the benchmark can take the span from the first start to the last end.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

BROKER_ENV = "BENCH_REDIS_URL"
MODEL_URL_ENV = "BENCH_MODEL_URL"
MODEL_DELAY_ENV = "BENCH_MODEL_DELAY"
QUEUE = "bench.noop"
TASK = "bench.noop"
COUNTER_KEY = "bench:noop:done"
CHAT_QUEUE = CHAT_TASK = "bench.chat"
CHAT_STREAM_QUEUE = CHAT_STREAM_TASK = "bench.chat_stream"
SLEEP_QUEUE = SLEEP_TASK = "bench.sleep"
SPANS_KEY = "bench:spans"  # "start end" per finished task, seconds since the epoch
DONE_KEY = "bench:done"
FAILED_KEY = "bench:failed"

broker_url = os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/14")

app = Celery("bench", broker=broker_url, set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    worker_send_task_events=False,  # as ours: on once a monitor asks (no monitor here)
    task_send_sent_event=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600},
)

counter = redis.Redis.from_url(broker_url)


@app.task(name=TASK, ignore_result=True)
def noop() -> None:
    counter.incr(COUNTER_KEY)


_client_lock = threading.Lock()
_client: Any = None


def openai_client() -> Any:
    """One `openai.OpenAI` for every thread, as an application would share it."""
    global _client
    with _client_lock:
        if _client is None:
            import openai

            _client = openai.OpenAI(
                base_url=os.environ[MODEL_URL_ENV], api_key="bench", max_retries=0, timeout=60
            )
        return _client


def timed(work: Callable[[], object]) -> None:
    """Run `work`, then record its span and count it done (or failed, and re-raise)."""
    started = time.time()
    try:
        work()
    except Exception:
        counter.incr(FAILED_KEY)
        raise
    pipe = counter.pipeline(transaction=False)
    pipe.rpush(SPANS_KEY, f"{started} {time.time()}")
    pipe.incr(DONE_KEY)
    pipe.execute()


@app.task(name=CHAT_TASK, ignore_result=True, queue=CHAT_QUEUE)
def chat(message: str) -> None:
    messages = [{"role": "user", "content": message}]
    timed(lambda: openai_client().chat.completions.create(model="bench-model", messages=messages))


@app.task(name=CHAT_STREAM_TASK, ignore_result=True, queue=CHAT_STREAM_QUEUE)
def chat_stream(message: str) -> None:
    messages = [{"role": "user", "content": message}]

    def read_all() -> str:
        chunks = openai_client().chat.completions.create(
            model="bench-model", messages=messages, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    timed(read_all)


@app.task(name=SLEEP_TASK, ignore_result=True, queue=SLEEP_QUEUE)
def sleep(message: str) -> None:
    timed(lambda: time.sleep(float(os.environ.get(MODEL_DELAY_ENV, "0.2"))))
