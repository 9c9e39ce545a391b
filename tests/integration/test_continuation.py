"""Continuation chains through the executor on real SQL (both backends) and Redis: a chain
interrupted more than once, where a later run resolved a call an earlier one had in flight,
and the stop rule (a continuation stops when it leaves what the chain recorded without
repeating the call whose outcome is unknown) whatever else the model does. The chains are
written as a killed worker leaves them: ledger rows, then an orphan scan."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests import tools
from tests.helpers import MakeRuntime, Script, claim_run, run_of, scripted_agent
from tests.helpers import event_types as types
from tests.integration.test_durability import RECONCILE, STEPS, new_run, orphan_midway
from tracon_jobs.db.models import Run, ToolCallRecord
from tracon_jobs.runs.continuation import chain_ledger
from tracon_jobs.runs.ledger import LedgerEntry, ToolOutcome, arguments_hash
from tracon_jobs.runs.lifecycle import Claim
from tracon_jobs.runtime import Runtime

SLOW: dict[str, Any] = {"Name": "slow_step", "Arguments": {"seconds": 0}}
LOOKUP: dict[str, Any] = {"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}
RECORD_B: dict[str, Any] = {"Name": "record_step", "Arguments": {"step": "B"}}


@pytest.fixture(autouse=True)
def _clean_tool_records() -> None:
    tools.calls.clear()


def chain_runtime(
    make_runtime: MakeRuntime, url: str, script: Script, fallback: Script | None = None
) -> Runtime:
    """Continuation on, twice per chain, for agent `demo` on `script` (then on `fallback`
    after a transient failure), with sub-agent `helper`."""
    config = scripted_agent(script, ["record_step", "slow_step", "lookup_order", "close_account"])
    config["Providers"]["helper"] = {"Kind": "scripted", "Script": [{"Text": "helped"}]}
    config["Agents"]["helper"] = {"Model": {"provider": "helper", "model": "demo-model"}}
    config["Agents"]["demo"]["SubAgents"] = ["helper"]
    if fallback is not None:
        config["Providers"]["backup"] = {"Kind": "scripted", "Script": fallback}
        config["Agents"]["demo"]["Model"]["fallbacks"] = [
            {"provider": "backup", "model": "demo-model"}
        ]
    return make_runtime(
        url,
        sender=lambda _run_id: None,
        RunReconciliation=RECONCILE,
        RunContinuation={"Enabled": True, "MaxAttempts": 2},
        **config,
    )


def killed_in(runtime: Runtime, run_id: str) -> Claim:
    """Claim the run as a worker that is about to die; its claim."""
    claim = claim_run(runtime, run_id, "doomed-worker")
    assert claim is not None
    return claim


def start(
    runtime: Runtime,
    claim: Claim,
    turn: int,
    call: dict[str, Any],
    key: str | None = None,
    position: int = 0,
) -> LedgerEntry:
    """A ledger row `started` for `call`, as the worker wrote it right before the body."""
    call_id = f"call_{turn}_{position}"
    return runtime.executor.ledger.start(claim, turn, call_id, call["Name"], call["Arguments"], key)


def continued(runtime: Runtime, run_id: str) -> str:
    """The orphan scan closes the silent run and continues it; the continuation's id."""
    scan_at = runtime.db.now() + timedelta(minutes=10)
    return str(runtime.reconciler.scan_once(scan_at).continued[run_id])


def keys_of(runtime: Runtime, run_id: str, tool: str) -> list[str]:
    with runtime.db.read() as session:
        rows = session.query(ToolCallRecord).filter(
            ToolCallRecord.run_id == run_id, ToolCallRecord.tool == tool
        )
        return [row.idempotency_key for row in rows]


def ended(runtime: Runtime, run_id: str) -> tuple[str, str | None]:
    run: Run = run_of(runtime, run_id)
    return run.status, run.error_type


# -- a chain interrupted twice ----------------------------------------------------------------


def test_a_call_in_flight_in_two_runs_of_the_chain_is_repeated_once_and_the_chain_completes(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a run killed with a read in flight, and its continuation killed in the same read
    # (repeated with its key)
    runtime = chain_runtime(make_runtime, sql_url, [{"ToolCalls": [SLOW]}, {"Text": "all done"}])
    first = new_run(runtime, session_id="s1")
    key = start(runtime, killed_in(runtime, first.id), 0, SLOW).idempotency_key
    second = continued(runtime, first.id)
    start(runtime, killed_in(runtime, second), 0, SLOW, key)
    third = continued(runtime, second)

    # When the second continuation repeats the read once more, and answers
    runtime.executor.execute(third)

    # Then the read ran with its key and the chain completed: it was one call, in flight twice
    assert ended(runtime, third) == ("Completed", None), run_of(runtime, third).error_message
    assert run_of(runtime, third).output == {"text": "all done"}
    assert keys_of(runtime, third, "slow_step") == [key]


def test_a_call_a_later_run_of_the_chain_resolved_is_not_in_flight_any_more(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a run killed with a read in flight; its continuation repeated the read with its
    # key (it succeeded), then was killed with another read in flight
    script: Script = [{"ToolCalls": [LOOKUP]}, {"ToolCalls": [SLOW]}, {"Text": "all done"}]
    runtime = chain_runtime(make_runtime, sql_url, script)
    first = new_run(runtime, session_id="s1")
    lookup_key = start(runtime, killed_in(runtime, first.id), 0, LOOKUP).idempotency_key
    second = continued(runtime, first.id)
    claim = killed_in(runtime, second)
    resolved = start(runtime, claim, 0, LOOKUP, lookup_key)
    runtime.executor.ledger.finish(claim, resolved, "lookup_order", ToolOutcome(ok=True, result={}))
    slow_key = start(runtime, claim, 1, SLOW).idempotency_key
    third = continued(runtime, second)

    # When the second continuation replays the chain: the lookup answered, the read repeated
    runtime.executor.execute(third)

    # Then it completes; the lookup the chain resolved was not taken for a call in flight
    assert ended(runtime, third) == ("Completed", None), run_of(runtime, third).error_message
    assert [name for name, _arguments in tools.calls] == [], "the lookup was answered, not rerun"
    assert keys_of(runtime, third, "slow_step") == [slow_key]
    assert "ToolCallAnsweredFromLedger" in types(runtime, third)


def test_chain_ledger_keeps_one_call_in_flight_once_and_a_resolved_one_not_at_all(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a run killed in a turn of two concurrent reads, and its continuation killed
    # after one of them succeeded (repeated with its key) and the other did not end again
    runtime = chain_runtime(make_runtime, sql_url, [{"Text": "unused"}])
    first = new_run(runtime, session_id="s1")
    claim = killed_in(runtime, first.id)
    slow_key = start(runtime, claim, 0, SLOW).idempotency_key
    lookup_key = start(runtime, claim, 0, LOOKUP, position=1).idempotency_key
    second = continued(runtime, first.id)
    claim = killed_in(runtime, second)
    start(runtime, claim, 0, SLOW, slow_key)
    resolved = start(runtime, claim, 0, LOOKUP, lookup_key, position=1)
    runtime.executor.ledger.finish(claim, resolved, "lookup_order", ToolOutcome(ok=True, result={}))
    third = run_of(runtime, continued(runtime, second))

    # When the second continuation reads its chain
    ledger = chain_ledger(runtime.db, third)

    # Then the read in flight twice is one call in flight, and the resolved one is recorded
    slow = ("slow_step", arguments_hash(SLOW["Arguments"]))
    lookup = ("lookup_order", arguments_hash(LOOKUP["Arguments"]))
    assert {key: list(keys) for key, keys in ledger.in_flight.items() if keys} == {slow: [slow_key]}
    assert [outcome.ok for _id, outcome in ledger.recorded[lookup]] == [True]
    assert ledger.run_ids == [second, first.id]


# -- the stop rule, whatever the model does ---------------------------------------------------


@pytest.mark.parametrize(
    "script",
    [
        [{"ToolCalls": [RECORD_B]}, {"Text": "all done"}],
        [{"ToolCalls": [RECORD_B]}, {"ToolCalls": [SLOW]}, {"Text": "all done"}],
        [{"ToolCalls": [*STEPS[0]["ToolCalls"], LOOKUP]}, {"ToolCalls": [SLOW]}, {"Text": "done"}],
    ],
    ids=["other-arguments-then-answer", "other-arguments-then-the-call", "a-call-added"],
)
def test_a_continuation_that_leaves_the_record_without_the_call_in_flight_stops(
    make_runtime: MakeRuntime, sql_url: str, script: Script
) -> None:
    # Given the interrupted run completed `record_step {"step": "A"}`, then died with
    # `slow_step` in flight (outcome unknown)
    runtime = chain_runtime(make_runtime, sql_url, script)
    orphan = orphan_midway(runtime)
    continuation_id = continued(runtime, orphan.id)
    tools.calls.clear()

    # When the continuation's model asks for a call the chain has no record of (the
    # completed call with other arguments, or one more call) before the call in flight
    runtime.executor.execute(continuation_id)

    # Then it stops right there, naming the call in flight, and runs nothing
    assert ended(runtime, continuation_id) == ("Failed", "continuation_blocked"), (
        f"the continuation went on: it ran {[name for name, _arguments in tools.calls]} "
        "without repeating slow_step first"
    )
    blocked = [
        e.data for e in runtime.runs.events(continuation_id) if e.type == "RunContinuationBlocked"
    ]
    assert blocked[0]["tool"] == "slow_step"
    assert tools.calls == [], "nothing past the record ran"


def test_a_continuation_that_repeated_the_call_then_waited_for_a_person_goes_on(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a continuation that repeated the call in flight, then stopped `Waiting` for the
    # approval of a gated call
    close: dict[str, Any] = {"Name": "close_account", "Arguments": {"account": "acc-1"}}
    script: Script = [{"ToolCalls": [SLOW]}, {"ToolCalls": [close]}, {"Text": "all done"}]
    runtime = chain_runtime(make_runtime, sql_url, script)
    orphan = new_run(runtime, session_id="s1")
    start(runtime, killed_in(runtime, orphan.id), 0, SLOW)
    continuation_id = continued(runtime, orphan.id)
    assert runtime.executor.execute(continuation_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(continuation_id)

    # When the person approves and it resumes in the turn it waited in
    runtime.approvals.decide(runtime.tenants.ensure_tenant("acme"), approval_id, True)
    runtime.executor.execute(continuation_id)

    # Then the call it repeated before waiting is no longer in flight: the run completes
    status = ended(runtime, continuation_id)
    assert status == ("Completed", None), run_of(runtime, continuation_id).error_message
    assert [name for name, _arguments in tools.calls] == ["close_account"]


def test_a_sub_agent_call_the_chain_completed_does_not_stop_its_replay(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a run that called its sub-agent, then died with a read in flight
    helper: dict[str, Any] = {"Name": "helper", "Arguments": {"message": "check"}}
    script: Script = [{"ToolCalls": [helper]}, {"ToolCalls": [SLOW]}, {"Text": "all done"}]
    runtime = chain_runtime(make_runtime, sql_url, script)
    orphan = new_run(runtime, session_id="s1")
    claim = killed_in(runtime, orphan.id)
    child = runtime.executor.ledger.start(claim, 0, "call_0_0", "agent:helper", helper["Arguments"])
    runtime.executor.ledger.finish(claim, child, "agent:helper", ToolOutcome(ok=True, result="ok"))
    start(runtime, claim, 1, SLOW)
    continuation_id = continued(runtime, orphan.id)

    # When the continuation replays the sub-agent call, then repeats the read
    runtime.executor.execute(continuation_id)

    # Then it completes
    status = ended(runtime, continuation_id)
    assert status == ("Completed", None), run_of(runtime, continuation_id).error_message


# -- the chain's record on every fallback link ------------------------------------------------


def test_a_fallback_link_of_a_continuation_reads_the_chains_record_again(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a continuation whose link 1 replays the write the chain completed, then fails
    runtime = chain_runtime(make_runtime, sql_url, [STEPS[0], {"ErrorStatus": 503}], STEPS)
    orphan = orphan_midway(runtime)
    continuation_id = continued(runtime, orphan.id)
    tools.calls.clear()

    # When link 2 starts the conversation over and replays the same write
    runtime.executor.execute(continuation_id)

    # Then the chain's record answers it on link 2 too: the write never runs again
    status = ended(runtime, continuation_id)
    assert status == ("Completed", None), run_of(runtime, continuation_id).error_message
    assert tools.calls == [], "the completed write ran again"
    assert types(runtime, continuation_id).count("ToolCallAnsweredFromLedger") == 2
