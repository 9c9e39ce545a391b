"""`GET /openapi.json` is a valid OpenAPI 3.1 document that describes every route the app
serves (a new route cannot go undocumented), with the errors the framework itself answers:
404 for no route, 405 with `Allow`, 413 over `Web.MaxRequestBytes`, problem+json on `/api`
and OpenAI's error shape on `/v1`. What the operations accept and answer is held to the
description by schemathesis in test_fuzz.py; the frames of the event streams (stored events,
the live text of a model call, and the `/v1` chunks and typed events) are held to it here."""

from __future__ import annotations

import json
import re
import typing
from datetime import UTC, datetime
from typing import Any

import jsonschema_rs
import pytest
import schemathesis
from flask import Flask
from flask.testing import FlaskClient
from pydantic import BaseModel
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.definitions import OPENAPI_31
from werkzeug.test import TestResponse

from tests.helpers import MakeRuntime, hold_queued, scripted_agent
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import Event
from web import create_app
from web.inputs import PATH_FIELDS
from web.live_turn import LiveDelta, LiveReset
from web.openai_compat import ChatFrames, ResponseFrames
from web.openai_request import NEUTRAL, ChatRequest, Options, ResponsesRequest
from web.sse import frame, live_frame

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


def fits(spec: dict[str, Any], schema: dict[str, Any], instance: Any) -> list[str]:
    """What keeps `instance` from `schema`; a frame's `data` is held to the `contentSchema`
    of the branch the frame fits too (a JSON Schema validator takes that for a note)."""
    errors = _errors(spec, schema, instance)
    if errors or not isinstance(instance, dict) or instance.get("data") == "[DONE]":
        return errors
    for branch in _branches(spec, schema):
        if _errors(spec, branch, instance):
            continue
        data = branch.get("properties", {}).get("data", {})
        for option in [data, *data.get("anyOf", [])]:
            if "contentSchema" in option:
                errors += fits(spec, option["contentSchema"], json.loads(instance["data"]))
    return errors


def _errors(spec: dict[str, Any], schema: dict[str, Any], instance: Any) -> list[str]:
    root = {**schema, "components": spec["components"]}
    return [e.message for e in jsonschema_rs.validator_for(root).iter_errors(instance)]


def _branches(spec: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """`schema`, or each branch of its `oneOf`, with refs followed."""
    if "$ref" in schema:
        return _branches(spec, spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]])
    if "oneOf" in schema:
        return [branch for option in schema["oneOf"] for branch in _branches(spec, option)]
    return [schema]


def sse_frames(text: str) -> list[dict[str, str]]:
    """Server-sent events as a client reads them: `event` is `message` when not sent, `id`
    the last one sent, comments (keep-alives) left out."""
    frames = []
    last_id: str | None = None
    for block in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in block.splitlines() if not line.startswith(":")
        )
        if not fields:
            continue
        last_id = fields.get("id", last_id)
        frames.append({"event": "message", **fields, **({"id": last_id} if last_id else {})})
    return frames


def stream_schema(spec: dict[str, Any], path: str) -> dict[str, Any]:
    schema: dict[str, Any] = spec["paths"][path]["post"]["responses"]["200"]["content"][
        "text/event-stream"
    ]["schema"]
    return schema


def test_the_native_stream_describes_stored_events_and_live_text_frames(
    spec: dict[str, Any],
) -> None:
    schemas = spec["components"]["schemas"]
    for path, method in [("/api/agents/{name}/run", "post"), ("/api/runs/{id}/events", "get")]:
        described = spec["paths"][path][method]["responses"]["200"]["content"]
        assert described["text/event-stream"]["schema"]["oneOf"] == [
            {"$ref": "#/components/schemas/EventFrame"},
            {"$ref": "#/components/schemas/LiveTextFrame"},
        ], path
    assert "id" in schemas["EventFrame"]["required"]
    assert "id" not in schemas["LiveTextFrame"]["required"]
    assert schemas["LiveTextFrame"]["properties"]["event"]["enum"] == [
        "ModelTextDelta",
        "ModelTextReset",
    ]
    assert schemas["ModelTextDelta"]["properties"]["data"]["required"] == ["callSeq", "text"]
    assert schemas["ModelTextReset"]["properties"]["data"]["required"] == ["callSeq"]


def test_the_frames_the_native_stream_sends_fit_the_description(spec: dict[str, Any]) -> None:
    sse = stream_schema(spec, "/api/agents/{name}/run")
    started = Event("r", 7, "ModelCallStarted", datetime(2026, 1, 2, 3, 4, 5), {"model": "m"})
    live = live_frame(LiveDelta(7, "The order ship")) + live_frame(LiveReset(7))
    assert "id:" not in live
    stored, delta, reset = sse_frames(frame(started) + live)
    assert (stored["id"], stored["event"], delta["event"]) == (
        "7",
        "ModelCallStarted",
        "ModelTextDelta",
    )
    assert json.loads(delta["data"]) == {
        "type": "ModelTextDelta",
        "data": {"callSeq": 7, "text": "The order ship"},
    }
    assert json.loads(reset["data"]) == {"type": "ModelTextReset", "data": {"callSeq": 7}}
    for sent in (stored, delta, reset):
        assert fits(spec, sse, sent) == [], sent
    assert fits(spec, sse, {k: v for k, v in stored.items() if k != "id"}), "no id fits"
    assert fits(spec, sse, {**stored, "event": "ModelTextDelta"}), "an event as live text fits"
    assert fits(spec, sse, {**delta, "data": json.dumps({"type": "ModelTextDelta"})})


def stream_run() -> Run:
    return Run(
        id="r1",
        status="Running",
        created_at=datetime.now(UTC).replace(tzinfo=None),
        input_tokens=0,
        output_tokens=0,
        output=None,
    )


def test_v1_streams_describe_text_deltas_and_withdrawn_text(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    assert schemas["ChatCompletionChunk"]["properties"]["object"] == {
        "const": "chat.completion.chunk"
    }
    withdrawn = schemas["StreamTextWithdrawn"]["properties"]["error"]["properties"]["code"]
    assert withdrawn == {"const": "stream_text_withdrawn"}
    events = schemas["ResponseStreamEvent"]["properties"]["type"]["enum"]
    assert {"response.output_text.delta", "response.failed", "response.completed"} <= set(events)
    for path in ("/v1/chat/completions", "/v1/responses"):
        description = stream_schema(spec, path)["description"]
        assert "stream_text_withdrawn" in description and "as the model writes" in description


def test_the_frames_v1_streams_send_fit_the_description(spec: dict[str, Any]) -> None:
    chat = ChatFrames(stream_run(), "demo", include_usage=False)
    text = chat.opening() + chat.live(LiveDelta(7, "Hel")) + chat.live(LiveReset(7))
    sent = sse_frames(text)
    assert [json.loads(f["data"]).get("object") for f in sent[:2]] == ["chat.completion.chunk"] * 2
    assert json.loads(sent[1]["data"])["choices"][0]["delta"] == {"content": "Hel"}
    assert json.loads(sent[2]["data"])["error"]["code"] == "stream_text_withdrawn"
    assert sent[3] == {"event": "message", "data": "[DONE]"} and len(sent) == 4
    responses = ResponseFrames(stream_run(), "demo")
    text = responses.opening() + responses.live(LiveDelta(7, "Hel")) + responses.live(LiveReset(7))
    typed = sse_frames(text)
    kinds = [f["event"] for f in typed]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.failed"
    failed = json.loads(typed[-1]["data"])["response"]
    assert failed["error"]["code"] == "stream_text_withdrawn"
    for path, frames in [("/v1/chat/completions", sent), ("/v1/responses", typed)]:
        for each in frames:
            assert fits(spec, stream_schema(spec, path), each) == [], (path, each)
    chat_sse = stream_schema(spec, "/v1/chat/completions")
    assert fits(spec, chat_sse, {"data": json.dumps({"object": "chat.completion.chunk"})})


def declared_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """The fields a request model reads, those of its options objects as `object.field`."""
    fields: set[str] = set()
    for name, spec in model.model_fields.items():
        field = prefix + (spec.alias or name)
        fields.add(field)
        for member in typing.get_args(spec.annotation) or (spec.annotation,):
            if isinstance(member, type) and issubclass(member, Options):
                fields |= declared_fields(member, field + ".")
    return fields


def described_fields(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """The fields a request schema describes, into each object that takes no others."""
    fields: set[str] = set()
    for name, sub in schema["properties"].items():
        fields.add(prefix + name)
        if sub.get("additionalProperties") is False:
            fields |= described_fields(sub, f"{prefix}{name}.")
    return fields


@pytest.mark.parametrize(
    ("component", "model"),
    [("ChatCompletionRequest", ChatRequest), ("ResponsesRequest", ResponsesRequest)],
)
def test_a_v1_request_is_described_field_by_field_and_takes_no_other(
    spec: dict[str, Any], component: str, model: type[BaseModel]
) -> None:
    """The description and the model that reads a request name the same fields, so what the
    description allows is read (or refused for a reason) and nothing else is taken
    (`unknown_parameter`); a field taken only at its neutral values is described so."""
    schema = spec["components"]["schemas"][component]

    assert schema["additionalProperties"] is False
    assert described_fields(schema) == declared_fields(model)
    for field in NEUTRAL.keys() & declared_fields(model):
        described = schema
        for name in field.split("."):
            described = described["properties"][name]
        assert described["enum"] == list(NEUTRAL[field][0]), field


def test_every_field_taken_only_at_its_neutral_values_is_a_field_of_a_v1_request() -> None:
    assert NEUTRAL.keys() <= declared_fields(ChatRequest) | declared_fields(ResponsesRequest)
