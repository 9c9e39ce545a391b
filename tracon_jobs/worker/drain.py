"""A worker's graceful stop: refuse new runs, give in-flight runs `Drain.Timeout`, then exit.

Celery's own warm shutdown waits for tasks forever and its SIGTERM handler cannot
be bounded, so once the worker is ready we take SIGTERM over. With `Drain.Enabled` the
worker stops consuming, waits for its executing runs up to the timeout, then lets Celery
finish a warm shutdown (unstarted messages go back to the broker) or, with runs still
stuck, exits hard and leaves them to reconciliation. Without drain it exits at once.

A web node drains by its flag file (`tracon_jobs.drain_file`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from tracon_jobs import tracing
from tracon_jobs.runs.live import LiveRuns
from tracon_jobs.settings import DrainSettings

log = logging.getLogger(__name__)


class WorkerDrain:
    """A worker's graceful stop: stop consuming, wait for live runs, then exit."""

    def __init__(
        self,
        app: Celery,
        config: DrainSettings,
        draining: threading.Event,
        live_runs: LiveRuns,
        queues: list[str],
    ) -> None:
        self.app = app
        self.config = config
        self.draining = draining  # the executor claims nothing once it is set
        self.live_runs = live_runs
        self.queues = queues

    def install(self) -> None:
        """Take SIGTERM over once this app's worker is ready (signal handlers: main thread)."""

        def on_ready(sender: Any = None, **_kwargs: Any) -> None:
            if getattr(sender, "app", None) is not self.app:
                return
            if threading.current_thread() is not threading.main_thread():
                log.warning("worker not in the main thread; SIGTERM keeps Celery's handler")
                return
            hostname = str(getattr(sender, "hostname", ""))
            signal.signal(signal.SIGTERM, lambda *_: self.on_term(hostname))

        worker_ready.connect(on_ready, weak=False)

    def on_term(self, hostname: str) -> None:
        if not self.config.enabled:
            log.warning("SIGTERM: exiting at once (Drain disabled); runs in flight are cut off")
            _exit(0)
        if self.draining.is_set():
            return
        self.draining.set()
        timeout = self.config.timeout.total_seconds()
        log.warning("SIGTERM: draining for up to %.1fs", timeout)
        threading.Thread(
            target=self._drain_then_exit, args=(hostname, timeout), daemon=True, name="drain"
        ).start()

    def _drain_then_exit(self, hostname: str, timeout: float) -> None:
        self._stop_consuming(hostname)
        deadline = time.monotonic() + timeout
        while self.live_runs.snapshot() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.live_runs.snapshot()
        if left:
            log.error("drain timeout: cutting off %d runs (reconciliation closes them)", len(left))
            _exit(1)
        log.warning("drained; stopping")
        from celery.worker import state

        state.should_stop = 0  # Celery's warm shutdown: nothing runs, unstarted messages return
        time.sleep(10)
        _exit(0)  # a warm shutdown that hangs must not block a deployment

    def _stop_consuming(self, hostname: str) -> None:
        try:
            for queue in self.queues:
                self.app.control.cancel_consumer(queue, destination=[hostname])
        except Exception as exc:  # the executor refuses new claims anyway
            log.warning("could not stop consuming while draining: %s", exc)


EXIT_FLUSH_SECONDS = 2.0
"""How long an exit waits for the spans still batched to be exported (when tracing)."""


def _exit(code: int) -> None:
    """`os._exit`, after the spans this process still holds are sent (bounded)."""
    tracing.flush(EXIT_FLUSH_SECONDS)
    os._exit(code)
