"""A run's fenced writes through a database that fails as it commits (a primary failing over):
the try whose commit landed, though its caller saw only a dropped connection, is the outcome.
The next try does not write its event again, nor count a model call's tokens or a tool's
cost twice. A try that failed before it wrote anything is written by the next, once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any, cast

import pytest
from sqlalchemy.exc import OperationalError

from tests.helpers import MakeRuntime, claim_run, scripted_agent
from tracon_jobs.errors import ClaimedElsewhere
from tracon_jobs.runs.ledger import Ledger, ToolOutcome
from tracon_jobs.runs.lifecycle import Claim, ErrorClass, PendingClaim, RunError, RunStatus
from tracon_jobs.runs.store import NewRun, TurnSpend
from tracon_jobs.runtime import Runtime

DROPPED = OperationalError("COMMIT", None, Exception("server closed the connection"))


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url, **scripted_agent([]))


def claimed(runtime: Runtime) -> Claim:
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"})).id
    claim = claim_run(runtime, run_id, "worker-1")
    assert claim is not None
    runtime.runs.settle(claim)  # the claim made: only the write under test is left
    return claim


def open_claim(runtime: Runtime, run_id: str, owner: str) -> PendingClaim:
    """The claim read, not made: the next fenced write makes it (as a worker's first)."""
    opened = runtime.runs.open_claim(run_id, owner)
    assert opened is not None
    return opened[0]


def dropped_after_the_commit(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The next publish after a committed write fails as a dropped connection would, once:
    the write's caller sees a transient error though its transaction committed."""
    failed: list[int] = []
    publish: Callable[..., Any] = runtime.runs.publish

    def once(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            raise DROPPED
        return publish(*args, **kwargs)

    monkeypatch.setattr(runtime.runs, "publish", once)
    return failed


def dropped_before_the_write(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The next write transaction fails as it opens, once: nothing of it is written."""
    failed: list[int] = []
    db = runtime.runs.db
    for name in ("transaction", "write", "autocommit"):
        opened: Callable[..., Any] = getattr(db, name)

        @contextmanager
        def failing(opened: Callable[..., Any] = opened) -> Iterator[Any]:
            if not failed:
                failed.append(1)
                raise DROPPED
            with opened() as session:
                yield session

        monkeypatch.setattr(db, name, failing)
    return failed


Failure = Callable[[Runtime, pytest.MonkeyPatch], list[int]]


@pytest.fixture(params=[dropped_after_the_commit, dropped_before_the_write])
def failure(request: pytest.FixtureRequest) -> Failure:
    """Each way a try fails on the connection, installed by the test once its run is claimed:
    after its commit, or before it wrote anything."""
    return cast(Failure, request.param)


def of_type(runtime: Runtime, run_id: str, type_: str) -> list[dict[str, Any]]:
    return [e.data for e in runtime.runs.events(run_id) if e.type == type_]


SPEND = TurnSpend("m", input_tokens=7, output_tokens=5, cost=Decimal("0.25"), cost_source="x")


def test_an_event_is_appended_once(
    runtime: Runtime,
    monkeypatch: pytest.MonkeyPatch,
    failure: Failure,
) -> None:
    claim = claimed(runtime)
    failed = failure(runtime, monkeypatch)

    event = runtime.runs.append(claim, "ModelFallbackUsed", {"from": "a", "to": "b"})

    assert failed == [1]
    assert of_type(runtime, claim.run_id, "ModelFallbackUsed") == [{"from": "a", "to": "b"}]
    [stored] = [e for e in runtime.runs.events(claim.run_id) if e.type == "ModelFallbackUsed"]
    assert stored.seq == event.seq


def test_a_model_calls_spend_is_counted_once(
    runtime: Runtime,
    monkeypatch: pytest.MonkeyPatch,
    failure: Failure,
) -> None:
    claim = claimed(runtime)
    failed = failure(runtime, monkeypatch)

    runtime.runs.record_spend(claim, SPEND, {"callSeq": 3})

    assert failed == [1]
    assert of_type(runtime, claim.run_id, "ModelCallCompleted") == [{"callSeq": 3}]
    run = runtime.runs.get(claim.run_id)
    assert run is not None
    assert (run.input_tokens, run.output_tokens) == (7, 5)
    assert Decimal(str(run.cost_amount)) == Decimal("0.25")


def test_a_tools_cost_is_counted_once(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    claim = claimed(runtime)
    failed = dropped_after_the_commit(runtime, monkeypatch)

    runtime.runs.add_cost(claim, Decimal("1.5"), {"tool": "search", "amount": "1.5"})

    assert failed == [1]
    assert len(of_type(runtime, claim.run_id, "UsageReported")) == 1
    run = runtime.runs.get(claim.run_id)
    assert run is not None and Decimal(str(run.cost_amount)) == Decimal("1.5")


def test_events_appended_together_are_written_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = claimed(runtime)
    failed = dropped_after_the_commit(runtime, monkeypatch)

    runtime.runs.append_all(claim, [("ModelCallFailed", {"n": 1}), ("ModelCallFailed", {"n": 2})])

    assert failed == [1]
    assert of_type(runtime, claim.run_id, "ModelCallFailed") == [{"n": 1}, {"n": 2}]


def test_a_tool_calls_end_is_written_once(
    runtime: Runtime,
    monkeypatch: pytest.MonkeyPatch,
    failure: Failure,
) -> None:
    claim = claimed(runtime)
    ledger = Ledger(runtime.runs)
    entry = ledger.start(claim, 0, "call_0_0", "lookup", {"id": 1})
    failed = failure(runtime, monkeypatch)

    ledger.finish(claim, entry, "lookup", ToolOutcome(ok=True, result={"found": 1}, attempts=1))

    assert failed == [1]
    completed = of_type(runtime, claim.run_id, "ToolCallCompleted")
    assert [e["executionId"] for e in completed] == [entry.execution_id]
    [row] = ledger.calls(claim.run_id)
    assert (row.status, row.result) == ("succeeded", {"value": {"found": 1}})


def test_an_event_another_writer_took_the_seq_of_is_not_mistaken_for_ones_own(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A try that did not commit leaves its seq to the next writer: the event there is not
    this write's, which the next try writes after it."""
    claim = claimed(runtime)
    failed: list[int] = []
    transaction = runtime.runs.db.transaction

    @contextmanager
    def rolled_back_once() -> Iterator[Any]:
        failed.append(1)
        monkeypatch.setattr(runtime.runs.db, "transaction", transaction)  # the next tries'
        try:
            with transaction() as connection:
                yield connection  # the try's statements run
                raise DROPPED  # and it is rolled back, as a COMMIT that never arrived
        finally:  # another thread of the run writes at the seq the try had
            runtime.runs.append(claim, "CircuitStateChanged", {"to": "open"})

    monkeypatch.setattr(runtime.runs.db, "transaction", rolled_back_once)
    event = runtime.runs.append(claim, "ModelFallbackUsed", {"from": "a", "to": "b"})

    assert failed == [1]
    types = [e.type for e in runtime.runs.events(claim.run_id)]
    assert types[-2:] == ["CircuitStateChanged", "ModelFallbackUsed"]
    assert types.count("ModelFallbackUsed") == 1
    assert runtime.runs.events(claim.run_id)[-1].seq == event.seq


def test_a_claim_whose_commit_landed_is_this_workers(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim is one statement (its seq never seen by the caller): the next try finds the
    run claimed at its fence, by its owner, with its `RunStarted` last, and goes on with it
    instead of taking it for another worker's."""
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"})).id
    failed = dropped_after_the_commit(runtime, monkeypatch)

    event = runtime.runs.append(
        open_claim(runtime, run_id, "worker-1"), "ModelCallStarted", {"callSeq": 1}
    )

    assert failed == [1]
    assert [e.type for e in runtime.runs.events(run_id)][-2:] == ["RunStarted", "ModelCallStarted"]
    assert len(of_type(runtime, run_id, "RunStarted")) == 1
    assert runtime.runs.events(run_id)[-1].seq == event.seq


def test_a_claim_another_worker_made_is_still_theirs(
    runtime: Runtime, make_runtime: MakeRuntime, sql_url: str
) -> None:
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"})).id
    mine = open_claim(runtime, run_id, "worker-1")
    other = make_runtime(sql_url, **scripted_agent([]))  # another worker's process
    assert claim_run(other, run_id, "worker-2") is not None  # read at the same fence, made

    with pytest.raises(ClaimedElsewhere):
        runtime.runs.append(mine, "ModelCallStarted", {"callSeq": 1})


def test_a_final_write_whose_commit_landed_ends_the_run_once(
    runtime: Runtime,
    monkeypatch: pytest.MonkeyPatch,
    failure: Failure,
) -> None:
    claim = claimed(runtime)
    failed = failure(runtime, monkeypatch)

    event = runtime.runs.finish(claim, RunStatus.COMPLETED, output={"text": "done"})

    assert failed == [1]
    assert event is not None and event.type == "RunCompleted"  # not "taken away"
    assert of_type(runtime, claim.run_id, "RunCompleted") == [
        {"status": "Completed", "output": {"text": "done"}}
    ]


def test_a_final_write_of_a_run_that_ended_otherwise_is_none(runtime: Runtime) -> None:
    """The run's newest event is not this write's: nothing landed, the run is not this
    write's to end."""
    claim = claimed(runtime)
    error = RunError("internal_error", ErrorClass.INTERNAL, "gone")
    assert runtime.runs.finish(claim, RunStatus.FAILED, error=error) is not None

    assert runtime.runs.finish(claim, RunStatus.COMPLETED, output={"text": "done"}) is None
    assert of_type(runtime, claim.run_id, "RunCompleted") == []


def test_a_workflow_nodes_checkpoint_whose_commit_landed_is_written_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its node's row is unique: without this, the next try fails the run on it."""
    claim = claimed(runtime)
    failed = dropped_after_the_commit(runtime, monkeypatch)

    runtime.workflow_store.checkpoint(claim, "fetch", "step", {"rows": 3}, {"node": "fetch"})

    assert failed == [1]
    assert of_type(runtime, claim.run_id, "WorkflowNodeCompleted") == [{"node": "fetch"}]
    recorded = runtime.workflow_store.recorded([claim.run_id])
    assert recorded["fetch"].value == {"rows": 3}


def test_a_question_whose_commit_landed_puts_the_run_waiting_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two events in one transaction: both are the landed try's, published then."""
    claim = claimed(runtime)
    failed = dropped_after_the_commit(runtime, monkeypatch)

    runtime.workflow_store.ask(claim, "approve", {"amount": 10})

    assert failed == [1]
    types = [e.type for e in runtime.runs.events(claim.run_id)]
    assert types[-2:] == ["WorkflowRequestCreated", "RunWaiting"]
    assert (types.count("WorkflowRequestCreated"), types.count("RunWaiting")) == (1, 1)
    run = runtime.runs.get(claim.run_id)
    assert run is not None and run.status == "Waiting"


def test_an_event_taken_by_a_try_whose_commit_landed_is_the_answer(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event was taken by the landed try: a try made again would find none kept, and the
    run would wait for an event already consumed."""
    claim = claimed(runtime)
    run = runtime.runs.get(claim.run_id)
    assert run is not None
    store = runtime.workflow_store
    store.keep_event(run.tenant_id, claim.run_id, "paid", {"amount": 12})
    failed = dropped_after_the_commit(runtime, monkeypatch)

    taken = store.take_event(claim, "wait-paid", claim.run_id, "paid")

    assert failed == [1]
    assert taken is not None and (taken.node, taken.value) == ("wait-paid", {"amount": 12})
    assert len(of_type(runtime, claim.run_id, "WorkflowEventReceived")) == 1
    assert store.kept_events(claim.run_id) == 0
