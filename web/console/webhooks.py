"""The console's webhooks pages: the signed-in tenant's endpoints, a new one (its secret shown
once, on the answer to the form, never in a cookie or a redirect), and one endpoint with its
recent deliveries and their attempts: edit it (URL, event types, description), disable or
enable it, rotate its secret (with the grace asked for, or `Webhooks.RotationGrace`), delete
it, send a delivery again.

The forms go through the same store and the same rules as `POST /api/webhooks`,
`PATCH /api/webhooks/{id}` and `POST /api/webhooks/{id}/rotate-secret`; an endpoint of another
tenant is a 404, exactly as in the API.
"""

from __future__ import annotations

from contextlib import suppress
from datetime import timedelta
from typing import Any

from flask import flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import NotFound

from tracon_jobs.webhooks.endpoints import (
    DeliveryNotFound,
    Endpoint,
    EndpointDisabled,
    EndpointNotFound,
    InvalidEndpoint,
    checked,
)
from tracon_jobs.webhooks.events import TENANT_EVENTS
from web.console.blueprint import bp
from web.console.session import current_tenant
from web.extensions import runtime
from web.webhooks import checked_grace, destinations, endpoint_store

DELIVERIES_SHOWN = 50
"""The most recent deliveries the endpoint's page lists."""
ENDPOINTS_SHOWN = 200
"""The endpoints the list shows (a tenant has a handful)."""


@bp.get("/webhooks")
def webhooks() -> str:
    return _list_page()


def _list_page(form: dict[str, Any] | None = None, error: str | None = None) -> str:
    endpoints = endpoint_store().page(current_tenant(), ENDPOINTS_SHOWN)
    return render_template(
        "console/webhooks.html",
        endpoints=endpoints,
        event_types=TENANT_EVENTS,
        form=form or {"url": "", "events": [], "description": ""},
        error=error,
    )


@bp.post("/webhooks")
def create_webhook() -> ResponseReturnValue:
    """Create, then show the endpoint's page with its secret: this answer is its only view."""
    form = _endpoint_form()
    try:
        changes = checked(form, destinations(), creating=True)
    except InvalidEndpoint as invalid:
        return _list_page(form, _worded(invalid)), 400
    endpoint, secret = endpoint_store().create(
        current_tenant(), changes["url"], changes["events"], changes.get("description")
    )
    return _endpoint_page(endpoint, secret=secret, note="Endpoint created.")


def _endpoint_form() -> dict[str, Any]:
    """The fields of the new-endpoint and edit forms, as typed (an empty description: none)."""
    return {
        "url": (request.form.get("url") or "").strip(),
        "events": request.form.getlist("events"),
        "description": (request.form.get("description") or "").strip() or None,
    }


FIELD_NAMES = {
    "url": "The URL",
    "events": "Events",
    "description": "The description",
    "graceSeconds": "The grace",
}
"""The API's field names as the forms name them."""


def _worded(invalid: InvalidEndpoint) -> str:
    """The rule broken, named as the form names its fields."""
    name = invalid.field.split("[", 1)[0]
    return f"{FIELD_NAMES.get(name, 'The form')} {invalid.rule}."


@bp.get("/webhooks/<endpoint_id>")
def webhook_page(endpoint_id: str) -> str:
    return _endpoint_page(_owned(endpoint_id))


def _owned(endpoint_id: str) -> Endpoint:
    endpoint = endpoint_store().get(current_tenant(), endpoint_id)
    if endpoint is None:
        raise NotFound(f"There is no webhook endpoint {endpoint_id} in this tenant.")
    return endpoint


def _endpoint_page(
    endpoint: Endpoint,
    *,
    secret: str | None = None,
    note: str | None = None,
    form: dict[str, Any] | None = None,
    error: str | None = None,
    grace: str = "",
    grace_error: str | None = None,
) -> str:
    """The endpoint's page; `form` and `error` are an edit to show again as typed with the
    rule it broke, `grace` and `grace_error` a rotation's."""
    deliveries = endpoint_store().deliveries(current_tenant(), endpoint.id, DELIVERIES_SHOWN)
    default_grace = runtime().settings.webhooks.rotation_grace
    return render_template(
        "console/webhook.html",
        endpoint=endpoint,
        deliveries=deliveries,
        secret=secret,
        note=note,
        now=runtime().db.now(),
        event_types=TENANT_EVENTS,
        form=form
        or {
            "url": endpoint.url,
            "events": list(endpoint.events or []),
            "description": endpoint.description,
        },
        error=error,
        grace=grace,
        grace_error=grace_error,
        default_grace=int(default_grace.total_seconds()),
    )


@bp.post("/webhooks/<endpoint_id>/edit")
def edit_webhook(endpoint_id: str) -> ResponseReturnValue:
    """Change the URL, the event types and the description, as `PATCH /api/webhooks/{id}`
    does; a form that breaks a rule is shown again as typed, naming the rule."""
    endpoint = _owned(endpoint_id)
    form = _endpoint_form()
    try:
        changes = checked(form, destinations(), creating=False)
    except InvalidEndpoint as invalid:
        return _endpoint_page(endpoint, form=form, error=_worded(invalid)), 400
    try:
        endpoint_store().update(current_tenant(), endpoint_id, changes)
    except EndpointNotFound:
        raise NotFound(f"There is no webhook endpoint {endpoint_id} in this tenant.") from None
    flash("Endpoint saved.", "ok")
    return redirect(url_for("console.webhook_page", endpoint_id=endpoint_id))


@bp.post("/webhooks/<endpoint_id>/enabled")
def set_enabled(endpoint_id: str) -> ResponseReturnValue:
    enabled = request.form.get("enabled") == "true"
    try:
        endpoint_store().update(current_tenant(), endpoint_id, {"enabled": enabled})
    except EndpointNotFound:
        raise NotFound(f"There is no webhook endpoint {endpoint_id} in this tenant.") from None
    flash("Endpoint enabled." if enabled else "Endpoint disabled.", "ok")
    return redirect(url_for("console.webhook_page", endpoint_id=endpoint_id))


@bp.post("/webhooks/<endpoint_id>/rotate")
def rotate(endpoint_id: str) -> ResponseReturnValue:
    """Rotate, then show the new secret on this answer (never in a cookie or a redirect). The
    grace is the form's seconds, held to `graceSeconds`'s rule, or `Webhooks.RotationGrace`
    when left empty."""
    endpoint = _owned(endpoint_id)
    typed = (request.form.get("grace") or "").strip()
    try:
        grace = _grace(typed)
    except InvalidEndpoint as invalid:
        return _endpoint_page(endpoint, grace=typed, grace_error=_worded(invalid)), 400
    try:
        endpoint, secret = endpoint_store().rotate_secret(current_tenant(), endpoint_id, grace)
    except EndpointNotFound:
        raise NotFound(f"There is no webhook endpoint {endpoint_id} in this tenant.") from None
    return _endpoint_page(endpoint, secret=secret, note="Secret rotated.")


def _grace(typed: str) -> timedelta:
    """The rotate form's grace: none typed, `Webhooks.RotationGrace`; else the number typed
    (text that is not a whole number is handed on as it is, and refused by the rule)."""
    if not typed:
        return runtime().settings.webhooks.rotation_grace
    seconds: Any = typed
    with suppress(ValueError):
        seconds = int(typed)
    return checked_grace(seconds)


@bp.post("/webhooks/<endpoint_id>/delete")
def delete(endpoint_id: str) -> ResponseReturnValue:
    try:
        canceled = endpoint_store().delete(current_tenant(), endpoint_id)
    except EndpointNotFound:
        raise NotFound(f"There is no webhook endpoint {endpoint_id} in this tenant.") from None
    flash(f"Endpoint deleted; {canceled} pending deliveries canceled.", "ok")
    return redirect(url_for("console.webhooks"))


@bp.post("/webhooks/<endpoint_id>/deliveries/<delivery_id>/redeliver")
def redeliver(endpoint_id: str, delivery_id: str) -> ResponseReturnValue:
    back = redirect(url_for("console.webhook_page", endpoint_id=endpoint_id))
    try:
        endpoint_store().redeliver(current_tenant(), endpoint_id, delivery_id)
    except (EndpointNotFound, DeliveryNotFound):
        raise NotFound(f"There is no such delivery of endpoint {endpoint_id}.") from None
    except EndpointDisabled:
        flash("Not sent again: the endpoint is disabled. Enable it first.", "error")
        return back
    flash("Delivery pending again, due now.", "ok")
    return back
