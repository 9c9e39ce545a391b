"""Traces: one OpenTelemetry trace per run, across the web, the broker and the worker.

Tracing is on when the standard environment says so (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER` other than `none`; off
with `OTEL_SDK_DISABLED=true`), and then exported over OTLP/HTTP (protobuf) by the
official SDK, which reads the rest of the standard variables itself: the endpoint, headers
and timeout, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`(`_ARG`)
and the batch processor's `OTEL_BSP_*`. `check_environment` refuses, at startup, a value
of those that would be ignored or would silently export nothing (`grpc`, `zipkin`, a
sampler the SDK does not know).

Off, nothing of OpenTelemetry is imported: every function here answers at once (a span is
`NO_SPAN`, a traceparent None). On, the SDK is set up once per process and again in a
process forked after it (`start(process)` in gunicorn's `post_fork`, the worker's and
beat's init; a pid check catches any other fork), because its batch processor is a thread.

The spans (`docs/tracing.md`): the web's request (`SpanKind.SERVER`, continuing the
client's `traceparent`), the run's submission (`submit <agent>`, whose context is the
run's `traceparent`, kept on its row and sent in its message's headers), each execution
of the run on a worker (`execute <agent>`, a child of the submission), and inside it the
GenAI spans: `chat <model>` per model call, `execute_tool <tool>` per tool call (a child
run's submission nests under it), and a workflow's nodes.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tracon_jobs.errors import ConfigurationError

if TYPE_CHECKING:
    from tracon_jobs.tracing.sdk import Tracing

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("http/protobuf",)
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
BSP_VARIABLES = (
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
)
CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
"""The GenAI instrumentations' opt-in: `true` records messages, prompts and tool
arguments and results on the spans (`gen_ai.input.messages`, ...); off by default."""

SERVICE_NAMES = {"web": "tracon-web", "worker": "tracon-worker", "beat": "tracon-beat"}


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporters(env)
    if exporters is not None:
        return any(name != "none" for name in exporters)
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse the standard variables this process would ignore (`ConfigurationError`
    naming the variable): an exporter or protocol other than OTLP/HTTP with protobuf, an
    unknown sampler, a sampler argument or a batch setting that is not a number."""
    env = os.environ if environ is None else environ
    for name in _exporters(env) or ():
        if name not in EXPORTERS:
            raise ConfigurationError(
                "OTEL_TRACES_EXPORTER", f"must be one of {', '.join(EXPORTERS)} (got {name!r})"
            )
    for variable in PROTOCOL_VARIABLES:
        value = env.get(variable, "").strip()
        if value and value not in PROTOCOLS:
            raise ConfigurationError(
                variable, f"only http/protobuf is exported (got {value!r}; grpc is not)"
            )
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler and sampler not in SAMPLERS:
        raise ConfigurationError(
            "OTEL_TRACES_SAMPLER", f"must be one of {', '.join(SAMPLERS)} (got {sampler!r})"
        )
    argument = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if argument and sampler.endswith("traceidratio"):
        try:
            ratio = float(argument)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise ConfigurationError(
                "OTEL_TRACES_SAMPLER_ARG", f"must be a ratio from 0 to 1 (got {argument!r})"
            )
    for variable in BSP_VARIABLES:
        value = env.get(variable, "").strip()
        if value and not (value.isdigit() and int(value) > 0):
            raise ConfigurationError(variable, f"must be a whole number above 0 (got {value!r})")
    capture = env.get(CAPTURE_CONTENT, "").strip().lower()
    if capture and capture not in ("true", "false"):
        raise ConfigurationError(CAPTURE_CONTENT, f"must be true or false (got {capture!r})")


def _exporters(env: Mapping[str, str]) -> list[str] | None:
    raw = env.get("OTEL_TRACES_EXPORTER")
    if raw is None or not raw.strip():
        return None
    return [part.strip().lower() for part in raw.split(",") if part.strip()]


# -- the process's tracer ---------------------------------------------------------------

_process = "tracon"  # what `start` names this process; a lazy start uses it too
_tracing: Tracing | None = None
_checked_pid = -1  # the process `_tracing` was looked at in (-1: never)


def start(process: str) -> bool:
    """Set tracing up in this process (after any fork), when the environment asks for it;
    `process` is `web`, `worker` or `beat` (its `service.name` unless `OTEL_SERVICE_NAME`
    names one). True when on."""
    global _process
    _process = process
    return _here(restart=True) is not None


def name_process(process: str) -> None:
    """What a lazy start names this process, unless `start` named it already."""
    global _process
    if _process == "tracon":
        _process = process


def _active() -> Tracing | None:
    """This process's tracing if it was set up here (never sets it up)."""
    tracing = _tracing
    return tracing if tracing is not None and tracing.pid == os.getpid() else None


def flush(timeout_seconds: float) -> None:
    """Export what is buffered, waiting at most `timeout_seconds` (before an `os._exit`)."""
    tracing = _active()
    if tracing is not None:
        tracing.provider.force_flush(int(timeout_seconds * 1000))


def shutdown() -> None:
    """Export what is buffered and stop (a process's last words; idempotent)."""
    global _tracing
    if _tracing is not None:
        _tracing.shutdown()
        _tracing = None


def _here(restart: bool = False) -> Tracing | None:
    """This process's tracing: set up on first use in each process, when wanted."""
    global _tracing, _checked_pid
    pid = os.getpid()
    if _checked_pid == pid and not restart:
        return _tracing
    _checked_pid = pid
    if _tracing is not None and _tracing.pid == pid and not restart:
        return _tracing
    if _tracing is not None and _tracing.pid == pid:
        _tracing.shutdown()
    _tracing = None  # another process's (a fork's parent): its exporter thread is not here
    if wanted():
        check_environment()
        from tracon_jobs.tracing.sdk import Tracing

        _tracing = Tracing.create(SERVICE_NAMES.get(_process, f"tracon-{_process}"))
    return _tracing


def on() -> bool:
    """Whether this process traces."""
    return _here() is not None


def capture_content() -> bool:
    """Whether messages and tool arguments may be recorded (`CAPTURE_CONTENT`)."""
    return os.environ.get(CAPTURE_CONTENT, "").strip().lower() == "true"


# -- spans -------------------------------------------------------------------------------


class Span(Protocol):
    """What the code does with a span: attributes, events, its traceparent."""

    def set(self, key: str, value: Any) -> None: ...

    def set_many(self, attributes: Mapping[str, Any]) -> None: ...

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None: ...

    def fail(self, description: str) -> None: ...

    @property
    def traceparent(self) -> str | None: ...


class _NoSpan:
    """The span of a process that does not trace: every call does nothing."""

    def set(self, key: str, value: Any) -> None:
        pass

    def set_many(self, attributes: Mapping[str, Any]) -> None:
        pass

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def fail(self, description: str) -> None:
        pass

    @property
    def traceparent(self) -> str | None:
        return None


NO_SPAN: Span = _NoSpan()
OFF: contextlib.AbstractContextManager[Span] = contextlib.nullcontext(NO_SPAN)
"""What `span` returns when this process does not trace: one reusable no-op block."""

INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = (
    "internal",
    "server",
    "client",
    "producer",
    "consumer",
)


def span(
    name: str,
    *,
    kind: str = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    parent: str | None = None,
    links: Sequence[str | None] = (),
    expected: tuple[type[BaseException], ...] = (),
) -> contextlib.AbstractContextManager[Span]:
    """A span around the block, current inside it (a child of the current span, or of
    `parent`, a W3C traceparent, when given); `links` are traceparents it links to. An
    exception leaving the block marks it failed, unless it is one of `expected` (a run
    that parks or waits for a person: an event `tracon.stopped` says which). `NO_SPAN`
    (in `OFF`) when this process does not trace: callers that build attributes ask `on()`
    first."""
    tracing = _here()
    if tracing is None:
        return OFF
    return tracing.span(name, kind, attributes, parent, links, expected)


def current_span() -> Span:
    """The current span, to add to (`NO_SPAN` outside one, or when off)."""
    tracing = _active()
    return NO_SPAN if tracing is None else tracing.current_span()


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (None outside one, or when off)."""
    tracing = _active()
    return None if tracing is None else tracing.current_traceparent()


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, for log lines and exemplars."""
    tracing = _active()
    return None if tracing is None else tracing.current_ids()


@contextlib.contextmanager
def attached(traceparent: str | None) -> Iterator[None]:
    """The block runs as a child of `traceparent` (a web request's client span)."""
    tracing = _here()
    if tracing is None or not traceparent:
        yield
        return
    with tracing.attached(traceparent):
        yield


_incoming: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tracon_incoming_traceparent", default=None
)


@contextlib.contextmanager
def delivered(traceparent: str | None) -> Iterator[None]:
    """The traceparent the message being executed was sent with (its `traceparent`
    header): the sender's span, linked from the execution's span."""
    token = _incoming.set(traceparent)
    try:
        yield
    finally:
        _incoming.reset(token)


def delivered_with() -> str | None:
    """The traceparent of the message this thread executes, if it had one."""
    return _incoming.get()


def exemplar() -> dict[str, str] | None:
    """The current span's ids (else those of the message being executed) as a Prometheus
    exemplar's labels, `{"trace_id", "span_id"}`; None when this process does not trace."""
    tracing = _active()
    if tracing is None:
        return None
    ids = tracing.current_ids()
    if ids is None:
        parts = (_incoming.get() or "").split("-")
        if len(parts) != 4:
            return None
        ids = (parts[1], parts[2])
    return {"trace_id": ids[0], "span_id": ids[1]}


def carry_context() -> Any:
    """The current trace context, for work handed to another thread (`run_in`)."""
    tracing = _active()
    return None if tracing is None else tracing.context()


@contextlib.contextmanager
def run_in(context: Any) -> Iterator[None]:
    """The block runs in a context `carry_context` took on another thread."""
    tracing = _active()
    if tracing is None or context is None:
        yield
        return
    with tracing.context_attached(context):
        yield
