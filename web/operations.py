"""Operator views: circuits and slots per provider, run statistics grouped by model."""

from __future__ import annotations

from typing import Any

import redis
from flask import Blueprint, Response, jsonify, request

from tracon_jobs.resilience.views import circuits_view
from tracon_jobs.runs.store import ModelUsage
from web.auth import require_tenant, tenant_id
from web.extensions import runtime
from web.problems import Problem

bp = Blueprint("operations", __name__, url_prefix="/api")
require_tenant(bp)


@bp.get("/circuits")
def circuits() -> Response:
    try:
        rt = runtime()
        items = circuits_view(rt.breaker, rt.slots, rt.settings.providers, rt.rate_limits)
        return jsonify({"enabled": rt.breaker.enabled, "items": items})
    except redis.RedisError as exc:
        raise Problem(
            503,
            "Service Unavailable",
            f"the circuit store is unreachable: {exc}",
            headers={"Retry-After": "5"},
        ) from exc


@bp.get("/statistics/runs")
def run_statistics() -> Response:
    """Counts, tokens and cost of the tenant's runs, grouped by the model that answered."""
    stats = runtime().runs.statistics(tenant_id(), agent=request.args.get("agent"))
    by_status = stats.by_status
    by_model = [_model_row(usage) for usage in stats.by_model]
    return jsonify(
        {
            "total": sum(by_status.values()),
            "byStatus": by_status,
            "usage": {
                key: sum(m["usage"][key] for m in by_model)
                for key in ("inputTokens", "outputTokens", "totalTokens")
            },
            "cost": {
                "amount": sum(m["cost"]["amount"] for m in by_model),
                "currency": runtime().settings.pricing.currency,
            },
            "byModel": by_model,
        }
    )


def _model_row(usage: ModelUsage) -> dict[str, Any]:
    inputs, outputs = usage.input_tokens, usage.output_tokens
    return {
        "model": usage.model,
        "runs": usage.runs,
        "usage": {"inputTokens": inputs, "outputTokens": outputs, "totalTokens": inputs + outputs},
        "cost": {"amount": usage.cost},
    }
