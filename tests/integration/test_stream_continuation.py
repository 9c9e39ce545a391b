"""A stream of a run whose worker died follows on into the run that continues it, on the
same connection: the orphan's partial text withdrawn as its call ends (`ModelCallFailed`,
interrupted), its `RunFailed` and `RunContinued`, then the continuation's events (named
`<run id>:<seq>`) and its streaming text; a client that comes back with such a
`Last-Event-ID` resumes in the continuation. Both ways a stream is served: the stream hub
(socket pairs) and `followed` (Flask's test client). The runs are written here as a worker
and the orphan scan write them, on real SQL and Redis."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

import web.continuing
from tests.helpers import MakeRuntime, claim_run, scripted_agent
from tests.integration.test_stream_hub import Client
from tracon_jobs.coordination.streams import StreamPlaces
from tracon_jobs.runs.lifecycle import ErrorClass, RunError, RunStatus
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from web import create_app
from web.sse import EventFrames
from web.stream_hub import StreamHub

HALF = "The first half of an answer "
WHOLE = "A whole answer, from the continuation."


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    sections: dict[str, Any] = scripted_agent([{"Text": "ok"}])
    sections |= {"RunReconciliation": {"Enabled": True}, "RunContinuation": {"Enabled": True}}
    return make_runtime(sql_url, **sections)


@pytest.fixture
def hub(runtime: Runtime) -> Iterator[StreamHub]:
    hub = StreamHub(
        runtime.runs,
        runtime.feed,
        StreamPlaces(runtime.redis, 4),
        keepalive=0.3,
        live_text=runtime.live_text,
        follows_on=True,
    )
    yield hub
    hub.close()


@dataclass
class Chain:
    """An orphan and, once `continue_it` ran, its continuation."""

    runtime: Runtime
    orphan: str
    tenant: str
    continuation: str | None = None

    def orphan_streams_then_dies(self) -> int:
        """The orphan's worker opened a call and sent half its text, then died: the scan
        closes it (`RunFailed`, orphaned). The call's seq."""
        call = self.orphan_streams()
        self.orphan_dies()
        return call

    def orphan_streams(self) -> int:
        runs = self.runtime.runs
        claim = claim_run(self.runtime, self.orphan, "w1")
        assert claim is not None
        call = runs.append(claim, "ModelCallStarted", {"turn": 0, "provider": "a", "model": "m"})
        self.runtime.live_text.append(self.orphan, call.seq, HALF)
        return call.seq

    def orphan_dies(self) -> None:
        runs = self.runtime.runs
        run = runs.get(self.orphan)
        assert run is not None and run.heartbeat_at is not None
        error = RunError("orphaned", ErrorClass.INFRASTRUCTURE, "its process is gone")
        silent_since = run.heartbeat_at + timedelta(hours=1)
        assert runs.close_orphan(run, RunStatus.FAILED, error, silent_since)

    def continue_it(self) -> str:
        """The scan continues the orphan: a new run in the session, then `RunContinued`."""
        runs = self.runtime.runs
        new = NewRun(self.tenant, "demo", {}, continued_from_run_id=self.orphan, attempt=2)
        self.continuation = runs.create(new).id
        data = {"continuationRunId": self.continuation}
        runs.append(None, "RunContinued", data, run_id=self.orphan)
        return self.continuation

    def continuation_answers(self, client: Client | None = None) -> None:
        """The continuation's call streams its answer and completes; with `client`, the
        rest of the text waits until its first piece reached the client (a call read whole,
        its `ModelCallCompleted` already in, sends no live text on the native stream)."""
        assert self.continuation is not None
        runs = self.runtime.runs
        claim = claim_run(self.runtime, self.continuation, "w2")
        assert claim is not None
        call = runs.append(claim, "ModelCallStarted", {"turn": 0, "provider": "a", "model": "m"})
        self.runtime.live_text.append(self.continuation, call.seq, WHOLE[:10])
        if client is not None:
            client.read_until(lambda text: WHOLE[:10] in text)
        self.runtime.live_text.append(self.continuation, call.seq, WHOLE[10:])
        if client is not None:
            client.read_until(lambda text: WHOLE[10:] in text)
        claim = runs.settle(claim)
        runs.append(claim, "ModelCallCompleted", {"turn": 0, "text": WHOLE})
        runs.finish(claim, RunStatus.COMPLETED, output={"text": WHOLE})


@pytest.fixture
def chain(runtime: Runtime) -> Chain:
    tenant = runtime.tenants.ensure_tenant("acme")
    orphan = runtime.runs.create(NewRun(tenant, "demo", {}, session_id="s-1")).id
    return Chain(runtime, orphan, tenant)


def follow(hub: StreamHub, run_id: str) -> Client:
    ours, theirs = socket.socketpair()
    place = hub.places.take("acme")
    assert place is not None
    hub.adopt(ours, EventFrames(run_id), 0, place, chunked=True)
    return Client(theirs)


def frames(text: str) -> list[tuple[str | None, str, dict[str, Any]]]:
    """(id or None, event, data) of each frame."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in block.splitlines() if not line.startswith(":")
        )
        if fields:
            out.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return out


def assert_followed_on(text: str, chain: Chain, call: int) -> None:
    seen = frames(text)
    kinds = [kind for _, kind, _ in seen]
    orphan_end = kinds.index("RunFailed")
    # the orphan's half answer withdrawn as its call ends (interrupted), then its end
    assert kinds[orphan_end - 2 : orphan_end] == ["ModelTextReset", "ModelCallFailed"]
    assert seen[orphan_end - 2][2]["data"]["callSeq"] == call
    assert seen[orphan_end - 1][2]["data"]["kind"] == "interrupted"
    assert kinds[orphan_end + 1] == "RunContinued"
    after = seen[orphan_end + 2 :]
    stored = [(id_, kind) for id_, kind, _ in after if id_ is not None]
    assert chain.continuation is not None
    events = chain.runtime.runs.events(chain.continuation)
    assert stored == [(f"{chain.continuation}:{e.seq}", e.type) for e in events]
    text_sent = "".join(d["data"]["text"] for _, kind, d in after if kind == "ModelTextDelta")
    assert text_sent == WHOLE
    assert kinds[-1] == "RunCompleted"
    assert all(re.fullmatch(r"\d+", id_ or "0") for id_, _, _ in seen[: orphan_end + 2])


def test_a_hub_follower_follows_the_orphan_into_its_continuation(
    runtime: Runtime, hub: StreamHub, chain: Chain
) -> None:
    client = follow(hub, chain.orphan)
    client.read_until(lambda text: "RunQueued" in text)

    call = chain.orphan_streams()
    client.read_until(lambda text: HALF in text)
    chain.orphan_dies()
    client.read_until(lambda text: "RunFailed" in text)
    chain.continue_it()
    client.read_until(lambda text: "RunContinued" in text)
    chain.continuation_answers(client)

    text = client.read_until(lambda _text: False)  # to the end: the hub closes it
    assert client.ended
    assert_followed_on(text, chain, call)


def test_a_blocked_continuation_ends_the_stream(
    runtime: Runtime, hub: StreamHub, chain: Chain
) -> None:
    client = follow(hub, chain.orphan)
    chain.orphan_streams_then_dies()
    client.read_until(lambda text: "RunFailed" in text)
    runtime.runs.append(
        None, "RunContinuationBlocked", {"reason": "the run has no session"}, run_id=chain.orphan
    )

    text = client.read_until(lambda _text: False)
    assert client.ended and frames(text)[-1][1] == "RunContinuationBlocked"


def test_a_stream_gives_up_when_the_scan_says_nothing_more(
    runtime: Runtime, hub: StreamHub, chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web.continuing, "WAIT_SECONDS", 0.5)
    client = follow(hub, chain.orphan)
    chain.orphan_streams_then_dies()

    text = client.read_until(lambda _text: False, timeout=5)
    assert client.ended and frames(text)[-1][1] == "RunFailed"


def test_without_continuation_the_stream_ends_at_the_orphans_end(
    runtime: Runtime, chain: Chain
) -> None:
    hub = StreamHub(runtime.runs, runtime.feed, StreamPlaces(runtime.redis, 4), keepalive=0.3)
    try:
        client = follow(hub, chain.orphan)
        chain.orphan_streams_then_dies()
        text = client.read_until(lambda _text: False, timeout=5)
    finally:
        hub.close()
    assert client.ended and frames(text)[-1][1] == "RunFailed"


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    app: Flask = create_app(runtime, {"TESTING": True, "SSE_KEEPALIVE_SECONDS": 0.5})
    return app.test_client()


def test_followed_follows_on_and_a_client_resumes_in_the_continuation(
    runtime: Runtime, chain: Chain, client: FlaskClient
) -> None:
    key = runtime.tenants.issue_key(chain.tenant).secret
    headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
    chain.orphan_streams_then_dies()
    continuation = chain.continue_it()
    chain.continuation_answers()

    whole = client.get(f"/api/runs/{chain.orphan}/events", headers=headers)
    assert whole.status_code == 200
    text = whole.get_data(as_text=True)
    # the orphan's text was withdrawn before the stream began: nothing of it is sent
    assert "ModelTextReset" not in text and HALF not in text
    seen = frames(text)
    assert [kind for _, kind, _ in seen][-1] == "RunCompleted"
    assert seen[-1][0] == f"{continuation}:{len(runtime.runs.events(continuation))}"

    resumed = client.get(
        f"/api/runs/{chain.orphan}/events",
        headers={**headers, "Last-Event-ID": f"{chain.continuation}:1"},
    )
    ids = [id_ for id_, _, _ in frames(resumed.get_data(as_text=True))]
    events = runtime.runs.events(chain.continuation or "")
    assert ids == [f"{chain.continuation}:{e.seq}" for e in events if e.seq > 1]

    other = runtime.tenants.ensure_tenant("other")
    stranger = runtime.runs.create(NewRun(other, "demo", {}, continued_from_run_id=chain.orphan))
    refused = client.get(
        f"/api/runs/{chain.orphan}/events",
        headers={**headers, "Last-Event-ID": f"{stranger.id}:1"},
    )
    assert refused.status_code == 400 and "Last-Event-ID" in refused.get_data(as_text=True)
