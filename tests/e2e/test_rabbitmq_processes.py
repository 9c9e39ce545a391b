"""RabbitMQ as the broker with real processes, whatever `TRACON_TEST_BROKER` says: a run sent
over HTTP through the web, quorum queues and a worker; and the message a killed worker had
prefetched back in the queue as its connection drops, for another worker, with no requeue pass
(no beat runs)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import pytest

from tests.e2e.cluster import Cluster, past_the_lines, wait_until
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.rabbitmq import queue_depth, queue_type
from tracon_jobs.runs.store import NewRun
from tracon_jobs.worker.app import CONTROL_QUEUE
from tracon_jobs.worker.envelope import RUNS_QUEUE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_run_sent_over_http_goes_through_rabbitmq(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    amqp_url: str,
) -> None:
    sections = scripted_agent([{"Text": "via RabbitMQ"}]) | {"Broker": {"Url": amqp_url}}
    cluster = make_cluster(sqlite_url, **sections)
    worker = cluster.worker("w1")
    _web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret

    with httpx.stream(
        "POST",
        f"{base}/api/agents/demo/run",
        headers={"Authorization": f"Bearer {key}"},
        json={"message": "hi"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        body = "".join(response.iter_text())

    events = re.findall(r"^event: (\w+)$", body, flags=re.M)
    assert events[0] == "RunQueued" and events[-1] == "RunCompleted", body
    assert "amqp://guest:**@127.0.0.1:5672/" in worker.text()  # its broker, password masked
    # through quorum queues; the worker's own queue is Celery's classic one
    assert queue_type(amqp_url, RUNS_QUEUE) == queue_type(amqp_url, CONTROL_QUEUE) == "quorum"
    own = re.search(r"\.> (w1@\S+\.dq2) ", worker.text())
    assert own is not None and queue_type(amqp_url, own.group(1)) == "classic"


def test_a_killed_worker_s_prefetched_run_goes_to_another_worker_at_once(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    amqp_url: str,
) -> None:
    # Given a worker busy with one run, holding the next one's message prefetched
    # (RequeueAfter far off, and no beat: nothing but the broker can give it to another)
    sections = scripted_agent([{"Text": "slow", "DelaySeconds": 30}])
    sections |= {"Broker": {"Url": amqp_url}, "Runs": {"RequeueAfter": "01:00:00"}}
    sections["Worker"] = {"FairReserve": 0}  # one thread: the next message waits for it
    cluster = make_cluster(sqlite_url, **sections)
    doomed = cluster.worker("doomed", concurrency=1)
    runtime = make_runtime(sqlite_url, **sections)
    past_the_lines(runtime)
    tenant = runtime.tenants.ensure_tenant("acme")
    busy = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "busy"})).id
    wait_until(lambda: run_of(runtime, busy).status == "Running", timeout=30, what="busy Running")
    waiting = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "next"})).id
    wait_until(
        lambda: queue_depth(amqp_url, RUNS_QUEUE) == (0, 1),
        timeout=10,
        what="the message prefetched by the doomed worker",
    )

    # When it is killed
    doomed.kill9()

    # Then the message is back in the queue at once, and a worker started later (its runs
    # answer at once) executes the run from it, sent once
    wait_until(
        lambda: queue_depth(amqp_url, RUNS_QUEUE) == (1, 0),
        timeout=10,
        what="the message back in the queue",
    )
    fast = scripted_agent([{"Text": "done"}]) | {"Broker": {"Url": amqp_url}}
    cluster.directory.joinpath("tracon.json").write_text(
        json.dumps(
            {
                "Tracon": {
                    **fast,
                    "Database": {"Url": sqlite_url},
                    "Redis": {"Url": runtime.settings.redis.url},
                }
            }
        )
    )
    survivor = cluster.worker("survivor", concurrency=2)
    wait_until(
        lambda: run_of(runtime, waiting).status == "Completed", timeout=30, what="next Completed"
    )
    assert run_of(runtime, waiting).enqueue_count == 1
    started = [e.data for e in runtime.runs.events(waiting) if e.type == "RunStarted"]
    assert [s["owner"].split("/")[1] for s in started] == [str(survivor.popen.pid)]
    # And the run it was executing, acknowledged as it started, was not delivered again
    assert run_of(runtime, busy).status == "Running"
    assert queue_depth(amqp_url, RUNS_QUEUE) == (0, 1)
