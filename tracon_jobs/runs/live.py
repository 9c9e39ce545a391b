"""The runs this worker process is executing: their heartbeats and their cancellation.

One background thread per process does the SQL side for all of them at once: a bulk,
fence-guarded heartbeat every `HeartbeatInterval` (when reconciliation is on) and a poll of
persisted cancel requests every second. Cancel notices from Redis abort a run at once; the
poll is what makes a cancel survive a lost notice or a flushed Redis. A run missing from a
heartbeat's answer was taken away: its signal fires and the executor stops before its next
model or tool call.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from tracon_jobs.abort import AbortSignal
from tracon_jobs.coordination.cancellation import CancelBus
from tracon_jobs.runs.lifecycle import AnyClaim
from tracon_jobs.runs.store import RunStore

log = logging.getLogger(__name__)

CANCELED = "canceled"
TAKEN_AWAY = "taken_away"


@dataclass
class _Live:
    claim: AnyClaim
    signal: AbortSignal


class LiveRuns:
    """The runs this process executes: one heartbeat writer and cancel delivery for all."""

    def __init__(
        self,
        store: RunStore,
        bus: CancelBus,
        heartbeat_interval: timedelta | None,
        poll_seconds: float = 1.0,
    ) -> None:
        self.store = store
        self.bus = bus
        self.heartbeat_seconds = heartbeat_interval.total_seconds() if heartbeat_interval else None
        self.poll_seconds = poll_seconds
        self._runs: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def register(self, claim: AnyClaim, signal: AbortSignal) -> None:
        with self._lock:
            self._runs[claim.run_id] = _Live(claim, signal)
            if self._thread is None:
                self.bus.subscribe(self.on_cancel_notice)
                self._thread = threading.Thread(
                    target=self._tick_forever, daemon=True, name="live-runs"
                )
                self._thread.start()

    def unregister(self, run_id: str) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    def on_cancel_notice(self, run_id: str) -> None:
        self._abort(run_id, CANCELED)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {run_id: live.claim.fence for run_id, live in self._runs.items()}

    def tick(self, heartbeat_due: bool) -> None:
        """One pass: heartbeat (when due) and look for persisted cancel requests."""
        owned = self.snapshot()
        if not owned:
            return
        if heartbeat_due:
            self.beat(owned)
        for run_id in self.store.cancel_requested(list(owned)):
            self._abort(run_id, CANCELED)

    def beat(self, owned: dict[str, int]) -> None:
        """Heartbeat the claims `owned` (run id -> fence, as read before) and stop the
        execution of each one that is gone; only that claim's: the run may have a new claim
        here since (a decision continues the same row with the next fence)."""
        for run_id in set(owned) - self.store.heartbeat(owned):
            if self._abort(run_id, TAKEN_AWAY, fence=owned[run_id]):
                log.warning("run %s was taken away from this process", run_id)

    def _abort(self, run_id: str, reason: str, *, fence: int | None = None) -> bool:
        """Abort the run's execution here (only the one of `fence`, when given)."""
        with self._lock:
            live = self._runs.get(run_id)
        if live is None or (fence is not None and live.claim.fence != fence):
            return False
        live.signal.abort(reason)
        return True

    def _tick_forever(self) -> None:
        last_heartbeat = 0.0
        while not self._stopped.wait(self.poll_seconds):
            now = time.monotonic()
            due = (
                self.heartbeat_seconds is not None
                and now - last_heartbeat >= self.heartbeat_seconds
            )
            try:
                self.tick(due)
            except Exception as exc:  # logged; the next interval tries again
                log.warning("heartbeat/cancel poll failed, retrying next interval: %s", exc)
                continue
            if due:
                last_heartbeat = now
