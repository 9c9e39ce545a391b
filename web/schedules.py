"""The schedule surface: a tenant's schedules (create, list, read, pause, resume, delete) and
the slots each one recorded (`/fires`). The runs they start are the firing pass's (beat's
`tracon.schedules.fire`); none of these routes starts a run, so they are served while the
node drains."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request

from tracon_jobs.db.models import Schedule
from tracon_jobs.schedules.definition import InvalidSchedule, ScheduleSpec, UnknownTarget, checked
from tracon_jobs.schedules.store import (
    ScheduleExists,
    ScheduleNotFound,
    ScheduleStore,
    fire_json,
    schedule_json,
)
from web import inputs
from web.auth import require_tenant, tenant_id
from web.extensions import runtime
from web.idempotency import idempotent
from web.problems import Problem, bad_request, not_found
from web.runs import decode_cursor, keyset_page, page_size

bp = Blueprint("schedules", __name__, url_prefix="/api")
require_tenant(bp)


def store() -> ScheduleStore:
    return runtime().schedules


def checked_body() -> ScheduleSpec:
    """The body held to the schedule rules: 400 naming the field and the rule, 422 for a
    target this installation does not have."""
    body = inputs.json_body()
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", field="body")
    try:
        return checked(body, runtime().schedule_targets)
    except InvalidSchedule as invalid:
        raise refused(invalid) from None


def refused(invalid: InvalidSchedule) -> Problem:
    if isinstance(invalid, UnknownTarget):
        return Problem(422, "Unprocessable Content", str(invalid), field=invalid.field)
    return bad_request(str(invalid), field=invalid.field)


def missing(schedule_id: str) -> Problem:
    return not_found(f"no schedule '{schedule_id}'")


def owned(schedule_id: str) -> Schedule:
    try:
        return store().get(tenant_id(), schedule_id)
    except ScheduleNotFound:
        raise missing(schedule_id) from None


@bp.post("/schedules")
@idempotent()
def create_schedule() -> tuple[Response, int, dict[str, str]]:
    spec = checked_body()
    try:
        schedule = store().create(tenant_id(), spec)
    except ScheduleExists as exists:
        raise Problem(409, "Conflict", f"name: {exists}", field="name") from None
    location = {"Location": f"/api/schedules/{schedule.id}"}
    return jsonify(schedule_json(schedule)), 201, location


@bp.get("/schedules")
def list_schedules() -> Response:
    limit = page_size(request.args.get("limit"))
    before = decode_cursor(request.args.get("cursor"))
    rows = store().page(tenant_id(), limit + 1, before)
    page, cursor = keyset_page(rows, limit, lambda s: (s.created_at, s.id))
    return jsonify({"items": [schedule_json(s) for s in page], "nextCursor": cursor})


@bp.get("/schedules/<schedule_id>")
def get_schedule(schedule_id: str) -> Response:
    return jsonify(schedule_json(owned(schedule_id)))


@bp.post("/schedules/<schedule_id>/pause")
def pause_schedule(schedule_id: str) -> Response:
    return jsonify(schedule_json(_changed(store().pause, schedule_id)))


@bp.post("/schedules/<schedule_id>/resume")
def resume_schedule(schedule_id: str) -> Response:
    return jsonify(schedule_json(_changed(store().resume, schedule_id)))


def _changed(change: Any, schedule_id: str) -> Schedule:
    try:
        changed: Schedule = change(tenant_id(), schedule_id)
    except ScheduleNotFound:
        raise missing(schedule_id) from None
    return changed


@bp.delete("/schedules/<schedule_id>")
def delete_schedule(schedule_id: str) -> tuple[str, int]:
    try:
        store().delete(tenant_id(), schedule_id)
    except ScheduleNotFound:
        raise missing(schedule_id) from None
    return "", 204


@bp.get("/schedules/<schedule_id>/fires")
def list_fires(schedule_id: str) -> Response:
    limit = page_size(request.args.get("limit"))
    before = decode_cursor(request.args.get("cursor"))
    try:
        rows = store().fires(tenant_id(), schedule_id, limit + 1, before and before[0])
    except ScheduleNotFound:
        raise missing(schedule_id) from None
    page, cursor = keyset_page(rows, limit, lambda f: (f.slot_at, schedule_id))
    return jsonify({"items": [fire_json(f) for f in page], "nextCursor": cursor})
