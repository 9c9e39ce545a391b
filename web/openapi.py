"""`GET /openapi.json`: the OpenAPI 3.1 description of the HTTP API.

It is held to two promises (tests/integration/test_fuzz.py runs schemathesis on it): a request
the description allows is accepted, unless it names something that does not exist or meets a
state the description cannot know (a cursor this API did not return), and a request it
forbids is refused with a 4xx. So every limit the API enforces is written here (patterns,
lengths, enums, ranges, `additionalProperties: false` where unknown fields are a `400`), the
limits that are settings come from the running settings, and every operation lists every
answer it can give. Errors are shared `components/responses`: problem+json on `/api`, OpenAI's
error object on `/v1`, except 414 and 431, which the server writes before any route is known.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

import tracon_jobs
from tracon_jobs.schedules.definition import NAME_MAX
from tracon_jobs.schedules.policies import CatchUp, Outcome, Overlap
from tracon_jobs.settings import Settings
from tracon_jobs.webhooks.addresses import MAX_URL_LENGTH
from tracon_jobs.webhooks.endpoints import DELIVERY_STATUSES, MAX_DESCRIPTION, TENANT_TYPES
from web.extensions import runtime
from web.openai_request import (
    FORMAT_NAME,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    MAX_OUTPUT_LIMIT,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    NEUTRAL,
    REASONING_EFFORTS,
    TOKEN_ID,
    VERBOSITIES,
)
from web.openai_shapes import WITHDRAWN_CODE
from web.runs import TREE_NODE_KEYS
from web.webhooks import MAX_GRACE_SECONDS
from web.workflows import MAX_ANSWERS

bp = Blueprint("openapi", __name__)

OPENAI = "OpenAI"
PROBLEM = "Problem"
TIMESTAMP = {"type": "string", "format": "date-time"}
MAYBE_TIMESTAMP = {"type": ["string", "null"], "format": "date-time"}
RUN_STATUSES = ["Queued", "Running", "Waiting", "Completed", "Failed", "Canceled"]
APPROVAL_STATUSES = ["Pending", "Approved", "Rejected", "Expired", "Canceled"]
MAX_SESSION_ID = 200
MAX_PAGE = 200
MAX_EVENT_SEQ = 2**31 - 1
MAX_COMMENT = 2000


def _ref(kind: str, name: str) -> dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


def _schema(name: str) -> dict[str, str]:
    return _ref("schemas", name)


def _json(schema: dict[str, Any], description: str, **extra: Any) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": schema}},
        **extra,
    }


# -- errors ---------------------------------------------------------------------------

ERRORS: dict[int, str] = {
    400: "a parameter, header or body this operation refuses (`field` names it): a NUL"
    " character anywhere, a body that is not the JSON the operation takes",
    401: "no API key, or not a valid one",
    404: "nothing of that name for this tenant (another tenant's is 404 too), or no such route",
    405: "a method this path does not take; Allow lists those it does",
    409: "a conflict with the resource's state (see the operation)",
    413: "a body larger than Web.MaxRequestBytes",
    414: "a request line longer than 4094 bytes (the server's own answer, problem+json on"
    " every route)",
    422: "this Idempotency-Key was used with another method, path or body",
    429: "the tenant's cost quota is spent (Retry-After: seconds to the end of the period), or"
    " its live event streams are at their cap",
    431: "a header field larger than 8190 bytes, or more than 100 of them (the server's own"
    " answer, problem+json on every route)",
    501: "Idempotency-Key sent while Idempotency.Enabled is false",
    502: "the run failed (a buffered answer)",
    503: "this node drains, the broker refused the message, or SQL or Redis does not answer;"
    " retry after Retry-After seconds",
}
SERVER_OWN = {414, 431}
HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}}},
    405: {"Allow": {"required": True, "schema": {"type": "string", "minLength": 1}}},
    429: {"Retry-After": {"schema": {"type": "integer", "minimum": 0}}},
    503: {"Retry-After": {"required": True, "schema": {"type": "integer", "minimum": 0}}},
}
OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's error object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "RFC 9457 problem details",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "detail": {"type": "string"},
        "field": {"type": "string", "description": "the offending input (400)"},
        "code": {"type": "string"},
    },
}


def _error_response(shape: str, status: int, max_request_bytes: int) -> dict[str, Any]:
    description = ERRORS[status]
    if status == 413:
        description += f" ({max_request_bytes} bytes here)"
    if shape == OPENAI:
        content = {"application/json": {"schema": _schema("OpenAIError")}}
    else:
        content = {"application/problem+json": {"schema": _schema("Problem")}}
    response: dict[str, Any] = {"description": description, "content": content}
    if status in HEADERS:
        response["headers"] = HEADERS[status]
    return response


def error_responses(max_request_bytes: int) -> dict[str, Any]:
    """`components/responses`: `Problem400` ... and `OpenAI400` ..., one per status."""
    return {
        f"{shape}{status}": _error_response(shape, status, max_request_bytes)
        for shape in (PROBLEM, OPENAI)
        for status in ERRORS
        if not (shape == OPENAI and status in SERVER_OWN)
    }


def errors(shape: str, *statuses: int) -> dict[str, Any]:
    """The error answers of an operation: the given ones, and those every operation can give
    (400, 405, 414, 431)."""
    every = sorted({400, 405, 414, 431, *statuses})
    return {
        str(status): _ref("responses", f"{PROBLEM if status in SERVER_OWN else shape}{status}")
        for status in every
    }


# -- parameters -----------------------------------------------------------------------


def _path(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": schema,
    }


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "description": description, "schema": schema}


RUN_ID = _path("id", {"type": "string", "format": "uuid"}, "a run's id")
APPROVAL_ID = _path("id", {"type": "string", "format": "uuid"}, "an approval's id")
NAME = _path("name", {"type": "string", "minLength": 1}, "an agent's or workflow's name")
EVENT_NAME = _path("name", {"type": "string", "minLength": 1, "maxLength": 200}, "an event's name")
PREFER = {
    "name": "Prefer",
    "in": "header",
    "description": "RFC 7240; `respond-async` answers 202 with Location at once (other"
    " preferences are ignored)",
    "schema": {"type": "string"},
}
LIMIT = _query(
    "limit",
    {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 50},
    "page size",
)
CURSOR = _query(
    "cursor",
    {"type": "string", "pattern": "^[A-Za-z0-9_-]*$"},
    "the previous page's nextCursor (any other value is a 400)",
)


EVENT_SEQ = {
    "type": ["integer", "string"],
    "description": "an event's sequence number, or empty",
    "minimum": 0,
    "maximum": MAX_EVENT_SEQ,
    "maxLength": 0,
}


def idempotency_key(max_length: int, needs_async: bool = False) -> dict[str, Any]:
    description = "execute once; a repeat gets the stored 2xx with Idempotency-Replayed: true"
    if needs_async:
        description += "; on this route only together with Prefer: respond-async (else 400)"
    else:
        description += "; not with `stream: true` (400)"
    return {
        "name": "Idempotency-Key",
        "in": "header",
        "description": description,
        "schema": {"type": "string", "minLength": 1, "maxLength": max_length, "pattern": "\\S"},
    }


# -- shapes ---------------------------------------------------------------------------

USAGE = {
    "type": "object",
    "required": ["inputTokens", "outputTokens", "totalTokens"],
    "properties": {
        key: {"type": "integer", "minimum": 0}
        for key in ("inputTokens", "outputTokens", "totalTokens")
    },
}
RUN_ERROR = {
    "type": ["object", "null"],
    "required": ["type", "class", "message"],
    "properties": {
        "type": {"type": "string"},
        "class": {"type": ["string", "null"]},
        "message": {"type": ["string", "null"]},
        "retryAfter": {"type": "number"},
    },
}
RUN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "agent", "kind", "status", "input", "rootRunId", "depth", "usage", "cost"],
    "properties": {
        "id": {"type": "string"},
        "tenant": {"type": "string"},
        "agent": {"type": "string"},
        "kind": {"enum": ["agent", "workflow"]},
        "status": {"enum": RUN_STATUSES},
        "input": {"type": "object"},
        "output": {"type": ["object", "null"]},
        "sessionId": {"type": ["string", "null"]},
        "parentRunId": {"type": ["string", "null"]},
        "rootRunId": {"type": "string"},
        "depth": {"type": "integer", "minimum": 0},
        "continuedFromRunId": {"type": ["string", "null"]},
        "attempt": {"type": "integer"},
        "traceparent": {
            "type": ["string", "null"],
            "description": "The W3C traceparent of the run's submission span (null when "
            "untraced): its execution's spans are in this trace",
        },
        "workflowVersion": {
            "type": ["string", "null"],
            "description": "a workflow run's code version, as the worker that executed it ran "
            "it (declared, or a hash of its module's source); null for an agent run",
        },
        "modelId": {"type": ["string", "null"]},
        "usage": USAGE,
        "cost": {
            "type": "object",
            "required": ["amount", "currency"],
            "properties": {
                "amount": {"type": "number"},
                "currency": {"type": ["string", "null"]},
                "source": {"type": ["string", "null"]},
            },
        },
        "error": RUN_ERROR,
        "attempts": {"type": "array", "items": {"type": "object"}},
        "createdAt": TIMESTAMP,
        "startedAt": MAYBE_TIMESTAMP,
        "endedAt": MAYBE_TIMESTAMP,
        "heartbeatAt": MAYBE_TIMESTAMP,
        "cancelRequestedAt": MAYBE_TIMESTAMP,
        "pendingApprovals": {
            "type": "array",
            "items": {"type": "string"},
            "description": "ids of the approvals a Waiting run waits for (else empty)",
        },
        "messages": {
            "type": "array",
            "items": {"type": "object"},
            "description": "with ?include=messages: the conversation saved after its last turn",
        },
    },
}
TREE_NODE = {
    "type": "object",
    "required": ["id", "agent", "kind", "status", "depth"],
    "properties": {key: RUN_SCHEMA["properties"][key] for key in TREE_NODE_KEYS},
}
EVENT_SCHEMA = {
    "type": "object",
    "required": ["seq", "type", "at", "data"],
    "properties": {
        "seq": {"type": "integer", "minimum": 1},
        "type": {"type": "string"},
        "at": TIMESTAMP,
        "data": {"type": "object"},
    },
}
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "runId", "tool", "status", "requestedAt", "expiresAt"],
    "properties": {
        "id": {"type": "string"},
        "runId": {"type": "string"},
        "tool": {"type": "string"},
        "callId": {"type": ["string", "null"]},
        "arguments": {"type": ["object", "null"]},
        "executionId": {"type": ["string", "null"]},
        "status": {"enum": APPROVAL_STATUSES},
        "requestedAt": TIMESTAMP,
        "expiresAt": TIMESTAMP,
        "decidedAt": MAYBE_TIMESTAMP,
        "decidedBy": {"type": ["string", "null"]},
        "comment": {"type": ["string", "null"]},
        "consumedAt": MAYBE_TIMESTAMP,
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
        "idempotencyKey": {"type": ["string", "null"]},
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
        "startedAt": MAYBE_TIMESTAMP,
        "endedAt": MAYBE_TIMESTAMP,
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
                    "sideEffect": {
                        "enum": ["none", "read", "write", "destructive", "external", None]
                    },
                    "idempotent": {"type": "boolean"},
                    "requiresApproval": {
                        "type": ["boolean", "null"],
                        "description": "registered requires_approval, or in requireApproval",
                    },
                },
            },
        },
        "subAgents": {"type": "array", "items": {"type": "string"}},
        "requireApproval": {"type": "array", "items": {"type": "string"}},
        "parameters": {"type": ["object", "null"]},
    },
}
QUOTA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["period", "limit", "used", "left", "resetsAt", "currency"],
    "properties": {
        "period": {"enum": ["day", "month"]},
        "limit": {"type": ["number", "null"], "description": "null: no quota"},
        "used": {"type": "number", "description": "spent in the current period"},
        "left": {"type": ["number", "null"]},
        "resetsAt": TIMESTAMP,
        "currency": {"type": "string"},
        "maxConcurrentRuns": {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "most of the tenant's runs executing at once (null: no limit)",
        },
        "weight": {
            "type": "integer",
            "minimum": 1,
            "description": "the tenant's share of fair dispatch while tenants have runs lined up",
        },
        "priority": {
            "type": "object",
            "required": ["default", "min", "max"],
            "description": "the priorities a run may ask for; higher go first in its tenant's line",
            "properties": {
                "default": {"type": "integer"},
                "min": {"type": "integer"},
                "max": {"type": "integer"},
            },
        },
    },
}
STATISTICS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["total", "byStatus", "usage", "cost", "byModel"],
    "properties": {
        "total": {"type": "integer", "minimum": 0},
        "byStatus": {"type": "object", "additionalProperties": {"type": "integer"}},
        "usage": USAGE,
        "cost": {"type": "object", "required": ["amount"]},
        "byModel": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["model", "runs", "usage", "cost"],
                "properties": {"model": {"type": ["string", "null"]}, "usage": USAGE},
            },
        },
    },
}
CIRCUITS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["enabled", "items"],
    "properties": {
        "enabled": {"type": "boolean"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["provider", "state", "consecutiveFailures", "retryAfter", "slots"],
                "properties": {
                    "provider": {"type": "string"},
                    "state": {"enum": ["closed", "open", "half_open"]},
                    "consecutiveFailures": {"type": "integer"},
                    "retryAfter": {"type": ["number", "null"]},
                    "probesInFlight": {"type": "integer"},
                    "slots": {"type": "object"},
                    "rateLimits": {
                        "type": "array",
                        "description": "each limited scope's window: the provider's, its models'",
                        "items": {
                            "type": "object",
                            "required": ["scope", "requests", "tokens", "blockedFor"],
                            "properties": {
                                "scope": {"type": "string"},
                                "requestsPerMinute": {"type": ["integer", "null"]},
                                "requests": {"type": "integer", "minimum": 0},
                                "tokensPerMinute": {"type": ["integer", "null"]},
                                "tokens": {"type": "integer"},
                                "blockedFor": {"type": ["number", "null"]},
                            },
                        },
                    },
                },
            },
        },
    },
}
ACCEPTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["runId", "status"],
    "properties": {"runId": {"type": "string"}, "status": {"enum": RUN_STATUSES}},
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
OPENAI_OBJECT: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's `chat.completion` or `response` object",
    "required": ["id", "object", "model"],
    "properties": {
        "id": {"type": "string"},
        "object": {"enum": ["chat.completion", "response"]},
        "model": {"type": "string"},
    },
}


def _items(schema: dict[str, Any], description: str, **more: Any) -> dict[str, Any]:
    properties = {"items": {"type": "array", "items": schema}, **more}
    body = {"type": "object", "required": list(properties), "properties": properties}
    return _json(body, description)


# -- request bodies -------------------------------------------------------------------

NO_NUL = "strings hold no NUL character or lone surrogate, at any depth (else 400)"
RUN_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": NO_NUL,
    "required": ["message"],
    "additionalProperties": False,
    "properties": {
        "message": {"type": "string", "minLength": 1},
        "sessionId": {"type": ["string", "null"], "maxLength": MAX_SESSION_ID},
        "parameters": {"type": ["object", "null"], "description": "the agent's parameters"},
    },
}
DECISION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["approve"],
    "additionalProperties": False,
    "properties": {
        "approve": {"type": "boolean"},
        "comment": {"type": ["string", "null"], "maxLength": MAX_COMMENT},
    },
}
WORKFLOW_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": NO_NUL,
    "additionalProperties": False,
    "properties": {
        "input": {"type": "object", "description": "the workflow function's input"},
        "sessionId": {"type": ["string", "null"], "maxLength": MAX_SESSION_ID},
    },
}
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": NO_NUL,
    "required": ["answer"],
    "additionalProperties": False,
    "properties": {"answer": {"description": "any JSON value"}},
}
ANSWERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": NO_NUL,
    "required": ["answers"],
    "additionalProperties": False,
    "properties": {
        "answers": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_ANSWERS,
            "items": {
                "type": "object",
                "required": ["runId", "answer"],
                "additionalProperties": False,
                "properties": {
                    "runId": {"type": "string", "format": "uuid"},
                    "answer": {"description": "any JSON value"},
                },
            },
        }
    },
}
ANSWERED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["items"],
    "properties": {
        "items": {
            "type": "array",
            "description": "one per answer, in the request's order",
            "items": {
                "type": "object",
                "required": ["runId", "status"],
                "properties": {
                    "runId": {"type": "string", "description": "the run answered"},
                    "status": {
                        "enum": [202, 404, 409],
                        "description": "202 answered (continuationRunId continues the chain);"
                        " 404 no such workflow run of the tenant; 409 it waits for no answer",
                    },
                    "continuationRunId": {"type": "string", "format": "uuid"},
                    "runStatus": {"type": "string"},
                    "detail": {"type": "string"},
                },
            },
        }
    },
}
EVENT_BODY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": NO_NUL,
    "additionalProperties": False,
    "properties": {"payload": {"description": "any JSON value: what ctx.wait_for returns"}},
}
EVENT_DELIVERED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["runId", "status", "event", "outcome"],
    "properties": {
        "runId": {"type": "string", "format": "uuid"},
        "status": {"type": "string"},
        "event": {"type": "string"},
        "outcome": {"enum": ["delivered", "kept"]},
    },
}
TEXT_PART: dict[str, Any] = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"enum": ["text", "input_text", "output_text"]},
        "text": {"type": "string"},
    },
}
TEXT_CONTENT: dict[str, Any] = {"type": ["string", "null", "array"], "items": TEXT_PART}
ROLES = ["system", "developer", "user", "assistant"]
USER_MESSAGE = {"type": "object", "required": ["role"], "properties": {"role": {"const": "user"}}}
SERVER_TOOLS = "the agent's tools are configured on the server: only an empty list (else 400)"
OPEN_CHOICE = {
    "enum": ["auto", "none", None],
    "description": "the agent's model decides when to call its tools (anything else is a 400)",
}
NO_TOOLS = {"type": ["array", "null"], "maxItems": 0, "description": SERVER_TOOLS}
OUTPUT_LIMIT_USE = "replaces the agent's Model.MaxOutputTokens for this run"
OUTPUT_LIMIT = {
    "type": ["integer", "null"],
    "minimum": 1,
    "maximum": MAX_OUTPUT_LIMIT,
    "description": OUTPUT_LIMIT_USE,
}
SAMPLING: dict[str, Any] = {
    "temperature": {
        "type": ["number", "null"],
        "minimum": 0,
        "maximum": 2,
        "description": "replaces the agent's Model.Temperature for this run; at most 1 when "
        "a provider of the agent's chain is anthropic (else 400)",
    },
    "top_p": {
        "type": ["number", "null"],
        "minimum": 0,
        "maximum": 1,
        "description": "replaces the agent's Model.TopP for this run",
    },
    "tools": NO_TOOLS,
    "tool_choice": OPEN_CHOICE,
}


def neutral(field: str) -> dict[str, Any]:
    """A field the run cannot honour: only the values that ask for nothing (`NEUTRAL`)."""
    values, why = NEUTRAL[field]
    return {"enum": list(values), "description": f"anything else is a 400: {why}"}


def options_object(properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": properties,
        **more,
    }


UNUSED = "accepted and not passed on: by OpenAI's definition it changes nothing of the answer"
ANTHROPIC_REFUSES = "; a 400 when a provider of the agent's chain is anthropic"
NULLABLE_TEXT = {"type": ["string", "null"]}
NULL = {"type": "null"}
OBJECT = {"type": "object"}
STRING = {"type": "string"}
FORMAT_TYPES = ["text", "json_object", "json_schema"]
NO_FORMAT = {"type": {"enum": ["text", "json_object"]}}
RESPONSE_FORMAT_USE = (
    "replaces the agent's Model.ResponseFormat for this run (text: none); json_object is a "
    "400 when a provider of the agent's chain is anthropic, and json_schema needs its schema"
)
SHARED_FIELDS: dict[str, Any] = {
    **SAMPLING,
    "metadata": {
        "type": ["object", "null"],
        "maxProperties": MAX_METADATA_PAIRS,
        "propertyNames": {"maxLength": MAX_METADATA_KEY},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        "description": "kept with the run (its input's metadata) and shown on a response",
    },
    "parallel_tool_calls": {"type": ["boolean", "null"], "description": UNUSED},
    "user": {**NULLABLE_TEXT, "description": UNUSED},
    "safety_identifier": {**NULLABLE_TEXT, "description": UNUSED},
    "prompt_cache_key": {**NULLABLE_TEXT, "description": UNUSED},
    "prompt_cache_retention": {"enum": ["in_memory", "24h", None], "description": UNUSED},
    "prompt_cache_options": options_object(
        {
            "mode": {"enum": ["implicit", "explicit", None]},
            "ttl": {"enum": ["30m", "12h", None]},
            "prewarm": neutral("prompt_cache_options.prewarm"),
            "comparison_response_id": neutral("prompt_cache_options.comparison_response_id"),
        },
        description=UNUSED,
    ),
    **{field: neutral(field) for field in ("store", "service_tier", "top_logprobs", "moderation")},
}
PENALTY = {
    "type": ["number", "null"],
    "minimum": -2,
    "maximum": 2,
    "description": "sent to the model for this run; other than 0, a 400 when a provider of the "
    "agent's chain is anthropic",
}
CHAT_ONLY_NEUTRAL = ["n", "logprobs", "prediction", "audio", "modalities", "web_search_options"]
RESPONSES_ONLY_NEUTRAL = [
    "background",
    "background_options",
    "conversation",
    "previous_response_id",
    "include",
    "max_tool_calls",
    "prompt",
    "truncation",
    "context_management",
    "image",
    "access_programs",
]
REASONING_EFFORT = {
    "enum": [*REASONING_EFFORTS, None],
    "description": "sent to the model for this run" + ANTHROPIC_REFUSES,
}
VERBOSITY = {
    "enum": [*VERBOSITIES, None],
    "description": "sent to the model for this run" + ANTHROPIC_REFUSES,
}
FORMAT_SPEC = ("name", "schema", "description", "strict")
TEXT_FORMAT = options_object(
    {
        "type": {"enum": FORMAT_TYPES},
        "name": {"type": ["string", "null"], "pattern": FORMAT_NAME},
        "description": NULLABLE_TEXT,
        "schema": {"type": ["object", "null"]},
        "strict": {"type": ["boolean", "null"]},
    },
    required=["type"],
    anyOf=[
        {"properties": {**NO_FORMAT, **{key: NULL for key in FORMAT_SPEC}}},
        {
            "properties": {"type": {"const": "json_schema"}, "name": STRING, "schema": OBJECT},
            "required": ["name", "schema"],
        },
    ],
    description=RESPONSE_FORMAT_USE,
)
UNKNOWN_FIELDS = "a field not described here is a 400 (unknown_parameter); "
CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": UNKNOWN_FIELDS + NO_NUL,
    "required": ["model", "messages"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "an agent's name"},
        "messages": {
            "type": "array",
            "description": "the conversation; at least one user message",
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {"role": {"enum": ROLES}, "content": TEXT_CONTENT},
            },
            "contains": USER_MESSAGE,
        },
        "stream": {"type": "boolean", "default": False},
        "stream_options": options_object(
            {
                "include_usage": {"type": "boolean"},
                "include_obfuscation": neutral("stream_options.include_obfuscation"),
            }
        ),
        **SHARED_FIELDS,
        "max_tokens": OUTPUT_LIMIT,
        "max_completion_tokens": {
            **OUTPUT_LIMIT,
            "description": "with max_tokens, the smaller holds; " + OUTPUT_LIMIT_USE,
        },
        "functions": NO_TOOLS,
        "function_call": OPEN_CHOICE,
        "response_format": options_object(
            {
                "type": {"enum": FORMAT_TYPES},
                "json_schema": options_object(
                    {
                        "name": {"type": "string", "pattern": FORMAT_NAME},
                        "description": NULLABLE_TEXT,
                        "schema": {"type": ["object", "null"]},
                        "strict": {"type": ["boolean", "null"]},
                    },
                    required=["name"],
                ),
            },
            required=["type"],
            anyOf=[
                {"properties": {**NO_FORMAT, "json_schema": NULL}},
                {
                    "properties": {
                        "type": {"const": "json_schema"},
                        "json_schema": {"type": "object"},
                    },
                    "required": ["json_schema"],
                },
            ],
            description=RESPONSE_FORMAT_USE,
        ),
        "stop": {
            "type": ["string", "array", "null"],
            "minLength": 1,
            "maxItems": MAX_STOP_SEQUENCES,
            "items": {"type": "string", "minLength": 1},
            "description": "sent to the model for this run (anthropic: stop_sequences, each "
            "with a character other than whitespace, else 400)",
        },
        "seed": {
            "type": ["integer", "null"],
            "minimum": -MAX_SEED - 1,
            "maximum": MAX_SEED,
            "description": "sent to the model for this run" + ANTHROPIC_REFUSES,
        },
        "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY,
        "logit_bias": {
            "type": ["object", "null"],
            "propertyNames": {"pattern": TOKEN_ID},
            "additionalProperties": {"type": "integer", "minimum": -100, "maximum": 100},
            "description": "sent to the model for this run; not empty, a 400 when a provider "
            "of the agent's chain is anthropic",
        },
        "reasoning_effort": REASONING_EFFORT,
        "verbosity": VERBOSITY,
        **{field: neutral(field) for field in CHAT_ONLY_NEUTRAL},
    },
}
RESPONSES_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": UNKNOWN_FIELDS + NO_NUL,
    "required": ["model", "input"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "an agent's name"},
        "input": {
            "type": ["string", "array"],
            "description": "the user's text, or message items with at least one from the user",
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "type": {"const": "message"},
                    "role": {"enum": ROLES},
                    "content": TEXT_CONTENT,
                },
            },
            "contains": USER_MESSAGE,
        },
        "instructions": {
            "type": ["string", "null"],
            "description": "a system message after the agent's instructions",
        },
        "stream": {"type": "boolean", "default": False},
        "stream_options": options_object(
            {"include_obfuscation": neutral("stream_options.include_obfuscation")}
        ),
        **SHARED_FIELDS,
        "max_output_tokens": OUTPUT_LIMIT,
        "text": options_object({"format": TEXT_FORMAT, "verbosity": VERBOSITY}),
        "reasoning": options_object(
            {
                "effort": REASONING_EFFORT,
                **{
                    key: neutral(f"reasoning.{key}")
                    for key in ("summary", "generate_summary", "context", "mode")
                },
            }
        ),
        **{field: neutral(field) for field in RESPONSES_ONLY_NEUTRAL},
    },
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


# -- operations -----------------------------------------------------------------------

LIVE_TEXT_EVENTS = ["ModelTextDelta", "ModelTextReset"]


def _json_text(schema: dict[str, Any]) -> dict[str, Any]:
    """A string that holds JSON of `schema` (an SSE frame's `data`)."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


CALL_SEQ = {
    "type": "integer",
    "minimum": 1,
    "description": "the seq of the model call's ModelCallStarted event",
}
MODEL_TEXT_DELTA: dict[str, Any] = {
    "type": "object",
    "description": "text the open model call wrote, following what this stream sent of it;"
    " joined, a call's deltas are the text of its ModelCallCompleted",
    "required": ["type", "data"],
    "properties": {
        "type": {"const": "ModelTextDelta"},
        "data": {
            "type": "object",
            "required": ["callSeq", "text"],
            "properties": {"callSeq": CALL_SEQ, "text": {"type": "string", "minLength": 1}},
        },
    },
}
MODEL_TEXT_RESET: dict[str, Any] = {
    "type": "object",
    "description": "the text this stream sent of the call is withdrawn (the call ended without"
    " completing: it failed, or its worker was lost)",
    "required": ["type", "data"],
    "properties": {
        "type": {"const": "ModelTextReset"},
        "data": {"type": "object", "required": ["callSeq"], "properties": {"callSeq": CALL_SEQ}},
    },
}
STREAM_ID = "^([0-9a-f-]+:)?[0-9]+$"
"""A stored event's `id` on a stream: its seq, or `<run id>:<seq>` in a continuation."""
EVENT_FRAME: dict[str, Any] = {
    "type": "object",
    "description": "a stored event: `id: <seq>` (what Last-Event-ID names; `<run id>:<seq>`"
    " for the events of a run that continues the stream's run after its worker died),"
    " `event: <type>`, `data: <event JSON>`",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "pattern": STREAM_ID},
        "event": {
            "type": "string",
            "pattern": "^[A-Z][A-Za-z]+$",
            "not": {"enum": LIVE_TEXT_EVENTS},
        },
        "data": _json_text(_schema("Event")),
    },
}
LIVE_TEXT_FRAME: dict[str, Any] = {
    "type": "object",
    "description": "the open model call's text as it streams, or its withdrawal: `event:"
    " ModelTextDelta` or `event: ModelTextReset` and `data:` its JSON, sent with no `id` line,"
    " so Last-Event-ID counts stored events only",
    "required": ["event", "data"],
    "properties": {
        "id": {
            "type": "string",
            "pattern": STREAM_ID,
            "description": "never sent: a client keeps the last stored event's (the SSE rules)",
        },
        "event": {"enum": LIVE_TEXT_EVENTS},
        "data": _json_text({"oneOf": [_schema("ModelTextDelta"), _schema("ModelTextReset")]}),
    },
}
SSE_EVENT: dict[str, Any] = {
    "description": "one server-sent event: a stored event (with `id`), or, between a model"
    " call's ModelCallStarted and its end, a live text frame (without)",
    "oneOf": [_schema("EventFrame"), _schema("LiveTextFrame")],
}
RESPONSE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
    "response.failed",
]
CHAT_CHUNK: dict[str, Any] = {
    "type": "object",
    "description": "OpenAI's `chat.completion.chunk`: the role first, then each piece of the"
    " answer's text as the model writes it in `delta.content` (a blank line between model"
    " turns), then `finish_reason: stop`, and with `stream_options.include_usage` a last chunk"
    " with no choices and `usage`",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion.chunk"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "delta", "finish_reason"],
                "properties": {
                    "index": {"const": 0},
                    "delta": {
                        "type": "object",
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": "string"},
                        },
                    },
                    "finish_reason": {"enum": ["stop", None]},
                },
            },
        },
        "usage": {"type": "object"},
    },
}
STREAM_TEXT_WITHDRAWN: dict[str, Any] = {
    "type": "object",
    "description": "the end of a chat completions stream whose text was withdrawn (the model"
    " call that wrote it failed): OpenAI's error object naming the run, then `data: [DONE]`;"
    " the run goes on, its answer is at /api/runs/{id}",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"const": "server_error"},
                "code": {"const": WITHDRAWN_CODE},
            },
        }
    },
}
RESPONSE_STREAM_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "a typed Responses stream event: `response.output_text.delta` for each piece"
    " of text as the model writes it, and at the end `response.completed` or `response.failed`"
    f" (a failed or canceled run, or withdrawn text: `response.error.code` is `{WITHDRAWN_CODE}`)",
    "required": ["type", "sequence_number"],
    "properties": {
        "type": {"enum": RESPONSE_EVENTS},
        "sequence_number": {"type": "integer", "minimum": 0},
        "delta": {"type": "string", "description": "response.output_text.delta: the piece"},
        "response": {
            "type": "object",
            "required": ["id", "object", "status"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "response"},
                "status": {"enum": ["in_progress", "completed", "failed", "cancelled"]},
                "error": {
                    "type": ["object", "null"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                },
            },
        },
    },
}
OPENAI_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "one server-sent event. Chat completions: `data:` a chunk (ChatCompletionChunk)"
    " for each piece of text as the model writes it, and last `data: [DONE]`; text already sent"
    f" that is withdrawn ends the stream with `data:` an error object (`code: {WITHDRAWN_CODE}`,"
    " StreamTextWithdrawn), and a failed run with its error object, each then `[DONE]`."
    " Responses: `event:` the type and `data:` the typed event (ResponseStreamEvent),"
    " `response.output_text.delta` as the model writes, ending with `response.completed` or"
    " `response.failed`",
    "required": ["data"],
    "properties": {
        "event": {
            "enum": ["message", *RESPONSE_EVENTS],
            "description": "responses: the event's type; chat completions send none (`message`"
            " by the SSE rules)",
        },
        "data": {
            "anyOf": [
                {"const": "[DONE]", "description": "chat completions' last frame"},
                _json_text(
                    {
                        "anyOf": [
                            _schema("ChatCompletionChunk"),
                            _schema("StreamTextWithdrawn"),
                            _schema("OpenAIError"),
                            _schema("ResponseStreamEvent"),
                        ]
                    }
                ),
            ]
        },
    },
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}
OPENAI_SSE = {"text/event-stream": {"schema": OPENAI_SSE_EVENT}}
RUN_OR_PROBLEM = {
    "application/json": {"schema": _schema("Run")},
    "application/problem+json": {"schema": _schema("Problem")},
}


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": responses, **extra}


def _api(*statuses: int) -> dict[str, Any]:
    """The error answers of an authenticated `/api` operation."""
    return errors(PROBLEM, 401, 503, *statuses)


def run_paths(key: dict[str, Any]) -> dict[str, Any]:
    run_started = {
        "200": {
            "description": "the run's events until its terminal event; with Idempotency-Key,"
            " the run JSON once it completed",
            "content": {**SSE, "application/json": {"schema": _schema("Run")}},
        },
        "202": _json(
            {"anyOf": [_schema("Accepted"), _schema("Run")]},
            "queued (Prefer: respond-async; Location names the run), or with Idempotency-Key"
            " the run JSON of a run still going or waiting for a person",
        ),
        **_api(404, 413, 422, 429, 501),
        "409": {
            "description": "the same Idempotency-Key is in progress, or (buffered) the run was"
            " canceled",
            "content": RUN_OR_PROBLEM,
        },
        "429": {**_error_response(PROBLEM, 429, 0), "content": RUN_OR_PROBLEM},
        "502": _json(_schema("Run"), "(buffered) the run failed"),
        "503": {**_error_response(PROBLEM, 503, 0), "content": RUN_OR_PROBLEM},
    }
    return {
        "/api/agents/{name}/run": {
            "post": _op(
                "Submit an agent run (SSE by default; Prefer: respond-async for 202)",
                run_started,
                parameters=[NAME, PREFER, key],
                requestBody=_body(_schema("RunRequest")),
            )
        },
        "/api/runs": {
            "get": _op(
                "List runs, newest first",
                {
                    "200": _items(
                        _schema("Run"), "a page of runs", nextCursor={"type": ["string", "null"]}
                    ),
                    **_api(),
                },
                parameters=[
                    _query("status", {"enum": RUN_STATUSES}, "only runs in this status"),
                    _query("agent", {"type": "string"}, "only this agent's runs"),
                    _query(
                        "sessionId",
                        {"type": "string", "maxLength": MAX_SESSION_ID},
                        "only this session's runs",
                    ),
                    CURSOR,
                    LIMIT,
                ],
            )
        },
        "/api/runs/{id}": {
            "get": _op(
                "A run; ?include=messages adds its saved conversation",
                {"200": _json(_schema("Run"), "the run"), **_api(404)},
                parameters=[
                    RUN_ID,
                    _query(
                        "include",
                        {
                            "type": "string",
                            "pattern": "^(\\s*(messages)?\\s*)(,\\s*(messages)?\\s*)*$",
                        },
                        "messages: add the conversation as `messages` (comma-separated)",
                    ),
                ],
            )
        },
        "/api/runs/{id}/events": {
            "get": _op(
                "The run's events in order; Accept: text/event-stream follows live",
                {
                    "200": {
                        "description": "the events after Last-Event-ID (or ?after); as SSE, also"
                        " the text of a model call as it streams (LiveTextFrame)",
                        "content": {
                            "application/json": {
                                "schema": _items(_schema("Event"), "")["content"][
                                    "application/json"
                                ]["schema"]
                            },
                            **SSE,
                        },
                    },
                    **_api(404, 429),
                },
                parameters=[
                    RUN_ID,
                    _query(
                        "after",
                        EVENT_SEQ,
                        "start after this sequence number (empty: from the start; Last-Event-ID"
                        " wins)",
                    ),
                    {
                        "name": "Last-Event-ID",
                        "in": "header",
                        "description": "start after this sequence number (empty: from the"
                        " start); on an event stream also `<run id>:<seq>`, of a run that"
                        " continues this one",
                        "schema": EVENT_SEQ,
                    },
                ],
            )
        },
        "/api/runs/{id}/tool-calls": {
            "get": _op(
                "The run's tool-call ledger, in the order the calls were recorded",
                {"200": _items(_schema("ToolCall"), "the ledger rows"), **_api(404)},
                parameters=[RUN_ID],
            )
        },
        "/api/runs/{id}/tree": {
            "get": _op(
                "The run tree rooted at the run's root",
                {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["rootRunId", "runs"],
                            "properties": {
                                "rootRunId": {"type": "string"},
                                "runs": {"type": "array", "items": TREE_NODE},
                            },
                        },
                        "the root's id and every run of the tree",
                    ),
                    **_api(404),
                },
                parameters=[RUN_ID],
            )
        },
        "/api/runs/{id}/cancel": {
            "post": _op(
                "Cancel a run and its descendants, wherever they execute (409: already ended)",
                {
                    "202": _json(
                        {
                            "type": "object",
                            "required": ["runId", "status", "runs"],
                            "properties": {
                                "runId": {"type": "string"},
                                "status": {"const": "CancelRequested"},
                                "runs": {"type": "array", "items": {"type": "string"}},
                            },
                        },
                        "the request is persisted and announced; `runs` it reached",
                    ),
                    **_api(404, 409),
                },
                parameters=[RUN_ID],
            )
        },
    }


def approval_paths(key: dict[str, Any]) -> dict[str, Any]:
    return {
        "/api/approvals": {
            "get": _op(
                "List the tenant's approvals, newest first",
                {
                    "200": _items(
                        _schema("Approval"),
                        "a page of approvals",
                        nextCursor={"type": ["string", "null"]},
                    ),
                    **_api(),
                },
                parameters=[
                    _query("status", {"enum": APPROVAL_STATUSES}, "only approvals in this status"),
                    _query("runId", {"type": "string"}, "only this run's approvals"),
                    LIMIT,
                    CURSOR,
                ],
            )
        },
        "/api/approvals/{id}": {
            "get": _op(
                "An approval",
                {"200": _json(_schema("Approval"), "the approval"), **_api(404)},
                parameters=[APPROVAL_ID],
            )
        },
        "/api/approvals/{id}/decision": {
            "post": _op(
                "Approve or reject a pending approval, once (409: already decided, expired or"
                " its run canceled; accepted while the node drains)",
                {
                    "200": _json(_schema("Approval"), "the decided approval"),
                    **_api(404, 409, 413, 422, 501),
                },
                parameters=[APPROVAL_ID, key],
                requestBody=_body(_schema("Decision")),
            )
        },
    }


def workflow_paths(key: dict[str, Any], async_key: dict[str, Any]) -> dict[str, Any]:
    started = {
        "200": {"description": "the new run's events until its terminal event", "content": SSE},
        "202": _json(_schema("Accepted"), "queued (Prefer: respond-async); Location names it"),
        **_api(404, 409, 413, 422, 501),
    }
    return {
        "/api/workflows": {
            "get": _op(
                "The registered workflows",
                {
                    "200": _items(
                        {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string"},
                                "description": {"type": ["string", "null"]},
                                "version": {
                                    "type": "string",
                                    "description": "its code version here: declared, or a hash "
                                    "of its module's source",
                                },
                            },
                        },
                        "the workflows",
                    ),
                    **_api(),
                },
            )
        },
        "/api/workflows/{name}/run": {
            "post": _op(
                "Start a workflow run (SSE by default; Prefer: respond-async for 202, which a job"
                " owns and, with Workflows.ResumeInterruptedRuns, resumes after a crash)",
                {**started, **_api(404, 409, 413, 422, 429, 501)},
                parameters=[NAME, PREFER, async_key],
                requestBody=_body(_schema("WorkflowRequest")),
            )
        },
        "/api/workflows/runs/{id}/respond": {
            "post": _op(
                "Answer the question a Waiting workflow run asked; a new run continues the chain"
                " (409 when it waits for nothing)",
                {**started, **_api(429)},
                parameters=[RUN_ID, PREFER, async_key],
                requestBody=_body(_schema("Answer")),
            )
        },
        "/api/workflows/answers": {
            "post": _op(
                f"Answer the questions of up to {MAX_ANSWERS} Waiting workflow runs in one"
                " transaction; each answered as its respond route would (a new run continues"
                " its chain), one that waits for nothing (409) or is not found (404) changing"
                " nothing of the others",
                {
                    "200": _json(_schema("Answered"), "each answer's outcome, in order"),
                    **_api(409, 413, 422, 429, 501),
                },
                parameters=[key],
                requestBody=_body(_schema("Answers")),
            )
        },
        "/api/workflows/runs/{id}/events/{name}": {
            "post": _op(
                "Deliver the event `name` to the chain of a workflow run (any run of it): it"
                " answers the chain's ctx.wait_for(name), and a new run continues the chain"
                " (outcome `delivered`); with no such wait open yet, it is kept for the chain's"
                " next one (outcome `kept`, Workflows.BufferEvents); 409 when it can be"
                " neither (buffering off, or the chain ended)",
                {
                    "202": _json(EVENT_DELIVERED_SCHEMA, "delivered, or kept; Location: the run"),
                    **_api(404, 409, 413, 422, 429),
                },
                parameters=[RUN_ID, EVENT_NAME, key],
                requestBody={
                    "required": False,
                    "content": {"application/json": {"schema": _schema("EventBody")}},
                },
            )
        },
        "/api/workflows/runs/{id}/resume": {
            "post": _op(
                "Resume a Failed workflow run from its latest checkpoint (409 for a live, waiting,"
                " completed or already resumed run); a body is ignored",
                {**started, **_api(429)},
                parameters=[RUN_ID, PREFER, async_key],
            )
        },
    }


def operator_paths() -> dict[str, Any]:
    return {
        "/api/agents": {
            "get": _op(
                "The configured agents", {"200": _items(_schema("Agent"), "the agents"), **_api()}
            )
        },
        "/api/circuits": {
            "get": _op(
                "Circuit and concurrency slots per provider",
                {"200": _json(CIRCUITS_SCHEMA, "one item per configured provider"), **_api()},
            )
        },
        "/api/quota": {
            "get": _op(
                "The tenant's cost quota and what it spent in the current period",
                {"200": _json(_schema("Quota"), "period, limit, used, left, resetsAt"), **_api()},
            )
        },
        "/api/statistics/runs": {
            "get": _op(
                "Counts, tokens and cost, grouped byModel (the model that answered)",
                {"200": _json(STATISTICS_SCHEMA, "statistics of the tenant's runs"), **_api()},
                parameters=[_query("agent", {"type": "string"}, "only this agent's runs")],
            )
        },
    }


def openai_paths(key: dict[str, Any]) -> dict[str, Any]:
    run_header = {
        "X-Tracon-Run-Id": {
            "description": "the run this request made (GET /api/runs/{id})",
            "schema": {"type": "string"},
        }
    }

    def submission(summary: str, request: str) -> dict[str, Any]:
        responses = {
            "200": {
                "description": "the OpenAI object, or text/event-stream with stream: true",
                "headers": run_header,
                "content": {"application/json": {"schema": _schema("OpenAIObject")}, **OPENAI_SSE},
            },
            "202": _json(
                _schema("OpenAIObject"),
                "Prefer: respond-async, or the run is still going (Runs.BufferedWaitTimeout);"
                " Location names the run",
                headers=run_header,
            ),
            **errors(OPENAI, 401, 404, 409, 413, 422, 429, 501, 502, 503),
        }
        return _op(
            summary,
            responses,
            parameters=[PREFER, key],
            requestBody=_body(_schema(request)),
        )

    return {
        "/v1/chat/completions": {
            "post": submission("OpenAI-compatible chat completions", "ChatCompletionRequest")
        },
        "/v1/responses": {"post": submission("OpenAI-compatible responses", "ResponsesRequest")},
        "/v1/models": {
            "get": _op(
                "The agents, in OpenAI's model-list shape",
                {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {
                                "object": {"const": "list"},
                                "data": {"type": "array", "items": _schema("Model")},
                            },
                        },
                        "the agents",
                    ),
                    **errors(OPENAI, 401, 503),
                },
            )
        },
        "/v1/models/{model}": {
            "get": _op(
                "One agent as an OpenAI model",
                {
                    "200": _json(_schema("Model"), "the model"),
                    **errors(OPENAI, 401, 404, 503),
                },
                parameters=[_path("model", {"type": "string", "minLength": 1}, "an agent's name")],
            )
        },
    }


def public_paths() -> dict[str, Any]:
    def public(summary: str, responses: dict[str, Any]) -> dict[str, Any]:
        return {"get": _op(summary, {**responses, **errors(PROBLEM)}, security=[])}

    ready = {
        "type": "object",
        "required": ["status", "checks", "draining"],
        "properties": {
            "status": {"enum": ["ready", "unavailable"]},
            "checks": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "draining": {"type": "boolean"},
        },
    }
    return {
        "/healthz": public(
            "Liveness",
            {"200": _json({"type": "object", "properties": {"status": {"const": "ok"}}}, "alive")},
        ),
        "/readyz": public(
            "Readiness",
            {
                "200": _json(ready, "ready"),
                "503": _json(ready, "SQL or Redis does not answer, or the node drains"),
            },
        ),
        "/metrics": public(
            "Prometheus metrics",
            {
                "200": {
                    "description": "text format 0.0.4",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                "503": _ref("responses", "Problem503"),
            },
        ),
        "/openapi.json": public(
            "This description", {"200": _json({"type": "object"}, "OpenAPI 3.1")}
        ),
    }


# -- webhooks -------------------------------------------------------------------------

ENDPOINT_ID = _path("id", {"type": "string", "format": "uuid"}, "a webhook endpoint's id")
DELIVERY_ID = _path("deliveryId", {"type": "string", "format": "uuid"}, "a delivery's id")
EVENT_TYPE_LIST: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "uniqueItems": True,
    "items": {"enum": list(TENANT_TYPES)},
    "description": "the event types it receives (else 400 naming the entry, as `events[2]`,"
    " with the `allowed` types)",
}
WEBHOOK_ENDPOINT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "never a secret",
    "required": ["id", "url", "events", "enabled", "createdAt", "updatedAt"],
    "properties": {
        "id": {"type": "string"},
        "url": {"type": "string"},
        "events": {"type": "array", "items": {"type": "string"}},
        "description": {"type": ["string", "null"]},
        "enabled": {"type": "boolean"},
        "disabledAt": MAYBE_TIMESTAMP,
        "disabledReason": {"type": ["string", "null"]},
        "failingSince": {
            **MAYBE_TIMESTAMP,
            "description": "the first failed attempt since the last success",
        },
        "previousSecretExpiresAt": {
            **MAYBE_TIMESTAMP,
            "description": "until when the secret before the last rotation still signs",
        },
        "createdAt": TIMESTAMP,
        "updatedAt": TIMESTAMP,
    },
}
WEBHOOK_SECRET_SCHEMA: dict[str, Any] = {
    "allOf": [
        _schema("WebhookEndpoint"),
        {
            "type": "object",
            "required": ["secret"],
            "properties": {
                "secret": {
                    "type": "string",
                    "pattern": "^whsec_[A-Za-z0-9+/]+=*$",
                    "description": "the signing secret (Standard Webhooks), shown this once",
                }
            },
        },
    ]
}
WEBHOOK_ATTEMPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["at", "status", "latencyMs", "error", "response"],
    "properties": {
        "at": TIMESTAMP,
        "status": {"type": ["integer", "null"], "description": "null: no answer came"},
        "latencyMs": {"type": "integer", "minimum": 0},
        "error": {"type": ["string", "null"]},
        "response": {"type": ["string", "null"], "description": "the answer's start, cut"},
    },
}
WEBHOOK_DELIVERY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "webhookId", "type", "status", "attemptCount", "createdAt", "attempts"],
    "properties": {
        "id": {"type": "string"},
        "webhookId": {"type": "string", "description": "the webhook-id of every attempt"},
        "type": {"type": "string"},
        "status": {"enum": list(DELIVERY_STATUSES)},
        "attemptCount": {"type": "integer", "minimum": 0},
        "nextAttemptAt": {**MAYBE_TIMESTAMP, "description": "while pending"},
        "lastStatus": {"type": ["integer", "null"]},
        "lastError": {"type": ["string", "null"]},
        "createdAt": TIMESTAMP,
        "deliveredAt": MAYBE_TIMESTAMP,
        "attempts": {"type": "array", "items": _schema("WebhookAttempt")},
    },
}
URL_RULE = (
    "https (http too with Webhooks.AllowHttp), no credentials, and no literal private,"
    " loopback or link-local address unless Webhooks.AllowPrivateNetworks (else 400)"
)


def _webhook_fields(allow_http: bool) -> dict[str, Any]:
    scheme = "^https?://" if allow_http else "^https://"
    return {
        "url": {
            "type": "string",
            "maxLength": MAX_URL_LENGTH,
            "pattern": scheme,
            "description": URL_RULE,
        },
        "events": EVENT_TYPE_LIST,
        "description": {"type": ["string", "null"], "maxLength": MAX_DESCRIPTION},
    }


def webhook_requests(allow_http: bool) -> dict[str, Any]:
    """The bodies of a creation, a change and a rotation."""
    fields = _webhook_fields(allow_http)
    return {
        "WebhookEndpointRequest": {
            "type": "object",
            "description": NO_NUL,
            "required": ["url", "events"],
            "additionalProperties": False,
            "properties": fields,
        },
        "WebhookEndpointChange": {
            "type": "object",
            "description": "at least one field; " + NO_NUL,
            "minProperties": 1,
            "additionalProperties": False,
            "properties": {**fields, "enabled": {"type": "boolean"}},
        },
        "SecretRotation": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "graceSeconds": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_GRACE_SECONDS,
                    "description": "how long the previous secret still signs (default"
                    " Webhooks.RotationGrace)",
                }
            },
        },
    }


def webhook_paths(key: dict[str, Any]) -> dict[str, Any]:
    return {**_endpoint_paths(key), **_delivery_paths()}


WEBHOOK_SECRET_ANSWER = _json(
    _schema("WebhookEndpointSecret"), "the endpoint and its new secret (once)"
)


def _endpoint_paths(key: dict[str, Any]) -> dict[str, Any]:
    endpoint = _json(_schema("WebhookEndpoint"), "the endpoint")
    secret = WEBHOOK_SECRET_ANSWER
    listed = _items(_schema("WebhookEndpoint"), "a page", nextCursor={"type": ["string", "null"]})
    location = {"Location": {"required": True, "schema": {"type": "string"}}}
    return {
        "/api/webhooks": {
            "post": _op(
                "Create a webhook endpoint; its secret is in this answer only",
                {"201": {**secret, "headers": location}, **_api(413, 422, 501)},
                parameters=[key],
                requestBody=_body(_schema("WebhookEndpointRequest")),
            ),
            "get": _op(
                "List the tenant's webhook endpoints, newest first",
                {"200": listed, **_api()},
                parameters=[LIMIT, CURSOR],
            ),
        },
        "/api/webhooks/{id}": {
            "get": _op(
                "A webhook endpoint", {"200": endpoint, **_api(404)}, parameters=[ENDPOINT_ID]
            ),
            "patch": _op(
                "Change an endpoint; enabled: true on a disabled one clears its disabling",
                {"200": endpoint, **_api(404, 413)},
                parameters=[ENDPOINT_ID],
                requestBody=_body(_schema("WebhookEndpointChange")),
            ),
            "delete": _op(
                "Delete an endpoint; its pending deliveries are canceled",
                {"204": {"description": "deleted"}, **_api(404)},
                parameters=[ENDPOINT_ID],
            ),
        },
        "/api/webhooks/{id}/rotate-secret": {
            "post": _op(
                "A new secret, shown once; the previous one signs beside it until"
                " previousSecretExpiresAt",
                {"200": secret, **_api(404, 413, 422, 501)},
                parameters=[ENDPOINT_ID, key],
                requestBody={**_body(_schema("SecretRotation")), "required": False},
            )
        },
    }


def _delivery_paths() -> dict[str, Any]:
    return {
        "/api/webhooks/{id}/deliveries": {
            "get": _op(
                "The endpoint's deliveries, newest first, each with its attempts",
                {
                    "200": _items(
                        _schema("WebhookDelivery"),
                        "a page",
                        nextCursor={"type": ["string", "null"]},
                    ),
                    **_api(404),
                },
                parameters=[
                    ENDPOINT_ID,
                    _query("status", {"enum": list(DELIVERY_STATUSES)}, "only these"),
                    LIMIT,
                    CURSOR,
                ],
            )
        },
        "/api/webhooks/{id}/deliveries/{deliveryId}/redeliver": {
            "post": _op(
                "Send a delivery again, whatever its status (409: the endpoint is disabled)",
                {"202": _json(_schema("WebhookDelivery"), "pending, due now"), **_api(404, 409)},
                parameters=[ENDPOINT_ID, DELIVERY_ID],
            )
        },
    }


def webhook_schemas(allow_http: bool) -> dict[str, Any]:
    return {
        "WebhookEndpoint": WEBHOOK_ENDPOINT_SCHEMA,
        "WebhookEndpointSecret": WEBHOOK_SECRET_SCHEMA,
        "WebhookDelivery": WEBHOOK_DELIVERY_SCHEMA,
        "WebhookAttempt": WEBHOOK_ATTEMPT_SCHEMA,
        **webhook_requests(allow_http),
    }


# -- schedules ------------------------------------------------------------------------

SCHEDULE_ID = _path("id", {"type": "string", "format": "uuid"}, "a schedule's id")
SCHEDULE_TARGET: dict[str, Any] = {
    "type": "object",
    "description": "one key: a configured agent or a registered workflow (else 422)",
    "minProperties": 1,
    "maxProperties": 1,
    "additionalProperties": False,
    "properties": {
        "agent": {"type": "string", "minLength": 1},
        "workflow": {"type": "string", "minLength": 1},
    },
}
SCHEDULE_POLICIES: dict[str, Any] = {
    "overlap": {"enum": [o.value for o in Overlap], "default": "skip"},
    "catchUp": {"enum": [c.value for c in CatchUp], "default": "none"},
}
SCHEDULE_FIELDS = [
    "id",
    "name",
    "cron",
    "timezone",
    "interval",
    "target",
    "input",
    "overlap",
    "catchUp",
    "paused",
    "nextFireAt",
    "lastFireAt",
    "lastRunId",
    "createdAt",
]
SCHEDULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": SCHEDULE_FIELDS,
    "properties": {
        "id": {"type": "string"},
        "name": {"type": "string"},
        "cron": {"type": ["string", "null"]},
        "timezone": {"type": ["string", "null"], "description": "a cron schedule's zone"},
        "interval": {"type": ["number", "null"], "description": "seconds"},
        "target": {"type": "object"},
        "input": {"type": "object"},
        **SCHEDULE_POLICIES,
        "paused": {"type": "boolean"},
        "nextFireAt": {**MAYBE_TIMESTAMP, "description": "null while paused"},
        "lastFireAt": {**MAYBE_TIMESTAMP, "description": "the slot of the last run started"},
        "lastRunId": {"type": ["string", "null"]},
        "createdAt": TIMESTAMP,
    },
}
SCHEDULE_REQUEST: dict[str, Any] = {
    "type": "object",
    "description": "exactly one of cron and interval (else 400); " + NO_NUL,
    "required": ["name", "target"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": NAME_MAX},
        "cron": {"type": "string", "description": "five fields, or @daily, @hourly, ..."},
        "timezone": {"type": "string", "description": "an IANA zone, with cron (default UTC)"},
        "interval": {
            "type": ["number", "string"],
            "description": "seconds, PT30S or 00:00:30; from 1 s to 366 days",
        },
        "target": SCHEDULE_TARGET,
        "input": {"type": "object", "description": "an agent's: {message}"},
        **SCHEDULE_POLICIES,
        "paused": {"type": "boolean", "default": False},
    },
}
SCHEDULE_FIRE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["slotAt", "outcome", "runId", "firedAt", "detail"],
    "properties": {
        "slotAt": TIMESTAMP,
        "outcome": {"enum": [o.value for o in Outcome]},
        "runId": {"type": ["string", "null"]},
        "firedAt": TIMESTAMP,
        "detail": {"type": ["string", "null"]},
    },
}


def schedule_paths(key: dict[str, Any]) -> dict[str, Any]:
    schedule = _json(_schema("Schedule"), "the schedule")
    listed = _items(_schema("Schedule"), "a page", nextCursor={"type": ["string", "null"]})
    fires = _items(_schema("ScheduleFire"), "a page", nextCursor={"type": ["string", "null"]})
    location = {"Location": {"required": True, "schema": {"type": "string"}}}
    return {
        "/api/schedules": {
            "post": _op(
                "Create a schedule: an agent or workflow run at each slot of a cron expression"
                " or an interval (409: the name is taken)",
                {"201": {**schedule, "headers": location}, **_api(409, 413, 422)},
                parameters=[key],
                requestBody=_body(_schema("ScheduleRequest")),
            ),
            "get": _op(
                "List the tenant's schedules, newest first",
                {"200": listed, **_api()},
                parameters=[LIMIT, CURSOR],
            ),
        },
        "/api/schedules/{id}": {
            "get": _op("A schedule", {"200": schedule, **_api(404)}, parameters=[SCHEDULE_ID]),
            "delete": _op(
                "Delete a schedule and its fires; its runs stay",
                {"204": {"description": "deleted"}, **_api(404)},
                parameters=[SCHEDULE_ID],
            ),
        },
        "/api/schedules/{id}/pause": {
            "post": _op(
                "Pause: no slot fires until it is resumed",
                {"200": schedule, **_api(404)},
                parameters=[SCHEDULE_ID],
            )
        },
        "/api/schedules/{id}/resume": {
            "post": _op(
                "Resume from the first slot after now (the slots missed while paused never fire)",
                {"200": schedule, **_api(404)},
                parameters=[SCHEDULE_ID],
            )
        },
        "/api/schedules/{id}/fires": {
            "get": _op(
                "The slots the schedule recorded, newest first: fired, skipped, queued,"
                " missed or failed",
                {"200": fires, **_api(404)},
                parameters=[SCHEDULE_ID, LIMIT, CURSOR],
            )
        },
    }


def schedule_schemas() -> dict[str, Any]:
    return {
        "Schedule": SCHEDULE_SCHEMA,
        "ScheduleRequest": SCHEDULE_REQUEST,
        "ScheduleFire": SCHEDULE_FIRE_SCHEMA,
    }


# -- where people decide: Slack's interactions, one-time links ------------------------------

HTML_PAGE = {"text/html": {"schema": {"type": "string"}}}
LINK_TOKEN = _path(
    "token",
    {"type": "string", "pattern": "^[A-Za-z0-9_-]+$", "maxLength": 400},
    "the signed token of an approval's one-time link",
)


def _page(description: str, *, problem: bool = False) -> dict[str, Any]:
    content = dict(HTML_PAGE)
    if problem:  # the edge's own refusals (a NUL character) stay problem+json
        content["application/problem+json"] = {"schema": _schema(PROBLEM)}
    return {"description": description, "content": content}


def integration_paths() -> dict[str, Any]:
    """The routes Slack and people's browsers call, without an API key (docs/integrations.md)."""
    return {
        "/integrations/slack/interactions": {"post": _slack_interaction()},
        "/approvals/links/{token}": _link_operations(),
    }


def _form(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": schema}}}


def _slack_interaction() -> dict[str, Any]:
    stamp = {"type": "string", "pattern": "^[0-9]{1,12}$"}
    headers = [
        {"name": "X-Slack-Request-Timestamp", "in": "header", "required": True, "schema": stamp},
        {
            "name": "X-Slack-Signature",
            "in": "header",
            "required": True,
            "schema": {"type": "string"},
        },
    ]
    payload = {"type": "string", "description": "Slack's JSON payload (`block_actions`)"}
    return _op(
        "A click on an approval's Slack buttons: verified by Slack's signature (no API key),"
        " decided once; the message is updated after the answer",
        {
            "200": {"description": "received (an empty body, as Slack expects)"},
            **errors(PROBLEM, 401, 404, 413, 503),
        },
        security=[],
        parameters=headers,
        requestBody=_form(
            {"type": "object", "required": ["payload"], "properties": {"payload": payload}}
        ),
    )


def _link_operations() -> dict[str, Any]:
    failures = {
        "400": _page("the form has no valid decision (or comment)", problem=True),
        "404": _page("not a link signed here, an unknown approval, or links not configured"),
        "405": _ref("responses", "Problem405"),
        "410": _page("the link has expired, with its approval"),
        "414": _ref("responses", "Problem414"),
        "431": _ref("responses", "Problem431"),
    }
    decision = {
        "type": "object",
        "required": ["decision"],
        "properties": {
            "decision": {"enum": ["approve", "reject"]},
            "comment": {"type": "string", "maxLength": MAX_COMMENT},
        },
    }
    shown = _page("the approval, with its form while it is pending")
    decided = {"200": _page("decided"), "409": _page("already decided, or expired")}
    return {
        "get": _op(
            "The page of a one-time approval link: what it decides and a form; never a"
            " decision (link scanners open links)",
            {"200": shown, **failures},
            security=[],
            parameters=[LINK_TOKEN],
        ),
        "post": _op(
            "Decide through a one-time link, once",
            {**decided, "413": _ref("responses", "Problem413"), **failures},
            security=[],
            parameters=[LINK_TOKEN],
            requestBody=_form(decision),
        ),
    }


def document(settings: Settings) -> dict[str, Any]:
    key = idempotency_key(settings.idempotency.max_key_length)
    async_key = idempotency_key(settings.idempotency.max_key_length, needs_async=True)
    return {
        "openapi": "3.1.0",
        "info": {"title": "tracon-jobs", "version": tracon_jobs.__version__},
        "security": [{"bearer": []}],
        "paths": {
            **run_paths(key),
            **approval_paths(key),
            **workflow_paths(key, async_key),
            **operator_paths(),
            **webhook_paths(key),
            **schedule_paths(key),
            **openai_paths(key),
            **public_paths(),
            **integration_paths(),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Run": RUN_SCHEMA,
                "Event": EVENT_SCHEMA,
                "EventFrame": EVENT_FRAME,
                "LiveTextFrame": LIVE_TEXT_FRAME,
                "ModelTextDelta": MODEL_TEXT_DELTA,
                "ModelTextReset": MODEL_TEXT_RESET,
                "Accepted": ACCEPTED_SCHEMA,
                "Approval": APPROVAL_SCHEMA,
                "Decision": DECISION_SCHEMA,
                "ToolCall": TOOL_CALL_SCHEMA,
                "Agent": AGENT_SCHEMA,
                "Quota": QUOTA_SCHEMA,
                "RunRequest": RUN_REQUEST,
                "WorkflowRequest": WORKFLOW_REQUEST,
                "Answer": ANSWER_SCHEMA,
                "Answers": ANSWERS_SCHEMA,
                "Answered": ANSWERED_SCHEMA,
                "EventBody": EVENT_BODY_SCHEMA,
                "ChatCompletionRequest": CHAT_REQUEST,
                "ResponsesRequest": RESPONSES_REQUEST,
                "OpenAIObject": OPENAI_OBJECT,
                "Model": MODEL_SCHEMA,
                "ChatCompletionChunk": CHAT_CHUNK,
                "StreamTextWithdrawn": STREAM_TEXT_WITHDRAWN,
                "ResponseStreamEvent": RESPONSE_STREAM_EVENT,
                "Problem": PROBLEM_SCHEMA,
                "OpenAIError": OPENAI_ERROR_SCHEMA,
                **webhook_schemas(settings.webhooks.allow_http),
                **schedule_schemas(),
            },
            "responses": error_responses(settings.web.max_request_bytes),
        },
    }


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(document(runtime().settings))
