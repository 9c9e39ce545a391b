"""The web console at `/`: server-rendered pages for a tenant's runs, their timelines and
trees, approvals, schedules, webhooks, circuits and statistics, signed in with an API key
(docs/console.md)."""

from __future__ import annotations

from flask import Flask

from web.console import live, schedules, views, webhooks
from web.console.blueprint import bp
from web.console.session import init_session

__all__ = ["init_app", "live", "schedules", "views", "webhooks"]


def init_app(app: Flask) -> None:
    """Sign the console's session cookie and serve its pages."""
    init_session(app)
    app.register_blueprint(bp)
