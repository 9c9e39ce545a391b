"""A worker's slots in the fair lines (`coordination.fair_share`): registered as the worker
becomes ready and every few seconds after, with its reserve threads, the runs it still runs
(their places stay taken) and the tenants' weights read from SQL; gone as it drains (and,
were it killed, when its registration ends, its runs' places with it).

Each registration also refills the runs on their way from the lines, so lines that waited
for a worker (none was alive) move as soon as one is.

The registration needs Redis only: the weights are read from SQL by a thread of their own and
the last ones read are registered. A database that does not answer (an outage, a failover
under way) must not let the worker's slots lapse while it runs: lined runs move only while a
worker is registered, and go out as its runs end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from tracon_jobs.coordination.fair_share import FairStore

log = logging.getLogger(__name__)

EVERY_SECONDS = 5.0


class WorkerCapacity:
    def __init__(
        self,
        app: Celery,
        store: FairStore,
        worker: str,
        slots: int,
        weights: Callable[[], dict[str, int]],
        send: Callable[[list[str]], None],
        draining: threading.Event,
        reserve: int = 0,
        running: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self.app = app
        self.store = store
        self.worker = worker
        self.slots = slots  # threads lined runs share
        self.reserve = reserve  # threads beyond them, for runs of tenants without a line
        self.running = running  # the runs this worker executes now
        self.weights = weights
        self.send = send  # runs handed over that the caller sends (no messages kept)
        self.draining = draining
        self._thread: threading.Thread | None = None
        self._weights: dict[str, int] = {}  # as last read from SQL

    def install(self) -> None:
        def on_ready(sender: Any = None, **_kwargs: Any) -> None:
            if getattr(sender, "app", None) is not self.app:
                return
            # the pool's size, which `-c` on the command line may have set
            pool = getattr(getattr(sender, "controller", None), "concurrency", None)
            if isinstance(pool, int) and pool > 0:
                self.reserve = min(self.reserve, pool - 1)
                self.slots = pool - self.reserve
            self.start()

        worker_ready.connect(on_ready, weak=False)

    def start(self) -> None:
        if self._thread is None:
            # (weights registered before have stayed in Redis: the first registration, made
            # before any is read, changes none)
            threading.Thread(target=self._read, daemon=True, name="fair-weights").start()
            self._thread = threading.Thread(target=self._run, daemon=True, name="fair-capacity")
            self._thread.start()

    def register(self) -> None:
        running = list(self.running())
        weights = self._weights
        self.send(self.store.register(self.worker, self.slots, weights, self.reserve, running))

    def read_weights(self) -> None:
        """The tenants' weights from SQL, for the next registrations (a failure is logged and
        the last ones read stay)."""
        try:
            self._weights = self.weights()
        except Exception as exc:
            log.warning("tenants' weights not read for fair dispatch: %s", exc)

    def _read(self) -> None:
        while not self.draining.is_set():
            self.read_weights()
            self.draining.wait(EVERY_SECONDS)

    def _run(self) -> None:
        while not self.draining.is_set():
            try:
                self.register()
            except Exception as exc:  # the next turn tries again; the registration lasts 15 s
                log.warning("worker slots not registered for fair dispatch: %s", exc)
            self.draining.wait(EVERY_SECONDS)
        try:
            self.store.leave(self.worker)
        except Exception as exc:  # its registration ends by itself
            log.warning("worker slots not withdrawn from fair dispatch: %s", exc)


def start_with_worker(app: Celery, start: Callable[[], None]) -> None:
    """Call `start` once this app's worker is ready (the webhook deliverer): a process that
    only sends runs (the web) never starts it."""

    def on_ready(sender: Any = None, **_kwargs: Any) -> None:
        if getattr(sender, "app", None) is app:
            start()

    worker_ready.connect(on_ready, weak=False)
