"""Tenant cost quotas as runs, the web and the command line use them.

A tenant's quota is its own row in `tenant_quotas` (set by `tracon-jobs tenants quota`), else
`Tenants.DefaultQuota`. A run reads it once, when it starts; the web reads it on every
submission. The counter is in Redis (`tracon_jobs.limits.quota_store`) and rebuilt from SQL
when it is gone. A store that cannot be reached lets work through and says so in the log, as
the tree budget does: a lost Redis must not stop every tenant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import redis
from sqlalchemy import delete, func, select

from tracon_jobs.coordination.fair_share import DEFAULT_PRIORITY, PRIORITIES
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, TenantQuotaOverride
from tracon_jobs.limits.budget_store import QUOTA_EXCEEDED, Refusal
from tracon_jobs.limits.quota_store import (
    PERIODS,
    Period,
    QuotaStore,
    QuotaVerdict,
    Window,
    utc_now,
    window_of,
)
from tracon_jobs.settings import QuotaSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quota:
    period: Period
    limit: Decimal | None  # None: no quota


@dataclass(frozen=True)
class OwnQuota:
    """The tenant's `tenant_quotas` row as read with something else (the run's claim):
    `period` and `cost_limit`, or `found=False` when the tenant has no row of its own."""

    found: bool
    period: str | None = None
    cost_limit: Any = None
    max_concurrent_runs: int | None = None  # the tenant's own, over Tenants.MaxConcurrentRuns


@dataclass(frozen=True)
class QuotaUsage:
    """What `GET /api/quota` shows: the tenant's quota and the current window's spend."""

    quota: Quota
    window: Window
    used: Decimal

    @property
    def left(self) -> Decimal | None:
        limit = self.quota.limit
        return None if limit is None else max(limit - self.used, Decimal(0))


class Quotas:
    """The quotas of every tenant: their limits (SQL), their counters (the store)."""

    def __init__(
        self, default: QuotaSettings, store: QuotaStore, db: Database, currency: str
    ) -> None:
        self.default = Quota(default.period, default.cost_limit)
        self.store = store
        self.db = db
        self.currency = currency

    # -- limits --------------------------------------------------------------------------------

    def quota_of(self, tenant_id: str) -> Quota:
        """The tenant's own quota, else the default."""
        with self.db.read() as session:
            row = session.get(TenantQuotaOverride, tenant_id)
            if row is None:
                return self.default
            return self.quota_from(OwnQuota(True, row.period, row.cost_limit))

    def quota_from(self, own: OwnQuota) -> Quota:
        """The quota a tenant's own row (read already) gives it, else the default."""
        if not own.found:
            return self.default
        limit = None if own.cost_limit is None else _plain(Decimal(str(own.cost_limit)))
        period: Period = "month" if own.period == "month" else "day"
        return Quota(period, limit)

    def has_own(self, tenant_id: str) -> bool:
        with self.db.read() as session:
            return session.get(TenantQuotaOverride, tenant_id) is not None

    def set_quota(self, tenant_id: str, period: Period, limit: Decimal | None) -> None:
        assert period in PERIODS
        now = self.db.now()  # before the transaction: one connection at a time per thread
        with self.db.write() as session:
            row = session.get(TenantQuotaOverride, tenant_id)
            if row is None:
                row = TenantQuotaOverride(tenant_id=tenant_id)
                session.add(row)
            row.period = period
            row.cost_limit = limit  # type: ignore[assignment]
            row.updated_at = now

    def clear_quota(self, tenant_id: str) -> bool:
        """Back to the default; False when the tenant had no quota of its own."""
        with self.db.write() as session:
            result = session.execute(
                delete(TenantQuotaOverride).where(TenantQuotaOverride.tenant_id == tenant_id)
            )
            return bool(getattr(result, "rowcount", 0))

    # -- counters ------------------------------------------------------------------------------

    def verdict(
        self, tenant_id: str, quota: Quota, window: Window, unseen: Decimal = Decimal(0)
    ) -> QuotaVerdict | None:
        """The gate's answer (the counter seeded from SQL when it is gone); None with no limit
        or when the store does not answer (logged)."""
        if quota.limit is None:
            return None
        try:
            verdict = self.store.gate(tenant_id, window, quota.limit, unseen)
            if verdict.lost:
                self._seed(tenant_id, window)
                verdict = self.store.gate(tenant_id, window, quota.limit, unseen)
        except redis.RedisError as exc:
            log.warning("quota store unreachable; work of tenant %s allowed: %s", tenant_id, exc)
            return None
        return verdict

    def refusal(self, tenant_id: str, quota: Quota, now: datetime | None = None) -> Refusal | None:
        window = window_of(quota.period, now)
        verdict = self.verdict(tenant_id, quota, window)
        if verdict is None or verdict.allowed:
            return None
        return Refusal(QUOTA_EXCEEDED, quota_message(quota, window, verdict.used, self.currency))

    def spent(self, tenant_id: str, amount: Decimal, now: datetime | None = None) -> None:
        """Count a spend in the tenant's day and month (each counter that exists)."""
        if amount <= 0:
            return
        now = now or utc_now()
        windows = [window_of(period, now) for period in PERIODS]
        try:
            self.store.spend(tenant_id, windows, amount)
        except redis.RedisError as exc:
            log.warning(
                "quota store unreachable; spend of tenant %s not counted: %s", tenant_id, exc
            )

    def usage(self, tenant_id: str, now: datetime | None = None) -> QuotaUsage:
        quota = self.quota_of(tenant_id)
        window = window_of(quota.period, now)
        used: Decimal | None = None
        try:
            used = self.store.used(tenant_id, window)
            if used is None:
                self._seed(tenant_id, window)
                used = self.store.used(tenant_id, window)
        except redis.RedisError as exc:
            log.warning(
                "quota store unreachable; usage of tenant %s read from SQL: %s", tenant_id, exc
            )
        if used is None:
            used = spent_in(self.db, tenant_id, window)
        return QuotaUsage(quota, window, used)

    def for_run(self, tenant_id: str, own: OwnQuota | None = None) -> TenantQuota:
        """The quota a run checks; `own`: the tenant's row as its claim read it."""
        quota = self.quota_of(tenant_id) if own is None else self.quota_from(own)
        return TenantQuota(self, tenant_id, quota)

    def _seed(self, tenant_id: str, window: Window) -> None:
        log.info("quota counter of tenant %s (%s) rebuilt from SQL", tenant_id, window.label)
        self.store.open(tenant_id, window, spent_in(self.db, tenant_id, window), utc_now())


@dataclass
class TenantQuota:
    """The quota of one run's tenant, read when the run started: the gates of its tree budget
    check it, and every spend the run records counts at once (nothing unseen)."""

    quotas: Quotas
    tenant_id: str
    quota: Quota

    def refuse(self) -> Refusal | None:
        return self.quotas.refusal(self.tenant_id, self.quota)

    def spent(self, amount: Decimal) -> None:
        self.quotas.spent(self.tenant_id, amount)


PRIORITY_RANGE: dict[str, int] = {
    "default": DEFAULT_PRIORITY,
    "min": min(PRIORITIES),
    "max": max(PRIORITIES),
}
"""The priorities a run may ask for (higher first within its tenant's line)."""


def quota_json(
    usage: QuotaUsage, currency: str, max_concurrent_runs: int | None, weight: int
) -> dict[str, Any]:
    """The tenant's quota as `GET /api/quota` shows it, and as `quota.exceeded` tells it: the
    limit and the spend of the current period, the concurrency limit, the weight in fair
    dispatch and the priorities its runs may ask for."""
    return {
        "period": usage.quota.period,
        "limit": _amount(usage.quota.limit),
        "used": _amount(usage.used),
        "left": _amount(usage.left),
        "resetsAt": f"{usage.window.end:%Y-%m-%dT%H:%M:%SZ}",
        "currency": currency,
        "maxConcurrentRuns": max_concurrent_runs,
        "weight": weight,
        "priority": dict(PRIORITY_RANGE),
    }


def _amount(value: Decimal | None) -> float | None:
    return None if value is None else float(value)


def spent_in(db: Database, tenant_id: str, window: Window) -> Decimal:
    """What the tenant's runs created in the window cost (the counter's rebuild)."""
    query = select(func.coalesce(func.sum(Run.cost_amount), 0)).where(
        Run.tenant_id == tenant_id, Run.created_at >= window.start, Run.created_at < window.end
    )
    with db.read() as session:
        total = session.scalar(query)
    return Decimal(str(total or 0)).quantize(Decimal("0.000000001"))


def _plain(value: Decimal) -> Decimal:
    """`2.50000000` from a NUMERIC column as `2.5`, and `10.00000000` as `10` (not `1E+1`)."""
    return value.quantize(Decimal(1)) if value == value.to_integral_value() else value.normalize()


def quota_message(quota: Quota, window: Window, used: Decimal, currency: str) -> str:
    """The metric (cost), the period and the limit, and when the quota resets."""
    return (
        f"the tenant's cost quota is spent: {used:.6f} {currency} of its limit of "
        f"{quota.limit} {currency} per {quota.period} (metric cost, period {quota.period}, "
        f"limit {quota.limit}); it resets at {window.end:%Y-%m-%dT%H:%M:%SZ}"
    )
