"""Fan-out across real worker processes: a workflow's ten agent branches run as child runs
while the parent holds no thread; one child waits for a person's approval, and on a worker
of two threads the other nine, and runs submitted meanwhile, complete; the approval's
decision ends the last child, whose worker continues the parent."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import FAST_RECONCILE, Cluster, wait_until
from tests.e2e.test_approvals_processes import CLOSE_THEN_ANSWER, status_is, submit
from tests.e2e.test_workflow_waits_processes import chain_end, ended
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.helpers import log_lines as lines
from tracon_jobs.runs.store import NewRun, Run
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def sections() -> dict[str, Any]:
    config = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"])
    config["Providers"]["plain"] = {"Kind": "scripted", "Script": [{"Text": "hi"}]}
    config["Agents"]["plain"] = {
        "Instructions": "no gated tools",
        "Model": {"provider": "plain", "model": "demo-model"},
        "Tools": [],
    }
    config["WorkflowModules"] = ["tests.workflows"]
    config["Workflows"] = {"EnableCheckpointing": True}
    config["Worker"] = {"Concurrency": 2}
    return config


def children(runtime: Runtime, run_id: str) -> list[Run]:
    return [run for run in runtime.runs.subtree(run_of(runtime, run_id)) if run.id != run_id]


def test_ten_agent_branches_one_awaiting_approval_on_a_worker_of_two_threads(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, flags: Path
) -> None:
    config = sections()
    cluster = make_cluster(sqlite_url, **config)
    cluster.worker("w1", concurrency=2)
    runtime = make_runtime(sqlite_url, **config)
    tenant = runtime.tenants.ensure_tenant("acme")

    # Given three workflows (more than the worker's two threads) fanning out to ten agents
    # each, one of which waits for an approval
    parents = [
        runtime.dispatcher.submit(
            NewRun(tenant, "fan-ten", {}, kind="workflow", session_id="s", resumable=True)
        ).id
        for _ in range(3)
    ]

    def nine_done(parent: str) -> bool:
        runs = children(runtime, parent)
        done = [run for run in runs if run.agent == "plain" and run.status == "Completed"]
        return len(runs) == 10 and len(done) == 9

    # Then the nine others of each complete on the two threads while the parents wait
    wait_until(lambda: all(map(nine_done, parents)), timeout=60, what="27 branches completed")
    approvals = []
    for parent in parents:
        [gated] = [run for run in children(runtime, parent) if run.agent == "demo"]
        status_is(runtime, gated.id, "Waiting", 30)
        approvals += runtime.approval_store.pending_ids(gated.id)
        waiting = run_of(runtime, parent)
        assert waiting.status == "Waiting" and waiting.owner is None  # no thread held
        assert chain_end(runtime, parent).id == parent
    assert len(approvals) == 3

    # And both threads are free: a run submitted now completes at once
    began = time.monotonic()
    other = submit(runtime, agent="plain")
    status_is(runtime, other, "Completed", 15)
    assert time.monotonic() - began < 10

    # When the person approves, the last branch ends and its worker continues the parent
    for approval_id in approvals:
        runtime.approvals.decide(tenant, approval_id, True, "ok")
    for parent in parents:
        last = run_of(runtime, ended(runtime, parent, timeout=60))
        assert last.status == "Completed", last.error_message
        assert last.output == {"result": ["Done."] + ["hi"] * 9}
        assert last.continued_from_run_id == parent
    assert len(lines(flags, "close_account")) == 3


def test_a_worker_killed_inside_a_fan_out_s_branch_is_resumed_without_a_second_child(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, flags: Path
) -> None:
    config = scripted_agent([{"Text": "-"}]) | {
        "RunReconciliation": FAST_RECONCILE,
        "RunContinuation": {"Enabled": True},
        "WorkflowModules": ["tests.workflows"],
        "Workflows": {"EnableCheckpointing": True, "ResumeInterruptedRuns": True},
    }
    cluster = make_cluster(sqlite_url, **config)
    owner = cluster.worker("owner")
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **config)
    tenant = runtime.tenants.ensure_tenant("acme")

    # Given a fan-out whose child and quick branch finished, its slow branch running (60 s)
    new = NewRun(
        tenant, "fan-slow", {"seconds": 60}, kind="workflow", session_id="s", resumable=True
    )
    first = runtime.dispatcher.submit(new).id
    wait_until(lambda: len(lines(flags, "fan-slow")) == 1, timeout=30, what="slow branch began")
    [child] = children(runtime, first)
    status_is(runtime, child.id, "Completed", 30)
    assert lines(flags, "fan-quick") == [""]

    # When its worker is killed with kill -9 and another takes over
    owner.kill9()
    (flags / "fast").touch()
    cluster.worker("survivor")

    # Then the run that resumes it takes over the fan-out: the child and the quick branch
    # are not started again, the slow branch runs again with the same key
    def chain_ended() -> bool:
        chain = chain_ids(runtime, first)
        return bool(chain) and run_of(runtime, chain[-1]).status in ("Completed", "Failed")

    wait_until(chain_ended, timeout=60, what="the resumed chain ended")
    chain = chain_ids(runtime, first)
    assert run_of(runtime, first).error_type == "interrupted"
    last = run_of(runtime, chain[-1])
    assert last.status == "Completed", last.error_message
    assert last.output == {"result": ["q", "fan-slow", "-"]}
    assert [run.id for id_ in [first, *chain] for run in children(runtime, id_)] == [child.id]
    assert lines(flags, "fan-quick") == [""]
    assert lines(flags, "fan-slow") == [f"tj-wf-{first}-parallel#1/1"] * 2


def chain_ids(runtime: Runtime, first: str) -> list[str]:
    """The runs that continue `first`'s chain (answers, resumes), oldest first."""
    found: list[str] = []
    current = first
    while True:
        following = [
            e.data["continuationRunId"]
            for e in runtime.runs.events(current)
            if e.type == "RunContinued"
        ]
        if not following:
            return found
        current = str(following[0])
        found.append(current)
