"""The runs a worker holds, with real worker and beat processes: a killed worker's prefetched
run is sent again as soon as the worker's liveness ends (not after `Runs.RequeueAfter`), and a
live worker's prefetched run is never sent twice, however long past `RequeueAfter` it waits
for the worker's thread."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis

from tests.e2e.cluster import Cluster, past_the_lines, wait_until
from tests.e2e.test_processes import started_events, status_of, text, wait_status
from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.coordination.held import ALIVE_MS, Holders
from tracon_jobs.runs.store import NewRun

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def held_live(client: redis.Redis) -> set[str]:
    return Holders(client).read()[1]


def test_a_killed_worker_s_prefetched_run_goes_out_again_once_its_liveness_ends(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_client: redis.Redis,
) -> None:
    # Runs.RequeueAfter at its default (60 s): the dead worker's liveness decides, not age
    sections = scripted_agent([{"Text": "slow", "DelaySeconds": 60}])
    # one thread, and Celery's prefetch (at 1 a busy worker takes no message): the next
    # message waits in the worker for its thread
    sections["Worker"] = {"FairReserve": 0, "PrefetchMultiplier": 2}
    cluster = make_cluster(sqlite_url, **sections)
    doomed = cluster.worker("doomed", concurrency=1)
    runtime = make_runtime(sqlite_url, **sections)
    past_the_lines(runtime)
    tenant = runtime.tenants.ensure_tenant("acme")

    # Given a worker busy with one run and holding the next run's message
    busy = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "busy"})).id
    wait_status(runtime, busy, "Running")
    prefetched = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "next"})).id
    wait_until(
        lambda: prefetched in held_live(redis_client), timeout=10, what="the run held, recorded"
    )

    # When the worker is killed with SIGKILL, and another worker and beat are up
    doomed.kill9()
    killed = time.monotonic()
    config = json.loads(cluster.directory.joinpath("tracon.json").read_text())
    config["Tracon"].update(scripted_agent([{"Text": "done"}]))
    cluster.directory.joinpath("tracon.json").write_text(json.dumps(config))
    survivor = cluster.worker("survivor", concurrency=2)
    cluster.start("beat", "beat")

    # Then the held run is sent again once the liveness ends (10 s) plus a requeue pass
    # (5 s), well before RequeueAfter, and the survivor completes it
    wait_status(runtime, prefetched, "Completed", timeout=40)
    took = time.monotonic() - killed
    assert took < ALIVE_MS / 1000 + 5 + 10, f"re-sent after {took:.1f}s"
    owner = started_events(runtime, prefetched)[-1]["owner"]
    assert owner.split("/")[1] == str(survivor.popen.pid)
    run = runtime.runs.get(prefetched)
    assert run is not None and run.enqueue_count == 2
    assert status_of(runtime, busy) == "Running"  # the claimed run is the orphan scan's


def test_a_live_worker_s_prefetched_run_is_not_sent_twice_past_requeue_after(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_client: redis.Redis,
) -> None:
    sections = scripted_agent([{"Text": "slow", "DelaySeconds": 6}])
    sections["Runs"] = {"RequeueAfter": "00:00:01"}
    sections["Worker"] = {"FairReserve": 0, "PrefetchMultiplier": 2}  # as above
    cluster = make_cluster(sqlite_url, **sections)
    worker = cluster.worker("busy", concurrency=1)
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **sections)
    past_the_lines(runtime)
    tenant = runtime.tenants.ensure_tenant("acme")

    # Given a worker of one thread busy for 6 s, holding the next run's message
    first = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "one"})).id
    wait_status(runtime, first, "Running")
    second = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "two"})).id
    wait_until(lambda: second in held_live(redis_client), timeout=10, what="the run held")
    assert any(second in text(v) for v in redis_client.hvals("unacked"))

    # When it waits for the thread for six times RequeueAfter, beat passing every second
    wait_status(runtime, second, "Completed", timeout=40)

    # Then it was sent once, and no delivery was dropped
    run = runtime.runs.get(second)
    assert run is not None and run.enqueue_count == 1
    assert "'dropped'" not in worker.text()
    wait_until(lambda: not held_live(redis_client), timeout=5, what="nothing held")
