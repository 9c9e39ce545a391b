"""Property-based tests of the edge: whatever a client sends, no answer is a 5xx, and every
4xx is problem+json (OpenAI's error shape on `/v1`).

`hypothesis` drives every route's inputs (path, query, headers, body: text with NUL
characters and lone surrogates, non-finite numbers, deep nesting, raw bytes); `schemathesis`
drives the routes from `GET /openapi.json` in-process, positive and negative, checking the
answers against the description. Both run on SQLite and PostgreSQL and are bounded in time.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
import schemathesis
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import positive_data_acceptance
from werkzeug.test import TestResponse

from tests.helpers import MakeRuntime, hold_queued, scripted_agent
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
    "/v1/models/{}",
]
LIST_ROUTES = ["/api/runs", "/api/approvals", "/api/statistics/runs"]
QUERY_NAMES = ["status", "agent", "sessionId", "limit", "cursor", "runId", "include", "after"]
BODY_ROUTES = [
    "/api/agents/demo/run",
    "/api/workflows/none/run",
    "/api/approvals/none/decision",
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


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def key(runtime: Runtime) -> str:
    return runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret


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


def test_schemathesis_finds_no_5xx_and_no_schema_violation(app: Flask, key: str) -> None:
    """Every operation of `GET /openapi.json`, positive and negative, with every check but
    `positive_data_acceptance`: the description cannot say which cursors this API returned,
    nor that a conversation needs a user message, so some schema-valid inputs are a 400."""
    config = schemathesis.Config.from_dict(
        {"generation": {"allow-extra-parameters": False, "allow-x00": True}}
    )
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app, config=config)
    headers = {"Authorization": f"Bearer {key}"}
    failures: list[str] = []
    results = list(schema.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results) >= 20  # the description itself is valid
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.POSITIVE or _negatable(operation):
                _fuzz(operation, mode, headers, failures)
    assert not failures, "\n\n".join(failures[:5])


def _fuzz(
    operation: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    headers: dict[str, str],
    failures: list[str],
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
        try:
            case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])
        except BaseException as failure:  # a FailureGroup: record it, go on
            failures.append(f"{operation.label} ({mode.value}): {failure}"[:2000])

    check()


def _negatable(operation: schemathesis.APIOperation) -> bool:
    """Whether the operation has an input a negative test can break (the probes take none)."""
    return operation.path not in {"/healthz", "/readyz", "/metrics"}
