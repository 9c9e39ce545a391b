"""Cancellation, heartbeats, reconciliation and continuation, in one process with real SQL
and Redis; times are explicit (`reconciler.scan_once(now)`), nothing sleeps for a deadline."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from tests import tools
from tests.helpers import (
    MakeRuntime,
    Script,
    ThreadWorker,
    claim_run,
    drop_idle_connections,
    event_types,
    hold_queued,
    scripted_agent,
    wait_until,
)
from tests.stub_provider import StubProvider, hang, reply, tool_call
from tracon_jobs.abort import AbortSignal
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, ToolCallRecord
from tracon_jobs.runs.ledger import ToolOutcome
from tracon_jobs.runs.lifecycle import ErrorClass, RunError, RunStatus
from tracon_jobs.runs.live import TAKEN_AWAY, LiveRuns
from tracon_jobs.runs.store import NewRun, RunStore
from tracon_jobs.runtime import Runtime
from web import create_app
from web.console.run_timeline import build_timeline

RECONCILE = {
    "Enabled": True,
    "HeartbeatInterval": "00:00:00.200",
    "OrphanThreshold": "00:00:05",
    "ScanInterval": "00:00:01",
}


def new_run(runtime: Runtime, **fields: Any) -> Run:
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.runs.create(NewRun(tenant, "demo", {"message": "go"}, **fields))


def status(runtime: Runtime, run_id: str) -> str:
    run = runtime.runs.get(run_id)
    assert run is not None
    return run.status


def set_heartbeat(runtime: Runtime, run_id: str, ago: timedelta, **values: Any) -> None:
    with runtime.db.write() as session:
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(heartbeat_at=runtime.db.now() - ago, **values)
        )


# -- cancellation -------------------------------------------------------------------------


@pytest.fixture
def web_runtime(
    make_runtime: MakeRuntime,
    sql_url: str,
    stub_provider: StubProvider,
    thread_worker: ThreadWorker,
) -> Runtime:
    config = scripted_agent([], ["slow_step"])
    config["Providers"] = {
        "a": {"Kind": "openai", "BaseUrl": stub_provider.base_url, "TimeoutSeconds": 60}
    }
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    runtime = make_runtime(sql_url, **config)
    runtime.send_runs_with(thread_worker.sender(runtime))
    return runtime


@pytest.fixture
def client(web_runtime: Runtime) -> tuple[FlaskClient, dict[str, str]]:
    app = create_app(web_runtime, {"TESTING": True})
    key = web_runtime.tenants.issue_key(web_runtime.tenants.ensure_tenant("acme")).secret
    return app.test_client(), {"Authorization": f"Bearer {key}"}


def submit_async(client: FlaskClient, headers: dict[str, str]) -> str:
    response = client.post(
        "/api/agents/demo/run",
        json={"message": "go"},
        headers={**headers, "Prefer": "respond-async"},
    )
    assert response.status_code == 202
    return str(response.get_json()["runId"])


def test_cancel_aborts_a_hanging_provider_call_within_a_second(
    client: tuple[FlaskClient, dict[str, str]],
    web_runtime: Runtime,
    stub_provider: StubProvider,
) -> None:
    http, headers = client
    stub_provider.default = hang(60, reply("too late"))
    run_id = submit_async(http, headers)
    wait_until(lambda: stub_provider.in_progress == 1, what="the provider call", timeout=5)

    response = http.post(f"/api/runs/{run_id}/cancel", headers=headers)
    elapsed = wait_until(
        lambda: status(web_runtime, run_id) == "Canceled", what="the run canceled", timeout=20
    )

    assert response.status_code == 202
    assert elapsed < 5.0  # not the provider's 60 s
    # the connection was really closed
    wait_until(lambda: stub_provider.in_progress == 0, what="the call closed", timeout=5)
    types = event_types(web_runtime, run_id)
    assert "CancelRequested" in types and types[-1] == "RunCanceled"


def test_a_cancel_ends_the_model_call_in_flight_before_the_run(
    client: tuple[FlaskClient, dict[str, str]],
    web_runtime: Runtime,
    stub_provider: StubProvider,
) -> None:
    """The call cut by the cancel ends with `ModelCallFailed` (kind `canceled`) before
    `RunCanceled`: every follower sees it end, and its duration stops there."""
    http, headers = client
    stub_provider.default = hang(60, reply("too late"))
    run_id = submit_async(http, headers)
    wait_until(lambda: stub_provider.in_progress == 1, what="the provider call", timeout=5)

    http.post(f"/api/runs/{run_id}/cancel", headers=headers)
    wait_until(lambda: status(web_runtime, run_id) == "Canceled", what="canceled", timeout=5)

    events = web_runtime.runs.events(run_id)
    assert [e.type for e in events][-4:] == [
        "ModelCallStarted",
        "CancelRequested",
        "ModelCallFailed",
        "RunCanceled",
    ]
    ended = events[-2].data
    assert ended == {
        "provider": "a",
        "model": "gpt-a",
        "status": None,
        "kind": "canceled",
        "message": "the run was canceled",
        "counted": False,
    }
    [call] = [step for step in build_timeline(events, [], live=False).steps if step.kind == "model"]
    assert (call.state, call.stopped, call.ended) == ("stopped", "canceled", events[-2].at)
    later = web_runtime.db.now() + timedelta(hours=1)
    assert call.duration_ms(later) == call.duration_ms(events[-1].at)
    sse = {**headers, "Accept": "text/event-stream"}
    frames = http.get(f"/api/runs/{run_id}/events", headers=sse).get_data(as_text=True)
    assert frames.index("event: ModelCallFailed") < frames.index("event: RunCanceled")


def test_cancel_reaches_a_running_tool_through_its_signal(
    client: tuple[FlaskClient, dict[str, str]],
    web_runtime: Runtime,
    stub_provider: StubProvider,
) -> None:
    http, headers = client
    stub_provider.enqueue(tool_call("slow_step", {"seconds": 60}))
    run_id = submit_async(http, headers)
    wait_until(
        lambda: "ToolCallStarted" in event_types(web_runtime, run_id),
        what="the tool call started",
        timeout=5,
    )

    assert http.post(f"/api/runs/{run_id}/cancel", headers=headers).status_code == 202

    wait_until(
        lambda: status(web_runtime, run_id) == "Canceled", what="the run canceled", timeout=2
    )
    failed = [e.data for e in web_runtime.runs.events(run_id) if e.type == "ToolCallFailed"]
    assert failed and failed[0]["error"]["code"] == "CANCELLED"


def test_cancel_a_queued_run_closes_it_and_its_message_is_dropped(
    client: tuple[FlaskClient, dict[str, str]],
    web_runtime: Runtime,
) -> None:
    http, headers = client
    web_runtime.send_runs_with(hold_queued)
    run_id = submit_async(http, headers)

    assert http.post(f"/api/runs/{run_id}/cancel", headers=headers).status_code == 202

    assert status(web_runtime, run_id) == "Canceled"
    assert web_runtime.executor.execute(run_id) == "dropped"
    assert http.post(f"/api/runs/{run_id}/cancel", headers=headers).status_code == 409


def test_cancel_is_404_for_unknown_and_other_tenants_runs(
    client: tuple[FlaskClient, dict[str, str]],
    web_runtime: Runtime,
) -> None:
    http, headers = client
    web_runtime.send_runs_with(hold_queued)
    run_id = submit_async(http, headers)
    other = web_runtime.tenants.issue_key(web_runtime.tenants.ensure_tenant("globex")).secret

    assert http.post("/api/runs/nope/cancel", headers=headers).status_code == 404
    assert (
        http.post(
            f"/api/runs/{run_id}/cancel", headers={"Authorization": f"Bearer {other}"}
        ).status_code
        == 404
    )
    assert status(web_runtime, run_id) == "Queued"


def test_canceling_a_root_cancels_descendants_but_a_child_touches_nobody_else(
    client: tuple[FlaskClient, dict[str, str]],
    web_runtime: Runtime,
) -> None:
    http, headers = client
    root = new_run(web_runtime)
    child = new_run(web_runtime, parent_run_id=root.id, root_run_id=root.id, depth=1)
    sibling = new_run(web_runtime, parent_run_id=root.id, root_run_id=root.id, depth=1)
    grandchild = new_run(web_runtime, parent_run_id=child.id, root_run_id=root.id, depth=2)

    assert http.post(f"/api/runs/{sibling.id}/cancel", headers=headers).status_code == 202
    assert [status(web_runtime, r.id) for r in (root, child, sibling, grandchild)] == [
        "Queued",
        "Queued",
        "Canceled",
        "Queued",
    ]

    assert http.post(f"/api/runs/{root.id}/cancel", headers=headers).status_code == 202
    assert {status(web_runtime, r.id) for r in (root, child, grandchild)} == {"Canceled"}


# -- heartbeats -------------------------------------------------------------------------


def test_a_heartbeat_that_changes_no_row_stops_the_executor(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    runtime = make_runtime(
        sqlite_url, RunReconciliation=RECONCILE, **scripted_agent([{"Text": "hi"}])
    )
    run = new_run(runtime)
    claim = claim_run(runtime, run.id, "me")
    assert claim is not None
    signal = AbortSignal()
    runtime.live_runs.register(claim, signal)
    with runtime.db.write() as session:  # another owner claimed it meanwhile
        session.execute(update(Run).where(Run.id == run.id).values(fence=Run.fence + 1))

    runtime.live_runs.tick(heartbeat_due=True)

    assert signal.aborted and signal.reason == TAKEN_AWAY
    runtime.live_runs.unregister(run.id)


def test_heartbeats_are_written_for_running_runs(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    runtime = make_runtime(sql_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    run = new_run(runtime)
    claim = claim_run(runtime, run.id, "me")
    assert claim is not None
    set_heartbeat(runtime, run.id, timedelta(minutes=10))

    assert runtime.runs.heartbeat({run.id: claim.fence}) == {run.id}

    fresh = runtime.runs.get(run.id)
    assert fresh is not None and fresh.heartbeat_at is not None
    assert runtime.db.now() - fresh.heartbeat_at < timedelta(seconds=5)


def test_a_heartbeat_while_a_claim_is_read_and_not_made_yet_keeps_the_run(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    # Given a claim read and not made yet (its first write makes it), and the heartbeat
    # thread ticking meanwhile
    runtime = make_runtime(sql_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    run = new_run(runtime)
    claimed = runtime.runs.open_claim(run.id, "me")
    assert claimed is not None
    claim = claimed[0]
    answer: dict[str, set[str]] = {}
    beat = threading.Thread(
        target=lambda: answer.update(owned=runtime.runs.heartbeat({run.id: claim.fence}))
    )
    beat.start()
    beat.join(timeout=10)

    # Then the run is still ours, and stays ours once the claim is made
    assert answer == {"owned": {run.id}}
    runtime.runs.settle(claim)
    assert runtime.runs.heartbeat({run.id: claim.fence}) == {run.id}


def test_heartbeats_racing_claims_never_judge_a_claim_lost(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    # Given claims read and then made by two executor threads, and the heartbeat of the
    # runs they hold written as fast as it can go meanwhile (no run ends: every run is
    # this process's all along)
    runtime = make_runtime(sql_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    runs = [new_run(runtime).id for _ in range(300)]
    held: dict[str, int] = {}
    lock = threading.Lock()
    lost: set[str] = set()
    beats = 0
    claiming = threading.Event()
    done = threading.Event()

    def claim(run_ids: list[str]) -> None:
        for index, run_id in enumerate(run_ids):
            claimed = runtime.runs.open_claim(run_id, "me")
            assert claimed is not None
            with lock:
                held[run_id] = claimed[0].fence
            claiming.set()
            time.sleep(0.0005 * (index % 3))  # the first write comes a little later
            runtime.runs.append(claimed[0], "ModelCallStarted", {"turn": 0})

    def beat() -> None:
        nonlocal beats
        claiming.wait(10)
        while not done.is_set():
            with lock:
                owned = dict(held)
            lost.update(set(owned) - runtime.runs.heartbeat(owned))
            beats += 1

    # When they race
    claimers = [threading.Thread(target=claim, args=(runs[i::2],)) for i in range(2)]
    beater = threading.Thread(target=beat)
    beater.start()
    for thread in claimers:
        thread.start()
    for thread in claimers:
        thread.join(timeout=60)
    done.set()
    beater.join(timeout=10)

    # Then no heartbeat judged a run lost, in any of its states
    assert beats >= 20, f"only {beats} heartbeats raced the claims"
    assert lost == set(), f"{len(lost)} of {len(runs)} claims judged taken away"
    assert {status(runtime, run_id) for run_id in runs} == {"Running"}


def test_a_heartbeat_of_an_earlier_claim_does_not_stop_the_next_one(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    # Given a run executed here under one claim, then under the next (a decision continues
    # the same row), while a heartbeat of the first claim was on its way
    runtime = make_runtime(sqlite_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    run = new_run(runtime)
    first = claim_run(runtime, run.id, "me")
    assert first is not None
    snapshot = {run.id: first.fence}
    with runtime.db.write() as session:  # the run waited and was queued again
        session.execute(update(Run).where(Run.id == run.id).values(status="Queued"))
    second = claim_run(runtime, run.id, "me")
    assert second is not None and second.fence == first.fence + 1
    signal = AbortSignal()
    runtime.live_runs.register(second, signal)

    # When the first claim's heartbeat answers that it is gone
    runtime.live_runs.beat(snapshot)

    # Then the execution of the second claim goes on; a heartbeat of its own stops it once
    # it is gone too
    assert not signal.aborted
    with runtime.db.write() as session:
        session.execute(update(Run).where(Run.id == run.id).values(fence=Run.fence + 1))
    runtime.live_runs.beat({run.id: second.fence})
    assert signal.aborted and signal.reason == TAKEN_AWAY
    runtime.live_runs.unregister(run.id)


def test_a_claim_whose_first_write_fails_is_made_by_the_next_one(
    make_runtime: MakeRuntime,
    postgres_url: str | None,
) -> None:
    # Given a claim read, and its first write failing: the server dropped every idle
    # connection, as a restart does (`Database.OutageRetry` is 1 ms: no second try)
    if postgres_url is None:
        pytest.skip("no PostgreSQL server (set TRACON_TEST_POSTGRES_URL)")
    database = {"Url": postgres_url, "OutageRetry": "00:00:00.001"}
    runtime = make_runtime(postgres_url, Database=database, **scripted_agent([]))
    run = new_run(runtime)
    claimed = runtime.runs.open_claim(run.id, "me")
    assert claimed is not None
    claim = claimed[0]
    drop_idle_connections(postgres_url)
    with pytest.raises(OperationalError):
        runtime.runs.append(claim, "ModelCallStarted", {"model": "m"})
    assert status(runtime, run.id) == "Queued"  # nothing of the claim was written

    # Then the heartbeat still counts the run as this process's, and the next write makes
    # the claim with the same fence and commits its events in order
    assert runtime.runs.heartbeat({run.id: claim.fence}) == {run.id}
    runtime.runs.append(claim, "ModelCallStarted", {"model": "m"})
    row = runtime.runs.get(run.id)
    assert row is not None and (row.status, row.fence, row.owner) == ("Running", claim.fence, "me")
    events = [(e.seq, e.type) for e in runtime.runs.events(run.id)]
    assert events == [(1, "RunQueued"), (2, "RunStarted"), (3, "ModelCallStarted")]
    assert runtime.runs.heartbeat({run.id: claim.fence}) == {run.id}


# -- reconciliation ----------------------------------------------------------------------


def test_scan_closes_silent_running_runs_as_orphaned(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    runtime = make_runtime(sql_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    silent, alive, queued_old = new_run(runtime), new_run(runtime), new_run(runtime)
    for run in (silent, alive):
        assert claim_run(runtime, run.id, "dead-worker") is not None
    set_heartbeat(runtime, silent.id, timedelta(minutes=10))

    result = runtime.reconciler.scan_once(runtime.db.now())

    assert result.orphaned == [silent.id]
    closed = runtime.runs.get(silent.id)
    assert closed is not None and (closed.status, closed.error_type, closed.error_class) == (
        "Failed",
        "orphaned",
        "Infrastructure",
    )
    assert event_types(runtime, silent.id)[-1] == "RunFailed"
    assert status(runtime, alive.id) == "Running"
    assert status(runtime, queued_old.id) == "Queued", "Queued work without a heartbeat stays"


def test_scan_closes_a_queued_run_that_heartbeated(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    runtime = make_runtime(sqlite_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    waiting = new_run(runtime)
    set_heartbeat(runtime, waiting.id, timedelta(minutes=10))

    assert runtime.reconciler.scan_once(runtime.db.now()).orphaned == [waiting.id]


def test_scan_closes_a_canceled_orphan_as_canceled_and_never_continues_it(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    runtime = make_runtime(
        sqlite_url,
        RunReconciliation=RECONCILE,
        RunContinuation={"Enabled": True},
        **scripted_agent([]),
    )
    run = new_run(runtime, session_id="s1")
    assert claim_run(runtime, run.id, "dead-worker") is not None
    set_heartbeat(runtime, run.id, timedelta(minutes=10), cancel_requested_at=runtime.db.now())

    result = runtime.reconciler.scan_once(runtime.db.now())

    assert result.canceled == [run.id] and result.continued == {}
    assert status(runtime, run.id) == "Canceled"


def test_scan_respects_max_runs_per_scan(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    runtime = make_runtime(
        sqlite_url, RunReconciliation={**RECONCILE, "MaxRunsPerScan": 2}, **scripted_agent([])
    )
    runs = [new_run(runtime) for _ in range(3)]
    for run in runs:
        claim_run(runtime, run.id, "dead")
        set_heartbeat(runtime, run.id, timedelta(minutes=10))

    first = runtime.reconciler.scan_once(runtime.db.now())
    second = runtime.reconciler.scan_once(runtime.db.now())

    assert len(first.orphaned) == 2 and len(second.orphaned) == 1


def test_a_run_that_beats_after_the_scan_read_it_is_not_closed(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    runtime = make_runtime(sql_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    run = new_run(runtime)
    claim = claim_run(runtime, run.id, "slow-but-alive")
    assert claim is not None
    set_heartbeat(runtime, run.id, timedelta(minutes=10))
    now = runtime.db.now()
    [candidate] = runtime.runs.orphans(now, timedelta(seconds=5), 10)

    runtime.runs.heartbeat({run.id: claim.fence})  # it beats between the read and the close
    closed = runtime.runs.close_orphan(
        candidate,
        RunStatus.FAILED,
        RunError("orphaned", ErrorClass.INFRASTRUCTURE, "x"),
        now - timedelta(seconds=5),
    )

    assert closed is None and status(runtime, run.id) == "Running"


def test_scan_ends_the_model_call_an_orphan_was_making(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    """A process that died (or was cut off at its drain deadline) mid call wrote no end of
    it: the close writes one, `ModelCallFailed` of kind `interrupted`, before `RunFailed`."""
    runtime = make_runtime(sql_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    run, answered = new_run(runtime), new_run(runtime)
    for each in (run, answered):
        claim = claim_run(runtime, each.id, "dead-worker")
        assert claim is not None
        runtime.runs.append(claim, "ModelCallStarted", {"turn": 0, "provider": "p", "model": "m"})
        set_heartbeat(runtime, each.id, timedelta(minutes=10))
    runtime.runs.append(claim, "ModelCallFailed", {"provider": "p", "model": "m"})  # answered's

    result = runtime.reconciler.scan_once(runtime.db.now())

    assert sorted(result.orphaned) == sorted([run.id, answered.id])
    events = runtime.runs.events(run.id)
    assert [e.type for e in events][-3:] == ["ModelCallStarted", "ModelCallFailed", "RunFailed"]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-2].data["kind"] == "interrupted"
    assert (events[-2].data["provider"], events[-2].data["model"]) == ("p", "m")
    types = event_types(runtime, answered.id)
    assert types[-2:] == ["ModelCallFailed", "RunFailed"] and types.count("ModelCallFailed") == 1


def test_an_orphan_that_wrote_an_event_after_the_scan_read_it_is_not_closed(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    """Its model call was open when read: the close that ends it needs the events unchanged."""
    runtime = make_runtime(sql_url, RunReconciliation=RECONCILE, **scripted_agent([]))
    run = new_run(runtime)
    claim = claim_run(runtime, run.id, "slow-but-alive")
    assert claim is not None
    runtime.runs.append(claim, "ModelCallStarted", {"turn": 0, "provider": "p", "model": "m"})
    set_heartbeat(runtime, run.id, timedelta(minutes=10))
    now = runtime.db.now()
    [candidate] = runtime.runs.orphans(now, timedelta(seconds=5), 10)

    runtime.runs.append(claim, "ModelCallFailed", {"provider": "p", "model": "m"})
    closed = runtime.runs.close_orphan(
        candidate,
        RunStatus.FAILED,
        RunError("orphaned", ErrorClass.INFRASTRUCTURE, "x"),
        now - timedelta(seconds=5),
    )

    assert closed is None and status(runtime, run.id) == "Running"
    assert event_types(runtime, run.id)[-1] == "ModelCallFailed"


# -- continuation ------------------------------------------------------------------------

STEPS: Script = [
    {"ToolCalls": [{"Name": "record_step", "Arguments": {"step": "A"}}]},
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 0}}]},
    {"Text": "all done"},
]


def orphan_midway(runtime: Runtime, tool: str = "slow_step", **fields: Any) -> Run:
    """A run that completed `record_step` and died with `tool` in flight."""
    run = new_run(runtime, session_id="s1", **fields)
    claim = claim_run(runtime, run.id, "dead-worker")
    assert claim is not None
    done = runtime.executor.ledger.start(claim, 0, "call_0_0", "record_step", {"step": "A"})
    assert done is not None
    runtime.executor.ledger.finish(
        claim, done, "record_step", ToolOutcome(ok=True, result="recorded A")
    )
    runtime.executor.ledger.start(claim, 1, "call_1_0", tool, {"seconds": 0})
    set_heartbeat(runtime, run.id, timedelta(minutes=10))
    return run


def continuation_runtime(make_runtime: MakeRuntime, url: str, **continuation: Any) -> Runtime:
    return make_runtime(
        url,
        sender=hold_queued,
        RunReconciliation=RECONCILE,
        RunContinuation={"Enabled": True, **continuation},
        **scripted_agent(STEPS, ["record_step", "slow_step", "wipe_records"]),
    )


def test_continuation_answers_completed_calls_and_reruns_the_one_in_flight_with_its_key(
    make_runtime: MakeRuntime,
    sql_url: str,
) -> None:
    runtime = continuation_runtime(make_runtime, sql_url)
    orphan = orphan_midway(runtime)
    steps_before = [c for c in tools.calls if c[0] == "record_step"]

    result = runtime.reconciler.scan_once(runtime.db.now())
    continuation_id = result.continued[orphan.id]
    assert runtime.executor.execute(continuation_id) == "Completed"

    continuation = runtime.runs.get(continuation_id)
    assert continuation is not None
    assert continuation.continued_from_run_id == orphan.id and continuation.attempt == 2
    assert continuation.session_id == "s1" and continuation.output == {"text": "all done"}
    assert [c for c in tools.calls if c[0] == "record_step"] == steps_before, "not rerun"
    assert "ToolCallAnsweredFromLedger" in event_types(runtime, continuation_id)
    assert "RunContinued" in event_types(runtime, orphan.id)
    with runtime.db.read() as session:
        keys = {
            r.run_id: r.idempotency_key
            for r in session.query(ToolCallRecord).filter(ToolCallRecord.tool == "slow_step")
        }
    assert keys[continuation_id] == keys[orphan.id], "the in-flight call keeps its key"


@pytest.mark.parametrize(
    "second_turn",
    [
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 1}}]},  # other arguments
        {"ToolCalls": [{"Name": "record_step", "Arguments": {"step": "B"}}]},  # another call
        {"Text": "I am done"},  # no call at all
    ],
)
def test_a_continuation_stops_when_the_in_flight_call_is_not_repeated(
    make_runtime: MakeRuntime, sql_url: str, second_turn: dict[str, Any]
) -> None:
    # Given the interrupted run had `slow_step {"seconds": 0}` in flight, outcome unknown
    script: Script = [STEPS[0], second_turn, {"Text": "never"}]
    runtime = make_runtime(
        sql_url,
        sender=hold_queued,
        RunReconciliation=RECONCILE,
        RunContinuation={"Enabled": True},
        **scripted_agent(script, ["record_step", "slow_step"]),
    )
    orphan = orphan_midway(runtime)
    continuation_id = runtime.reconciler.scan_once(runtime.db.now()).continued[orphan.id]
    before = len(tools.calls)

    # When the continuation's model does something else in the turn the chain stopped in
    assert runtime.executor.execute(continuation_id) == "Failed"

    # Then it stops there, naming the call, and starts nothing
    run = runtime.runs.get(continuation_id)
    assert run is not None and run.error_type == "continuation_blocked"
    blocked = [
        e.data for e in runtime.runs.events(continuation_id) if e.type == "RunContinuationBlocked"
    ]
    assert blocked[0]["tool"] == "slow_step" and "slow_step" in blocked[0]["message"]
    assert len(tools.calls) == before


def test_a_destructive_call_in_flight_blocks_continuation(
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    runtime = continuation_runtime(make_runtime, sqlite_url)
    orphan = orphan_midway(runtime, tool="wipe_records")

    result = runtime.reconciler.scan_once(runtime.db.now())

    assert result.continued == {} and status(runtime, orphan.id) == "Failed"
    blocked = [e.data for e in runtime.runs.events(orphan.id) if e.type == "RunContinuationBlocked"]
    assert blocked[0]["tool"] == "wipe_records" and blocked[0]["sideEffect"] == "destructive"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"session_id": None}, "no session"),
        ({"parent_run_id": "parent", "depth": 1}, "sub-run"),
        ({"kind": "workflow"}, "/api/workflows/runs/"),
        ({"attempt": 2}, "MaxAttempts"),
    ],
)
def test_continuation_is_refused_with_a_reason(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    fields: dict[str, Any],
    reason: str,
) -> None:
    runtime = continuation_runtime(make_runtime, sqlite_url)
    run = new_run(runtime, **({"session_id": "s1"} | fields))
    assert claim_run(runtime, run.id, "dead") is not None
    set_heartbeat(runtime, run.id, timedelta(minutes=10))

    assert runtime.reconciler.scan_once(runtime.db.now()).continued == {}

    blocked = [e.data for e in runtime.runs.events(run.id) if e.type == "RunContinuationBlocked"]
    assert reason in blocked[0]["reason"]


def test_a_failed_heartbeat_is_logged_and_tried_again_at_the_next_interval(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    runtime = make_runtime(sqlite_url, **scripted_agent([]))
    run = new_run(runtime)
    claim = claim_run(runtime, run.id, "me")
    assert claim is not None
    set_heartbeat(runtime, run.id, timedelta(minutes=10))
    # Given the database is unreachable when the first heartbeats are due
    store = RunStore(Database("sqlite:////proc/no-such-dir/tracon.db"))
    live = LiveRuns(store, runtime.cancel_bus, timedelta(milliseconds=50), poll_seconds=0.05)
    live.register(claim, AbortSignal())
    wait_until(
        lambda: "heartbeat/cancel poll failed" in caplog.text, what="a failed poll", timeout=5
    )

    # When it answers again
    store.db = runtime.db

    # Then the next interval writes the heartbeat
    def beat_is_fresh() -> bool:
        fresh = runtime.runs.get(run.id)
        assert fresh is not None and fresh.heartbeat_at is not None
        return runtime.db.now() - fresh.heartbeat_at < timedelta(seconds=5)

    wait_until(beat_is_fresh, what="a fresh heartbeat", timeout=5)
    live.stop()
