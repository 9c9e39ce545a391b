"""The order of the steps that answer a tool call, through the executor on real SQL (both
backends) and Redis: a recorded answer (the continuation chain, then an earlier fallback
link), the tenant's quota and the tree's budget, a person's approval, the body. A person is
asked only for a call that reaches the approval step, and whether it does is decided by the
same steps, in the same order, that answer it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests import tools
from tests.helpers import MakeRuntime, Script, claim_run, run_of, scripted_agent
from tests.helpers import event_types as types
from tests.integration.test_durability import RECONCILE
from tracon_jobs.db.models import Approval
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

CLOSE = {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]}
EXPENSIVE_CLOSE = CLOSE | {"InputTokens": 5000}  # $0.005 at the demo model's price
SPENT = {
    "tree budget": ({"AgentGraph": {"MaxTotalTokens": 2000}}, "BUDGET_EXCEEDED"),
    "tenant quota": (
        {"Tenants": {"DefaultQuota": {"Period": "month", "CostLimit": 0.001}}},
        "TENANT_QUOTA_EXCEEDED",
    ),
}
"""Sections whose limit the first model call of `EXPENSIVE_CLOSE` spends, and the error code
a tool call refused by it answers the model with."""


@pytest.fixture(autouse=True)
def _clean_tool_records() -> None:
    tools.calls.clear()


def closes() -> list[dict[str, object]]:
    return [arguments for name, arguments in tools.calls if name == "close_account"]


def submit(runtime: Runtime, **fields: Any) -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.runs.create(NewRun(tenant, "demo", {"message": "go"}, **fields)).id


def tool_results(runtime: Runtime, run_id: str) -> list[str]:
    return [m["content"] for m in run_of(runtime, run_id).messages or [] if m["role"] == "tool"]


def approvals_of(runtime: Runtime, *run_ids: str) -> list[Approval]:
    with runtime.db.read() as session:
        return list(session.query(Approval).filter(Approval.run_id.in_(run_ids)))


def with_fallback(script: Script, fallback: Script, tools_: list[str]) -> dict[str, Any]:
    """Agent `demo` on scripted provider `scripted`, then on `backup` after a transient
    failure (each link starts the conversation over)."""
    config = scripted_agent(script, tools_)
    config["Providers"]["backup"] = {"Kind": "scripted", "Script": fallback}
    config["Agents"]["demo"]["Model"]["fallbacks"] = [{"provider": "backup", "model": "demo-model"}]
    return config


# -- budget before approval ---------------------------------------------------------------


@pytest.mark.parametrize("spent", SPENT.values(), ids=SPENT.keys())
def test_a_gated_call_the_budget_refuses_asks_nobody(
    make_runtime: MakeRuntime, sql_url: str, spent: tuple[dict[str, Any], str]
) -> None:
    # Given the model's first turn spends the limit, and asks for a gated call in it
    sections, code = spent
    config = scripted_agent([EXPENSIVE_CLOSE, {"Text": "Done."}], ["close_account"])
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config, **sections)
    run_id = submit(runtime)

    # When the run executes
    status = runtime.executor.execute(run_id)

    # Then the call is refused at its turn: nobody is asked to approve what cannot run
    assert status != "Waiting"
    assert approvals_of(runtime, run_id) == []
    assert "ApprovalRequested" not in types(runtime, run_id)
    assert closes() == []
    [result] = tool_results(runtime, run_id)
    assert code in result and "did not start" in result


@pytest.mark.parametrize("spent", SPENT.values(), ids=SPENT.keys())
def test_an_approved_call_on_a_limit_spent_while_it_waited_never_runs(
    make_runtime: MakeRuntime, sql_url: str, spent: tuple[dict[str, Any], str]
) -> None:
    # Given a run waiting for the approval of a call, under no limit
    sections, code = spent
    config = scripted_agent([EXPENSIVE_CLOSE, {"Text": "Done."}], ["close_account"])
    waiting = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    run_id = submit(waiting)
    assert waiting.executor.execute(run_id) == "Waiting"
    [approval_id] = waiting.approval_store.pending_ids(run_id)
    waiting.approvals.decide(waiting.tenants.ensure_tenant("acme"), approval_id, True)

    # When it resumes where the limit is lower than what the tree already spent
    limited = make_runtime(sql_url, sender=lambda _run_id: None, **config, **sections)
    limited.executor.execute(run_id)

    # Then the budget refuses the approved call: its body never runs, its approval is unused
    assert closes() == []
    [result] = tool_results(limited, run_id)
    assert code in result and "did not start" in result
    approval = limited.approval_store.get(approval_id)
    assert approval is not None and approval.consumed_at is None
    assert "ToolCallStarted" not in types(limited, run_id)


# -- a recorded answer before approval --------------------------------------------------------


def test_a_fallback_link_repeating_an_approved_call_is_answered_from_the_ledger(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given link 1 asked for a gated call, which was approved and ran, then link 1 failed
    failing: Script = [CLOSE, {"ErrorStatus": 503}]
    config = with_fallback(failing, [CLOSE, {"Text": "Done."}], ["close_account"])
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    runtime.approvals.decide(runtime.tenants.ensure_tenant("acme"), approval_id, True)

    # When link 2 asks for the same call with the same arguments
    assert runtime.executor.execute(run_id) == "Completed"

    # Then the ledger answers it: no second approval, the body ran once
    assert closes() == [{"account": "acc-1"}]
    assert [a.id for a in approvals_of(runtime, run_id)] == [approval_id]
    assert "ToolCallAnsweredFromLedger" in types(runtime, run_id)
    assert run_of(runtime, run_id).output == {"text": "Done."}


def test_a_continuations_fallback_link_repeating_an_approved_call_asks_nobody(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a run whose call was approved, killed before it used the approval, and continued
    failing: Script = [CLOSE, {"ErrorStatus": 503}]
    config = with_fallback(failing, [CLOSE, {"Text": "Done."}], ["close_account"])
    runtime = make_runtime(
        sql_url,
        sender=lambda _run_id: None,
        RunReconciliation=RECONCILE,
        RunContinuation={"Enabled": True},
        **config,
    )
    run_id = submit(runtime, session_id="s1")
    assert runtime.executor.execute(run_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    runtime.approvals.decide(runtime.tenants.ensure_tenant("acme"), approval_id, True)
    assert claim_run(runtime, run_id, "dead-worker") is not None
    scan_at = runtime.db.now() + timedelta(minutes=10)
    continuation_id = runtime.reconciler.scan_once(scan_at).continued[run_id]

    # When its link 1 uses the approval and fails, and link 2 asks for the same call
    status = runtime.executor.execute(continuation_id)

    # Then link 2's call is answered from the ledger: nobody is asked again, the body ran once
    asked = [(a.run_id, a.turn) for a in approvals_of(runtime, run_id, continuation_id)]
    assert asked == [(run_id, 0)], f"a person was asked again: {status}, approvals {asked}"
    assert (status, closes()) == ("Completed", [{"account": "acc-1"}])
    assert "ToolCallAnsweredFromLedger" in types(runtime, continuation_id)


def test_every_later_link_repeating_a_call_is_answered_from_the_ledger(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given three links, the first two failing after the same write call
    charge: dict[str, Any] = {
        "ToolCalls": [{"Name": "charge_card", "Arguments": {"amount_cents": 500}}]
    }
    config = with_fallback([charge, {"ErrorStatus": 503}], [charge, {"ErrorStatus": 503}], [])
    config["Providers"]["last"] = {"Kind": "scripted", "Script": [charge, {"Text": "Charged."}]}
    config["Agents"]["demo"]["Model"]["fallbacks"].append(
        {"provider": "last", "model": "demo-model"}
    )
    config["Agents"]["demo"]["Tools"] = ["charge_card"]
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    before = len(tools.charges)

    # When each link asks for the same charge
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Completed"

    # Then the charge ran once; links 2 and 3 read its recorded result
    assert len(tools.charges) - before == 1, f"the charge ran {len(tools.charges) - before} times"
    assert types(runtime, run_id).count("ToolCallAnsweredFromLedger") == 2
