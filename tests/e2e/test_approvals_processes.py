"""Approvals across real processes: concurrent decisions over two gunicorn workers, expiry by
beat, waiting runs that hold no worker thread, and kill -9 around the approved call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import FAST_RECONCILE, Cluster, wait_until
from tests.helpers import MakeRuntime, Script, run_of, scripted_agent
from tests.helpers import event_types as events
from tests.helpers import log_lines as lines
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]


def tool_results(runtime: Runtime, run_id: str) -> list[Any]:
    messages = run_of(runtime, run_id).messages or []
    return [m["content"] for m in messages if m["role"] == "tool"]


def submit(runtime: Runtime, agent: str = "demo", **fields: Any) -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.dispatcher.submit(NewRun(tenant, agent, {"message": "go"}, **fields)).id


def status_is(runtime: Runtime, run_id: str, status: str, timeout: float) -> None:
    wait_until(
        lambda: run_of(runtime, run_id).status == status,
        timeout=timeout,
        what=f"run {run_id} {status}",
    )


def one_pending(runtime: Runtime, run_id: str, timeout: float = 30) -> str:
    """Wait for the run to stop `Waiting` on one approval; its id."""
    status_is(runtime, run_id, "Waiting", timeout)
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    return approval_id


def auth(runtime: Runtime) -> dict[str, str]:
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    return {"Authorization": f"Bearer {key}"}


def test_twenty_concurrent_approvals_over_two_web_processes_one_wins_and_the_body_runs_once(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    flags: Path,
) -> None:
    sections = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"])
    cluster = make_cluster(sql_url, **sections)
    cluster.worker("w1")
    web, base = cluster.web(workers=2)
    wait_until(lambda: web.text().count("Booting worker") == 2, timeout=30, what="two web workers")
    runtime = make_runtime(sql_url, **sections)
    headers = auth(runtime)
    run_id = submit(runtime)
    approval_id = one_pending(runtime, run_id)
    listed = httpx.get(f"{base}/api/approvals?status=Pending", headers=headers, timeout=10)
    assert [a["id"] for a in listed.json()["items"]] == [approval_id]

    # When 20 clients approve it at the same moment, each on a connection of its own
    barrier = threading.Barrier(20)
    answers: list[httpx.Response] = []

    def approve() -> None:
        with httpx.Client(timeout=30) as client:
            barrier.wait()
            answers.append(
                client.post(
                    f"{base}/api/approvals/{approval_id}/decision",
                    json={"approve": True, "comment": "ok"},
                    headers=headers,
                )
            )

    threads = [threading.Thread(target=approve) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    # Then exactly one decision won, and the body ran once in the resumed run
    codes = sorted(a.status_code for a in answers)
    assert codes == [200] + [409] * 19, ([(a.status_code, a.text[:200]) for a in answers],)
    assert all(a.json()["approvalStatus"] == "Approved" for a in answers if a.status_code == 409)
    status_is(runtime, run_id, "Completed", 30)
    assert len(lines(flags, "close_account")) == 1
    assert tool_results(runtime, run_id) == ["closed acc-1"]
    assert events(runtime, run_id).count("ApprovalDecided") == 1
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.consumed_at is not None


def test_beat_expires_an_undecided_approval_and_the_run_goes_on(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    sections = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"]) | {
        "Approvals": {"Timeout": "00:00:01", "ExpiryScanInterval": "00:00:00.500"},
        "SingletonExecution": {"Enabled": True, "LeaseDuration": "00:00:03"},
    }
    cluster = make_cluster(sqlite_url, **sections)
    cluster.worker("w1")
    _web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)
    headers = auth(runtime)
    run_id = submit(runtime)
    approval_id = one_pending(runtime, run_id)
    cluster.start("beat", "beat")

    # When nobody decides: beat's expiry pass (on the worker holding the lease) expires it
    status_is(runtime, run_id, "Completed", 30)

    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.status == "Expired"
    assert approval.decided_by is None and approval.consumed_at is None
    assert lines(flags, "close_account") == [], "the body never ran"
    [answer] = tool_results(runtime, run_id)
    assert "approval_expired" in answer
    assert run_of(runtime, run_id).output == {"text": "Done."}
    # And a decision after expiry is refused
    late = httpx.post(
        f"{base}/api/approvals/{approval_id}/decision",
        json={"approve": True},
        headers=headers,
        timeout=10,
    )
    assert late.status_code == 409 and late.json()["approvalStatus"] == "Expired"


def test_waiting_runs_hold_no_worker_thread(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    sections = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"])
    sections["Providers"]["plain"] = {"Kind": "scripted", "Script": [{"Text": "hi"}]}
    sections["Agents"]["plain"] = {
        "Instructions": "no gated tools",
        "Model": {"provider": "plain", "model": "demo-model"},
        "Tools": [],
    }
    sections["Worker"] = {"Concurrency": 2}
    cluster = make_cluster(sqlite_url, **sections)
    cluster.worker("w1", concurrency=2)
    runtime = make_runtime(sqlite_url, **sections)

    # Given five runs waiting for a person on a worker of two threads
    waiting = [submit(runtime) for _ in range(5)]
    for run_id in waiting:
        one_pending(runtime, run_id)

    # When three runs of an agent without gated tools arrive, they complete promptly
    started = time.monotonic()
    plain = [submit(runtime, agent="plain") for _ in range(3)]
    for run_id in plain:
        status_is(runtime, run_id, "Completed", 15)
    elapsed = time.monotonic() - started

    assert elapsed < 10, f"the plain runs took {elapsed:.1f}s"
    assert [run_of(runtime, r).status for r in waiting] == ["Waiting"] * 5
    assert all(run_of(runtime, r).owner is None for r in waiting)
    assert lines(flags, "close_account") == []


def test_a_worker_killed_inside_an_approved_destructive_body_blocks_continuation(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "slow_gated_wipe", "Arguments": {"seconds": 60}}]},
        {"Text": "wiped"},
    ]
    sections = scripted_agent(script, ["slow_gated_wipe"]) | {
        "RunReconciliation": FAST_RECONCILE,
        "RunContinuation": {"Enabled": True},
    }
    cluster = make_cluster(sqlite_url, **sections)
    doomed = cluster.worker("owner")
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = submit(runtime, session_id="support-42")
    approval_id = one_pending(runtime, run_id)

    # Given the approved body is running
    runtime.approvals.decide(tenant, approval_id, True)
    wait_until(lambda: len(lines(flags, "slow_gated_wipe")) == 1, timeout=30, what="in the body")

    # When its worker is killed, and another worker is there
    doomed.kill9()
    cluster.worker("survivor")

    # Then the run is closed orphaned and not continued: the destructive call's outcome is
    # unknown
    wait_until(
        lambda: "RunContinuationBlocked" in events(runtime, run_id),
        timeout=20,
        what="continuation blocked",
    )
    blocked = next(
        e.data for e in runtime.runs.events(run_id) if e.type == "RunContinuationBlocked"
    )
    assert blocked["tool"] == "slow_gated_wipe" and blocked["sideEffect"] == "destructive"
    run = run_of(runtime, run_id)
    assert (run.status, run.error_type) == ("Failed", "orphaned")
    assert "RunContinued" not in events(runtime, run_id)
    assert len(lines(flags, "slow_gated_wipe")) == 1
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.consumed_at is not None


def test_a_worker_killed_after_the_decision_before_consuming_continues_without_asking_again(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
) -> None:
    # One turn: a slow read, then the gated call. Both are decided before either runs, so
    # the resumed run sits in slow_step, approved but not yet consumed, when it is killed.
    script: Script = [
        {
            "ToolCalls": [
                {"Name": "slow_step", "Arguments": {"seconds": 60}},
                {"Name": "close_account", "Arguments": {"account": "acc-1"}},
            ]
        },
        {"Text": "closed"},
    ]
    sections = scripted_agent(script, ["slow_step", "close_account"]) | {
        "RunReconciliation": FAST_RECONCILE,
        "RunContinuation": {"Enabled": True},
    }
    cluster = make_cluster(sqlite_url, **sections)
    doomed = cluster.worker("owner")
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = submit(runtime, session_id="support-42")
    approval_id = one_pending(runtime, run_id)
    assert lines(flags, "slow_step") == [], "no call of the turn ran before the approval"

    runtime.approvals.decide(tenant, approval_id, True)
    wait_until(lambda: len(lines(flags, "slow_step")) == 1, timeout=30, what="in slow_step")
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.consumed_at is None

    # When the worker dies there, and another worker is there
    doomed.kill9()
    (flags / "fast").touch()
    cluster.worker("survivor")

    # Then the orphan is continued; the continuation uses the approval, without a new one
    wait_until(lambda: "RunContinued" in events(runtime, run_id), timeout=20, what="continued")
    assert run_of(runtime, run_id).error_type == "orphaned"
    continued = next(
        e.data["continuationRunId"] for e in runtime.runs.events(run_id) if e.type == "RunContinued"
    )
    status_is(runtime, continued, "Completed", 30)
    assert run_of(runtime, continued).output == {"text": "closed"}
    assert len(lines(flags, "close_account")) == 1
    chain = [run_id, continued]
    assert sum(events(runtime, r).count("ApprovalRequested") for r in chain) == 1
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.consumed_at is not None
