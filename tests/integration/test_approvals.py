"""Approvals in one process over real SQL (both backends) and Redis: a gated call stops the
run `Waiting` before its body runs; a decision (once) continues the same run row; rejection,
expiry and cancel answer the model instead; an approval is consumed at most once."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from tests import tools
from tests.helpers import MakeRuntime, Script, scripted_agent
from tests.helpers import event_types as types
from tracon_jobs.runs.approvals import ApprovalConflict, ApprovalNotFound
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]


def submit(runtime: Runtime, tenant: str = "acme") -> str:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    return runtime.runs.create(
        NewRun(tenant_id=tenant_id, agent="demo", input={"message": "go"})
    ).id


def closes() -> list[dict[str, object]]:
    return [arguments for name, arguments in tools.calls if name == "close_account"]


def tool_result(runtime: Runtime, run_id: str) -> Any:
    run = runtime.runs.get(run_id)
    assert run is not None and run.messages is not None
    return [m["content"] for m in run.messages if m["role"] == "tool"]


@pytest.fixture(autouse=True)
def _clean_tool_records() -> None:
    tools.calls.clear()
    tools.refund_attempts.clear()


def waiting(make_runtime: MakeRuntime, sql_url: str, **sections: Any) -> tuple[Runtime, str, str]:
    """Given a run stopped `Waiting` for one approval: (runtime, run id, approval id)."""
    config = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"])
    config.update(sections)
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    return runtime, run_id, approval_id


def test_a_gated_tool_stops_the_run_before_its_body(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime, run_id, approval_id = waiting(make_runtime, sql_url)

    run = runtime.runs.get(run_id)
    assert run is not None and run.status == "Waiting"
    assert run.owner is None and run.heartbeat_at is None  # holds no worker
    assert closes() == []
    assert types(runtime, run_id)[-2:] == ["ApprovalRequested", "RunWaiting"]
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.status == "Pending"
    assert (approval.tool, approval.arguments) == ("close_account", {"account": "acc-1"})
    assert approval.expires_at - approval.requested_at == timedelta(days=1)
    assert (
        runtime.runs.orphans(runtime.db.now() + timedelta(days=3), timedelta(seconds=1), 10) == []
    )


def test_a_configured_gate_stops_a_tool_registered_without_one(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "charge_card", "Arguments": {"amount_cents": 500}}]},
        {"Text": "Charged."},
    ]
    config = scripted_agent(script, ["charge_card"])
    config["Agents"]["demo"]["RequireApproval"] = ["charge_card"]
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    tools.charges.clear()
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Waiting"
    assert tools.charges == []


def test_approve_continues_the_same_run_and_the_body_runs_once(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime, run_id, approval_id = waiting(make_runtime, sql_url)
    sent: list[str] = []
    runtime.send_runs_with(sent.append)
    tenant = runtime.tenants.ensure_tenant("acme")

    decided = runtime.approvals.decide(tenant, approval_id, True, "ok", "key:test")

    assert decided.resumed and sent == [run_id]
    run = runtime.runs.get(run_id)
    assert run is not None and run.status == "Queued"
    assert runtime.executor.execute(run_id) == "Completed"
    assert closes() == [{"account": "acc-1"}]
    run = runtime.runs.get(run_id)
    assert run is not None and run.fence == 2 and run.output == {"text": "Done."}
    assert tool_result(runtime, run_id) == ["closed acc-1"]
    assert "ApprovalDecided" in types(runtime, run_id)
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.consumed_at is not None
    with pytest.raises(ApprovalConflict):
        runtime.approvals.decide(tenant, approval_id, False)


def test_reject_answers_the_model_and_the_run_goes_on(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime, run_id, approval_id = waiting(make_runtime, sql_url)
    tenant = runtime.tenants.ensure_tenant("acme")

    runtime.approvals.decide(tenant, approval_id, False, "not this one")

    assert runtime.executor.execute(run_id) == "Completed"
    assert closes() == []
    [content] = tool_result(runtime, run_id)
    assert "approval_rejected" in content and "not this one" in content
    assert "ToolCallFailed" in types(runtime, run_id)


def test_expiry_answers_the_model_and_a_late_decision_is_refused(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime, run_id, approval_id = waiting(
        make_runtime, sql_url, Approvals={"Timeout": "00:00:00.050"}
    )
    tenant = runtime.tenants.ensure_tenant("acme")
    threading.Event().wait(0.1)  # past expiresAt, before any expiry pass

    with pytest.raises(ApprovalConflict, match="expired"):
        runtime.approvals.decide(tenant, approval_id, True)
    expired = runtime.approvals.expire_once(runtime.db.now())

    assert [d.approval.id for d in expired] == [approval_id] and expired[0].resumed
    assert runtime.executor.execute(run_id) == "Completed"
    assert closes() == []
    assert "approval_expired" in tool_result(runtime, run_id)[0]


def test_cancel_while_waiting_is_immediate(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime, run_id, approval_id = waiting(make_runtime, sql_url)
    run = runtime.runs.get(run_id)
    assert run is not None

    reached = cancel_tree(runtime.runs, runtime.cancel_bus, runtime.approval_store, run)

    assert reached == [run_id]
    run = runtime.runs.get(run_id)
    assert run is not None and run.status == "Canceled"
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.status == "Canceled"
    with pytest.raises(ApprovalConflict):
        runtime.approvals.decide(runtime.tenants.ensure_tenant("acme"), approval_id, True)


def test_another_tenant_cannot_see_or_decide(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime, _run_id, approval_id = waiting(make_runtime, sql_url)
    other = runtime.tenants.ensure_tenant("globex")

    assert runtime.approval_store.get(approval_id, other) is None
    with pytest.raises(ApprovalNotFound):
        runtime.approvals.decide(other, approval_id, True)


def test_runtime_retries_reuse_the_approval_and_a_new_model_call_asks_again(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    script: Script = [
        {"ToolCalls": [{"Name": "approved_refund", "Arguments": {"order": "o-1"}}]},
        {"ToolCalls": [{"Name": "approved_refund", "Arguments": {"order": "o-1"}}]},
        {"Text": "Refunded twice."},
    ]
    runtime = make_runtime(
        sql_url, sender=lambda _run_id: None, **scripted_agent(script, ["approved_refund"])
    )
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = submit(runtime)

    assert runtime.executor.execute(run_id) == "Waiting"
    [first] = runtime.approval_store.pending_ids(run_id)
    runtime.approvals.decide(tenant, first, True)
    assert runtime.executor.execute(run_id) == "Waiting"  # the model called it again
    [second] = runtime.approval_store.pending_ids(run_id)
    runtime.approvals.decide(tenant, second, True)
    assert runtime.executor.execute(run_id) == "Completed"

    assert first != second
    assert len(tools.refund_attempts) == 4  # two executions, each retried once
    assert len(set(tools.refund_attempts)) == 2
    assert types(runtime, run_id).count("ApprovalRequested") == 2
    assert types(runtime, run_id).count("CapabilityRetried") == 2


def test_twenty_concurrent_decisions_one_wins(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime, _run_id, approval_id = waiting(make_runtime, sql_url)
    tenant = runtime.tenants.ensure_tenant("acme")
    outcomes: list[str] = []
    start = threading.Barrier(20)

    def decide() -> None:
        start.wait()
        try:
            runtime.approvals.decide(tenant, approval_id, True)
            outcomes.append("ok")
        except ApprovalConflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=decide) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)

    assert sorted(outcomes) == ["conflict"] * 19 + ["ok"]


def test_a_consumed_approval_never_runs_a_body_again(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime, run_id, approval_id = waiting(make_runtime, sql_url)
    runtime.approvals.decide(runtime.tenants.ensure_tenant("acme"), approval_id, True)
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None
    with runtime.db.write() as session:
        assert runtime.approval_store.consume_in(session, approval)  # another process used it

    assert runtime.executor.execute(run_id) == "Completed"
    assert closes() == []
    assert "approval_used" in tool_result(runtime, run_id)[0]


def test_the_event_says_when_the_approval_expires(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime, run_id, approval_id = waiting(make_runtime, sql_url)
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None

    [requested] = [e for e in runtime.runs.events(run_id) if e.type == "ApprovalRequested"]

    assert requested.data["approvalId"] == approval_id
    assert (
        requested.data["expiresAt"] == approval.expires_at.isoformat(timespec="milliseconds") + "Z"
    )


def test_time_spent_waiting_does_not_count_toward_max_duration(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a tree allowed 1.5 s of execution, waiting 2 s for a person
    runtime, run_id, approval_id = waiting(
        make_runtime, sql_url, AgentGraph={"MaxDuration": "00:00:01.500"}
    )
    threading.Event().wait(2.0)

    # When the person approves and the run goes on
    runtime.approvals.decide(runtime.tenants.ensure_tenant("acme"), approval_id, True)

    # Then its next model call is not refused for time it spent waiting
    assert runtime.executor.execute(run_id) == "Completed"
    run = runtime.runs.get(run_id)
    assert run is not None and run.waited_ms >= 2000
    assert closes() == [{"account": "acc-1"}]


def test_without_excluding_the_wait_the_same_tree_would_be_refused(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    """The control for the test above: a tree that really executed past MaxDuration stops."""
    script: Script = [
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 0.9}}]},
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 0.9}}]},
        {"Text": "never"},
    ]
    config = scripted_agent(script, ["slow_step"])
    runtime = make_runtime(sql_url, AgentGraph={"MaxDuration": "00:00:01.500"}, **config)

    assert runtime.executor.execute(submit(runtime)) == "Failed"
