"""The OpenTelemetry SDK, imported only by a process that traces (`tracing._here`).

One `TracerProvider` per process, its resource from the standard environment (with
`service.name` of the process unless `OTEL_SERVICE_NAME` names one, and `process.pid`),
its sampler from `OTEL_TRACES_SAMPLER`, a batch processor (`OTEL_BSP_*`) per exporter of
`OTEL_TRACES_EXPORTER`: OTLP over HTTP with protobuf by default, or the console's. It is
made the global provider too, so spans a tool opens with `trace.get_tracer(...)` nest
under the tool's span.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import PROCESS_PID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_KINDS = {
    "internal": SpanKind.INTERNAL,
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
    "producer": SpanKind.PRODUCER,
    "consumer": SpanKind.CONSUMER,
}
_PROPAGATOR = TraceContextTextMapPropagator()
SCOPE = "tracon_jobs"


def _exporters() -> list[SpanExporter]:
    names = [
        part.strip().lower()
        for part in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
        if part.strip()
    ]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
    return exporters


def _version() -> str | None:
    """The installed tracon-jobs's version: the instrumentation scope's."""
    try:
        return metadata.version("tracon-jobs")
    except metadata.PackageNotFoundError:
        return None


def parent_context(traceparent: str | None) -> otel_context.Context | None:
    if not traceparent:
        return None
    found = _PROPAGATOR.extract({"traceparent": traceparent})
    return found if trace.get_current_span(found).get_span_context().is_valid else None


def traceparent_of(span: trace.Span) -> str | None:
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


class _OpenSpan:
    """An SDK span behind `tracing.Span`."""

    __slots__ = ("_span",)

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def set(self, key: str, value: Any) -> None:
        if value is not None:
            self._span.set_attribute(key, value)

    def set_many(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set(key, value)

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        clean = {k: v for k, v in (attributes or {}).items() if v is not None}
        self._span.add_event(name, clean)

    def fail(self, description: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, description))

    @property
    def traceparent(self) -> str | None:
        return traceparent_of(self._span)


@dataclass
class Tracing:
    """This process's provider and tracer."""

    pid: int
    provider: TracerProvider
    tracer: trace.Tracer

    @classmethod
    def create(cls, service_name: str) -> Tracing:
        attributes: dict[str, Any] = {PROCESS_PID: os.getpid()}
        if not os.environ.get("OTEL_SERVICE_NAME", "").strip():
            resource = Resource.create(attributes)  # OTEL_RESOURCE_ATTRIBUTES may name it
            if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
                resource = resource.merge(Resource({SERVICE_NAME: service_name}))
        else:
            resource = Resource.create(attributes)
        provider = TracerProvider(resource=resource)
        for exporter in _exporters():
            provider.add_span_processor(BatchSpanProcessor(exporter))
        with contextlib.suppress(Exception):  # a global set before (a test's) stays
            trace.set_tracer_provider(provider)
        return cls(os.getpid(), provider, provider.get_tracer(SCOPE, _version()))

    def shutdown(self) -> None:
        self.provider.shutdown()

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        kind: str,
        attributes: Mapping[str, Any] | None,
        parent: str | None,
        links: Sequence[str | None],
        expected: tuple[type[BaseException], ...] = (),
    ) -> Iterator[_OpenSpan]:
        linked = []
        for traceparent in links:
            found = parent_context(traceparent)
            if found is not None:
                linked.append(Link(trace.get_current_span(found).get_span_context()))
        clean = {k: v for k, v in (attributes or {}).items() if v is not None}
        with self.tracer.start_as_current_span(
            name,
            context=parent_context(parent),
            kind=_KINDS[kind],
            attributes=clean,
            links=linked,
            record_exception=False,
            set_status_on_exception=False,
        ) as opened:
            try:
                yield _OpenSpan(opened)
            except expected as stopped:
                opened.add_event("tracon.stopped", {"reason": type(stopped).__name__})
                raise
            except BaseException as exc:
                opened.record_exception(exc)
                opened.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                raise

    def current_span(self) -> _OpenSpan:
        return _OpenSpan(trace.get_current_span())

    def current_traceparent(self) -> str | None:
        return traceparent_of(trace.get_current_span())

    def current_ids(self) -> tuple[str, str] | None:
        context = trace.get_current_span().get_span_context()
        if not context.is_valid:
            return None
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"

    @contextlib.contextmanager
    def attached(self, traceparent: str) -> Iterator[None]:
        found = parent_context(traceparent)
        if found is None:
            yield
            return
        with self.context_attached(found):
            yield

    def context(self) -> otel_context.Context:
        return otel_context.get_current()

    @contextlib.contextmanager
    def context_attached(self, context: Any) -> Iterator[None]:
        token = otel_context.attach(context)
        try:
            yield
        finally:
            otel_context.detach(token)
