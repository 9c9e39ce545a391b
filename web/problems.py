"""RFC 9457 problem+json responses, raised as exceptions from anywhere in a request."""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, json
from sqlalchemy.exc import InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException

PROBLEM_TYPE = "about:blank"


class Problem(Exception):
    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def response(self) -> Response:
        body = {
            "type": PROBLEM_TYPE,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            **{key: value for key, value in self.extra.items() if not key.startswith("openai_")},
        }
        response = Response(
            json.dumps(body), status=self.status, mimetype="application/problem+json"
        )
        response.headers.update(self.headers)
        return response


def bad_request(detail: str, **extra: Any) -> Problem:
    return Problem(400, "Bad Request", detail, **extra)


def not_found(detail: str) -> Problem:
    return Problem(404, "Not Found", detail)


def init_app(app: Flask) -> None:
    app.register_error_handler(Problem, lambda problem: problem.response())
    for unavailable in (OperationalError, InterfaceError):
        app.register_error_handler(unavailable, _sql_unavailable)
    app.register_error_handler(HTTPException, _http_exception)


SQL_RETRY_AFTER_SECONDS = 5


def _sql_unavailable(exc: Exception) -> Response:
    """The database did not answer (a restart, a failover): 503 and when to retry, as a
    Redis outage gets; nothing was half-done, every write is one transaction."""
    logging.getLogger(__name__).warning("database unavailable: %s", exc)
    return Problem(
        503,
        "Service Unavailable",
        "the database is not answering; retry shortly",
        headers={"Retry-After": str(SQL_RETRY_AFTER_SECONDS)},
        code="database_unavailable",
        openai_type="service_unavailable",
    ).response()


def _http_exception(exc: HTTPException) -> Response:
    status = exc.code or 500
    return Problem(
        status, exc.name, exc.description or exc.name, headers=kept_headers(exc)
    ).response()


def kept_headers(exc: HTTPException) -> dict[str, str]:
    """The headers the framework's own error carries (`Allow` on a 405), but its type."""
    return {name: value for name, value in exc.get_headers() if name.lower() != "content-type"}
