"""The worker's Celery consumer, sending task events to Flower in batches.

Celery buffers a worker's task events and flushes them on the next turn of its event
loop: with a thread pool every event wakes the loop from the pool thread (a socket write)
and most flushes carry one or two events, so a run costs about two broker publishes and two
wake-ups for its `task-received`, `task-started` and `task-succeeded`. Here the first event
of a batch schedules one flush `EVENT_FLUSH_SECONDS` later, and the events sent meanwhile
go with it: Flower sees them up to that much later, in the same order. A full buffer is
still flushed at once by Celery, and whatever is buffered when the worker stops is flushed.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer

log = logging.getLogger(__name__)

EVENT_FLUSH_SECONDS = 0.1
"""How long a task event may wait for others to share its publish."""

CONSUMER = "tracon_jobs.worker.events:BatchingConsumer"
"""Celery's `worker_consumer`."""


class BatchingConsumer(Consumer):
    _flush_due = False

    def on_send_event_buffered(self) -> None:
        """From any thread: the first event of a batch schedules its flush."""
        if self.hub is None or self._flush_due:
            return
        self._flush_due = True
        self.hub.call_soon(self._schedule_flush)

    def _schedule_flush(self) -> None:
        self.hub.call_later(EVENT_FLUSH_SECONDS, self._flush_batch)

    def _flush_batch(self) -> None:
        self._flush_due = False  # an event sent from now on schedules the next flush
        self._flush_events()

    def stop(self) -> Any:
        self._flush_quietly()
        return super().stop()

    def shutdown(self) -> Any:
        self._flush_quietly()
        return super().shutdown()

    def _flush_quietly(self) -> None:
        try:
            self._flush_events()
        except Exception as exc:  # the broker is gone: the events were only Flower's
            log.warning("task events not sent as the worker stopped: %s", exc)
