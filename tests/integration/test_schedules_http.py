"""`/api/schedules` through the real Flask app, real SQL and real Redis: creation (201 with
`Location`, the schedule's JSON), each broken rule a problem+json naming the field (400, and
422 for a target that is not there), a duplicate name 409; the list, one schedule, pause,
resume, delete (204) and the fires; another tenant's schedule 404 on every route."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from tests.helpers import MakeRuntime, auth, hold_queued, scripted_agent
from tracon_jobs.runtime import Runtime
from web import create_app

BODY = {"name": "nightly", "cron": "0 3 * * *", "target": {"agent": "demo"}}


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    sections = {**scripted_agent([{"Text": "ok"}]), "WorkflowModules": ["tests.workflows"]}
    return make_runtime(sql_url, sender=hold_queued, **sections)


@pytest.fixture
def app(runtime: Runtime) -> Flask:
    return create_app(runtime, {"TESTING": True})


@pytest.fixture
def other_key(runtime: Runtime) -> str:
    return runtime.tenants.issue_key(runtime.tenants.ensure_tenant("globex")).secret


def create(client: FlaskClient, key: str, **changes: Any) -> TestResponse:
    body = {**BODY, "input": {"message": "report"}, **changes}
    body = {name: value for name, value in body.items() if value is not None}
    return client.post("/api/schedules", json=body, headers=auth(key))


def created(client: FlaskClient, key: str, **changes: Any) -> dict[str, Any]:
    response = create(client, key, **changes)
    assert response.status_code == 201, response.get_data(as_text=True)
    body: dict[str, Any] = response.get_json()
    return body


def problem(response: TestResponse, status: int, field: str) -> dict[str, Any]:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    body: dict[str, Any] = response.get_json()
    assert body["field"] == field and body["detail"].startswith(f"{field}: ")
    return body


def test_create_answers_201_with_the_schedule_and_location(client: FlaskClient, key: str) -> None:
    response = create(client, key, timezone="Europe/Paris", overlap="queue", catchUp="latest")

    assert response.status_code == 201
    body = response.get_json()
    assert response.headers["Location"] == f"/api/schedules/{body['id']}"
    assert {k: body[k] for k in ("name", "cron", "timezone", "interval", "target", "input")} == {
        "name": "nightly",
        "cron": "0 3 * * *",
        "timezone": "Europe/Paris",
        "interval": None,
        "target": {"agent": "demo"},
        "input": {"message": "report"},
    }
    assert (body["overlap"], body["catchUp"], body["paused"]) == ("queue", "latest", False)
    assert (body["lastFireAt"], body["lastRunId"]) == (None, None)
    next_fire = datetime.fromisoformat(body["nextFireAt"].rstrip("Z"))
    assert next_fire.minute == 0 and next_fire.hour in (1, 2)  # 03:00 in Paris, in UTC


def test_an_interval_schedule_takes_seconds_or_a_duration(client: FlaskClient, key: str) -> None:
    by_seconds = created(client, key, name="a", cron=None, interval=90)
    by_iso = created(client, key, name="b", cron=None, interval="PT1M30S")
    by_timespan = created(client, key, name="c", cron=None, interval="00:01:30")

    assert by_seconds["interval"] == by_iso["interval"] == by_timespan["interval"] == 90
    assert by_seconds["timezone"] is None and by_seconds["cron"] is None
    created_at = datetime.fromisoformat(by_seconds["createdAt"].rstrip("Z"))
    next_fire = datetime.fromisoformat(by_seconds["nextFireAt"].rstrip("Z"))
    assert next_fire - created_at == timedelta(seconds=90)


@pytest.mark.parametrize(
    ("changes", "status", "field"),
    [
        ({"name": ""}, 400, "name"),
        ({"name": "n" * 101}, 400, "name"),
        ({"cron": None}, 400, "cron"),
        ({"interval": 60}, 400, "cron"),
        ({"cron": "0 3 * *"}, 400, "cron"),
        ({"cron": "61 * * * *"}, 400, "cron"),
        ({"cron": "0 0 30 2 *"}, 400, "cron"),
        ({"timezone": "Mars/Olympus"}, 400, "timezone"),
        ({"cron": None, "interval": 0.5}, 400, "interval"),
        ({"cron": None, "interval": "soon"}, 400, "interval"),
        ({"cron": None, "interval": 60, "timezone": "UTC"}, 400, "timezone"),
        ({"target": {"agent": "demo", "workflow": "x"}}, 400, "target"),
        ({"target": "demo"}, 400, "target"),
        ({"target": {"agent": "nobody"}}, 422, "target.agent"),
        ({"target": {"workflow": "nothing"}}, 422, "target.workflow"),
        ({"input": []}, 400, "input"),
        ({"input": {}}, 400, "input.message"),
        ({"input": {"message": "hi", "temperature": 2}}, 400, "input.temperature"),
        ({"overlap": "sometimes"}, 400, "overlap"),
        ({"catchUp": "everything"}, 400, "catchUp"),
        ({"paused": "yes"}, 400, "paused"),
        ({"color": "red"}, 400, "color"),
    ],
)
def test_each_rule_is_a_problem_naming_the_field(
    client: FlaskClient, key: str, changes: dict[str, Any], status: int, field: str
) -> None:
    problem(create(client, key, **changes), status, field)
    listed = client.get("/api/schedules", headers=auth(key)).get_json()
    assert listed["items"] == []


def test_a_workflow_target_must_be_registered(client: FlaskClient, key: str) -> None:
    body = created(client, key, target={"workflow": "three-nodes"}, input={"order": 1})
    assert body["target"] == {"workflow": "three-nodes"}


def test_a_duplicate_name_is_409_and_another_tenant_may_use_it(
    client: FlaskClient, key: str, other_key: str
) -> None:
    created(client, key)

    problem(create(client, key), 409, "name")
    created(client, other_key)


def test_list_pages_newest_first(client: FlaskClient, key: str) -> None:
    names = [created(client, key, name=f"s{i}")["name"] for i in range(3)]

    first = client.get("/api/schedules?limit=2", headers=auth(key)).get_json()
    cursor = first["nextCursor"]
    second = client.get(f"/api/schedules?limit=2&cursor={cursor}", headers=auth(key)).get_json()

    listed = [s["name"] for s in first["items"] + second["items"]]
    assert sorted(listed) == sorted(names) and len(listed) == 3
    assert second["nextCursor"] is None


def test_pause_resume_and_delete(client: FlaskClient, key: str) -> None:
    schedule = created(client, key, cron=None, interval=60)
    path = f"/api/schedules/{schedule['id']}"

    paused = client.post(f"{path}/pause", headers=auth(key)).get_json()
    assert (paused["paused"], paused["nextFireAt"]) == (True, None)
    resumed = client.post(f"{path}/resume", headers=auth(key)).get_json()
    assert resumed["paused"] is False and resumed["nextFireAt"] is not None
    assert client.get(path, headers=auth(key)).get_json() == resumed

    assert client.delete(path, headers=auth(key)).status_code == 204
    assert client.get(path, headers=auth(key)).status_code == 404


def test_fires_list_the_recorded_slots(client: FlaskClient, key: str, runtime: Runtime) -> None:
    schedule = created(client, key, cron=None, interval=60)
    next_fire = datetime.fromisoformat(schedule["nextFireAt"].rstrip("Z"))

    runtime.schedule_firing.scan_once(next_fire + timedelta(seconds=1))

    fires = client.get(f"/api/schedules/{schedule['id']}/fires", headers=auth(key)).get_json()
    (fire,) = fires["items"]
    assert fire["slotAt"] == schedule["nextFireAt"] and fire["outcome"] == "fired"
    run = client.get(f"/api/runs/{fire['runId']}", headers=auth(key)).get_json()
    assert (run["agent"], run["sessionId"]) == ("demo", f"schedule:{schedule['id']}")
    again = client.get(f"/api/schedules/{schedule['id']}", headers=auth(key)).get_json()
    assert (again["lastRunId"], again["lastFireAt"]) == (fire["runId"], fire["slotAt"])


@pytest.mark.parametrize(
    ("method", "suffix"),
    [
        ("get", ""),
        ("delete", ""),
        ("post", "/pause"),
        ("post", "/resume"),
        ("get", "/fires"),
    ],
)
def test_another_tenants_schedule_is_404_everywhere(
    client: FlaskClient, key: str, other_key: str, method: str, suffix: str
) -> None:
    schedule = created(client, key)
    path = f"/api/schedules/{schedule['id']}{suffix}"

    response = getattr(client, method)(path, headers=auth(other_key))

    assert response.status_code == 404 and response.mimetype == "application/problem+json"
    assert client.get(f"/api/schedules/{schedule['id']}", headers=auth(key)).get_json() == schedule
    assert client.get("/api/schedules", headers=auth(other_key)).get_json()["items"] == []
