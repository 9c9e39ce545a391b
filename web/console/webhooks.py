"""The console's webhooks pages: the signed-in tenant's endpoints, a new one (its secret shown
once, on the answer to the form, never in a cookie or a redirect), and one endpoint with its
recent deliveries and their attempts: disable or enable it, rotate its secret, delete it,
send a delivery again.

The forms go through the same store and the same rules as `POST /api/webhooks`; an endpoint
of another tenant is a 404, exactly as in the API.
"""

from __future__ import annotations

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
from web.webhooks import destinations, endpoint_store

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
    form = {
        "url": (request.form.get("url") or "").strip(),
        "events": request.form.getlist("events"),
        "description": (request.form.get("description") or "").strip() or None,
    }
    try:
        changes = checked(form, destinations(), creating=True)
    except InvalidEndpoint as invalid:
        return _list_page(form, _worded(invalid)), 400
    endpoint, secret = endpoint_store().create(
        current_tenant(), changes["url"], changes["events"], changes.get("description")
    )
    return _endpoint_page(endpoint, secret=secret, note="Endpoint created.")


def _worded(invalid: InvalidEndpoint) -> str:
    """The rule broken, named as the form names its fields."""
    name = invalid.field.split("[", 1)[0]
    field = {"url": "The URL", "events": "Events", "description": "The description"}.get(
        name, "The form"
    )
    return f"{field} {invalid.rule}."


@bp.get("/webhooks/<endpoint_id>")
def webhook_page(endpoint_id: str) -> str:
    return _endpoint_page(_owned(endpoint_id))


def _owned(endpoint_id: str) -> Endpoint:
    endpoint = endpoint_store().get(current_tenant(), endpoint_id)
    if endpoint is None:
        raise NotFound(f"There is no webhook endpoint {endpoint_id} in this tenant.")
    return endpoint


def _endpoint_page(
    endpoint: Endpoint, *, secret: str | None = None, note: str | None = None
) -> str:
    deliveries = endpoint_store().deliveries(current_tenant(), endpoint.id, DELIVERIES_SHOWN)
    return render_template(
        "console/webhook.html",
        endpoint=endpoint,
        deliveries=deliveries,
        secret=secret,
        note=note,
        now=runtime().db.now(),
    )


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
    """Rotate, then show the new secret on this answer (never in a cookie or a redirect)."""
    grace = runtime().settings.webhooks.rotation_grace
    try:
        endpoint, secret = endpoint_store().rotate_secret(current_tenant(), endpoint_id, grace)
    except EndpointNotFound:
        raise NotFound(f"There is no webhook endpoint {endpoint_id} in this tenant.") from None
    return _endpoint_page(endpoint, secret=secret, note="Secret rotated.")


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
