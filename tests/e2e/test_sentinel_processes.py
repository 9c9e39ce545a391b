"""Redis Sentinel under load with real processes: web, two workers and beat on a
`sentinel://` URL (`tests/sentinels.py`: a master, a replica, three sentinels, passwords on
both), 60 runs in flight that each call a write tool, and the master killed with SIGKILL in the
middle: every run ends, nearly all `Completed`, and no tool body runs twice."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import FAST_RECONCILE, Cluster, wait_until
from tests.helpers import ENDED, MakeRuntime, Script, log_lines, run_of, scripted_agent
from tests.sentinels import REDIS_PASSWORD, SENTINEL_PASSWORD, SentinelGroup
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

RUNS = 60
SCRIPT: Script = [
    {"ToolCalls": [{"Name": "record_step", "Arguments": {"step": "A"}}], "DelaySeconds": 0.5},
    {"Text": "recorded", "DelaySeconds": 0.5},
]
"""A second a run: the 60 take four waves of the workers' 16 threads."""
KILL_AFTER = RUNS // 2
"""The master is killed once half the runs have written: the other half are running,
prefetched by a worker (its consumer waiting for more: the state in which kombu's own restore
at close stopped a worker's consumer for good) or waiting in their tenant's line."""
REQUEUE_AFTER = "00:00:03"
"""A message lost with the master (pushed, not yet replicated) is sent again this soon."""


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    started = SentinelGroup(tmp_path / "sentinel-group")
    try:
        yield started.start()
    finally:
        started.stop()


def submit(base: str, key: str) -> str:
    answer = httpx.post(
        f"{base}/api/agents/demo/run",
        json={"message": "record it"},
        headers={"Authorization": f"Bearer {key}", "Prefer": "respond-async"},
        timeout=10,
    )
    assert answer.status_code == 202, answer.text
    return str(answer.json()["runId"])


def statuses_of(runtime: Runtime, run_ids: list[str]) -> Counter[str]:
    return Counter(run_of(runtime, run_id).status for run_id in run_ids)


def record_steps_completed(runtime: Runtime, run_id: str) -> int:
    """How many record_step calls the run's events say completed."""
    return sum(
        1
        for event in runtime.runs.events(run_id)
        if event.type == "ToolCallCompleted" and event.data.get("tool") == "record_step"
    )


def test_killing_the_master_mid_load_loses_no_run_and_repeats_no_write(
    group: SentinelGroup,  # first: torn down last, after every process that uses it
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    # Given web, two workers and beat on the Sentinel group, passwords from the environment
    sections = scripted_agent(SCRIPT, ["record_step"]) | {
        "RunReconciliation": FAST_RECONCILE,
        "Runs": {"RequeueAfter": REQUEUE_AFTER},
    }
    cluster = make_cluster(sqlite_url, Redis=group.settings(), **sections)
    cluster.env.update(SentinelGroup.environment())
    _web, base = cluster.web(threads=16)
    workers = [cluster.worker("w1", concurrency=8), cluster.worker("w2", concurrency=8)]
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **sections)  # reads SQL only
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret

    # When 60 runs are submitted and the master is killed once half of them have written
    with ThreadPoolExecutor(8) as clients:
        run_ids = list(clients.map(lambda _: submit(base, key), range(RUNS)))
    wait_until(lambda: len(log_lines(flags, "record_step")) >= KILL_AFTER, timeout=30, what="load")
    killed_at = time.monotonic()
    old = group.kill_master()
    in_flight = {s: n for s, n in statuses_of(runtime, run_ids).items() if s not in ENDED}
    group.wait_for_new_master(old)

    # Then every run ends, and nearly all complete
    def ended() -> bool:
        return statuses_of(runtime, run_ids).keys() <= set(ENDED)

    wait_until(ended, timeout=45, what="every run ended")
    ended_after = time.monotonic() - killed_at
    statuses = statuses_of(runtime, run_ids)
    assert statuses["Completed"] >= 0.95 * RUNS, (statuses, cluster.logs())
    # And each worker's consumer takes the broker again on the new master, none stopped
    for worker in workers:

        def reconnected(text: Callable[[], str] = worker.text) -> bool:
            log = text()
            return "Connected to" in log[log.rindex("Connection to broker lost") :]

        wait_until(reconnected, timeout=20, what=f"{worker.name} on the broker again")
        assert "Unrecoverable error" not in worker.text()
    # And no write tool ran more often than runs recorded completing it: never twice a key
    keys = [line.split()[1] for line in log_lines(flags, "record_step")]
    repeated = {k: n for k, n in Counter(keys).items() if n > 1}
    assert repeated == {}
    assert len(keys) == sum(record_steps_completed(runtime, r) for r in run_ids)
    # And the passwords never reached a log line of any process
    logs = cluster.logs() + "".join(p.text() for p in cluster.children.children)
    assert REDIS_PASSWORD not in logs and SENTINEL_PASSWORD not in logs
    print(f"killed with {in_flight} in flight: all ended {ended_after:.1f} s later; {statuses}")
