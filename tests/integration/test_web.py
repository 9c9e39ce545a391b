"""The HTTP API through the real Flask app, real SQL and real Redis. Runs are executed by
the real executor on a thread standing in for a worker (Celery itself is covered by the
process tests in tests/e2e)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import (
    MakeRuntime,
    Script,
    ThreadWorker,
    auth,
    hold_queued,
    scripted_agent,
    wait_for_status,
)
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runtime import Runtime
from web import create_app

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]},
    {"Text": "It shipped."},
]


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker) -> Runtime:
    rt = make_runtime(sql_url, **scripted_agent(SCRIPT, ["lookup_order"]))
    rt.send_runs_with(thread_worker.sender(rt))
    return rt


@pytest.fixture
def app(runtime: Runtime) -> Flask:
    return create_app(runtime, {"TESTING": True, "SSE_KEEPALIVE_SECONDS": 0.5})


def parse_sse(body: str) -> list[dict[str, Any]]:
    frames = []
    for block in body.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        if not lines:
            continue
        fields = dict(line.split(": ", 1) for line in lines)
        frames.append(
            {"id": int(fields["id"]), "event": fields["event"], "data": json.loads(fields["data"])}
        )
    return frames


def test_run_streams_its_events_as_sse_ending_with_run_completed(
    client: FlaskClient, key: str
) -> None:
    response = client.post(
        "/api/agents/demo/run", headers=auth(key), json={"message": "Where is A-1?"}
    )

    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    frames = parse_sse(response.get_data(as_text=True))
    assert [f["id"] for f in frames] == list(range(1, len(frames) + 1))
    assert frames[0]["event"] == "RunQueued"
    assert frames[-1]["event"] == "RunCompleted"
    assert frames[-1]["data"]["data"]["output"] == {"text": "It shipped."}
    assert all(f["event"] == f["data"]["type"] and f["id"] == f["data"]["seq"] for f in frames)


def test_respond_async_answers_202_with_location(client: FlaskClient, key: str) -> None:
    response = client.post(
        "/api/agents/demo/run",
        json={"message": "hi", "sessionId": "s-1"},
        headers=auth(key, Prefer="respond-async"),
    )

    assert response.status_code == 202
    assert response.headers["Preference-Applied"] == "respond-async"
    run_id = response.get_json()["runId"]
    assert response.headers["Location"] == f"/api/runs/{run_id}"
    run = wait_for_status(client, key, run_id, "Completed")
    assert run["sessionId"] == "s-1"
    assert run["rootRunId"] == run_id and run["depth"] == 0
    assert run["usage"]["totalTokens"] == 30
    assert run["cost"] == {
        "amount": pytest.approx(0.00004),
        "currency": "USD",
        "source": "Configured",
    }
    assert run["output"] == {"text": "It shipped."}


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer tjk_nope_nope"}, 401),
        ({"Authorization": "Basic abc"}, 401),
    ],
)
def test_missing_or_unknown_key_is_401(
    client: FlaskClient, headers: dict[str, str], status: int
) -> None:
    response = client.get("/api/runs", headers=headers)
    assert response.status_code == status
    assert response.mimetype == "application/problem+json"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", "body"),
        (b"{}", "message"),
        (b'{"message": ""}', "message"),
        (b'{"message": "x", "sessionid": "typo"}', "sessionid"),
        (b'{"message": 5}', "message"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(
    client: FlaskClient, key: str, runtime: Runtime, body: bytes, field: str
) -> None:
    response = client.post(
        "/api/agents/demo/run", data=body, headers=auth(key, **{"Content-Type": "application/json"})
    )

    assert response.status_code == 400
    problem = response.get_json()
    assert problem["field"] == field and field in problem["detail"]
    assert client.get("/api/runs", headers=auth(key)).get_json()["items"] == []


def test_unknown_agent_is_404(client: FlaskClient, key: str) -> None:
    response = client.post("/api/agents/nobody/run", json={"message": "x"}, headers=auth(key))
    assert response.status_code == 404
    assert response.get_json()["title"] == "Not Found"


def test_tenants_never_see_each_other(client: FlaskClient, key: str, runtime: Runtime) -> None:
    other = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("globex")).secret
    run_id = client.post(
        "/api/agents/demo/run", json={"message": "x"}, headers=auth(key, Prefer="respond-async")
    ).get_json()["runId"]

    for path in (f"/api/runs/{run_id}", f"/api/runs/{run_id}/events", f"/api/runs/{run_id}/tree"):
        assert client.get(path, headers=auth(other)).status_code == 404
    live = auth(other, Accept="text/event-stream")  # a live stream is refused before it opens
    assert client.get(f"/api/runs/{run_id}/events", headers=live).status_code == 404
    assert client.get("/api/runs", headers=auth(other)).get_json()["items"] == []


def test_list_filters_and_paginates_with_a_cursor(client: FlaskClient, key: str) -> None:
    ids = [
        client.post(
            "/api/agents/demo/run",
            json={"message": f"m{i}", "sessionId": f"s{i % 2}"},
            headers=auth(key, Prefer="respond-async"),
        ).get_json()["runId"]
        for i in range(5)
    ]
    for run_id in ids:
        wait_for_status(client, key, run_id, "Completed")

    seen: list[str] = []
    cursor = None
    while True:
        query = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/runs", query_string=query, headers=auth(key)).get_json()
        seen += [run["id"] for run in page["items"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == 5
    by_session = client.get(
        "/api/runs", query_string={"sessionId": "s0"}, headers=auth(key)
    ).get_json()["items"]
    assert len(by_session) == 3
    assert (
        client.get("/api/runs", query_string={"status": "Done"}, headers=auth(key)).status_code
        == 400
    )


@pytest.mark.parametrize("route", ["/api/runs", "/api/approvals"])
@pytest.mark.parametrize(
    "limit",
    ["+5", "%2B5", "%205", "5%20", "5.0", "%D9%A5"],
    ids=["plus", "sign", "blank", "tail", "float", "arabic"],
)
def test_a_limit_with_anything_but_ascii_digits_is_a_400_naming_it(
    client: FlaskClient, key: str, route: str, limit: str
) -> None:
    """`+5` in a query string is `" 5"`; a sign, a blank, a fraction and a digit of another
    script are not the ASCII digits the API description asks for."""
    response = client.get(f"{route}?limit={limit}", headers=auth(key))

    assert response.status_code == 400, response.get_data(as_text=True)[:300]
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["field"] == "limit"
    assert client.get(f"{route}?limit=5", headers=auth(key)).status_code == 200


def test_events_json_and_sse_resume_with_last_event_id(client: FlaskClient, key: str) -> None:
    run_id = client.post(
        "/api/agents/demo/run", json={"message": "x"}, headers=auth(key, Prefer="respond-async")
    ).get_json()["runId"]
    wait_for_status(client, key, run_id, "Completed")
    all_events = client.get(f"/api/runs/{run_id}/events", headers=auth(key)).get_json()["items"]

    resumed = client.get(
        f"/api/runs/{run_id}/events",
        headers=auth(key, Accept="text/event-stream", **{"Last-Event-ID": "3"}),
    )

    frames = parse_sse(resumed.get_data(as_text=True))
    assert [f["id"] for f in frames] == [e["seq"] for e in all_events if e["seq"] > 3]
    assert frames[-1]["event"] == "RunCompleted"


def test_live_tail_follows_a_running_run_without_gaps_or_duplicates(
    client: FlaskClient, key: str, runtime: Runtime, thread_worker: ThreadWorker
) -> None:
    # Given a run that is still queued when the tail subscribes
    runtime.send_runs_with(hold_queued)
    run_id = client.post(
        "/api/agents/demo/run", json={"message": "x"}, headers=auth(key, Prefer="respond-async")
    ).get_json()["runId"]
    thread_worker.start(runtime.executor.execute, run_id, delay=0.3)

    response = client.get(
        f"/api/runs/{run_id}/events", headers=auth(key, Accept="text/event-stream")
    )

    body = response.get_data(as_text=True)
    frames = parse_sse(body)
    assert [f["id"] for f in frames] == list(range(1, len(frames) + 1))
    assert frames[-1]["event"] == "RunCompleted"


def test_tree_lists_the_root(client: FlaskClient, key: str) -> None:
    run_id = client.post(
        "/api/agents/demo/run", json={"message": "x"}, headers=auth(key, Prefer="respond-async")
    ).get_json()["runId"]
    tree = client.get(f"/api/runs/{run_id}/tree", headers=auth(key)).get_json()
    assert tree["rootRunId"] == run_id
    assert [node["id"] for node in tree["runs"]] == [run_id]


def test_enqueue_failure_is_503_and_recorded(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    def refuse(run_id: str) -> None:
        raise EnqueueError("broker down")

    runtime.send_runs_with(refuse)
    response = client.post(
        "/api/agents/demo/run", json={"message": "x"}, headers=auth(key, Prefer="respond-async")
    )

    assert response.status_code == 503
    run_id = response.get_json()["runId"]
    run = client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json()
    assert run["status"] == "Failed" and run["error"]["type"] == "enqueue_failed"


def test_health_readiness_and_openapi(client: FlaskClient) -> None:
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.get_json()["checks"] == {"sql": True, "redis": True}
    spec = client.get("/openapi.json").get_json()
    assert spec["openapi"].startswith("3.1")
    assert "/api/agents/{name}/run" in spec["paths"]
    assert {"/api/approvals", "/api/approvals/{id}", "/api/approvals/{id}/decision"} <= set(
        spec["paths"]
    )
    assert {"/api/agents", "/api/runs/{id}/tool-calls", "/v1/models"} <= set(spec["paths"])
    runs = {p["name"]: p["schema"] for p in spec["paths"]["/api/runs"]["get"]["parameters"]}
    assert runs["limit"] == {"type": "integer", "minimum": 1, "maximum": 200, "default": 50}
    assert runs["sessionId"]["maxLength"] == 200
    schemas = spec["components"]["schemas"]
    assert schemas["RunRequest"]["properties"]["sessionId"]["maxLength"] == 200
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert chat["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert {"model", "messages", "stream"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"model", "input", "stream"} <= set(schemas["ResponsesRequest"]["properties"])


def test_a_submissions_priority_is_kept_on_its_run_and_a_bad_one_is_refused(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    urgent = client.post(
        "/api/agents/demo/run",
        json={"message": "hi", "priority": 9},
        headers=auth(key, Prefer="respond-async"),
    )
    plain = client.post(
        "/api/agents/demo/run", json={"message": "hi"}, headers=auth(key, Prefer="respond-async")
    )
    assert urgent.status_code == plain.status_code == 202
    priorities = []
    for response in (urgent, plain):
        run = runtime.runs.get(response.get_json()["runId"])
        assert run is not None
        priorities.append(run.priority)
    assert priorities == [9, 5]
    for bad in (10, -1, "high"):
        refused = client.post(
            "/api/agents/demo/run", json={"message": "hi", "priority": bad}, headers=auth(key)
        )
        assert refused.status_code == 400, bad
        assert refused.mimetype == "application/problem+json"
        assert refused.get_json()["field"] == "priority"
