"""Operator views: circuits and slots per provider, run statistics grouped by model."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import redis
from flask import Blueprint, Response, jsonify, request
from sqlalchemy import func, select

from tracon_jobs.db.models import Run
from tracon_jobs.runtime import Runtime
from web.auth import require_tenant, tenant_id
from web.extensions import runtime
from web.problems import Problem

bp = Blueprint("operations", __name__, url_prefix="/api")
require_tenant(bp)


def circuits_view(rt: Runtime) -> list[dict[str, Any]]:
    """Every configured provider: its circuit and its concurrency slots."""
    views = []
    for name in sorted(rt.settings.providers):
        circuit = rt.breaker.snapshot(name)
        slots = rt.slots.usage(name)
        views.append(
            {
                "provider": name,
                "state": circuit.state,
                "consecutiveFailures": circuit.failures,
                "retryAfter": circuit.retry_after_ms / 1000 if circuit.retry_after_ms else None,
                "probesInFlight": circuit.probes,
                "slots": {"limit": slots.limit, "inUse": slots.in_use, "waiting": slots.waiting},
            }
        )
    return views


@bp.get("/circuits")
def circuits() -> Response:
    try:
        return jsonify({"enabled": runtime().breaker.enabled, "items": circuits_view(runtime())})
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
    filters = [Run.tenant_id == tenant_id()]
    if agent := request.args.get("agent"):
        filters.append(Run.agent == agent)
    with runtime().db.read() as session:
        by_status = dict(
            session.execute(
                select(Run.status, func.count()).where(*filters).group_by(Run.status)
            ).all()
        )
        rows = session.execute(
            select(
                Run.model_id,
                func.count(),
                func.sum(Run.input_tokens),
                func.sum(Run.output_tokens),
                func.sum(Run.cost_amount),
            )
            .where(*filters)
            .group_by(Run.model_id)
            .order_by(Run.model_id)
        ).all()
    by_model = [_model_row(*row) for row in rows]
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


def _model_row(
    model: str | None,
    runs: int,
    inputs: int | None,
    outputs: int | None,
    cost: Decimal | float | None,
) -> dict[str, Any]:
    inputs, outputs = int(inputs or 0), int(outputs or 0)
    return {
        "model": model,
        "runs": runs,
        "usage": {"inputTokens": inputs, "outputTokens": outputs, "totalTokens": inputs + outputs},
        "cost": {"amount": float(cost or 0)},
    }
