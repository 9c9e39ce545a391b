"""Which webhook event types anyone wants, kept in every process, so that an event nobody
listens to costs nothing: no statement and no Redis call (`webhooks.outbox` asks `current()`
before it writes a message).

Wanted are the types that enabled endpoints subscribe to (per tenant, from SQL) and the types
that configuration wants of every tenant: the operator's endpoint's `Events` and, with Slack
configured, the approval events.

Staleness: `RedisSubscriptions` reads SQL again at once when `CHANGED_CHANNEL` is told (the
web tells it after it creates, changes or removes an endpoint, and refreshes its own process
first), as its listener (re)subscribes, every `Webhooks.PollInterval` while the listener is
down, and every `LISTENING_POLL_SECONDS` (a safety net) while it listens: a connected
subscriber loses no notice (Redis drops a subscriber it cannot keep up with, which the listener
sees as a lost connection), and a poll a second would cost every process a statement a second
for nothing. A process that missed the notice (its listener was reconnecting, Redis was
restarting) is late by at most one poll interval:
until then it may skip the message of an event whose type was just subscribed to, or write
one that the insert's own check then drops. The insert reads whether the run's tenant has an
enabled endpoint for the type in the same statement, so a message is never written for a
tenant that has none; only an event in the first moments of a new subscription can be missed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, cast

import redis
from sqlalchemy import Table, select, true

from tracon_jobs.db import Database
from tracon_jobs.db.hot import hot
from tracon_jobs.db.models import WebhookEndpoint
from tracon_jobs.logs import Repeated
from tracon_jobs.settings import Settings
from tracon_jobs.webhooks.events import CHANGED_CHANNEL

log = logging.getLogger(__name__)

ENDPOINTS = cast(Table, WebhookEndpoint.__table__)

STOP_SECONDS: Final = 1.0
"""The longest the listener waits before it looks whether it was stopped."""

LISTENING_POLL_SECONDS: Final = 60.0
"""How often a process whose listener is subscribed reads the subscriptions again anyway."""

SLACK_EVENTS: Final = frozenset({"approval.requested", "approval.decided", "approval.expired"})
"""What the Slack integration posts and updates: every tenant's approvals."""


@dataclass(frozen=True)
class Wanted:
    """Who wants which event types, as of one read."""

    tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """type -> the tenants with an enabled endpoint that subscribes to it"""
    everyone: frozenset[str] = frozenset()
    """types wanted of every tenant, and the operator's own (configuration)"""

    def wants(self, type_: str) -> bool:
        """Whether anyone may want a message of `type_` (of some tenant)."""
        return type_ in self.everyone or type_ in self.tenants

    def wants_of(self, tenant_id: str, type_: str) -> bool:
        """Whether anyone wants a message of `type_` of tenant `tenant_id`."""
        return type_ in self.everyone or tenant_id in self.tenants.get(type_, ())

    def gated(self, type_: str) -> bool:
        """Whether a message of `type_` is wanted only by its tenant's endpoints (the insert
        checks that the tenant has one)."""
        return type_ not in self.everyone


def configured(settings: Settings) -> frozenset[str]:
    """The types configuration wants of every tenant: the operator's endpoint's, and the
    approval events when Slack is configured."""
    found: set[str] = set()
    operator = settings.webhooks.operator
    if operator is not None:
        found.update(operator.events)
    if settings.integrations.slack is not None:
        found.update(SLACK_EVENTS)
    return frozenset(found)


# a hot read (SQLite runs it straight on the driver): every process polls it
_ENABLED = hot(
    select(ENDPOINTS.c.tenant_id, ENDPOINTS.c.events).where(ENDPOINTS.c.enabled.is_(true()))
)


def read_wanted(db: Database, everyone: frozenset[str]) -> Wanted:
    """What the enabled endpoints subscribe to now, with `everyone`'s types."""
    with db.read_connection() as connection:
        rows = connection.execute(_ENABLED).all()
    tenants: defaultdict[str, set[str]] = defaultdict(set)
    for tenant_id, events in rows:
        for type_ in events or ():
            tenants[type_].add(tenant_id)
    return Wanted({type_: frozenset(ids) for type_, ids in tenants.items()}, everyone)


def changed(redis_client: redis.Redis) -> None:
    """Tell every process that an endpoint was created, changed or removed: each reads what
    is wanted again at once. A notice that cannot be sent is logged; the poll covers it."""
    try:
        redis_client.publish(CHANGED_CHANNEL, "1")
    except redis.RedisError as exc:
        log.warning("webhook endpoints changed; not told (processes poll SQL): %s", exc)


class Subscriptions(Protocol):
    def current(self) -> Wanted:
        """What is wanted, as last read (read now on first use)."""
        ...

    def refresh(self) -> Wanted:
        """Read what is wanted now, in this process."""
        ...

    def changed(self) -> None:
        """This process changed an endpoint: `refresh` here, and tell the others."""
        ...

    def stop(self) -> None: ...


class MemorySubscriptions:
    """One process's: read from SQL on first use and on each `refresh` or `changed` (no
    thread, no Redis), for one-process use and tests."""

    def __init__(self, db: Database, everyone: frozenset[str] = frozenset()) -> None:
        self.db = db
        self.everyone = everyone
        self._wanted: Wanted | None = None

    def current(self) -> Wanted:
        return self._wanted or self.refresh()

    def refresh(self) -> Wanted:
        self._wanted = read_wanted(self.db, self.everyone)
        return self._wanted

    def changed(self) -> None:
        self.refresh()

    def stop(self) -> None:
        """Nothing runs in the background."""


class RedisSubscriptions:
    """Read from SQL on first use, then kept by a daemon thread that reads again when
    `CHANGED_CHANNEL` is told and every `poll_seconds` (see the module's docstring)."""

    def __init__(
        self,
        db: Database,
        client: redis.Redis,
        everyone: frozenset[str] = frozenset(),
        *,
        poll_seconds: float = 1.0,
    ) -> None:
        self.db = db
        self.client = client
        self.everyone = everyone
        self.poll_seconds = poll_seconds
        self.subscribed = threading.Event()  # the listener hears notices now
        self._wanted: Wanted | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._pid = -1  # the process whose thread runs: a forked child starts its own
        self._warned = Repeated(log)  # a failure that goes on is not logged every poll

    def current(self) -> Wanted:
        wanted = self._wanted
        if wanted is None or self._pid != os.getpid():
            return self._start()
        return wanted

    def refresh(self) -> Wanted:
        """Read now; on a database error the last read stays (logged)."""
        try:
            self._wanted = read_wanted(self.db, self.everyone)
            self._warned.ended("sql")
        except Exception as exc:  # an outage must not stop event writes: keep the last read
            if not self._stopped.is_set():  # stopping, its database may be gone: nothing to say
                self._warned.warn("sql", "webhook subscriptions not read again: %s", exc)
            if self._wanted is None:
                self._wanted = Wanted(everyone=self.everyone)  # configuration only, until read
        return self._wanted

    def changed(self) -> None:
        self.refresh()
        changed(self.client)

    def stop(self) -> None:
        self._stopped.set()

    def _start(self) -> Wanted:
        with self._lock:
            if self._wanted is None or self._pid != os.getpid():
                self.subscribed.clear()
                self.refresh()
                self._pid = os.getpid()
                threading.Thread(
                    target=self._keep_fresh, name="webhook-subscriptions", daemon=True
                ).start()
            assert self._wanted is not None
            return self._wanted

    def _keep_fresh(self) -> None:
        """Listen and poll until stopped; without Redis, poll alone and try again."""
        while not self._stopped.is_set():
            try:
                self._listen()
            except Exception as exc:  # a lost connection: the poll goes on meanwhile
                self.subscribed.clear()
                if not self._stopped.is_set():
                    self._warned.warn("redis", "webhook subscriptions listener lost Redis: %s", exc)
                if not self._stopped.wait(self.poll_seconds):
                    self.refresh()

    def _listen(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(CHANGED_CHANNEL)
            self.refresh()  # what changed before this subscription heard of it
            self.subscribed.set()
            self._warned.ended("redis")  # the next loss is logged at once
            every = max(self.poll_seconds, LISTENING_POLL_SECONDS)
            due = time.monotonic() + every
            while not self._stopped.is_set():
                wait = min(max(due - time.monotonic(), 0.0), STOP_SECONDS)
                message = pubsub.get_message(timeout=wait)
                if _is_notice(message) or time.monotonic() >= due:
                    self.refresh()
                    due = time.monotonic() + every
        finally:
            with contextlib.suppress(Exception):
                pubsub.close()


def _is_notice(message: dict[str, Any] | None) -> bool:
    return message is not None and message.get("type") == "message"
