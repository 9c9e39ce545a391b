"""Live event streams on a real `tracon-jobs web`: they keep no request thread.

The web runs one gunicorn worker with two threads. Forty open streams would hold every
thread of a thread-per-stream server, so health, readiness and the API would not answer;
here the streams live in the process's stream hub and the API answers at once. A client
that goes away gives its tenant's stream place back at once (the cap's `429` clears), and
`Last-Event-ID` resumes where a client left off.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.runs.store import RunFilter
from tracon_jobs.runtime import Runtime

pytestmark = pytest.mark.e2e

STREAMS = 40
STEPS: list[dict[str, Any]] = [{"Text": "thinking", "DelaySeconds": 0.3}, {"Text": "done"}]


def tenant_key(runtime: Runtime, tenant: str = "acme") -> dict[str, str]:
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant(tenant)).secret
    return {"Authorization": f"Bearer {key}"}


def submit(base: str, headers: dict[str, str]) -> str:
    accepted = httpx.post(
        f"{base}/api/agents/demo/run",
        json={"message": "hello"},
        headers={**headers, "Prefer": "respond-async"},
        timeout=10,
    )
    assert accepted.status_code == 202, accepted.text
    run_id: str = accepted.json()["runId"]
    return run_id


def follow(base: str, headers: dict[str, str], run_id: str, after: int = 0) -> list[int]:
    """The event ids one client receives until the stream ends."""
    extra = {"Last-Event-ID": str(after)} if after else {}
    url = f"{base}/api/runs/{run_id}/events"
    stream_headers = {**headers, **extra, "Accept": "text/event-stream"}
    with httpx.stream("GET", url, headers=stream_headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        body = "".join(response.iter_text())
    return [int(seq) for seq in re.findall(r"^id: (\d+)$", body, flags=re.M)]


def timed_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, float]:
    started = time.monotonic()
    response = httpx.get(url, headers=headers, timeout=10)
    return response.status_code, time.monotonic() - started


def open_stream(base: str, headers: dict[str, str], run_id: str) -> tuple[socket.socket, bytes]:
    """A raw stream request: the socket and the answer's first bytes (its head)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    lines = [
        f"GET /api/runs/{run_id}/events HTTP/1.1",
        f"Host: {host}",
        "Accept: text/event-stream",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock, sock.recv(65536)


@pytest.fixture
def web_of(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sql_url: str
) -> Callable[..., tuple[Cluster, str, Runtime]]:
    def start(**web: object) -> tuple[Cluster, str, Runtime]:
        sections = {**scripted_agent(STEPS), "Web": web}
        cluster = make_cluster(sql_url, **sections)
        _web, base = cluster.web(threads=2)
        return cluster, base, make_runtime(sql_url, **sections)

    return start


def test_open_streams_leave_the_api_its_threads_and_every_follower_gets_every_event(
    web_of: Callable[..., tuple[Cluster, str, Runtime]],
) -> None:
    cluster, base, runtime = web_of()
    headers = tenant_key(runtime)
    runs = [submit(base, headers) for _ in range(4)]  # no worker yet: they wait, Queued

    with ThreadPoolExecutor(STREAMS) as pool:
        followers = [
            pool.submit(follow, base, headers, runs[i % len(runs)]) for i in range(STREAMS)
        ]
        wait_until(
            lambda: cluster.children.children[0].text().count("/events") >= STREAMS,
            timeout=30,
            what="every stream answered",
        )
        # While forty streams are open on two threads, everything else answers at once
        for path in ("/healthz", "/readyz"):
            status, seconds = timed_get(base + path)
            assert status == 200 and seconds < 5.0, (path, status, seconds)
        status, seconds = timed_get(base + "/api/runs", headers)
        assert status == 200 and seconds < 5.0, (status, seconds)
        assert not any(f.done() for f in followers)

        cluster.worker("w1")
        received = [f.result(timeout=60) for f in followers]

    for index, seqs in enumerate(received):
        expected = [e.seq for e in runtime.runs.events(runs[index % len(runs)])]
        assert seqs == expected, (index, seqs, expected)  # in order, no gap, nothing twice


def test_a_client_that_goes_away_gives_its_place_back_at_once(
    web_of: Callable[..., tuple[Cluster, str, Runtime]],
) -> None:
    _cluster, base, runtime = web_of(MaxStreamsPerTenant=3)
    headers = tenant_key(runtime)
    run_id = submit(base, headers)
    held = [open_stream(base, headers, run_id) for _ in range(3)]
    assert all(head.startswith(b"HTTP/1.1 200") for _sock, head in held)

    # The fourth stream of the tenant, read or run, is refused and writes nothing
    refused = httpx.get(
        f"{base}/api/runs/{run_id}/events",
        headers={**headers, "Accept": "text/event-stream"},
        timeout=10,
    )
    assert refused.status_code == 429 and refused.json()["code"] == "too_many_streams"
    before = run_count(runtime, "acme")
    started = httpx.post(
        f"{base}/api/agents/demo/run", json={"message": "x"}, headers=headers, timeout=10
    )
    assert started.status_code == 429
    assert run_count(runtime, "acme") == before
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert "tracon_live_streams 3.0" in metrics
    assert "tracon_live_streams_refused_total 2.0" in metrics
    # Another tenant has places of its own
    other = tenant_key(runtime, "globex")
    other_run = submit(base, other)
    sock, head = open_stream(base, other, other_run)
    assert head.startswith(b"HTTP/1.1 200")
    sock.close()

    held[0][0].close()  # the client goes away: no event, no keep-alive needed to notice
    closed_at = time.monotonic()
    wait_until(lambda: admitted(base, headers, run_id), timeout=20, what="the place given back")
    assert time.monotonic() - closed_at < 10  # not the next keep-alive, 15 s on
    for sock, _head in held[1:]:
        sock.close()


def admitted(base: str, headers: dict[str, str], run_id: str) -> bool:
    sock, head = open_stream(base, headers, run_id)
    sock.close()
    return head.startswith(b"HTTP/1.1 200")


def test_last_event_id_resumes_through_the_hub(
    web_of: Callable[..., tuple[Cluster, str, Runtime]],
) -> None:
    cluster, base, runtime = web_of()
    headers = tenant_key(runtime)
    cluster.worker("w1")
    run_id = submit(base, headers)
    wait_until(
        lambda: (run := runtime.runs.get(run_id)) is not None and run.status == "Completed",
        timeout=30,
        what="run Completed",
    )
    everything = [e.seq for e in runtime.runs.events(run_id)]
    assert follow(base, headers, run_id) == everything
    assert follow(base, headers, run_id, after=2) == everything[2:]


def test_an_openai_stream_through_the_hub_ends_with_the_run(
    web_of: Callable[..., tuple[Cluster, str, Runtime]],
) -> None:
    cluster, base, runtime = web_of()
    headers = tenant_key(runtime)
    cluster.worker("w1")
    body = {"model": "demo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "thinking"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert text.endswith("data: [DONE]\n\n")


def run_count(runtime: Runtime, tenant: str) -> int:
    return len(runtime.runs.page(tenant, RunFilter(), limit=100, before=None))
