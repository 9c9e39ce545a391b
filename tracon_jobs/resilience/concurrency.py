"""Per-provider concurrency: at most N calls in flight to one provider, across the cluster.

A call over the limit waits for a slot, first come first served, bounded only by its run's
abort signal; it is never rejected (a rejection would turn a burst into the failures this
exists to prevent). Slots are leases: a holder that crashed frees its slot when the lease
ends, and a process renews the slots it holds every third of the lease. With no limit
configured, `Slots.hold` costs nothing: no Redis call, no allocation beyond the context.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from tracon_jobs import metrics
from tracon_jobs.abort import AbortSignal
from tracon_jobs.coordination.cluster import CoordinationClient, reads_at_server_time
from tracon_jobs.coordination.scripts import Scripts
from tracon_jobs.errors import MustPark, ProviderError

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02
WAITER_LEASE_MS = 3_000
"""How long a queued caller keeps its place without polling again: a crashed waiter's place
expires after it, so it never blocks the queue behind it for good."""


@dataclass(frozen=True)
class SlotUsage:
    provider: str
    limit: int | None
    in_use: int
    waiting: int


class SlotStore(Protocol):
    def try_acquire(self, provider: str, token: str, limit: int, lease_ms: int) -> bool:
        """Hold a slot (True) or keep a place in the queue (False); call again to retry."""
        ...

    def release(self, provider: str, token: str) -> None: ...

    def renew(self, provider: str, tokens: list[str], lease_ms: int) -> int: ...

    def usage(self, provider: str) -> tuple[int, int]:
        """(slots in use, calls waiting)."""
        ...


class RedisSlotStore:
    def __init__(
        self,
        client: CoordinationClient,
        prefix: str = "tracon",
        *,
        waiter_lease_ms: int = WAITER_LEASE_MS,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.waiter_lease_ms = waiter_lease_ms
        self.scripts = Scripts(client)

    def keys(self, provider: str) -> list[str]:
        base = f"{self.prefix}:slots:{{{provider}}}"
        return [f"{base}:holders", f"{base}:queue", f"{base}:waiters", f"{base}:tickets"]

    def try_acquire(self, provider: str, token: str, limit: int, lease_ms: int) -> bool:
        args = [token, limit, lease_ms, self.waiter_lease_ms]
        return bool(self.scripts("slot_acquire", self.keys(provider), args))

    def release(self, provider: str, token: str) -> None:
        self.scripts("slot_release", self.keys(provider)[:3], [token])

    def renew(self, provider: str, tokens: list[str], lease_ms: int) -> int:
        return int(self.scripts("slot_renew", self.keys(provider)[:1], [lease_ms, *tokens]))

    def usage(self, provider: str) -> tuple[int, int]:
        holders, _queue, waiters, _tickets = self.keys(provider)

        def reads(pipe: Any) -> None:
            pipe.zrange(holders, 0, -1, withscores=True)
            pipe.zrange(waiters, 0, -1, withscores=True)

        (held, waiting), now = reads_at_server_time(self.client, holders, reads)
        live = sum(1 for _token, until in held if until > now)
        return live, sum(1 for _token, until in waiting if until > now)


class MemorySlotStore:
    """FIFO slots inside one process (leases never expire: a process cannot half-crash)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[str, set[str]] = {}
        self._queues: dict[str, deque[str]] = {}

    def try_acquire(self, provider: str, token: str, limit: int, lease_ms: int) -> bool:
        with self._lock:
            holders = self._holders.setdefault(provider, set())
            queue = self._queues.setdefault(provider, deque())
            if token in holders:
                return True
            if token not in queue:
                queue.append(token)
            free = limit - len(holders)
            if free > 0 and list(queue).index(token) < free:
                queue.remove(token)
                holders.add(token)
                return True
            return False

    def release(self, provider: str, token: str) -> None:
        with self._lock:
            self._holders.get(provider, set()).discard(token)
            queue = self._queues.get(provider)
            if queue is not None and token in queue:
                queue.remove(token)

    def renew(self, provider: str, tokens: list[str], lease_ms: int) -> int:
        with self._lock:
            return len(self._holders.get(provider, set()) & set(tokens))

    def usage(self, provider: str) -> tuple[int, int]:
        with self._lock:
            return len(self._holders.get(provider, ())), len(self._queues.get(provider, ()))


class Slots:
    """What the executor uses: `with slots.hold(provider, signal): call()`."""

    def __init__(self, store: SlotStore, limit: int | None, lease_ms: int) -> None:
        self.store = store
        self.limit = limit
        self.lease_ms = lease_ms
        self._held: dict[str, set[str]] = {}
        self._mean_hold: dict[str, float] = {}
        self._lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    @contextlib.contextmanager
    def hold(
        self, provider: str, signal: AbortSignal, park_after: float | None = None
    ) -> Iterator[None]:
        """Hold a slot of `provider` for the block. With `park_after`, a wait that lasts
        longer raises `MustPark` with the wait expected from here (its place is given up)."""
        if self.limit is None:
            yield
            return
        token = uuid.uuid4().hex
        try:
            self._wait_for_slot(provider, token, signal, park_after)
            self._track(provider, token)
            held = time.monotonic()
            yield
        finally:
            self._untrack(provider, token)
            self._release(provider, token)
        self._held_for(provider, time.monotonic() - held)

    def _held_for(self, provider: str, seconds: float) -> None:
        """A moving mean of how long this process's calls hold a slot (for the park time)."""
        with self._lock:
            mean = self._mean_hold.get(provider)
            self._mean_hold[provider] = seconds if mean is None else 0.8 * mean + 0.2 * seconds

    def expected_wait(self, provider: str) -> float:
        """The wait for a slot from now: the calls waiting, a slot's turn each (this
        process's mean hold), spread over the slots; at least a second."""
        assert self.limit is not None
        try:
            _in_use, waiting = self.store.usage(provider)
        except redis.RedisError:
            waiting = self.limit
        with self._lock:
            mean = self._mean_hold.get(provider, 1.0)
        return max(1.0, mean * (waiting + 1) / self.limit)

    def usage(self, provider: str) -> SlotUsage:
        if self.limit is None:
            return SlotUsage(provider, None, 0, 0)
        in_use, waiting = self.store.usage(provider)
        return SlotUsage(provider, self.limit, in_use, waiting)

    def _wait_for_slot(
        self, provider: str, token: str, signal: AbortSignal, park_after: float | None = None
    ) -> None:
        assert self.limit is not None
        started = time.monotonic()
        waited = False
        while not self._try_acquire(provider, token):
            waited = True
            if park_after is not None and time.monotonic() - started >= park_after:
                metrics.slot_wait(provider, time.monotonic() - started, waited)
                raise MustPark("concurrency_slot", self.expected_wait(provider))
            if signal.wait(POLL_SECONDS):
                metrics.slot_wait(provider, time.monotonic() - started, waited)
                raise ProviderError(
                    f"cancelled while waiting for a '{provider}' slot ({signal.reason})",
                    provider=provider,
                    kind="cancelled",
                )
        metrics.slot_wait(provider, time.monotonic() - started, waited)

    def _try_acquire(self, provider: str, token: str) -> bool:
        """True once held; a store that cannot be reached lets the call through (logged)."""
        assert self.limit is not None
        try:
            return self.store.try_acquire(provider, token, self.limit, self.lease_ms)
        except redis.RedisError as exc:
            log.warning("slot store unreachable; calling %s without a slot: %s", provider, exc)
            return True

    def _release(self, provider: str, token: str) -> None:
        try:
            self.store.release(provider, token)
        except redis.RedisError as exc:  # the lease frees it anyway
            log.warning("slot release for %s failed; its lease will free it: %s", provider, exc)

    def _track(self, provider: str, token: str) -> None:
        with self._lock:
            self._held.setdefault(provider, set()).add(token)
            if self._renewer is None or not self._renewer.is_alive():
                self._renewer = threading.Thread(
                    target=self._renew_forever, daemon=True, name="slot-renewer"
                )
                self._renewer.start()

    def _untrack(self, provider: str, token: str) -> None:
        with self._lock:
            self._held.get(provider, set()).discard(token)

    def _renew_forever(self) -> None:
        while not self._stopped.wait(self.lease_ms / 3000):
            with self._lock:
                held = {p: list(tokens) for p, tokens in self._held.items() if tokens}
            for provider, tokens in held.items():
                try:
                    self.store.renew(provider, tokens, self.lease_ms)
                except Exception as exc:  # this thread ending would let every held lease lapse
                    log.warning("slot renewal for %s failed: %s", provider, exc)
