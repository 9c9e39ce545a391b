"""`GET /openapi.json`: the OpenAPI 3.1 description of the HTTP API."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

import tracon_jobs

bp = Blueprint("openapi", __name__)

PROBLEM = {"$ref": "#/components/responses/Problem"}
RUN_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    common = {"401": PROBLEM, "404": PROBLEM}
    return {"summary": summary, "responses": {**responses, **common}, **extra}


def _json(schema_ref: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}},
    }


RUN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "agent", "kind", "status", "input", "rootRunId", "depth", "usage", "cost"],
    "properties": {
        "id": {"type": "string"},
        "tenant": {"type": "string"},
        "agent": {"type": "string"},
        "kind": {"enum": ["agent", "workflow"]},
        "status": {"enum": ["Queued", "Running", "Waiting", "Completed", "Failed", "Canceled"]},
        "input": {"type": "object"},
        "output": {"type": ["object", "null"]},
        "sessionId": {"type": ["string", "null"]},
        "parentRunId": {"type": ["string", "null"]},
        "rootRunId": {"type": "string"},
        "depth": {"type": "integer"},
        "continuedFromRunId": {"type": ["string", "null"]},
        "attempt": {"type": "integer"},
        "modelId": {"type": ["string", "null"]},
        "usage": {"type": "object"},
        "cost": {"type": "object"},
        "error": {"type": ["object", "null"]},
        "createdAt": {"type": "string"},
        "startedAt": {"type": ["string", "null"]},
        "endedAt": {"type": ["string", "null"]},
        "heartbeatAt": {"type": ["string", "null"]},
        "cancelRequestedAt": {"type": ["string", "null"]},
        "attempts": {"type": "array", "items": {"type": "object"}},
    },
}


IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "description": "execute once; a repeat gets the stored 2xx with Idempotency-Replayed: true",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
}
IDEMPOTENCY_RESPONSES: dict[str, Any] = {
    "409": {
        "description": "the same Idempotency-Key is still in progress, or the run was canceled"
    },
    "422": {"description": "the Idempotency-Key was used with another method, path or body"},
    "501": {"description": "Idempotency-Key sent while Tracon:Idempotency is disabled"},
}
OPENAI_ERROR = {"description": 'OpenAI error shape: {"error": {"message", "type", "code"}}'}


def _openai_op(summary: str) -> dict[str, Any]:
    responses = {
        "200": {"description": "the OpenAI object, or text/event-stream with stream: true"},
        "202": {"description": "the run is still going (Runs.BufferedWaitTimeout); Location"},
        **{status: OPENAI_ERROR for status in ("400", "401", "404", "429", "502", "503")},
        **IDEMPOTENCY_RESPONSES,
    }
    body = {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "summary": summary,
        "parameters": [IDEMPOTENCY_KEY],
        "requestBody": body,
        "responses": responses,
    }


OPENAI_PATHS: dict[str, Any] = {
    "/v1/chat/completions": {"post": _openai_op("OpenAI-compatible chat completions")},
    "/v1/responses": {"post": _openai_op("OpenAI-compatible responses")},
}


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "tracon-jobs", "version": tracon_jobs.__version__},
        "security": [{"bearer": []}],
        "paths": {
            "/api/agents/{name}/run": {
                "post": _op(
                    "Submit an agent run (SSE by default; Prefer: respond-async for 202)",
                    {
                        "200": {"description": "text/event-stream of the run's events"},
                        "202": _json("Accepted", "Queued; Location names the run"),
                        "400": PROBLEM,
                        "503": PROBLEM,
                        **IDEMPOTENCY_RESPONSES,
                    },
                    parameters=[
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        },
                        {"name": "Prefer", "in": "header", "schema": {"type": "string"}},
                        IDEMPOTENCY_KEY,
                    ],
                    requestBody={
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/RunRequest"}
                            }
                        },
                    },
                )
            },
            "/api/runs": {
                "get": _op(
                    "List runs, newest first",
                    {"200": {"description": "a page of runs with nextCursor"}, "400": PROBLEM},
                    parameters=[
                        {"name": n, "in": "query", "schema": {"type": "string"}}
                        for n in ("status", "agent", "sessionId", "cursor", "limit")
                    ],
                )
            },
            "/api/runs/{id}": {
                "get": _op("A run", {"200": _json("Run", "the run")}, parameters=[RUN_ID])
            },
            "/api/runs/{id}/events": {
                "get": _op(
                    "The run's events; Accept: text/event-stream follows live",
                    {"200": {"description": "events in order"}},
                    parameters=[RUN_ID],
                )
            },
            "/api/runs/{id}/cancel": {
                "post": _op(
                    "Cancel a run and its descendants, wherever they execute",
                    {
                        "202": {"description": "the request is persisted and announced"},
                        "409": PROBLEM,
                    },
                    parameters=[RUN_ID],
                )
            },
            "/api/circuits": {
                "get": _op(
                    "Circuit and concurrency slots per provider",
                    {"200": {"description": "one item per configured provider"}},
                )
            },
            "/api/statistics/runs": {
                "get": _op(
                    "Counts, tokens and cost, grouped byModel (the model that answered)",
                    {"200": {"description": "statistics of the tenant's runs"}},
                )
            },
            "/api/runs/{id}/tree": {
                "get": _op(
                    "The run tree rooted at the run's root",
                    {"200": {"description": "runs"}},
                    parameters=[RUN_ID],
                )
            },
            **OPENAI_PATHS,
            "/healthz": {
                "get": {
                    "summary": "Liveness",
                    "security": [],
                    "responses": {"200": {"description": "alive"}},
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Readiness",
                    "security": [],
                    "responses": {
                        "200": {"description": "ready"},
                        "503": {"description": "not ready"},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "security": [],
                    "responses": {"200": {"description": "text format"}},
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Run": RUN_SCHEMA,
                "RunRequest": {
                    "type": "object",
                    "required": ["message"],
                    "additionalProperties": False,
                    "properties": {
                        "message": {"type": "string", "minLength": 1},
                        "sessionId": {"type": "string"},
                        "parameters": {"type": "object"},
                    },
                },
                "Accepted": {
                    "type": "object",
                    "properties": {"runId": {"type": "string"}, "status": {"type": "string"}},
                },
                "Problem": {
                    "type": "object",
                    "properties": {
                        "type": {"type": "string"},
                        "title": {"type": "string"},
                        "status": {"type": "integer"},
                        "detail": {"type": "string"},
                    },
                },
            },
            "responses": {
                "Problem": {
                    "description": "problem+json",
                    "content": {
                        "application/problem+json": {
                            "schema": {"$ref": "#/components/schemas/Problem"}
                        }
                    },
                }
            },
        },
    }


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(document())
