"""What `/metrics` serves: the cluster's state computed from SQL and Redis at scrape time,
and the event metrics of this node's gunicorn workers (merged in multiprocess mode).

Approvals are computed from SQL at scrape time, so that every web process tells the same
truth whichever process decided, expired or canceled: one GROUP BY over the rows.

    tracon_approvals_pending                      gauge
    tracon_approval_decisions_total{outcome}      counter (approved|rejected|expired|canceled)
    tracon_approval_decision_seconds{outcome}     histogram of decided_at - requested_at

The rest (runs by status, fair dispatch's lines, circuits, slots, leases, drain, and the event
counters) is described in `tracon_jobs.metrics` and docs/operations.md#metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import Float, case, cast, func, select
from sqlalchemy.sql.elements import ColumnElement

from beat_schedules.schedule import APPROVAL_EXPIRY_TASK, IDEMPOTENCY_PURGE_TASK, RECONCILE_TASK
from tracon_jobs.db import Database
from tracon_jobs.db.models import Approval
from tracon_jobs.metrics import FairState, StateCollector, event_collector
from tracon_jobs.runs.approvals import ApprovalStatus
from tracon_jobs.runtime import Runtime

BUCKETS = (1.0, 10.0, 60.0, 300.0, 3600.0, 86400.0)
OUTCOMES = [s for s in ApprovalStatus if s is not ApprovalStatus.PENDING]


def _seconds(db: Database) -> ColumnElement[Any]:
    """decided_at - requested_at in seconds, in the database's own arithmetic."""
    if db.is_sqlite:
        days = func.julianday(Approval.decided_at) - func.julianday(Approval.requested_at)
        return cast(days * 86400.0, Float)
    return func.extract("epoch", Approval.decided_at - Approval.requested_at)


class ApprovalCollector(Collector):
    """Reads the approvals table on every collect; no state in the process."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[Any]:
        seconds = _seconds(self.db)
        decided = Approval.decided_at.is_not(None)
        columns = [
            Approval.status,
            func.count(),
            func.coalesce(func.sum(case((decided, seconds), else_=0.0)), 0.0),
            *[
                func.coalesce(func.sum(case((decided & (seconds <= bound), 1), else_=0)), 0)
                for bound in BUCKETS
            ],
        ]
        with self.db.read() as session:
            rows = session.execute(select(*columns).group_by(Approval.status)).all()
        by_status = {row[0]: row for row in rows}

        pending = GaugeMetricFamily(
            "tracon_approvals_pending", "Approvals waiting for a person (all tenants)"
        )
        pending_row = by_status.get(ApprovalStatus.PENDING.value)
        pending.add_metric([], float(pending_row[1]) if pending_row else 0.0)
        yield pending

        total = CounterMetricFamily(
            "tracon_approval_decisions_total",
            "Approvals decided, by outcome (from the rows' statuses)",
            labels=["outcome"],
        )
        histogram = HistogramMetricFamily(
            "tracon_approval_decision_seconds",
            "Time from an approval's request to its decision, by outcome",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            row = by_status.get(outcome.value)
            count = int(row[1]) if row else 0
            total.add_metric([outcome.value.lower()], float(count))
            cumulative = [int(v) for v in row[3:]] if row else [0] * len(BUCKETS)
            buckets = [
                (floatToGoString(b), float(c)) for b, c in zip(BUCKETS, cumulative, strict=True)
            ]
            buckets.append(("+Inf", float(count)))
            histogram.add_metric([outcome.value.lower()], buckets, float(row[2]) if row else 0.0)
        yield total
        yield histogram


def approval_registry(db: Database) -> CollectorRegistry:
    """A registry of this app's SQL-backed collectors, exposed next to the process ones."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ApprovalCollector(db))
    return registry


LEASES = (RECONCILE_TASK, APPROVAL_EXPIRY_TASK, IDEMPOTENCY_PURGE_TASK)
"""The singleton leases of the periodic services, named after their tasks."""


def scrape_registry(
    runtime: Runtime, approvals: Collector, draining: Callable[[], bool]
) -> CollectorRegistry:
    """Everything `/metrics` answers with, in one registry built once per process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(event_collector())
    registry.register(approvals)
    registry.register(state_collector(runtime, draining))
    return registry


def state_collector(runtime: Runtime, draining: Callable[[], bool]) -> StateCollector:
    providers = sorted(runtime.settings.providers)

    def circuits() -> Iterator[tuple[str, str, int]]:
        for provider in providers:
            snapshot = runtime.breaker.snapshot(provider)
            yield provider, snapshot.state, snapshot.failures

    def slots() -> Iterator[tuple[str, int | None, int, int]]:
        for provider in providers:
            usage = runtime.slots.usage(provider)
            yield provider, usage.limit, usage.in_use, usage.waiting

    def leases() -> Iterator[tuple[str, str | None]]:
        store = runtime.leases.store
        for lease in LEASES:
            yield lease, store.owner_of(lease)

    def rates() -> Iterator[tuple[str, str, int, int, float]]:
        for provider in providers:
            for usage in runtime.rate_limits.usage(provider):
                if usage.limit.requests is not None:
                    yield (
                        usage.scope,
                        "requests",
                        usage.limit.requests,
                        usage.requests,
                        usage.blocked_seconds,
                    )
                if usage.limit.tokens is not None:
                    yield (
                        usage.scope,
                        "tokens",
                        usage.limit.tokens,
                        usage.tokens,
                        usage.blocked_seconds,
                    )

    def fair() -> FairState:
        store = runtime.fair_store
        depth = store.depth()
        return FairState(store.lines(), depth.sent, depth.slots, depth.running, depth.reserve)

    return StateCollector(
        runtime.db,
        fair=fair,
        circuits=circuits,
        slots=slots,
        leases=leases,
        draining=draining,
        rates=rates if runtime.rate_limits.limits else None,
    )
