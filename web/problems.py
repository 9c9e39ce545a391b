"""RFC 9457 problem+json responses, raised as exceptions from anywhere in a request."""

from __future__ import annotations

from typing import Any

from flask import Flask, Response, json
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
    app.register_error_handler(HTTPException, _http_exception)


def _http_exception(exc: HTTPException) -> Response:
    status = exc.code or 500
    return Problem(status, exc.name, exc.description or exc.name).response()
