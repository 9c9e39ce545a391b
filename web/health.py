"""Liveness, readiness and Prometheus metrics (no authentication)."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from web.draining import is_draining
from web.extensions import runtime

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    checks = {"sql": _check_sql(), "redis": _check_redis()}
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


@bp.get("/metrics")
def metrics() -> Response:
    """The process's own metrics, then those computed from SQL at scrape time."""
    body = generate_latest() + generate_latest(current_app.extensions["tracon_metrics"])
    return Response(body, mimetype=CONTENT_TYPE_LATEST)
