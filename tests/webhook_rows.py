"""Webhook deliveries written straight into SQL, as the outbox's fan-out and the deliverer
leave them, for the tests of what reads them (the API, the command line, the console); and
the notices the webhook channels carry, as another process hears them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import redis

from tests.waits import TIMEOUT_SLACK
from tracon_jobs.db import Database
from tracon_jobs.db.models import WebhookAttempt, WebhookDelivery, WebhookMessage
from tracon_jobs.webhooks.signing import message_id


@dataclass(frozen=True)
class Tried:
    """One attempt: the answer's status (None: none came), its latency, error and excerpt."""

    status: int | None
    latency_ms: int = 12
    error: str | None = None
    response: str = ""


def delivery(
    db: Database,
    endpoint_id: str,
    tenant_id: str,
    *,
    status: str = "pending",
    type_: str = "run.completed",
    tried: tuple[Tried, ...] = (),
    claimed_by: str | None = None,
    created_at: datetime | None = None,
) -> tuple[str, str]:
    """A message of `type_` and its delivery to the endpoint, with its attempts a second
    apart: (delivery id, message id)."""
    created = created_at or db.now()
    message = message_id()
    delivery_id = str(uuid.uuid4())
    last = tried[-1] if tried else None
    with db.write() as session:
        session.add(
            WebhookMessage(
                id=message,
                tenant_id=tenant_id,
                type=type_,
                subject_id="run-1",
                data={"id": "run-1"},
                created_at=created,
                body='{"type":"' + type_ + '"}',
                fanned_at=created,
            )
        )
        session.flush()
        session.add(
            WebhookDelivery(
                id=delivery_id,
                message_id=message,
                target=endpoint_id,
                tenant_id=tenant_id,
                status=status,
                attempts=len(tried),
                next_attempt_at=created + timedelta(hours=1),
                claimed_by=claimed_by,
                claim_until=created + timedelta(minutes=1) if claimed_by else None,
                last_status=last.status if last else None,
                last_error=last.error if last else None,
                created_at=created,
                delivered_at=created if status == "delivered" else None,
            )
        )
        session.flush()
        for index, attempt in enumerate(tried):
            session.add(
                WebhookAttempt(
                    delivery_id=delivery_id,
                    attempted_at=created + timedelta(seconds=index),
                    status=attempt.status,
                    latency_ms=attempt.latency_ms,
                    error=attempt.error,
                    response=attempt.response,
                )
            )
    return delivery_id, message


def delivery_row(db: Database, delivery_id: str) -> WebhookDelivery:
    with db.read() as session:
        row = session.get(WebhookDelivery, delivery_id)
    assert row is not None
    return row


def subscribed(client: redis.Redis, *channels: str) -> redis.client.PubSub:
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(*channels)
    assert listener.get_message(timeout=2) is None  # the subscription's own reply, skipped
    return listener


def heard(listener: redis.client.PubSub, count: int, timeout: float = 5.0) -> list[str]:
    """The channels of the next `count` notices, then nothing more for a moment."""
    channels: list[str] = []
    deadline = time.monotonic() + timeout * TIMEOUT_SLACK
    while len(channels) < count and time.monotonic() < deadline:
        message = listener.get_message(timeout=0.2)
        if message is not None:
            channels.append(message["channel"].decode())
    extra = listener.get_message(timeout=0.2)
    assert extra is None, extra
    return channels
