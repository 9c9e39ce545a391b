"""A local OTLP/HTTP receiver of traces: `POST /v1/traces` with protobuf bodies (gzip or
not), decoded with the protocol's own messages (`opentelemetry-proto`), answered as a
collector answers. Tests point `OTEL_EXPORTER_OTLP_ENDPOINT` at `receiver.endpoint` and
wait for the spans they expect."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.local_server import LocalServer
from tests.waits import TIMEOUT_SLACK

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str


@dataclass(frozen=True)
class Event:
    name: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    status: str = "unset"

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name"))

    def event(self, name: str) -> Event | None:
        return next((e for e in self.events if e.name == name), None)


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which) if which else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


_STATUS = {0: "unset", 1: "ok", 2: "error"}


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        kind=KINDS.get(span.kind, str(span.kind)),
                        attributes=_attributes(span.attributes),
                        resource=resource,
                        events=[Event(e.name, _attributes(e.attributes)) for e in span.events],
                        links=[Link(k.trace_id.hex(), k.span_id.hex()) for k in span.links],
                        status=_STATUS.get(span.status.code, "unset"),
                    )
                )
    return spans


class OtlpReceiver:
    """The receiver, on a free port of 127.0.0.1 (a thread per request)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                received = decode(body)
                with receiver._lock:
                    receiver.requests += 1
                    receiver.spans.extend(received)
                    receiver._lock.notify_all()
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = LocalServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def env(self) -> dict[str, str]:
        """The variables a process exports to this receiver with (batches every 100 ms)."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def wait_for(
        self,
        predicate: Callable[[list[ReceivedSpan]], bool],
        timeout: float = 20.0,
        what: str = "spans",
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout * TIMEOUT_SLACK
        with self._lock:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise AssertionError(f"timed out waiting for {what}; received {names}")
                self._lock.wait(left)
            return list(self.spans)

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.name == name]
