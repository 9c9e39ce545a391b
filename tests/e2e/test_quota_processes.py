"""One tenant's cost quota across two real worker processes spending at once: no spend is
lost (the SQL sum of the runs' costs equals the Redis counter, to the nanounit), the quota
stops the tenant's work near its limit, and a run started once it is spent never calls its
model. Another tenant goes on."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
import redis

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime
from tracon_jobs.db.models import Run
from tracon_jobs.limits.quota_store import RedisQuotaStore, window_of
from tracon_jobs.limits.tenant_quotas import spent_in
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

RENDERS = 4
RUNS = 16
LIMIT = Decimal("1.0")
RENDER_COST = Decimal("0.05")


def config() -> dict[str, Any]:
    render = [
        {
            "ToolCalls": [{"Name": "render_audio", "Arguments": {"seconds": n}}],
            "InputTokens": 1000,
            "OutputTokens": 100,
            "DelaySeconds": 0.05,
        }
        for n in range(RENDERS)
    ]
    return {
        "Providers": {"scripted": {"Kind": "scripted", "Script": [*render, {"Text": "done"}]}},
        "Agents": {
            "paid": {
                "Model": {"provider": "scripted", "model": "paid-model"},
                "Tools": ["render_audio"],
            }
        },
        "Pricing": {"Models": {"paid-model": {"InputPerMillion": 3, "OutputPerMillion": 7}}},
        "ToolModules": ["tests.tools"],
        "AgentGraph": {"MaxTotalTokens": 0},
        "Tenants": {"DefaultQuota": {"Period": "day", "CostLimit": float(LIMIT)}},
    }


def submit(runtime: Runtime, tenant_id: str, count: int) -> list[str]:
    return [
        runtime.dispatcher.submit(NewRun(tenant_id, "paid", {"message": f"go {i}"})).id
        for i in range(count)
    ]


def ended(runtime: Runtime, run_ids: list[str], timeout: float = 90) -> list[Run]:
    def done() -> bool:
        runs = [runtime.runs.get(run_id) for run_id in run_ids]
        return all(r is not None and r.status in ("Completed", "Failed") for r in runs)

    wait_until(done, timeout=timeout, what=f"{len(run_ids)} runs ended")
    return [r for r in (runtime.runs.get(run_id) for run_id in run_ids) if r is not None]


def started_by(runtime: Runtime, runs: list[Run]) -> set[str]:
    return {
        e.data["owner"] for r in runs for e in runtime.runs.events(r.id) if e.type == "RunStarted"
    }


def test_two_workers_spending_for_one_tenant_lose_nothing_and_stop_at_the_quota(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_client: redis.Redis,
) -> None:
    cluster = make_cluster(sql_url, **config())
    cluster.worker("w1", concurrency=4)
    cluster.worker("w2", concurrency=4)
    runtime = make_runtime(sql_url, **config())
    acme = runtime.tenants.ensure_tenant("acme")

    runs = ended(runtime, submit(runtime, acme, RUNS))

    assert len(started_by(runtime, runs)) == 2, "both workers executed runs"
    refused = [r for r in runs if r.error_type == "tenant_quota_exceeded"]
    assert refused, "the quota stopped some of the tenant's runs"
    assert all(r.status == "Completed" for r in runs if r not in refused)
    # No lost spend: the day's counter equals what SQL recorded for the tenant (the month's
    # is seeded only once a gate or `/api/quota` asks for it)
    store = RedisQuotaStore(redis_client)
    spent = spent_in(runtime.db, acme, window_of("day"))
    assert store.used(acme, window_of("day")) == spent
    assert store.used(acme, window_of("month")) is None
    assert sum((Decimal(str(r.cost_amount)) for r in runs), Decimal(0)) == spent
    # It stopped near the limit: past it by at most what 8 threads had in flight
    per_turn = RENDER_COST + Decimal("0.0037")  # a render and a turn's tokens
    assert LIMIT <= spent <= LIMIT + 8 * per_turn + per_turn, spent

    # Once spent, a new run of the tenant never calls its model; another tenant's does
    other = runtime.tenants.ensure_tenant("other")
    late, fresh = ended(runtime, [*submit(runtime, acme, 1), *submit(runtime, other, 1)])
    assert (late.status, late.error_type, late.error_class) == (
        "Failed",
        "tenant_quota_exceeded",
        "QuotaExceeded",
    )
    assert not [e for e in runtime.runs.events(late.id) if e.type == "ModelCallStarted"]
    assert fresh.status == "Completed"
    assert store.used(acme, window_of("day")) == spent_in(runtime.db, acme, window_of("day"))
