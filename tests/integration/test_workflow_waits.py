"""Workflows that wait on the world, in one process over real SQL (both backends) and Redis:
a durable timer continues the chain once when it is due (and not before, and not after a
cancel); an event is taken whether it comes before, during or after its wait, once; a
wait's timeout answers `TIMED_OUT`; and without `Workflows.BufferEvents` an event nobody
waits for is refused."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from tests import workflows
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.helpers import event_types as types
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.workflows.store import RequestConflict


@pytest.fixture(autouse=True)
def _clean() -> None:
    workflows.ran.clear()


def runtime_for(make_runtime: MakeRuntime, sql_url: str, **sections: Any) -> Runtime:
    config = scripted_agent([{"Text": "ok"}])
    config["WorkflowModules"] = ["tests.workflows"]
    config["Workflows"] = {"EnableCheckpointing": True}
    config.update(sections)
    return make_runtime(sql_url, sender=lambda _run_id: None, **config)


def start(runtime: Runtime, name: str, payload: dict[str, Any]) -> str:
    tenant_id = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant_id=tenant_id, agent=name, kind="workflow", input=payload, session_id="s")
    return runtime.runs.create(new).id


def continued(runtime: Runtime, run_id: str) -> str:
    """The run that continues `run_id`'s chain, from the run's output."""
    output = run_of(runtime, run_id).output or {}
    return str(output["continuedIn"])


def test_a_timer_waits_without_a_worker_and_fires_once_when_due(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "nap", {"seconds": 60})

    # Given a workflow that ran a node and sleeps for a minute
    assert runtime.executor.execute(first) == "Waiting"
    waiting = run_of(runtime, first)
    assert waiting.owner is None and workflows.ran == ["before-nap"]
    assert types(runtime, first)[-2:] == ["WorkflowTimerStarted", "RunWaiting"]
    resumes = runtime.workflow_resumes

    # When the timer scan looks before its time, nothing fires
    assert resumes.fire_due(runtime.db.now()) == 0
    assert run_of(runtime, first).status == "Waiting"

    # When it looks after its time, twice (two passes racing, or a beat restarted)
    later = runtime.db.now() + timedelta(seconds=61)
    assert resumes.fire_due(later) == 1
    assert resumes.fire_due(later) == 0

    # Then one run continues the chain, replays the first node and runs the second
    second = continued(runtime, first)
    assert runtime.executor.execute(second) == "Completed"
    assert run_of(runtime, second).output == {"result": "rested"}
    assert workflows.ran == ["before-nap", "after-nap"]


def test_a_pass_that_looks_ahead_answers_a_timer_at_its_time_not_at_the_next_tick(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a workflow asleep for one second, and one asleep for a minute
    runtime = runtime_for(make_runtime, sql_url)
    soon, later = start(runtime, "nap", {"seconds": 1}), start(runtime, "nap", {"seconds": 60})
    assert runtime.executor.execute(soon) == "Waiting"
    assert runtime.executor.execute(later) == "Waiting"
    [timer] = [e for e in runtime.runs.events(soon) if e.type == "WorkflowTimerStarted"]
    # its time as the wait recorded it (the event's own time is read a moment later)
    due = datetime.fromisoformat(timer.data["until"].removesuffix("Z"))

    # When a pass begins before its time, looking two seconds ahead
    began = runtime.db.now()
    assert began < due
    assert runtime.workflow_resumes.fire_due(began, timedelta(seconds=2)) == 1

    # Then it answered the first at its time (not before), in this pass (the count above); the
    # other sleeps on. The bound after is the answer's own time, which a loaded machine has
    # stretched past half a second: it only rules out a wait of a whole further look-ahead.
    woke = run_of(runtime, continued(runtime, soon)).created_at
    assert due <= woke < due + timedelta(seconds=1.5), (due, woke)
    assert run_of(runtime, later).status == "Waiting"


def test_a_canceled_sleeper_never_wakes(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "nap", {"seconds": 1})
    assert runtime.executor.execute(first) == "Waiting"

    rt = runtime  # as the API's cancel does
    cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, run_of(rt, first), rt.dispatcher.done)

    assert run_of(runtime, first).status == "Canceled"
    assert runtime.workflow_resumes.fire_due(runtime.db.now() + timedelta(seconds=5)) == 0
    assert (run_of(runtime, first).output or {}).get("continuedIn") is None


@pytest.mark.parametrize("when", ["before", "during"])
def test_an_event_reaches_its_wait_whether_it_comes_before_or_during_it(
    make_runtime: MakeRuntime, sql_url: str, when: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "await-payment", {})
    resumes = runtime.workflow_resumes
    if when == "before":  # the run has not even started
        kept = resumes.deliver(run_of(runtime, first), "paid", {"amount": 40})
        assert kept.kept and kept.run.id == first
        assert runtime.workflow_store.kept_events(first, "paid") == 1
        # the wait takes it at once: the run completes without waiting
        assert runtime.executor.execute(first) == "Completed"
        assert run_of(runtime, first).output == {"result": {"order": "A-1", "paid": {"amount": 40}}}
        assert runtime.workflow_store.kept_events(first) == 0
        return
    assert runtime.executor.execute(first) == "Waiting"
    delivered = resumes.deliver(run_of(runtime, first), "paid", {"amount": 40})
    assert not delivered.kept and delivered.run.id == continued(runtime, first)
    assert runtime.executor.execute(delivered.run.id) == "Completed"
    result = run_of(runtime, delivered.run.id).output
    assert result == {"result": {"order": "A-1", "paid": {"amount": 40}}}
    assert workflows.ran == ["open-order"]  # replayed, not run again
    # a second event of that name is kept for a wait that will never come: the chain ended
    with pytest.raises(RequestConflict, match="Completed"):
        resumes.deliver(run_of(runtime, first), "paid", {"amount": 41})


def test_an_event_kept_while_its_wait_was_written_is_given_to_it(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given an event kept for a chain whose run then starts waiting for it (the race: the
    # delivery looked before the wait was committed, the wait before the event was)
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "await-payment", {})
    run = run_of(runtime, first)
    store = runtime.workflow_store
    store.keep_event(run.tenant_id, first, "paid", {"amount": 7})
    given: list[str] = []
    runner = runtime.workflow_runner
    runner.event_waited = given.append  # the wait commits, then looks (here: later)
    original = store.take_event
    store.take_event = lambda *args: None  # type: ignore[method-assign]  # it looked too early
    assert runtime.executor.execute(first) == "Waiting"
    store.take_event = original  # type: ignore[method-assign]

    # When the wait's side looks after its commit
    assert given == [first]
    taken = runtime.workflow_resumes.give_kept_event(first)

    # Then the kept event answers it, once
    assert taken is not None and taken.id == continued(runtime, first)
    assert runtime.workflow_resumes.give_kept_event(first) is None
    assert runtime.executor.execute(taken.id) == "Completed"
    assert run_of(runtime, taken.id).output == {"result": {"order": "A-1", "paid": {"amount": 7}}}


def test_a_waits_timeout_answers_timed_out_and_a_late_event_is_kept(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "await-payment", {"timeout": 30})
    assert runtime.executor.execute(first) == "Waiting"
    resumes = runtime.workflow_resumes

    assert resumes.fire_due(runtime.db.now()) == 0
    assert resumes.fire_due(runtime.db.now() + timedelta(seconds=31)) == 1
    second = continued(runtime, first)
    assert runtime.executor.execute(second) == "Completed"
    assert run_of(runtime, second).output == {"result": {"order": "A-1", "paid": None}}


def test_without_buffering_an_event_nobody_waits_for_is_refused(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(
        make_runtime, sql_url, Workflows={"EnableCheckpointing": True, "BufferEvents": False}
    )
    first = start(runtime, "await-payment", {})
    with pytest.raises(RequestConflict, match="BufferEvents is off"):
        runtime.workflow_resumes.deliver(run_of(runtime, first), "paid", 1)
    assert runtime.workflow_store.kept_events(first) == 0
    # and once it waits, the event is taken
    assert runtime.executor.execute(first) == "Waiting"
    delivered = runtime.workflow_resumes.deliver(run_of(runtime, first), "paid", 1)
    assert not delivered.kept


def test_an_event_stranded_by_a_worker_dying_after_its_wait_is_given_by_the_timer_scan(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given an event kept for a chain whose run then waits for it, and whose worker died
    # between committing the wait and looking for kept events (nobody looks again)
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "await-payment", {})
    other = start(runtime, "await-payment", {})
    run = run_of(runtime, first)
    store = runtime.workflow_store
    store.keep_event(run.tenant_id, first, "paid", {"amount": 5})
    store.keep_event(run.tenant_id, other, "refunded", {"amount": 1})  # not what it waits for
    runtime.workflow_runner.event_waited = None  # died before its look
    original = store.take_event
    store.take_event = lambda *args: None  # type: ignore[method-assign]  # it looked too early
    assert runtime.executor.execute(first) == "Waiting"
    assert runtime.executor.execute(other) == "Waiting"
    store.take_event = original  # type: ignore[method-assign]
    resumes = runtime.workflow_resumes

    # When the timer scan passes, at once (the worker's own look may still come) and later
    assert resumes.fire_due(runtime.db.now()) == 0
    later = runtime.db.now() + timedelta(seconds=3)
    assert resumes.fire_due(later) == 1
    assert resumes.fire_due(later) == 0

    # Then the kept event answered the stranded wait, once; the other run still waits
    second = continued(runtime, first)
    assert runtime.executor.execute(second) == "Completed"
    assert run_of(runtime, second).output == {"result": {"order": "A-1", "paid": {"amount": 5}}}
    assert run_of(runtime, other).status == "Waiting"
    assert store.kept_events(other) == 1


def test_a_wait_written_after_its_event_was_kept_takes_it_in_the_same_execution(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given an event kept for a chain whose wait looked for it just before it was kept
    runtime = runtime_for(make_runtime, sql_url)
    first = start(runtime, "await-payment", {})
    store = runtime.workflow_store
    original = store.take_event

    def too_early(*args: Any) -> Any:  # the wait looks, then the event is kept
        taken = original(*args)
        store.keep_event(run_of(runtime, first).tenant_id, first, "paid", {"amount": 9})
        return taken

    store.take_event = too_early  # type: ignore[method-assign,assignment]

    # When the run writes its wait (the runtime's own look after the commit follows)
    assert runtime.executor.execute(first) == "Waiting"

    # Then the kept event answered the wait at once: the chain goes on with it
    second = continued(runtime, first)
    assert runtime.workflow_store.kept_events(first) == 0
    assert runtime.executor.execute(second) == "Completed"
    assert run_of(runtime, second).output == {"result": {"order": "A-1", "paid": {"amount": 9}}}
