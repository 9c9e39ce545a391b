"""Which worker holds which run's message, so a dead worker's runs go out again at once and a
live worker's are never sent twice.

A worker takes messages from the broker before its threads are free for them (Celery's
prefetch), and a message it took stays invisible to every other worker until the broker's
visibility timeout (an hour) if the worker is killed. The requeue pass used to send again every
run still `Queued` after `Runs.RequeueAfter`: a minute's wait after a crash, and a second
message for a run a live but busy worker held all along.

Here each worker records the runs it holds, from the moment Celery hands it a message
(`task_received`) to the end of the run's task, in a set of its own (`tj:held:<worker>`), and
keeps a liveness key (`tj:alive:<worker>`, `ALIVE_MS`) fresh while it runs. The requeue pass
(beat, under its lease) then:

- sends again, at once, the runs a worker held whose liveness ended (killed, or cut off for
  `ALIVE_MS`) and that are still `Queued` in SQL (a claimed run is the orphan scan's), then
  forgets that worker;
- leaves alone, whatever their age, the runs a live worker holds.

A worker is live only while it can also reach SQL: its liveness is refreshed after a check of
the database (`healthy`, bounded by `HEALTH_SECONDS`), so a worker cut off from SQL but not from
Redis, which holds messages it cannot claim, counts as dead and its runs go to the others.

The records are written by a thread of the worker in batches (`FLUSH_SECONDS`): taking a
message costs the consumer's loop no round trip. A worker killed before its batch went out
leaves those runs to `Runs.RequeueAfter`, as before. A duplicate message stays harmless
either way: the guarded claim lets one delivery execute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import redis

log = logging.getLogger(__name__)

HOLDERS = "tj:holders"
ALIVE_MS = 10_000
"""How long a worker's liveness lasts without a refresh: it is refreshed every third of it."""
FLUSH_SECONDS = 0.05
"""How long a taken message's record may wait to be written with others."""
HEALTH_SECONDS = 5.0
"""How long the database check before a liveness refresh may take: a check still unanswered
then (a link that drops packets leaves it waiting for TCP) counts as a failure."""


def _held(worker: str) -> str:
    return f"tj:held:{{{worker}}}"


def _alive(worker: str) -> str:
    return f"tj:alive:{{{worker}}}"


class HeldRuns:
    """A worker's record of the runs it holds (`took`, `let_go`), written by its own thread."""

    def __init__(
        self,
        client: redis.Redis,
        worker: str,
        alive_ms: int = ALIVE_MS,
        healthy: Callable[[], object] | None = None,
    ) -> None:
        self.client = client
        self.worker = worker
        self.alive_ms = alive_ms
        self.healthy = healthy  # raises (or never returns) when the worker cannot reach SQL
        self._check: threading.Thread | None = None
        self._outcome: list[bool] = []
        self._changes: deque[tuple[bool, str]] = deque()  # (held?, run id), in order
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="held-runs")
            self._thread.start()

    def took(self, run_id: str) -> None:
        """The worker took `run_id`'s message from the broker."""
        self._changes.append((True, run_id))
        self._wake.set()

    def let_go(self, run_id: str) -> None:
        """The run's task ended here (it ran, was dropped, or was handed back)."""
        self._changes.append((False, run_id))
        self._wake.set()

    def stop(self) -> None:
        """At a graceful stop: the last records, and the worker leaves (nothing is held)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(_held(self.worker), _alive(self.worker))
            pipe.srem(HOLDERS, self.worker)
            pipe.execute()
        except redis.RedisError as exc:  # its liveness ends by itself; its runs are re-sent
            log.warning("held runs of %s not withdrawn: %s", self.worker, exc)

    def _run(self) -> None:
        refresh = self.alive_ms / 3000
        checked = -refresh
        while not self._stop.is_set():
            alive = None
            if time.monotonic() - checked >= refresh:  # the liveness, a third of its life
                # refreshed after a check that answered; a failed one leaves it to run out, so
                # a worker is dead once no check answered for `alive_ms` (one slow check, a
                # pool busy for a moment, does not end it)
                alive = True if self._can_reach_sql() else None
                checked = time.monotonic()
            try:
                self.flush(alive)
            except redis.RedisError as exc:  # kept, and tried again on the next turn
                log.warning("held runs not recorded: %s", exc)
            self._wake.wait(max(refresh - (time.monotonic() - checked), 0))
            self._wake.clear()
            if not self._stop.is_set():
                self._stop.wait(FLUSH_SECONDS)  # let a batch gather

    def _can_reach_sql(self) -> bool:
        """The database check, in a thread of its own so that a check stuck on a dead link
        ends the wait after `HEALTH_SECONDS` (one check at a time: a stuck one is waited
        for, failing, until it returns)."""
        if self.healthy is None:
            return True
        if self._check is None or not self._check.is_alive():
            outcome: list[bool] = []

            def check() -> None:
                try:
                    self.healthy()  # type: ignore[misc]
                    outcome.append(True)
                except Exception as exc:
                    log.warning("worker %s cannot reach SQL: %s", self.worker, exc)

            self._check = threading.Thread(target=check, daemon=True, name="held-runs-check")
            self._outcome = outcome
            self._check.start()
        self._check.join(HEALTH_SECONDS)
        return bool(self._outcome) and not self._check.is_alive()

    def flush(self, alive: bool | None = True) -> None:
        """Write the records gathered so far, and this worker's liveness (`alive`: refreshed;
        False: ended, the worker cannot serve; None: left as it is), in one round trip."""
        changes = []
        while self._changes:
            changes.append(self._changes.popleft())
        pipe = self.client.pipeline(transaction=False)
        if alive:
            pipe.set(_alive(self.worker), 1, px=self.alive_ms)
        elif alive is False:
            pipe.delete(_alive(self.worker))
        pipe.sadd(HOLDERS, self.worker)
        for held, run_id in changes:
            (pipe.sadd if held else pipe.srem)(_held(self.worker), run_id)
        try:
            pipe.execute()
        except redis.RedisError:
            self._changes.extendleft(reversed(changes))
            raise


class Holders:
    """The requeue pass's view of every worker's records."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def read(self) -> tuple[dict[str, set[str]], set[str]]:
        """(the runs each dead worker held, by worker; the runs live workers hold)."""
        workers = sorted(_text(w) for w in self.client.smembers(HOLDERS))
        if not workers:
            return {}, set()
        pipe = self.client.pipeline(transaction=False)
        for worker in workers:
            pipe.exists(_alive(worker))
            pipe.smembers(_held(worker))
        replies = pipe.execute()
        dead: dict[str, set[str]] = {}
        live: set[str] = set()
        for index, worker in enumerate(workers):
            alive, held = replies[2 * index], {_text(r) for r in replies[2 * index + 1]}
            if alive:
                live |= held
            else:
                dead[worker] = held
        return dead, live

    def forget(self, workers: Iterable[str]) -> None:
        """Drop the records of dead workers whose runs were sent again."""
        pipe = self.client.pipeline(transaction=False)
        for worker in workers:
            pipe.delete(_held(worker))
            pipe.srem(HOLDERS, worker)
        pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
