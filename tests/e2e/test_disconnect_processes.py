"""A streaming client that goes away mid-answer, on a real `tracon-jobs web` and worker.

The model is the stub provider, streaming a 20-piece answer 0.2 s apart (4 s in all); the
client reads until the first live text delta, then closes its TCP connection. By default
the run is durable: it goes on and its stored answer is the whole text. Under
`Runs.CancelOnDisconnect` a `/v1` stream's run is canceled at once and the model's stream
is cut (the stub's write fails; the run has no `ModelCallCompleted`); a native event
stream's run goes on even then (the setting is documented for `/v1` streams only).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from openai import OpenAI

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import ENDED, MakeRuntime, event_types, scripted_agent
from tests.stub_provider import Exchange, Reply, StubProvider
from tracon_jobs.db.models import Run
from tracon_jobs.runtime import Runtime

pytestmark = pytest.mark.e2e

ANSWER = "".join(f"word{i:02d} " for i in range(20))
CHUNKS = 20
CHUNK_DELAY = 0.2
ANSWER_SECONDS = CHUNKS * CHUNK_DELAY


@dataclass
class Recorded:
    """The slow streaming reply, recording how each answer ended: `finished` (every piece
    written) or `cut` (a write failed: the worker closed the connection)."""

    reply: Reply = field(default_factory=lambda: Reply(ANSWER, chunks=CHUNKS, chunk_delay=0))
    outcomes: list[str] = field(default_factory=list)

    def respond(self, exchange: Exchange) -> None:
        assert exchange.body.get("stream"), "the worker's call should stream"
        events = self.reply.completion_chunks(exchange.body)
        try:
            exchange.send_events(events, CHUNK_DELAY)
        except OSError:
            self.outcomes.append("cut")
            raise
        self.outcomes.append("finished")


Started = tuple[str, Runtime, dict[str, str], Recorded]


@pytest.fixture
def started(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> Callable[[bool], Started]:
    def start(cancel_on_disconnect: bool) -> Started:
        recorded = Recorded()
        stub_provider.default = recorded
        config = scripted_agent([])
        config["Providers"] = {"typist": {"Kind": "openai", "BaseUrl": stub_provider.base_url}}
        config["Agents"]["demo"]["Model"] = {"provider": "typist", "model": "typist-model"}
        config["Runs"] = {"CancelOnDisconnect": cancel_on_disconnect}
        cluster = make_cluster(sqlite_url, **config)
        cluster.worker("w1", concurrency=2)
        _web, base = cluster.web(threads=4)
        runtime = make_runtime(sqlite_url, **config)
        key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
        return base, runtime, {"Authorization": f"Bearer {key}"}, recorded

    return start


def native_left_mid_stream(base: str, headers: dict[str, str]) -> str:
    """`POST /api/agents/demo/run` as an event stream on a raw socket, read until the first
    `ModelTextDelta`, then reset (SO_LINGER 0): the run's id, from `Location`."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"message": "count"}).encode()
    lines = [
        "POST /api/agents/demo/run HTTP/1.1",
        f"Host: {host}",
        "Accept: text/event-stream",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        received = b""
        while b"event: ModelTextDelta" not in received:
            data = sock.recv(65536)
            assert data, f"the stream ended before any text delta: {received!r}"
            received += data
        assert received.startswith(b"HTTP/1.1 200"), received
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    head = received.split(b"\r\n\r\n", 1)[0].decode()
    location = next(
        line.split(":", 1)[1].strip()
        for line in head.split("\r\n")
        if line.lower().startswith("location:")
    )
    return location.removeprefix("/api/runs/")


def v1_left_mid_stream(base: str, headers: dict[str, str]) -> str:
    """`/v1/chat/completions` with `stream=True` through the official openai client, read
    until the first content delta, then closed: the run's id, from `X-Tracon-Run-Id`."""
    key = headers["Authorization"].removeprefix("Bearer ")
    with OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=10) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": "count"}], stream=True
        )
        run_id = raw.headers["X-Tracon-Run-Id"]
        stream = raw.parse()
        text = ""
        for chunk in stream:
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
            if text:
                break
        assert text and ANSWER.startswith(text), text
        stream.close()  # mid-answer: the connection is closed, not read to its end
    return run_id


ROUTES = {"native": native_left_mid_stream, "v1": v1_left_mid_stream}


def status_of(runtime: Runtime, run_id: str) -> str | None:
    run = runtime.runs.get(run_id)
    return None if run is None else run.status


def ended_run(runtime: Runtime, run_id: str) -> Run:
    wait_until(
        lambda: status_of(runtime, run_id) in ENDED,
        timeout=ANSWER_SECONDS + 15,
        what=f"run {run_id} ended",
    )
    run = runtime.runs.get(run_id)
    assert run is not None
    return run


def test_by_default_a_client_that_leaves_mid_stream_leaves_its_run_running(
    started: Callable[[bool], Started],
) -> None:
    base, runtime, headers, recorded = started(False)
    for route, left_mid_stream in ROUTES.items():
        run_id = left_mid_stream(base, headers)
        assert status_of(runtime, run_id) == "Running", route
        run = ended_run(runtime, run_id)
        assert run.status == "Completed", (route, run.error_message)
        assert run.output == {"text": ANSWER}, route
        assert "ModelCallCompleted" in event_types(runtime, run_id), route
    assert recorded.outcomes == ["finished", "finished"]


def test_under_cancel_on_disconnect_a_v1_client_that_leaves_cancels_its_run_and_cuts_the_model(
    started: Callable[[bool], Started],
) -> None:
    """Only `/v1` streams cancel (docs/http-api.md, docs/configuration.md): a native event
    stream's client that leaves still leaves its run running."""
    base, runtime, headers, recorded = started(True)
    submitted = time.monotonic()
    run_id = v1_left_mid_stream(base, headers)
    left = time.monotonic()
    run = ended_run(runtime, run_id)
    ended = time.monotonic()
    assert run.status == "Canceled", (run.status, run.error_message)
    # Well before the answer would have ended: at most half of it was written when the
    # client left, and the run ended soon after
    timings = (left - submitted, ended - left)
    assert left - submitted < ANSWER_SECONDS / 2 and ended - left < ANSWER_SECONDS / 2, timings
    types = event_types(runtime, run_id)
    assert "ModelCallCompleted" not in types and types[-1] == "RunCanceled", types
    wait_until(lambda: bool(recorded.outcomes), timeout=ANSWER_SECONDS, what="the stub's end")
    assert recorded.outcomes == ["cut"]  # the model's stream was closed mid-answer

    run_id = native_left_mid_stream(base, headers)
    run = ended_run(runtime, run_id)
    assert run.status == "Completed", (run.status, run.error_message)
    assert run.output == {"text": ANSWER}
    assert recorded.outcomes == ["cut", "finished"]
