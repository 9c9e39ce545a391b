"""A tenant's webhook endpoints: created, read, changed, removed, their secrets rotated; the
deliveries made to each with their attempts, and a delivery sent again on request.

Every call takes the tenant: another tenant's endpoint, or a delivery of another tenant's
endpoint, is not found, exactly as an id that does not exist. Times come from the database
clock. A secret leaves this module only as `create` and `rotate_secret` return it (once, for
the caller to show); `endpoint_json` never holds one.

Removal: the endpoint's row goes, its `pending` deliveries become `canceled` (their claim
cleared, so an attempt in flight changes nothing when it ends) in the same transaction, and
its history (deliveries and attempts) stays in SQL: an attempt that was in flight can still
record itself (attempts reference deliveries, deliveries reference messages; no row points at
the endpoint), and the operator keeps the record. The API no longer serves it: the endpoint's
routes answer 404.

After each change the other processes are told on `CHANGED_CHANNEL` (they keep which event
types anyone wants); after a redelivery the deliverers are woken on `WAKE_CHANNEL`. Neither
notice is needed for correctness (processes poll SQL), only for promptness.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, TypedDict, cast

import redis
from sqlalchemy import Table, select, tuple_, update
from sqlalchemy.orm import Session

from tracon_jobs.db import Database
from tracon_jobs.db.engine import StatementClock
from tracon_jobs.db.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookMessage
from tracon_jobs.runs.store import iso
from tracon_jobs.webhooks import events, signing
from tracon_jobs.webhooks.addresses import Destinations, url_problem
from tracon_jobs.webhooks.events import CHANGED_CHANNEL, WAKE_CHANNEL

log = logging.getLogger(__name__)

ENDPOINTS = cast(Table, WebhookEndpoint.__table__)
DELIVERIES = cast(Table, WebhookDelivery.__table__)
_NOW = StatementClock()

Endpoint = WebhookEndpoint
"""An endpoint as the store returns it: the row, detached (its secrets are in it: never
serialize it but with `endpoint_json`)."""

PENDING: Final = "pending"
CANCELED: Final = "canceled"
DELIVERY_STATUSES: Final = ("pending", "delivered", "failed", "canceled")

DISABLED_BY_TENANT: Final = "disabled by the tenant"
"""`disabled_reason` of an endpoint its tenant disabled (the deliverer writes its own)."""


class EndpointChanges(TypedDict, total=False):
    """The fields a change names; a field left out stays as it is (`description` may be set
    to None)."""

    url: str
    events: list[str]
    description: str | None
    enabled: bool


class InvalidEndpoint(ValueError):
    """A field of an endpoint's creation or change that breaks a rule: `field` names it as the
    API does (`events[2]`), `rule` follows that name ("must be a string"), `allowed` lists the
    values the field takes where there is such a list."""

    def __init__(self, field: str, rule: str, allowed: Sequence[str] = ()) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule
        self.allowed = list(allowed)


class EndpointNotFound(LookupError):
    """No such endpoint for this tenant (unknown, or another tenant's): the caller's 404."""


class DeliveryNotFound(LookupError):
    """No such delivery of this endpoint: the caller's 404."""


class EndpointDisabled(Exception):
    """A redelivery to a disabled endpoint, which would be canceled as it is claimed: the
    caller's 409 (enable the endpoint first)."""


@dataclass(frozen=True)
class Delivery:
    """One message to one endpoint, its event type and its attempts, oldest first."""

    row: WebhookDelivery
    type: str
    attempts: Sequence[WebhookAttempt]


class EndpointStore:
    """SQL persistence of endpoints and the reads of their deliveries; `redis_client` (when
    given) carries the notices of changes and redeliveries to the other processes."""

    def __init__(self, db: Database, redis_client: redis.Redis | None = None) -> None:
        self.db = db
        self.redis = redis_client

    # -- endpoints ---------------------------------------------------------------------------

    def create(
        self, tenant_id: str, url: str, events: list[str], description: str | None = None
    ) -> tuple[Endpoint, str]:
        """A new, enabled endpoint and its secret (the only time the secret is returned)."""
        secret = signing.new_secret()
        with self.db.write() as session:
            now = _now(self.db, session)
            endpoint = WebhookEndpoint(
                id=str(uuid.uuid4()),
                tenant_id=tenant_id,
                url=url,
                events=list(events),
                description=description,
                secret=secret,
                enabled=True,
                created_at=now,
                updated_at=now,
            )
            session.add(endpoint)
        self._changed()
        return endpoint, secret

    def get(self, tenant_id: str, endpoint_id: str) -> Endpoint | None:
        with self.db.read() as session:
            return _owned(session, tenant_id, endpoint_id)

    def page(
        self, tenant_id: str, limit: int, before: tuple[datetime, str] | None = None
    ) -> list[Endpoint]:
        """Newest first; `before` is the (created_at, id) of the last row of the prior page,
        as every page of the API goes."""
        query = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
        if before is not None:  # a row comparison, so the index seeks to the cursor
            query = query.where(
                tuple_(WebhookEndpoint.created_at, WebhookEndpoint.id) < tuple_(*before)
            )
        query = query.order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc())
        with self.db.read() as session:
            return list(session.scalars(query.limit(limit)))

    def update(self, tenant_id: str, endpoint_id: str, changes: EndpointChanges) -> Endpoint:
        """Apply `changes`; EndpointNotFound. `enabled: true` on a disabled endpoint clears
        why and since when it was disabled and failing (its failure clock starts again);
        `enabled: false` records the tenant as the reason."""
        with self.db.write() as session:
            endpoint = _owned(session, tenant_id, endpoint_id, lock=True)
            if endpoint is None:
                raise EndpointNotFound(endpoint_id)
            now = _now(self.db, session)
            _apply(endpoint, changes, now)
            endpoint.updated_at = now
        self._changed()
        return endpoint

    def delete(self, tenant_id: str, endpoint_id: str) -> int:
        """Remove the endpoint and cancel its pending deliveries (how many); EndpointNotFound.
        Its history stays in SQL (see the module's docstring)."""
        with self.db.write() as session:
            endpoint = _owned(session, tenant_id, endpoint_id, lock=True)
            if endpoint is None:
                raise EndpointNotFound(endpoint_id)
            canceled = session.execute(
                update(DELIVERIES)
                .where(DELIVERIES.c.target == endpoint_id, DELIVERIES.c.status == PENDING)
                .values(status=CANCELED, claimed_by=None, claim_until=None)
                .returning(DELIVERIES.c.id)
            ).all()
            session.delete(endpoint)
        self._changed()
        return len(canceled)

    def rotate_secret(
        self, tenant_id: str, endpoint_id: str, grace: timedelta
    ) -> tuple[Endpoint, str]:
        """A new secret, returned once; the one it replaces still signs beside it for `grace`
        (none when `grace` is zero). A rotation within the grace of the last drops the oldest
        secret at once: two secrets sign at most."""
        secret = signing.new_secret()
        with self.db.write() as session:
            endpoint = _owned(session, tenant_id, endpoint_id, lock=True)
            if endpoint is None:
                raise EndpointNotFound(endpoint_id)
            now = _now(self.db, session)
            kept = grace > timedelta(0)
            endpoint.previous_secret = endpoint.secret if kept else None
            endpoint.previous_secret_until = now + grace if kept else None
            endpoint.secret = secret
            endpoint.updated_at = now
        self._changed()
        return endpoint, secret

    # -- deliveries --------------------------------------------------------------------------

    def deliveries(
        self,
        tenant_id: str,
        endpoint_id: str,
        limit: int,
        before: tuple[datetime, str] | None = None,
        status: str | None = None,
    ) -> list[Delivery]:
        """The endpoint's deliveries, newest first, each with its attempts; EndpointNotFound."""
        query = (
            select(WebhookDelivery, WebhookMessage.type)
            .join(WebhookMessage, WebhookMessage.id == WebhookDelivery.message_id)
            .where(WebhookDelivery.target == endpoint_id)
        )
        if status is not None:
            query = query.where(WebhookDelivery.status == status)
        if before is not None:
            query = query.where(
                tuple_(WebhookDelivery.created_at, WebhookDelivery.id) < tuple_(*before)
            )
        query = query.order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
        with self.db.read() as session:
            if _owned(session, tenant_id, endpoint_id) is None:
                raise EndpointNotFound(endpoint_id)
            rows = session.execute(query.limit(limit)).all()
            attempts = _attempts(session, [row[0].id for row in rows])
        return [Delivery(row, type_, attempts.get(row.id, [])) for row, type_ in rows]

    def delivery(self, tenant_id: str, endpoint_id: str, delivery_id: str) -> Delivery:
        """One delivery of the endpoint, with its attempts; EndpointNotFound, DeliveryNotFound."""
        query = (
            select(WebhookDelivery, WebhookMessage.type)
            .join(WebhookMessage, WebhookMessage.id == WebhookDelivery.message_id)
            .where(WebhookDelivery.id == delivery_id, WebhookDelivery.target == endpoint_id)
        )
        with self.db.read() as session:
            if _owned(session, tenant_id, endpoint_id) is None:
                raise EndpointNotFound(endpoint_id)
            found = session.execute(query).one_or_none()
            if found is None:
                raise DeliveryNotFound(delivery_id)
            attempts = _attempts(session, [delivery_id])
        return Delivery(found[0], found[1], attempts.get(delivery_id, []))

    def redeliver(self, tenant_id: str, endpoint_id: str, delivery_id: str) -> Delivery:
        """Send the delivery again, whatever its status: `pending`, due now, its claim cleared
        (an attempt in flight then changes nothing when it ends). Its attempts count on, so
        one past the end of the schedule gets its one attempt. The deliverers are woken.
        EndpointNotFound, DeliveryNotFound, EndpointDisabled."""
        with self.db.write() as session:
            endpoint = _owned(session, tenant_id, endpoint_id)
            if endpoint is None:
                raise EndpointNotFound(endpoint_id)
            if not endpoint.enabled:
                raise EndpointDisabled(endpoint_id)
            changed = session.execute(
                update(DELIVERIES)
                .where(DELIVERIES.c.id == delivery_id, DELIVERIES.c.target == endpoint_id)
                .values(status=PENDING, next_attempt_at=_NOW, claimed_by=None, claim_until=None)
                .returning(DELIVERIES.c.id),
                self.db.clock_params(),
            ).scalar_one_or_none()
            if changed is None:
                raise DeliveryNotFound(delivery_id)
        self._publish(WAKE_CHANNEL, "1")
        return self.delivery(tenant_id, endpoint_id, delivery_id)

    # -- notices -----------------------------------------------------------------------------

    def _changed(self) -> None:
        """Every process reads again which event types anyone wants."""
        self._publish(CHANGED_CHANNEL, "1")

    def _publish(self, channel: str, message: str) -> None:
        """A notice; one that cannot be sent is logged (the processes poll SQL anyway)."""
        if self.redis is None:
            return
        try:
            self.redis.publish(channel, message)
        except redis.RedisError as exc:
            log.warning("webhook notice on %s not sent (processes poll): %s", channel, exc)


def _now(db: Database, session: Session) -> datetime:
    """The database clock, read in the transaction that writes with it."""
    value: datetime = session.execute(select(_NOW), db.clock_params()).scalar_one()
    return value


def _owned(
    session: Session, tenant_id: str, endpoint_id: str, *, lock: bool = False
) -> Endpoint | None:
    """The tenant's endpoint, or None (another tenant's is None too); `lock` takes its row
    for the transaction, so that concurrent changes of one endpoint take turns."""
    query = select(WebhookEndpoint).where(
        WebhookEndpoint.id == endpoint_id, WebhookEndpoint.tenant_id == tenant_id
    )
    return session.scalar(query.with_for_update() if lock else query)


def _apply(endpoint: Endpoint, changes: EndpointChanges, now: datetime) -> None:
    if "url" in changes:
        endpoint.url = changes["url"]
    if "events" in changes:
        endpoint.events = list(changes["events"])
    if "description" in changes:
        endpoint.description = changes["description"]
    if "enabled" not in changes or changes["enabled"] == endpoint.enabled:
        return  # enabling an enabled endpoint keeps its failure clock running
    endpoint.enabled = changes["enabled"]
    endpoint.disabled_at = None if endpoint.enabled else now
    endpoint.disabled_reason = None if endpoint.enabled else DISABLED_BY_TENANT
    endpoint.failing_since = None


def _attempts(session: Session, delivery_ids: list[str]) -> dict[str, list[WebhookAttempt]]:
    """The attempts of these deliveries, oldest first, by delivery."""
    found: dict[str, list[WebhookAttempt]] = {}
    if not delivery_ids:
        return found
    query = (
        select(WebhookAttempt)
        .where(WebhookAttempt.delivery_id.in_(delivery_ids))
        .order_by(WebhookAttempt.delivery_id, WebhookAttempt.id)
    )
    for attempt in session.scalars(query):
        found.setdefault(attempt.delivery_id, []).append(attempt)
    return found


# -- the rules of a body ------------------------------------------------------------------------

MAX_DESCRIPTION: Final = 1000
"""Characters of an endpoint's description at most."""
CREATE_FIELDS: Final = ("url", "events", "description")
CHANGE_FIELDS: Final = ("url", "events", "description", "enabled")
REQUIRED: Final = ("url", "events")
TENANT_TYPES: Final = tuple(events.TENANT_EVENTS)


def checked(body: Any, policy: Destinations, *, creating: bool) -> EndpointChanges:
    """A creation's or a change's fields (a decoded JSON body, a form, a command line's
    options), each held to its rule; InvalidEndpoint naming the first field that breaks one.
    The HTTP API, the console and the command line take the same rules from here."""
    if not isinstance(body, dict):
        raise InvalidEndpoint("body", "must be a JSON object")
    fields = CREATE_FIELDS if creating else CHANGE_FIELDS
    for name in body:
        if name not in fields:
            raise InvalidEndpoint(
                str(name), f"is not a field here; the fields are {', '.join(fields)}"
            )
    for name in REQUIRED if creating else ():
        if name not in body:
            raise InvalidEndpoint(name, "is required")
    if not body:
        raise InvalidEndpoint("body", f"must name at least one of {', '.join(fields)}")
    return _changes(body, policy)


def _changes(body: dict[str, Any], policy: Destinations) -> EndpointChanges:
    changes: EndpointChanges = {}
    if "url" in body:
        changes["url"] = _url(body["url"], policy)
    if "events" in body:
        changes["events"] = _event_types(body["events"])
    if "description" in body:
        changes["description"] = _description(body["description"])
    if "enabled" in body:
        if not isinstance(body["enabled"], bool):
            raise InvalidEndpoint("enabled", "must be true or false")
        changes["enabled"] = body["enabled"]
    return changes


def _url(value: Any, policy: Destinations) -> str:
    if not isinstance(value, str):
        raise InvalidEndpoint("url", "must be a string")
    problem = url_problem(value, policy)
    if problem is not None:
        raise InvalidEndpoint("url", problem)
    return value


def _event_types(value: Any) -> list[str]:
    """A non-empty list of distinct tenant event types."""
    if not isinstance(value, list):
        raise InvalidEndpoint("events", "must be a list of event types", TENANT_TYPES)
    if not value:
        raise InvalidEndpoint("events", "must name at least one event type", TENANT_TYPES)
    for index, item in enumerate(value):
        field = f"events[{index}]"
        if not isinstance(item, str):
            raise InvalidEndpoint(field, "must be a string (an event type)", TENANT_TYPES)
        if events.unknown_types([item]):
            rule = f"'{item}' is not an event type; one of {', '.join(TENANT_TYPES)}"
            raise InvalidEndpoint(field, rule, TENANT_TYPES)
        if item in value[:index]:
            raise InvalidEndpoint(field, f"'{item}' is listed twice")
    return list(value)


def _description(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > MAX_DESCRIPTION):
        raise InvalidEndpoint(
            "description", f"must be a string of at most {MAX_DESCRIPTION} characters, or null"
        )
    return value


# -- the API's shapes --------------------------------------------------------------------------


def endpoint_json(endpoint: Any) -> dict[str, Any]:
    """An endpoint as the API shows it (a row or a model): never a secret. The
    `webhook.disabled` event's data has this shape too."""
    return {
        "id": endpoint.id,
        "url": endpoint.url,
        "events": list(endpoint.events or []),
        "description": endpoint.description,
        "enabled": bool(endpoint.enabled),
        "disabledAt": iso(endpoint.disabled_at),
        "disabledReason": endpoint.disabled_reason,
        "failingSince": iso(endpoint.failing_since),
        "previousSecretExpiresAt": iso(endpoint.previous_secret_until),
        "createdAt": iso(endpoint.created_at),
        "updatedAt": iso(endpoint.updated_at),
    }


def with_secret(endpoint: Endpoint, secret: str) -> dict[str, Any]:
    """The answer of a creation or a rotation: the endpoint and its new secret, shown once."""
    return {**endpoint_json(endpoint), "secret": secret}


def delivery_json(delivery: Delivery) -> dict[str, Any]:
    """A delivery as the API shows it: `webhookId` is the `webhook-id` header of every attempt
    (the message's id), `nextAttemptAt` is set while it is pending."""
    row = delivery.row
    return {
        "id": row.id,
        "webhookId": row.message_id,
        "type": delivery.type,
        "status": row.status,
        "attemptCount": row.attempts,
        "nextAttemptAt": iso(row.next_attempt_at) if row.status == PENDING else None,
        "lastStatus": row.last_status,
        "lastError": row.last_error,
        "createdAt": iso(row.created_at),
        "deliveredAt": iso(row.delivered_at),
        "attempts": [attempt_json(attempt) for attempt in delivery.attempts],
    }


def attempt_json(attempt: WebhookAttempt) -> dict[str, Any]:
    """One try: when, the answer's status (null when none came), how long, what went wrong
    and the start of the answer's body."""
    return {
        "at": iso(attempt.attempted_at),
        "status": attempt.status,
        "latencyMs": attempt.latency_ms,
        "error": attempt.error,
        "response": attempt.response,
    }
