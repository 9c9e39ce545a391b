"""The Flask front end: `create_app(runtime)` with one blueprint per surface.

The web process never executes a run: it authenticates, validates, writes the `Queued`
row, enqueues the task and then answers 202, streams the run's events, or waits.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask

from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import load_settings


def create_app(runtime: Runtime | None = None, test_config: dict[str, Any] | None = None) -> Flask:
    from web import (
        agents,
        approvals,
        console,
        draining,
        health,
        inputs,
        integrations,
        metrics,
        openai_compat,
        openapi,
        operations,
        problems,
        quota,
        runs,
        schedules,
        tracing,
        webhooks,
        workflows,
    )

    app = Flask(__name__)
    app.config.update(SSE_KEEPALIVE_SECONDS=15.0, JSON_SORT_KEYS=False)
    app.extensions["tracon"] = runtime or Runtime(load_settings())
    app.config["MAX_CONTENT_LENGTH"] = app.extensions["tracon"].settings.web.max_request_bytes
    if test_config:
        app.config.update(test_config)
    app.extensions["tracon_metrics"] = metrics.approval_registry(app.extensions["tracon"].db)
    tracing.init_app(app)  # first: the request's span opens before any other hook runs
    problems.init_app(app)
    inputs.init_app(app)
    draining.init_app(app)
    app.register_blueprint(health.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(runs.bp)
    app.register_blueprint(approvals.bp)
    app.register_blueprint(workflows.bp)
    app.register_blueprint(operations.bp)
    app.register_blueprint(quota.bp)
    app.register_blueprint(openai_compat.bp)
    app.register_blueprint(webhooks.bp)
    app.register_blueprint(schedules.bp)
    console.init_app(app)
    app.register_blueprint(agents.bp)
    app.register_blueprint(integrations.bp)  # Slack's interactions, one-time approval links
    logging.getLogger(__name__).info("tracon-jobs web ready")
    return app
