"""Fair dispatch across tenants: one tenant's backlog never stands in front of another's runs.

A submitted run's message goes to the run queue at once while fewer runs are on their way
there (sent, not yet claimed by a worker) than the live workers have slots, and no tenant
has runs lined up. Otherwise the run waits in its tenant's line in Redis, `Queued` as
before (its row was written first). Each claim, each worker's registration (every few
seconds) and each offer refills what is on its way up to the slots, from the lines: stride
scheduling across tenants (a tenant's share is its weight, `tracon-jobs tenants weight`;
default 1), then priority (0-9, higher first), then first come, within a tenant's line. So
at most one run per worker slot waits in the queue ahead of a newly lined run, whatever the
size of another tenant's backlog.

One script (`fair_share.lua`) does each step atomically. With the envelope fast path the
web hands the script the message itself: it is pushed to the run queue by the script that
decides, now or when its turn comes, and a submission costs one round trip, as the `LPUSH`
it replaces. A worker's claim is one more script composed with the claim's first Redis call
(`deferring`). Without the fast path (or on another broker) the script answers the runs to
send and the caller sends them.

No worker registered (workers of an older version, tests that run runs in threads): every
run is sent at once, first come first served. A run on its way that no worker claimed within
`Runs.RequeueAfter` counts as lost and frees its place; the requeue scan offers it again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import redis

from tracon_jobs.coordination.scripts import Later, Scripts

PRIORITIES = range(0, 10)
DEFAULT_PRIORITY = 5
REGISTRATION_MS = 15_000
"""How long a worker's slots count without its next registration (it renews every 5 s)."""


class Offered(IntEnum):
    LINED = 0  # waits in its tenant's line
    SENT = 1  # on its way to the run queue now
    ALREADY = 2  # a re-send of a run already on its way or in its line: nothing to do


@dataclass(frozen=True)
class Offer:
    outcome: Offered
    to_send: list[str] = field(default_factory=list)  # run ids the caller sends itself


@dataclass(frozen=True)
class Depth:
    sent: int  # runs on their way to a worker
    lined: int  # runs waiting in their tenants' lines
    tenants: int  # tenants with runs in line
    slots: int | None  # the live workers' slots; None: no worker registered


class FairStore(Protocol):
    def offer(self, run_id: str, tenant_id: str, priority: int, message: str | None) -> Offer: ...

    def take(self, run_id: str) -> list[str]:
        """A worker claimed `run_id`: the runs it makes room for that the caller sends."""
        ...

    def take_later(self, run_id: str) -> Later | None:
        """`take` sent with the claim's next Redis call; None where that is not possible."""
        ...

    def register(self, worker: str, slots: int, weights: dict[str, int]) -> list[str]: ...

    def leave(self, worker: str) -> None: ...

    def depth(self) -> Depth: ...

    def lines(self) -> dict[str, int]:
        """Each tenant with runs lined up: how many wait in its line (read only)."""
        ...


def fair_ids(reply: object) -> list[str]:
    """The run ids the caller sends, from a script's reply (`{outcome, ids...}`)."""
    return _ids(list(reply)[1:]) if isinstance(reply, list | tuple) else []


def _ids(reply: list[object]) -> list[str]:
    return [r.decode() if isinstance(r, bytes) else str(r) for r in reply]


class RedisFairStore:
    """The lines in Redis; with `queue`, messages given to `offer` are pushed there by the
    script (the envelope fast path)."""

    def __init__(
        self,
        client: redis.Redis,
        lost_after_ms: int,
        queue: str | None = None,
        prefix: str = "tracon",
    ) -> None:
        self.scripts = Scripts(client)
        self.lost_after_ms = lost_after_ms
        self.queue = queue
        base = f"{prefix}:fair"
        self.keys = [
            f"{base}:sent",
            f"{base}:lines",
            f"{base}:messages",
            f"{base}:lined",
            f"{base}:state",
            f"{base}:workers",
            f"{base}:slots",
            queue or "",
        ]
        self.line_prefix = f"{base}:line:"

    def _call(self, op: str, *args: object) -> list[object]:
        reply = self.scripts(
            "fair_share", self.keys, [op, self.line_prefix, self.lost_after_ms, *args]
        )
        return list(reply)

    def offer(self, run_id: str, tenant_id: str, priority: int, message: str | None) -> Offer:
        reply = self._call("offer", run_id, tenant_id, priority, message or "")
        return Offer(Offered(int(str(reply[0]))), _ids(reply[1:]))

    def take(self, run_id: str) -> list[str]:
        return _ids(self._call("take", run_id)[1:])

    def take_later(self, run_id: str) -> Later | None:
        """None unless this store pushes messages itself: runs handed over that the caller
        sends must go now, not when the claim's next Redis call is made."""
        if self.queue is None:
            return None
        return self.scripts.later(
            "fair_share", self.keys, ["take", self.line_prefix, self.lost_after_ms, run_id]
        )

    def register(self, worker: str, slots: int, weights: dict[str, int]) -> list[str]:
        pairs = [x for tenant, weight in weights.items() for x in (tenant, weight)]
        return _ids(self._call("register", worker, slots, REGISTRATION_MS, *pairs)[1:])

    def leave(self, worker: str) -> None:
        self._call("leave", worker)

    def depth(self) -> Depth:
        sent, lined, tenants, slots = (int(str(x)) for x in self._call("depth"))
        return Depth(sent, lined, tenants, None if slots < 0 else slots)

    def lines(self) -> dict[str, int]:
        reply = _ids(self._call("lines"))
        return {tenant: int(n) for tenant, n in zip(reply[::2], reply[1::2], strict=True)}


class MemoryFairStore:
    """The same rules in one process; the caller sends every run (no messages kept)."""

    def __init__(self, lost_after_ms: int = 60_000) -> None:
        self.lost_after_ms = lost_after_ms
        self._lock = threading.Lock()
        self._sent: dict[str, float] = {}  # run -> monotonic ms sent
        self._lines: dict[str, list[tuple[float, str]]] = {}  # tenant -> sorted (score, run)
        self._passes: dict[str, float] = {}  # tenant with a line -> pass
        self._idle: dict[str, float] = {}  # tenant without a line -> its pass
        self._lined: dict[str, str] = {}  # run -> tenant
        self._weights: dict[str, int] = {}
        self._workers: dict[str, tuple[float, int]] = {}  # worker -> (ends ms, slots)
        self._vt = 0.0
        self._ticket = 0

    @staticmethod
    def _now() -> float:
        return time.monotonic() * 1000

    def _capacity(self, now: float) -> int | None:
        for worker in [w for w, (ends, _) in self._workers.items() if ends <= now]:
            del self._workers[worker]
        if not self._workers:
            return None
        return sum(n for _, n in self._workers.values())

    def _expire(self, now: float) -> None:
        for run in [r for r, at in self._sent.items() if at <= now - self.lost_after_ms]:
            del self._sent[run]

    def _refill(self, now: float) -> list[str]:
        self._expire(now)
        cap = self._capacity(now)
        out: list[str] = []
        if cap is None:
            return out
        while len(self._sent) < cap and self._passes:
            tenant = min(self._passes, key=lambda t: (self._passes[t], t))
            passed = self._passes[tenant]
            line = self._lines[tenant]
            _, run = line.pop(0)
            after = passed + 1 / self._weights.get(tenant, 1)
            self._vt = passed
            if line:
                self._passes[tenant] = after
            else:
                del self._passes[tenant], self._lines[tenant]
                self._idle[tenant] = after
            del self._lined[run]
            self._sent[run] = now
            out.append(run)
        return out

    def offer(self, run_id: str, tenant_id: str, priority: int, message: str | None) -> Offer:
        with self._lock:
            now = self._now()
            self._expire(now)
            if run_id in self._sent or run_id in self._lined:
                return Offer(Offered.ALREADY)
            cap = self._capacity(now)
            if cap is None or (not self._passes and len(self._sent) < cap):
                self._sent[run_id] = now
                if cap is not None:  # its pass moves on as a served one's would
                    start = max(self._idle.get(tenant_id, 0.0), self._vt)
                    self._vt = start
                    self._idle[tenant_id] = start + 1 / self._weights.get(tenant_id, 1)
                return Offer(Offered.SENT, [run_id])
            self._ticket += 1
            line = self._lines.setdefault(tenant_id, [])
            line.append(((9 - priority) * 1e12 + self._ticket, run_id))
            line.sort()
            self._lined[run_id] = tenant_id
            if tenant_id not in self._passes:
                self._passes[tenant_id] = max(self._idle.get(tenant_id, 0.0), self._vt)
            out = self._refill(now)
            return Offer(Offered.SENT if run_id in self._sent else Offered.LINED, out)

    def take(self, run_id: str) -> list[str]:
        with self._lock:
            self._sent.pop(run_id, None)
            tenant = self._lined.pop(run_id, None)
            if tenant is not None:
                line = [entry for entry in self._lines[tenant] if entry[1] != run_id]
                if line:
                    self._lines[tenant] = line
                else:
                    del self._lines[tenant], self._passes[tenant]
            return self._refill(self._now())

    def take_later(self, run_id: str) -> None:
        return None

    def register(self, worker: str, slots: int, weights: dict[str, int]) -> list[str]:
        with self._lock:
            now = self._now()
            self._workers[worker] = (now + REGISTRATION_MS, slots)
            self._weights.update(weights)
            return self._refill(now)

    def leave(self, worker: str) -> None:
        with self._lock:
            self._workers.pop(worker, None)

    def depth(self) -> Depth:
        with self._lock:
            now = self._now()
            self._expire(now)
            return Depth(len(self._sent), len(self._lined), len(self._passes), self._capacity(now))

    def lines(self) -> dict[str, int]:
        with self._lock:
            return {tenant: len(line) for tenant, line in self._lines.items() if line}
