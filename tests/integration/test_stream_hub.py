"""The stream hub in one process, on real SQL and Redis, its followers on socket pairs: what
a client reads is what the run wrote, in order; a quiet stream gets keep-alives; a client
that goes away gives its tenant's place back at once, and so does one that stops reading;
the cap counts across the cluster."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import pytest

from tests.helpers import MakeRuntime, claim_run, scripted_agent, wait_until
from tracon_jobs.coordination.streams import StreamPlaces
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from web.sse import EventFrames
from web.stream_hub import StreamHub


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url, **scripted_agent([{"Text": "ok"}]))


@pytest.fixture
def hub(runtime: Runtime) -> Iterator[StreamHub]:
    hub = StreamHub(runtime.runs, runtime.feed, StreamPlaces(runtime.redis, 2), keepalive=0.3)
    yield hub
    hub.close()


@pytest.fixture
def small_hub(runtime: Runtime) -> Iterator[StreamHub]:
    """A hub that drops a client once 4 KiB wait unsent for it."""
    places = StreamPlaces(runtime.redis, 2)
    hub = StreamHub(runtime.runs, runtime.feed, places, keepalive=0.3, max_buffered=4096)
    yield hub
    hub.close()


def new_run(runtime: Runtime, tenant: str = "acme") -> str:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    return runtime.runs.create(NewRun(tenant_id=tenant_id, agent="demo", input={})).id


class Client:
    """The client end of a followed connection: reads HTTP/1.1 chunks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(10)
        self.raw = b""
        self.ended = False

    def read_until(self, predicate: object, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while not (callable(predicate) and predicate(self.text())):
            if time.monotonic() > deadline:
                raise TimeoutError(self.text())
            data = self.sock.recv(65536)
            if not data:
                self.ended = True
                break
            self.raw += data
        return self.text()

    def text(self) -> str:
        out, rest = b"", self.raw
        while b"\r\n" in rest:
            size_line, tail = rest.split(b"\r\n", 1)
            size = int(size_line, 16)
            if size == 0 or len(tail) < size + 2:
                break
            out, rest = out + tail[:size], tail[size + 2 :]
        return out.decode()

    def seqs(self) -> list[int]:
        return [int(seq) for seq in re.findall(r"^id: (\d+)$", self.text(), flags=re.M)]


def follow(hub: StreamHub, places: StreamPlaces, run_id: str, after: int = 0) -> Client:
    ours, theirs = socket.socketpair()
    place = places.take("acme")
    assert place is not None
    hub.adopt(ours, EventFrames(run_id), after, place, chunked=True)
    return Client(theirs)


def test_a_follower_reads_every_event_in_order_and_the_stream_ends_with_the_run(
    runtime: Runtime, hub: StreamHub
) -> None:
    run_id = new_run(runtime)
    first = follow(hub, hub.places, run_id)
    first.read_until(lambda text: "RunQueued" in text)
    claim = claim_run(runtime, run_id, "w1")
    assert claim is not None
    late = follow(hub, hub.places, run_id, after=1)  # resumes after RunQueued
    for index in range(20):
        runtime.runs.append(claim, "ModelCallCompleted", {"text": f"t{index}"})
    runtime.runs.finish(claim, RunStatus.COMPLETED, output={"text": "ok"})

    expected = [event.seq for event in runtime.runs.events(run_id)]
    for client, wanted in ((first, expected), (late, expected[1:])):
        client.read_until(lambda _text: False)  # to the end: the hub closes the connection
        assert client.ended and client.raw.endswith(b"0\r\n\r\n")
        assert client.seqs() == wanted
    wait_until(lambda: hub.places.held("acme") == 0, timeout=5, what="places given back")


def test_a_quiet_stream_gets_keepalives_and_a_client_that_leaves_frees_its_place(
    runtime: Runtime, hub: StreamHub
) -> None:
    run_id = new_run(runtime)
    client = follow(hub, hub.places, run_id)
    second = follow(hub, hub.places, run_id)
    assert hub.places.take("acme") is None  # the cap is 2, counted in Redis
    client.read_until(lambda text: text.count(": keep-alive") >= 2, timeout=5)
    assert hub.count() == 2

    client.sock.close()
    closed = time.monotonic()
    wait_until(lambda: hub.places.held("acme") == 1, timeout=5, what="the place back")
    assert time.monotonic() - closed < 3.0 and hub.count() == 1
    second.sock.close()
    wait_until(lambda: hub.count() == 0, timeout=5, what="the hub empty")


def test_a_client_that_stops_reading_is_dropped_and_its_place_given_back(
    runtime: Runtime, small_hub: StreamHub
) -> None:
    hub = small_hub
    run_id = new_run(runtime)
    claim = claim_run(runtime, run_id, "w1")
    assert claim is not None
    client = follow(hub, hub.places, run_id)  # never reads from here on
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    big = "x" * 20_000
    for _ in range(60):  # far more than the socket buffers and the hub's 4 KiB hold
        runtime.runs.append(claim, "ModelCallCompleted", {"text": big})
    wait_until(lambda: hub.count() == 0, timeout=10, what="the slow client dropped")
    wait_until(lambda: hub.places.held("acme") == 0, timeout=5, what="its place given back")


def test_places_of_many_tenants_are_given_back_together(runtime: Runtime) -> None:
    places = StreamPlaces(runtime.redis, 3)
    taken = [places.take(tenant) for tenant in ("acme", "acme", "globex")]
    kept = places.take("acme")
    assert None not in taken and kept is not None
    places.give_back_all([p for p in taken if p is not None])
    assert (places.held("acme"), places.held("globex")) == (1, 0)  # only what was given back
    places.give_back_all([])
    assert places.held("acme") == 1


@pytest.fixture
def text_hub(runtime: Runtime) -> Iterator[StreamHub]:
    places = StreamPlaces(runtime.redis, 4)
    hub = StreamHub(runtime.runs, runtime.feed, places, keepalive=0.3, live_text=runtime.live_text)
    yield hub
    hub.close()


def deltas(text: str) -> list[tuple[int, str]]:
    """The `ModelTextDelta` frames a client read: (callSeq, text) each, in order."""
    found = re.findall(r"^event: ModelTextDelta\ndata: (.*)$", text, flags=re.M)
    return [(item["data"]["callSeq"], item["data"]["text"]) for item in map(json.loads, found)]


def test_followers_of_one_run_each_get_its_text_once_whenever_they_joined(
    runtime: Runtime, text_hub: StreamHub
) -> None:
    run_id = new_run(runtime)
    claim = claim_run(runtime, run_id, "w1")
    assert claim is not None
    call = runtime.runs.append(
        claim, "ModelCallStarted", {"turn": 0, "provider": "a", "model": "m"}
    )
    places = StreamPlaces(runtime.redis, 4)
    # Given two followers from the start of the call, sent its first piece
    early = [follow(text_hub, places, run_id) for _ in range(2)]
    for client in early:
        client.read_until(lambda text: f"id: {call.seq}\n" in text)
    runtime.live_text.append(run_id, call.seq, "one ")
    for client in early:
        client.read_until(lambda text: "one " in text)

    # When a third joins mid-call, and two more pieces come (the hub encodes each once
    # for every follower whose frame depends on the piece alone)
    late = follow(text_hub, places, run_id)
    late.read_until(lambda text: "one " in text)
    runtime.live_text.append(run_id, call.seq, "two ")
    runtime.live_text.append(run_id, call.seq, "three")
    clients = [*early, late]
    for client in clients:
        client.read_until(lambda text: "three" in text)

    # Then each got the call's text once, in order: the late one its text so far in one
    # delta, then the same pieces as the others
    for client in early:
        assert deltas(client.text()) == [
            (call.seq, "one "),
            (call.seq, "two "),
            (call.seq, "three"),
        ]
    assert deltas(late.text()) == [(call.seq, "one "), (call.seq, "two "), (call.seq, "three")]
    assert all("".join(text for _, text in deltas(c.text())) == "one two three" for c in clients)
