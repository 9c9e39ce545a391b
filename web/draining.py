"""While this node drains, every route that starts a run answers 503; the rest still work."""

from __future__ import annotations

from flask import Flask, current_app, request

from tracon_jobs.drain import web_draining
from web.problems import Problem

RUN_STARTING_ENDPOINTS = frozenset(
    {
        "runs.run_agent",
        "openai.chat_completions",
        "openai.responses",
        "workflows.run_workflow",
        "workflows.respond",
        "workflows.resume",
    }
)


def is_draining() -> bool:
    return bool(current_app.config.get("TRACON_DRAINING")) or web_draining()


def init_app(app: Flask) -> None:
    @app.before_request
    def _refuse_new_runs_while_draining() -> None:
        if request.endpoint in RUN_STARTING_ENDPOINTS and is_draining():
            raise Problem(
                503,
                "Service Unavailable",
                "this node is draining before it stops; retry shortly",
                headers={"Retry-After": "5"},
                code="service_unavailable",
                openai_type="service_unavailable",
            )
