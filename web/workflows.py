"""The workflow surface: start a workflow run, answer the question it waits on, resume it.

Each answers like `POST /api/agents/{name}/run`: the run's events as SSE by default, or
`202` with `Location` under `Prefer: respond-async`. `Idempotency-Key` is accepted only
together with `Prefer: respond-async` (the reliability guide's idempotency table: their
synchronous answer is a stream; a key without the preference is `400` and nothing runs).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel, ConfigDict, Field

from tracon_jobs.coordination.fair_share import DEFAULT_PRIORITY, PRIORITIES
from tracon_jobs.coordination.streams import StreamPlace
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.workflows.store import RequestConflict, ResumeConflict
from web.auth import require_tenant, tenant_id
from web.extensions import runtime
from web.idempotency import idempotent, remember_run
from web.preferences import prefers_async
from web.problems import Problem, bad_request, not_found
from web.quota import refuse_when_spent
from web.runs import owned_run, parse_body, submit
from web.sse import EventFrames
from web.streams import live_stream, place_for_stream

bp = Blueprint("workflows", __name__, url_prefix="/api")
require_tenant(bp)
refuse_when_spent(bp, {"workflows.run_workflow"})


class WorkflowRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    input: dict[str, Any] = Field(default_factory=dict)
    session_id: str | None = Field(default=None, alias="sessionId", max_length=200)
    priority: int = Field(default=DEFAULT_PRIORITY, ge=min(PRIORITIES), le=max(PRIORITIES))


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answer: Any = Field(...)


MAX_ANSWERS = 100
"""The most answers one `POST /api/workflows/answers` carries."""


class AnswerOf(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    run_id: UUID = Field(alias="runId")
    answer: Any = Field(...)


class Answers(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answers: list[AnswerOf] = Field(min_length=1, max_length=MAX_ANSWERS)


class EventBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    payload: Any = None


EVENT_NAME_MAX = 200


@bp.get("/workflows")
def list_workflows() -> Response:
    registry = runtime().workflow_registry
    items = []
    for name in registry.names():
        spec = registry.get(name)
        assert spec is not None
        items.append({"name": name, "description": spec.description, "version": spec.version})
    return jsonify({"items": items})


@bp.post("/workflows/<name>/run")
@idempotent(require_async=True)
def run_workflow(name: str) -> Response | tuple[Response, int, dict[str, str]]:
    rt = runtime()
    if not rt.workflow_registry.knows(name):
        raise not_found(f"no workflow named '{name}'")
    body: WorkflowRequest = parse_body(WorkflowRequest)
    with place_for_stream(not prefers_async()) as place:
        run = submit(
            NewRun(
                tenant_id=tenant_id(),
                agent=name,
                kind="workflow",
                input=body.input,
                session_id=body.session_id,
                currency=rt.settings.pricing.currency,
                resumable=prefers_async(),  # a job owns it: bound to no connection
                priority=body.priority,
                workflow_version=rt.workflow_registry.version_of(name),
            )
        )
    return started(run, place)


@bp.post("/workflows/runs/<run_id>/respond")
@idempotent(require_async=True)
def respond(run_id: str) -> Response | tuple[Response, int, dict[str, str]]:
    run = owned_workflow_run(run_id)
    body: Answer = parse_body(Answer)
    with place_for_stream(not prefers_async()) as place:
        try:
            continuation = runtime().workflow_resumes.respond(
                run, body.answer, resumable=prefers_async()
            )
        except RequestConflict as conflict:
            raise Problem(409, "Conflict", str(conflict), runStatus=run.status) from None
    return started(continuation, place)


@bp.post("/workflows/answers")
@idempotent()
def respond_many() -> tuple[Response, int]:
    """The answers to the questions of several waiting runs, written in one transaction
    (`WorkflowResumes.respond_many`); `200` with each one's outcome, in order: `202` and the
    run that continues its chain, `404` (not a workflow run of the tenant), or `409` (it waits
    for no answer). The continuations are bound to no connection, as under `respond-async`;
    answering twice answers once (the second is a `409`)."""
    body: Answers = parse_body(Answers)
    rt = runtime()
    runs = rt.runs.get_many([str(item.run_id) for item in body.answers], tenant_id())
    items: list[dict[str, Any]] = []
    found: list[tuple[int, Run, Any]] = []
    for item in body.answers:
        run = runs.get(str(item.run_id))
        if run is None or run.kind != "workflow":
            items.append(
                {
                    "runId": str(item.run_id),
                    "status": 404,
                    "detail": f"no workflow run '{item.run_id}'",
                }
            )
        else:
            items.append({"runId": run.id})
            found.append((len(items) - 1, run, item.answer))
    outcomes = rt.workflow_resumes.respond_many(
        [(run, answer) for _, run, answer in found], resumable=True
    )
    for (index, run, _), outcome in zip(found, outcomes, strict=True):
        if isinstance(outcome, RequestConflict):
            items[index] |= {"status": 409, "detail": str(outcome), "runStatus": run.status}
        else:
            items[index] |= {"status": 202, "continuationRunId": outcome.id}
    return jsonify({"items": items}), 200


@bp.post("/workflows/runs/<run_id>/events/<name>")
@idempotent()
def deliver_event(run_id: str, name: str) -> tuple[Response, int, dict[str, str]]:
    """The event `name` for the chain of `run_id` (any run of it): `202` with the run that
    continues the chain (`delivered`), or, when no wait for it is open yet, the run it is
    kept for (`kept`, with `Workflows.BufferEvents`); `409` when it can be neither."""
    if len(name) > EVENT_NAME_MAX:
        raise bad_request(f"name: at most {EVENT_NAME_MAX} characters", field="name")
    run = owned_workflow_run(run_id)
    body: EventBody = parse_body(EventBody) if request.get_data(cache=True) else EventBody()
    try:
        delivered = runtime().workflow_resumes.deliver(run, name, body.payload)
    except RequestConflict as conflict:
        raise Problem(409, "Conflict", str(conflict), runStatus=run.status) from None
    answer = {
        "runId": delivered.run.id,
        "status": delivered.run.status,
        "event": name,
        "outcome": "kept" if delivered.kept else "delivered",
    }
    remember_run(delivered.run.id)
    return jsonify(answer), 202, {"Location": f"/api/runs/{delivered.run.id}"}


@bp.post("/workflows/runs/<run_id>/resume")
@idempotent(require_async=True)
def resume(run_id: str) -> Response | tuple[Response, int, dict[str, str]]:
    run = owned_workflow_run(run_id)
    with place_for_stream(not prefers_async()) as place:
        try:
            continuation = runtime().workflow_resumes.resume(run, resumable=prefers_async())
        except ResumeConflict as conflict:
            raise Problem(409, "Conflict", str(conflict), runStatus=run.status) from None
    return started(continuation, place)


def owned_workflow_run(run_id: str) -> Run:
    run = owned_run(run_id)
    if run.kind != "workflow":
        raise not_found(f"no workflow run '{run_id}'")
    return run


def started(run: Run, place: StreamPlace | None) -> Response | tuple[Response, int, dict[str, str]]:
    """`202` + `Location` under `Prefer: respond-async`, else the run's events as SSE."""
    remember_run(run.id)
    location = f"/api/runs/{run.id}"
    if prefers_async():
        headers = {"Location": location, "Preference-Applied": "respond-async"}
        return jsonify({"runId": run.id, "status": run.status}), 202, headers
    return live_stream(EventFrames(run.id), 0, place, Location=location)
