"""The web's spans: one `SpanKind.SERVER` span per request (but health checks, `/metrics`
and static files), continuing the client's W3C `traceparent`; an answer that submitted a
run carries the run's `traceparent` header (also in the run's JSON).

Nothing is installed when the process does not trace (`tracing.on()`).
"""

from __future__ import annotations

import contextlib

from flask import Flask, Response, g, request

from tracon_jobs import tracing

UNTRACED_PREFIXES = ("/healthz", "/readyz", "/livez", "/metrics", "/static/", "/console/static/")
TRACEPARENT = "traceparent"


def init_app(app: Flask) -> None:
    tracing.name_process("web")
    if not tracing.on():
        return

    @app.before_request
    def _open_span() -> None:
        if request.path.startswith(UNTRACED_PREFIXES):
            return
        rule = request.url_rule.rule if request.url_rule is not None else None
        stack = contextlib.ExitStack()
        span = stack.enter_context(
            tracing.span(
                f"{request.method} {rule}" if rule else request.method,
                kind=tracing.SERVER,
                parent=request.headers.get(TRACEPARENT),
                attributes={
                    "http.request.method": request.method,
                    "http.route": rule,
                    "url.path": request.path,
                    "url.scheme": request.scheme,
                    "user_agent.original": request.user_agent.string or None,
                    "client.address": request.remote_addr,
                },
            )
        )
        g.tracon_span = span
        g.tracon_span_stack = stack

    @app.after_request
    def _answer(response: Response) -> Response:
        span = g.get("tracon_span")
        if span is not None:
            span.set("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                span.fail(f"HTTP {response.status_code}")
        run_traceparent = g.get("run_traceparent")
        if run_traceparent:
            response.headers[TRACEPARENT] = run_traceparent
        return response

    @app.teardown_request
    def _close_span(error: BaseException | None) -> None:
        stack = g.pop("tracon_span_stack", None)
        if stack is None:
            return
        if error is not None:
            stack.__exit__(type(error), error, error.__traceback__)
        else:
            stack.close()


def submitted(traceparent: str | None) -> None:
    """The run this request submitted: its traceparent goes back in the answer's header."""
    if traceparent:
        g.run_traceparent = traceparent
