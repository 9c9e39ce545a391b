"""A local OTLP/HTTP receiver of traces for the benchmarks: `POST /v1/traces` with a
protobuf body (gzip or not), its spans counted per `service.name`, answered as a collector
answers (200, an empty `ExportTraceServiceResponse`, `application/x-protobuf`).

It runs in the benchmark's process (a `ThreadingHTTPServer`, a thread per connection,
keep-alive) and keeps counts only, never the spans; the CPU its threads spend is counted
too (`cpu_seconds`), as it is on the machine being measured.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACES_PATH = "/v1/traces"
SERVICE_NAME = "service.name"
EMPTY_ANSWER = ExportTraceServiceResponse().SerializeToString()


@dataclass(frozen=True)
class Received:
    """What the receiver had counted at one moment."""

    spans: Counter[str]  # service.name -> spans
    requests: int
    rejected: int  # requests answered other than 200 (a wrong path, a body that did not parse)
    body_bytes: int  # as sent (compressed when gzip)
    cpu_seconds: float  # of the receiver's threads, handling requests

    def __sub__(self, before: Received) -> Received:
        spans = Counter(self.spans)
        spans.subtract(before.spans)
        return Received(
            +spans,
            self.requests - before.requests,
            self.rejected - before.rejected,
            self.body_bytes - before.body_bytes,
            self.cpu_seconds - before.cpu_seconds,
        )

    @property
    def total(self) -> int:
        return sum(self.spans.values())


def count_spans(body: bytes) -> Counter[str]:
    """Spans per `service.name` of one export request's (uncompressed) body."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    counts: Counter[str] = Counter()
    for resource_spans in request.resource_spans:
        service = next(
            (
                kv.value.string_value
                for kv in resource_spans.resource.attributes
                if kv.key == SERVICE_NAME
            ),
            "unknown",
        )
        counts[service] += sum(len(scope.spans) for scope in resource_spans.scope_spans)
    return counts


class OtlpReceiver:
    """The receiver on a free port of 127.0.0.1, serving from `__enter__` to `__exit__`."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._last = time.monotonic()  # when the last export came in
        self._spans: Counter[str] = Counter()
        self._requests = self._rejected = self._bytes = 0
        self._cpu = 0.0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # the exporter's session keeps its connection

            def do_POST(self) -> None:
                started = time.thread_time()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                counts: Counter[str] | None = None
                if self.path == TRACES_PATH:
                    try:
                        if self.headers.get("Content-Encoding", "").lower() == "gzip":
                            counts = count_spans(gzip.decompress(body))
                        else:
                            counts = count_spans(body)
                    except (DecodeError, OSError, EOFError):  # counted, answered 400
                        counts = None
                # counted before the answer: an exporter that has its answer may exit at once
                receiver._add(counts, len(body), time.thread_time() - started)
                started = time.thread_time()
                if counts is None:
                    self._answer(404 if self.path != TRACES_PATH else 400, b"", "text/plain")
                else:
                    self._answer(200, EMPTY_ANSWER, "application/x-protobuf")
                receiver._add_cpu(time.thread_time() - started)

            def _answer(self, status: int, payload: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # not a line per export on the benchmark's output

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="otlp-receiver", daemon=True
        )

    def _add(self, counts: Counter[str] | None, body_bytes: int, cpu: float) -> None:
        with self._lock:
            self._requests += 1
            self._bytes += body_bytes
            self._cpu += cpu
            if counts is None:
                self._rejected += 1
            else:
                self._spans.update(counts)
            self._last = time.monotonic()

    def _add_cpu(self, cpu: float) -> None:
        with self._lock:
            self._cpu += cpu

    def wait_quiet(self, quiet: float, timeout: float) -> bool:
        """Until no export has come for `quiet` seconds, counted from now at the earliest
        (False: still coming at `timeout`). An SDK's batch processor exports what it holds
        at least every schedule delay."""
        now = time.monotonic()
        deadline = now + timeout
        with self._lock:
            while (left := max(self._last, now) + quiet - time.monotonic()) > 0:
                if time.monotonic() >= deadline:
                    return False
                self._lock.wait(min(left, deadline - time.monotonic()))
            return True

    def received(self) -> Received:
        with self._lock:
            return Received(
                Counter(self._spans), self._requests, self._rejected, self._bytes, self._cpu
            )

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
