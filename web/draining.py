"""While this node drains, every route that starts a run answers 503; the rest still work.

A retry with an `Idempotency-Key` whose answer is stored still gets it (`before_new_work`):
the drain stops new work, a replay starts none.
"""

from __future__ import annotations

from flask import Flask, current_app, request

from tracon_jobs.drain_file import web_draining
from web.idempotency import before_new_work
from web.problems import Problem

RUN_STARTING_ENDPOINTS = frozenset(
    {
        "runs.run_agent",
        "openai.chat_completions",
        "openai.responses",
        "workflows.run_workflow",
        "workflows.respond",
        "workflows.respond_many",
        "workflows.resume",
        "workflows.deliver_event",
    }
)


def is_draining() -> bool:
    return bool(current_app.config.get("TRACON_DRAINING")) or web_draining()


def init_app(app: Flask) -> None:
    @app.before_request
    def _refuse_new_runs_while_draining() -> None:
        if request.endpoint in RUN_STARTING_ENDPOINTS:
            before_new_work(refuse_while_draining)


def refuse_while_draining() -> None:
    if is_draining():
        raise Problem(
            503,
            "Service Unavailable",
            "this node is draining before it stops; retry shortly",
            headers={"Retry-After": "5"},
            code="service_unavailable",
            openai_type="service_unavailable",
        )
