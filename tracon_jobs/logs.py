"""Log lines that say which run they belong to, as text or as one JSON object per line.

While a run executes, `run_context(run_id, tenant, agent)` holds its identity in a context
variable; `RunContextFilter` copies it onto every record (`record.run_id`, `.tenant`,
`.agent`, and `.run_tag` for the text format), whatever logger emitted it. `install()`
puts the filter and the format on the root logger's handlers: text by default, JSON with
`TRACON_LOG_FORMAT=json`:

    {"time": "2026-11-30T03:17:14.050Z", "level": "WARNING", "logger": "tracon_jobs.x",
     "message": "...", "run_id": "…", "tenant": "acme", "agent": "demo",
     "trace_id": "…", "span_id": "…", "exc_info": null}

`trace_id` and `span_id` are the current span's (`tracing`), null when untraced.

A context variable does not follow work handed to another thread: `carry(fn)` and
`carry_coroutine(coro)` take the current run's identity along.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from tracon_jobs import tracing

FORMAT_ENV = "TRACON_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(run_tag)s %(message)s"

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class RunFields:
    run_id: str
    tenant: str | None = None
    agent: str | None = None


_current: contextvars.ContextVar[RunFields | None] = contextvars.ContextVar(
    "tracon_run", default=None
)


def current() -> RunFields | None:
    """The run the current thread (or task) executes, if any."""
    return _current.get()


@contextlib.contextmanager
def run_context(
    run_id: str, tenant: str | None = None, agent: str | None = None
) -> Iterator[RunFields]:
    """Every line logged inside carries the run's id, tenant and agent.

    A field left None is taken from the enclosing context when it is the same run (the
    Celery task knows the tenant's name, the executor only its id), so nesting never
    loses what the outer context knew.
    """
    outer = _current.get()
    if outer is not None and outer.run_id == run_id:
        tenant = tenant if tenant is not None else outer.tenant
        agent = agent if agent is not None else outer.agent
    fields = RunFields(run_id, tenant, agent)
    token = _current.set(fields)
    try:
        yield fields
    finally:
        _current.reset(token)


def carry(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn` bound to the current run's identity and trace context, for another thread (a
    pool's worker)."""
    fields = _current.get()
    trace_context = tracing.carry_context()

    def bound(*args: P.args, **kwargs: P.kwargs) -> T:
        token = _current.set(fields)
        try:
            with tracing.run_in(trace_context):
                return fn(*args, **kwargs)
        finally:
            _current.reset(token)

    return bound


def carry_coroutine(coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """`coro` wrapped to run under the current run's identity (and trace context) on
    another event loop."""
    fields = _current.get()
    trace_context = tracing.carry_context()

    async def bound() -> T:
        _current.set(fields)  # the task runs in a copy of the loop's context: nothing leaks
        with tracing.run_in(trace_context):
            return await coro

    return bound()


class RunContextFilter(logging.Filter):
    """Adds `run_id`, `tenant`, `agent` (None outside a run), `trace_id` and `span_id`
    (None outside a span, or untraced) and `run_tag` to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _current.get()
        ids = tracing.current_ids()
        record.trace_id, record.span_id = ids if ids is not None else (None, None)
        if fields is None:
            record.run_id = record.tenant = record.agent = None
            record.run_tag = "" if ids is None else f" [trace_id={ids[0]}]"
        else:
            record.run_id, record.tenant, record.agent = (
                fields.run_id,
                fields.tenant,
                fields.agent,
            )
            parts = [f"run_id={fields.run_id}"]
            parts += [f"{k}={v}" for k, v in asdict(fields).items() if k != "run_id" and v]
            if ids is not None:
                parts.append(f"trace_id={ids[0]}")
            record.run_tag = f" [{' '.join(parts)}]"
        return True


class Repeated:
    """Warnings of a failure that goes on (SQL or Redis away, seen by a loop that polls):
    logged once, then at most once every `every` seconds per source while it lasts, and at
    once again after `ended`."""

    def __init__(self, logger: logging.Logger, every: float = 60.0) -> None:
        self.logger = logger
        self.every = every
        self._last: dict[str, float] = {}

    def warn(self, source: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(source, -self.every) >= self.every:
            self._last[source] = now
            self.logger.warning(message, *args)

    def ended(self, source: str) -> None:
        self._last.pop(source, None)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, run fields, exc_info."""

    def format(self, record: logging.LogRecord) -> str:
        exc_info = None
        if record.exc_info:
            exc_info = self.formatException(record.exc_info)
        elif record.exc_text:
            exc_info = record.exc_text
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "run_id": getattr(record, "run_id", None),
            "tenant": getattr(record, "tenant", None),
            "agent": getattr(record, "agent", None),
            "trace_id": getattr(record, "trace_id", None),
            "span_id": getattr(record, "span_id", None),
            "exc_info": exc_info,
        }
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def formatter(environ: dict[str, str] | None = None) -> logging.Formatter:
    """The formatter `TRACON_LOG_FORMAT` asks for (`text`, the default, or `json`)."""
    env = os.environ if environ is None else environ
    kind = env.get(FORMAT_ENV, "text").strip().lower()
    if kind == "json":
        return JsonFormatter()
    if kind not in ("", "text"):
        logging.getLogger(__name__).warning("%s=%r is unknown; using text", FORMAT_ENV, kind)
    return logging.Formatter(TEXT_FORMAT)


def install(logger: logging.Logger | None = None, environ: dict[str, str] | None = None) -> None:
    """Put the run filter and the chosen format on `logger`'s handlers (the root's by
    default); idempotent, so every setup signal of a process may call it."""
    target = logger or logging.getLogger()
    chosen = formatter(environ)
    for handler in target.handlers:
        if not any(isinstance(f, RunContextFilter) for f in handler.filters):
            handler.addFilter(RunContextFilter())
        handler.setFormatter(chosen)
