"""A tenant's runs executing at once, across the cluster: `Tenants.MaxConcurrentRuns`.

A worker that takes a run of a tenant already running its most asks first, before it claims
anything (`TenantRuns.admit`): over the limit, the run stays `Queued` (nothing is written),
its message is acknowledged and its worker thread goes to other runs; it waits in the
tenant's line in Redis. When one of the tenant's runs lets go of its place (it ended, waits
for a person, was parked), the place goes to the run that waited longest, held for it, and
that run is sent again (`RunResumed`). A place is a lease renewed at every model turn, so a
worker that died frees its runs' places when their leases end; a waiting run whose message
was lost is sent again by the requeue scan, and keeps its place in the line.

With no limit, nothing here costs a Redis call.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import redis

from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.coordination.scripts import Scripts

log = logging.getLogger(__name__)

LEASE_MS = 10 * 60 * 1000
"""How long a run holds its place without a model turn: longer than any turn should take,
short enough that a dead worker's places come back."""


class TenantRunStore(Protocol):
    def admit(self, tenant_id: str, run_id: str, limit: int, lease_ms: int) -> bool: ...

    def release(self, tenant_id: str, run_id: str, limit: int, lease_ms: int) -> list[str]:
        """Free `run_id`'s place; the runs given a place (held for them), to be sent."""
        ...

    def renew(self, tenant_id: str, run_id: str, lease_ms: int) -> None: ...


class RedisTenantRunStore:
    def __init__(self, client: CoordinationClient, prefix: str = "tracon") -> None:
        self.scripts = Scripts(client)
        self.prefix = prefix

    def keys(self, tenant_id: str) -> list[str]:
        base = f"{self.prefix}:tenant-runs:{{{tenant_id}}}"
        return [f"{base}:running", f"{base}:waiting", f"{base}:tickets"]

    def admit(self, tenant_id: str, run_id: str, limit: int, lease_ms: int) -> bool:
        return bool(self.scripts("tenant_admit", self.keys(tenant_id), [run_id, limit, lease_ms]))

    def release(self, tenant_id: str, run_id: str, limit: int, lease_ms: int) -> list[str]:
        keys = self.keys(tenant_id)[:2]
        given = self.scripts("tenant_release", keys, [run_id, limit, lease_ms])
        return [g.decode() if isinstance(g, bytes) else str(g) for g in given or []]

    def renew(self, tenant_id: str, run_id: str, lease_ms: int) -> None:
        self.scripts("tenant_renew", self.keys(tenant_id)[:1], [run_id, lease_ms], reply=False)


class MemoryTenantRunStore:
    """The same rules in one process (leases do not expire here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, set[str]] = {}
        self._waiting: dict[str, list[str]] = {}

    def admit(self, tenant_id: str, run_id: str, limit: int, lease_ms: int) -> bool:
        with self._lock:
            running = self._running.setdefault(tenant_id, set())
            waiting = self._waiting.setdefault(tenant_id, [])
            if run_id in running:
                return True
            ahead = waiting.index(run_id) if run_id in waiting else len(waiting)
            if len(running) + ahead < limit:
                if run_id in waiting:
                    waiting.remove(run_id)
                running.add(run_id)
                return True
            if run_id not in waiting:
                waiting.append(run_id)
            return False

    def release(self, tenant_id: str, run_id: str, limit: int, lease_ms: int) -> list[str]:
        with self._lock:
            running = self._running.setdefault(tenant_id, set())
            waiting = self._waiting.setdefault(tenant_id, [])
            running.discard(run_id)
            given = []
            while len(running) < limit and waiting:
                given.append(waiting.pop(0))
                running.add(given[-1])
            return given

    def renew(self, tenant_id: str, run_id: str, lease_ms: int) -> None:
        """Leases do not expire in one process."""


class TenantRuns:
    """What the executor uses: `admit` before a claim, `release` when the run lets go. The
    limit is the tenant's own (`tracon-jobs tenants concurrency`), else `limit`
    (`Tenants.MaxConcurrentRuns`)."""

    def __init__(self, store: TenantRunStore, limit: int | None, lease_ms: int = LEASE_MS):
        self.store = store
        self.limit = limit
        self.lease_ms = lease_ms
        self._limits: dict[str, int] = {}  # run id -> its tenant's limit, while it runs here
        self._lock = threading.Lock()

    def admit(self, tenant_id: str, run_id: str, own_limit: int | None = None) -> bool:
        """Whether the run may execute now (also: its place renewed); a store that cannot be
        reached lets it (logged)."""
        limit = own_limit if own_limit is not None else self.limit
        if limit is None:
            return True
        try:
            admitted = self.store.admit(tenant_id, run_id, limit, self.lease_ms)
        except redis.RedisError as exc:
            log.warning("tenant run limit unreachable; run %s goes on: %s", run_id, exc)
            return True
        if admitted:
            with self._lock:
                self._limits[run_id] = limit
        return admitted

    def renew(self, tenant_id: str, run_id: str) -> None:
        """At a model turn: the run keeps its place for another lease."""
        if run_id not in self._limits:
            return
        try:
            self.store.renew(tenant_id, run_id, self.lease_ms)
        except redis.RedisError as exc:
            log.warning("tenant run place of %s not renewed: %s", run_id, exc)

    def release(self, tenant_id: str, run_id: str) -> list[str]:
        """Give back a place this process admitted (or, for a run that no longer waits,
        handed on to it), at the limit it was admitted under."""
        with self._lock:
            limit = self._limits.pop(run_id, None)
        if limit is None:
            return []
        return self._release(tenant_id, run_id, limit)

    def pass_on(self, tenant_id: str, run_id: str, limit: int) -> list[str]:
        """A place given to a run that no longer waits (canceled meanwhile) goes on."""
        return self._release(tenant_id, run_id, limit)

    def forget(self, run_id: str) -> None:
        """A run another process claimed first: its place is that process's to give back."""
        with self._lock:
            self._limits.pop(run_id, None)

    def limit_of(self, run_id: str) -> int | None:
        return self._limits.get(run_id)

    def _release(self, tenant_id: str, run_id: str, limit: int) -> list[str]:
        try:
            return self.store.release(tenant_id, run_id, limit, self.lease_ms)
        except redis.RedisError as exc:  # its lease frees the place
            log.warning("tenant run place of %s not given back: %s", run_id, exc)
            return []
