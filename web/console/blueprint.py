"""The console blueprint and its gate: every page needs a signed-in session, every POST the
session's CSRF token; errors are HTML pages, not problem+json; nothing is cached."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Response, jsonify, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from tracon_jobs.numbers import json_text
from web.console.money import money
from web.console.session import csrf_ok, csrf_token, signed_in_tenant

bp = Blueprint(
    "console",
    __name__,
    template_folder="templates",
    static_folder="static",
    static_url_path="/console/static",
)

OPEN_ENDPOINTS = {"console.signin", "console.static"}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class FormRefused(HTTPException):
    code = 400
    description = "The form was not sent by this console (its security token is missing or old)."


@bp.before_request
def _gate() -> ResponseReturnValue | None:
    if request.method == "POST" and not csrf_ok():
        raise FormRefused()
    if request.endpoint in OPEN_ENDPOINTS or signed_in_tenant() is not None:
        return None
    if request.path.startswith("/console/live/"):
        response = jsonify({"signedIn": False})
        response.status_code = 401
        return response
    return redirect(url_for("console.signin", next=request.full_path.rstrip("?")))


@bp.after_request
def _headers(response: Response) -> Response:
    if request.endpoint != "console.static":
        response.headers["Cache-Control"] = "no-store"
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    return response


@bp.errorhandler(HTTPException)
def _error_page(exc: HTTPException) -> tuple[str, int]:
    status = exc.code or 500
    return render_template("console/error.html", status=status, error=exc), status


@bp.app_template_global("csrf_token")
def _csrf_token() -> str:
    return csrf_token()


@bp.app_template_filter("when")
def when(value: datetime | None) -> str:
    return "—" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


@bp.app_template_filter("iso")
def iso(value: datetime | None) -> str:
    return "" if value is None else value.isoformat(timespec="milliseconds") + "Z"


@bp.app_template_filter("duration")
def duration(ms: float | None) -> str:
    if ms is None:
        return "—"
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms // 60_000:.0f} min {ms % 60_000 / 1000:.0f} s"


bp.app_template_filter("money")(money)


@bp.app_template_filter("pretty")
def pretty(value: Any) -> str:
    """JSON for a `<pre>`: strings as they are, everything else indented, its numbers
    positional as every amount on the page (`0.000053`, never `5.3e-05`)."""
    if isinstance(value, str):
        return value
    return json_text(value, ensure_ascii=False)


@bp.app_template_filter("short")
def short(run_id: str | None) -> str:
    return "—" if not run_id else run_id[:8]


def safe_next(target: str | None) -> str:
    """A same-site path to go back to after signing in, never another host."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return url_for("console.runs")
    parts = urlsplit(target)
    return target if not parts.scheme and not parts.netloc else url_for("console.runs")
