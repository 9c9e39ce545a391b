"""A live native event stream whose worker is killed mid-answer, on real processes
(`tracon-jobs web` with its stream hub, celery workers, beat's orphan scan, Redis, SQLite):
the same connection withdraws the orphan's partial text, tells of its call's end, its own end
and its continuation, then follows the continuation run, its stored events named
`<continuation id>:<seq>` and its answer's text live, and ends with its `RunCompleted`
(docs/http-api.md, "A worker that dies mid-run"). A client that comes back with
`Last-Event-ID: <continuation id>:1` gets the continuation's events after that seq.

The model is the stub provider: its first answer streams slowly (the worker is killed while
it is written), its second, the continuation's, streams a different text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import FAST_RECONCILE, Cluster
from tests.helpers import MakeRuntime, scripted_agent
from tests.stub_provider import Reply, StubProvider

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

FIRST = "".join(f"orphan{i:02d} " for i in range(100))
"""The killed run's answer: 100 pieces 0.2 s apart, far longer than the test lets it run."""
SECOND = "".join(f"again{i:02d} " for i in range(12))
"""The continuation's answer, streamed in 12 pieces."""


@dataclass(frozen=True)
class Frame:
    event: str
    id: str | None
    data: dict[str, Any]


def frames_of(lines: Iterator[str]) -> Iterator[Frame]:
    """The SSE frames of a stream's lines (comments, the keep-alives, left out)."""
    fields: dict[str, str] = {}
    for line in lines:
        if line == "":
            if "event" in fields:
                yield Frame(fields["event"], fields.get("id"), json.loads(fields["data"]))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


def status_of(base: str, headers: dict[str, str], run_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{base}/api/runs/{run_id}", headers=headers, timeout=10)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_a_stream_whose_worker_dies_follows_the_continuation_on_the_same_connection(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    # Given a streaming model whose first answer is slow and whose second is known
    stub_provider.enqueue(
        Reply(FIRST, chunks=100, chunk_delay=0.2), Reply(SECOND, chunks=12, chunk_delay=0.05)
    )
    config = scripted_agent([])
    config["Providers"] = {"typist": {"Kind": "openai", "BaseUrl": stub_provider.base_url}}
    config["Agents"]["demo"]["Model"] = {"provider": "typist", "model": "typist-model"}
    config["RunReconciliation"] = FAST_RECONCILE
    config["RunContinuation"] = {"Enabled": True, "MaxAttempts": 1}
    cluster = make_cluster(sqlite_url, **config)
    owner = cluster.worker("owner", concurrency=2)
    cluster.start("beat", "beat")
    _web, base = cluster.web(threads=4)
    runtime = make_runtime(sqlite_url, **config)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    headers = {"Authorization": f"Bearer {key}"}

    seen: list[Frame] = []
    with (
        httpx.Client(timeout=httpx.Timeout(10, read=40)) as client,
        client.stream(
            "POST",
            f"{base}/api/agents/demo/run",
            json={"message": "count", "sessionId": "support-7"},
            headers={**headers, "Accept": "text/event-stream"},
        ) as stream,
    ):
        assert stream.status_code == 200, stream.read()
        orphan = stream.headers["Location"].removeprefix("/api/runs/")
        frames = frames_of(stream.iter_lines())

        # When the worker is killed once the first answer's text is streaming
        for item in frames:
            seen.append(item)
            if item.event == "ModelTextDelta":
                break
        assert [f.event for f in seen][-1] == "ModelTextDelta", seen
        assert FIRST.startswith(seen[-1].data["data"]["text"]), seen[-1]
        survivor = cluster.worker("survivor", concurrency=2)
        for item in frames:  # still streaming once the survivor is up
            seen.append(item)
            assert item.event not in ("RunCompleted", "RunFailed"), item
            if item.event == "ModelTextDelta":
                break
        assert seen[-1].event == "ModelTextDelta", seen
        owner.kill9()

        # Then the same connection reads on to the continuation's end, and closes
        seen.extend(frames)
    assert survivor.popen.poll() is None

    events = [f.event for f in seen]
    reset = events.index("ModelTextReset")
    ends = ["ModelCallFailed", "RunFailed", "RunContinued"]
    assert events[reset + 1 : reset + 4] == ends, events
    assert all(f.id is None for f in seen if f.event.startswith("ModelText")), seen
    before = seen[:reset]
    assert before[0].id == "1" and all(f.id and ":" not in f.id for f in before if f.id)
    cut, failed, continued = seen[reset + 1 : reset + 4]
    assert cut.data["data"]["kind"] == "interrupted", cut  # the killed worker's call ends
    assert failed.data["data"]["error"]["type"] == "orphaned", failed
    continuation = str(continued.data["data"]["continuationRunId"])
    assert continuation != orphan
    assert all(":" not in (f.id or "") for f in (cut, failed, continued))
    after = seen[reset + 4 :]
    stored = [f for f in after if f.id is not None]
    assert [f.id for f in stored] == [f"{continuation}:{n}" for n in range(1, len(stored) + 1)]
    assert stored[-1].event == "RunCompleted", events
    assert after[-1] is stored[-1], "the stream ends after the continuation's RunCompleted"
    assert "ModelCallCompleted" in [f.event for f in stored]
    partial = "".join(f.data["data"]["text"] for f in before if f.event == "ModelTextDelta")
    assert partial and FIRST.startswith(partial) and len(partial) < len(FIRST), partial
    # The continuation's text streams live inside its call: between its ModelCallStarted
    # (whose seq the deltas name) and its ModelCallCompleted
    started = next(at for at, f in enumerate(after) if f.event == "ModelCallStarted")
    completed = next(at for at, f in enumerate(after) if f.event == "ModelCallCompleted")
    call_seq = int(str(after[started].id).rpartition(":")[2])
    live = [f for f in after if f.event == "ModelTextDelta"]
    assert live == [f for f in after[started:completed] if f.event == "ModelTextDelta"]
    assert {f.data["data"]["callSeq"] for f in live} == {call_seq}, live
    deltas = [f.data["data"]["text"] for f in live]
    assert len(deltas) > 1 and "".join(deltas) == SECOND, deltas
    assert "ModelTextReset" not in [f.event for f in after]

    run = status_of(base, headers, continuation)
    assert (run["status"], run["output"]) == ("Completed", {"text": SECOND}), run
    assert (run["continuedFromRunId"], run["sessionId"]) == (orphan, "support-7")
    assert status_of(base, headers, orphan)["status"] == "Failed"

    # And a client back with `Last-Event-ID: <continuation>:1` resumes in the continuation
    answer = httpx.get(
        f"{base}/api/runs/{orphan}/events",
        headers={
            **headers,
            "Accept": "text/event-stream",
            "Last-Event-ID": f"{continuation}:1",
        },
        timeout=20,
    )
    assert answer.status_code == 200, answer.text
    resumed = list(frames_of(iter(answer.text.splitlines())))
    assert [(f.id, f.event) for f in resumed] == [(f.id, f.event) for f in stored[1:]]
    assert len(stub_provider.requests) == 2, "the orphan's call and the continuation's"
