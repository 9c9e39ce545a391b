"""`GET /openapi.json`: the OpenAPI 3.1 description of the HTTP API."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

import tracon_jobs

bp = Blueprint("openapi", __name__)

PROBLEM = {"$ref": "#/components/responses/Problem"}
RUN_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
QUOTA_SPENT = {
    "description": "the tenant's cost quota is spent (`tenant_quota_exceeded`); nothing was"
    " written; Retry-After is the seconds to the end of the period",
    "headers": {"Retry-After": {"schema": {"type": "integer"}}},
    "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}},
}
QUOTA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["period", "limit", "used", "left", "resetsAt", "currency"],
    "properties": {
        "period": {"enum": ["day", "month"]},
        "limit": {"type": ["number", "null"], "description": "null: no quota"},
        "used": {"type": "number", "description": "spent in the current period"},
        "left": {"type": ["number", "null"]},
        "resetsAt": {"type": "string", "format": "date-time"},
        "currency": {"type": "string"},
    },
}


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
        "pendingApprovals": {
            "type": "array",
            "items": {"type": "string"},
            "description": "ids of the approvals a Waiting run waits for (else empty)",
        },
    },
}

APPROVAL_STATUSES = ["Pending", "Approved", "Rejected", "Expired", "Canceled"]
APPROVAL_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "runId", "tool", "status", "requestedAt", "expiresAt"],
    "properties": {
        "id": {"type": "string"},
        "runId": {"type": "string"},
        "tool": {"type": "string"},
        "callId": {"type": "string"},
        "arguments": {"type": "object"},
        "executionId": {"type": "string"},
        "status": {"enum": APPROVAL_STATUSES},
        "requestedAt": {"type": "string"},
        "expiresAt": {"type": "string"},
        "decidedAt": {"type": ["string", "null"]},
        "decidedBy": {"type": ["string", "null"]},
        "comment": {"type": ["string", "null"]},
        "consumedAt": {"type": ["string", "null"]},
    },
}
DECISION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["approve"],
    "additionalProperties": False,
    "properties": {
        "approve": {"type": "boolean"},
        "comment": {"type": "string", "maxLength": 2000},
    },
}
WAITING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "a /v1 answer for a run that waits for a person (202, Location)",
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "tracon.run"},
        "status": {"const": "waiting"},
        "pendingApprovals": {"type": "array", "items": {"type": "string"}},
        "location": {"type": "string"},
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
RUN_ID_HEADER = {
    "X-Tracon-Run-Id": {
        "description": "the run this request made (GET /api/runs/{id})",
        "schema": {"type": "string"},
    }
}
LIMIT = {
    "name": "limit",
    "in": "query",
    "schema": {"type": "integer", "minimum": 1, "maximum": 200, "default": 50},
}

TEXT_PART: dict[str, Any] = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"enum": ["text", "input_text", "output_text"]},
        "text": {"type": "string"},
    },
}
TEXT_CONTENT: dict[str, Any] = {
    "oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": TEXT_PART}]
}
CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": "other OpenAI fields are accepted and ignored",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "an agent's name"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "description": "the conversation; at least one user message",
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant"]},
                    "content": TEXT_CONTENT,
                },
            },
        },
        "stream": {"type": "boolean", "default": False},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": "boolean"}},
        },
    },
}
RESPONSES_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": "other OpenAI fields are accepted and ignored",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "an agent's name"},
        "input": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "description": "message items; at least one from the user",
                    "items": {
                        "type": "object",
                        "required": ["role"],
                        "properties": {
                            "type": {"const": "message"},
                            "role": {"enum": ["system", "developer", "user", "assistant"]},
                            "content": TEXT_CONTENT,
                        },
                    },
                },
            ]
        },
        "instructions": {"type": ["string", "null"]},
        "stream": {"type": "boolean", "default": False},
    },
}
MODEL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string", "description": "an agent's name"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"const": "tracon"},
    },
}
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "turn", "callId", "tool", "arguments", "executionId", "status"],
    "properties": {
        "id": {"type": "integer"},
        "turn": {"type": "integer"},
        "callId": {"type": "string"},
        "tool": {"type": "string"},
        "arguments": {"type": "object"},
        "executionId": {"type": "string"},
        "idempotencyKey": {"type": "string"},
        "status": {"enum": ["started", "succeeded", "failed"]},
        "result": {"description": "what the tool returned (null unless succeeded)"},
        "error": {
            "type": ["object", "null"],
            "properties": {
                "code": {"type": ["string", "null"]},
                "message": {"type": ["string", "null"]},
            },
        },
        "attempts": {"type": "integer"},
        "startedAt": {"type": "string"},
        "endedAt": {"type": ["string", "null"]},
        "durationMs": {"type": ["integer", "null"]},
    },
}
BINDING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "provider": {"type": "string"},
        "model": {"type": "string"},
        "fallbacks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"provider": {"type": "string"}, "model": {"type": "string"}},
            },
        },
        "temperature": {"type": ["number", "null"]},
        "topP": {"type": ["number", "null"]},
        "maxOutputTokens": {"type": ["integer", "null"]},
    },
}
AGENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "model", "tools", "subAgents", "requireApproval"],
    "properties": {
        "name": {"type": "string"},
        "model": BINDING_SCHEMA,
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": ["string", "null"]},
                    "sideEffect": {"enum": ["none", "read", "write", "destructive", "external"]},
                    "idempotent": {"type": "boolean"},
                    "requiresApproval": {
                        "type": "boolean",
                        "description": "registered requires_approval, or in requireApproval",
                    },
                },
            },
        },
        "subAgents": {"type": "array", "items": {"type": "string"}},
        "requireApproval": {"type": "array", "items": {"type": "string"}},
        "parameters": {"type": "object"},
    },
}


def _items(schema_ref: str, description: str) -> dict[str, Any]:
    items = {"type": "array", "items": {"$ref": f"#/components/schemas/{schema_ref}"}}
    schema = {"type": "object", "required": ["items"], "properties": {"items": items}}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _openai_op(summary: str, request_schema: str) -> dict[str, Any]:
    responses = {
        "200": {
            "description": "the OpenAI object, or text/event-stream with stream: true",
            "headers": RUN_ID_HEADER,
        },
        "202": {
            "description": (
                "the run is still going (Runs.BufferedWaitTimeout), or it waits for a person:"
                " then a tracon.run object, Location and X-Tracon-Run-Id"
            ),
            "headers": RUN_ID_HEADER,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/WaitingRun"}}
            },
        },
        **{status: OPENAI_ERROR for status in ("400", "401", "404", "429", "502", "503")},
        **IDEMPOTENCY_RESPONSES,
    }
    schema = {"$ref": f"#/components/schemas/{request_schema}"}
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    return {
        "summary": summary,
        "parameters": [IDEMPOTENCY_KEY],
        "requestBody": body,
        "responses": responses,
    }


OPENAI_PATHS: dict[str, Any] = {
    "/v1/chat/completions": {
        "post": _openai_op("OpenAI-compatible chat completions", "ChatCompletionRequest")
    },
    "/v1/responses": {"post": _openai_op("OpenAI-compatible responses", "ResponsesRequest")},
    "/v1/models": {
        "get": {
            "summary": "The agents, in OpenAI's model-list shape",
            "responses": {
                "200": {
                    "description": 'the agents: {"object": "list", "data": [models]}',
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "object": {"const": "list"},
                                    "data": {
                                        "type": "array",
                                        "items": {"$ref": "#/components/schemas/Model"},
                                    },
                                },
                            }
                        }
                    },
                },
                "401": OPENAI_ERROR,
            },
        }
    },
    "/v1/models/{model}": {
        "get": {
            "summary": "One agent as an OpenAI model",
            "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {
                "200": {
                    "description": "the model",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Model"}}
                    },
                },
                "401": OPENAI_ERROR,
                "404": OPENAI_ERROR,
            },
        }
    },
}


APPROVAL_PATHS: dict[str, Any] = {
    "/api/approvals": {
        "get": _op(
            "List the tenant's approvals, newest first",
            {"200": {"description": "a page of approvals with nextCursor"}, "400": PROBLEM},
            parameters=[
                {"name": "status", "in": "query", "schema": {"enum": APPROVAL_STATUSES}},
                {"name": "runId", "in": "query", "schema": {"type": "string"}},
                LIMIT,
                {"name": "cursor", "in": "query", "schema": {"type": "string"}},
            ],
        )
    },
    "/api/approvals/{id}": {
        "get": _op(
            "An approval", {"200": _json("Approval", "the approval")}, parameters=[APPROVAL_ID]
        )
    },
    "/api/approvals/{id}/decision": {
        "post": _op(
            "Approve or reject a pending approval (once; accepted while the node drains)",
            {
                "200": _json("Approval", "the decided approval"),
                "400": PROBLEM,
                "409": PROBLEM,
                "422": IDEMPOTENCY_RESPONSES["422"],
                "501": IDEMPOTENCY_RESPONSES["501"],
            },
            parameters=[APPROVAL_ID, IDEMPOTENCY_KEY],
            requestBody={
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Decision"}}
                },
            },
        )
    },
}


PREFER = {
    "name": "Prefer",
    "in": "header",
    "schema": {"type": "string"},
    "description": "respond-async: answer 202 with Location instead of the event stream",
}
WORKFLOW_STARTED = {
    "200": {"description": "text/event-stream of the new run's events"},
    "202": {"description": "queued (Prefer: respond-async); Location names the new run"},
    "400": PROBLEM,
    "409": PROBLEM,
    "422": {"description": "Idempotency-Key reused with another method, path or body"},
    "503": PROBLEM,
}
WORKFLOW_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "input": {"type": "object", "description": "the workflow function's input"},
        "sessionId": {"type": "string", "maxLength": 200},
    },
}
WORKFLOW_PATHS: dict[str, Any] = {
    "/api/workflows": {
        "get": _op(
            "The registered workflows", {"200": {"description": "{items: [{name, description}]}"}}
        )
    },
    "/api/workflows/{name}/run": {
        "post": _op(
            "Start a workflow run (SSE by default; Prefer: respond-async for 202, which a job"
            " owns and, with Workflows.ResumeInterruptedRuns, resumes after a crash)",
            {**WORKFLOW_STARTED, "429": QUOTA_SPENT},
            parameters=[
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                PREFER,
                IDEMPOTENCY_KEY,
            ],
            requestBody={
                "content": {"application/json": {"schema": WORKFLOW_REQUEST_SCHEMA}},
            },
        )
    },
    "/api/workflows/runs/{id}/respond": {
        "post": _op(
            "Answer the question a Waiting workflow run asked; a new run continues the chain"
            " (409 when it waits for nothing)",
            WORKFLOW_STARTED,
            parameters=[RUN_ID, PREFER, IDEMPOTENCY_KEY],
            requestBody={
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["answer"],
                            "additionalProperties": False,
                            "properties": {"answer": {"description": "any JSON value"}},
                        }
                    }
                },
            },
        )
    },
    "/api/workflows/runs/{id}/resume": {
        "post": _op(
            "Resume a Failed workflow run from its latest checkpoint (409 for a live, waiting,"
            " completed or already resumed run)",
            WORKFLOW_STARTED,
            parameters=[RUN_ID, PREFER, IDEMPOTENCY_KEY],
        )
    },
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
                        "202": _json(
                            "Accepted",
                            "Queued; Location names the run (with Idempotency-Key: the run"
                            " JSON of a run still going or waiting for a person)",
                        ),
                        "400": PROBLEM,
                        "429": QUOTA_SPENT,
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
                        {
                            "name": "status",
                            "in": "query",
                            "schema": {"enum": RUN_SCHEMA["properties"]["status"]["enum"]},
                        },
                        {"name": "agent", "in": "query", "schema": {"type": "string"}},
                        {
                            "name": "sessionId",
                            "in": "query",
                            "schema": {"type": "string", "maxLength": 200},
                        },
                        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
                        LIMIT,
                    ],
                )
            },
            "/api/runs/{id}": {
                "get": _op(
                    "A run; ?include=messages adds its saved conversation",
                    {"200": _json("Run", "the run"), "400": PROBLEM},
                    parameters=[
                        RUN_ID,
                        {
                            "name": "include",
                            "in": "query",
                            "description": "messages: add the conversation as `messages`",
                            "schema": {"enum": ["messages"]},
                        },
                    ],
                )
            },
            "/api/runs/{id}/tool-calls": {
                "get": _op(
                    "The run's tool-call ledger, in the order the calls were recorded",
                    {"200": _items("ToolCall", "the ledger rows")},
                    parameters=[RUN_ID],
                )
            },
            "/api/agents": {
                "get": {
                    "summary": "The configured agents",
                    "responses": {"200": _items("Agent", "the agents"), "401": PROBLEM},
                }
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
            "/api/quota": {
                "get": _op(
                    "The tenant's cost quota and what it spent in the current period",
                    {"200": _json("Quota", "period, limit, used, left, resetsAt, currency")},
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
            **APPROVAL_PATHS,
            **WORKFLOW_PATHS,
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
                "Approval": APPROVAL_SCHEMA,
                "Decision": DECISION_SCHEMA,
                "WaitingRun": WAITING_SCHEMA,
                "ToolCall": TOOL_CALL_SCHEMA,
                "Agent": AGENT_SCHEMA,
                "Model": MODEL_SCHEMA,
                "ChatCompletionRequest": CHAT_REQUEST,
                "ResponsesRequest": RESPONSES_REQUEST,
                "RunRequest": {
                    "type": "object",
                    "required": ["message"],
                    "additionalProperties": False,
                    "properties": {
                        "message": {"type": "string", "minLength": 1},
                        "sessionId": {"type": ["string", "null"], "maxLength": 200},
                        "parameters": {"type": ["object", "null"]},
                    },
                },
                "Quota": QUOTA_SCHEMA,
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
