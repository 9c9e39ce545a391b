"""Parked runs sent again when they may go on.

A run whose next model call would wait long (its provider's rate limits spent) is saved
`Queued` with its conversation and a `RunParked` event (`RunStore.park`), and its worker
thread is free. The process that parked it sends it again at the time it named, with
`RunResumed` first; any worker claims it then (a new fence) and goes on from the saved
turn. A process that dies meanwhile loses nothing: the run's `enqueued_at` is that time, so
the requeue scan sends it once `Runs.RequeueAfter` has passed beyond it. A run canceled
while parked is not sent again (a cancel of a `Queued` run ends it at once).
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time

from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import RunStore

log = logging.getLogger(__name__)


class Resumer:
    """One thread per process that sends its parked runs again when they are due."""

    def __init__(self, runs: RunStore, dispatcher: RunDispatcher) -> None:
        self.runs = runs
        self.dispatcher = dispatcher
        self._cond = threading.Condition()
        self._due: list[tuple[float, str, str]] = []
        self._pid: int | None = None

    def at(self, run_id: str, seconds: float, after: str = "parked") -> None:
        """Send run `run_id` again in `seconds`; `after`: what it waited for (`RunResumed`)."""
        with self._cond:
            if self._pid != os.getpid():  # first use in this process (a fork has no thread)
                self._pid = os.getpid()
                self._due = []
                threading.Thread(target=self._run, name="parked-runs", daemon=True).start()
            heapq.heappush(self._due, (time.monotonic() + seconds, run_id, after))
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._due)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0][0] > time.monotonic():
                    timeout = None if not self._due else self._due[0][0] - time.monotonic()
                    self._cond.wait(timeout)
                _, run_id, after = heapq.heappop(self._due)
            try:
                self.resume(run_id, after)
            except Exception:  # the requeue scan sends it instead
                log.exception("parked run %s not sent again", run_id)

    def resume(self, run_id: str, after: str = "parked") -> bool:
        """`RunResumed`, then the run's message; False when it no longer waits to go on."""
        run = self.runs.get(run_id)
        if run is None or run.status != RunStatus.QUEUED.value:
            return False
        self.runs.append(None, "RunResumed", {"after": after}, run_id=run_id)
        return self.dispatcher.resend(run_id)
