"""The series behind the console's statistics plots (`RunTimeline.series`), on SQLite and on
PostgreSQL: runs, tokens and cost per hour or day, by agent or by model, one tenant only.

Not a browser test: it sits beside them because it checks what the statistics page draws."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import update

from tests.helpers import MakeRuntime
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runs.timeline import Bucket, GroupBy, RunTimeline
from tracon_jobs.runtime import Runtime

NOW = datetime(2026, 11, 30, 14, 25)


def add_run(
    runtime: Runtime, tenant: str, agent: str, at: datetime, model: str | None, tokens: int
) -> None:
    run = runtime.runs.create(NewRun(tenant, agent, {"message": "x"}))
    with runtime.db.write() as session:
        session.execute(
            update(Run)
            .where(Run.id == run.id)
            .values(
                created_at=at,
                model_id=model,
                input_tokens=tokens,
                output_tokens=tokens // 2,
                cost_amount=tokens / 1000,
            )
        )


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url)


def test_hourly_series_by_agent_counts_each_bucket_and_fills_empty_ones(runtime: Runtime) -> None:
    tenant = runtime.tenants.ensure_tenant("acme")
    other = runtime.tenants.ensure_tenant("globex")
    add_run(runtime, tenant, "support", NOW - timedelta(minutes=5), "m1", 100)
    add_run(runtime, tenant, "support", NOW - timedelta(minutes=20), "m2", 200)
    add_run(runtime, tenant, "triage", NOW - timedelta(hours=2, minutes=10), None, 0)
    add_run(runtime, tenant, "support", NOW - timedelta(hours=30), "m1", 999)  # before the window
    add_run(runtime, other, "support", NOW - timedelta(minutes=5), "m1", 50)

    series = RunTimeline(runtime.db).series(
        tenant, until=NOW, buckets=24, bucket=Bucket.HOUR, group_by=GroupBy.AGENT
    )

    assert len(series.starts) == 24
    assert series.starts[-1] == datetime(2026, 11, 30, 14) and series.starts[0] == datetime(
        2026, 11, 29, 15
    )
    assert series.keys == ["support", "triage"]
    support = series.point(datetime(2026, 11, 30, 14), "support")
    assert (support.runs, support.input_tokens, support.output_tokens) == (2, 300, 150)
    assert support.cost == pytest.approx(0.3)
    assert series.point(datetime(2026, 11, 30, 12), "triage").runs == 1
    assert series.point(datetime(2026, 11, 30, 13), "support").runs == 0


def test_daily_series_by_model_names_runs_no_model_answered(runtime: Runtime) -> None:
    tenant = runtime.tenants.ensure_tenant("acme")
    add_run(runtime, tenant, "support", NOW - timedelta(hours=1), "m1", 100)
    add_run(runtime, tenant, "support", NOW - timedelta(days=1, hours=1), "m1", 10)
    add_run(runtime, tenant, "triage", NOW - timedelta(days=2), None, 0)

    series = RunTimeline(runtime.db).series(
        tenant, until=NOW, buckets=7, bucket=Bucket.DAY, group_by=GroupBy.MODEL
    )

    assert series.starts[-1] == datetime(2026, 11, 30) and len(series.starts) == 7
    assert series.keys == ["m1", None]
    assert series.point(datetime(2026, 11, 30), "m1").total_tokens == 150
    assert series.point(datetime(2026, 11, 29), "m1").total_tokens == 15
    assert series.point(datetime(2026, 11, 28), None).runs == 1
