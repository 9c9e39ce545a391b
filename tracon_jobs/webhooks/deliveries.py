"""Deliveries in SQL: the outbox's messages fanned out to their targets, claimed by one
deliverer at a time, and each attempt's outcome recorded.

The life of a message (`webhook_messages`) and its deliveries (`webhook_deliveries`):

1. **Fan-out.** A deliverer takes a batch of messages not fanned out yet (a short claim,
   `claim_until`, so that two deliverers do not render the same ones), renders each body once
   (`webhooks.render`) and, in one transaction, stores the body, marks the message fanned out
   and inserts one `pending` delivery per target: each enabled endpoint of the message's
   tenant that subscribes to its type, `operator` when the operator's endpoint lists the type,
   `slack` for the approval events when Slack is configured. The mark is guarded
   (`fanned_at IS NULL`): a fan-out that lost its claim and finds the message done writes
   nothing, so a message is fanned out exactly once. A deliverer killed in between leaves the
   message as it was; its claim runs out and another takes it.
2. **Claim.** A deliverer takes due deliveries (`pending`, `next_attempt_at` passed, no live
   claim) with a token of its own in `claimed_by` and `claim_until` beyond the attempt's
   timeout: one deliverer at a time sends a delivery. A deliverer killed mid-attempt leaves
   the claim to run out; the delivery is then sent again, with the same `webhook-id` and body.
3. **Record.** The attempt is always recorded (`webhook_attempts`); the delivery changes only
   while the claim is still the deliverer's own and the delivery `pending` (a redelivery or
   a removal meanwhile wins): `delivered` after a 2xx, else due again after the next wait of
   `Webhooks.Backoff`, or `failed` once the schedule has run out. An endpoint's answers keep
   its `failing_since` (cleared by a success); one failing for `Webhooks.DisableAfter` is
   disabled in the same transaction, its pending deliveries canceled and a `webhook.disabled`
   message written.

At least once: a receiver that took a message and whose answer was lost (a timeout, a
deliverer killed before it recorded the 2xx) gets it again, with the same `webhook-id` to
deduplicate on. Not ordered: deliveries of one endpoint go out concurrently and retries
overtake nothing in particular.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, cast

from sqlalchemy import CTE, Select, Table, exists, insert, or_, select, update
from sqlalchemy.orm import Session

from tracon_jobs.db import Database
from tracon_jobs.db.models import (
    Run,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookMessage,
)
from tracon_jobs.runs.store import iso
from tracon_jobs.webhooks.endpoints import CANCELED, PENDING, endpoint_json
from tracon_jobs.webhooks.render import Links, render
from tracon_jobs.webhooks.sender import AttemptResult
from tracon_jobs.webhooks.signing import message_id
from tracon_jobs.webhooks.subscriptions import SLACK_EVENTS

log = logging.getLogger(__name__)

MESSAGES = cast(Table, WebhookMessage.__table__)
DELIVERIES = cast(Table, WebhookDelivery.__table__)
ATTEMPTS = cast(Table, WebhookAttempt.__table__)
ENDPOINTS = cast(Table, WebhookEndpoint.__table__)

DELIVERED: Final = "delivered"
FAILED: Final = "failed"

OPERATOR: Final = "operator"
"""The target of the operator's endpoint (`Webhooks.Operator`)."""
SLACK: Final = "slack"
"""The target of the Slack app's approval messages (`Integrations.Slack`)."""

FAN_OUT_BATCH: Final = 100
"""Messages one fan-out takes at most."""
FAN_OUT_CLAIM: Final = timedelta(seconds=30)
"""How long a fan-out's claim on its messages holds (rendering takes milliseconds)."""

DISABLED_REASON: Final = "failing since {since} (Webhooks.DisableAfter: {after})"


@dataclass(frozen=True)
class Targets:
    """Who gets a message besides its tenant's endpoints: the operator's types, and whether
    Slack posts the approval events."""

    operator_events: frozenset[str] = frozenset()
    slack: bool = False

    def of(self, message: WebhookMessage, endpoints: Sequence[tuple[str, list[Any]]]) -> list[str]:
        """The targets of `message`, given its tenant's enabled endpoints (id, events)."""
        found = [id_ for id_, events in endpoints if message.type in (events or ())]
        if message.type in self.operator_events:
            found.append(OPERATOR)
        if self.slack and message.type in SLACK_EVENTS and message.tenant_id is not None:
            found.append(SLACK)
        return found


@dataclass(frozen=True)
class Claimed:
    """A delivery this deliverer holds: what its attempt needs, and the claim's token."""

    id: str
    token: str
    message_id: str
    type: str
    target: str
    tenant_id: str | None
    body: str
    attempts: int
    """attempts made before this one"""
    url: str | None = None
    """the endpoint's (an endpoint target whose endpoint is enabled), else None"""
    secrets: tuple[str, ...] = ()
    """the endpoint's secrets that sign: the current one, and the previous in its grace"""


@dataclass(frozen=True)
class Outcome:
    """What became of a claimed delivery after its attempt."""

    status: str  # delivered | pending (retried later) | failed | canceled
    recorded: bool  # False: the claim was lost meanwhile (redelivered, removed)
    disabled: dict[str, Any] | None = (
        None  # the endpoint this attempt disabled, as the API shows it
    )


@dataclass(frozen=True)
class Due:
    """What a deliverer's look finds waiting."""

    messages: bool  # messages to fan out
    deliveries: bool  # deliveries due now
    pending: bool  # deliveries pending, due now or later (or claimed)


Clock = Callable[[], datetime]

CLOCK_READ_SECONDS: Final = 60.0
"""How often the deliverer reads the database clock again; between reads it runs on this
host's clock, corrected by the difference last read (no statement per look for the time)."""


class DatabaseClock:
    """The database clock (`Database.now`), read once a minute: the deliverers of every host
    compare due times and claims on the one clock that writes them (a redelivery's `now`
    is the database's), without a round trip for it in every statement."""

    def __init__(self, db: Database, read_every: float = CLOCK_READ_SECONDS) -> None:
        self.db = db
        self.read_every = read_every
        self._offset = timedelta(0)
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        here = time.monotonic()
        if self._read_at is None or here - self._read_at >= self.read_every:
            with self._lock:
                if self._read_at is None or here - self._read_at >= self.read_every:
                    database = self.db.now()
                    self._offset = database - _utc_now()
                    self._read_at = here
        return _utc_now() + self._offset


def _utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class DeliveryStore:
    """Fan-out, claims and outcomes, in SQL (see the module's docstring)."""

    def __init__(
        self,
        db: Database,
        targets: Targets,
        backoff: Sequence[timedelta],
        disable_after: timedelta,
        claim_for: timedelta,
        *,
        links: Links | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.db = db
        self.targets = targets
        self.backoff = list(backoff)
        self.disable_after = disable_after
        self.claim_for = claim_for
        self.links = links
        self.clock = clock or DatabaseClock(db)

    # -- what waits ------------------------------------------------------------------------

    def due(self) -> Due:
        """What waits, in one read."""
        now = self.clock()
        messages = select(MESSAGES.c.id).where(
            MESSAGES.c.fanned_at.is_(None),
            or_(MESSAGES.c.claim_until.is_(None), MESSAGES.c.claim_until < now),
        )
        deliveries = select(DELIVERIES.c.id).where(
            DELIVERIES.c.status == PENDING,
            DELIVERIES.c.next_attempt_at <= now,
            or_(DELIVERIES.c.claim_until.is_(None), DELIVERIES.c.claim_until < now),
        )
        pending = select(DELIVERIES.c.id).where(DELIVERIES.c.status == PENDING)
        with self.db.read_connection() as connection:
            row = connection.execute(
                select(exists(messages), exists(deliveries), exists(pending))
            ).one()
        return Due(bool(row[0]), bool(row[1]), bool(row[2]))

    # -- fan-out ---------------------------------------------------------------------------

    def fan_out(self, limit: int = FAN_OUT_BATCH) -> int:
        """Fan out up to `limit` messages; how many this call fanned out."""
        now = self.clock()
        ids = self._claim_messages(now, limit)
        if not ids:
            return 0
        planned: list[tuple[str, str | None, str, list[str]]] = []  # id, tenant, body, targets
        with self.db.read() as session:
            rows = list(
                session.scalars(
                    select(WebhookMessage)
                    .where(WebhookMessage.id.in_(ids))
                    .order_by(WebhookMessage.created_at, WebhookMessage.id)
                )
            )
            _load_runs(session, rows)  # one read for the batch, not one per message
            endpoints: dict[str, list[tuple[str, list[Any]]]] = {}  # per tenant, this batch
            for message in rows:
                id_, tenant_id = message.id, message.tenant_id
                try:
                    body = self._body(session, message)
                    targets = self.targets.of(
                        message, self._endpoints(session, tenant_id, endpoints)
                    )
                except Exception:  # one message that cannot be rendered holds back no other
                    session.rollback()  # a statement that failed ends the read's transaction
                    log.exception("webhook message %s not fanned out (tried again later)", id_)
                    continue
                planned.append((id_, tenant_id, body, targets))
        done = 0
        deliveries: list[dict[str, Any]] = []
        with self.db.write() as session:
            for id_, tenant_id, body, targets in planned:
                marked = session.execute(
                    update(MESSAGES)
                    .where(MESSAGES.c.id == id_, MESSAGES.c.fanned_at.is_(None))
                    .values(body=body, fanned_at=now, claim_until=None)
                    .returning(MESSAGES.c.id)
                ).first()
                if marked is None:
                    continue  # another fan-out did it (this one's claim had run out)
                done += 1
                deliveries.extend(
                    {
                        "id": str(uuid.uuid4()),
                        "message_id": id_,
                        "target": target,
                        "tenant_id": tenant_id,
                        "status": PENDING,
                        "attempts": 0,
                        "next_attempt_at": now,
                        "created_at": now,
                    }
                    for target in targets
                )
            if deliveries:
                session.execute(insert(DELIVERIES), deliveries)
        return done

    def _endpoints(
        self,
        session: Session,
        tenant_id: str | None,
        known: dict[str, list[tuple[str, list[Any]]]],
    ) -> list[tuple[str, list[Any]]]:
        """The tenant's enabled endpoints (id, events), read once per tenant and batch."""
        if tenant_id is None:
            return []
        if tenant_id not in known:
            known[tenant_id] = [
                (row.id, row.events)
                for row in session.execute(
                    select(ENDPOINTS.c.id, ENDPOINTS.c.events)
                    .where(ENDPOINTS.c.tenant_id == tenant_id, ENDPOINTS.c.enabled)
                    .order_by(ENDPOINTS.c.created_at, ENDPOINTS.c.id)
                )
            ]
        return known[tenant_id]

    def _claim_messages(self, now: datetime, limit: int) -> list[str]:
        waiting = (
            select(MESSAGES.c.id)
            .where(
                MESSAGES.c.fanned_at.is_(None),
                or_(MESSAGES.c.claim_until.is_(None), MESSAGES.c.claim_until < now),
            )
            .order_by(MESSAGES.c.created_at, MESSAGES.c.id)
            .limit(limit)
        )
        picked = self._picked(waiting, "waiting")
        with self.db.write() as session:
            return list(
                session.execute(
                    update(MESSAGES)
                    .where(
                        MESSAGES.c.id.in_(select(picked.c.id)),
                        MESSAGES.c.fanned_at.is_(None),
                    )
                    .values(claim_until=now + FAN_OUT_CLAIM)
                    .returning(MESSAGES.c.id)
                ).scalars()
            )

    def _picked(self, query: Select[Any], name: str) -> CTE:
        """The rows a claim takes, picked once: `id IN (SELECT … LIMIT n)` may run its
        subquery again for each row it compares (PostgreSQL did, and a claim of 4 took 13);
        a materialized CTE is evaluated once. On PostgreSQL the rows other claims hold are
        skipped (`SKIP LOCKED`); SQLite has one writer at a time."""
        if self.db.is_sqlite:
            return query.cte(name)
        return query.with_for_update(skip_locked=True).cte(name).prefix_with("MATERIALIZED")

    def _body(self, session: Session, message: WebhookMessage) -> str:
        payload = render(session, message, links=self.links)
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False, default=str)

    # -- claims ------------------------------------------------------------------------------

    def claim(self, owner: str, limit: int) -> list[Claimed]:
        """Take up to `limit` due deliveries for `owner` (this deliverer), oldest due first."""
        if limit <= 0:
            return []
        now = self.clock()
        due = (
            select(DELIVERIES.c.id)
            .where(
                DELIVERIES.c.status == PENDING,
                DELIVERIES.c.next_attempt_at <= now,
                or_(DELIVERIES.c.claim_until.is_(None), DELIVERIES.c.claim_until < now),
            )
            .order_by(DELIVERIES.c.next_attempt_at, DELIVERIES.c.id)
            .limit(limit)
        )
        picked = self._picked(due, "due")
        token = f"{owner}:{uuid.uuid4().hex[:12]}"
        with self.db.write() as session:
            ids = list(
                session.execute(
                    update(DELIVERIES)
                    .where(
                        DELIVERIES.c.id.in_(select(picked.c.id)),
                        DELIVERIES.c.status == PENDING,
                    )
                    .values(claimed_by=token, claim_until=now + self.claim_for)
                    .returning(DELIVERIES.c.id)
                ).scalars()
            )
            if not ids:
                return []
            rows = session.execute(
                select(
                    DELIVERIES.c.id,
                    DELIVERIES.c.message_id,
                    DELIVERIES.c.target,
                    DELIVERIES.c.tenant_id,
                    DELIVERIES.c.attempts,
                    MESSAGES.c.type,
                    MESSAGES.c.body,
                    ENDPOINTS.c.url,
                    ENDPOINTS.c.enabled,
                    ENDPOINTS.c.secret,
                    ENDPOINTS.c.previous_secret,
                    ENDPOINTS.c.previous_secret_until,
                )
                .join(MESSAGES, MESSAGES.c.id == DELIVERIES.c.message_id)
                .outerjoin(ENDPOINTS, ENDPOINTS.c.id == DELIVERIES.c.target)
                .where(DELIVERIES.c.id.in_(ids))
                .order_by(DELIVERIES.c.next_attempt_at, DELIVERIES.c.id)
            ).all()
        return [_claimed(row, token, now) for row in rows]

    # -- outcomes ------------------------------------------------------------------------------

    def record(self, claimed: Claimed, result: AttemptResult) -> Outcome:
        """Record the attempt, and what it makes of the delivery (see the module's docstring)."""
        now = self.clock()
        tries = claimed.attempts + 1
        if result.succeeded:
            status = DELIVERED
            changes: dict[str, Any] = {"status": DELIVERED, "delivered_at": now}
        elif tries > len(self.backoff):
            status = FAILED
            changes = {"status": FAILED}
        else:
            status = PENDING
            changes = {"next_attempt_at": now + self.backoff[tries - 1]}
        changes.update(
            attempts=DELIVERIES.c.attempts + 1,
            last_status=result.status,
            last_error=result.error,
            claimed_by=None,
            claim_until=None,
        )
        disabled = None
        with self.db.write() as session:
            # the endpoint's row before the delivery's, as a removal takes them (it locks the
            # endpoint, then cancels its deliveries): the other order deadlocks
            if claimed.url is not None and result.succeeded:
                session.execute(  # a success ends the failure clock (locks only a failing one)
                    update(ENDPOINTS)
                    .where(ENDPOINTS.c.id == claimed.target, ENDPOINTS.c.failing_since.is_not(None))
                    .values(failing_since=None)
                )
            elif claimed.url is not None:
                session.execute(
                    select(ENDPOINTS.c.id).where(ENDPOINTS.c.id == claimed.target).with_for_update()
                )
            session.execute(
                insert(ATTEMPTS).values(
                    delivery_id=claimed.id,
                    attempted_at=now,
                    status=result.status,
                    latency_ms=result.latency_ms,
                    error=result.error,
                    response=result.response_excerpt or None,
                )
            )
            changed = session.execute(
                update(DELIVERIES)
                .where(
                    DELIVERIES.c.id == claimed.id,
                    DELIVERIES.c.claimed_by == claimed.token,
                    DELIVERIES.c.status == PENDING,
                )
                .values(**changes)
                .returning(DELIVERIES.c.id)
            ).first()
            if claimed.url is not None and not result.succeeded:
                disabled = self._failed(session, claimed.target, now)
        return Outcome(status if changed else "lost", changed is not None, disabled)

    def cancel(self, claimed: Claimed, why: str) -> Outcome:
        """The delivery's target is gone (a removed or disabled endpoint, an unconfigured
        integration): `canceled`, with no attempt."""
        with self.db.write() as session:
            changed = session.execute(
                update(DELIVERIES)
                .where(
                    DELIVERIES.c.id == claimed.id,
                    DELIVERIES.c.claimed_by == claimed.token,
                    DELIVERIES.c.status == PENDING,
                )
                .values(status=CANCELED, last_error=why, claimed_by=None, claim_until=None)
                .returning(DELIVERIES.c.id)
            ).first()
        return Outcome(CANCELED if changed else "lost", changed is not None)

    def _failed(self, session: Session, endpoint_id: str, now: datetime) -> dict[str, Any] | None:
        """Start the endpoint's failure clock; disable it once it has failed for long enough
        (its pending deliveries canceled, `webhook.disabled` written). The endpoint, as the
        API shows it, when this failure disabled it."""
        session.execute(
            update(ENDPOINTS)
            .where(ENDPOINTS.c.id == endpoint_id, ENDPOINTS.c.failing_since.is_(None))
            .values(failing_since=now)
        )
        endpoint = session.get(WebhookEndpoint, endpoint_id, with_for_update=True)
        if (
            endpoint is None
            or not endpoint.enabled
            or endpoint.failing_since is None
            or now - endpoint.failing_since < self.disable_after
        ):
            return None
        endpoint.enabled = False
        endpoint.disabled_at = now
        endpoint.disabled_reason = DISABLED_REASON.format(
            since=iso(endpoint.failing_since), after=_duration(self.disable_after)
        )
        endpoint.updated_at = now
        session.execute(
            update(DELIVERIES)
            .where(DELIVERIES.c.target == endpoint_id, DELIVERIES.c.status == PENDING)
            .values(status=CANCELED, last_error="the endpoint was disabled")
        )
        session.flush()
        shown = endpoint_json(endpoint)
        session.execute(
            insert(MESSAGES).values(
                id=message_id(),
                tenant_id=endpoint.tenant_id,
                type="webhook.disabled",
                subject_id=endpoint.id,
                data=shown,
                created_at=now,
            )
        )
        return shown


def _load_runs(session: Session, messages: Sequence[WebhookMessage]) -> None:
    """Read the runs the batch's run messages render into the session at once, so that each
    message's `session.get` finds its run there."""
    run_ids = [m.subject_id for m in messages if m.type.startswith("run.") and m.subject_id]
    if run_ids:
        list(session.scalars(select(Run).where(Run.id.in_(run_ids))))


def _claimed(row: Any, token: str, now: datetime) -> Claimed:
    url = secrets = None
    if row.url is not None and row.enabled:
        url = row.url
        in_grace = row.previous_secret is not None and (
            row.previous_secret_until is not None and row.previous_secret_until > now
        )
        secrets = (row.secret, row.previous_secret) if in_grace else (row.secret,)
    return Claimed(
        id=row.id,
        token=token,
        message_id=row.message_id,
        type=row.type,
        target=row.target,
        tenant_id=row.tenant_id,
        body=row.body or "",
        attempts=row.attempts,
        url=url,
        secrets=secrets or (),
    )


def _duration(value: timedelta) -> str:
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
