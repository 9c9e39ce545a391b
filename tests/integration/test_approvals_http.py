"""Approvals through the real Flask app, real SQL and real Redis: the inbox, one approval,
the decision (200 once, 409 after), tenants, validation, `Idempotency-Key`, draining, the
run JSON, the buffered and streamed answers of a waiting run, cancel, and `/metrics`.

Runs are executed by the real executor on a thread standing in for a worker.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import pytest
from flask.testing import FlaskClient

from tests import tools
from tests.helpers import (
    MakeRuntime,
    Script,
    ThreadWorker,
    auth,
    scripted_agent,
    wait_for_status,
    wait_until,
)
from tracon_jobs.db.models import Approval
from tracon_jobs.runtime import Runtime
from web import create_app

CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]


@pytest.fixture(autouse=True)
def _clean_tool_records() -> None:
    tools.calls.clear()


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker) -> Runtime:
    rt = make_runtime(sql_url, **scripted_agent(CLOSE_THEN_ANSWER, ["close_account"]))
    rt.send_runs_with(thread_worker.sender(rt))
    return rt


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    return create_app(runtime, {"TESTING": True, "SSE_KEEPALIVE_SECONDS": 0.2}).test_client()


@pytest.fixture
def other_key(runtime: Runtime) -> str:
    return runtime.tenants.issue_key(runtime.tenants.ensure_tenant("globex")).secret


def start_waiting(client: FlaskClient, key: str) -> tuple[str, str]:
    """A run submitted with respond-async, once it waits: (run id, approval id)."""
    response = client.post(
        "/api/agents/demo/run",
        json={"message": "close it"},
        headers=auth(key, Prefer="respond-async"),
    )
    assert response.status_code == 202
    run_id = response.get_json()["runId"]
    run = wait_for_status(client, key, run_id, "Waiting")
    [approval_id] = run["pendingApprovals"]
    return run_id, approval_id


def decide(client: FlaskClient, key: str, approval_id: str, body: Any, **headers: str) -> Any:
    path = f"/api/approvals/{approval_id}/decision"
    return client.post(path, json=body, headers=auth(key, **headers))


def approve_when_waiting(runtime: Runtime) -> tuple[threading.Thread, threading.Event]:
    """A person on a thread: approves acme's first pending approval once there is one."""
    tenant = runtime.tenants.find_tenant("acme")
    assert tenant is not None
    decided = threading.Event()

    def first_pending() -> list[Approval]:
        store = runtime.approval_store
        return store.page(tenant, status="Pending", run_id=None, limit=1, before=None)

    def approve() -> None:
        with contextlib.suppress(TimeoutError):  # the test then finds `decided` unset
            wait_until(lambda: bool(first_pending()), what="a pending approval", timeout=10)
            runtime.approvals.decide(tenant, first_pending()[0].id, True)
            decided.set()

    approver = threading.Thread(target=approve, daemon=True)
    approver.start()
    return approver, decided


def parse_sse(body: str) -> list[dict[str, Any]]:
    frames = []
    for block in body.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        if lines:
            fields = dict(line.split(": ", 1) for line in lines)
            frames.append({"event": fields["event"], "data": json.loads(fields["data"])})
    return frames


# -- list, get, decide --------------------------------------------------------------------


def test_list_filters_by_status_and_run_and_pages_with_a_cursor(
    client: FlaskClient, key: str
) -> None:
    first_run, first = start_waiting(client, key)
    second_run, second = start_waiting(client, key)
    _, third = start_waiting(client, key)
    assert decide(client, key, first, {"approve": False}).status_code == 200
    wait_for_status(client, key, first_run, "Completed")

    everything = client.get("/api/approvals", headers=auth(key)).get_json()
    assert [a["id"] for a in everything["items"]] == [third, second, first]  # newest first
    assert everything["nextCursor"] is None
    pending = client.get("/api/approvals?status=Pending", headers=auth(key)).get_json()
    assert {a["id"] for a in pending["items"]} == {second, third}
    rejected = client.get("/api/approvals?status=Rejected", headers=auth(key)).get_json()
    assert [(a["id"], a["runId"]) for a in rejected["items"]] == [(first, first_run)]
    by_run = client.get(f"/api/approvals?runId={second_run}", headers=auth(key)).get_json()
    assert [a["id"] for a in by_run["items"]] == [second]

    page1 = client.get("/api/approvals?limit=2", headers=auth(key)).get_json()
    assert [a["id"] for a in page1["items"]] == [third, second]
    assert page1["nextCursor"]
    page2 = client.get(
        f"/api/approvals?limit=2&cursor={page1['nextCursor']}", headers=auth(key)
    ).get_json()
    assert [a["id"] for a in page2["items"]] == [first] and page2["nextCursor"] is None


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("status=Maybe", "status"),
        ("limit=0", "limit"),
        ("limit=x", "limit"),
        ("cursor=!!", "cursor"),
    ],
)
def test_list_rejects_a_bad_filter_naming_it(
    client: FlaskClient, key: str, query: str, field: str
) -> None:
    response = client.get(f"/api/approvals?{query}", headers=auth(key))

    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["field"] == field


def test_get_then_decide_once_then_409(client: FlaskClient, key: str) -> None:
    run_id, approval_id = start_waiting(client, key)

    got = client.get(f"/api/approvals/{approval_id}", headers=auth(key))
    assert got.status_code == 200
    approval = got.get_json()
    assert approval["status"] == "Pending" and approval["runId"] == run_id
    assert (approval["tool"], approval["arguments"]) == ("close_account", {"account": "acc-1"})
    assert approval["decidedAt"] is None and approval["expiresAt"]

    first = decide(client, key, approval_id, {"approve": True, "comment": "ok by me"})
    assert first.status_code == 200
    body = first.get_json()
    assert body["status"] == "Approved" and body["comment"] == "ok by me"
    assert body["decidedBy"] and body["decidedAt"]

    again = decide(client, key, approval_id, {"approve": False})
    assert again.status_code == 409
    assert again.get_json()["approvalStatus"] == "Approved"
    run = wait_for_status(client, key, run_id, "Completed")
    assert run["output"] == {"text": "Done."} and run["pendingApprovals"] == []
    assert [name for name, _ in tools.calls] == ["close_account"]


def test_another_tenant_gets_404(client: FlaskClient, key: str, other_key: str) -> None:
    _, approval_id = start_waiting(client, key)

    assert client.get(f"/api/approvals/{approval_id}", headers=auth(other_key)).status_code == 404
    assert decide(client, other_key, approval_id, {"approve": True}).status_code == 404
    assert client.get("/api/approvals", headers=auth(other_key)).get_json()["items"] == []
    assert client.get("/api/approvals/nope", headers=auth(key)).status_code == 404
    still = client.get(f"/api/approvals/{approval_id}", headers=auth(key)).get_json()
    assert still["status"] == "Pending"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"approve": "yes"}, "approve"),
        ({"comment": "no approve"}, "approve"),
        ({"approve": True, "by": "me"}, "by"),
    ],
)
def test_a_bad_decision_body_is_400_naming_the_field(
    client: FlaskClient, key: str, body: dict[str, Any], field: str
) -> None:
    _, approval_id = start_waiting(client, key)

    response = decide(client, key, approval_id, body)

    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["field"] == field
    still = client.get(f"/api/approvals/{approval_id}", headers=auth(key)).get_json()
    assert still["status"] == "Pending"


def test_idempotency_key_replays_the_first_200_byte_identically(
    client: FlaskClient, key: str
) -> None:
    run_id, approval_id = start_waiting(client, key)

    first = decide(client, key, approval_id, {"approve": True}, **{"Idempotency-Key": "d-1"})
    again = decide(client, key, approval_id, {"approve": True}, **{"Idempotency-Key": "d-1"})

    assert first.status_code == again.status_code == 200
    assert again.data == first.data
    assert again.headers["Idempotency-Replayed"] == "true"
    wait_for_status(client, key, run_id, "Completed")
    assert [name for name, _ in tools.calls] == ["close_account"]


def test_a_decision_is_accepted_while_the_node_drains(runtime: Runtime, key: str) -> None:
    from web.draining import RUN_STARTING_ENDPOINTS

    assert "approvals.decide" not in RUN_STARTING_ENDPOINTS
    client = create_app(runtime, {"TESTING": True}).test_client()
    run_id, approval_id = start_waiting(client, key)
    draining = create_app(runtime, {"TESTING": True, "TRACON_DRAINING": True}).test_client()
    refused = draining.post(
        "/api/agents/demo/run", json={"message": "x"}, headers=auth(key, Prefer="respond-async")
    )
    assert refused.status_code == 503

    assert decide(draining, key, approval_id, {"approve": True}).status_code == 200
    wait_for_status(draining, key, run_id, "Completed")


# -- runs that wait -------------------------------------------------------------------------


def test_the_run_json_of_a_waiting_run_shows_its_pending_approvals(
    client: FlaskClient, key: str
) -> None:
    run_id, approval_id = start_waiting(client, key)

    run = client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json()
    assert run["status"] == "Waiting" and run["pendingApprovals"] == [approval_id]
    listed = client.get("/api/runs?status=Waiting", headers=auth(key)).get_json()
    assert [r["pendingApprovals"] for r in listed["items"]] == [[approval_id]]


def test_a_buffered_run_that_starts_waiting_answers_202_with_location(
    client: FlaskClient, key: str
) -> None:
    response = client.post(
        "/api/agents/demo/run",
        json={"message": "close it"},
        headers=auth(key, **{"Idempotency-Key": "b-1"}),
    )

    assert response.status_code == 202
    run = response.get_json()
    assert run["status"] == "Waiting" and len(run["pendingApprovals"]) == 1
    assert response.headers["Location"] == f"/api/runs/{run['id']}"
    assert decide(client, key, run["pendingApprovals"][0], {"approve": True}).status_code == 200
    wait_for_status(client, key, run["id"], "Completed")


def test_the_stream_of_a_waiting_run_stays_open_until_its_end(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    approver, decided = approve_when_waiting(runtime)
    response = client.post("/api/agents/demo/run", json={"message": "close it"}, headers=auth(key))
    frames = parse_sse(response.get_data(as_text=True))
    approver.join(10)

    assert decided.is_set()
    events = [f["event"] for f in frames]
    waiting = events.index("RunWaiting")
    assert "ApprovalRequested" in events[:waiting]
    assert "ApprovalDecided" in events[waiting:]
    assert events[-1] == "RunCompleted"
    assert events.count("RunCompleted") == 1
    assert frames[-1]["data"]["data"]["output"] == {"text": "Done."}


def test_the_stream_of_a_waiting_run_sends_no_terminal_event_while_it_waits(
    client: FlaskClient, key: str
) -> None:
    run_id, _ = start_waiting(client, key)
    response = client.get(
        f"/api/runs/{run_id}/events",
        headers=auth(key, Accept="text/event-stream"),
        buffered=False,
    )
    chunks = response.response
    seen: list[str] = []
    deadline = time.monotonic() + 1.0
    for chunk in chunks:  # keep-alives come every 0.2 s, so this loop wakes up
        text = chunk.decode() if isinstance(chunk, bytes) else chunk
        seen.extend(f["event"] for f in parse_sse(text))
        if time.monotonic() > deadline:
            break
    response.close()

    assert "RunWaiting" in seen and "ApprovalRequested" in seen
    assert not {"RunCompleted", "RunFailed", "RunCanceled"} & set(seen)


def test_cancel_of_a_waiting_run_is_202_and_cancels_it_at_once(
    client: FlaskClient, key: str
) -> None:
    run_id, approval_id = start_waiting(client, key)

    response = client.post(f"/api/runs/{run_id}/cancel", headers=auth(key))

    assert response.status_code == 202
    run = client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json()
    assert run["status"] == "Canceled" and run["pendingApprovals"] == []
    approval = client.get(f"/api/approvals/{approval_id}", headers=auth(key)).get_json()
    assert approval["status"] == "Canceled"
    assert decide(client, key, approval_id, {"approve": True}).status_code == 409
    assert tools.calls == []


# -- /metrics -------------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_metrics_show_pending_approvals_and_decisions_from_sql(
    client: FlaskClient, key: str
) -> None:
    run_id, first = start_waiting(client, key)
    _, second = start_waiting(client, key)

    before = client.get("/metrics").get_data(as_text=True)
    assert metric(before, "tracon_approvals_pending") == 2
    assert metric(before, 'tracon_approval_decisions_total{outcome="approved"}') == 0

    assert decide(client, key, first, {"approve": True}).status_code == 200
    wait_for_status(client, key, run_id, "Completed")
    assert decide(client, key, second, {"approve": False}).status_code == 200

    after = client.get("/metrics").get_data(as_text=True)
    assert metric(after, "tracon_approvals_pending") == 0
    assert metric(after, 'tracon_approval_decisions_total{outcome="approved"}') == 1
    assert metric(after, 'tracon_approval_decisions_total{outcome="rejected"}') == 1
    assert metric(after, 'tracon_approval_decisions_total{outcome="expired"}') == 0
    bucket = 'tracon_approval_decision_seconds_bucket{le="60.0",outcome="approved"}'
    assert metric(after, bucket) == 1
    assert metric(after, 'tracon_approval_decision_seconds_count{outcome="approved"}') == 1
    assert 0 <= metric(after, 'tracon_approval_decision_seconds_sum{outcome="approved"}') < 60


# -- /v1 ------------------------------------------------------------------------------------


V1 = [
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "go"}]}),
    ("/v1/responses", {"model": "demo", "input": "go"}),
]


@pytest.mark.parametrize(("path", "body"), V1, ids=["chat", "responses"])
def test_v1_answers_409_naming_the_waiting_run(
    client: FlaskClient, key: str, path: str, body: dict[str, Any]
) -> None:
    response = client.post(path, json=body, headers=auth(key))

    assert response.status_code == 409
    error = response.get_json()["error"]
    run_id = response.headers["X-Tracon-Run-Id"]
    assert response.headers["Location"] == f"/api/runs/{run_id}"
    assert response.headers["x-should-retry"] == "false"
    assert error["code"] == "run_waiting_for_approval" and run_id in error["message"]
    [approval_id] = client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json()[
        "pendingApprovals"
    ]
    assert approval_id in error["message"]
    assert decide(client, key, approval_id, {"approve": True}).status_code == 200
    wait_for_status(client, key, run_id, "Completed")


@pytest.mark.parametrize(("path", "body"), V1, ids=["chat", "responses"])
def test_v1_stream_stays_open_until_the_run_ends(
    client: FlaskClient, key: str, runtime: Runtime, path: str, body: dict[str, Any]
) -> None:
    approver, decided = approve_when_waiting(runtime)
    response = client.post(path, json={**body, "stream": True}, headers=auth(key))
    text = response.get_data(as_text=True)
    approver.join(10)

    assert response.status_code == 200 and decided.is_set()
    assert "Done." in text
    if path == "/v1/chat/completions":
        assert text.rstrip().endswith("data: [DONE]")
    else:
        assert "response.completed" in text


def test_openapi_describes_the_approval_routes(client: FlaskClient) -> None:
    spec = client.get("/openapi.json").get_json()

    listing = spec["paths"]["/api/approvals"]["get"]
    params = {p["name"]: p["schema"] for p in listing["parameters"]}
    assert params["status"]["enum"] == ["Pending", "Approved", "Rejected", "Expired", "Canceled"]
    assert {"runId", "limit", "cursor"} <= set(params)
    assert "200" in spec["paths"]["/api/approvals/{id}"]["get"]["responses"]
    decision = spec["paths"]["/api/approvals/{id}/decision"]["post"]
    assert {"200", "400", "404", "409"} <= set(decision["responses"])
    assert spec["components"]["schemas"]["Decision"]["required"] == ["approve"]
    assert "pendingApprovals" in spec["components"]["schemas"]["Run"]["properties"]
