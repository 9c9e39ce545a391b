"""`Redis:ClusterUrl` across real processes: two workers whose coordination state is on a Redis
Cluster of three masters started by the test (`tests/redis_cluster.py`), the broker and the rest
on a Redis of the test's own. The provider's limit of calls at once and its circuit hold across
the processes through the cluster, and a worker killed with -9 while holding the provider's
slots frees them within the lease, as on one Redis.

Skipped when this machine's `redis-server` cannot run in cluster mode."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import redis

from tests.e2e.cluster import Cluster
from tests.e2e.test_resilience_processes import Submitter, start_workers, stub_agent
from tests.helpers import MakeRuntime, wait_until
from tests.stub_provider import StubProvider, error, hang, reply

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_two_workers_share_the_limit_and_the_circuit_through_the_cluster(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    cluster_url: str,
    stub_provider: StubProvider,
) -> None:
    # Given two workers of eight threads whose coordination state is on the cluster, and a
    # provider allowed two calls at once
    sections = stub_agent(
        stub_provider,
        Redis={"Url": redis_url, "ClusterUrl": cluster_url},
        ModelConcurrency={"MaxConcurrentCallsPerProvider": 2},
        CircuitBreaker={"FailureThreshold": 3, "BreakDuration": "00:01:00"},
    )
    start_workers(make_cluster(sqlite_url, **sections), 2, concurrency=8)
    runtime = make_runtime(sqlite_url, **sections)
    submit = Submitter(runtime)
    stub_provider.default = hang(0.1, reply("ok"))

    # When thirty runs go to both workers at once
    runs = [
        submit.finished(run_id, timeout=60)
        for run_id in [submit.to(f"w{i % 2}") for i in range(30)]
    ]

    # Then all completed, never more than two calls at once across the processes
    assert {run.status for run in runs} == {"Completed"}
    assert stub_provider.peak_in_progress == 2
    usage = runtime.slots.usage("a")
    assert (usage.in_use, usage.waiting) == (0, 0)
    # And the slots' keys were on the cluster, none on the broker's Redis
    assert not list(redis_client.scan_iter("tracon:slots:*"))

    # When the provider fails three calls, from either worker
    stub_provider.default = error(500)
    failed = [submit.finished(submit.to(f"w{i % 2}")) for i in range(3)]
    refused = [submit.finished(submit.to(f"w{i}")) for i in range(2)]

    # Then its circuit opened for both: the next runs failed without calling it
    assert [run.error_type for run in failed] == ["provider_error"] * 3
    assert [run.error_type for run in refused] == ["provider_unavailable"] * 2
    assert len(stub_provider.requests) == 33
    assert runtime.breaker.snapshot("a").state == "open"
    assert not list(redis_client.scan_iter("tracon:breaker:*"))


def test_a_killed_holder_frees_its_slots_on_the_cluster_within_the_lease(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    cluster_url: str,
    stub_provider: StubProvider,
) -> None:
    sections = stub_agent(
        stub_provider,
        Redis={"Url": redis_url, "ClusterUrl": cluster_url},
        ModelConcurrency={"MaxConcurrentCallsPerProvider": 2, "SlotLease": "00:00:02"},
    )
    doomed, _survivor = start_workers(make_cluster(sqlite_url, **sections), 2, concurrency=4)
    runtime = make_runtime(sqlite_url, **sections)
    submit = Submitter(runtime)
    stub_provider.default = hang(60, reply("never"))

    # Given a worker holding both slots, renewing them on the cluster past the lease
    for _ in range(2):
        submit.to("w0")
    wait_until(lambda: runtime.slots.usage("a").in_use == 2, timeout=20, what="2 slots held")
    threading.Event().wait(2.5)
    assert runtime.slots.usage("a").in_use == 2, "live holders renew their leases"

    # When it is killed with -9, a run on the other worker gets a slot within the lease
    doomed.kill9()
    stub_provider.default = reply("ok")
    run = submit.finished(submit.to("w1"), timeout=15)
    assert run.status == "Completed"
