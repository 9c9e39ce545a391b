"""Workflows that wait on the world, with real worker, beat and web processes: a durable
timer outlives a worker's kill -9 and a beat's restart and fires once, at its time; an
event reaches its wait whether it comes before, during or after it (then too late: its
timeout answered first)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.helpers import log_lines as lines
from tracon_jobs.runs.store import NewRun, Run
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SECTIONS: dict[str, Any] = scripted_agent([{"Text": "-"}]) | {
    "WorkflowModules": ["tests.workflows"],
    "Workflows": {"EnableCheckpointing": True, "TimerScanInterval": "00:00:00.300"},
}


def chain_end(runtime: Runtime, run_id: str) -> Run:
    """The last run of `run_id`'s chain so far (following each `continuedIn`), each run read
    once: a run read again could have ended and been continued in between."""
    while True:
        run = run_of(runtime, run_id)
        following = (run.output or {}).get("continuedIn")
        if not following:
            return run
        run_id = str(following)


def ended(runtime: Runtime, run_id: str, timeout: float = 30) -> str:
    last: list[Run] = []

    def done() -> bool:
        last[:] = [chain_end(runtime, run_id)]
        return last[0].status in ("Completed", "Failed")

    wait_until(done, timeout=timeout, what=f"the chain of {run_id} ended")
    return last[0].id


def test_a_timer_outlives_a_killed_worker_and_a_restarted_beat_and_fires_once(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, flags: Path
) -> None:
    # Given a workflow asleep for 4 s, its worker and its beat running
    cluster = make_cluster(sqlite_url, **SECTIONS)
    first_worker = cluster.worker("w1")
    first_beat = cluster.start("beat-1", "beat")
    runtime = make_runtime(sqlite_url, **SECTIONS)
    tenant = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant, "nap", {"seconds": 4}, kind="workflow", session_id="s", resumable=True)
    run_id = runtime.dispatcher.submit(new).id
    wait_until(lambda: run_of(runtime, run_id).status == "Waiting", timeout=30, what="asleep")
    [timer] = [e for e in runtime.runs.events(run_id) if e.type == "WorkflowTimerStarted"]
    assert run_of(runtime, run_id).owner is None  # no worker holds it

    # When the worker is killed with kill -9, and beat too, then both start again
    first_worker.kill9()
    first_beat.kill9()
    cluster.worker("w2")
    cluster.start("beat-2", "beat")

    # Then the chain goes on once, no earlier than the timer's time
    last = ended(runtime, run_id)
    done = run_of(runtime, last)
    assert done.status == "Completed" and done.output == {"result": "rested"}
    assert done.continued_from_run_id == run_id
    assert done.created_at >= timer.at.replace(tzinfo=None) + timedelta(seconds=4) - timedelta(
        milliseconds=5
    )
    slept = run_of(runtime, run_id)
    assert slept.waited_ms >= 3_900  # asleep: not counted toward AgentGraph.MaxDuration
    continuations = [e for e in runtime.runs.events(run_id) if e.type == "RunContinued"]
    assert len(continuations) == 1
    assert len(lines(flags, "before-nap")) == 1 and len(lines(flags, "after-nap")) == 1


def test_an_event_reaches_its_wait_before_during_and_not_after_its_timeout(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    # Given a web, a worker and beat, and a tenant's key
    cluster = make_cluster(sqlite_url, **SECTIONS)
    cluster.worker("w1")
    cluster.start("beat", "beat")
    _web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **SECTIONS)
    tenant = runtime.tenants.ensure_tenant("acme")
    headers = {"Authorization": f"Bearer {runtime.tenants.issue_key(tenant).secret}"}

    def deliver(run_id: str, payload: Any) -> httpx.Response:
        return httpx.post(
            f"{base}/api/workflows/runs/{run_id}/events/paid",
            json={"payload": payload},
            headers=headers,
            timeout=10,
        )

    def submit(**workflow_input: Any) -> str:
        answer = httpx.post(
            f"{base}/api/workflows/await-payment/run",
            json={"input": workflow_input},
            headers={**headers, "Prefer": "respond-async"},
            timeout=10,
        )
        assert answer.status_code == 202, answer.text
        return str(answer.json()["runId"])

    # Before: the event comes to a run written but not yet sent, and is kept for its wait
    early = runtime.runs.create(NewRun(tenant, "await-payment", {}, kind="workflow")).id
    kept = deliver(early, {"amount": 1})
    assert kept.status_code == 202 and kept.json()["outcome"] == "kept"
    runtime.dispatcher.send(early)

    # During: the run waits for it, and the event continues the chain
    waiting = submit()
    wait_until(lambda: run_of(runtime, waiting).status == "Waiting", timeout=30, what="waits")
    delivered = deliver(waiting, {"amount": 2})
    assert delivered.status_code == 202 and delivered.json()["outcome"] == "delivered"

    # After: the wait's timeout (1 s) answers first; the late event has nothing to reach
    timed = submit(timeout=1)

    assert run_of(runtime, ended(runtime, early)).output == {
        "result": {"order": "A-1", "paid": {"amount": 1}}
    }
    assert run_of(runtime, ended(runtime, waiting)).output == {
        "result": {"order": "A-1", "paid": {"amount": 2}}
    }
    assert run_of(runtime, ended(runtime, timed)).output == {
        "result": {"order": "A-1", "paid": None}
    }
    late = deliver(timed, {"amount": 3})
    assert late.status_code == 409 and "Completed" in late.json()["detail"]
