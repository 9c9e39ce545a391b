"""Fair dispatch across tenants: one tenant's backlog never stands in front of another's runs.

A submitted run's message goes to the run queue at once while fewer runs are held (on their
way there, sent and not yet claimed, or running on a worker) than the live workers have
slots, and no tenant has runs lined up. Otherwise the run waits in its tenant's line in
Redis, `Queued` as before (its row was written first). Each run's end (`done`), each
worker's registration (every few seconds) and each offer refills what is held up to the
slots, from the lines: stride scheduling across tenants (a tenant's share is its weight,
`tracon-jobs tenants weight`; default 1), then priority (0-9, higher first), then first
come, within a tenant's line.

Beyond its slots a worker keeps `Worker.FairReserve` threads that lined runs never get: a
run of a tenant with no line, whose turn it is (its pass not behind the first line's), goes
at once onto one of them while other tenants' runs are lined. So a tenant back from idle
does not wait for a slot to free beside another's backlog, and, as nothing is sent ahead of
the slots, no run on its way stands in front of it in a worker's queue.

One script (`fair_share.lua`) does each step atomically. With the envelope fast path the
web hands the script the message itself: it is pushed to the run queue by the script that
decides, now or when its turn comes, and a submission costs one round trip, as the `LPUSH`
it replaces. A worker's claim (`take`: on its way -> running) is one more script composed
with the claim's first Redis call (`deferring`); the run's end (`done`) one more. Without
the fast path (or on another broker) the script answers the runs to send and the caller
sends them.

No worker registered (workers of an older version, tests that run runs in threads): every
run is sent at once, first come first served. A run on its way that no worker claimed within
`Runs.RequeueAfter` counts as lost and frees its place; the requeue scan offers it again. A
running run its worker stopped naming (each registration names its runs) frees its place
once that registration ends (`REGISTRATION_MS`): a worker killed mid-run gives its places back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
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
    ALREADY = 2  # a re-send of a run already on its way (sent, not claimed): nothing done
    IN_LINE = 3  # a re-send of a run already in its line: it keeps its place there


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
    running: int = 0  # runs claimed by a worker, not yet done
    reserve: int = 0  # the live workers' reserve threads (for tenants without a line)


class FairStore(Protocol):
    def offer(self, run_id: str, tenant_id: str, priority: int, message: str | None) -> Offer: ...

    def take(self, run_id: str) -> list[str]:
        """A worker claimed `run_id` (on its way -> running): the runs the caller sends (a
        claim makes room only when its run was still lined, claimed from a stale message)."""
        ...

    def take_later(self, run_id: str) -> Later | None:
        """`take` sent with the claim's next Redis call; None where that is not possible."""
        ...

    def done(self, run_id: str) -> list[str]:
        """`run_id` no longer holds a place (it ended or was dropped on a worker, or was
        canceled in its line): the runs it makes room for that the caller sends."""
        ...

    def done_later(self, run_id: str) -> Later | None:
        """`done` sent with the next Redis call (the run's final publish); None where that is
        not possible (the caller then calls `done`)."""
        ...

    def register(
        self,
        worker: str,
        slots: int,
        weights: dict[str, int],
        reserve: int = 0,
        running: Sequence[str] = (),
    ) -> list[str]:
        """A worker's `slots` and `reserve` threads for the next `REGISTRATION_MS`, and the
        runs it still runs (their places stay taken); `worker` '': the weights only."""
        ...

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
        gone_after_ms: int = REGISTRATION_MS,
    ) -> None:
        self.scripts = Scripts(client)
        self.lost_after_ms = lost_after_ms
        self.gone_after_ms = gone_after_ms  # a running run its worker stopped naming
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
            f"{base}:running",
            f"{base}:reserves",
            f"{base}:jumped",
        ]
        self.line_prefix = f"{base}:line:"

    def _args(self, op: str, *args: object) -> list[object]:
        return [op, self.line_prefix, self.lost_after_ms, self.gone_after_ms, *args]

    def _call(self, op: str, *args: object) -> list[object]:
        return list(self.scripts("fair_share", self.keys, self._args(op, *args)))

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
        return self.scripts.later("fair_share", self.keys, self._args("take", run_id))

    def done(self, run_id: str) -> list[str]:
        return _ids(self._call("done", run_id)[1:])

    def done_later(self, run_id: str) -> Later | None:
        """None unless this store pushes messages itself (as `take_later`)."""
        if self.queue is None:
            return None
        return self.scripts.later("fair_share", self.keys, self._args("done", run_id))

    def register(
        self,
        worker: str,
        slots: int,
        weights: dict[str, int],
        reserve: int = 0,
        running: Sequence[str] = (),
    ) -> list[str]:
        pairs = [x for tenant, weight in weights.items() for x in (tenant, weight)]
        args = [worker, slots, REGISTRATION_MS, reserve, len(weights), *pairs, *running]
        return _ids(self._call("register", *args)[1:])

    def leave(self, worker: str) -> None:
        self._call("leave", worker)

    def depth(self) -> Depth:
        sent, lined, tenants, slots, running, reserve = (int(str(x)) for x in self._call("depth"))
        return Depth(sent, lined, tenants, None if slots < 0 else slots, running, reserve)

    def lines(self) -> dict[str, int]:
        reply = _ids(self._call("lines"))
        return {tenant: int(n) for tenant, n in zip(reply[::2], reply[1::2], strict=True)}


class MemoryFairStore:
    """The same rules in one process; the caller sends every run (no messages kept)."""

    def __init__(self, lost_after_ms: int = 60_000, gone_after_ms: int = REGISTRATION_MS) -> None:
        self.lost_after_ms = lost_after_ms
        self.gone_after_ms = gone_after_ms
        self._lock = threading.Lock()
        self._sent: dict[str, float] = {}  # run -> monotonic ms sent
        self._running: dict[str, float] = {}  # run -> monotonic ms its worker last said so
        self._jumped: set[str] = set()  # runs sent onto a reserve thread (while held)
        self._lines: dict[str, list[tuple[float, str]]] = {}  # tenant -> sorted (score, run)
        self._passes: dict[str, float] = {}  # tenant with a line -> pass
        self._idle: dict[str, float] = {}  # tenant without a line -> its pass
        self._lined: dict[str, str] = {}  # run -> tenant
        self._weights: dict[str, int] = {}
        self._workers: dict[str, tuple[float, int, int]] = {}  # worker -> (ends ms, slots, reserve)
        self._vt = 0.0
        self._ticket = 0

    @staticmethod
    def _now() -> float:
        return time.monotonic() * 1000

    def _capacity(self, now: float) -> tuple[int | None, int]:
        for worker in [w for w, (ends, _, _) in self._workers.items() if ends <= now]:
            del self._workers[worker]
        if not self._workers:
            return None, 0
        workers = self._workers.values()
        return sum(n for _, n, _ in workers), sum(r for _, _, r in workers)

    def _held(self, now: float) -> int:
        for run in [r for r, at in self._sent.items() if at <= now - self.lost_after_ms]:
            del self._sent[run]
        for run in [r for r, at in self._running.items() if at <= now - self.gone_after_ms]:
            del self._running[run]
        return len(self._sent) + len(self._running)

    def _on_reserve(self) -> int:
        self._jumped = {r for r in self._jumped if r in self._sent or r in self._running}
        return len(self._jumped)

    def _start_pass(self, tenant: str) -> float:
        return max(self._idle.get(tenant, 0.0), self._vt)

    def _refill(self, now: float) -> list[str]:
        cap, _ = self._capacity(now)
        out: list[str] = []
        if cap is None:
            return out
        held = self._held(now) - self._on_reserve()  # the slots' runs
        while held < cap and self._passes:
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
            held += 1
        return out

    def _unline(self, run_id: str) -> bool:
        tenant = self._lined.pop(run_id, None)
        if tenant is None:
            return False
        line = [entry for entry in self._lines[tenant] if entry[1] != run_id]
        if line:
            self._lines[tenant] = line
        else:
            del self._lines[tenant], self._passes[tenant]
        return True

    def offer(self, run_id: str, tenant_id: str, priority: int, message: str | None) -> Offer:
        with self._lock:
            now = self._now()
            held = self._held(now)
            if run_id in self._sent:
                return Offer(Offered.ALREADY)
            if run_id in self._lined:
                return Offer(Offered.IN_LINE)
            cap, reserve = self._capacity(now)
            reserved = self._on_reserve()
            at_once = cap is None or (not self._passes and held - reserved < cap)
            if (
                not at_once
                and self._passes
                and tenant_id not in self._passes
                and reserved < reserve
                and self._start_pass(tenant_id) <= min(self._passes.values())
            ):
                self._jumped.add(run_id)  # its turn: onto a reserve thread
                at_once = True
            if at_once:
                self._sent[run_id] = now
                if cap is not None:  # its pass moves on as a served one's would
                    start = self._start_pass(tenant_id)
                    self._vt = start
                    self._idle[tenant_id] = start + 1 / self._weights.get(tenant_id, 1)
                return Offer(Offered.SENT, [run_id])
            self._ticket += 1
            line = self._lines.setdefault(tenant_id, [])
            line.append(((9 - priority) * 1e12 + self._ticket, run_id))
            line.sort()
            self._lined[run_id] = tenant_id
            if tenant_id not in self._passes:
                self._passes[tenant_id] = self._start_pass(tenant_id)
            out = self._refill(now)
            return Offer(Offered.SENT if run_id in self._sent else Offered.LINED, out)

    def take(self, run_id: str) -> list[str]:
        with self._lock:
            now = self._now()
            was_sent = self._sent.pop(run_id, None) is not None
            if self._unline(run_id) or was_sent:
                self._running[run_id] = now
            return self._refill(now)

    def take_later(self, run_id: str) -> None:
        return None

    def done_later(self, run_id: str) -> None:
        return None

    def done(self, run_id: str) -> list[str]:
        with self._lock:
            self._sent.pop(run_id, None)
            self._running.pop(run_id, None)
            self._jumped.discard(run_id)
            self._unline(run_id)
            return self._refill(self._now())

    def register(
        self,
        worker: str,
        slots: int,
        weights: dict[str, int],
        reserve: int = 0,
        running: Sequence[str] = (),
    ) -> list[str]:
        with self._lock:
            now = self._now()
            if worker:
                self._workers[worker] = (now + REGISTRATION_MS, slots, reserve)
            self._weights.update(weights)
            for run in running:
                if run in self._running:
                    self._running[run] = now
            return self._refill(now)

    def leave(self, worker: str) -> None:
        with self._lock:
            self._workers.pop(worker, None)

    def depth(self) -> Depth:
        with self._lock:
            now = self._now()
            held = self._held(now)
            cap, reserve = self._capacity(now)
            running = len(self._running)
            return Depth(held - running, len(self._lined), len(self._passes), cap, running, reserve)

    def lines(self) -> dict[str, int]:
        with self._lock:
            return {tenant: len(line) for tenant, line in self._lines.items() if line}
