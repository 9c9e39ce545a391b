"""Tenant cost quotas through the real executor, workflow runner, Flask app and command line,
on real Redis and SQL (SQLite and PostgreSQL): a spent quota refuses the next model call, a
tool call (the tool's error, which the model reads) and a workflow node (the exempt one still
runs); submissions answer `429` with `Retry-After` and write nothing; `GET /api/quota`; other
tenants go on; the counter is rebuilt from SQL after `FLUSHDB`; `tenants quota`."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from flask.testing import FlaskClient

from tests import workflows
from tests.helpers import (
    MakeRuntime,
    Script,
    ThreadWorker,
    as_the_command_line,
    auth,
    run_of,
    scripted_agent,
)
from tracon_jobs.cli import main
from tracon_jobs.db.models import IdempotencyRecord, Run
from tracon_jobs.limits.quota_store import utc_now, window_of
from tracon_jobs.limits.tenant_quotas import spent_in
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from web import create_app

RENDER: Script = [
    *[{"ToolCalls": [{"Name": "render_audio", "Arguments": {"seconds": n}}]} for n in range(4)],
    {"Text": "done"},
]
TWO_RENDERS: Script = [
    {
        "ToolCalls": [
            {"Name": "render_audio", "Arguments": {"seconds": 1}},
            {"Name": "render_audio", "Arguments": {"seconds": 2}},
        ]
    },
    {"Text": "done"},
]
ANSWER: Script = [{"Text": "done"}]


@pytest.fixture(autouse=True)
def _clean() -> None:
    workflows.ran.clear()


def runtime_for(
    make_runtime: MakeRuntime, sql_url: str, script: Script = ANSWER, **sections: Any
) -> Runtime:
    config = scripted_agent(script, ["render_audio"])
    config["WorkflowModules"] = ["tests.workflows"]
    config.update(sections)
    return make_runtime(sql_url, sender=lambda _run_id: None, **config)


def tenant(runtime: Runtime, name: str = "acme", limit: str | None = None) -> str:
    tenant_id = runtime.tenants.ensure_tenant(name)
    if limit is not None:
        runtime.quotas.set_quota(tenant_id, "day", Decimal(limit))
    return tenant_id


def run_agent(runtime: Runtime, tenant_id: str) -> Run:
    run_id = runtime.runs.create(NewRun(tenant_id, "demo", {"message": "go"})).id
    runtime.executor.execute(run_id)
    return run_of(runtime, run_id)


def run_workflow(runtime: Runtime, tenant_id: str, name: str, payload: dict[str, Any]) -> Run:
    new = NewRun(tenant_id=tenant_id, agent=name, kind="workflow", input=payload, session_id="s")
    run_id = runtime.runs.create(new).id
    runtime.executor.execute(run_id)
    return run_of(runtime, run_id)


def events(runtime: Runtime, run_id: str, type_: str) -> list[dict[str, Any]]:
    return [e.data for e in runtime.runs.events(run_id) if e.type == type_]


def sql_spent(runtime: Runtime, tenant_id: str, period: str = "day") -> Decimal:
    return spent_in(runtime.db, tenant_id, window_of("day" if period == "day" else "month"))


# -- the gates of a run ----------------------------------------------------------------------


def test_a_spent_quota_refuses_the_next_model_call(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(make_runtime, sql_url, RENDER)
    acme = tenant(runtime, limit="0.08")

    run = run_agent(runtime, acme)

    assert (run.status, run.error_type, run.error_class) == (
        "Failed",
        "tenant_quota_exceeded",
        "QuotaExceeded",
    )
    message = run.error_message or ""
    assert "metric cost" in message and "period day" in message and "limit 0.08" in message
    assert len(events(runtime, run.id, "ToolCallCompleted")) == 2  # 0.05, 0.10: then refused
    started = events(runtime, run.id, "ModelCallStarted")
    assert len(started) == 2  # the third model call never started
    assert runtime.quotas.usage(acme).used == sql_spent(runtime, acme)


def test_a_spent_quota_refuses_a_tool_call_with_the_tools_error(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, TWO_RENDERS)
    acme = tenant(runtime, limit="0.04")

    run = run_agent(runtime, acme)

    refused = events(runtime, run.id, "ToolCallFailed")
    assert [r["error"]["code"] for r in refused] == ["TENANT_QUOTA_EXCEEDED"]
    assert refused[0]["error"]["message"].endswith("The tool call did not start.")
    assert "cost quota" in refused[0]["error"]["message"]
    assert len(events(runtime, run.id, "ToolCallCompleted")) == 1
    assert run.error_type == "tenant_quota_exceeded"  # and the next model call is refused


def test_a_spent_quota_refuses_a_workflow_node_but_not_an_exempt_one(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    acme = tenant(runtime, limit="0.5")

    done = run_workflow(runtime, acme, "paid", {"amount": 0.3})
    assert done.status == "Completed"  # 0.6 spent before `store`, which is exempt
    assert workflows.ran == ["first", "second", "store"]

    refused = run_workflow(runtime, acme, "paid", {"amount": 0.3})
    assert (refused.status, refused.error_type, refused.error_class) == (
        "Failed",
        "tenant_quota_exceeded",
        "QuotaExceeded",
    )
    assert "workflow node 'first#1' did not start" in (refused.error_message or "")
    assert workflows.ran == ["first", "second", "store"]  # nothing ran the second time
    failed = events(runtime, refused.id, "WorkflowNodeFailed")
    assert failed and "cost quota" in failed[0]["error"]


def test_a_budget_refusal_keeps_its_own_type(make_runtime: MakeRuntime, sqlite_url: str) -> None:
    runtime = runtime_for(make_runtime, sqlite_url, AgentGraph={"MaxTotalCost": 0.5})
    acme = tenant(runtime, limit="100")

    run = run_workflow(runtime, acme, "paid", {"amount": 0.5})

    assert run.error_type == "run_budget_exceeded" and "MaxTotalCost" in (run.error_message or "")


def test_another_tenant_is_unaffected(make_runtime: MakeRuntime, sql_url: str) -> None:
    runtime = runtime_for(
        make_runtime, sql_url, RENDER, Tenants={"DefaultQuota": {"CostLimit": 0.08}}
    )
    acme, other = tenant(runtime, "acme"), tenant(runtime, "other")

    assert run_agent(runtime, acme).error_type == "tenant_quota_exceeded"
    assert run_agent(runtime, acme).error_type == "tenant_quota_exceeded"

    run = run_agent(runtime, other)
    assert len(events(runtime, run.id, "ToolCallCompleted")) == 2  # its own 0.08
    unlimited = tenant(runtime, "unlimited")
    runtime.quotas.set_quota(unlimited, "day", None)  # a row without a limit: no quota
    free = run_agent(runtime, unlimited)
    assert free.status == "Completed"
    assert len(events(runtime, free.id, "ToolCallCompleted")) == 4


def test_the_counter_is_rebuilt_from_sql_after_flushdb(
    make_runtime: MakeRuntime, sql_url: str, redis_client: redis.Redis
) -> None:
    runtime = runtime_for(make_runtime, sql_url, TWO_RENDERS)
    acme = tenant(runtime, limit="0.12")
    first = run_agent(runtime, acme)
    assert first.status == "Completed"  # 0.10 and some tokens
    assert runtime.quotas.usage(acme).used == sql_spent(runtime, acme)

    redis_client.flushdb()

    assert runtime.quotas.store.used(acme, window_of("day")) is None
    second = run_agent(runtime, acme)  # the first gate re-seeds: 0.10 already spent
    assert second.error_type == "tenant_quota_exceeded"
    assert len(events(runtime, second.id, "ToolCallCompleted")) == 1
    assert runtime.quotas.usage(acme).used == sql_spent(runtime, acme)


# -- the web ---------------------------------------------------------------------------------


@pytest.fixture
def web_runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return runtime_for(make_runtime, sql_url, TWO_RENDERS)


@pytest.fixture
def client(web_runtime: Runtime) -> FlaskClient:
    return create_app(web_runtime, {"TESTING": True}).test_client()


def key_of(runtime: Runtime, name: str) -> str:
    return runtime.tenants.issue_key(runtime.tenants.ensure_tenant(name)).secret


def count_rows(runtime: Runtime) -> tuple[int, int]:
    with runtime.db.read() as session:
        runs = session.scalar(sa.select(sa.func.count()).select_from(Run)) or 0
        keys = session.scalar(sa.select(sa.func.count()).select_from(IdempotencyRecord)) or 0
    return runs, keys


def test_submissions_are_answered_429_while_the_quota_is_spent(
    web_runtime: Runtime, client: FlaskClient
) -> None:
    key = key_of(web_runtime, "acme")
    tenant(web_runtime, "acme", limit="0")  # nothing may be spent
    before = count_rows(web_runtime)
    expected = window_of("day").seconds_left(utc_now())

    posts = [
        ("/api/agents/demo/run", {"message": "hi"}, {"Idempotency-Key": "k1"}),
        (
            "/api/workflows/paid/run",
            {"input": {}},
            {"Prefer": "respond-async", "Idempotency-Key": "k2"},
        ),
        ("/api/agents/demo/run", {"message": "hi"}, {"Prefer": "respond-async"}),
    ]
    for path, body, headers in posts:
        response = client.post(path, json=body, headers=auth(key, **headers))
        assert response.status_code == 429, response.get_data(as_text=True)
        assert response.mimetype == "application/problem+json"
        problem = response.get_json()
        assert problem["code"] == "tenant_quota_exceeded" and "cost quota" in problem["detail"]
        assert abs(int(response.headers["Retry-After"]) - expected) <= 2

    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=chat, headers=auth(key))
    assert response.status_code == 429
    error = response.get_json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "tenant_quota_exceeded")
    assert "Retry-After" in response.headers
    response = client.post(
        "/v1/responses", json={"model": "demo", "input": "hi"}, headers=auth(key)
    )
    assert response.status_code == 429

    assert count_rows(web_runtime) == before  # no run, no idempotency record

    other = key_of(web_runtime, "other")
    accepted = client.post(
        "/api/agents/demo/run",
        json={"message": "hi"},
        headers=auth(other, Prefer="respond-async"),
    )
    assert accepted.status_code == 202


def test_a_buffered_answer_of_a_run_the_quota_stopped_is_429_and_not_stored(
    make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker
) -> None:
    runtime = runtime_for(make_runtime, sql_url, TWO_RENDERS)
    runtime.send_runs_with(thread_worker.sender(runtime))
    client = create_app(runtime, {"TESTING": True}).test_client()
    key = key_of(runtime, "acme")
    tenant(runtime, "acme", limit="0.04")  # the second render of the run is refused
    headers = auth(key, **{"Idempotency-Key": "buffered-1"})

    response = client.post("/api/agents/demo/run", json={"message": "hi"}, headers=headers)

    assert response.status_code == 429
    assert response.get_json()["error"]["type"] == "tenant_quota_exceeded"
    assert 0 < int(response.headers["Retry-After"]) <= 24 * 3600
    assert count_rows(runtime) == (1, 0)  # the run; its key was released, not stored
    again = client.post("/api/agents/demo/run", json={"message": "hi"}, headers=headers)
    assert again.status_code == 429 and "Idempotency-Replayed" not in again.headers
    assert again.get_json()["code"] == "tenant_quota_exceeded"  # refused at the door now
    assert count_rows(runtime) == (1, 0)


def test_a_retry_with_its_key_replays_the_stored_answer_after_the_quota_is_spent(
    web_runtime: Runtime, client: FlaskClient
) -> None:
    """The quota stops new work only: what was decided before it ran out is still answered."""
    # Given three submissions accepted with a key each, then two runs that spend the quota
    key = key_of(web_runtime, "acme")
    tenant(web_runtime, "acme", limit="0.5")
    later = {"Prefer": "respond-async"}
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    posts = [
        ("/api/agents/demo/run", {"message": "hi"}, "agent-1"),
        ("/api/workflows/paid/run", {"input": {"amount": 0.3}}, "workflow-1"),
        ("/v1/chat/completions", chat, "chat-1"),
    ]
    first = [
        client.post(path, json=body, headers=auth(key, **later, **{"Idempotency-Key": idem}))
        for path, body, idem in posts
    ]
    assert [response.status_code for response in first] == [202, 202, 202]
    for response in first[:2]:
        web_runtime.executor.execute(response.get_json()["runId"])
    fresh = client.post("/api/agents/demo/run", json={"message": "hi"}, headers=auth(key, **later))
    assert fresh.status_code == 429, "the quota is spent"

    # When each submission is retried with its key
    retries = [
        client.post(path, json=body, headers=auth(key, **later, **{"Idempotency-Key": idem}))
        for path, body, idem in posts
    ]

    # Then each gets its stored 202 and run, and a new key is still refused
    for original, retry in zip(first, retries, strict=True):
        assert retry.status_code == 202, retry.get_data(as_text=True)[:300]
        assert retry.headers["Idempotency-Replayed"] == "true"
        assert retry.get_data() == original.get_data()
    unseen = client.post(
        "/api/agents/demo/run",
        json={"message": "hi"},
        headers=auth(key, **later, **{"Idempotency-Key": "agent-2"}),
    )
    assert unseen.status_code == 429 and unseen.get_json()["code"] == "tenant_quota_exceeded"
    assert count_rows(web_runtime) == (3, 3), "the refused key was released"


def test_get_quota_shows_the_period_limit_use_and_reset(
    web_runtime: Runtime, client: FlaskClient, redis_client: redis.Redis
) -> None:
    key = key_of(web_runtime, "acme")
    acme = tenant(web_runtime, "acme")

    body = client.get("/api/quota", headers=auth(key)).get_json()
    assert body == {
        "period": "day",
        "limit": None,
        "used": 0.0,
        "left": None,
        "resetsAt": f"{window_of('day').end:%Y-%m-%dT%H:%M:%SZ}",
        "currency": "USD",
        "maxConcurrentRuns": None,
        "weight": 1,
        "priority": {"default": 5, "min": 0, "max": 9},
    }

    web_runtime.tenants.set_weight(acme, 3)
    web_runtime.tenants.set_max_concurrent_runs(acme, 2)
    body = client.get("/api/quota", headers=auth(key)).get_json()
    assert (body["weight"], body["maxConcurrentRuns"]) == (3, 2)
    assert body["priority"] == {"default": 5, "min": 0, "max": 9}

    web_runtime.quotas.set_quota(acme, "month", Decimal("1.5"))
    run_agent(web_runtime, acme)
    spent = sql_spent(web_runtime, acme, "month")
    assert spent > Decimal("0.1")
    body = client.get("/api/quota", headers=auth(key)).get_json()
    assert body["period"] == "month" and body["limit"] == 1.5
    assert body["used"] == pytest.approx(float(spent))
    assert body["left"] == pytest.approx(1.5 - float(spent))
    assert body["resetsAt"] == f"{window_of('month').end:%Y-%m-%dT%H:%M:%SZ}"

    redis_client.flushdb()  # rebuilt from SQL
    assert client.get("/api/quota", headers=auth(key)).get_json()["used"] == body["used"]
    assert client.get("/api/quota").status_code == 401
    assert "/api/quota" in client.get("/openapi.json").get_json()["paths"]


def test_the_window_of_a_quota_is_the_utc_day_or_month() -> None:
    now = datetime(2026, 11, 30, 23, 0, 0)
    assert window_of("day", now).seconds_left(now) == 3600
    assert window_of("month", now).end == datetime(2026, 12, 1)


# -- the command line ------------------------------------------------------------------------


def test_tenants_quota_sets_shows_and_clears(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config: dict[str, Any] = {"Tenants": {"DefaultQuota": {"CostLimit": 10}}}
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url}, **config)
    as_the_command_line(monkeypatch, tmp_path, path)
    runtime = make_runtime(sqlite_url, **config)
    acme = runtime.tenants.ensure_tenant("acme")

    assert main(["tenants", "quota", "acme"]) == 0
    assert "quota (default): 10.00 USD per day; used 0.00 USD" in capsys.readouterr().out

    assert main(["tenants", "quota", "acme", "--period", "month", "--cost-limit", "2.5"]) == 0
    assert "quota (own): 2.50 USD per month" in capsys.readouterr().out
    assert runtime.quotas.quota_of(acme).limit == Decimal("2.5")

    assert main(["tenants", "quota", "acme", "--cost-limit", "none"]) == 0
    out = capsys.readouterr().out
    assert "quota (own): none per month" in out and "left" not in out
    assert runtime.quotas.quota_of(acme).limit is None

    assert main(["tenants", "quota", "acme", "--clear"]) == 0
    assert "own quota removed" in capsys.readouterr().out
    assert runtime.quotas.quota_of(acme).limit == Decimal(10)

    assert main(["tenants", "quota", "nobody"]) != 0
    with pytest.raises(SystemExit):
        main(["tenants", "quota", "acme", "--cost-limit", "-1"])
    assert main(["tenants", "quota", "acme", "--clear", "--period", "day"]) != 0
