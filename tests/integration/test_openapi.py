"""`GET /openapi.json` is a valid OpenAPI 3.1 document that describes every route the app
serves (a new route cannot go undocumented), with the errors the framework itself answers:
404 for no route, 405 with `Allow`, 413 over `Web.MaxRequestBytes`, problem+json on `/api`
and OpenAI's error shape on `/v1`. What the operations accept and answer is held to the
description by schemathesis in test_fuzz.py."""

from __future__ import annotations

import re
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from flask import Flask
from flask.testing import FlaskClient
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.definitions import OPENAPI_31
from werkzeug.test import TestResponse

from tests.helpers import MakeRuntime, hold_queued, scripted_agent
from web import create_app
from web.inputs import PATH_FIELDS

MAX_REQUEST_BYTES = 1024
METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}
UNDESCRIBED = ("static", "console.")
"""Endpoints outside the JSON API: Flask's static files and the web console's HTML pages
(docs/console.md), signed in with a cookie rather than a bearer key."""
CONVERTER = re.compile(r"<(?:[^:<>]+:)?([^<>]+)>")


@pytest.fixture
def app(make_runtime: MakeRuntime, sqlite_url: str) -> Flask:
    sections = {**scripted_agent([{"Text": "ok"}]), "Web": {"MaxRequestBytes": MAX_REQUEST_BYTES}}
    return create_app(make_runtime(sqlite_url, sender=hold_queued, **sections), {"TESTING": True})


@pytest.fixture
def spec(client: FlaskClient) -> dict[str, Any]:
    response = client.get("/openapi.json")  # no key: the description is public
    assert response.status_code == 200
    body: dict[str, Any] = response.get_json()
    return body


@pytest.fixture
def key(app: Flask) -> str:
    tenants = app.extensions["tracon"].tenants
    secret: str = tenants.issue_key(tenants.ensure_tenant("acme")).secret
    return secret


def described_routes(app: Flask) -> dict[str, set[str]]:
    """The app's routes as the description names them: `{run_id}` is `{id}`, methods
    without the HEAD and OPTIONS Flask adds to each."""
    routes: dict[str, set[str]] = {}
    for rule in app.url_map.iter_rules():
        if rule.endpoint.startswith(UNDESCRIBED):
            continue
        path = CONVERTER.sub(lambda m: "{" + PATH_FIELDS.get(m[1], m[1]) + "}", rule.rule)
        routes.setdefault(path, set()).update((rule.methods or set()) & METHODS)
    return routes


def operations(spec: dict[str, Any]) -> dict[str, set[str]]:
    return {path: {method.upper() for method in item} for path, item in spec["paths"].items()}


def test_the_description_is_valid_openapi_3_1(app: Flask, spec: dict[str, Any]) -> None:
    errors = [error.message for error in jsonschema_rs.validator_for(OPENAPI_31).iter_errors(spec)]
    assert spec["openapi"] == "3.1.0" and not errors, errors[:5]
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    results = list(schema.get_all_operations())
    assert results and all(isinstance(result, Ok) for result in results)


def test_every_route_of_the_app_is_described_and_nothing_else(
    app: Flask, spec: dict[str, Any]
) -> None:
    assert operations(spec) == described_routes(app)


def test_every_operation_documents_the_errors_every_route_can_give(spec: dict[str, Any]) -> None:
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            statuses = set(operation["responses"])
            must = {"400", "405", "414", "431"}
            if operation.get("security", spec["security"]):
                must |= {"401", "503"}
            if "requestBody" in operation:
                must |= {"413"}
            if "{" in path:
                must |= {"404"}
            assert must <= statuses, (method, path, must - statuses)


def test_errors_are_problem_json_on_the_api_and_openai_errors_on_v1(
    spec: dict[str, Any],
) -> None:
    responses = spec["components"]["responses"]
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            for status, answer in operation["responses"].items():
                if status < "400" or "$ref" not in answer:
                    continue
                name = answer["$ref"].rsplit("/", 1)[1]
                expected = (
                    "OpenAI"
                    if path.startswith("/v1/") and status not in {"414", "431"}
                    else "Problem"
                )
                assert name == f"{expected}{status}", (method, path, status, name)
                assert name in responses
    assert "Allow" in responses["Problem405"]["headers"]
    assert "Retry-After" in responses["OpenAI503"]["headers"]
    assert f"{MAX_REQUEST_BYTES} bytes" in responses["Problem413"]["description"]


def assert_error(response: TestResponse, path: str, status: int) -> None:
    """`status` in the shape the path's errors take."""
    body = response.get_json(force=True)
    assert response.status_code == status, (path, response.get_data(as_text=True)[:300])
    if path.startswith("/v1/"):
        assert response.mimetype == "application/json", path
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    else:
        assert response.mimetype == "application/problem+json", path
        assert body["status"] == status and body["title"] and body["detail"]


def test_a_method_a_path_does_not_take_is_405_with_allow(
    client: FlaskClient, spec: dict[str, Any], key: str
) -> None:
    for path, methods in operations(spec).items():
        concrete = path.replace("{", "").replace("}", "")  # {id} -> id
        for method in sorted(METHODS - methods):
            response = client.open(
                concrete, method=method, headers={"Authorization": f"Bearer {key}"}
            )
            assert_error(response, path, 405)
            allowed = {part.strip() for part in response.headers["Allow"].split(",")}
            assert allowed & METHODS == methods, (method, path, allowed)


@pytest.mark.parametrize("path", ["/api/nothing", "/v1/nothing", "/nothing/at/all"])
def test_no_such_route_is_404_in_the_shape_of_its_surface(client: FlaskClient, path: str) -> None:
    assert_error(client.get(path), path, 404)


@pytest.mark.parametrize(
    "path",
    [
        "/api/agents/demo/run",
        "/api/approvals/x/decision",
        "/v1/chat/completions",
        "/v1/responses",
    ],
)
def test_a_body_over_web_max_request_bytes_is_413(client: FlaskClient, key: str, path: str) -> None:
    body = b'{"message": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    response = client.post(
        path,
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert_error(response, path, 413)
