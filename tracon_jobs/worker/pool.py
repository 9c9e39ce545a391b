"""The worker's pool: Celery's thread pool, with every thread started before the first task.

Celery's pool (`concurrent.futures.ThreadPoolExecutor`) starts a thread when a task finds
none idle, on the consumer's thread, and `Thread.start` waits there until the new thread
runs. A worker that starts on a backlog starts one thread per task of its first wave, each
start waiting for the interpreter lock that the tasks already running hold: the consumer
hands out the wave one task every few milliseconds, and the model calls of 100 slots went
out over about 300 ms instead of all at once. Started with the pool, before the consumer
takes a message, the threads are idle and waiting when the backlog arrives.
"""

from __future__ import annotations

import logging
import threading

from celery.concurrency.thread import TaskPool

from tracon_jobs.startup import freeze_startup_objects

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0
"""Seconds the pool's threads may take to start; after it the worker goes on without them
(Celery starts the missing ones as tasks need them, as it would have anyway)."""


class StartedTaskPool(TaskPool):
    """`--pool threads`, with its `limit` threads started at once."""

    def on_start(self) -> None:
        super().on_start()
        everyone = threading.Barrier(self.limit + 1, timeout=START_TIMEOUT)
        for _ in range(self.limit):
            self.executor.submit(_wait_at, everyone)
        _wait_at(everyone)
        freeze_startup_objects()  # the worker is built: the consumer starts next


def _wait_at(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        if threading.current_thread() is threading.main_thread():
            log.warning("the pool's threads did not all start within %.0fs", START_TIMEOUT)
