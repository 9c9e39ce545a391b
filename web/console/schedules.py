"""The console's schedules pages: the signed-in tenant's schedules (cadence, target, policies,
paused or active, next and last fire with its run), a new one, and one schedule with its
recent fires; pause, resume and delete, from the list or from the schedule's page.

The new-schedule form is turned into the body `POST /api/schedules` takes and held to the same
rules (`schedules.definition.checked`); a form that breaks one is shown again as typed, naming
the rule. A schedule of another tenant is a 404, exactly as in the API.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from flask import flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import NotFound

from tracon_jobs.db.models import Schedule
from tracon_jobs.schedules.definition import TARGET_KINDS, InvalidSchedule, UnknownTarget, checked
from tracon_jobs.schedules.policies import CatchUp, Outcome, Overlap
from tracon_jobs.schedules.store import ScheduleExists, ScheduleNotFound, ScheduleStore
from web.console import forms
from web.console.blueprint import bp
from web.console.session import current_tenant
from web.extensions import runtime
from web.runs import keyset_page

SCHEDULES_SHOWN = 100
"""The schedules a page of the list shows (**More schedules →** for the next)."""
FIRES_SHOWN = 50
"""The most recent fires the schedule's page lists."""

FIELD_LABELS = {
    "name": "Name",
    "cron": "Cron",
    "timezone": "Time zone",
    "interval": "Interval",
    "target": "Target",
    "target.agent": "Agent",
    "target.workflow": "Workflow",
    "input": "Input",
    "overlap": "Overlap",
    "catchUp": "Catch-up",
    "paused": "Paused",
}
"""The API's field names as the form names them."""

OUTCOME_BADGES = {
    Outcome.FIRED.value: "status-completed",
    Outcome.QUEUED.value: "status-pending",
    Outcome.SKIPPED.value: "status-canceled",
    Outcome.MISSED.value: "status-expired",
    Outcome.FAILED.value: "status-failed",
}


def store() -> ScheduleStore:
    return runtime().schedules


@bp.get("/schedules")
def schedules() -> str:
    return _list_page()


def _list_page(
    form: dict[str, Any] | None = None, error: str | None = None, invalid: str | None = None
) -> str:
    """The list and the new-schedule form; `form`, `error` and `invalid` (the field's name)
    are a form to show again as typed with the rule it broke."""
    before = forms.schedules_cursor()
    rows = store().page(current_tenant(), SCHEDULES_SHOWN + 1, before)
    page, more = keyset_page(rows, SCHEDULES_SHOWN, lambda s: (s.created_at, s.id))
    return render_template(
        "console/schedules.html",
        schedules=page,
        more=more,
        first_page=before is None,
        form=form or EMPTY_FORM,
        error=error,
        invalid=invalid,
        target_kinds=TARGET_KINDS,
        agents=sorted(runtime().settings.agents),
        workflows=runtime().workflow_registry.names(),
        overlaps=[o.value for o in Overlap],
        catch_ups=[c.value for c in CatchUp],
    )


EMPTY_FORM: dict[str, Any] = {
    "name": "",
    "cron": "",
    "timezone": "",
    "interval": "",
    "target_kind": "agent",
    "target_name": "",
    "input": "",
    "overlap": Overlap.SKIP.value,
    "catch_up": CatchUp.NONE.value,
    "paused": False,
}


@bp.post("/schedules")
def create_schedule() -> ResponseReturnValue:
    """Create as `POST /api/schedules` does, then show the schedule's page; a form that breaks
    a rule is shown again as typed (400; 422 for a target this installation does not have,
    409 for a name the tenant has already)."""
    form = _typed()
    answer = forms.json_form("input", None)
    if answer.error is not None:
        return _list_page(form, answer.error, "input"), 400
    try:
        spec = checked(_body(form, answer.value), runtime().schedule_targets)
    except InvalidSchedule as broken:
        status = 422 if isinstance(broken, UnknownTarget) else 400
        return _list_page(form, _worded(broken), broken.field.split(".")[0]), status
    try:
        schedule = store().create(current_tenant(), spec)
    except ScheduleExists as exists:
        return _list_page(form, f"Name: {exists}.", "name"), 409
    flash("Schedule created.", "ok")
    return redirect(url_for("console.schedule_page", schedule_id=schedule.id))


def _typed() -> dict[str, Any]:
    """The new-schedule form as typed, to show again."""
    text = {name: (request.form.get(name) or "").strip() for name in EMPTY_FORM}
    return {**text, "paused": request.form.get("paused") == "true"}


def _body(form: dict[str, Any], input_value: Any) -> dict[str, Any]:
    """The form as the body of `POST /api/schedules`: an empty field is one not given (a
    cron expression or an interval; the time zone then is UTC; the input `{}`)."""
    body: dict[str, Any] = {
        "name": form["name"],
        "target": {form["target_kind"]: form["target_name"]},
        "paused": form["paused"],
    }
    for name, field in (
        ("cron", "cron"),
        ("timezone", "timezone"),
        ("interval", "interval"),
        ("overlap", "overlap"),
        ("catch_up", "catchUp"),
    ):
        if form[name]:
            body[field] = form[name]
    if input_value is not None:
        body["input"] = input_value
    return body


def _worded(invalid: InvalidSchedule) -> str:
    """The rule broken, named as the form names its fields (`input.message`: Input message)."""
    label = FIELD_LABELS.get(invalid.field)
    if label is None:
        top, _, rest = invalid.field.partition(".")
        label = f"{FIELD_LABELS.get(top, 'The form')} {rest}".strip()
    return f"{label}: {invalid.rule}."


@bp.get("/schedules/<schedule_id>")
def schedule_page(schedule_id: str) -> str:
    schedule = _owned(schedule_id)
    fires = store().fires(current_tenant(), schedule.id, FIRES_SHOWN)
    return render_template(
        "console/schedule.html",
        schedule=schedule,
        fires=fires,
        outcome_badges=OUTCOME_BADGES,
        fires_shown=FIRES_SHOWN,
    )


def _owned(schedule_id: str) -> Schedule:
    try:
        return store().get(current_tenant(), schedule_id)
    except ScheduleNotFound:
        raise _missing(schedule_id) from None


def _missing(schedule_id: str) -> NotFound:
    return NotFound(f"There is no schedule {schedule_id} in this tenant.")


@bp.post("/schedules/<schedule_id>/pause")
def pause_schedule(schedule_id: str) -> ResponseReturnValue:
    try:
        store().pause(current_tenant(), schedule_id)
    except ScheduleNotFound:
        raise _missing(schedule_id) from None
    flash("Schedule paused: no slot fires until it is resumed.", "ok")
    return _back(schedule_id)


@bp.post("/schedules/<schedule_id>/resume")
def resume_schedule(schedule_id: str) -> ResponseReturnValue:
    try:
        store().resume(current_tenant(), schedule_id)
    except ScheduleNotFound:
        raise _missing(schedule_id) from None
    flash("Schedule resumed: it fires from the first slot after now.", "ok")
    return _back(schedule_id)


@bp.post("/schedules/<schedule_id>/delete")
def delete_schedule(schedule_id: str) -> ResponseReturnValue:
    try:
        store().delete(current_tenant(), schedule_id)
    except ScheduleNotFound:
        raise _missing(schedule_id) from None
    flash("Schedule deleted with its fires; its runs stay.", "ok")
    return redirect(url_for("console.schedules"))


def _back(schedule_id: str) -> ResponseReturnValue:
    """To the list when the button was in it, else to the schedule's page."""
    if request.form.get("back") == "list":
        return redirect(url_for("console.schedules"))
    return redirect(url_for("console.schedule_page", schedule_id=schedule_id))


@bp.app_template_filter("cadence")
def cadence(schedule: Schedule) -> str:
    """When its slots are: `0 3 * * MON-FRI (Europe/Paris)` or `every 1 min 30 s`."""
    if schedule.cron is not None:
        return f"{schedule.cron} ({schedule.timezone})"
    return f"every {every(schedule.interval_ms or 0)}"


def every(ms: int) -> str:
    """An interval in days, hours, minutes and seconds: `1 d 2 h`, `1 min 30 s`, `1.5 s`."""
    days, rest = divmod(ms, 86_400_000)
    hours, rest = divmod(rest, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    parts = [f"{n} {unit}" for n, unit in ((days, "d"), (hours, "h"), (minutes, "min")) if n]
    if rest:
        parts.append(f"{rest / 1000:g} s")
    return " ".join(parts) or "0 s"


@bp.app_template_filter("in_zone")
def in_zone(value: datetime | None, zone: str) -> str:
    """A stored (UTC) time as the clock of `zone` reads it: `2025-03-31 03:00 CEST`."""
    if value is None:
        return "—"
    return value.replace(tzinfo=UTC).astimezone(ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M %Z")
