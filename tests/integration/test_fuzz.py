"""Property-based tests of the edge: whatever a client sends, no answer is a 5xx, and every
4xx is problem+json (OpenAI's error shape on `/v1`).

`hypothesis` drives every route's inputs (path, query, headers, body: text with NUL
characters and lone surrogates, non-finite numbers, deep nesting, raw bytes); `schemathesis`
drives the routes from `GET /openapi.json` in-process, positive and negative, checking the
answers against the description. Both run on SQLite and PostgreSQL and are bounded in time.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any
from urllib.parse import quote

import pytest
import schemathesis
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.core.result import Ok
from werkzeug.test import TestResponse

from tests import webhook_rows
from tests.helpers import MakeRuntime, ThreadWorker, hold_queued, scripted_agent
from tracon_jobs.runtime import Runtime
from web import create_app

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
GET_ROUTES = [
    "/api/runs/{}",
    "/api/runs/{}/events",
    "/api/runs/{}/tool-calls",
    "/api/runs/{}/tree",
    "/api/approvals/{}",
    "/api/webhooks/{}",
    "/api/webhooks/{}/deliveries",
    "/v1/models/{}",
]
LIST_ROUTES = ["/api/runs", "/api/approvals", "/api/statistics/runs", "/api/webhooks"]
QUERY_NAMES = ["status", "agent", "sessionId", "limit", "cursor", "runId", "include", "after"]
BODY_ROUTES = [
    "/api/agents/demo/run",
    "/api/workflows/none/run",
    "/api/workflows/answers",
    "/api/approvals/none/decision",
    "/api/webhooks",
    "/v1/chat/completions",
    "/v1/responses",
]
HEADER_NAMES = ["Last-Event-ID", "Idempotency-Key", "Prefer", "Accept", "Content-Type"]

texts = st.text(max_size=40)
header_values = st.text(st.characters(max_codepoint=255, blacklist_characters="\r\n"), max_size=40)
numbers = st.one_of(
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "²", "-0", "9" * 30]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
run_bodies = st.fixed_dictionaries(
    {},
    optional={
        "message": st.one_of(texts, json_values),
        "sessionId": st.one_of(texts, json_values),
        "parameters": json_values,
        "model": st.one_of(st.just("demo"), texts),
        "input": st.one_of(texts, json_values),
        "messages": st.one_of(
            json_values, st.lists(st.fixed_dictionaries({"role": texts, "content": json_values}))
        ),
        "approve": json_values,
        "comment": json_values,
        "stream": st.just(False),
    },
)


def encoded(value: str) -> str:
    """`value` percent-encoded as UTF-8 (a lone surrogate as its surrogate-pass bytes)."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


def body_bytes(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url, sender=hold_queued, **scripted_agent([{"Text": "ok"}]))


@pytest.fixture
def app(runtime: Runtime) -> Flask:
    return create_app(runtime, {"TESTING": True, "SSE_KEEPALIVE_SECONDS": 0.1})


def assert_answered(response: TestResponse, path: str) -> None:
    """No 5xx; a 4xx is problem+json, or OpenAI's error shape on a `/v1` route."""
    status = response.status_code
    assert status < 500, (path, response.get_data(as_text=True)[:500])
    if status < 400:
        return
    body = response.get_json(force=True, silent=True)
    assert isinstance(body, dict), (path, status, response.get_data(as_text=True)[:200])
    if response.mimetype == "application/problem+json":
        assert body["status"] == status and body["title"] and body["detail"], body
    else:
        assert path.startswith("/v1/"), (path, status, response.mimetype)
        assert body["error"]["type"] and body["error"]["message"], body


@FUZZ
@given(route=st.sampled_from(GET_ROUTES), value=texts)
def test_any_path_parameter_is_answered_without_a_5xx(
    client: FlaskClient, key: str, route: str, value: str
) -> None:
    path = route.format(encoded(value) or "x")
    assert_answered(client.get(path, headers={"Authorization": f"Bearer {key}"}), path)


@FUZZ
@given(
    route=st.sampled_from(LIST_ROUTES),
    query=st.dictionaries(st.sampled_from(QUERY_NAMES), st.one_of(texts, numbers.map(str))),
)
def test_any_query_is_answered_without_a_5xx(
    client: FlaskClient, key: str, route: str, query: dict[str, str]
) -> None:
    path = route + "?" + "&".join(f"{encoded(k)}={encoded(v)}" for k, v in query.items())
    assert_answered(client.get(path, headers={"Authorization": f"Bearer {key}"}), path)


@FUZZ
@given(headers=st.dictionaries(st.sampled_from(HEADER_NAMES), header_values), value=texts)
def test_any_header_is_answered_without_a_5xx(
    client: FlaskClient, key: str, headers: dict[str, str], value: str
) -> None:
    headers["Accept"] = headers.get("Accept", "").replace("text/event-stream", "")
    path = f"/api/runs/{encoded(value) or 'x'}/events"
    assert_answered(client.get(path, headers={"Authorization": f"Bearer {key}", **headers}), path)


@FUZZ
@given(
    route=st.sampled_from(BODY_ROUTES),
    body=st.one_of(run_bodies, json_values),
    ascii_only=st.booleans(),
    keyed=st.booleans(),
)
def test_any_json_body_is_answered_without_a_5xx(
    client: FlaskClient, key: str, route: str, body: Any, ascii_only: bool, keyed: bool
) -> None:
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/json",
        "Prefer": "respond-async",
    }
    if keyed:
        headers["Idempotency-Key"] = "fuzz-key"
    response = client.post(route, headers=headers, data=body_bytes(body, ascii_only))
    assert_answered(response, route)


@FUZZ
@given(route=st.sampled_from(BODY_ROUTES), raw=st.binary(max_size=200), depth=st.integers(0, 3000))
def test_any_byte_body_is_answered_without_a_5xx(
    client: FlaskClient, key: str, route: str, raw: bytes, depth: int
) -> None:
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/json",
        "Prefer": "respond-async",
    }
    data = b'{"message": ' + b"[" * depth + raw + b"]" * depth + b"}"
    assert_answered(client.post(route, headers=headers, data=data), route)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": []}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "stream": "yes"}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}},
        ),
        ("/v1/responses", {"input": [{"role": "user", "content": {"type": "text", "text": "x"}}]}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        ("/v1/responses", {"input": "hi", "stream": 1}),
    ],
)
def test_a_v1_body_the_description_forbids_is_a_400(
    client: FlaskClient, key: str, route: str, body: dict[str, Any]
) -> None:
    """Content parts are `{"type": "text", "text": str}`; `stream` and `include_usage` are JSON
    booleans (a list as a part's type was a 500; "yes" opened a stream)."""
    headers = {"Authorization": f"Bearer {key}", "Prefer": "respond-async"}
    response = client.post(route, json={"model": "demo", **body}, headers=headers)
    assert response.status_code == 400, response.get_data(as_text=True)
    assert response.get_json()["error"]["type"] == "invalid_request_error"


def test_after_is_checked_when_last_event_id_wins(client: FlaskClient, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}", "Prefer": "respond-async"}
    run = client.post("/api/agents/demo/run", json={"message": "hi"}, headers=headers)
    path = f"/api/runs/{run.get_json()['runId']}/events"

    refused = client.get(f"{path}?after=-1", headers={**headers, "Last-Event-ID": "1"})
    empty = client.get(f"{path}?after=", headers={**headers, "Last-Event-ID": ""})

    assert refused.status_code == 400 and refused.get_json()["field"] == "after"
    assert empty.status_code == 200 and empty.get_json()["items"][0]["seq"] == 1


KEYED = [
    "POST /api/agents/{name}/run",
    "POST /api/approvals/{id}/decision",
    "POST /api/webhooks/{id}/rotate-secret",
    "POST /v1/chat/completions",
    "POST /v1/responses",
]
KEYED_WORKFLOW = [
    "POST /api/workflows/{name}/run",
    "POST /api/workflows/runs/{id}/respond",
    "POST /api/workflows/runs/{id}/resume",
]
ACCEPTED = ["2xx", "401", "404", "409", "429"]
"""What `positive_data_acceptance` takes from a schema-valid request: a success, or an answer
that depends on state: 404 for a name or id that does not exist, 409 for a run that already
ended, 429 for a spent quota (the default, but 3xx: this API redirects nowhere)."""
SCHEMATHESIS_CONFIG: dict[str, Any] = {
    "generation": {
        "allow-extra-parameters": False,
        "allow-x00": False,
        "with-security-parameters": False,
    },
    "operations": [
        {
            "include-name": ["POST /api/agents/{name}/run"],
            "parameters": {"path.name": {"dictionary": "agents", "probability": 0.5}},
        },
        {
            "include-name": ["POST /v1/chat/completions", "POST /v1/responses"],
            "parameters": {"body.model": {"dictionary": "agents", "probability": 0.5}},
        },
        {
            "include-path-regex": "^/api/runs/",
            "parameters": {"path.id": {"dictionary": "runs", "probability": 0.5}},
        },
        {
            "include-path-regex": "^/api/approvals/",
            "parameters": {"path.id": {"dictionary": "approvals", "probability": 0.5}},
        },
        {
            "include-name": [
                "GET /api/runs",
                "GET /api/approvals",
                "GET /api/webhooks",
                "GET /api/webhooks/{id}/deliveries",
                "GET /api/schedules",
                "GET /api/schedules/{id}/fires",
            ],
            "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "400"]}},
        },
        {
            "include-name": KEYED + KEYED_WORKFLOW,
            "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "422"]}},
        },
        {
            "include-path-regex": "^/api/webhooks/",
            "exclude-name": ["DELETE /api/webhooks/{id}"],  # the others need it to exist
            "parameters": {
                "path.id": {"dictionary": "webhooks", "probability": 0.5},
                "path.deliveryId": {"dictionary": "deliveries", "probability": 0.5},
            },
        },
        {
            "include-name": [
                "POST /api/webhooks",
                "PATCH /api/webhooks/{id}",
                "POST /api/schedules",
                "POST /api/workflows/answers",
            ],
            "checks": {
                "positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "400", "422"]}
            },
        },
    ],
}
"""Where a schema-valid request may still be refused for a state the description cannot
know: a `cursor` this API did not return (400), an `Idempotency-Key` it saw with another
body (422), a webhook URL the destination policy refuses for what its host is (a literal
private address) or that the URL parser refuses, a schedule's cron, interval or zone text,
or its one-of-cron-and-interval rule (400: a pattern cannot state either), a lone surrogate in
a string of the free-form answers of `POST /api/workflows/answers` (400: refused in every
string at any depth, as NUL is below; the lowest schemathesis allowed generates them there,
and that route reads its body before any run). Half
the generated agent names, run ids, approval ids, webhook endpoint and delivery ids name ones
that exist, so that the answers about real ones are checked too."""


@pytest.fixture
def worked_app(make_runtime: MakeRuntime, sql_url: str, thread_worker: ThreadWorker) -> Flask:
    """An app whose runs execute (on threads), so that every stream and buffered answer ends;
    its agent `closer` calls a tool a person approves."""
    sections = scripted_agent([{"Text": "ok"}])
    sections["Providers"]["closing"] = {"Kind": "scripted", "Script": CLOSE_THEN_ANSWER}
    sections["Agents"]["closer"] = {
        "Instructions": "test agent",
        "Model": {"provider": "closing", "model": "demo-model"},
        "Tools": ["close_account"],
    }
    rt = make_runtime(sql_url, **sections)
    rt.send_runs_with(thread_worker.sender(rt))
    return create_app(rt, {"TESTING": True, "SSE_KEEPALIVE_SECONDS": 0.1})


CLOSE_THEN_ANSWER = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]


def seed_runs(client: FlaskClient, headers: dict[str, str]) -> tuple[str, str, str]:
    """A completed run, and a run that waits for a person: (run id, run id, approval id)."""
    done = client.post(
        "/api/agents/demo/run",
        json={"message": "hello"},
        headers={**headers, "Idempotency-Key": "seed"},
    )
    waiting = client.post(
        "/api/agents/closer/run",
        json={"message": "close it"},
        headers={**headers, "Idempotency-Key": "seed-waiting"},
    )  # a buffered answer ends once the run waits for a person
    assert done.status_code == 200 and waiting.status_code == 202, waiting.get_data(as_text=True)
    [approval] = waiting.get_json()["pendingApprovals"]
    return done.get_json()["id"], waiting.get_json()["id"], approval


@pytest.mark.timeout(300)  # every operation, both modes: two minutes on a busy machine
def test_schemathesis_finds_no_5xx_and_no_schema_violation(worked_app: Flask) -> None:
    """Every operation of `GET /openapi.json`, positive and negative, with every check
    schemathesis has for a single request, `positive_data_acceptance` included (see
    `SCHEMATHESIS_CONFIG` for the states a description cannot state).

    `allow-extra-parameters` stays off: the API ignores query parameters and headers it does
    not know (clients and proxies add their own), so an extra one is no negative case. NUL
    characters stay out of generated strings (`allow-x00` off): the API refuses them in every
    string at any depth, which a description cannot say of free-form JSON; the hypothesis
    tests above send them.
    """
    client = worked_app.test_client()
    rt: Runtime = worked_app.extensions["tracon"]
    key = rt.tenants.issue_key(rt.tenants.ensure_tenant("acme")).secret
    headers = {"Authorization": f"Bearer {key}"}
    done, waiting, approval = seed_runs(client, headers)
    endpoint, delivery_id = seed_webhook(rt, client, headers)
    config = schemathesis.Config.from_dict(
        {
            **SCHEMATHESIS_CONFIG,
            "dictionaries": {
                "agents": {"values": ["demo"]},
                "runs": {"values": [done, waiting]},
                "approvals": {"values": [approval]},
                "webhooks": {"values": [endpoint]},
                "deliveries": {"values": [delivery_id]},
            },
        }
    )
    schema = schemathesis.openapi.from_wsgi("/openapi.json", worked_app, config=config)
    results = list(schema.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results) >= 25  # the description itself is valid
    failures: list[str] = []
    answers: Counter[tuple[str, str, int]] = Counter()
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.POSITIVE or _negatable(operation):
                _fuzz(operation, mode, headers, failures, answers)
    assert not failures, "\n".join(sorted(set(failures)))
    succeeded = {label for (label, mode, status), _ in answers.items() if status < 300}
    assert succeeded >= set(EXERCISED), sorted(answers.items())  # real runs were answered


def seed_webhook(rt: Runtime, client: FlaskClient, headers: dict[str, str]) -> tuple[str, str]:
    """A webhook endpoint with one failed delivery: (endpoint id, delivery id)."""
    body = {"url": "https://hooks.example.com/x", "events": ["run.completed"]}
    created = client.post("/api/webhooks", json=body, headers=headers)
    assert created.status_code == 201, created.get_data(as_text=True)
    endpoint: str = created.get_json()["id"]
    tenant = rt.tenants.find_tenant("acme")
    assert tenant is not None
    delivery_id, _ = webhook_rows.delivery(rt.db, endpoint, tenant, status="failed")
    return endpoint, delivery_id


EXERCISED = [
    "POST /api/agents/{name}/run",
    "GET /api/approvals/{id}",
    "POST /api/approvals/{id}/decision",
    "GET /api/runs/{id}/tool-calls",
    "GET /api/runs/{id}",
    "GET /api/runs/{id}/events",
    "GET /api/runs/{id}/tree",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "GET /api/webhooks/{id}",
    "GET /api/webhooks/{id}/deliveries",
    "POST /api/webhooks/{id}/deliveries/{deliveryId}/redeliver",
    "POST /api/webhooks/{id}/rotate-secret",
]
"""Operations whose successes the run must have checked: the dictionaries did their work."""


def _fuzz(
    operation: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    headers: dict[str, str],
    failures: list[str],
    answers: Counter[tuple[str, str, int]],
) -> None:
    """A bounded, deterministic run of one operation in one mode; failures are recorded."""

    @settings(
        max_examples=12,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        if mode is schemathesis.GenerationMode.POSITIVE:
            _keep_rules_across_parameters(case, operation.label)
        response = case.call(headers=headers)
        answers[(operation.label, mode.value, response.status_code)] += 1
        try:
            case.validate_response(response, headers=headers, transport_kwargs={"headers": headers})
        except BaseException as failure:  # a FailureGroup: record each, go on
            for one in getattr(failure, "exceptions", [failure]):
                failures.append(
                    f"{operation.label} ({mode.value}): {getattr(one, 'title', one)}:"
                    f" {response.status_code} {response.text[:300]!r}"
                    f" for {case.as_curl_command(headers)[:600]}"
                )

    try:
        check()
    except Unsatisfiable:  # no input of the operation can be broken: only free strings
        assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label


def _keep_rules_across_parameters(case: schemathesis.Case, label: str) -> None:
    """Make a positive case keep the rules that tie two parameters together, which OpenAPI
    cannot state (each is in its parameter's description): `Idempotency-Key` is refused with
    `stream: true`, and on the workflow routes needs `Prefer: respond-async`."""
    if "Idempotency-Key" not in (case.headers or {}):
        return
    if label in KEYED_WORKFLOW:
        case.headers["Prefer"] = "respond-async"
    elif isinstance(case.body, dict) and case.body.get("stream") is True:
        case.body["stream"] = False


def _negatable(operation: schemathesis.APIOperation) -> bool:
    """Whether the operation takes an input a negative test can break."""
    inputs = (operation.path_parameters, operation.query, operation.headers, operation.body)
    return any(len(container) for container in inputs)
