"""Liveness, readiness and Prometheus metrics (no authentication)."""

from __future__ import annotations

from flask import Blueprint, Flask, Response, current_app, jsonify
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from redis.cluster import RedisCluster
from sqlalchemy import text

from web.draining import is_draining
from web.extensions import runtime
from web.metrics import scrape_registry

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    checks = {"sql": _check_sql(), "redis": _check_redis()}
    if runtime().settings.redis.cluster_url is not None:
        checks["redisCluster"] = _check_redis_cluster()
    draining = is_draining()
    ready = all(checks.values()) and not draining
    body = {"status": "ready" if ready else "unavailable", "checks": checks, "draining": draining}
    return jsonify(body), 200 if ready else 503


def _check_sql() -> bool:
    try:
        with runtime().db.read() as session:
            session.execute(text("SELECT 1"))
    except Exception:
        return False
    return True


def _check_redis() -> bool:
    try:
        return bool(runtime().redis.ping())
    except Exception:
        return False


def _check_redis_cluster() -> bool:
    """The coordination state's cluster (`Redis:ClusterUrl`): every master answers a `PING`
    (building the client asks a startup node for the map, which fails when none answers)."""
    try:
        coordination = runtime().coordination
        return bool(coordination.ping(target_nodes=RedisCluster.PRIMARIES))
    except Exception:
        return False


@bp.get("/metrics")
def metrics() -> Response:
    """This node's event metrics, then the cluster's state computed at scrape time, in the
    Prometheus text format 0.0.4 (its content type given whole: Flask would add a charset)."""
    body = generate_latest(_registry(current_app))
    return Response(body, content_type=CONTENT_TYPE_PLAIN_0_0_4)


def _registry(app: Flask) -> CollectorRegistry:
    registry: CollectorRegistry | None = app.extensions.get("tracon_scrape_registry")
    if registry is None:
        approvals = app.extensions["tracon_metrics"]
        registry = scrape_registry(app.extensions["tracon"], approvals, is_draining)
        app.extensions["tracon_scrape_registry"] = registry
    return registry
