"""The worker's prefetch, asked of a running `tracon-jobs worker` through Celery's control API:
`Worker.PrefetchMultiplier` (1 by default, so a killed worker hides as few prefetched messages
as can be) times its concurrency is the count its consumer reserves; a bad value stops the
worker at startup, naming the setting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.cluster import Cluster
from tests.helpers import MakeRuntime
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CONCURRENCY = 3


def worker_stats(runtime: Runtime, name: str) -> dict[str, Any]:
    """`celery inspect stats` of the one worker named `name@<host>`."""
    replies = runtime.celery.control.inspect(timeout=5).stats() or {}
    found = [stats for node, stats in replies.items() if node.startswith(f"{name}@")]
    assert len(found) == 1, f"stats of {name}: {sorted(replies)}"
    return dict(found[0])


@pytest.mark.parametrize(
    ("worker", "multiplier"),
    [({}, 1), ({"PrefetchMultiplier": 2}, 2)],
    ids=["default", "configured"],
)
def test_the_prefetch_multiplier_reaches_the_running_worker(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    worker: dict[str, Any],
    multiplier: int,
) -> None:
    cluster = make_cluster(sqlite_url, Worker=worker)
    cluster.worker("prefetch", concurrency=CONCURRENCY)
    runtime = make_runtime(sqlite_url)

    stats = worker_stats(runtime, "prefetch")

    threads = CONCURRENCY + 1  # and Worker.FairReserve's thread
    assert stats["pool"]["max-concurrency"] == threads
    assert stats["prefetch_count"] == multiplier * threads, stats


@pytest.mark.parametrize("value", [0, -1, "two", 1.5])
def test_a_bad_prefetch_multiplier_stops_the_worker_naming_the_setting(
    make_cluster: Callable[..., Cluster], sqlite_url: str, value: object
) -> None:
    cluster = make_cluster(sqlite_url, Worker={"PrefetchMultiplier": value})
    process = cluster.start("worker", "worker", "-n", "bad@%h")

    code = process.popen.wait(timeout=60)

    assert code == 78, process.text()  # EX_CONFIG, before Celery starts
    assert "Worker.PrefetchMultiplier" in process.text()
    assert "ready." not in process.text()
