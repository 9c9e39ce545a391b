"""Tenant cost quotas on the web: `GET /api/quota`, and the `429` a run-starting route answers
while the tenant's quota is spent (before the body is read or a row written). With an
`Idempotency-Key` the check comes after the replay decision (`before_new_work`): a stored
answer is replayed, since a replay spends nothing, and a refusal releases the reservation."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from flask import Blueprint, Response, g, jsonify, request

from tracon_jobs.limits.quota_store import Period, utc_now, window_of
from tracon_jobs.limits.tenant_quotas import quota_json
from tracon_jobs.runtime import Runtime
from web.auth import require_tenant, tenant_id
from web.extensions import runtime
from web.idempotency import before_new_work
from web.problems import Problem

log = logging.getLogger(__name__)

bp = Blueprint("quota", __name__, url_prefix="/api")
require_tenant(bp)


@bp.get("/quota")
def quota() -> Response:
    """The tenant's quota and what it spent in the current period, its concurrency limit,
    its weight in fair dispatch and the priorities its runs may ask for."""
    return jsonify(quota_view(runtime(), tenant_id()))


def quota_view(rt: Runtime, tenant: str) -> dict[str, Any]:
    """`GET /api/quota`'s body: also the data of a `quota.exceeded` webhook message."""
    usage = rt.quotas.usage(tenant)
    return quota_json(
        usage,
        rt.settings.pricing.currency,
        max_concurrent_runs(rt, tenant),
        rt.tenants.weight(tenant),
    )


def max_concurrent_runs(rt: Runtime, tenant: str) -> int | None:
    """The tenant's own limit, else `Tenants.MaxConcurrentRuns`."""
    own = rt.tenants.max_concurrent_runs(tenant)
    return own if own is not None else rt.settings.tenants.max_concurrent_runs


def refuse_when_spent(blueprint: Blueprint, endpoints: Iterable[str]) -> None:
    """Register, after the blueprint's authentication, the check that answers `429` with
    `Retry-After` (seconds to the end of the period) to a new run while the quota is spent."""
    guarded = frozenset(endpoints)

    @blueprint.before_request
    def _refuse_new_runs_over_quota() -> None:
        if request.endpoint in guarded:
            before_new_work(refuse_when_quota_spent)


def refuse_when_quota_spent() -> None:
    """`429` with `Retry-After` (seconds to the end of the period) while the tenant's quota is
    spent."""
    quotas = runtime().quotas
    tenant = tenant_id()
    now = utc_now()
    own = g.get("own_quota")
    quota = quotas.quota_of(tenant) if own is None else quotas.quota_from(own)
    if quota.limit is None:
        return
    refusal = quotas.refusal(tenant, quota, now)
    if refusal is None:
        return
    tell_quota_exceeded(tenant, quota.period)
    retry_after = window_of(quota.period, now).seconds_left(now)
    raise Problem(
        429,
        "Too Many Requests",
        refusal.message,
        headers={"Retry-After": str(retry_after)},
        code=refusal.type,
        openai_type="insufficient_quota",
    )


def tell_quota_exceeded(tenant: str, period: Period) -> None:
    """The `quota.exceeded` webhook message of the refusal (once a quota window, only when
    anyone wants it): a failure to write it is logged, and the `429` answered all the same."""
    try:
        runtime().outbox.quota_refused(tenant, period)
    except Exception as exc:  # the refusal stands whatever the outbox does
        log.warning("quota.exceeded of tenant %s not written: %s", tenant, exc)
