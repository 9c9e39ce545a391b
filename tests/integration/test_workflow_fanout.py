"""Fan-out, in one process over real SQL (both backends) and Redis: `ctx.parallel` starts its
children with the node and runs its function branches at once, then waits without a thread;
the last branch's end answers it once (whoever sees it: the child's worker, the parent after
its own commit, the timer scan); `fail_fast` fails the node at the first failure and cancels
the rest, `collect` returns every outcome; a child workflow waits on its own (a timer) and
its chain stays in the parent's tree; budgets count each branch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests import workflows
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.helpers import event_types as types
from tracon_jobs.db.models import Run
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime


@pytest.fixture(autouse=True)
def _clean() -> None:
    workflows.ran.clear()


def runtime_for(
    make_runtime: MakeRuntime, sql_url: str, *, inline: bool = False, **sections: Any
) -> Runtime:
    """A runtime whose sent runs go nowhere (the test executes them), or (`inline`) are
    executed at once on the sending thread: a child then ends before its parent waits."""
    config = scripted_agent([{"Text": "ok"}])
    config["WorkflowModules"] = ["tests.workflows"]
    config["Workflows"] = {"EnableCheckpointing": True}
    config.update(sections)
    made: list[Runtime] = []

    def sender(run_id: str) -> None:
        if inline:
            made[0].executor.execute(run_id)

    made.append(make_runtime(sql_url, sender=sender, **config))
    return made[0]


def start(runtime: Runtime, name: str, payload: dict[str, Any]) -> str:
    tenant_id = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant_id=tenant_id, agent=name, kind="workflow", input=payload, session_id="s")
    return runtime.runs.create(new).id


def children_of(runtime: Runtime, run_id: str) -> list[Run]:
    return [run for run in runtime.runs.subtree(run_of(runtime, run_id)) if run.id != run_id]


def continued(runtime: Runtime, run_id: str) -> str:
    return str((run_of(runtime, run_id).output or {})["continuedIn"])


def test_a_fan_out_runs_its_branches_at_once_and_waits_for_its_child_without_a_thread(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "fan", {})

    # When the workflow reaches its fan-out
    assert runtime.executor.execute(first) == "Waiting"

    # Then its function branches ran, its agent branch is a child run of its tree, and it
    # waits (no owner) for that child, its reason said
    assert sorted(workflows.ran) == ["score", "score"]
    [child] = children_of(runtime, first)
    assert (child.kind, child.agent, child.status, child.depth) == ("agent", "demo", "Queued", 1)
    assert child.input == {"message": "hello"}
    waiting = run_of(runtime, first)
    assert waiting.status == "Waiting" and waiting.owner is None
    events = runtime.runs.events(first)
    [started] = [e for e in events if e.type == "WorkflowFanOutStarted"]
    assert started.data["onFailure"] == "fail_fast"
    assert [b["kind"] for b in started.data["branches"]] == ["step", "agent", "step"]
    assert started.data["branches"][1]["runId"] == child.id
    assert events[-1].type == "RunWaiting" and events[-1].data["reason"] == "fanout"

    # When the child ends on a worker
    assert runtime.executor.execute(child.id) == "Completed"

    # Then that worker answered the fan-out: the chain goes on in a new run, which replays
    # every branch (none runs again) and returns them in order
    second = continued(runtime, first)
    assert runtime.workflow_resumes.fire_due(runtime.db.now() + timedelta(seconds=60)) == 0
    assert runtime.executor.execute(second) == "Completed"
    output = run_of(runtime, second).output
    assert output == {"result": {"results": [10, "ok", 20], "after": "done"}}
    assert sorted(workflows.ran) == ["after-fan", "score", "score"]
    assert "WorkflowNodeReplayed" in types(runtime, second)


def test_a_child_that_ends_before_its_parent_waits_is_not_missed(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given children executed the moment they are sent: before the parent's wait commits
    runtime = runtime_for(make_runtime, sql_url, inline=True)
    first = start(runtime, "fan", {"seconds": 0.2})

    assert runtime.executor.execute(first) == "Waiting"
    [child] = children_of(runtime, first)
    assert run_of(runtime, child.id).status == "Completed"

    # Then the parent, seeing it after its own commit, answered its fan-out itself; the
    # continuation was sent (and, here, executed) at once
    second = continued(runtime, first)
    assert run_of(runtime, second).output == {
        "result": {"results": [10, "ok", 20], "after": "done"}
    }


def test_fail_fast_fails_the_node_at_a_failed_function_branch_and_cancels_the_children(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "fan", {"broken": True})

    assert runtime.executor.execute(first) == "Failed"

    run = run_of(runtime, first)
    assert run.error_type == "workflow_node_failed"
    assert "branch 3 ('broken'): ValueError: item 3 is broken" in str(run.error_message)
    [child] = children_of(runtime, first)
    assert run_of(runtime, child.id).status == "Canceled"
    assert "after-fan" not in workflows.ran


def test_collect_returns_every_outcome_with_the_failed_ones_in_their_places(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "fan", {"broken": True, "onFailure": "collect"})

    assert runtime.executor.execute(first) == "Waiting"
    [child] = children_of(runtime, first)
    assert runtime.executor.execute(child.id) == "Completed"
    second = continued(runtime, first)
    assert runtime.executor.execute(second) == "Completed"

    result = (run_of(runtime, second).output or {})["result"]
    assert result["results"][:3] == [10, "ok", 20]
    assert result["results"][3] == {"failed": "ValueError: item 3 is broken"}
    assert result["after"] == "done"


def test_a_child_canceled_where_no_worker_sees_it_is_answered_by_the_timer_scan(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a fail-fast fan-out of three agents, waiting
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "fan-agents", {"n": 3, "onFailure": "fail_fast"})
    assert runtime.executor.execute(first) == "Waiting"
    one, two, three = sorted(children_of(runtime, first), key=lambda r: r.created_at)

    # When one child completes and another is canceled while Queued (no worker ends it)
    assert runtime.executor.execute(one.id) == "Completed"
    rt = runtime
    cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, run_of(rt, two.id))
    assert run_of(runtime, first).status == "Waiting"

    # Then the timer scan, at the fan-out's next look, answers it; the third is canceled
    assert runtime.workflow_resumes.fire_due(runtime.db.now()) == 0
    assert runtime.workflow_resumes.fire_due(runtime.db.now() + timedelta(seconds=6)) == 1
    assert run_of(runtime, three.id).status == "Canceled"
    second = continued(runtime, first)
    assert runtime.executor.execute(second) == "Failed"
    error = str(run_of(runtime, second).error_message)
    assert error.startswith("node 'map:demo#1' branch 1 ('agent:demo'): agent 'demo' run")
    assert "ended Canceled" in error


def test_a_child_workflow_waits_on_its_own_and_its_chain_stays_in_the_tree(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    parent = start(runtime, "parent-of-nap", {"seconds": 30})

    # Given the parent waiting for its child workflow, which sleeps
    assert runtime.executor.execute(parent) == "Waiting"
    [child] = children_of(runtime, parent)
    assert (child.kind, child.agent) == ("workflow", "nap")
    assert runtime.executor.execute(child.id) == "Waiting"

    # When the child's timer fires, its continuation is still the parent's child
    assert runtime.workflow_resumes.fire_due(runtime.db.now() + timedelta(seconds=31)) == 1
    follow = run_of(runtime, continued(runtime, child.id))
    assert (follow.parent_run_id, follow.root_run_id, follow.depth) == (parent, parent, 1)
    assert run_of(runtime, parent).status == "Waiting"

    # Then its end answers the parent, whose continuation returns the child's result
    assert runtime.executor.execute(follow.id) == "Completed"
    second = continued(runtime, parent)
    assert runtime.executor.execute(second) == "Completed"
    assert run_of(runtime, second).output == {"result": {"child": "rested"}}


def test_a_fan_out_past_the_tree_budget_starts_no_child(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, AgentGraph={"MaxTotalRuns": 3})
    first = start(runtime, "fan-agents", {"n": 5})

    assert runtime.executor.execute(first) == "Failed"

    run = run_of(runtime, first)
    assert run.error_type == "run_budget_exceeded", run.error_message
    assert "map:demo#1/" in str(run.error_message)
    assert children_of(runtime, first) == []


def test_an_unknown_agent_fails_the_node_naming_it(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "fan-agents", {"n": 2, "agent": "nobody"})

    assert runtime.executor.execute(first) == "Failed"

    run = run_of(runtime, first)
    assert run.error_type == "configuration_error"
    assert "no agent 'nobody' is configured" in str(run.error_message)
    assert children_of(runtime, first) == []


def test_a_canceled_parent_cancels_its_waiting_fan_out_and_its_children(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "fan-agents", {"n": 2})
    assert runtime.executor.execute(first) == "Waiting"

    rt = runtime
    cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, run_of(rt, first), rt.dispatcher.taken)

    assert run_of(runtime, first).status == "Canceled"
    assert {run.status for run in children_of(runtime, first)} == {"Canceled"}
    assert runtime.workflow_resumes.fire_due(runtime.db.now() + timedelta(seconds=60)) == 0


def test_what_the_children_spent_counts_in_the_budget_of_the_run_that_goes_on(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a tree budget that one agent call exhausts
    runtime = runtime_for(make_runtime, sql_url, AgentGraph={"MaxTotalCost": 0.0000001})
    first = start(runtime, "fan", {})
    assert runtime.executor.execute(first) == "Waiting"
    [child] = children_of(runtime, first)

    # When the agent branch spends it
    assert runtime.executor.execute(child.id) == "Completed"
    assert run_of(runtime, child.id).cost_amount > 0

    # Then the run that goes on after the fan-out starts from that spend: its next node is
    # refused
    second = continued(runtime, first)
    assert runtime.executor.execute(second) == "Failed"
    run = run_of(runtime, second)
    assert run.error_type == "run_budget_exceeded"
    assert "after-fan#1" in str(run.error_message)
    assert "after-fan" not in workflows.ran


def test_a_resumed_fan_out_runs_again_only_its_failed_and_canceled_branches(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a fail-fast fan-out whose function branch failed: the child canceled, the run Failed
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "fan", {"brokenOnce": True})
    assert runtime.executor.execute(first) == "Failed"
    [canceled] = children_of(runtime, first)
    assert run_of(runtime, canceled.id).status == "Canceled"
    assert sorted(workflows.ran) == ["broken-once", "score", "score"]

    # When an operator resumes it
    second = runtime.workflow_resumes.resume(run_of(runtime, first), resumable=True).id
    assert runtime.executor.execute(second) == "Waiting"

    # Then the branches that succeeded are not run again; the failed one is, and the
    # canceled child is replaced by a new one
    assert sorted(workflows.ran) == ["broken-once", "broken-once", "score", "score"]
    [child] = children_of(runtime, second)
    assert child.id != canceled.id
    assert runtime.executor.execute(child.id) == "Completed"
    third = continued(runtime, second)
    assert runtime.executor.execute(third) == "Completed"
    assert run_of(runtime, third).output == {
        "result": {"results": [10, "ok", 20, 3], "after": "done"}
    }
