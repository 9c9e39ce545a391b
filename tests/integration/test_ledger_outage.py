"""A tool call's ledger row through a database that fails as it commits (a primary failing
over): the try whose commit landed, though its caller saw only a dropped connection, stands,
and the next try neither fails on it nor writes it twice. Without such a failure, a row that
is in the way is still an error."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

from tests.helpers import MakeRuntime, claim_run, scripted_agent
from tests.integration.test_write_outage import dropped_after_the_commit
from tracon_jobs.runs.ledger import Ledger, ToolOutcome
from tracon_jobs.runs.lifecycle import Claim
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url, **scripted_agent([]))


def claimed(runtime: Runtime) -> tuple[Claim, Ledger]:
    """A new run claimed as a worker would, and the ledger its tool calls go in."""
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"})).id
    claim = claim_run(runtime, run_id, "worker-1")
    assert claim is not None
    return claim, Ledger(runtime.runs)


def started_events(runtime: Runtime, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in runtime.runs.events(run_id) if e.type == "ToolCallStarted"]


def test_a_start_whose_commit_landed_stands_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim, ledger = claimed(runtime)
    failed = dropped_after_the_commit(runtime, monkeypatch)

    entry = ledger.start(claim, 0, "call_0_0", "slow_step", {"seconds": 1})

    assert failed == [1]  # the first try committed, then failed
    [row] = ledger.calls(claim.run_id)
    assert (row.id, row.execution_id, row.idempotency_key) == (
        entry.id,
        entry.execution_id,
        entry.idempotency_key,
    )
    assert [e["executionId"] for e in started_events(runtime, claim.run_id)] == [entry.execution_id]


def test_a_start_with_an_approval_whose_commit_landed_stands_and_uses_it_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim, ledger = claimed(runtime)
    uses: list[int] = []

    def consume(_session: Any) -> bool:  # an approval that one execution may use
        uses.append(1)
        return len(uses) == 1

    failed = dropped_after_the_commit(runtime, monkeypatch)
    entry = ledger.start(
        claim, 0, "call_0_0", "wipe", {}, execution_id="approved-1", consume=consume
    )

    assert failed == [1] and len(uses) == 2  # the retry found it used: by the landed try
    assert entry.execution_id == "approved-1"
    assert [r.execution_id for r in ledger.calls(claim.run_id)] == ["approved-1"]


def test_a_refusal_whose_commit_landed_stands_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim, ledger = claimed(runtime)
    failed = dropped_after_the_commit(runtime, monkeypatch)
    outcome = ToolOutcome(ok=False, error_code="BUDGET", error_message="spent")

    ledger.refuse(claim, 0, "call_0_0", "slow_step", {}, outcome)

    assert failed == [1]
    [row] = ledger.calls(claim.run_id)
    assert row.status == "failed"
    failed_events = [e for e in runtime.runs.events(claim.run_id) if e.type == "ToolCallFailed"]
    assert len(failed_events) == 1


def test_without_a_failed_try_a_row_in_the_way_is_still_an_error(runtime: Runtime) -> None:
    claim, ledger = claimed(runtime)
    ledger.start(claim, 0, "call_0_0", "slow_step", {})

    with pytest.raises(IntegrityError):
        ledger.start(claim, 0, "call_0_0", "slow_step", {})
    assert len(ledger.calls(claim.run_id)) == 1
