"""The run surface: submit an agent run, read runs, their events, conversations, tool-call
ledgers and trees."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tracon_jobs.coordination.fair_share import DEFAULT_PRIORITY, PRIORITIES
from tracon_jobs.db.models import Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.ledger import Ledger
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import NewRun, RunFilter
from tracon_jobs.runs.views import run_json, tool_call_json
from web import inputs, tracing
from web.auth import require_tenant, tenant_id
from web.buffered import buffered_run_response, run_view
from web.continuing import ChainPosition, continues
from web.extensions import runtime
from web.idempotency import has_key, idempotent, remember_run
from web.preferences import prefers_async
from web.problems import Problem, bad_request, not_found
from web.quota import refuse_when_spent
from web.sse import EventFrames
from web.streams import live_stream, place_for_stream

bp = Blueprint("runs", __name__, url_prefix="/api")
require_tenant(bp)
refuse_when_spent(bp, {"runs.run_agent"})

MAX_PAGE = 200
MAX_SESSION_ID = 200
STATUSES = {"Queued", "Running", "Waiting", "Completed", "Failed", "Canceled"}
INCLUDES = {"messages"}
MAX_EVENT_SEQ = 2**31 - 1  # the largest sequence number the events table can hold
CURSOR_ID = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    message: str = Field(min_length=1)
    session_id: str | None = Field(default=None, alias="sessionId", max_length=MAX_SESSION_ID)
    parameters: dict[str, Any] | None = None
    priority: int = Field(default=DEFAULT_PRIORITY, ge=min(PRIORITIES), le=max(PRIORITIES))


PRIORITY_HEADER = "X-Tracon-Priority"


def priority_header() -> int:
    """`X-Tracon-Priority` (`/v1`, whose bodies are OpenAI's): 0-9, default 5."""
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is None:
        return DEFAULT_PRIORITY
    if not raw.strip().isdigit() or int(raw) not in PRIORITIES:
        raise bad_request(
            f"{PRIORITY_HEADER} must be a whole number from {min(PRIORITIES)} to "
            f"{max(PRIORITIES)} (got {raw!r})",
            field=PRIORITY_HEADER,
        )
    return int(raw)


def parse_body(model: type[BaseModel]) -> Any:
    """The JSON body validated by `model`; 400 naming the field and the rule otherwise."""
    body = inputs.json_body()
    if body is None:
        raise bad_request("the request body must be a JSON object", field="body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise bad_request(f"{field}: {first['msg']}", field=field) from exc


@bp.post("/agents/<name>/run")
@idempotent()
def run_agent(name: str) -> Response | tuple[Response, int, dict[str, str]]:
    rt = runtime()
    if name not in rt.settings.agents:
        raise not_found(f"no agent named '{name}'")
    body: RunRequest = parse_body(RunRequest)
    with place_for_stream(not prefers_async() and not has_key()) as place:
        run = submit(
            NewRun(
                tenant_id=tenant_id(),
                agent=name,
                input={"message": body.message},
                session_id=body.session_id,
                parameters=body.parameters,
                currency=rt.settings.pricing.currency,
                priority=body.priority,
            )
        )
    remember_run(run.id)
    location = f"/api/runs/{run.id}"
    if prefers_async():
        headers = {"Location": location, "Preference-Applied": "respond-async"}
        return jsonify({"runId": run.id, "status": run.status}), 202, headers
    if has_key():
        return buffered_run_response(run.id)
    return live_stream(EventFrames(run.id), 0, place, Location=location)


def submit(new: NewRun) -> Run:
    try:
        run = runtime().dispatcher.submit(new)
    except EnqueueError as exc:
        raise Problem(
            503,
            "Service Unavailable",
            f"the run was recorded but could not be queued: {exc}",
            headers={"Retry-After": "5"},
            runId=new.id,
        ) from exc
    tracing.submitted(run.traceparent)
    return run


@bp.get("/runs/<run_id>")
def get_run(run_id: str) -> Response:
    """The run; `?include=messages` adds the conversation saved after its last finished turn."""
    includes = included()
    run = owned_run(run_id)
    view = run_view(run)
    if "messages" in includes:
        view["messages"] = run.messages or []
    return jsonify(view)


def included() -> set[str]:
    """The `include` query values (repeated or comma-separated); 400 for an unknown one."""
    values = {
        part.strip()
        for raw in request.args.getlist("include")
        for part in raw.split(",")
        if part.strip()
    }
    unknown = values - INCLUDES
    if unknown:
        raise bad_request(f"include: must be one of {', '.join(sorted(INCLUDES))}", field="include")
    return values


@bp.get("/runs/<run_id>/tool-calls")
def run_tool_calls(run_id: str) -> Response:
    """The run's tool-call ledger, in the order the calls were recorded."""
    run = owned_run(run_id)
    calls = Ledger(runtime().runs).calls(run.id)
    return jsonify({"items": [tool_call_json(call) for call in calls]})


def owned_run(run_id: str) -> Run:
    run = runtime().runs.get(run_id, tenant_id())
    if run is None:
        raise not_found(f"no run '{run_id}'")
    return run


@bp.get("/runs")
def list_runs() -> Response:
    status = request.args.get("status")
    if status is not None and status not in STATUSES:
        raise bad_request(f"status: must be one of {', '.join(sorted(STATUSES))}", field="status")
    session_id = request.args.get("sessionId")
    if session_id is not None and len(session_id) > MAX_SESSION_ID:
        raise bad_request(
            f"sessionId: must be at most {MAX_SESSION_ID} characters", field="sessionId"
        )
    filters = RunFilter(status, request.args.get("agent"), session_id)
    limit = page_size(request.args.get("limit"))
    before = decode_cursor(request.args.get("cursor"))
    runs = runtime().runs.page(tenant_id(), filters, limit=limit + 1, before=before)
    page, cursor = keyset_page(runs, limit, lambda run: (run.created_at, run.id))
    return jsonify({"items": [run_view(run) for run in page], "nextCursor": cursor})


def page_size(raw: str | None) -> int:
    return 50 if raw is None else inputs.integer(raw, "limit", 1, MAX_PAGE)


Row = TypeVar("Row")


def keyset_page(
    rows: Sequence[Row], limit: int, key: Callable[[Row], tuple[datetime, str]]
) -> tuple[Sequence[Row], str | None]:
    """The first `limit` of `rows` (read as `limit + 1`, to tell whether more follow) and the
    cursor of the page after them, None on the last page; `key`: a row's (time, id)."""
    page = rows[:limit]
    return page, encode_cursor(*key(page[-1])) if len(rows) > limit and page else None


def encode_cursor(at: datetime, row_id: str) -> str:
    """An opaque cursor: the (time, id) of the last row of a page, newest first."""
    raw = f"{at.isoformat()}|{row_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> tuple[datetime, str] | None:
    if not cursor:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, row_id = raw.split("|", 1)
        when = datetime.fromisoformat(at)
        if when.tzinfo is not None or not CURSOR_ID.fullmatch(row_id):
            raise ValueError(raw)  # this API writes naive UTC times and plain ids
        return when, row_id
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise bad_request("cursor: not a cursor this API returned", field="cursor") from exc


@bp.get("/runs/<run_id>/events")
def run_events(run_id: str) -> Response:
    rt = runtime()
    if not rt.runs.exists(run_id, tenant_id()):  # every stream opens here: no row loaded
        raise not_found(f"no run '{run_id}'")
    if "text/event-stream" in request.headers.get("Accept", ""):
        followed, after = stream_position(run_id)
        return live_stream(EventFrames(followed, origin=run_id), after)
    after = last_event_id()
    return jsonify({"items": [event.as_json() for event in rt.runs.events(run_id, after)]})


def last_event_id(last: str | None = None) -> int:
    """`Last-Event-ID` (or `last`, its seq), else `?after=`, else 0: an event sequence
    number. Each one sent is checked (400 naming it), the one not used too; an empty one
    reads as none."""
    sent = [
        inputs.integer(raw, field, 0, MAX_EVENT_SEQ)
        for field, raw in (
            ("Last-Event-ID", last if last is not None else request.headers.get("Last-Event-ID")),
            ("after", request.args.get("after")),
        )
        if raw
    ]
    return sent[0] if sent else 0


def stream_position(run_id: str) -> tuple[str, int]:
    """(the run a resumed stream follows, the seq after which): `Last-Event-ID` names a seq
    of `run_id`, or `<run id>:<seq>` of a run that continues it (`web.continuing`)."""
    raw = request.headers.get("Last-Event-ID")
    continuation, seq = ChainPosition.parse(raw) if raw else (None, raw)
    if continuation is None:
        return run_id, last_event_id(seq)
    if not continues(runtime().runs, run_id, continuation, tenant_id()):
        raise bad_request(
            f"Last-Event-ID: '{continuation}' is not a run that continues run '{run_id}'",
            field="Last-Event-ID",
        )
    return continuation, last_event_id(seq)


@bp.get("/runs/<run_id>/tree")
def run_tree(run_id: str) -> Response:
    run = owned_run(run_id)
    runs = runtime().runs.tree(run.root_run_id, tenant_id())
    return jsonify({"rootRunId": run.root_run_id, "runs": [tree_node(r) for r in runs]})


TREE_NODE_KEYS = (
    "id",
    "agent",
    "kind",
    "status",
    "parentRunId",
    "depth",
    "continuedFromRunId",
    "modelId",
    "usage",
    "cost",
    "error",
)
"""What `GET /api/runs/{id}/tree` shows of each run of the tree."""


def tree_node(run: Run) -> dict[str, Any]:
    view = run_json(run)
    return {key: view[key] for key in TREE_NODE_KEYS}


@bp.post("/runs/<run_id>/cancel")
def cancel_run(run_id: str) -> tuple[Response, int]:
    """202 once the request is persisted and announced; 409 for a run already ended."""
    run = owned_run(run_id)
    if RunStatus(run.status).is_terminal:
        raise Problem(
            409, "Conflict", f"run '{run_id}' already ended ({run.status})", runStatus=run.status
        )
    rt = runtime()
    reached = cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, run, rt.dispatcher.done)
    return jsonify({"runId": run_id, "status": "CancelRequested", "runs": reached}), 202
