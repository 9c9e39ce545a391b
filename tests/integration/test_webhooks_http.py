"""`/api/webhooks` through the real Flask app, real SQL and real Redis: creation (201, the
secret once, `Location`), the list and one endpoint (never a secret), changes, removal (204),
rotation, deliveries with their attempts and redelivery (202); problem+json 400s naming the
field and the rule; another tenant's endpoint 404 on every route; `Idempotency-Key` on the
creation and the rotation; served while the node drains; the notices to other processes."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from tests.helpers import MakeRuntime, auth, hold_queued
from tests.webhook_rows import Tried, delivery, delivery_row, heard, subscribed
from tracon_jobs.runtime import Runtime
from tracon_jobs.webhooks.events import CHANGED_CHANNEL, TENANT_EVENTS, WAKE_CHANNEL
from web import create_app

URL = "https://hooks.example.com/tracon"


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url, sender=hold_queued)


@pytest.fixture
def app(runtime: Runtime) -> Flask:
    return create_app(runtime, {"TESTING": True})


@pytest.fixture
def other_key(runtime: Runtime) -> str:
    return runtime.tenants.issue_key(runtime.tenants.ensure_tenant("globex")).secret


def create(client: FlaskClient, key: str, body: Any, **headers: str) -> TestResponse:
    return client.post("/api/webhooks", json=body, headers=auth(key, **headers))


def created(client: FlaskClient, key: str, events: list[str] | None = None) -> dict[str, Any]:
    response = create(client, key, {"url": URL, "events": events or ["run.completed"]})
    assert response.status_code == 201, response.get_data(as_text=True)
    body: dict[str, Any] = response.get_json()
    return body


def problem(response: TestResponse, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    body: dict[str, Any] = response.get_json()
    assert body["status"] == status and body["detail"]
    return body


def tenant_of(runtime: Runtime, name: str) -> str:
    found = runtime.tenants.find_tenant(name)
    assert found is not None
    return found


# -- the endpoint ----------------------------------------------------------------------------


def test_create_answers_201_with_the_secret_once_and_location(
    client: FlaskClient, key: str
) -> None:
    response = create(client, key, {"url": URL, "events": ["run.completed", "approval.requested"]})

    assert response.status_code == 201 and response.mimetype == "application/json"
    body = response.get_json()
    assert response.headers["Location"] == f"/api/webhooks/{body['id']}"
    assert body["secret"].startswith("whsec_")
    assert (body["url"], body["events"], body["enabled"]) == (
        URL,
        ["run.completed", "approval.requested"],
        True,
    )
    read = client.get(response.headers["Location"], headers=auth(key))
    listed = client.get("/api/webhooks", headers=auth(key))
    for answer in (read, listed):
        assert answer.status_code == 200
        assert "secret" not in answer.get_data(as_text=True)
        assert body["secret"] not in answer.get_data(as_text=True)
    assert read.get_json() == {k: v for k, v in body.items() if k != "secret"}
    assert listed.get_json() == {"items": [read.get_json()], "nextCursor": None}


def test_the_list_pages_with_a_cursor(client: FlaskClient, key: str) -> None:
    ids = [created(client, key)["id"] for _ in range(3)]

    first = client.get("/api/webhooks?limit=2", headers=auth(key)).get_json()
    rest = client.get(f"/api/webhooks?cursor={first['nextCursor']}", headers=auth(key)).get_json()

    assert len(first["items"]) == 2 and first["nextCursor"]
    assert {e["id"] for e in first["items"] + rest["items"]} == set(ids)
    assert rest["nextCursor"] is None
    bad = client.get("/api/webhooks?cursor=nope", headers=auth(key))
    assert problem(bad, 400)["field"] == "cursor"
    assert problem(client.get("/api/webhooks?limit=0", headers=auth(key)), 400)["field"] == "limit"


def test_patch_changes_and_disables_then_enables(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    endpoint = created(client, key)
    path = f"/api/webhooks/{endpoint['id']}"

    changed = client.patch(
        path, json={"events": ["run.failed"], "description": "ops"}, headers=auth(key)
    )
    assert changed.status_code == 200
    assert (changed.get_json()["events"], changed.get_json()["description"]) == (
        ["run.failed"],
        "ops",
    )
    disabled = client.patch(path, json={"enabled": False}, headers=auth(key)).get_json()
    assert disabled["enabled"] is False and disabled["disabledAt"]
    assert disabled["disabledReason"] == "disabled by the tenant"
    enabled = client.patch(path, json={"enabled": True}, headers=auth(key)).get_json()
    assert (enabled["enabled"], enabled["disabledAt"], enabled["disabledReason"]) == (
        True,
        None,
        None,
    )
    assert "secret" not in enabled


def test_delete_answers_204_then_404(client: FlaskClient, key: str, runtime: Runtime) -> None:
    endpoint = created(client, key)
    pending, _ = delivery(runtime.db, endpoint["id"], tenant_of(runtime, "acme"))
    path = f"/api/webhooks/{endpoint['id']}"

    response = client.delete(path, headers=auth(key))

    assert response.status_code == 204 and response.get_data() == b""
    assert delivery_row(runtime.db, pending).status == "canceled"
    for answer in (client.get(path, headers=auth(key)), client.delete(path, headers=auth(key))):
        problem(answer, 404)
    assert client.get(f"{path}/deliveries", headers=auth(key)).status_code == 404


def test_rotation_answers_the_new_secret_and_when_the_old_one_stops(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    endpoint = created(client, key)
    path = f"/api/webhooks/{endpoint['id']}/rotate-secret"

    rotated = client.post(path, headers=auth(key))

    assert rotated.status_code == 200
    body = rotated.get_json()
    assert body["secret"].startswith("whsec_") and body["secret"] != endpoint["secret"]
    expires = datetime.fromisoformat(body["previousSecretExpiresAt"].rstrip("Z"))
    hours = (expires - runtime.db.now()).total_seconds() / 3600
    assert 23.9 < hours <= 24  # Webhooks.RotationGrace
    stored = client.get(f"/api/webhooks/{endpoint['id']}", headers=auth(key))
    assert stored.get_json()["previousSecretExpiresAt"] == body["previousSecretExpiresAt"]

    short = client.post(path, json={"graceSeconds": 60}, headers=auth(key)).get_json()
    until = datetime.fromisoformat(short["previousSecretExpiresAt"].rstrip("Z"))
    assert 0 < (until - runtime.db.now()).total_seconds() <= 60
    cut = client.post(path, json={"graceSeconds": 0.0}, headers=auth(key)).get_json()
    assert cut["previousSecretExpiresAt"] is None
    default = client.post(path, json={}, headers=auth(key)).get_json()
    until = datetime.fromisoformat(default["previousSecretExpiresAt"].rstrip("Z"))
    assert (until - runtime.db.now()).total_seconds() > 23.9 * 3600
    bad_bodies = ({"graceSeconds": -1}, {"graceSeconds": "60"}, {"graceSeconds": 1.5})
    for bad in (*bad_bodies, {"graceSeconds": True}, {"grace": 5}, [60]):
        refused = problem(client.post(path, json=bad, headers=auth(key)), 400)
        assert refused["field"] in {"graceSeconds", "grace", "body"}


# -- bodies refused --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"url": "http://hooks.example.com/", "events": ["run.failed"]}, "url", "https"),
        ({"url": "https://127.0.0.1:9/", "events": ["run.failed"]}, "url", "loopback"),
        ({"url": "https://169.254.169.254/", "events": ["run.failed"]}, "url", "link-local"),
        ({"url": URL}, "events", "is required"),
        ({"url": URL, "events": []}, "events", "at least one"),
        ({"url": URL, "events": ["run.failed", "run.failed"]}, "events[1]", "twice"),
        ({"url": URL, "events": ["run.failed"], "description": "d" * 1001}, "description", "1000"),
        ({"url": URL, "events": ["run.failed"], "enabled": False}, "enabled", "not a field"),
        ({"url": URL, "events": ["run.failed"], "secret": "whsec_x"}, "secret", "not a field"),
    ],
)
def test_a_bad_creation_is_a_400_naming_the_field_and_the_rule(
    client: FlaskClient, key: str, body: dict[str, Any], field: str, words: str
) -> None:
    refused = problem(create(client, key, body), 400)

    assert refused["field"] == field and refused["detail"].startswith(f"{field}: ")
    assert words in refused["detail"]
    assert client.get("/api/webhooks", headers=auth(key)).get_json()["items"] == []


def test_an_unknown_event_type_is_named_by_its_place_and_the_allowed_listed(
    client: FlaskClient, key: str
) -> None:
    body = {"url": URL, "events": ["run.completed", "run.failed", "run.exploded"]}

    refused = problem(create(client, key, body), 400)

    assert refused["field"] == "events[2]" and "'run.exploded'" in refused["detail"]
    assert refused["allowed"] == list(TENANT_EVENTS)


def test_bodies_that_are_not_json_objects_and_empty_patches_are_400(
    client: FlaskClient, key: str
) -> None:
    endpoint = created(client, key)
    path = f"/api/webhooks/{endpoint['id']}"
    headers = auth(key, **{"Content-Type": "application/json"})

    assert problem(client.post("/api/webhooks", data="[1", headers=headers), 400)["field"] == "body"
    assert problem(client.post("/api/webhooks", headers=auth(key)), 400)["field"] == "body"
    assert problem(client.patch(path, json={}, headers=auth(key)), 400)["field"] == "body"
    assert problem(client.patch(path, json={"enabled": 1}, headers=auth(key)), 400)["field"] == (
        "enabled"
    )
    nul = client.post("/api/webhooks", json={"url": URL + "\x00", "events": []}, headers=auth(key))
    assert problem(nul, 400)["field"] == "url"


def test_the_url_policy_follows_the_settings(
    make_runtime: MakeRuntime, sql_url: str, redis_url: str
) -> None:
    rt = make_runtime(
        sql_url, sender=hold_queued, Webhooks={"AllowHttp": True, "AllowPrivateNetworks": True}
    )
    client = create_app(rt, {"TESTING": True}).test_client()
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret

    local = create(client, key, {"url": "http://127.0.0.1:9000/hook", "events": ["run.failed"]})

    assert local.status_code == 201, local.get_data(as_text=True)


# -- tenants, authentication, drain ----------------------------------------------------------


def test_another_tenants_endpoint_is_404_on_every_route(
    client: FlaskClient, key: str, other_key: str, runtime: Runtime
) -> None:
    endpoint = created(client, key)
    delivery_id, _ = delivery(
        runtime.db, endpoint["id"], tenant_of(runtime, "acme"), status="failed"
    )
    path = f"/api/webhooks/{endpoint['id']}"
    answers = [
        client.get(path, headers=auth(other_key)),
        client.patch(path, json={"enabled": False}, headers=auth(other_key)),
        client.delete(path, headers=auth(other_key)),
        client.post(f"{path}/rotate-secret", headers=auth(other_key)),
        client.get(f"{path}/deliveries", headers=auth(other_key)),
        client.post(f"{path}/deliveries/{delivery_id}/redeliver", headers=auth(other_key)),
    ]

    for answer in answers:
        problem(answer, 404)
    assert client.get("/api/webhooks", headers=auth(other_key)).get_json()["items"] == []
    mine = client.get(path, headers=auth(key)).get_json()
    assert mine["enabled"] is True and mine["previousSecretExpiresAt"] is None
    assert delivery_row(runtime.db, delivery_id).status == "failed"


def test_every_route_needs_a_key(client: FlaskClient) -> None:
    for method, path in [
        ("GET", "/api/webhooks"),
        ("POST", "/api/webhooks"),
        ("GET", "/api/webhooks/x"),
        ("PATCH", "/api/webhooks/x"),
        ("DELETE", "/api/webhooks/x"),
        ("POST", "/api/webhooks/x/rotate-secret"),
        ("GET", "/api/webhooks/x/deliveries"),
        ("POST", "/api/webhooks/x/deliveries/y/redeliver"),
    ]:
        answer = client.open(path, method=method)
        assert problem(answer, 401) and answer.headers["WWW-Authenticate"] == "Bearer"


def test_the_routes_are_served_while_the_node_drains(runtime: Runtime, key: str) -> None:
    client = create_app(runtime, {"TESTING": True, "TRACON_DRAINING": True}).test_client()

    endpoint = created(client, key)

    assert client.get(f"/api/webhooks/{endpoint['id']}", headers=auth(key)).status_code == 200


# -- idempotency -----------------------------------------------------------------------------


def test_a_retried_creation_with_its_key_gets_the_same_endpoint_and_secret(
    client: FlaskClient, key: str
) -> None:
    body = {"url": URL, "events": ["run.completed"]}
    first = create(client, key, body, **{"Idempotency-Key": "hook-1"})
    again = create(client, key, body, **{"Idempotency-Key": "hook-1"})

    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.get_json() == first.get_json() and again.headers["Location"]
    assert len(client.get("/api/webhooks", headers=auth(key)).get_json()["items"]) == 1
    other = create(client, key, {**body, "description": "x"}, **{"Idempotency-Key": "hook-1"})
    assert problem(other, 422)["code"] == "idempotency_key_reused"


def test_a_retried_rotation_with_its_key_rotates_once(client: FlaskClient, key: str) -> None:
    endpoint = created(client, key)
    path = f"/api/webhooks/{endpoint['id']}/rotate-secret"
    headers = auth(key, **{"Idempotency-Key": "rotate-1"})

    first = client.post(path, headers=headers).get_json()
    again = client.post(path, headers=headers).get_json()

    assert again == first
    # the secret the endpoint had still signs: one rotation, not two
    later = client.post(path, json={"graceSeconds": 0}, headers=auth(key)).get_json()
    assert later["secret"] not in {first["secret"], endpoint["secret"]}


# -- deliveries ------------------------------------------------------------------------------


def test_deliveries_show_each_attempt_and_redeliver_makes_one_pending(
    client: FlaskClient, key: str, runtime: Runtime, redis_client: redis.Redis
) -> None:
    endpoint = created(client, key)
    tenant = tenant_of(runtime, "acme")
    tried = (Tried(None, 10_000, "timed out"), Tried(502, 75, "HTTP 502", "bad gateway"))
    failed, message = delivery(runtime.db, endpoint["id"], tenant, status="failed", tried=tried)
    path = f"/api/webhooks/{endpoint['id']}/deliveries"

    listed = client.get(path, headers=auth(key)).get_json()

    [shown] = listed["items"]
    assert (shown["id"], shown["webhookId"], shown["type"], shown["status"]) == (
        failed,
        message,
        "run.completed",
        "failed",
    )
    assert shown["attemptCount"] == 2 and shown["nextAttemptAt"] is None
    assert [
        (a["status"], a["latencyMs"], a["error"], a["response"]) for a in shown["attempts"]
    ] == [
        (None, 10_000, "timed out", ""),
        (502, 75, "HTTP 502", "bad gateway"),
    ]
    assert client.get(f"{path}?status=pending", headers=auth(key)).get_json()["items"] == []
    assert problem(client.get(f"{path}?status=lost", headers=auth(key)), 400)["field"] == "status"

    listener = subscribed(redis_client, WAKE_CHANNEL)
    again = client.post(f"{path}/{failed}/redeliver", headers=auth(key))

    assert again.status_code == 202
    assert again.get_json()["status"] == "pending" and again.get_json()["nextAttemptAt"]
    assert delivery_row(runtime.db, failed).status == "pending"
    assert heard(listener, 1) == [WAKE_CHANNEL]
    problem(client.post(f"{path}/nope/redeliver", headers=auth(key)), 404)


def test_redeliver_to_a_disabled_endpoint_is_409(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    endpoint = created(client, key)
    failed, _ = delivery(runtime.db, endpoint["id"], tenant_of(runtime, "acme"), status="failed")
    client.patch(f"/api/webhooks/{endpoint['id']}", json={"enabled": False}, headers=auth(key))

    refused = client.post(
        f"/api/webhooks/{endpoint['id']}/deliveries/{failed}/redeliver", headers=auth(key)
    )

    assert problem(refused, 409)["code"] == "endpoint_disabled"
    assert delivery_row(runtime.db, failed).status == "failed"


def test_each_change_over_http_tells_the_other_processes(
    client: FlaskClient, key: str, redis_client: redis.Redis
) -> None:
    listener = subscribed(redis_client, CHANGED_CHANNEL)

    endpoint = created(client, key)
    path = f"/api/webhooks/{endpoint['id']}"
    client.patch(path, json={"description": "x"}, headers=auth(key))
    client.post(f"{path}/rotate-secret", headers=auth(key))
    client.get(path, headers=auth(key))
    client.delete(path, headers=auth(key))

    assert heard(listener, 4) == [CHANGED_CHANNEL] * 4


def test_no_secret_reaches_the_logs(
    client: FlaskClient, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    endpoint = created(client, key)
    rotated = client.post(f"/api/webhooks/{endpoint['id']}/rotate-secret", headers=auth(key))

    logged = "\n".join(record.getMessage() for record in caplog.records)
    for secret in (endpoint["secret"], rotated.get_json()["secret"]):
        assert secret not in logged
