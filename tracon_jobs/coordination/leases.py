"""Singleton leases: at most one process at a time acts as the owner of a periodic service.

A lease is a Redis key that holds its owner's token and expires after `LeaseDuration`
(PX, so on Redis server time, never on a worker's clock). Acquire, renew and release
compare the owner inside one Lua script: a process whose lease ran out can neither extend
nor delete the next owner's lease (rq's scheduler lock extends and deletes unchecked; that
is exactly the bug this avoids).

`Singleton` is the elector of one process. A daemon thread renews every lease the process
holds every third of the TTL and tries again for the leases it wants but does not hold, so
when an owner dies another process takes over within one lease duration plus one renewal
interval. Belief is conservative on purpose: a process believes it owns a lease only until
the TTL counted from *before* its last successful call, less a drift margin, so it stops
believing on its own clock no later than Redis expires the key, even while its renewer is
stalled (GC pause, SIGSTOP, a hung Redis call). A refused or failed renewal drops ownership
at once; the next `is_owner` or background pass may take it again.

This is coordination, not exactly-once: a body already running keeps running after its
lease is lost unless it asks `still_owner` between batches. And no clock can see a lease
vanish early: when Redis is flushed or restarted empty, the old owner believes until its
next renewal is refused (at most one renewal interval) while a new one may already hold it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

import redis

from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.coordination.scripts import Scripts

log = logging.getLogger(__name__)

Clock = Callable[[], int]
"""Milliseconds from an arbitrary origin; only differences are used."""

OwnershipListener = Callable[[str, str], None]
"""`listener(lease, change)`, change one of `acquired`, `lost`, `released` (metrics)."""

_listeners: list[OwnershipListener] = []


def on_ownership_change(listener: OwnershipListener) -> None:
    """Call `listener` whenever a process's `Singleton` gains or gives up a lease."""
    if listener not in _listeners:
        _listeners.append(listener)


def _announce(lease: str, change: str) -> None:
    for listener in list(_listeners):
        try:
            listener(lease, change)
        except Exception:  # an observer must never break the elector
            log.debug("lease listener failed", exc_info=True)


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


# -- stores ------------------------------------------------------------------------------


class LeaseStore(Protocol):
    def acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        """Take the lease when free or expired, or extend it when `owner` already holds it."""
        ...

    def renew(self, name: str, owner: str, ttl_ms: int) -> bool:
        """Extend the lease only while `owner` still holds it; never revive a lost one."""
        ...

    def release(self, name: str, owner: str) -> bool:
        """Delete the lease only when `owner` holds it."""
        ...

    def owner_of(self, name: str) -> str | None: ...


class RedisLeaseStore:
    """Leases as Redis strings, changed only by owner-checking Lua scripts."""

    def __init__(self, client: CoordinationClient, prefix: str = "tracon") -> None:
        self.client = client
        self.prefix = prefix
        self.scripts = Scripts(client)

    def key(self, name: str) -> str:
        return f"{self.prefix}:lease:{{{name}}}"

    def acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(self.scripts("lease_acquire", [self.key(name)], [owner, ttl_ms]))

    def renew(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(self.scripts("lease_renew", [self.key(name)], [owner, ttl_ms]))

    def release(self, name: str, owner: str) -> bool:
        return bool(self.scripts("lease_release", [self.key(name)], [owner]))

    def owner_of(self, name: str) -> str | None:
        value = self.client.get(self.key(name))
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)


class MemoryLeaseStore:
    """The same rules inside one process, expiring on an injectable millisecond clock.

    Like Redis, a lease is still held at exactly its expiry millisecond and gone after it.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or monotonic_ms
        self._leases: dict[str, tuple[str, int]] = {}  # name -> (owner, expires at ms)
        self._lock = threading.Lock()

    def acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        with self._lock:
            if self._live_owner(name) not in (None, owner):
                return False
            self._leases[name] = (owner, self.clock() + ttl_ms)
            return True

    def renew(self, name: str, owner: str, ttl_ms: int) -> bool:
        with self._lock:
            if self._live_owner(name) != owner:
                return False
            self._leases[name] = (owner, self.clock() + ttl_ms)
            return True

    def release(self, name: str, owner: str) -> bool:
        with self._lock:
            if self._live_owner(name) != owner:
                return False
            del self._leases[name]
            return True

    def owner_of(self, name: str) -> str | None:
        with self._lock:
            return self._live_owner(name)

    def _live_owner(self, name: str) -> str | None:
        lease = self._leases.get(name)
        if lease is None or lease[1] < self.clock():
            return None
        return lease[0]


# -- the elector -------------------------------------------------------------------------


class Singleton:
    """Which singleton leases this process holds right now, kept fresh in the background.

    `enabled=False` (the reliability guide's default for SingletonExecution) makes every
    process the owner of everything, with no store call and no thread: the behaviour of a
    single process.
    """

    def __init__(
        self,
        store: LeaseStore,
        owner: str,
        ttl_ms: int,
        enabled: bool = True,
        *,
        clock: Clock | None = None,
        background: bool = True,
    ) -> None:
        if ttl_ms <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_ms} ms")
        if not owner:
            raise ValueError("a lease owner token must not be empty")
        self.store = store
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.enabled = enabled
        self.clock = clock or monotonic_ms
        self.background = background  # False: tests drive `refresh()` on a fake clock
        self._deadlines: dict[str, int] = {}  # held leases: name -> local deadline (ms)
        self._wanted: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._exit_hook = False

    @property
    def renew_interval_ms(self) -> int:
        """A third of the TTL: two renewals can fail before the lease runs out."""
        return max(self.ttl_ms // 3, 1)

    @property
    def drift_ms(self) -> int:
        """How much earlier than the TTL belief ends: clock-rate drift between this host and
        Redis, and the millisecond rounding of PX (the margin Redlock uses)."""
        return min(self.ttl_ms // 100 + 2, self.ttl_ms // 2)

    def is_owner(self, name: str) -> bool:
        """Acquire `name`, or confirm and extend it when this process holds it (one call).

        Also marks `name` as wanted: from now on the background thread renews it while held
        and retries it while free, so a dead owner is replaced within one lease plus one
        renewal interval even if no task asks again. An unreachable store means "not the
        owner" (logged): skipping a periodic pass is safer than running it twice.
        """
        if not self.enabled:
            return True
        self._want(name)
        return self._attempt(name, self.store.acquire, "acquire")

    def still_owner(self, name: str) -> bool:
        """Whether this process may still act as the owner of `name`, with no store call.

        Cheap enough to ask between every batch of a long body. It turns False the moment a
        renewal fails or the local deadline passes, even when the renewer never ran (a
        stalled process), and the local deadline is never later than the expiry Redis holds.
        """
        if not self.enabled:
            return True
        with self._lock:
            deadline = self._deadlines.get(name)
            if deadline is None:
                return False
            if self.clock() < deadline:
                return True
            del self._deadlines[name]
        log.warning("lease %s ran out before it was renewed: %s stops as owner", name, self.owner)
        _announce(name, "lost")
        return False

    def refresh(self) -> None:
        """One background pass: renew each held lease, retry each wanted one that is free."""
        with self._lock:
            wanted = sorted(self._wanted)
            held = set(self._deadlines)
        for name in wanted:
            if name in held:
                self._attempt(name, self.store.renew, "renewal")
            else:
                self._attempt(name, self.store.acquire, "acquire")

    def release_all(self) -> None:
        """Stop renewing and give every held lease back (on shutdown), so another process
        takes over at once instead of after the TTL."""
        with self._lock:
            self._stop.set()
            held = list(self._deadlines)
            self._deadlines.clear()
            self._wanted.clear()
        for name in held:
            _announce(name, "released")
            try:
                self.store.release(name, self.owner)
            except redis.RedisError as exc:
                log.warning("lease %s not released (it will expire): %s", name, exc)

    def held(self) -> list[str]:
        """The leases this process believes it owns right now."""
        with self._lock:
            now = self.clock()
            return sorted(name for name, deadline in self._deadlines.items() if now < deadline)

    # -- internals -----------------------------------------------------------------------

    def _attempt(self, name: str, call: Callable[[str, str, int], bool], what: str) -> bool:
        started = self.clock()  # before the call: Redis sets the expiry after this instant
        try:
            granted = call(name, self.owner, self.ttl_ms)
        except redis.RedisError as exc:
            self._lose(name, f"lease {name} {what} failed: {exc}", error=True)
            return False
        if not granted:
            self._lose(name, f"lease {name} {what} refused: it expired or another process owns it")
            return False
        return self._keep(name, started + self.ttl_ms - self.drift_ms)

    def _keep(self, name: str, deadline: int) -> bool:
        with self._lock:
            if name not in self._wanted:  # released while the call was in flight
                return False
            previous = self._deadlines.get(name)
            self._deadlines[name] = deadline if previous is None else max(previous, deadline)
        if previous is None:
            log.info("%s is now the owner of %s", self.owner, name)
            _announce(name, "acquired")
        return True

    def _lose(self, name: str, reason: str, *, error: bool = False) -> None:
        with self._lock:
            was_held = self._deadlines.pop(name, None) is not None
        if was_held:
            log.warning("%s; %s stops as owner at once", reason, self.owner)
            _announce(name, "lost")
        elif error:
            log.warning(reason)
        else:
            log.debug(reason)

    def _want(self, name: str) -> None:
        with self._lock:
            self._wanted.add(name)
            if self.background and (self._renewer is None or not self._renewer.is_alive()):
                self._start_renewer()

    def _start_renewer(self) -> None:
        """A daemon thread that holds only a weak reference, so a dropped Singleton (a
        test's Runtime) does not keep renewing forever."""
        self._stop = threading.Event()
        ref = weakref.ref(self)
        self._renewer = threading.Thread(
            target=_renew_forever,
            args=(ref, self._stop, self.renew_interval_ms / 1000),
            daemon=True,
            name="lease-renewer",
        )
        self._renewer.start()
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(_release_at_exit, ref)


def _renew_forever(ref: weakref.ref[Singleton], stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        singleton = ref()
        if singleton is None:
            return
        try:
            singleton.refresh()
        except Exception:  # the thread must outlive any one bad pass
            log.exception("lease renewal pass failed")
        del singleton


def _release_at_exit(ref: weakref.ref[Singleton]) -> None:
    singleton = ref()
    if singleton is not None:
        singleton.release_all()
