"""RFC 9457 problem+json responses, raised as exceptions from anywhere in a request."""

from __future__ import annotations

import logging
from typing import Any

import redis
from flask import Flask, Response, current_app, json, request
from sqlalchemy.exc import InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException

from tracon_jobs.db.engine import ConnectionsExhausted

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
    for unavailable in (OperationalError, InterfaceError, ConnectionsExhausted):
        app.register_error_handler(unavailable, _sql_unavailable)
    for outage in REDIS_OUTAGES:
        app.register_error_handler(outage, _redis_unavailable)
    app.register_error_handler(HTTPException, _http_exception)


SQL_RETRY_AFTER_SECONDS = 5
REDIS_RETRY_AFTER_SECONDS = 5
REDIS_OUTAGES = (redis.ConnectionError, redis.TimeoutError)
"""What a Redis that does not answer raises (a refused or dropped connection, a timeout);
a script or command error is a defect, and stays a 500."""


def _sql_unavailable(exc: Exception) -> Response:
    """The database did not answer (a restart, a failover), or this process's every
    connection stayed busy (`Database.MaxConnections`): 503 and when to retry; nothing was
    half-done, every write is one transaction."""
    logging.getLogger(__name__).warning("database unavailable: %s", exc)
    return unavailable("the database", SQL_RETRY_AFTER_SECONDS, "database_unavailable")


def _redis_unavailable(exc: Exception) -> Response:
    """Redis did not answer (a restart, a failover) where a request needs it (a live
    stream's place, the broker): 503 and when to retry, as for the database."""
    logging.getLogger(__name__).warning("redis unavailable: %s", exc)
    return unavailable("Redis", REDIS_RETRY_AFTER_SECONDS, "redis_unavailable")


def unavailable(store: str, retry_after: int, code: str) -> Response:
    """A store outage met anywhere in a request, answered as the route answers its own
    `Problem`s: problem+json, or OpenAI's error shape under `/v1` (its blueprint's handler)."""
    problem = Problem(
        503,
        "Service Unavailable",
        f"{store} is not answering; retry shortly",
        headers={"Retry-After": str(retry_after)},
        code=code,
        openai_type="service_unavailable",
    )
    return current_app.make_response(current_app.handle_user_exception(problem))


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
