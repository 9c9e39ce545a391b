"""Crash and race tests with real processes: Celery workers, web (gunicorn), beat."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.cluster import Cluster, past_the_lines, wait_for_log, wait_until
from tests.helpers import MakeRuntime, scripted_agent
from tests.rabbitmq import queue_depth
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings.broker_url import is_amqp
from tracon_jobs.worker.envelope import RUNS_QUEUE, celery_sender

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def status_of(runtime: Runtime, run_id: str) -> str:
    run = runtime.runs.get(run_id)
    assert run is not None
    return run.status


def wait_status(runtime: Runtime, run_id: str, status: str, timeout: float = 30) -> None:
    wait_until(
        lambda: status_of(runtime, run_id) == status, timeout=timeout, what=f"run {run_id} {status}"
    )


def text(value: bytes | str) -> str:
    """A Redis reply as text (the test client does not decode responses)."""
    return value.decode() if isinstance(value, bytes) else value


def started_events(runtime: Runtime, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in runtime.runs.events(run_id) if e.type == "RunStarted"]


def prefetched_by_a_worker(runtime: Runtime, redis_client: redis.Redis, run_id: str) -> bool:
    """Whether a worker holds `run_id`'s message unacknowledged: in kombu's `unacked` hash on
    Redis; on RabbitMQ, out of the run queue's ready messages (its only message is the run's)
    while a worker consumes it."""
    url = runtime.settings.broker.url
    if url is None or not is_amqp(url):
        return any(run_id in text(v) for v in redis_client.hvals("unacked"))
    ready, consumers = queue_depth(url, RUNS_QUEUE)
    return ready == 0 and consumers == 1


def test_duplicated_messages_across_two_workers_execute_each_run_once(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    sections = scripted_agent([{"Text": "once", "DelaySeconds": 0.2}])
    cluster = make_cluster(sqlite_url, **sections)
    workers = [cluster.worker("w1", concurrency=4), cluster.worker("w2", concurrency=4)]
    runtime = make_runtime(sqlite_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    send = celery_sender(runtime.celery)

    # When every run's message is delivered three times
    run_ids = [runtime.runs.create(NewRun(tenant, "demo", {"message": "x"})).id for _ in range(8)]
    for _ in range(3):
        for run_id in run_ids:
            send(run_id)

    # Then every run completes exactly once, and the duplicates are dropped
    for run_id in run_ids:
        wait_status(runtime, run_id, "Completed")
    for run_id in run_ids:
        assert len(started_events(runtime, run_id)) == 1

    # (a worker logs a task's result after the run's row is written: wait for the lines)
    def count(word: str) -> int:
        return sum(w.text().count(f"'{word}'") for w in workers)

    wait_until(lambda: count("dropped") == 16, timeout=20, what="16 dropped deliveries")
    wait_until(lambda: count("Completed") >= 8, timeout=20, what="8 completed deliveries")
    assert count("Completed") == 8
    assert count("dropped") == 16
    logs = [w.text() for w in workers]
    assert all("tracon.runs.execute" in log for log in logs), "both workers took deliveries"


def test_killed_worker_prefetched_run_is_resent_and_completed_by_another(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_client: redis.Redis,
) -> None:
    sections = scripted_agent([{"Text": "slow", "DelaySeconds": 30}])
    sections["Runs"] = {"RequeueAfter": 2}
    # one thread, and Celery's prefetch (at 1 a busy worker takes no message): the next
    # message waits in the worker for its thread
    sections["Worker"] = {"FairReserve": 0, "PrefetchMultiplier": 2}
    cluster = make_cluster(sqlite_url, **sections)
    doomed = cluster.worker("doomed", concurrency=1)
    runtime = make_runtime(sqlite_url, **sections)
    past_the_lines(runtime)
    tenant = runtime.tenants.ensure_tenant("acme")

    # Given a worker busy with one run and holding the next run's message prefetched
    busy = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "busy"})).id
    wait_status(runtime, busy, "Running")
    prefetched = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "next"})).id
    wait_until(
        lambda: prefetched_by_a_worker(runtime, redis_client, prefetched),
        timeout=10,
        what="the second message unacknowledged by the doomed worker",
    )

    # When the worker is killed with SIGKILL and another worker and beat are up
    doomed.kill9()
    survivor_sections = scripted_agent([{"Text": "done"}])
    survivor_sections["Runs"] = {"RequeueAfter": 2}
    cluster.directory.joinpath("tracon.json").write_text(
        json.dumps(
            {
                "Tracon": {
                    **survivor_sections,
                    "Database": {"Url": sqlite_url},
                    "Redis": {"Url": runtime.settings.redis.url},
                    "Broker": {"Url": runtime.settings.broker.url},
                }
            }
        )
    )
    survivor = cluster.worker("survivor", concurrency=2)
    cluster.start("beat", "beat")

    # Then the prefetched run is re-sent and completed by the survivor (RabbitMQ gives the
    # message back as the worker's connection drops: a re-send of the requeue pass may come
    # too, or not; Redis keeps it invisible for the visibility timeout: only the pass sends it)
    wait_status(runtime, prefetched, "Completed", timeout=40)
    owner = started_events(runtime, prefetched)[-1]["owner"]
    assert owner.split("/")[1] == str(survivor.popen.pid)
    run = runtime.runs.get(prefetched)
    resent = 1 if is_amqp(runtime.settings.broker.url) else 2
    assert run is not None and run.enqueue_count >= resent
    assert len(started_events(runtime, prefetched)) == 1
    # And the run the dead worker was executing stays Running (reconciliation is off)
    assert status_of(runtime, busy) == "Running"


def one_thread_worker(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    fast_paths: str,
    name: str,
    *,
    call_seconds: float,
) -> tuple[Cluster, Runtime, str]:
    """A worker `name` of one thread whose every run makes one model call of `call_seconds`
    (kombu's own channel with the fast paths off), and a runtime that sends runs straight to
    the run queue, past the fair lines: only the worker's consumer decides what it takes."""
    sections = scripted_agent([{"Text": "step", "DelaySeconds": call_seconds}])
    sections["Worker"] = {"FairReserve": 0}
    cluster = make_cluster(sqlite_url, **sections)
    cluster.env["TRACON_FAST_PATHS"] = fast_paths
    cluster.worker(name, concurrency=1)
    runtime = make_runtime(sqlite_url, **sections)
    past_the_lines(runtime)
    return cluster, runtime, runtime.tenants.ensure_tenant("acme")


@pytest.mark.parametrize("fast_paths", ["on", "off"])
def test_a_busy_worker_leaves_a_run_it_cannot_start_to_an_idle_one(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_client: redis.Redis,
    fast_paths: str,
) -> None:
    """`Worker.PrefetchMultiplier` 1 on Redis: a worker whose every thread is busy takes no
    more messages (the acknowledgement of a started task frees Celery's prefetch, which would
    let it), so the next run starts on an idle worker instead of waiting behind a long call."""
    cluster, runtime, tenant = one_thread_worker(
        make_cluster, make_runtime, sqlite_url, fast_paths, "busy", call_seconds=30
    )
    if is_amqp(runtime.settings.broker.url or ""):
        pytest.skip("RabbitMQ pushes up to the prefetch (docs/reliability.md)")

    # Given a worker of one thread busy with a long call
    busy = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "busy"})).id
    wait_status(runtime, busy, "Running")
    # When the next run is sent while it is busy
    waiting = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "next"})).id
    # Then its message stays in the run queue, not taken by the busy worker
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert not prefetched_by_a_worker(runtime, redis_client, waiting)
        time.sleep(0.1)
    assert redis_client.llen(RUNS_QUEUE) == 1
    # and an idle worker, once up, starts it while the busy one's call goes on
    idle = cluster.worker("idle", concurrency=1)
    wait_status(runtime, waiting, "Running", timeout=20)
    owner = started_events(runtime, waiting)[-1]["owner"]
    assert owner.split("/")[1] == str(idle.popen.pid)
    assert status_of(runtime, busy) == "Running"


@pytest.mark.parametrize("fast_paths", ["on", "off"])
def test_a_thread_that_frees_takes_the_next_waiting_run_at_once(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    fast_paths: str,
) -> None:
    """While every thread is busy the worker's consumer does not ask the broker; the end of a
    run wakes it at once, instead of leaving the freed thread idle until the consumer's loop
    looks again on its own (up to a second)."""
    _, runtime, tenant = one_thread_worker(
        make_cluster, make_runtime, sqlite_url, fast_paths, "single", call_seconds=0.3
    )

    # Given 6 runs sent at once to a worker of one thread
    ids = [
        runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": f"r{n}"})).id for n in range(6)
    ]
    for run_id in ids:
        wait_status(runtime, run_id, "Completed", timeout=30)

    # Then each run after the first started as the one before it ended: the 5 waits add up
    # to far less than the consumer's own look every second or so would give
    spans = []
    for run_id in ids:
        at = {e.type: e.at for e in runtime.runs.events(run_id)}
        spans.append((at["RunStarted"], at["RunCompleted"]))
    spans.sort()
    idle = [(after[0] - before[1]).total_seconds() for before, after in pairwise(spans)]
    assert all(gap >= 0 for gap in idle), idle  # one at a time
    assert sum(idle) < 0.75, idle


@pytest.mark.parametrize("fast_paths", ["on", "off"])
def test_submit_over_http_to_real_web_and_worker_processes(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sql_url: str, fast_paths: str
) -> None:
    """The same answers whether the processes take their fast paths or every library's own
    path (`TRACON_FAST_PATHS`, docs/internals.md)."""
    sections = scripted_agent(
        [
            {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "Z-9"}}]},
            {"Text": "Z-9 shipped."},
        ],
        ["lookup_order"],
    )
    cluster = make_cluster(sql_url, **sections)
    cluster.env["TRACON_FAST_PATHS"] = fast_paths
    cluster.worker("w1")
    web, base = cluster.web()
    runtime = make_runtime(sql_url, **sections)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    headers = {"Authorization": f"Bearer {key}"}

    with httpx.stream(
        "POST",
        f"{base}/api/agents/demo/run",
        headers=headers,
        json={"message": "Where is Z-9?"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        body = "".join(response.iter_text())
    events = re.findall(r"^event: (\w+)$", body, flags=re.M)
    assert events[0] == "RunQueued" and events[-1] == "RunCompleted"
    assert "ToolCallCompleted" in events

    accepted = httpx.post(
        f"{base}/api/agents/demo/run",
        json={"message": "again"},
        headers={**headers, "Prefer": "respond-async"},
        timeout=10,
    )
    assert accepted.status_code == 202
    run_url = base + accepted.headers["Location"]
    wait_until(
        lambda: httpx.get(run_url, headers=headers).json()["status"] == "Completed",
        timeout=30,
        what="async run Completed",
    )
    run = httpx.get(run_url, headers=headers).json()
    assert run["output"] == {"text": "Z-9 shipped."} and run["usage"]["totalTokens"] == 30
    wait_for_log(web, "POST /api/agents/demo/run", timeout=5)
