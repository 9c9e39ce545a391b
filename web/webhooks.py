"""The webhook surface: a tenant's endpoints (create, list, read, change, remove, rotate the
secret) and each endpoint's deliveries with their attempts (list, send one again).

A secret is in two answers only: the creation's and the rotation's. Both take
`Idempotency-Key`, so that a client that lost the answer and retries gets the same secret
instead of a second endpoint, or a second rotation that would drop the secret it still uses.
None of these routes starts a run: they are served while the node drains.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from flask import Blueprint, Response, jsonify, request

from tracon_jobs.webhooks.addresses import Destinations
from tracon_jobs.webhooks.endpoints import (
    DELIVERY_STATUSES,
    DeliveryNotFound,
    EndpointChanges,
    EndpointDisabled,
    EndpointNotFound,
    EndpointStore,
    InvalidEndpoint,
    checked,
    delivery_json,
    endpoint_json,
    with_secret,
)
from web import inputs
from web.auth import require_tenant, tenant_id
from web.extensions import runtime
from web.idempotency import idempotent
from web.problems import Problem, bad_request, not_found
from web.runs import decode_cursor, keyset_page, page_size

bp = Blueprint("webhooks", __name__, url_prefix="/api")
require_tenant(bp)

MAX_GRACE_SECONDS = 7 * 24 * 3600
"""The longest grace a rotation may ask for (`graceSeconds`): a week."""


def endpoint_store() -> EndpointStore:
    """The store, with this process's Redis for the notices to the other processes."""
    rt = runtime()
    return EndpointStore(rt.db, rt.redis)


def destinations() -> Destinations:
    """The installation's policy for endpoint URLs (`Webhooks.AllowHttp`, ...)."""
    config = runtime().settings.webhooks
    return Destinations(config.allow_http, config.allow_private_networks)


def checked_body(creating: bool) -> EndpointChanges:
    """The body's fields held to the endpoint rules; 400 naming the field and the rule."""
    body = inputs.json_body()
    if body is None:
        raise bad_request("the request body must be a JSON object", field="body")
    try:
        return checked(body, destinations(), creating=creating)
    except InvalidEndpoint as invalid:
        raise refused(invalid) from None


def refused(invalid: InvalidEndpoint) -> Problem:
    extra: dict[str, Any] = {"allowed": invalid.allowed} if invalid.allowed else {}
    return bad_request(str(invalid), field=invalid.field, **extra)


def missing(endpoint_id: str) -> Problem:
    return not_found(f"no webhook endpoint '{endpoint_id}'")


@bp.post("/webhooks")
@idempotent()
def create_endpoint() -> tuple[Response, int, dict[str, str]]:
    changes = checked_body(creating=True)
    endpoint, secret = endpoint_store().create(
        tenant_id(), changes["url"], changes["events"], changes.get("description")
    )
    location = {"Location": f"/api/webhooks/{endpoint.id}"}
    return jsonify(with_secret(endpoint, secret)), 201, location


@bp.get("/webhooks")
def list_endpoints() -> Response:
    limit = page_size(request.args.get("limit"))
    before = decode_cursor(request.args.get("cursor"))
    rows = endpoint_store().page(tenant_id(), limit + 1, before)
    page, cursor = keyset_page(rows, limit, lambda e: (e.created_at, e.id))
    return jsonify({"items": [endpoint_json(e) for e in page], "nextCursor": cursor})


@bp.get("/webhooks/<endpoint_id>")
def get_endpoint(endpoint_id: str) -> Response:
    endpoint = endpoint_store().get(tenant_id(), endpoint_id)
    if endpoint is None:
        raise missing(endpoint_id)
    return jsonify(endpoint_json(endpoint))


@bp.patch("/webhooks/<endpoint_id>")
def update_endpoint(endpoint_id: str) -> Response:
    changes = checked_body(creating=False)
    try:
        endpoint = endpoint_store().update(tenant_id(), endpoint_id, changes)
    except EndpointNotFound:
        raise missing(endpoint_id) from None
    return jsonify(endpoint_json(endpoint))


@bp.delete("/webhooks/<endpoint_id>")
def delete_endpoint(endpoint_id: str) -> tuple[str, int]:
    try:
        endpoint_store().delete(tenant_id(), endpoint_id)
    except EndpointNotFound:
        raise missing(endpoint_id) from None
    return "", 204


@bp.post("/webhooks/<endpoint_id>/rotate-secret")
@idempotent()
def rotate_secret(endpoint_id: str) -> Response:
    grace = rotation_grace()
    try:
        endpoint, secret = endpoint_store().rotate_secret(tenant_id(), endpoint_id, grace)
    except EndpointNotFound:
        raise missing(endpoint_id) from None
    return jsonify(with_secret(endpoint, secret))


def rotation_grace() -> timedelta:
    """`graceSeconds` of an optional body, else `Webhooks.RotationGrace` (a JSON integer may
    be written `60.0`, as JSON Schema counts it)."""
    body = inputs.json_body()
    if body is None:
        return runtime().settings.webhooks.rotation_grace
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", field="body")
    unknown = sorted(set(body) - {"graceSeconds"})
    if unknown:
        raise bad_request(
            f"{unknown[0]}: is not a field here; the field is graceSeconds", field=unknown[0]
        )
    if "graceSeconds" not in body:
        return runtime().settings.webhooks.rotation_grace
    try:
        return checked_grace(body["graceSeconds"])
    except InvalidEndpoint as invalid:
        raise refused(invalid) from None


def checked_grace(seconds: Any) -> timedelta:
    """`graceSeconds` held to its rule (the API's body and the console's rotate form take it
    from here): a whole number of seconds from 0 to `MAX_GRACE_SECONDS`; InvalidEndpoint."""
    whole = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    if not whole or seconds != int(seconds) or not 0 <= seconds <= MAX_GRACE_SECONDS:
        raise InvalidEndpoint("graceSeconds", f"must be an integer from 0 to {MAX_GRACE_SECONDS}")
    return timedelta(seconds=int(seconds))


@bp.get("/webhooks/<endpoint_id>/deliveries")
def list_deliveries(endpoint_id: str) -> Response:
    status = request.args.get("status")
    if status is not None and status not in DELIVERY_STATUSES:
        raise bad_request(f"status: must be one of {', '.join(DELIVERY_STATUSES)}", field="status")
    limit = page_size(request.args.get("limit"))
    before = decode_cursor(request.args.get("cursor"))
    try:
        rows = endpoint_store().deliveries(tenant_id(), endpoint_id, limit + 1, before, status)
    except EndpointNotFound:
        raise missing(endpoint_id) from None
    page, cursor = keyset_page(rows, limit, lambda d: (d.row.created_at, d.row.id))
    return jsonify({"items": [delivery_json(d) for d in page], "nextCursor": cursor})


@bp.post("/webhooks/<endpoint_id>/deliveries/<delivery_id>/redeliver")
def redeliver(endpoint_id: str, delivery_id: str) -> tuple[Response, int]:
    try:
        delivery = endpoint_store().redeliver(tenant_id(), endpoint_id, delivery_id)
    except EndpointNotFound:
        raise missing(endpoint_id) from None
    except DeliveryNotFound:
        raise not_found(
            f"no delivery '{delivery_id}' of webhook endpoint '{endpoint_id}'"
        ) from None
    except EndpointDisabled:
        raise Problem(
            409,
            "Conflict",
            f"webhook endpoint '{endpoint_id}' is disabled; enable it (PATCH enabled: true) "
            "before sending it a delivery again",
            code="endpoint_disabled",
        ) from None
    return jsonify(delivery_json(delivery)), 202
