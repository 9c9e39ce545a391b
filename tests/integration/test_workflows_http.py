"""The workflow routes through the real Flask app, real SQL and Redis: start (SSE by
default, 202 with `Prefer: respond-async`), respond, resume; the reliability guide's
idempotency rows for the three routes, drain 503s, 404 across tenants, 400 for bad input.

Runs are executed by the real executor on a thread standing in for a worker."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from flask.testing import FlaskClient

from tests import workflows
from tests.helpers import MakeRuntime, ThreadWorker, auth, scripted_agent, wait_for_status
from tracon_jobs.runs.store import NewRun, RunFilter
from tracon_jobs.runtime import Runtime
from web import create_app


@pytest.fixture(autouse=True)
def _clean() -> None:
    workflows.ran.clear()


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker) -> Runtime:
    config = scripted_agent([{"Text": "Sorry for the delay."}])
    config |= {"WorkflowModules": ["tests.workflows"], "Workflows": {"EnableCheckpointing": True}}
    rt = make_runtime(sql_url, **config)
    rt.send_runs_with(thread_worker.sender(rt))
    return rt


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    return create_app(runtime, {"TESTING": True, "SSE_KEEPALIVE_SECONDS": 0.2}).test_client()


def key_of(runtime: Runtime, tenant: str) -> str:
    return runtime.tenants.issue_key(runtime.tenants.ensure_tenant(tenant)).secret


ASYNC = {"Prefer": "respond-async"}


def start_waiting(client: FlaskClient, key: str) -> str:
    return start_all_waiting(client, key, 1)[0]


def start_all_waiting(client: FlaskClient, key: str, count: int) -> list[str]:
    """`count` runs of `hundred`, all submitted, then each waited for until it asks."""
    run_ids = []
    for _ in range(count):
        response = client.post(
            "/api/workflows/hundred/run", json={"input": {}}, headers=auth(key, **ASYNC)
        )
        assert response.status_code == 202
        run_ids.append(str(response.get_json()["runId"]))
    for run_id in run_ids:
        wait_for_status(client, key, run_id, "Waiting", timeout=15)
    return run_ids


def test_start_streams_events_by_default(client: FlaskClient, runtime: Runtime) -> None:
    key = key_of(runtime, "acme")

    response = client.post(
        "/api/workflows/three-nodes/run", json={"input": {"seconds": 0}}, headers=auth(key)
    )

    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    body = response.get_data(as_text=True)
    assert "event: WorkflowNodeCompleted" in body and "event: RunCompleted" in body
    assert body.count("event: WorkflowNodeStarted") == 3
    assert response.headers["Location"].startswith("/api/runs/")


def test_start_async_then_respond_continues_the_chain(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    run_id = start_waiting(client, key)
    run = client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json()
    assert run["kind"] == "workflow" and run["agent"] == "hundred"
    assert run["workflowVersion"] == runtime.workflow_registry.version_of("hundred")

    answered = client.post(
        f"/api/workflows/runs/{run_id}/respond",
        json={"answer": {"ok": True}},
        headers=auth(key, **ASYNC),
    )

    assert answered.status_code == 202
    continued = wait_for_status(client, key, answered.get_json()["runId"], "Completed", timeout=15)
    assert continued["continuedFromRunId"] == run_id
    assert continued["output"] == {"result": sum(range(100))}
    again = client.post(
        f"/api/workflows/runs/{run_id}/respond", json={"answer": 1}, headers=auth(key, **ASYNC)
    )
    assert again.status_code == 409


def test_resume_of_a_completed_run_is_409_and_of_a_live_one_too(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    waiting = start_waiting(client, key)

    live = client.post(f"/api/workflows/runs/{waiting}/resume", headers=auth(key, **ASYNC))
    done = client.post(
        "/api/workflows/three-nodes/run", json={"input": {}}, headers=auth(key, **ASYNC)
    ).get_json()["runId"]
    wait_for_status(client, key, done, "Completed", timeout=15)
    completed = client.post(f"/api/workflows/runs/{done}/resume", headers=auth(key, **ASYNC))

    assert live.status_code == 409 and completed.status_code == 409
    assert completed.get_json()["runStatus"] == "Completed"


def test_another_tenant_gets_404_everywhere(client: FlaskClient, runtime: Runtime) -> None:
    key, other = key_of(runtime, "acme"), key_of(runtime, "globex")
    run_id = start_waiting(client, key)

    for path in ("respond", "resume"):
        response = client.post(
            f"/api/workflows/runs/{run_id}/{path}", json={"answer": 1}, headers=auth(other)
        )
        assert response.status_code == 404
    assert client.get(f"/api/runs/{run_id}", headers=auth(other)).status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/workflows/three-nodes/run", {"input": "not an object"}, "input"),
        ("/api/workflows/three-nodes/run", {"input": {}, "extra": 1}, "extra"),
        ("/api/workflows/three-nodes/run", {"sessionId": "x" * 201}, "sessionId"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    client: FlaskClient, runtime: Runtime, path: str, body: dict[str, Any], field: str
) -> None:
    response = client.post(path, json=body, headers=auth(key_of(runtime, "acme")))

    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["field"] == field


def test_an_unknown_workflow_is_404_and_a_respond_without_answer_400(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    assert client.post("/api/workflows/nope/run", json={}, headers=auth(key)).status_code == 404
    run_id = start_waiting(client, key)
    missing = client.post(f"/api/workflows/runs/{run_id}/respond", json={}, headers=auth(key))
    assert missing.status_code == 400 and missing.get_json()["field"] == "answer"


@pytest.mark.parametrize("route", ["run", "respond", "resume"])
def test_a_key_without_respond_async_is_400_and_nothing_runs(
    client: FlaskClient, runtime: Runtime, route: str
) -> None:
    key = key_of(runtime, "acme")
    waiting = start_waiting(client, key)
    path = {
        "run": "/api/workflows/three-nodes/run",
        "respond": f"/api/workflows/runs/{waiting}/respond",
        "resume": f"/api/workflows/runs/{waiting}/resume",
    }[route]
    before = runtime.runs.page(
        runtime.tenants.ensure_tenant("acme"), _all(), limit=100, before=None
    )

    response = client.post(path, json={"answer": 1}, headers=auth(key, **{"Idempotency-Key": "k"}))

    assert response.status_code == 400 and "respond-async" in response.get_json()["detail"]
    after = runtime.runs.page(runtime.tenants.ensure_tenant("acme"), _all(), limit=100, before=None)
    assert len(after) == len(before)
    assert client.get(f"/api/runs/{waiting}", headers=auth(key)).get_json()["status"] == "Waiting"


def test_a_key_with_respond_async_replays_the_202(client: FlaskClient, runtime: Runtime) -> None:
    key = key_of(runtime, "acme")
    headers = auth(key, **ASYNC, **{"Idempotency-Key": "start-1"})

    first = client.post("/api/workflows/three-nodes/run", json={"input": {}}, headers=headers)
    second = client.post("/api/workflows/three-nodes/run", json={"input": {}}, headers=headers)

    assert first.status_code == second.status_code == 202
    assert second.get_data() == first.get_data()
    assert second.headers["Idempotency-Replayed"] == "true"


def test_the_run_starting_routes_answer_503_while_draining(runtime: Runtime) -> None:
    key = key_of(runtime, "acme")
    client = create_app(runtime, {"TESTING": True, "TRACON_DRAINING": True}).test_client()

    for path in (
        "/api/workflows/three-nodes/run",
        "/api/workflows/runs/x/respond",
        "/api/workflows/runs/x/resume",
        "/api/workflows/runs/x/events/paid",
        "/api/workflows/answers",
    ):
        response = client.post(path, json={}, headers=auth(key, **ASYNC))
        assert response.status_code == 503 and response.headers["Retry-After"]
    assert client.get("/api/workflows", headers=auth(key)).status_code == 200


def test_the_registered_workflows_are_listed(client: FlaskClient, runtime: Runtime) -> None:
    body = client.get("/api/workflows", headers=auth(key_of(runtime, "acme"))).get_json()

    names = [item["name"] for item in body["items"]]
    assert {"review", "three-nodes", "hundred"} <= set(names)
    versions = {item["name"]: item["version"] for item in body["items"]}
    assert versions["review"] == runtime.workflow_registry.version_of("review")


def _all() -> Any:
    from tracon_jobs.runs.store import RunFilter

    return RunFilter()


def test_whether_a_job_owns_a_continuation_is_decided_by_its_own_request(
    client: FlaskClient, runtime: Runtime
) -> None:
    """A respond or resume under `Prefer: respond-async` is owned by a job (the orphan scan
    attempts it again); one answered over SSE is bound to that connection, whatever the
    request that started the chain was."""
    key = key_of(runtime, "acme")
    async_start = start_waiting(client, key)  # started with Prefer: respond-async

    # When the answer comes over SSE, the run it starts is bound to that stream
    streamed = client.post(
        f"/api/workflows/runs/{async_start}/respond", json={"answer": 1}, headers=auth(key)
    )
    assert streamed.status_code == 200 and "event: RunCompleted" in streamed.get_data(True)
    bound = streamed.headers["Location"].rsplit("/", 1)[-1]
    assert runtime.runs.get(bound).resumable is False  # type: ignore[union-attr]

    # And a run started over SSE, answered with Prefer: respond-async, is owned by a job
    tenant = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant, "hundred", {}, kind="workflow", session_id="s", resumable=False)
    sse_start = runtime.runs.create(new).id
    assert runtime.executor.execute(sse_start) == "Waiting"
    queued = client.post(
        f"/api/workflows/runs/{sse_start}/respond", json={"answer": 1}, headers=auth(key, **ASYNC)
    )
    assert queued.status_code == 202
    owned = wait_for_status(client, key, queued.get_json()["runId"], "Completed", timeout=15)
    assert runtime.runs.get(owned["id"]).resumable is True  # type: ignore[union-attr]


def test_an_event_is_kept_then_taken_or_delivered_to_its_wait_over_http(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    started = client.post(
        "/api/workflows/await-payment/run", json={"input": {}}, headers=auth(key, **ASYNC)
    )
    first = str(started.get_json()["runId"])
    wait_for_status(client, key, first, "Waiting", timeout=15)
    route = f"/api/workflows/runs/{first}/events/paid"

    # An event while it waits answers the wait: a run continues the chain with it
    delivered = client.post(route, json={"payload": {"amount": 40}}, headers=auth(key))
    assert delivered.status_code == 202, delivered.get_json()
    body = delivered.get_json()
    assert body["outcome"] == "delivered" and body["event"] == "paid"
    assert delivered.headers["Location"] == f"/api/runs/{body['runId']}"
    done = wait_for_status(client, key, body["runId"], "Completed", timeout=15)
    assert done["output"] == {"result": {"order": "A-1", "paid": {"amount": 40}}}

    # The chain has ended: another is refused, naming why
    late = client.post(route, json={"payload": 1}, headers=auth(key))
    assert late.status_code == 409 and "Completed" in late.get_json()["detail"]


def test_an_event_before_its_wait_is_kept_and_a_retry_with_its_key_is_one_delivery(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    tenant = runtime.tenants.ensure_tenant("acme")
    first = runtime.runs.create(
        NewRun(tenant_id=tenant, agent="await-payment", kind="workflow", input={})
    ).id  # written, not sent: its wait is not open yet
    route = f"/api/workflows/runs/{first}/events/paid"
    headers = auth(key, **{"Idempotency-Key": "pay-1"})

    kept = client.post(route, json={"payload": "card"}, headers=headers)
    again = client.post(route, json={"payload": "card"}, headers=headers)

    assert kept.status_code == again.status_code == 202
    assert (
        kept.get_json()
        == again.get_json()
        == {
            "runId": first,
            "status": "Queued",
            "event": "paid",
            "outcome": "kept",
        }
    )
    assert runtime.workflow_store.kept_events(first, "paid") == 1
    assert runtime.executor.execute(first) == "Completed"
    assert run_output(runtime, first) == {"result": {"order": "A-1", "paid": "card"}}


def test_events_are_refused_for_another_tenants_run_and_for_bad_input(
    client: FlaskClient, runtime: Runtime
) -> None:
    tenant = runtime.tenants.ensure_tenant("acme")
    first = runtime.runs.create(
        NewRun(tenant_id=tenant, agent="await-payment", kind="workflow", input={})
    ).id
    other = key_of(runtime, "globex")
    mine = key_of(runtime, "acme")
    route = f"/api/workflows/runs/{first}/events/paid"

    assert client.post(route, json={"payload": 1}, headers=auth(other)).status_code == 404
    bad = client.post(route, json={"payload": 1, "extra": 2}, headers=auth(mine))
    assert bad.status_code == 400 and bad.get_json()["field"] == "extra"
    long_name = client.post(
        f"/api/workflows/runs/{first}/events/{'x' * 201}", json={}, headers=auth(mine)
    )
    assert long_name.status_code == 400 and long_name.get_json()["field"] == "name"
    assert runtime.workflow_store.kept_events(first) == 0


def run_output(runtime: Runtime, run_id: str) -> Any:
    run = runtime.runs.get(run_id)
    assert run is not None
    return run.output


# -- answers in bulk: POST /api/workflows/answers -----------------------------------------


def test_answers_in_bulk_continue_each_chain_and_one_that_cannot_changes_no_other(
    client: FlaskClient, runtime: Runtime
) -> None:
    key, other = key_of(runtime, "acme"), key_of(runtime, "globex")
    waiting = start_all_waiting(client, key, 3)
    theirs = start_waiting(client, other)
    done = client.post(
        "/api/workflows/three-nodes/run", json={"input": {}}, headers=auth(key, **ASYNC)
    ).get_json()["runId"]
    wait_for_status(client, key, done, "Completed", timeout=15)

    # When one request answers three waiting runs, one of them twice, a completed run, another
    # tenant's waiting run and a run that does not exist
    answers = [
        {"runId": waiting[0], "answer": {"ok": True}},
        {"runId": done, "answer": 1},
        {"runId": waiting[1], "answer": 2},
        {"runId": theirs, "answer": 3},
        {"runId": waiting[0], "answer": "again"},
        {"runId": "00000000-0000-4000-8000-000000000000", "answer": 4},
        {"runId": waiting[2], "answer": None},
    ]
    response = client.post("/api/workflows/answers", json={"answers": answers}, headers=auth(key))

    # Then each gets its own outcome, in order: the waiting ones continue, once each
    assert response.status_code == 200
    items = response.get_json()["items"]
    assert [(item["runId"], item["status"]) for item in items] == [
        (waiting[0], 202),
        (done, 409),
        (waiting[1], 202),
        (theirs, 404),
        (waiting[0], 409),
        (answers[5]["runId"], 404),
        (waiting[2], 202),
    ]
    assert items[1]["runStatus"] == "Completed" and "not waiting" in items[1]["detail"]
    for index in (0, 2, 6):
        continued = wait_for_status(
            client, key, items[index]["continuationRunId"], "Completed", timeout=15
        )
        assert continued["continuedFromRunId"] == items[index]["runId"]
        assert continued["output"] == {"result": sum(range(100))}
        answered = client.get(f"/api/runs/{items[index]['runId']}", headers=auth(key))
        assert answered.get_json()["status"] == "Completed"
    # And the other tenant's run still waits, unanswered; the completed run has no continuation
    assert client.get(f"/api/runs/{theirs}", headers=auth(other)).get_json()["status"] == "Waiting"
    continuations = [
        run.id
        for run in runtime.runs.page(
            runtime.tenants.ensure_tenant("acme"), RunFilter(), limit=100, before=None
        )
        if run.continued_from_run_id is not None
    ]
    assert len(continuations) == 3
    # And a retry of the whole request answers nothing again
    retried = client.post("/api/workflows/answers", json={"answers": answers}, headers=auth(key))
    assert [item["status"] for item in retried.get_json()["items"]] == [
        409,
        409,
        409,
        404,
        409,
        404,
        409,
    ]


def test_answers_in_bulk_beside_a_canceled_run_answer_the_others_and_not_it(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    waiting = start_all_waiting(client, key, 3)
    # Given one of them canceled while it waited (its question stays asked, its run ended)
    canceled = client.post(f"/api/runs/{waiting[1]}/cancel", headers=auth(key))
    assert canceled.status_code in (200, 202)
    wait_for_status(client, key, waiting[1], "Canceled", timeout=15)

    # When one request answers all three
    answers = [{"runId": run_id, "answer": index} for index, run_id in enumerate(waiting)]
    response = client.post("/api/workflows/answers", json={"answers": answers}, headers=auth(key))

    # Then the two still waiting continue, and the canceled one is a 409 with no continuation
    items = response.get_json()["items"]
    assert [item["status"] for item in items] == [202, 409, 202]
    assert items[1]["runStatus"] == "Canceled"
    for index in (0, 2):
        continued = wait_for_status(
            client, key, items[index]["continuationRunId"], "Completed", timeout=15
        )
        assert continued["continuedFromRunId"] == waiting[index]
    runs = runtime.runs.page(
        runtime.tenants.ensure_tenant("acme"), RunFilter(), limit=100, before=None
    )
    assert sorted(str(run.continued_from_run_id) for run in runs if run.continued_from_run_id) == (
        sorted([waiting[0], waiting[2]])
    )
    events = [e.type for e in runtime.runs.events(waiting[1])]
    assert "RunContinued" not in events and events[-1] == "RunCanceled"


def test_bulk_answers_racing_over_the_same_runs_answer_each_once(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    waiting = start_all_waiting(client, key, 12)
    app = create_app(runtime, {"TESTING": True})
    barrier = threading.Barrier(4)

    # When four requests at once answer all twelve, each in an order of its own
    def answer_all(seed: int) -> list[dict[str, Any]]:
        order = random.Random(seed).sample(waiting, len(waiting))
        body = {"answers": [{"runId": run_id, "answer": seed} for run_id in order]}
        barrier.wait(timeout=10)
        response = app.test_client().post("/api/workflows/answers", json=body, headers=auth(key))
        assert response.status_code == 200, response.get_data(as_text=True)
        return list(response.get_json()["items"])

    with ThreadPoolExecutor(4) as pool:
        answered = [item for items in pool.map(answer_all, range(4)) for item in items]

    # Then each run was answered by one of them (the others got 409), and continued once
    winners = [item for item in answered if item["status"] == 202]
    assert sorted(item["runId"] for item in winners) == sorted(waiting)
    assert {item["status"] for item in answered} == {202, 409}
    for item in winners:
        continued = wait_for_status(client, key, item["continuationRunId"], "Completed", timeout=15)
        assert continued["continuedFromRunId"] == item["runId"]
    runs = runtime.runs.page(
        runtime.tenants.ensure_tenant("acme"), RunFilter(), limit=100, before=None
    )
    assert len([run for run in runs if run.continued_from_run_id]) == len(waiting)


def test_bulk_answers_racing_one_at_a_time_over_the_same_runs_answer_each_once(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    waiting = start_all_waiting(client, key, 12)
    # Given a canceled run in every batch, so that none is written together: each batch
    # answers its runs one at a time, each in a savepoint, in its own transaction
    canceled = start_waiting(client, key)
    assert client.post(f"/api/runs/{canceled}/cancel", headers=auth(key)).status_code in (200, 202)
    wait_for_status(client, key, canceled, "Canceled", timeout=15)
    app = create_app(runtime, {"TESTING": True})
    barrier = threading.Barrier(4)

    # When four such requests at once answer all twelve, each in an order of its own
    def answer_all(seed: int) -> list[dict[str, Any]]:
        order = random.Random(seed).sample([*waiting, canceled], len(waiting) + 1)
        body = {"answers": [{"runId": run_id, "answer": seed} for run_id in order]}
        barrier.wait(timeout=10)
        response = app.test_client().post("/api/workflows/answers", json=body, headers=auth(key))
        assert response.status_code == 200, response.get_data(as_text=True)
        items = list(response.get_json()["items"])
        assert [item["runId"] for item in items] == order  # the outcomes in the request's order
        return items

    with ThreadPoolExecutor(4) as pool:
        answered = [item for items in pool.map(answer_all, range(4)) for item in items]

    # Then none deadlocked (rows are locked in run id order), each run was answered once,
    # and the canceled one by none
    winners = sorted(item["runId"] for item in answered if item["status"] == 202)
    assert winners == sorted(waiting)
    assert all(item["status"] == 409 for item in answered if item["runId"] == canceled)
    runs = runtime.runs.page(
        runtime.tenants.ensure_tenant("acme"), RunFilter(), limit=100, before=None
    )
    assert len([run for run in runs if run.continued_from_run_id]) == len(waiting)


def test_answers_in_bulk_under_a_key_replay_their_outcomes(
    client: FlaskClient, runtime: Runtime
) -> None:
    key = key_of(runtime, "acme")
    waiting = start_waiting(client, key)
    body = {"answers": [{"runId": waiting, "answer": 1}]}
    headers = auth(key, **{"Idempotency-Key": "bulk-1"})

    first = client.post("/api/workflows/answers", json=body, headers=headers)
    again = client.post("/api/workflows/answers", json=body, headers=headers)

    assert first.status_code == again.status_code == 200
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.get_json() == first.get_json()
    assert first.get_json()["items"][0]["status"] == 202


SOME_ID = "00000000-0000-4000-8000-000000000000"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "answers"),
        ({"answers": []}, "answers"),
        ({"answers": [{"runId": SOME_ID}]}, "answers.0.answer"),
        ({"answers": [{"answer": 1}]}, "answers.0.runId"),
        ({"answers": [{"runId": "x", "answer": 1}]}, "answers.0.runId"),
        ({"answers": [{"runId": SOME_ID, "answer": 1, "extra": 1}]}, "answers.0.extra"),
        ({"answers": [{"runId": SOME_ID, "answer": 1}] * 101}, "answers"),
    ],
)
def test_bad_bulk_answers_are_400_naming_the_field_and_answer_nothing(
    client: FlaskClient, runtime: Runtime, body: dict[str, Any], field: str
) -> None:
    key = key_of(runtime, "acme")

    response = client.post("/api/workflows/answers", json=body, headers=auth(key))

    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["field"] == field
