"""Tenant cost quotas: what a tenant spent in the current day or month, shared by every
process, and the gate that stops new work once it reaches the tenant's limit.

One counter per tenant and period window (`tracon:quota:{tenant}:2026-11-30` for a day,
`...:2026-11` for a month) holds cost in nanos of `Pricing.Currency`. Spend is added with
INCRBY in Lua, so several workers spending at once never lose an increment; every spend goes
to the day's and the month's counter alike, so a tenant whose period changes finds a counter
that saw everything. A counter that is gone (never seeded, or a flushed Redis) is seeded
from SQL by the next gate: the sum of `runs.cost_amount` of the tenant's runs created in the
window. Windows are UTC days and months.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Literal, Protocol

from tracon_jobs.coordination.cluster import CoordinationClient
from tracon_jobs.coordination.scripts import Scripts

Period = Literal["day", "month"]
PERIODS: tuple[Period, ...] = ("day", "month")
NANOS = Decimal(10**9)
LOST = "?"
REFUSED = "CostLimit"
KEEP_AFTER_WINDOW = timedelta(days=2)
"""A counter outlives its window by this much (for `/api/quota` near the boundary), then expires."""


def to_nanos(amount: Decimal) -> int:
    return int((amount * NANOS).to_integral_value())


def from_nanos(nanos: int) -> Decimal:
    return Decimal(nanos) / NANOS


@dataclass(frozen=True)
class Window:
    """One period window: `[start, end)` in naive UTC, and the label in its counter's key."""

    period: Period
    start: datetime
    end: datetime
    label: str

    def seconds_left(self, now: datetime) -> int:
        """Whole seconds to the end of the window, at least 1 (a `Retry-After`)."""
        left = (self.end - now).total_seconds()
        return max(1, int(left) + (0 if left == int(left) else 1))

    def ttl_ms(self, now: datetime) -> int:
        return int(((self.end - now) + KEEP_AFTER_WINDOW).total_seconds() * 1000)


def window_of(period: Period, now: datetime | None = None) -> Window:
    """The window of `period` that holds `now` (naive UTC; the current time by default)."""
    now = now or utc_now()
    if period == "day":
        start = datetime(now.year, now.month, now.day)
        return Window(period, start, start + timedelta(days=1), f"{start:%Y-%m-%d}")
    start = datetime(now.year, now.month, 1)
    end = datetime(now.year + 1, 1, 1) if now.month == 12 else datetime(now.year, now.month + 1, 1)
    return Window(period, start, end, f"{start:%Y-%m}")


def utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class QuotaVerdict:
    refused: str  # "CostLimit" when the limit is reached, "?" when the counter is gone, else ""
    used: Decimal

    @property
    def allowed(self) -> bool:
        return not self.refused

    @property
    def lost(self) -> bool:
        return self.refused == LOST


class QuotaStore(Protocol):
    def open(self, tenant: str, window: Window, used: Decimal, now: datetime) -> bool:
        """Seed the window's counter once (a counter already there wins); True when this did."""
        ...

    def gate(self, tenant: str, window: Window, limit: Decimal, unseen: Decimal) -> QuotaVerdict:
        """Refused once what the counter has, plus `unseen`, reaches `limit`."""
        ...

    def spend(self, tenant: str, windows: list[Window], amount: Decimal) -> int | None:
        """Add `amount` to each window's counter that exists; how many did (None: not known
        yet, the call was deferred to the next script, see `coordination.scripts.deferring`)."""
        ...

    def used(self, tenant: str, window: Window) -> Decimal | None:
        """The window's counter, or None when it is gone."""
        ...


class RedisQuotaStore:
    def __init__(self, client: CoordinationClient, prefix: str = "tracon") -> None:
        self.client = client
        self.scripts = Scripts(client)
        self.prefix = prefix

    def key(self, tenant: str, window: Window) -> str:
        return f"{self.prefix}:quota:{{{tenant}}}:{window.label}"

    def open(self, tenant: str, window: Window, used: Decimal, now: datetime) -> bool:
        key = self.key(tenant, window)
        return bool(self.client.set(key, to_nanos(used), nx=True, px=window.ttl_ms(now)))

    def gate(self, tenant: str, window: Window, limit: Decimal, unseen: Decimal) -> QuotaVerdict:
        args = [to_nanos(limit), to_nanos(unseen)]
        refused, used = self.scripts("quota_gate", [self.key(tenant, window)], args)
        text = refused.decode() if isinstance(refused, bytes) else str(refused)
        return QuotaVerdict(text, from_nanos(int(used)))

    def spend(self, tenant: str, windows: list[Window], amount: Decimal) -> int | None:
        keys = [self.key(tenant, window) for window in windows]
        seen = self.scripts("quota_spend", keys, [to_nanos(amount)], reply=False)
        return None if seen is None else int(seen)

    def used(self, tenant: str, window: Window) -> Decimal | None:
        value = self.client.get(self.key(tenant, window))
        return None if value is None else from_nanos(int(value))


class MemoryQuotaStore:
    """The same rules in one process (expiry aside)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], int] = {}

    def open(self, tenant: str, window: Window, used: Decimal, now: datetime) -> bool:
        with self._lock:
            if (tenant, window.label) in self._counters:
                return False
            self._counters[(tenant, window.label)] = to_nanos(used)
            return True

    def gate(self, tenant: str, window: Window, limit: Decimal, unseen: Decimal) -> QuotaVerdict:
        with self._lock:
            used = self._counters.get((tenant, window.label))
        if used is None:
            return QuotaVerdict(LOST, Decimal(0))
        refused = REFUSED if used + to_nanos(unseen) >= to_nanos(limit) else ""
        return QuotaVerdict(refused, from_nanos(used))

    def spend(self, tenant: str, windows: list[Window], amount: Decimal) -> int:
        seen = 0
        with self._lock:
            for window in windows:
                key = (tenant, window.label)
                if key in self._counters:
                    self._counters[key] += to_nanos(amount)
                    seen += 1
        return seen

    def used(self, tenant: str, window: Window) -> Decimal | None:
        with self._lock:
            value = self._counters.get((tenant, window.label))
        return None if value is None else from_nanos(value)

    def flush(self) -> None:
        """Forget every counter, as a flushed Redis does."""
        with self._lock:
            self._counters.clear()
