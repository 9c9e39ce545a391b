"""Provider rate limits and parked runs on real processes (web, workers, beat).

A provider of 20 requests a minute shared by three workers: the 26 runs sent to it make 20
calls in the first window and park the other 6 (`RunParked`), which hold no worker thread
(another provider's runs go through meanwhile) and go on once the window moved
(`RunResumed`). No 60 seconds hold more than 20 of its calls, counted from the stub's own
arrival times and from the limiter's record in Redis.

A parked run whose worker is killed with -9 loses nothing: the requeue scan sends it once
`Runs.RequeueAfter` passed beyond its `until`, another worker claims it and makes its one
call after the window.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import ENDED, MakeRuntime, event_types
from tests.stub_provider import Error, Exchange, Reply, StubProvider
from tracon_jobs.resilience.rate_limits import RedisRateStore
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = pytest.mark.e2e

WINDOW = 60.0
"""Seconds of a rate limit's window (fixed in `resilience.rate_limits`)."""
LAG = 1.0
"""Seconds a call may reach the stub after the limiter admitted it (its `ModelCallStarted`
is written in between): the limit bounds starts, so two arrivals 20 calls apart may be a
little less than 60 s apart (about 0.08 s seen here), never more than this less."""


@dataclass
class Timed:
    """Answers `echo: <the last user message>` and records when each request arrived
    (`time.monotonic()`) and the message it answered."""

    arrivals: list[float] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def respond(self, exchange: Exchange) -> None:
        arrived = time.monotonic()
        message = str(exchange.body["messages"][-1]["content"])
        with self.lock:
            self.arrivals.append(arrived)
            self.messages.append(message)
        Reply(f"echo: {message}").respond(exchange)

    def count(self) -> int:
        with self.lock:
            return len(self.arrivals)


@pytest.fixture
def timed_stubs() -> Iterator[Callable[[], tuple[StubProvider, Timed]]]:
    """`make()`: a started stub whose default behaviour is a new `Timed`; stopped after."""
    stubs: list[StubProvider] = []

    def make() -> tuple[StubProvider, Timed]:
        timed = Timed()
        stub = StubProvider(timed).start()
        stubs.append(stub)
        return stub, timed

    yield make
    for stub in stubs:
        stub.stop()


def agents_on(providers: dict[str, dict[str, Any]], **sections: Any) -> dict[str, Any]:
    """One agent per provider, named after it, on its model `<provider>-model`."""
    return {
        "Providers": providers,
        "Agents": {
            name: {
                "Instructions": "test agent",
                "Model": {"provider": name, "model": f"{name}-model"},
            }
            for name in providers
        },
        **sections,
    }


def most_in_a_window(times: list[float], window: float) -> int:
    """The most of `times` any half-open interval of `window` holds."""
    ordered = sorted(times)
    return max(
        (bisect.bisect_left(ordered, at + window) - i for i, at in enumerate(ordered)), default=0
    )


def statuses(runtime: Runtime, run_ids: list[str]) -> list[str | None]:
    found = []
    for run_id in run_ids:
        run = runtime.runs.get(run_id)
        found.append(None if run is None else run.status)
    return found


def all_completed(runtime: Runtime, run_ids: list[str]) -> bool:
    seen = statuses(runtime, run_ids)
    if any(status in ENDED and status != "Completed" for status in seen):
        raise AssertionError(f"a run ended other than Completed: {seen}")
    return seen == ["Completed"] * len(run_ids)


def submit_async(base: str, headers: dict[str, str], agent: str, message: str) -> str:
    accepted = httpx.post(
        f"{base}/api/agents/{agent}/run",
        json={"message": message},
        headers={**headers, "Prefer": "respond-async"},
        timeout=10,
    )
    assert accepted.status_code == 202, accepted.text
    return str(accepted.json()["runId"])


def starts_in_redis(client: redis.Redis, scope: str) -> dict[str, float]:
    """The limiter's record of the scope's starts: call id -> Redis time in seconds."""
    entries: list[tuple[bytes, float]] = list(
        client.zrange(RedisRateStore(client).keys(scope)[0], 0, -1, withscores=True)  # type: ignore[arg-type]
    )
    return {call.decode(): score / 1000 for call, score in entries}


@pytest.mark.long
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sql_url", ["postgresql"], indirect=True)
def test_a_provider_at_20_a_minute_shared_by_three_workers_parks_the_rest_of_its_runs(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_client: redis.Redis,
    timed_stubs: Callable[[], tuple[StubProvider, Timed]],
) -> None:
    # Given "slow" at 20 requests a minute and "free" without limits, three workers of four
    # threads, and runs that park after 2 s of waiting
    slow_stub, slow = timed_stubs()
    free_stub, free = timed_stubs()
    config = agents_on(
        {
            "slow": {"Kind": "openai", "BaseUrl": slow_stub.base_url, "RequestsPerMinute": 20},
            "free": {"Kind": "openai", "BaseUrl": free_stub.base_url},
        },
        Runs={"ParkAfter": "00:00:02"},
        Worker={"Concurrency": 4},
    )
    cluster = make_cluster(sql_url, **config)
    for name in ("w1", "w2", "w3"):
        cluster.worker(name, concurrency=4)
    cluster.start("beat", "beat")
    _web, base = cluster.web(threads=8)
    runtime = make_runtime(sql_url, **config)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    headers = {"Authorization": f"Bearer {key}"}

    # When 26 runs are sent to "slow" at once, then 8 to "free"
    began = time.monotonic()
    slow_runs = {
        f"slow-{n:02d}": submit_async(base, headers, "slow", f"slow-{n:02d}") for n in range(26)
    }
    free_sent = time.monotonic()
    free_runs = [submit_async(base, headers, "free", f"free-{n}") for n in range(8)]

    # Then the "free" runs complete at once: the parked runs hold no worker thread
    wait_until(
        lambda: all_completed(runtime, free_runs), timeout=15, what="the 'free' runs completed"
    )
    free_took = time.monotonic() - free_sent
    assert free.count() == 8
    for run_id, n in zip(free_runs, range(8), strict=True):
        run = runtime.runs.get(run_id)
        assert run is not None and run.output == {"text": f"echo: free-{n}"}

    # And "slow" got 20 calls, then none until the window moved (seen in the first ~50 s)
    recorded: dict[str, float] = {}
    wait_until(lambda: slow.count() >= 20, timeout=30, what="20 calls at 'slow'")
    while time.monotonic() - began < 50:
        recorded |= starts_in_redis(redis_client, "slow")
        assert slow.count() == 20, (
            f"{slow.count()} calls at 'slow' after {time.monotonic() - began:.1f}s"
        )
        time.sleep(0.5)
    first_window = list(slow.messages)
    parked = sorted(set(slow_runs) - set(first_window))
    assert len(parked) == 6, parked
    for message in parked:
        run = runtime.runs.get(slow_runs[message])
        assert run is not None and run.status == "Queued" and run.owner is None, run
        assert "RunParked" in event_types(runtime, slow_runs[message]), message

    # And all 26 complete once it moved, each with its one call
    def slow_done() -> bool:
        recorded.update(starts_in_redis(redis_client, "slow"))
        return all_completed(runtime, list(slow_runs.values()))

    wait_until(slow_done, timeout=90 - (time.monotonic() - began), what="the 'slow' runs completed")
    slow_took = time.monotonic() - began
    recorded |= starts_in_redis(redis_client, "slow")
    assert sorted(slow.messages) == sorted(slow_runs), "one call for each run"
    for message, run_id in slow_runs.items():
        run = runtime.runs.get(run_id)
        assert run is not None and run.output == {"text": f"echo: {message}"}
        types = event_types(runtime, run_id)
        if message in parked:
            assert (
                types.index("RunParked") < types.index("RunResumed") < types.index("RunCompleted")
            ), types
        else:
            assert "RunParked" not in types, types
    # the later six started once the window moved past the first calls
    assert min(slow.arrivals[20:]) - min(slow.arrivals[:20]) >= WINDOW - 1

    # And no 60 s hold more than 20 of its calls by the limiter's record (Redis time, exact);
    # at the stub, no 60 s less the lag of an arrival behind its start
    assert len(recorded) == 26, sorted(recorded.values())
    assert most_in_a_window(list(recorded.values()), WINDOW) == 20
    assert most_in_a_window(slow.arrivals, WINDOW - LAG) == 20
    print(f"free runs completed in {free_took:.1f}s, slow runs in {slow_took:.1f}s")


@pytest.mark.long
@pytest.mark.timeout(150)
def test_a_parked_run_whose_worker_is_killed_is_sent_by_the_requeue_scan_after_the_window(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    timed_stubs: Callable[[], tuple[StubProvider, Timed]],
) -> None:
    # Given one request a minute, runs that park after 1 s of waiting, a 3 s requeue scan
    stub, timed = timed_stubs()
    config = agents_on(
        {"slow": {"Kind": "openai", "BaseUrl": stub.base_url, "RequestsPerMinute": 1}},
        Runs={"ParkAfter": "00:00:01", "RequeueAfter": "00:00:03"},
    )
    cluster = make_cluster(sqlite_url, **config)
    doomed = cluster.worker("doomed", concurrency=2)
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **config)
    tenant = runtime.tenants.ensure_tenant("acme")
    first = runtime.dispatcher.submit(NewRun(tenant, "slow", {"message": "first"})).id
    wait_until(lambda: all_completed(runtime, [first]), timeout=20, what="the first run")
    assert timed.count() == 1

    # And a second run parked: the window's one request is spent
    second = runtime.dispatcher.submit(NewRun(tenant, "slow", {"message": "second"})).id
    wait_until(
        lambda: "RunParked" in event_types(runtime, second), timeout=20, what="the second parked"
    )
    parked = runtime.runs.get(second)
    assert parked is not None and (parked.status, parked.owner) == ("Queued", None)
    until = next(e.data for e in runtime.runs.events(second) if e.type == "RunParked")
    assert until["reason"] == "rate_limit", until

    # When the worker that parked it is killed with -9 (its resumer with it), and another
    # worker is started
    doomed.kill9()
    survivor = cluster.worker("survivor", concurrency=2)

    # Then the requeue scan sends it after the window, the survivor claims it and makes its
    # one call: 60 s after the first run's
    wait_until(
        lambda: all_completed(runtime, [second]),
        timeout=WINDOW + 30 - (time.monotonic() - timed.arrivals[0]),
        what="the second run completed",
    )
    run = runtime.runs.get(second)
    assert run is not None and run.output == {"text": "echo: second"}
    assert timed.messages == ["first", "second"]
    # (not before `until` and the requeue scan's 3 s beyond it)
    assert timed.arrivals[1] - timed.arrivals[0] >= WINDOW + 3 - LAG
    types = event_types(runtime, second)
    assert types.index("RunParked") < types.index("RunCompleted"), types
    assert "RunResumed" not in types, "the process that parked it is dead"
    assert types.count("ModelCallStarted") == 1, types
    owners = [e.data["owner"] for e in runtime.runs.events(second) if e.type == "RunStarted"]
    assert len(owners) == 2 and owners[-1].split("/")[1] == str(survivor.popen.pid), owners
    assert run.enqueue_count >= 2, "sent again by the requeue scan"
    print(f"the second call came {timed.arrivals[1] - timed.arrivals[0]:.1f}s after the first")


@pytest.mark.timeout(120)
def test_the_providers_retry_after_and_headers_hold_every_worker_and_a_parked_run_cancels(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    timed_stubs: Callable[[], tuple[StubProvider, Timed]],
) -> None:
    # Given a limited provider (so its word is learned), two workers, runs that park after 2 s
    stub, timed = timed_stubs()
    config = agents_on(
        {"slow": {"Kind": "openai", "BaseUrl": stub.base_url, "RequestsPerMinute": 1000}},
        Runs={"ParkAfter": "00:00:02"},
    )
    cluster = make_cluster(sqlite_url, **config)
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    _web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **config)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    headers = {"Authorization": f"Bearer {key}"}

    # When the provider answers a 429 with Retry-After: 6
    stub.enqueue(Error(429, retry_after="6"))
    refused = submit_async(base, headers, "slow", "refused")
    wait_until(lambda: statuses(runtime, [refused]) == ["Failed"], timeout=20, what="the 429")
    said = time.monotonic()
    # Then the runs after it, on either worker, park and call only once the 6 s passed
    held = [submit_async(base, headers, "slow", f"held-{n}") for n in range(4)]
    doomed = submit_async(base, headers, "slow", "canceled")
    wait_until(
        lambda: all("RunParked" in event_types(runtime, r) for r in [*held, doomed]),
        timeout=10,
        what="the runs parked",
    )
    reasons = {
        e.data["reason"] for r in held for e in runtime.runs.events(r) if e.type == "RunParked"
    }
    assert reasons == {"rate_limit"}
    # And a parked run canceled over HTTP ends at once and is never sent to the provider
    canceled = httpx.post(f"{base}/api/runs/{doomed}/cancel", headers=headers, timeout=10)
    assert canceled.status_code == 202, canceled.text
    wait_until(lambda: statuses(runtime, [doomed]) == ["Canceled"], timeout=3, what="canceled")
    wait_until(lambda: all_completed(runtime, held), timeout=30, what="the held runs")
    assert timed.count() == 4 and "canceled" not in timed.messages
    assert min(timed.arrivals) - said >= 6 - LAG, min(timed.arrivals) - said
    assert {
        e.data["owner"].split("/")[1]
        for r in held
        for e in runtime.runs.events(r)
        if e.type == "RunStarted"
    } != set(), "claimed"

    # When an answer says no requests remain until a reset 5 s away
    spent = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "5s"}
    stub.enqueue(Reply("spent", headers=spent))
    last = submit_async(base, headers, "slow", "spent")
    wait_until(lambda: all_completed(runtime, [last]), timeout=20, what="the spending run")
    answered = time.monotonic()
    after = submit_async(base, headers, "slow", "after")
    # Then the next call, whichever worker takes it, waits for the reset (parked meanwhile)
    wait_until(lambda: all_completed(runtime, [after]), timeout=30, what="the run after it")
    assert timed.arrivals[-1] - answered >= 5 - LAG
    assert "RunParked" in event_types(runtime, after)
