"""Controls that had no test of their own: each test here fails when its control is removed or
inverted. Real SQL and Redis, the real executor; times are explicit where a deadline matters
(`reconciler.scan_once(now)` against a heartbeat set in the past).

1. `safe_to_repeat=True` lets a continuation repeat a write tool in flight
   (tracon_jobs/runs/continuation.py, `Continuations._unsafe_call_in_flight`).
2. A draining worker claims nothing (tracon_jobs/runs/executor.py, `RunExecutor.execute`).
3. Continuation needs `RunContinuation.Enabled` and `RunReconciliation.Enabled`
   (tracon_jobs/runs/continuation.py, `Continuations.continue_orphan`).
4. Reconciliation off: no scan scheduled, and a silent run left alone
   (beat_schedules/schedule.py, `build_schedule`; beat_schedules/tasks.py).
5. `ToolLoop.AllowConcurrentToolCalls` (tracon_jobs/runs/toolcalls.py, `ToolCalls.answer_turn`).
6. `GET /api/circuits` (web/operations.py, tracon_jobs/resilience/views.py).
7. `GET /api/statistics/runs` (web/operations.py, `RunStore.statistics`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

import beat_schedules
from beat_schedules.schedule import RECONCILE_TASK, build_schedule
from tests import tools_extra
from tests.helpers import MakeRuntime, Script, claim_run, event_types, hold_queued, scripted_agent
from tests.stub_provider import StubProvider, error
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
from web import create_app

RECONCILE = {
    "Enabled": True,
    "HeartbeatInterval": "00:00:00.200",
    "OrphanThreshold": "00:00:05",
    "ScanInterval": "00:00:01",
}
TOOL_MODULES = ["tests.tools", "tests.tools_extra"]


def agent(script: Script, tools: list[str]) -> dict[str, Any]:
    """`scripted_agent`, with the tools of tests/tools_extra.py registered too."""
    config = scripted_agent(script, tools)
    config["ToolModules"] = TOOL_MODULES
    return config


def new_run(runtime: Runtime, tenant: str = "acme", agent: str = "demo", **fields: Any) -> Run:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    return runtime.runs.create(NewRun(tenant_id, agent, {"message": "go"}, **fields))


def fetch(runtime: Runtime, run_id: str) -> Run:
    run = runtime.runs.get(run_id)
    assert run is not None
    return run


def events_of(runtime: Runtime, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [dict(e.data) for e in runtime.runs.events(run_id) if e.type == kind]


def set_heartbeat(runtime: Runtime, run_id: str, ago: timedelta) -> None:
    with runtime.db.write() as session:
        session.execute(
            update(Run).where(Run.id == run_id).values(heartbeat_at=runtime.db.now() - ago)
        )


def continuations_of(runtime: Runtime, run_id: str) -> int:
    with runtime.db.read() as session:
        count = session.scalar(
            select(func.count()).select_from(Run).where(Run.continued_from_run_id == run_id)
        )
    return int(count or 0)


def silent_running_run(runtime: Runtime, **fields: Any) -> Run:
    """A run claimed by a worker that died: `Running`, its heartbeat ten minutes old."""
    run = new_run(runtime, **fields)
    assert claim_run(runtime, run.id, "dead-worker") is not None
    set_heartbeat(runtime, run.id, timedelta(minutes=10))
    return fetch(runtime, run.id)


# -- 1. safe_to_repeat ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "continued"),
    [("repeatable_write", True), ("unrepeatable_write", False)],
)
def test_safe_to_repeat_lets_a_continuation_repeat_a_write_in_flight_with_its_key(
    make_runtime: MakeRuntime, sql_url: str, tool: str, continued: bool
) -> None:
    # Guards continuation.py `_unsafe_call_in_flight`:
    #   `if spec is None or (effect in WRITE_LIKE and not spec.safe_to_repeat)`
    # Without `and not spec.safe_to_repeat` the repeatable write is blocked too; inverted,
    # the plain write is continued. Both tools are `write` and differ only in the flag.
    script: Script = [
        {"ToolCalls": [{"Name": tool, "Arguments": {"step": "A"}}]},
        {"Text": "written"},
    ]
    runtime = make_runtime(
        sql_url,
        sender=hold_queued,
        RunReconciliation=RECONCILE,
        RunContinuation={"Enabled": True},
        **agent(script, [tool]),
    )
    # Given a run that died with the write in flight (ledger `started`, no outcome)
    orphan = new_run(runtime, session_id="s1")
    claim = claim_run(runtime, orphan.id, "dead-worker")
    assert claim is not None
    in_flight = runtime.executor.ledger.start(claim, 0, "call_0_0", tool, {"step": "A"})
    set_heartbeat(runtime, orphan.id, timedelta(minutes=10))

    # When the orphan scan closes it
    result = runtime.reconciler.scan_once(runtime.db.now())

    assert result.orphaned == [orphan.id]
    assert fetch(runtime, orphan.id).status == "Failed"
    if not continued:
        # Then a plain write blocks the continuation, and its body never runs again
        assert result.continued == {} and continuations_of(runtime, orphan.id) == 0
        [blocked] = events_of(runtime, orphan.id, "RunContinuationBlocked")
        assert (blocked["tool"], blocked["sideEffect"]) == (tool, "write")
        assert blocked["executionId"] == in_flight.execution_id
        assert "safe_to_repeat" in blocked["reason"]
        assert "RunContinued" not in event_types(runtime, orphan.id)
        assert [w for w in tools_extra.writes if w[1] == orphan.id] == []
        return

    # Then a safe_to_repeat write is continued, and runs again with the key it had
    continuation_id = result.continued[orphan.id]
    assert "RunContinuationBlocked" not in event_types(runtime, orphan.id)
    assert events_of(runtime, orphan.id, "RunContinued") == [{"continuationRunId": continuation_id}]
    assert runtime.executor.execute(continuation_id) == "Completed"
    assert fetch(runtime, continuation_id).output == {"text": "written"}
    ran = [w for w in tools_extra.writes if w[1] in (orphan.id, continuation_id)]
    assert ran == [(tool, continuation_id, in_flight.idempotency_key)]


# -- 2. drain -------------------------------------------------------------------------------


def test_a_draining_worker_leaves_a_run_queued_and_untouched(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Guards executor.py `RunExecutor.execute`:
    #   `if self.draining.is_set(): ... return "draining"` (before `claim_and_load`)
    # Removed, the run is claimed (fence 1, RunStarted) and runs; inverted, the control
    # below (not draining) would answer "draining" instead of running it.
    runtime = make_runtime(sql_url, sender=hold_queued, **agent([{"Text": "hi"}], []))
    run = new_run(runtime)
    runtime.draining.set()

    assert runtime.executor.execute(run.id) == "draining"

    after = fetch(runtime, run.id)
    assert (after.status, after.fence, after.owner, after.started_at) == ("Queued", 0, None, None)
    assert event_types(runtime, run.id) == ["RunQueued"]

    # The control: once the drain is over the very same run is claimed and runs
    runtime.draining.clear()
    assert runtime.executor.execute(run.id) == "Completed"
    assert fetch(runtime, run.id).fence == 1
    assert "RunStarted" in event_types(runtime, run.id)


# -- 3. continuation needs both switches ---------------------------------------------------


@pytest.mark.parametrize("continuation", [True, False], ids=["continuation-on", "continuation-off"])
def test_the_scan_continues_an_orphan_only_with_run_continuation_enabled(
    make_runtime: MakeRuntime, sql_url: str, continuation: bool
) -> None:
    # Guards continuation.py `continue_orphan`:
    #   `if not (settings.run_continuation.enabled and settings.run_reconciliation.enabled)`
    # (its `run_continuation.enabled` half; the other half is the next test).
    runtime = make_runtime(
        sql_url,
        sender=hold_queued,
        RunReconciliation=RECONCILE,
        RunContinuation={"Enabled": continuation},
        **agent([{"Text": "hi"}], []),
    )
    orphan = silent_running_run(runtime, session_id="s1")

    result = runtime.reconciler.scan_once(runtime.db.now())

    assert result.orphaned == [orphan.id], "the scan closes it either way"
    closed = fetch(runtime, orphan.id)
    assert (closed.status, closed.error_type) == ("Failed", "orphaned")
    if continuation:
        assert list(result.continued) == [orphan.id]
        assert continuations_of(runtime, orphan.id) == 1
        assert "RunContinued" in event_types(runtime, orphan.id)
    else:
        assert result.continued == {} and continuations_of(runtime, orphan.id) == 0
        types = event_types(runtime, orphan.id)
        assert "RunContinued" not in types and "RunContinuationBlocked" not in types


@pytest.mark.parametrize(
    "reconciliation", [True, False], ids=["reconciliation-on", "reconciliation-off"]
)
def test_continue_orphan_needs_run_reconciliation_enabled(
    make_runtime: MakeRuntime, sql_url: str, reconciliation: bool
) -> None:
    # Guards continuation.py `continue_orphan`, its `run_reconciliation.enabled` half:
    # removed, the reconciliation-off case starts a continuation.
    runtime = make_runtime(
        sql_url,
        sender=hold_queued,
        RunReconciliation={**RECONCILE, "Enabled": reconciliation},
        RunContinuation={"Enabled": True},
        **agent([{"Text": "hi"}], []),
    )
    orphan = silent_running_run(runtime, session_id="s1")  # `Running`, as the scan reads it

    continuation = runtime.continuations.continue_orphan(orphan)

    if reconciliation:
        assert continuation is not None
        assert fetch(runtime, continuation).continued_from_run_id == orphan.id
    else:
        assert continuation is None
        assert continuations_of(runtime, orphan.id) == 0
        types = event_types(runtime, orphan.id)
        assert "RunContinued" not in types and "RunContinuationBlocked" not in types


# -- 4. reconciliation off ------------------------------------------------------------------


def scheduled_tasks(settings: Settings) -> set[str]:
    return {entry["task"] for entry in build_schedule(settings).values()}


def test_reconciliation_off_schedules_no_scan() -> None:
    # Guards schedule.py `build_schedule`: `if settings.run_reconciliation.enabled:`
    on = Settings.model_validate({"RunReconciliation": {"Enabled": True}})
    off = Settings.model_validate({"RunReconciliation": {"Enabled": False}})
    default = Settings.model_validate({})

    assert RECONCILE_TASK in scheduled_tasks(on)
    assert "reconcile-orphaned-runs" in build_schedule(on)
    assert RECONCILE_TASK not in scheduled_tasks(off)
    assert "reconcile-orphaned-runs" not in build_schedule(off)
    assert RECONCILE_TASK not in scheduled_tasks(default), "off by default"


@pytest.mark.parametrize("enabled", [True, False], ids=["reconciliation-on", "reconciliation-off"])
def test_reconciliation_off_a_reconcile_tick_leaves_a_silent_run_running(
    make_runtime: MakeRuntime, sqlite_url: str, enabled: bool
) -> None:
    # Guards what `RunReconciliation.Enabled: false` promises a worker: nothing closes its
    # runs (it writes no heartbeats, so every run older than OrphanThreshold looks silent).
    # The schedule has no entry (above); a tick that still arrives (a beat with another
    # configuration, `celery call tracon.reconcile.scan`) must do nothing either.
    # Off: the default settings (OrphanThreshold 5 min); the run was claimed 10 min ago.
    reconcile = RECONCILE if enabled else {}
    runtime = make_runtime(
        sqlite_url, sender=hold_queued, RunReconciliation=reconcile, **agent([], [])
    )
    beat_schedules.install(runtime.celery, runtime)  # the periodic tasks, as a worker has
    run = silent_running_run(runtime)

    scheduled = {e["task"] for e in runtime.celery.conf.beat_schedule.values()}
    assert (RECONCILE_TASK in scheduled) is enabled
    task = runtime.celery.tasks.get(RECONCILE_TASK)
    if task is not None:
        task()

    after = fetch(runtime, run.id)
    if enabled:  # the control: the same tick closes it when reconciliation is on
        assert (after.status, after.error_type) == ("Failed", "orphaned")
    else:
        assert (after.status, after.fence) == ("Running", run.fence)
        assert "RunFailed" not in event_types(runtime, run.id)


# -- 5. concurrent tool calls ---------------------------------------------------------------


@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent", "sequential"])
def test_allow_concurrent_tool_calls_overlaps_the_calls_of_one_turn(
    make_runtime: MakeRuntime, sqlite_url: str, concurrent: bool
) -> None:
    # Guards toolcalls.py `answer_turn`: `if not self.concurrent or len(calls) < 2:` (and
    # its wiring, executor.py `concurrent=settings.tool_loop.allow_concurrent_tool_calls`).
    script: Script = [
        {
            "ToolCalls": [
                {"Name": "timed_sleep", "Arguments": {"label": "a", "seconds": 0.4}},
                {"Name": "timed_sleep", "Arguments": {"label": "b", "seconds": 0.4}},
            ]
        },
        {"Text": "both slept"},
    ]
    runtime = make_runtime(
        sqlite_url,
        sender=hold_queued,
        ToolLoop={"AllowConcurrentToolCalls": concurrent},
        **agent(script, ["timed_sleep"]),
    )
    run = new_run(runtime)

    assert runtime.executor.execute(run.id) == "Completed"

    spans = sorted((t[2], t[3], t[1]) for t in tools_extra.timings if t[0] == run.id)
    assert [label for _, _, label in spans] in (["a", "b"], ["b", "a"])
    (first_start, first_end, _), (second_start, second_end, _) = spans
    overlap = second_start < first_end
    assert overlap is concurrent, spans
    if concurrent:  # both waits at once: well under two waits back to back
        assert max(first_end, second_end) - first_start < 0.75
    else:
        assert second_start >= first_end


# -- 6. GET /api/circuits -------------------------------------------------------------------


def test_circuits_route_shows_an_open_circuit_with_failures_retry_after_and_slots(
    make_runtime: MakeRuntime, sqlite_url: str, stub_provider: StubProvider
) -> None:
    # Guards web/operations.py `circuits` and resilience/views.py `circuits_view` (state,
    # consecutiveFailures, retryAfter, slots), `require_tenant(bp)` for the 401, and that
    # the circuit opens at `FailureThreshold` and not before.
    config = agent([{"Text": "unused"}], [])
    config["Providers"]["a"] = {"Kind": "openai", "BaseUrl": stub_provider.base_url}
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    runtime = make_runtime(
        sqlite_url,
        sender=hold_queued,
        CircuitBreaker={"FailureThreshold": 3, "BreakDuration": "00:01:00"},
        ModelConcurrency={"MaxConcurrentCallsPerProvider": 4},
        **config,
    )
    http = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    headers = {"Authorization": f"Bearer {key}"}
    stub_provider.default = error(500)

    def circuit(name: str) -> dict[str, Any]:
        response = http.get("/api/circuits", headers=headers)
        assert response.status_code == 200
        body = response.get_json()
        assert body["enabled"] is True
        [item] = [i for i in body["items"] if i["provider"] == name]
        return dict(item)

    def fail_once() -> None:
        run = new_run(runtime)
        assert runtime.executor.execute(run.id) == "Failed"
        assert fetch(runtime, run.id).error_type == "provider_error"

    for _ in range(2):
        fail_once()
    below = circuit("a")
    assert (below["state"], below["consecutiveFailures"], below["retryAfter"]) == (
        "closed",
        2,
        None,
    )

    fail_once()  # the third: FailureThreshold

    opened = circuit("a")
    assert opened["state"] == "open" and opened["consecutiveFailures"] == 3
    assert 55 < opened["retryAfter"] <= 60
    assert opened["slots"] == {"limit": 4, "inUse": 0, "waiting": 0}
    untouched = circuit("scripted")
    assert (untouched["state"], untouched["consecutiveFailures"]) == ("closed", 0)
    assert len(stub_provider.requests) == 3

    assert http.get("/api/circuits").status_code == 401
    bad_key = {"Authorization": "Bearer tjk_not-a-key"}
    assert http.get("/api/circuits", headers=bad_key).status_code == 401


# -- 7. GET /api/statistics/runs ------------------------------------------------------------


def test_run_statistics_count_statuses_and_usage_by_model_for_the_tenant_only(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Guards web/operations.py `run_statistics` and store.py `RunStore.statistics`: the
    # tenant filter `filters = [Run.tenant_id == tenant_id]`, the counts per status and the
    # sums per model (runs, tokens, cost).
    config = agent([{"Text": "done", "InputTokens": 100, "OutputTokens": 20}], [])
    config["Providers"]["breaking"] = {
        "Kind": "scripted",
        "Script": [
            {
                "ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}],
                "InputTokens": 40,
                "OutputTokens": 4,
            },
            {"ErrorStatus": 400},
        ],
    }
    config["Agents"]["broken"] = {
        "Instructions": "fails on its second turn",
        "Model": {"provider": "breaking", "model": "fail-model"},
        "Tools": ["lookup_order"],
    }
    config["Pricing"] = {
        "Models": {
            "demo-model": {"InputPerMillion": 1000, "OutputPerMillion": 2000},
            "fail-model": {"InputPerMillion": 500, "OutputPerMillion": 5000},
        }
    }
    runtime = make_runtime(sql_url, sender=hold_queued, **config)

    def executed(tenant: str, agent_name: str, expected: str) -> None:
        run = new_run(runtime, tenant, agent_name)
        assert runtime.executor.execute(run.id) == expected

    # Given acme: two completed runs, one failed run (after one answered turn), one queued
    executed("acme", "demo", "Completed")
    executed("acme", "demo", "Completed")
    executed("acme", "broken", "Failed")
    new_run(runtime, "acme")
    # And globex: runs of its own, on the same models, that acme must never see
    for _ in range(3):
        executed("globex", "demo", "Completed")
    executed("globex", "broken", "Failed")
    new_run(runtime, "globex")

    http = create_app(runtime, {"TESTING": True}).test_client()
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    response = http.get("/api/statistics/runs", headers={"Authorization": f"Bearer {key}"})

    assert response.status_code == 200
    body = response.get_json()
    assert body["byStatus"] == {"Completed": 2, "Failed": 1, "Queued": 1}
    assert body["total"] == 4
    by_model = {row["model"]: row for row in body["byModel"]}
    assert set(by_model) == {"demo-model", "fail-model", None}
    demo, failed, unanswered = by_model["demo-model"], by_model["fail-model"], by_model[None]
    assert demo["runs"] == 2
    assert demo["usage"] == {"inputTokens": 200, "outputTokens": 40, "totalTokens": 240}
    assert demo["cost"]["amount"] == pytest.approx(2 * (0.1 + 0.04))
    assert failed["runs"] == 1
    assert failed["usage"] == {"inputTokens": 40, "outputTokens": 4, "totalTokens": 44}
    assert failed["cost"]["amount"] == pytest.approx(0.02 + 0.02)
    assert unanswered["runs"] == 1 and unanswered["usage"]["totalTokens"] == 0
    assert body["usage"] == {"inputTokens": 240, "outputTokens": 44, "totalTokens": 284}
    assert body["cost"]["amount"] == pytest.approx(0.28 + 0.04)
    assert body["cost"]["currency"] == runtime.settings.pricing.currency

    assert http.get("/api/statistics/runs").status_code == 401
