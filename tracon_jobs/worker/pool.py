"""The worker's pool: Celery's thread pool, with every thread started before the first task,
and a worker that takes a message only for an idle thread.

Celery's pool (`concurrent.futures.ThreadPoolExecutor`) starts a thread when a task finds
none idle, on the consumer's thread, and `Thread.start` waits there until the new thread
runs. A worker that starts on a backlog starts one thread per task of its first wave, each
start waiting for the interpreter lock that the tasks already running hold: the consumer
hands out the wave one task every few milliseconds, and the model calls of 100 slots went
out over about 300 ms instead of all at once. Started with the pool, before the consumer
takes a message, the threads are idle and waiting when the backlog arrives.

A message is acknowledged as its task starts, which frees its place in Celery's prefetch: on
its own, a worker whose every thread is busy goes on taking messages, which wait in its pool
behind calls that may last minutes while another worker sits idle. `PoolRoom` (on a Redis
broker at `Worker.PrefetchMultiplier` 1) lets the consumer take messages only while the pool
has an idle thread, and bounds the `broker` fast path's batches by the idle threads. While
every thread is busy the consumer's loop no longer asks the broker, and nothing in it would
notice a thread freeing before its poll times out (up to a second): the pool wakes the loop
(`Hub.call_soon` from the thread) when a task's end frees a full pool. A run that told the fair
lines its end (just before its final write, when the next run's message is sent) counts as
idle already (`leaving`), and telling it wakes the loop as well: the next message is taken
while the thread finishes, as Celery's prefetch would have had it waiting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.concurrency.thread import TaskPool
from celery.worker import state as worker_state

from tracon_jobs import leaving
from tracon_jobs.startup import freeze_startup_objects
from tracon_jobs.worker.broker import TakingQoS

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0
"""Seconds the pool's threads may take to start; after it the worker goes on without them
(Celery starts the missing ones as tasks need them, as it would have anyway)."""


class StartedTaskPool(TaskPool):
    """`--pool threads`, with its `limit` threads started at once; `room_freed` is called on
    the thread of a task whose end frees a pool that was full (`PoolRoom`)."""

    room_freed: Callable[[], object] | None = None

    def on_start(self) -> None:
        super().on_start()
        everyone = threading.Barrier(self.limit + 1, timeout=START_TIMEOUT)
        for _ in range(self.limit):
            self.executor.submit(_wait_at, everyone)
        _wait_at(everyone)
        freeze_startup_objects()  # the worker is built: the consumer starts next

    def on_apply(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        **options: Any,
    ) -> Any:
        if callback is not None and self.room_freed is not None:
            callback = self._then_room(callback, self.room_freed)
        return super().on_apply(target, args, kwargs, callback, accept_callback, **options)

    @staticmethod
    def busy() -> int:
        """Threads running a task or about to (Celery's reserved requests), less those whose
        run told its end (`leaving`): the next run's message is for that thread."""
        return len(worker_state.reserved_requests) - leaving.count()

    def _then_room(
        self, callback: Callable[..., Any], room_freed: Callable[[], object]
    ) -> Callable[..., Any]:
        """`callback` (the request's end: Celery's `task_ready` takes it out of the reserved
        requests), then `room_freed` if the pool was full until then, or is one short of it
        now (the loop may have filled the thread this end was freeing, and paused)."""

        def ended(*args: Any) -> None:
            full = self.busy() >= self.limit
            try:
                leaving.ended()
                callback(*args)
            finally:
                if full or self.busy() >= self.limit - 1:
                    room_freed()

        return ended


def _wait_at(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        if threading.current_thread() is threading.main_thread():
            log.warning("the pool's threads did not all start within %.0fs", START_TIMEOUT)


class PoolRoom(bootsteps.StartStopStep):
    """A consumer step, after Celery's `Tasks` (at every start, reconnections included): the
    consumer takes a message only while the pool has an idle thread (the bound of Celery's
    `worker_disable_prefetch`, which would leave the loop asleep as a thread frees), one
    batch of the `broker` fast path holds no more than the idle threads
    (`broker.QoS.idle_threads`), and a task's end that frees a full pool wakes the loop to
    ask the broker again."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        pool, hub = c.pool, c.hub
        if not isinstance(pool, StartedTaskPool) or hub is None:
            return  # Celery's own pool (`--pool threads`), or no event loop: its prefetch
        limit = int(pool.limit)
        qos = c.task_consumer.channel.qos
        taken_for_granted = qos.can_consume

        def can_consume() -> bool:
            return pool.busy() < limit and bool(taken_for_granted())

        qos.can_consume = can_consume
        if isinstance(qos, TakingQoS):
            qos.idle_threads = lambda: limit - pool.busy()
        pool.room_freed = lambda: hub.call_soon(_nothing)
        # a run that tells its end frees its thread for the next message
        leaving.listen(lambda: pool.busy() >= limit - 1 and hub.call_soon(_nothing))


def _nothing() -> None:
    """What the loop is woken for: its next turn asks `can_consume` again."""
