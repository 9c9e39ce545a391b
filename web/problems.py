"""RFC 9457 problem+json responses, raised as exceptions from anywhere in a request."""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, json, request
from sqlalchemy.exc import InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException

PROBLEM_TYPE = "about:blank"
OPENAI_PREFIX = "/v1/"
"""Where errors take OpenAI's shape (`{"error": {...}}`) instead of problem+json."""
OPENAI_CODES = {404: "not_found", 405: "method_not_allowed"}


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
    detail = exc.description or exc.name
    if request.path.startswith(OPENAI_PREFIX):  # no /v1 route matched: its own handler never ran
        return _openai_error(status, detail, kept_headers(exc))
    return Problem(status, exc.name, detail, headers=kept_headers(exc)).response()


def _openai_error(status: int, message: str, headers: dict[str, str]) -> Response:
    """A framework error (no such route, a method the route does not take) on a `/v1` path, in
    OpenAI's error shape like every other `/v1` answer."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": kind, "param": None, "code": OPENAI_CODES.get(status)}
    response = Response(json.dumps({"error": error}), status=status, mimetype="application/json")
    response.headers.update(headers)
    return response


def kept_headers(exc: HTTPException) -> dict[str, str]:
    """The headers the framework's own error carries (`Allow` on a 405), but its type."""
    return {name: value for name, value in exc.get_headers() if name.lower() != "content-type"}
