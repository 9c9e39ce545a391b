"""Workflow runs and crashes, with real worker and beat processes: a worker killed with
kill -9 inside node 2 of 3 (the job resumes the run from its checkpoint, or fails with its
attempts exhausted), and `MaxResumeAttempts` honoured."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import FAST_RECONCILE, Cluster, wait_until
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.helpers import event_types as types
from tests.helpers import log_lines as lines
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def start_in_node_two(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    flags: Path,
    workflows: dict[str, Any],
    **extra: Any,
) -> tuple[Cluster, Runtime, str]:
    """A queued `three-nodes` run on one worker (with beat), inside node 2 (60 s long)."""
    sections = scripted_agent([{"Text": "-"}]) | {
        "RunReconciliation": FAST_RECONCILE,
        "RunContinuation": {"Enabled": True},
        "WorkflowModules": ["tests.workflows"],
        "Workflows": workflows,
        **extra,
    }
    cluster = make_cluster(sql_url, **sections)
    owner = cluster.worker("owner")
    cluster.start("beat", "beat")
    runtime = make_runtime(sql_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    new = NewRun(
        tenant, "three-nodes", {"seconds": 60}, kind="workflow", session_id="s", resumable=True
    )
    run_id = runtime.dispatcher.submit(new).id
    wait_until(lambda: len(lines(flags, "node-2")) == 1, timeout=30, what="node 2 started")
    owner.kill9()
    (flags / "fast").touch()
    cluster.worker("survivor")
    return cluster, runtime, run_id


def test_a_killed_worker_s_workflow_run_is_resumed_from_its_checkpoint(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, flags: Path
) -> None:
    _cluster, runtime, run_id = start_in_node_two(
        make_cluster,
        make_runtime,
        sqlite_url,
        flags,
        {"EnableCheckpointing": True, "ResumeInterruptedRuns": True, "MaxResumeAttempts": 1},
    )

    # Then the interrupted run is closed, and a continuation finishes the workflow
    wait_until(lambda: "RunContinued" in types(runtime, run_id), timeout=20, what="resumed")
    interrupted = run_of(runtime, run_id)
    assert (interrupted.status, interrupted.error_type) == ("Failed", "interrupted")
    continued = next(
        e.data["continuationRunId"] for e in runtime.runs.events(run_id) if e.type == "RunContinued"
    )
    wait_until(
        lambda: run_of(runtime, continued).status == "Completed", timeout=30, what="completed"
    )
    done = run_of(runtime, continued)
    assert done.continued_from_run_id == run_id and done.output == {
        "result": ["node-1", "node-2", "node-3"]
    }
    # node 1 ran once (replayed from its checkpoint), node 2 twice with one key, node 3 once
    assert len(lines(flags, "node-1")) == 1
    assert len(lines(flags, "node-2")) == 2 and len(set(lines(flags, "node-2"))) == 1
    assert len(lines(flags, "node-3")) == 1
    assert "WorkflowNodeReplayed" in types(runtime, continued)


def test_without_resume_the_job_fails_with_its_attempts_exhausted(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, flags: Path
) -> None:
    _cluster, runtime, run_id = start_in_node_two(
        make_cluster, make_runtime, sqlite_url, flags, {"EnableCheckpointing": True}
    )

    wait_until(lambda: run_of(runtime, run_id).status == "Failed", timeout=20, what="closed")
    wait_until(lambda: "JobFailed" in types(runtime, run_id), timeout=5, what="job failed")
    # the scan writes why the run is not continued right after JobFailed, in a write of its own
    wait_until(
        lambda: "RunContinuationBlocked" in types(runtime, run_id), timeout=5, what="blocked"
    )
    run = run_of(runtime, run_id)
    assert run.error_type == "orphaned"
    failed = next(e for e in runtime.runs.events(run_id) if e.type == "JobFailed")
    assert failed.data["error"] == "tracon.job.attempts-exhausted"
    blocked = next(e for e in runtime.runs.events(run_id) if e.type == "RunContinuationBlocked")
    assert f"/api/workflows/runs/{run_id}/resume" in blocked.data["reason"]
    assert "RunContinued" not in types(runtime, run_id)
    assert len(lines(flags, "node-3")) == 0


def test_without_resume_a_job_with_attempts_left_runs_the_workflow_again_from_the_start(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, flags: Path
) -> None:
    _cluster, runtime, run_id = start_in_node_two(
        make_cluster,
        make_runtime,
        sqlite_url,
        flags,
        {"EnableCheckpointing": True},
        AsyncRun={"MaxAttempts": 2},
    )

    # Then the job attempts the workflow again, as a new run from its first node
    wait_until(lambda: "RunContinued" in types(runtime, run_id), timeout=20, what="attempted")
    interrupted = run_of(runtime, run_id)
    assert (interrupted.status, interrupted.error_type) == ("Failed", "restarted")
    again = next(
        e.data["continuationRunId"] for e in runtime.runs.events(run_id) if e.type == "RunContinued"
    )
    wait_until(lambda: run_of(runtime, again).status == "Completed", timeout=30, what="completed")
    assert run_of(runtime, again).attempt == 2
    # node 1's checkpoint answers nothing: it ran again, like node 2; node 3 ran once
    assert len(lines(flags, "node-1")) == 2 and len(lines(flags, "node-2")) == 2
    assert len(lines(flags, "node-3")) == 1
    assert "WorkflowNodeReplayed" not in types(runtime, again)
    assert "JobFailed" not in types(runtime, run_id)


def test_max_resume_attempts_zero_resumes_nothing(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, flags: Path
) -> None:
    _cluster, runtime, run_id = start_in_node_two(
        make_cluster,
        make_runtime,
        sqlite_url,
        flags,
        {"EnableCheckpointing": True, "ResumeInterruptedRuns": True, "MaxResumeAttempts": 0},
    )

    wait_until(lambda: "JobFailed" in types(runtime, run_id), timeout=20, what="job failed")
    assert run_of(runtime, run_id).status == "Failed"
    assert "RunContinued" not in types(runtime, run_id)
