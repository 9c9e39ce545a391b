"""Crashes, zombies, cancels across web processes and a flushed Redis, with real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import update

from tests.e2e.cluster import FAST_RECONCILE, Cluster, Process, wait_until
from tests.helpers import MakeRuntime, Script, run_of, scripted_agent
from tests.helpers import event_types as events
from tests.helpers import log_lines as lines
from tests.stub_provider import StubProvider, hang, reply
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "record_step", "Arguments": {"step": "A"}}]},
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 60}}]},
    {"Text": "all done"},
]


def completed_continuation(runtime: Runtime, run_id: str) -> str:
    """Wait for the continuation of an orphan, and for it to complete; its id."""
    wait_until(lambda: "RunContinued" in events(runtime, run_id), timeout=15, what="continued")
    continued = next(
        e.data["continuationRunId"] for e in runtime.runs.events(run_id) if e.type == "RunContinued"
    )
    wait_until(
        lambda: run_of(runtime, continued).status == "Completed",
        timeout=30,
        what="continuation completed",
    )
    return str(continued)


def submit(runtime: Runtime, **fields: Any) -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "go"}, **fields)).id


@dataclass
class Crashable:
    cluster: Cluster
    owner: Process  # the worker executing the run
    runtime: Runtime
    run_id: str


def run_inside_a_tool(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    flags: Path,
    script: Script,
    tools: list[str],
    in_tool: str,
) -> Crashable:
    """A run on one worker (with beat, reconciliation and continuation on), inside `in_tool`."""
    sections = scripted_agent(script, tools) | {
        "RunReconciliation": FAST_RECONCILE,
        "RunContinuation": {"Enabled": True},
    }
    cluster = make_cluster(sql_url, **sections)
    owner = cluster.worker("owner")
    cluster.start("beat", "beat")
    runtime = make_runtime(sql_url, **sections)
    run_id = submit(runtime, session_id="support-42")
    wait_until(lambda: len(lines(flags, in_tool)) == 1, timeout=30, what=f"{in_tool} started")
    return Crashable(cluster, owner, runtime, run_id)


def test_a_run_killed_mid_tool_is_orphaned_then_continued_without_repeating_effects(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    # Given the worker completed record_step and is inside slow_step
    crash = run_inside_a_tool(
        make_cluster,
        make_runtime,
        sqlite_url,
        flags,
        SCRIPT,
        ["record_step", "slow_step"],
        "slow_step",
    )
    cluster, doomed, runtime, run_id = crash.cluster, crash.owner, crash.runtime, crash.run_id
    assert lines(flags, "record_step")[0].startswith("A ")

    # When it is killed, and another worker is there (started first: the bound below is the
    # orphan scan's, not a worker's boot time on a busy machine)
    cluster.worker("survivor")
    doomed.kill9()
    killed_at = time.monotonic()
    (flags / "fast").touch()

    # Then the run is closed as orphaned within OrphanThreshold + ScanInterval (+ slack)
    wait_until(lambda: run_of(runtime, run_id).status == "Failed", timeout=15, what="orphaned")
    assert time.monotonic() - killed_at < 2 + 0.5 + 3
    assert run_of(runtime, run_id).error_type == "orphaned"
    # And a continuation completes it, without running record_step again
    continued = completed_continuation(runtime, run_id)
    assert run_of(runtime, continued).output == {"text": "all done"}
    assert len(lines(flags, "record_step")) == 1, "the completed write was not executed again"
    slow = lines(flags, "slow_step")
    assert len(slow) == 2 and slow[0] == slow[1], "the in-flight read ran again with its key"


def test_a_destructive_tool_in_flight_at_the_crash_blocks_continuation(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "wipe_records", "Arguments": {"seconds": 60}}]},
        {"Text": "wiped"},
    ]
    crash = run_inside_a_tool(
        make_cluster, make_runtime, sqlite_url, flags, script, ["wipe_records"], "wipe_records"
    )
    cluster, doomed, runtime, run_id = crash.cluster, crash.owner, crash.runtime, crash.run_id

    doomed.kill9()
    cluster.worker("survivor")  # periodic tasks run on workers; beat only schedules them

    wait_until(
        lambda: "RunContinuationBlocked" in events(runtime, run_id),
        timeout=15,
        what="continuation blocked",
    )
    blocked = next(
        e.data for e in runtime.runs.events(run_id) if e.type == "RunContinuationBlocked"
    )
    assert blocked["tool"] == "wipe_records" and blocked["sideEffect"] == "destructive"
    assert run_of(runtime, run_id).status == "Failed"
    assert "RunContinued" not in events(runtime, run_id)


def test_cancel_from_another_web_process_aborts_a_hanging_provider_call(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    sections = scripted_agent([])
    sections["Providers"] = {
        "a": {"Kind": "openai", "BaseUrl": stub_provider.base_url, "TimeoutSeconds": 120}
    }
    sections["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    cluster = make_cluster(sqlite_url, **sections)
    cluster.worker("w1")
    _web1, base1 = cluster.web()
    _web2, base2 = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    auth = {"Authorization": f"Bearer {key}"}
    stub_provider.default = hang(120, reply("never"))

    accepted = httpx.post(
        f"{base1}/api/agents/demo/run",
        json={"message": "hang"},
        headers={**auth, "Prefer": "respond-async"},
        timeout=10,
    )
    run_id = accepted.json()["runId"]
    wait_until(lambda: stub_provider.in_progress == 1, timeout=20, what="provider call")

    started = time.monotonic()
    cancel = httpx.post(f"{base2}/api/runs/{run_id}/cancel", headers=auth, timeout=10)
    assert cancel.status_code == 202
    wait_until(lambda: run_of(runtime, run_id).status == "Canceled", timeout=20, what="canceled")

    assert time.monotonic() - started < 8
    wait_until(lambda: stub_provider.in_progress == 0, timeout=2, what="connection closed")
    assert events(runtime, run_id)[-1] == "RunCanceled"
    again = httpx.post(f"{base2}/api/runs/{run_id}/cancel", headers=auth, timeout=10)
    assert again.status_code == 409


def test_a_flushed_redis_loses_neither_the_run_nor_its_cancel_nor_its_heartbeats(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
    redis_client: redis.Redis,
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 60}}]},
        {"Text": "survived"},
    ]
    sections = scripted_agent(script, ["slow_step"]) | {"RunReconciliation": FAST_RECONCILE}
    cluster = make_cluster(sqlite_url, **sections)
    cluster.worker("w1")
    runtime = make_runtime(sqlite_url, **sections)
    survivor, canceled = submit(runtime), submit(runtime)
    wait_until(lambda: len(lines(flags, "slow_step")) == 2, timeout=30, what="both in the tool")

    # When Redis loses everything in the middle of both runs
    redis_client.flushdb()
    beat_before = run_of(runtime, survivor).heartbeat_at
    # And a cancel reaches SQL only (no notice is published)
    with runtime.db.write() as session:
        session.execute(
            update(Run).where(Run.id == canceled).values(cancel_requested_at=runtime.db.now())
        )

    # Then the cancel still arrives, heartbeats go on, and the other run completes
    wait_until(
        lambda: run_of(runtime, canceled).status == "Canceled", timeout=5, what="cancel via SQL"
    )
    wait_until(
        lambda: run_of(runtime, survivor).heartbeat_at != beat_before,
        timeout=5,
        what="a heartbeat after the flush",
    )
    (flags / "fast").touch()
    wait_until(
        lambda: run_of(runtime, survivor).status == "Completed",
        timeout=20,
        what="completed after the flush",
    )
    assert run_of(runtime, survivor).output == {"text": "survived"}


def test_a_frozen_zombie_never_produces_a_second_result(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 60}}]},
        {"Text": "done"},
    ]
    crash = run_inside_a_tool(
        make_cluster, make_runtime, sqlite_url, flags, script, ["slow_step"], "slow_step"
    )
    cluster, zombie, runtime, run_id = crash.cluster, crash.owner, crash.runtime, crash.run_id

    # Given the owner freezes (no heartbeats) and is reconciled; a continuation completes
    os.killpg(zombie.popen.pid, signal.SIGSTOP)
    (flags / "fast").touch()
    cluster.worker("survivor")
    completed_continuation(runtime, run_id)
    closed = run_of(runtime, run_id)

    # When the zombie wakes up and finishes its tool
    os.killpg(zombie.popen.pid, signal.SIGCONT)
    time.sleep(2)  # give the zombie every chance to write

    # Then its stale fence changed nothing
    after = run_of(runtime, run_id)
    assert (after.status, after.error_type, after.ended_at) == (
        closed.status,
        closed.error_type,
        closed.ended_at,
    )
    assert events(runtime, run_id).count("RunCompleted") == 0


def test_a_live_worker_heartbeating_every_millisecond_abandons_no_run(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, postgres_url: str | None
) -> None:
    # Given one worker on PostgreSQL whose heartbeat runs every millisecond, so that it
    # lands again and again between the read of a claim and its first write, and nothing
    # killed
    if postgres_url is None:
        pytest.skip("no PostgreSQL server (set TRACON_TEST_POSTGRES_URL)")
    reconcile = {**FAST_RECONCILE, "HeartbeatInterval": "00:00:00.001"}
    script: Script = [
        {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]},
        {"Text": "A-1 shipped."},
    ]
    sections = {**scripted_agent(script, ["lookup_order"]), "RunReconciliation": reconcile}
    cluster = make_cluster(postgres_url, **sections)
    worker = cluster.worker("w1", concurrency=4)
    runtime = make_runtime(postgres_url, **sections)

    # When 200 runs come in at about 40 a second
    run_ids = []
    for _ in range(200):
        run_ids.append(submit(runtime))
        time.sleep(0.025)

    # Then every one of them completes, and the worker never judged one taken away
    def unfinished() -> list[str]:
        return [r for r in run_ids if run_of(runtime, r).status != "Completed"]

    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not unfinished(), timeout=60, what="every run Completed")
    left = unfinished()
    assert left == [], f"{len(left)} of {len(run_ids)} runs abandoned by a live worker"
    taken = [line for line in worker.text().splitlines() if "taken away" in line]
    assert taken == []
