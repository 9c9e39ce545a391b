"""Workflows in one process over real SQL (both backends) and Redis: checkpoints and replay,
a question answered across runs of one chain with its budget carried, operator resume, the
budget gate of function nodes, and what a continuation reads once (the chain)."""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select, update

from tests import workflows
from tests.helpers import MakeRuntime, claim_run, drop_idle_connections, run_of, scripted_agent
from tests.helpers import event_types as types
from tracon_jobs.db.models import Run, WorkflowNode
from tracon_jobs.errors import ConfigurationError, RunTakenAway
from tracon_jobs.limits.tree import ChainUnreadable, seed_totals
from tracon_jobs.runs.lifecycle import Claim, ErrorClass, RunError, RunStatus
from tracon_jobs.runs.reconcile import JOB_RESTARTED
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
from tracon_jobs.workflows import WorkflowContext
from tracon_jobs.workflows.store import RequestConflict, ResumeConflict

DRAFT = [{"Text": "Sorry for the delay.", "InputTokens": 100, "OutputTokens": 20}]


@pytest.fixture(autouse=True)
def _clean() -> None:
    workflows.ran.clear()


def runtime_for(make_runtime: MakeRuntime, sql_url: str, **sections: Any) -> Runtime:
    config = scripted_agent(DRAFT)
    config["WorkflowModules"] = ["tests.workflows"]
    config.setdefault("Workflows", {"EnableCheckpointing": True})
    config.update(sections)
    return make_runtime(sql_url, sender=lambda _run_id: None, **config)


def start(runtime: Runtime, name: str, payload: dict[str, Any], tenant: str = "acme") -> str:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    new = NewRun(tenant_id=tenant_id, agent=name, kind="workflow", input=payload, session_id="s")
    return runtime.runs.create(new).id


def test_a_workflow_with_a_question_completes_across_respond(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "review", {"orderId": "A-1"})

    # Given the first run ran two nodes and waits for a person
    assert runtime.executor.execute(first) == "Waiting"
    waiting = run_of(runtime, first)
    assert waiting.status == "Waiting" and waiting.owner is None
    assert workflows.ran == ["load-order"]
    assert "WorkflowRequestCreated" in types(runtime, first)

    # When the person answers
    second = runtime.workflow_resumes.respond(waiting, {"text": "send it"}, resumable=False)
    assert runtime.executor.execute(second.id) == "Completed"

    # Then the answer continues the chain; finished nodes are replayed, not run again
    done = run_of(runtime, second.id)
    assert done.output == {"result": {"reply": "A-1: send it"}}
    assert done.continued_from_run_id == first and done.session_id == "s"
    assert workflows.ran == ["load-order", "finish"]
    assert types(runtime, second.id).count("WorkflowNodeReplayed") == 3
    closed = run_of(runtime, first)
    assert closed.status == "Completed" and closed.output == {"continuedIn": second.id}
    children = [r for r in runtime.runs.tree(first, closed.tenant_id) if r.id != first]
    assert [r.agent for r in children] == ["demo"]  # the agent node ran once, in the first run
    # And the budget of the second run starts from what the first one spent
    carried = seed_totals(runtime.db, second.id)
    assert carried.tokens == 120 and carried.cost == Decimal("0.00014")
    with pytest.raises(RequestConflict):
        runtime.workflow_resumes.respond(closed, {"text": "again"}, resumable=False)


def test_time_waiting_for_the_answer_is_not_executed_time(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "hundred", {})
    assert runtime.executor.execute(first) == "Waiting"
    time.sleep(0.3)

    second = runtime.workflow_resumes.respond(run_of(runtime, first), None, resumable=False)

    waited = run_of(runtime, first)
    assert waited.waited_ms >= 300
    assert waited.ended_at is not None and waited.started_at is not None
    wall_ms = (waited.ended_at - waited.started_at).total_seconds() * 1000
    assert abs(seed_totals(runtime.db, second.id).executed_ms - (wall_ms - waited.waited_ms)) < 5


def test_a_function_node_is_refused_by_cost_and_resumes_after_the_setting_is_raised(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    config = {"AgentGraph": {"MaxTotalCost": 0.5}}
    runtime = runtime_for(make_runtime, sql_url, **config)
    first = start(runtime, "paid", {"amount": 0.5})

    assert runtime.executor.execute(first) == "Failed"
    failed = run_of(runtime, first)
    assert (failed.error_type, failed.error_class) == ("run_budget_exceeded", "QuotaExceeded")
    assert "second#1" in (failed.error_message or "")  # 0.5 spent: the next node is refused
    assert "MaxTotalCost" in (failed.error_message or "")
    assert workflows.ran == ["first"]

    # When the operator raises the setting and resumes
    raised = runtime_for(make_runtime, sql_url, AgentGraph={"MaxTotalCost": 5})
    resumed = raised.workflow_resumes.resume(failed, resumable=False)
    assert raised.executor.execute(resumed.id) == "Completed"
    assert run_of(raised, resumed.id).output == {"result": ["first", "second", "store"]}
    assert workflows.ran == ["first", "second", "store"]  # no node ran twice

    with pytest.raises(ResumeConflict):
        raised.workflow_resumes.resume(
            run_of(raised, resumed.id), resumable=False
        )  # a completed run
    with pytest.raises(ResumeConflict):
        raised.workflow_resumes.resume(failed, resumable=False)  # resumed already


def test_a_node_marked_to_start_when_the_budget_is_spent_still_runs(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, AgentGraph={"MaxTotalCost": 0.5})
    run_id = start(runtime, "paid", {"amount": 0.3})

    assert runtime.executor.execute(run_id) == "Completed"  # 0.6 spent before `store` starts
    assert workflows.ran == ["first", "second", "store"]


def test_tokens_do_not_stop_a_function_node(make_runtime: MakeRuntime, sql_url: str) -> None:
    # Given an agent node whose model call fits under the tree's 500 tokens when it starts
    # (it reserves under 300) and then reports 1,020: the tree is past MaxTotalTokens
    big = [{"Text": "Sorry.", "InputTokens": 1000, "OutputTokens": 20}]
    config = scripted_agent(big) | {"WorkflowModules": ["tests.workflows"]}
    runtime = make_runtime(
        sql_url, sender=lambda _run_id: None, **config, AgentGraph={"MaxTotalTokens": 500}
    )
    run_id = start(runtime, "agent-then-step", {})

    assert runtime.executor.execute(run_id) == "Completed"

    assert seed_totals(runtime.db, run_id).tokens == 1020  # more than MaxTotalTokens
    assert workflows.ran == ["after-agent"]  # the function node still ran


def test_a_refused_function_node_is_invoked_then_fails(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, AgentGraph={"MaxTotalCost": 0.5})
    run_id = start(runtime, "paid", {"amount": 0.5})

    assert runtime.executor.execute(run_id) == "Failed"

    second = [
        (e.type, e.data) for e in runtime.runs.events(run_id) if e.data.get("node") == "second#1"
    ]
    assert [kind for kind, _ in second] == ["WorkflowNodeStarted", "WorkflowNodeFailed"]
    assert second[1][1]["refused"] == "run_budget_exceeded"
    assert workflows.ran == ["first"]  # the refused node's body never ran


def test_max_duration_keeps_the_next_function_node_from_starting(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # (well over what node 1 and the claim take on a loaded machine: 0.3 s was not)
    runtime = runtime_for(make_runtime, sql_url, AgentGraph={"MaxDuration": "00:00:01.500"})
    run_id = start(runtime, "three-nodes", {"seconds": 2.0})

    assert runtime.executor.execute(run_id) == "Failed"

    failed = run_of(runtime, run_id)
    assert (failed.error_type, failed.error_class) == ("run_budget_exceeded", "QuotaExceeded")
    assert "node-3#1" in (failed.error_message or "")
    assert "MaxDuration" in (failed.error_message or "")
    assert workflows.ran == ["node-1", "node-2"]  # node 2 was not cut off, node 3 never ran


def test_a_retry_is_checked_against_the_budget_again(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, AgentGraph={"MaxTotalCost": 0.5})
    run_id = start(runtime, "costly-retry", {"amount": 1.0})

    assert runtime.executor.execute(run_id) == "Failed"

    failed = run_of(runtime, run_id)
    assert failed.error_type == "run_budget_exceeded" and "MaxTotalCost" in (
        failed.error_message or ""
    )
    assert workflows.ran == ["costly"]  # the first attempt spent past the limit: no second
    attempts = [
        (e.type, e.data["attempt"])
        for e in runtime.runs.events(run_id)
        if e.type.startswith("WorkflowNode")
    ]
    assert attempts == [
        ("WorkflowNodeStarted", 1),
        ("WorkflowNodeFailed", 1),
        ("WorkflowNodeStarted", 2),
        ("WorkflowNodeFailed", 2),
    ]


def test_a_failed_node_is_retried_when_asked(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    run_id = start(runtime, "flaky", {})

    assert runtime.executor.execute(run_id) == "Completed"
    assert workflows.ran == ["flaky", "flaky"]
    assert types(runtime, run_id).count("WorkflowNodeFailed") == 1


def test_replaying_a_hundred_checkpoints_is_cheap(
    make_runtime: MakeRuntime, sql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replaying 100 checkpointed nodes: one read of the chain's checkpoints before (in
    `_prepare`), and during the replay itself one transaction, the write of the replay events,
    whatever the count of nodes. Timed as well, and printed (2-6 ms on SQLite, 3-8 ms on
    PostgreSQL here): the time is not asserted, as the machine runs other tests beside it."""
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "hundred", {})
    assert runtime.executor.execute(first) == "Waiting"
    second = runtime.workflow_resumes.respond(run_of(runtime, first), None, resumable=False)
    claim, run, signal = _claimed(runtime, second.id)
    stale = Claim(first, 0, "nobody")  # a worker compiles its statements once per process
    with pytest.raises(RunTakenAway):
        runtime.runs.append_all(stale, [("WorkflowNodeReplayed", {})])
    opened: list[str] = []
    db = runtime.runs.db
    for name in ("write", "transaction", "autocommit", "read", "read_connection"):
        monkeypatch.setattr(db, name, _counted(getattr(db, name), name, opened))

    timings = []
    for _ in range(3):  # the best of three
        execution = runtime.workflow_runner._prepare(claim, run, signal)
        assert len(execution.recorded) == 101
        before = len(opened)
        started = time.perf_counter()
        total = workflows.hundred(WorkflowContext(execution), {})
        execution.flush_replays()
        timings.append((time.perf_counter() - started) * 1000)
        assert opened[before:] == ["transaction"]  # the replay events, in one write
    print(f"replayed 100 checkpointed nodes and a question in {min(timings):.1f} ms (best of 3)")

    assert total == sum(range(100))
    assert types(runtime, second.id).count("WorkflowNodeReplayed") == 3 * 101


def _counted(opened: Any, name: str, log: list[str]) -> Any:
    """`opened` (a context manager factory of the database), each use noted in `log`."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        log.append(name)
        return opened(*args, **kwargs)

    return counted


def _claimed(runtime: Runtime, run_id: str) -> tuple[Any, Run, Any]:
    from tracon_jobs.abort import AbortSignal

    claimed = runtime.runs.claim_and_load(run_id, "test")
    assert claimed is not None
    return claimed[0], claimed[1], AbortSignal()


def test_a_chain_longer_than_128_runs_fails_before_its_first_node(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    previous = None
    for _ in range(129):
        tenant = runtime.tenants.ensure_tenant("acme")
        new = NewRun(tenant_id=tenant, agent="three-nodes", kind="workflow", input={})
        run = runtime.runs.create(new)
        with runtime.db.write() as session:
            session.execute(
                update(Run).where(Run.id == run.id).values(continued_from_run_id=previous)
            )
        previous = run.id
    assert previous is not None

    assert runtime.executor.execute(previous) == "Failed"
    run = run_of(runtime, previous)
    assert run.error_type == "chain_unreadable" and "128" in (run.error_message or "")
    assert workflows.ran == []


def test_a_chain_is_read_in_one_statement_as_the_walk_read_it(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    """`WorkflowStore.lineage`: the chain newest first, ending at a run it names that is gone
    (as the walk run by run did), the runs after the newest restarted by its job, and 128 runs
    the most a chain may hold."""
    runtime = runtime_for(make_runtime, sql_url)
    tenant = runtime.tenants.ensure_tenant("acme")
    store = runtime.workflow_store

    def run(continues: str | None, **values: Any) -> Run:
        new = NewRun(tenant, "three-nodes", {}, kind="workflow", continued_from_run_id=continues)
        created = runtime.runs.create(new)
        if values:
            with runtime.db.write() as session:
                session.execute(update(Run).where(Run.id == created.id).values(**values))
        return run_of(runtime, created.id)

    # a chain whose oldest run names one that is gone, and whose middle run its job restarted
    oldest = run(None, continued_from_run_id="gone")
    restarted = run(oldest.id, error_type=JOB_RESTARTED)
    middle = run(restarted.id)
    newest = run(middle.id)
    lineage = store.lineage(newest)
    assert lineage.ids == [newest.id, middle.id, restarted.id, oldest.id, "gone"]
    assert lineage.since_restart == [newest.id, middle.id]
    assert store.lineage(oldest).ids == [oldest.id, "gone"]
    fresh = run(None)  # continues nothing: nothing read
    assert (store.lineage(fresh).ids, store.lineage(fresh).since_restart) == ([fresh.id],) * 2

    # 128 runs: read whole; 129: refused
    previous = run(None)
    for _ in range(127):
        previous = run(previous.id)
    assert len(store.lineage(previous).ids) == 128
    with pytest.raises(ChainUnreadable):
        store.lineage(run(previous.id))


def test_an_agent_continuation_with_a_long_chain_fails_too(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    tenant = runtime.tenants.ensure_tenant("acme")
    previous = None
    for _ in range(130):
        run = runtime.runs.create(NewRun(tenant_id=tenant, agent="demo", input={"message": "m"}))
        with runtime.db.write() as session:
            session.execute(
                update(Run)
                .where(Run.id == run.id)
                .values(continued_from_run_id=previous, status="Failed")
            )
        previous = run.id
    last = runtime.runs.create(
        NewRun(
            tenant_id=tenant, agent="demo", input={"message": "m"}, continued_from_run_id=previous
        )
    )

    assert runtime.executor.execute(last.id) == "Failed"
    assert run_of(runtime, last.id).error_type == "chain_unreadable"


def test_resume_needs_reconciliation_and_checkpoints(sql_url: str, redis_url: str) -> None:
    sections = {
        "Database": {"Url": sql_url},
        "Redis": {"Url": redis_url},
        "Workflows": {"EnableCheckpointing": True, "ResumeInterruptedRuns": True},
    }
    with pytest.raises(ConfigurationError, match=r"RunReconciliation\.Enabled"):
        Runtime(Settings.model_validate(sections))
    sections["Workflows"] = {"EnableCheckpointing": False, "ResumeInterruptedRuns": True}
    with pytest.raises(Exception, match="EnableCheckpointing"):
        Settings.model_validate(sections)
    sections["Workflows"] = {}
    sections["AsyncRun"] = {"MaxAttempts": 3}
    with pytest.raises(ConfigurationError, match=r"AsyncRun\.MaxAttempts"):
        Runtime(Settings.model_validate(sections))


def test_an_unknown_workflow_is_left_for_a_worker_that_knows_it(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    run_id = start(runtime, "not-here", {})

    assert runtime.executor.execute(run_id) == "released"
    run = run_of(runtime, run_id)
    assert run.status == "Queued" and run.owner is None
    assert "RunReleased" in types(runtime, run_id)


RECONCILE = {"Enabled": True, "HeartbeatInterval": "00:00:00.200", "OrphanThreshold": "00:00:05"}


def _orphan(runtime: Runtime, run_id: str, checkpointed: tuple[str, ...] = ()) -> None:
    """The run was claimed by a worker that committed the `checkpointed` step nodes and then
    died (its heartbeat is ten minutes old)."""
    claim = claim_run(runtime, run_id, "dead-worker")
    assert claim is not None
    for node in checkpointed:
        data = {"node": node, "kind": "step"}
        runtime.workflow_store.checkpoint(claim, node, "step", node.split("#")[0], data)
    with runtime.db.write() as session:
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(heartbeat_at=runtime.db.now() - timedelta(minutes=10))
        )


def queued(runtime: Runtime, name: str, payload: dict[str, Any]) -> str:
    """A workflow run submitted with `Prefer: respond-async`: its job owns it."""
    tenant = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant, name, payload, kind="workflow", session_id="s", resumable=True)
    return runtime.runs.create(new).id


def test_without_resume_a_job_attempt_runs_the_workflow_again_from_its_first_node(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(
        make_runtime, sql_url, RunReconciliation=RECONCILE, AsyncRun={"MaxAttempts": 2}
    )
    first = queued(runtime, "three-nodes", {})
    _orphan(runtime, first, checkpointed=("node-1#1",))

    # When the orphan scan finds the job's first attempt silent
    second = runtime.reconciler.scan_once(runtime.db.now()).continued[first]

    # Then the job attempts it again as a new run, from the start: no checkpoint answers
    interrupted = run_of(runtime, first)
    assert (interrupted.status, interrupted.error_type) == ("Failed", "restarted")
    attempt = run_of(runtime, second)
    assert (attempt.attempt, attempt.continued_from_run_id, attempt.resumable) == (2, first, True)
    assert runtime.executor.execute(second) == "Completed"
    assert workflows.ran == ["node-1", "node-2", "node-3"]  # node 1 ran again
    assert "WorkflowNodeReplayed" not in types(runtime, second)


def test_without_resume_a_queued_run_s_job_gets_async_run_max_attempts(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(
        make_runtime, sql_url, RunReconciliation=RECONCILE, AsyncRun={"MaxAttempts": 2}
    )
    first = queued(runtime, "three-nodes", {})
    _orphan(runtime, first, checkpointed=("node-1#1",))

    # The job's first attempt was interrupted: it has a second one, from the start
    second = runtime.reconciler.scan_once(runtime.db.now()).continued[first]
    assert run_of(runtime, first).error_type == "restarted"
    assert run_of(runtime, second).attempt == 2

    # The second attempt is interrupted too: the job's attempts are exhausted
    _orphan(runtime, second)
    result = runtime.reconciler.scan_once(runtime.db.now())
    assert result.continued == {} and result.orphaned == [second]
    assert (run_of(runtime, second).status, run_of(runtime, second).error_type) == (
        "Failed",
        "orphaned",
    )
    failed = [e.data for e in runtime.runs.events(second) if e.type == "JobFailed"]
    assert failed == [{"error": "tracon.job.attempts-exhausted", "attempts": 2}]


JOB_ATTEMPTS = {"AsyncRun": {"MaxAttempts": 2}}
RESUMES = {
    "Workflows": {
        "EnableCheckpointing": True,
        "ResumeInterruptedRuns": True,
        "MaxResumeAttempts": 1,
    }
}


@pytest.mark.parametrize(
    ("sections", "nodes_run"),
    [
        (JOB_ATTEMPTS, ["load-order", "load-order", "finish"]),  # from the start
        (RESUMES, ["load-order", "finish"]),  # from the latest checkpoint
    ],
    ids=["job-attempts", "resume"],
)
def test_an_answer_does_not_use_up_the_job_s_attempts(
    make_runtime: MakeRuntime, sql_url: str, sections: dict[str, Any], nodes_run: list[str]
) -> None:
    runtime = runtime_for(make_runtime, sql_url, RunReconciliation=RECONCILE, **sections)
    first = queued(runtime, "review", {"orderId": "A-1"})
    assert runtime.executor.execute(first) == "Waiting"

    # Given the person answered, and the worker running the answer's run died
    answered = runtime.workflow_resumes.respond(
        run_of(runtime, first), {"text": "send it"}, resumable=True
    )
    assert answered.attempt == 1  # an answer is no attempt of the job
    _orphan(runtime, answered.id)

    # When the orphan scan finds it silent
    result = runtime.reconciler.scan_once(runtime.db.now())

    # Then its job attempts it again (it was never retried), and the answer is kept
    assert "JobFailed" not in types(runtime, answered.id)
    again = result.continued[answered.id]
    assert run_of(runtime, again).attempt == 2
    assert runtime.executor.execute(again) == "Completed"
    assert run_of(runtime, again).output == {"result": {"reply": "A-1: send it"}}
    assert workflows.ran == nodes_run


def test_an_operator_resume_does_not_use_up_the_job_s_attempts(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, RunReconciliation=RECONCILE, **RESUMES)
    first = queued(runtime, "three-nodes", {})
    _orphan(runtime, first)
    runtime.runs.close_orphan(
        run_of(runtime, first),
        RunStatus.FAILED,
        RunError("orphaned", ErrorClass.INFRASTRUCTURE, "closed by hand"),
        runtime.db.now(),
    )
    resumed = runtime.workflow_resumes.resume(run_of(runtime, first), resumable=True)
    assert resumed.attempt == 1
    _orphan(runtime, resumed.id)

    result = runtime.reconciler.scan_once(runtime.db.now())

    assert resumed.id in result.continued and "JobFailed" not in types(runtime, resumed.id)


def test_a_run_bound_to_a_connection_is_never_resumed_automatically(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    resume = {"EnableCheckpointing": True, "ResumeInterruptedRuns": True, "MaxResumeAttempts": 5}
    runtime = runtime_for(make_runtime, sql_url, RunReconciliation=RECONCILE, Workflows=resume)
    tenant = runtime.tenants.ensure_tenant("acme")
    bound = runtime.runs.create(
        NewRun(tenant, "three-nodes", {}, kind="workflow", session_id="s", resumable=False)
    ).id
    _orphan(runtime, bound)

    result = runtime.reconciler.scan_once(runtime.db.now())

    assert result.continued == {} and run_of(runtime, bound).error_type == "orphaned"


def test_without_checkpointing_nothing_is_checkpointed_and_a_continuation_replays_nothing(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, Workflows={"EnableCheckpointing": False})
    first = start(runtime, "review", {"orderId": "A-1"})
    assert runtime.executor.execute(first) == "Waiting"

    # Then only the question is written: no node's result
    with runtime.db.read() as session:
        rows = session.scalars(select(WorkflowNode).where(WorkflowNode.run_id == first)).all()
    assert [(row.node, row.kind, row.status) for row in rows] == [
        ("approve-reply#1", "ask", "asked")
    ]
    assert types(runtime, first).count("WorkflowNodeCompleted") == 2

    # When the person answers, the continuation runs every node again; the answer is kept
    second = runtime.workflow_resumes.respond(
        run_of(runtime, first), {"text": "send it"}, resumable=False
    )
    assert runtime.executor.execute(second.id) == "Completed"
    assert run_of(runtime, second.id).output == {"result": {"reply": "A-1: send it"}}
    assert workflows.ran == ["load-order", "load-order", "finish"]
    replayed = [
        e.data["node"] for e in runtime.runs.events(second.id) if e.type == "WorkflowNodeReplayed"
    ]
    assert replayed == ["approve-reply#1"]  # only the answer
    children = [r for r in runtime.runs.tree(second.id, second.tenant_id) if r.id != second.id]
    assert [r.agent for r in children] == ["demo"]  # the agent node ran again


def test_without_checkpointing_an_operator_resume_runs_every_node_again(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    off = {"EnableCheckpointing": False}
    runtime = runtime_for(make_runtime, sql_url, Workflows=off, AgentGraph={"MaxTotalCost": 0.5})
    first = start(runtime, "paid", {"amount": 0.2})
    _orphan(runtime, first)
    runtime.runs.close_orphan(
        run_of(runtime, first),
        RunStatus.FAILED,
        RunError("orphaned", ErrorClass.INFRASTRUCTURE, "closed by hand"),
        runtime.db.now(),
    )

    raised = runtime_for(make_runtime, sql_url, Workflows=off, AgentGraph={"MaxTotalCost": 5})
    failed = run_of(raised, first)
    resumed = raised.workflow_resumes.resume(failed, resumable=False)
    assert raised.executor.execute(resumed.id) == "Completed"
    assert workflows.ran == ["first", "second", "store"]
    assert "WorkflowNodeReplayed" not in types(raised, resumed.id)


def test_a_database_failure_while_a_workflow_run_prepares_ends_the_run(
    make_runtime: MakeRuntime, postgres_url: str | None
) -> None:
    # Given a claimed run, and the server dropping every idle connection as it prepares
    # (a restart; `Database.OutageRetry` is 1 ms, so the outage outlasts it)
    if postgres_url is None:
        pytest.skip("no PostgreSQL server (set TRACON_TEST_POSTGRES_URL)")
    database = {"Url": postgres_url, "OutageRetry": "00:00:00.001"}
    runtime = runtime_for(make_runtime, postgres_url, Database=database)
    run_id = start(runtime, "three-nodes", {})
    claim, run, signal = _claimed(runtime, run_id)
    runtime.runs.settle(claim)
    drop_idle_connections(postgres_url)

    # When the runner prepares the run
    status = runtime.workflow_runner.run(claim, run, signal)

    # Then the run ends Failed with the error at once, instead of waiting for the orphan scan
    assert status == "Failed"
    failed = run_of(runtime, run_id)
    assert (failed.status, failed.error_type, failed.error_class) == (
        "Failed",
        "database_error",
        "Infrastructure",
    )
    assert "AdminShutdown" in (failed.error_message or "")  # the server's own error
    assert workflows.ran == []
