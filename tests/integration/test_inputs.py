"""No client input gives a 500: bad inputs at the edge are `400` problem+json naming the
field (OpenAI's error shape on `/v1`), bodies are bounded (`413`), and the framework's own
`404`/`405` are problem+json too. Every test runs on SQLite and on PostgreSQL, whose `json`
and `text` refuse what SQLite stores (NUL characters, `NaN`)."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from tests.helpers import MakeRuntime, auth, hold_queued, scripted_agent
from tracon_jobs.runs.store import RunFilter
from tracon_jobs.runtime import Runtime
from web import create_app

ASYNC = {"Prefer": "respond-async", "Content-Type": "application/json"}


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url, sender=hold_queued, **scripted_agent([{"Text": "ok"}]))


@pytest.fixture
def app(runtime: Runtime) -> Flask:
    return create_app(runtime, {"TESTING": True})


def problem(response: TestResponse, status: int, field: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    assert response.mimetype == "application/problem+json"
    body: dict[str, Any] = response.get_json()
    assert body["status"] == status and body["title"] and body["detail"]
    if field is not None:
        assert body["field"] == field, body
    return body


def openai_error(response: TestResponse, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    assert response.mimetype == "application/json"
    error: dict[str, Any] = response.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    return error


def nested(depth: int) -> str:
    return '{"message": "x", "parameters": {"a": ' + "[" * depth + "]" * depth + "}}"


# -- 1. NUL characters ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/api/runs/%00", "id"),
        ("/api/runs/a%00b/events", "id"),
        ("/api/runs/%00/tool-calls", "id"),
        ("/api/runs/%00/tree", "id"),
        ("/api/approvals/%00", "id"),
        ("/api/runs?sessionId=%00", "sessionId"),
        ("/api/runs?agent=demo%00", "agent"),
        ("/api/approvals?runId=%00", "runId"),
        ("/api/statistics/runs?agent=%00", "agent"),
        ("/v1/models/%00", "model"),
    ],
)
def test_a_nul_character_in_a_path_or_query_is_a_400_naming_it(
    client: FlaskClient, key: str, path: str, field: str
) -> None:
    response = client.get(path, headers=auth(key))

    if path.startswith("/v1"):
        openai_error(response, 400, field)
    else:
        problem(response, 400, field)


@pytest.mark.parametrize("route", ["/api/runs", "/api/approvals"])
def test_a_cursor_with_a_nul_character_is_a_400_naming_it(
    client: FlaskClient, key: str, route: str
) -> None:
    cursor = base64.urlsafe_b64encode(b"2026-01-01T00:00:00|\x00").decode().rstrip("=")

    problem(client.get(f"{route}?cursor={cursor}", headers=auth(key)), 400, "cursor")


@pytest.mark.parametrize(
    "raw", [b"2026-01-01T00:00:00+14:00|r", b"0001-01-01T00:00:00+14:00|r", b"x" * 300]
)
def test_a_cursor_this_api_did_not_return_is_a_400(
    client: FlaskClient, key: str, raw: bytes
) -> None:
    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")

    problem(client.get(f"/api/runs?cursor={cursor}", headers=auth(key)), 400, "cursor")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"message": "a\u0000b"}, "message"),
        ({"message": "x", "sessionId": "\u0000"}, "sessionId"),
        ({"message": "x", "parameters": {"k": ["\u0000"]}}, "parameters.k.0"),
        ({"message": "x", "parameters": {"\u0000": 1}}, "parameters"),
    ],
)
def test_a_nul_character_in_a_body_is_a_400_naming_the_field(
    client: FlaskClient, key: str, body: dict[str, Any], field: str
) -> None:
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), json=body)

    problem(response, 400, field)


def test_a_nul_character_in_a_header_is_a_400_naming_it(client: FlaskClient, key: str) -> None:
    headers = auth(key, **ASYNC, **{"Idempotency-Key": "a\x00b"})
    response = client.post("/api/agents/demo/run", headers=headers, json={"message": "x"})

    problem(response, 400, "Idempotency-Key")


# -- 2. non-finite numbers --------------------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_a_non_finite_number_in_a_body_is_a_400(client: FlaskClient, key: str, number: str) -> None:
    data = '{"message": "x", "parameters": {"t": ' + number + "}}"
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), data=data)

    problem(response, 400, "body")


def test_a_non_finite_number_on_v1_is_an_openai_400(client: FlaskClient, key: str) -> None:
    data = '{"model": "demo", "input": "hi", "temperature": NaN}'
    response = client.post("/v1/responses", headers=auth(key, **ASYNC), data=data)

    openai_error(response, 400, "body")


# -- 3. deep nesting --------------------------------------------------------------------


@pytest.mark.parametrize("depth", [65, 960, 100_000])
def test_json_nested_too_deep_is_a_400_without_recursion(
    client: FlaskClient, key: str, depth: int
) -> None:
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), data=nested(depth))

    assert "nested" in problem(response, 400, "body")["detail"]


def test_json_nested_too_deep_with_an_idempotency_key_is_a_400(
    client: FlaskClient, key: str
) -> None:
    headers = auth(key, **ASYNC, **{"Idempotency-Key": "deep-1"})
    response = client.post("/api/agents/demo/run", headers=headers, data=nested(960))

    problem(response, 400, "body")


def test_json_nested_within_the_bound_is_accepted(client: FlaskClient, key: str) -> None:
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), data=nested(60))

    assert response.status_code == 202


# -- 4. integers: ASCII digits only, and 5. in range -------------------------------------


@pytest.mark.parametrize("route", ["/api/runs", "/api/approvals"])
@pytest.mark.parametrize("limit", ["%C2%B2", "%D9%A3", "1%E2%80%8B", "0", "201", "-1", "1e2"])
def test_a_limit_that_is_not_ascii_digits_in_range_is_a_400(
    client: FlaskClient, key: str, route: str, limit: str
) -> None:
    problem(client.get(f"{route}?limit={limit}", headers=auth(key)), 400, "limit")


@pytest.mark.parametrize(
    "value", ["\u00b2", "99999999999999999999999", "2147483648", "-1", "1 2", "0x1"]
)
def test_a_bad_last_event_id_is_a_400(
    client: FlaskClient, key: str, runtime: Runtime, value: str
) -> None:
    run_id = client.post(
        "/api/agents/demo/run", headers=auth(key, **ASYNC), json={"message": "x"}
    ).get_json()["runId"]

    header = client.get(f"/api/runs/{run_id}/events", headers=auth(key, **{"Last-Event-ID": value}))
    query = client.get(f"/api/runs/{run_id}/events?after={value}", headers=auth(key))

    problem(header, 400, "Last-Event-ID")
    problem(query, 400, "after")


def test_a_good_last_event_id_still_reads_later_events(client: FlaskClient, key: str) -> None:
    run_id = client.post(
        "/api/agents/demo/run", headers=auth(key, **ASYNC), json={"message": "x"}
    ).get_json()["runId"]

    response = client.get(f"/api/runs/{run_id}/events", headers=auth(key, **{"Last-Event-ID": "0"}))

    assert response.status_code == 200
    assert [event["type"] for event in response.get_json()["items"]] == ["RunQueued"]


# -- lone surrogates --------------------------------------------------------------------


def test_a_lone_surrogate_on_v1_responses_is_an_openai_400_not_a_run(
    client: FlaskClient, key: str, runtime: Runtime
) -> None:
    data = '{"model": "demo", "input": "\\ud800"}'
    response = client.post("/v1/responses", headers=auth(key, **ASYNC), data=data)

    openai_error(response, 400, "input")
    tenant = runtime.tenants.ensure_tenant("acme")
    assert runtime.runs.page(tenant, RunFilter(), limit=10, before=None) == []


def test_a_lone_surrogate_on_chat_completions_names_the_message(
    client: FlaskClient, key: str
) -> None:
    data = '{"model": "demo", "messages": [{"role": "user", "content": "a\\udfffb"}]}'
    response = client.post("/v1/chat/completions", headers=auth(key, **ASYNC), data=data)

    openai_error(response, 400, "messages.0.content")


def test_a_lone_surrogate_in_a_run_body_is_a_400(client: FlaskClient, key: str) -> None:
    data = '{"message": "\\udc00"}'
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), data=data)

    problem(response, 400, "message")


def test_a_body_that_is_not_utf8_is_a_400(client: FlaskClient, key: str) -> None:
    data = b'{"message": "\xed\xa0\x80"}'
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), data=data)

    problem(response, 400, "body")


def test_a_well_formed_surrogate_pair_is_accepted(client: FlaskClient, key: str) -> None:
    data = '{"message": "\\ud83d\\ude00"}'
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), data=data)

    assert response.status_code == 202


# -- body size --------------------------------------------------------------------------


def test_a_body_over_the_default_limit_is_a_413(client: FlaskClient, key: str) -> None:
    body = {"message": "x" * (10 * 1024 * 1024)}
    response = client.post("/api/agents/demo/run", headers=auth(key, **ASYNC), json=body)

    problem(response, 413)


def test_a_chunked_body_over_the_limit_is_a_413(
    make_runtime: MakeRuntime, sql_url: str, key: str
) -> None:
    rt = make_runtime(
        sql_url, sender=hold_queued, Web={"MaxRequestBytes": 1024}, **scripted_agent([])
    )
    secret = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret
    client = create_app(rt, {"TESTING": True}).test_client()
    data = json.dumps({"message": "x" * 2048}).encode()

    response = client.post(
        "/api/agents/demo/run",
        headers=auth(secret, **ASYNC, **{"Transfer-Encoding": "chunked"}),
        input_stream=io.BytesIO(data),
        environ_overrides={"wsgi.input_terminated": True},
    )
    small = client.post(
        "/api/agents/demo/run", headers=auth(secret, **ASYNC), json={"message": "x" * 100}
    )

    problem(response, 413)
    assert small.status_code == 202


def test_a_body_over_the_limit_on_v1_is_a_413_in_openai_shape(
    client: FlaskClient, key: str
) -> None:
    body = {"model": "demo", "input": "x" * (2 * 1024 * 1024)}
    response = client.post("/v1/responses", headers=auth(key, **ASYNC), json=body)

    assert response.status_code == 413
    assert response.get_json()["error"]["type"] == "invalid_request_error"


# -- the framework's own errors ---------------------------------------------------------


def test_a_wrong_method_is_a_405_problem_keeping_allow(client: FlaskClient, key: str) -> None:
    response = client.delete("/api/runs", headers=auth(key))

    problem(response, 405)
    assert "GET" in response.headers["Allow"]


def test_a_wrong_method_on_v1_keeps_allow(client: FlaskClient, key: str) -> None:
    response = client.get("/v1/chat/completions", headers=auth(key))

    assert response.status_code == 405
    assert "POST" in response.headers["Allow"]


def test_an_unknown_route_is_a_404_problem(client: FlaskClient, key: str) -> None:
    problem(client.get("/api/nothing-here", headers=auth(key)), 404)
