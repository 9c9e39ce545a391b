"""Access to the Runtime that `create_app` stored in `app.extensions`."""

from __future__ import annotations

from flask import current_app

from tracon_jobs.runtime import Runtime


def runtime() -> Runtime:
    value: Runtime = current_app.extensions["tracon"]
    return value
