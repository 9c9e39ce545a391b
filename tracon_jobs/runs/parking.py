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

import logging
import threading
from collections import Counter

from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import RunStore
from tracon_jobs.timers import timers

log = logging.getLogger(__name__)

THREAD = "parked-runs"


class Resumer:
    """Sends this process's parked runs again when they are due (a timer thread of its own:
    sending is IO)."""

    def __init__(self, runs: RunStore, dispatcher: RunDispatcher) -> None:
        self.runs = runs
        self.dispatcher = dispatcher
        self._lock = threading.Lock()
        self._due: Counter[str] = Counter()  # run id -> sends still to come
        self._stopped = threading.Event()

    def stop(self) -> None:
        """The process closes: sends still to come are left to the requeue scan."""
        self._stopped.set()

    def at(self, run_id: str, seconds: float, after: str = "parked") -> None:
        """Send run `run_id` again in `seconds`; `after`: what it waited for (`RunResumed`)."""
        with self._lock:
            self._due[run_id] += 1
        timers(THREAD).after(seconds, lambda: self._resume(run_id, after))

    def pending(self) -> int:
        """This resumer's sends still to come."""
        with self._lock:
            return sum(self._due.values())

    def _resume(self, run_id: str, after: str) -> None:
        with self._lock:
            self._due[run_id] -= 1
            if self._due[run_id] <= 0:
                del self._due[run_id]
        if self._stopped.is_set():
            return
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
