"""The deliverer: the thread in each worker process that fans the outbox out and sends its
deliveries, `Webhooks.Concurrency` attempts at a time (`webhooks.deliveries` holds the rules).

It looks for work when a commit that wrote messages says so on `WAKE_CHANNEL` (a redelivery
too), when one of its attempts ends while more may be due, and every `Webhooks.PollInterval`
while anyone wants any event or deliveries are pending (retries come due, claims of a killed
worker run out). Each look is one read first; it writes only when that read found work. While
nobody wants anything and nothing is pending, it looks once every `LISTENING_POLL_SECONDS`, so
an installation without webhooks pays no statement a second for it. A lost wake-up (the
listener was reconnecting) costs at most a poll.

A drain stops it claiming; the attempts in flight end within `Webhooks.Timeout` and are
recorded. A worker killed mid-attempt leaves its claims to run out, and another worker sends
those deliveries again, same `webhook-id`, same body.

Each attempt goes to its target: an endpoint's URL, signed with its secrets (`signing`) and
sent by the `Sender` (its destination checked after DNS, at this very attempt); the operator's
endpoint of configuration; or the Slack app (`integrations.slack`, a `Sink`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Protocol

import redis

from tracon_jobs import metrics
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.logs import Repeated
from tracon_jobs.settings.sections import WebhooksSettings
from tracon_jobs.webhooks import signing
from tracon_jobs.webhooks.addresses import Destinations, url_problem
from tracon_jobs.webhooks.deliveries import (
    OPERATOR,
    PENDING,
    SLACK,
    Claimed,
    DeliveryStore,
    Due,
    Outcome,
)
from tracon_jobs.webhooks.events import WAKE_CHANNEL, unknown_types
from tracon_jobs.webhooks.sender import AttemptResult, Sender
from tracon_jobs.webhooks.subscriptions import Subscriptions, changed

log = logging.getLogger(__name__)

LISTENING_POLL_SECONDS: Final = 60.0
"""How often an idle deliverer looks anyway while nobody wants any event."""

STOP_SECONDS: Final = 1.0
"""The longest the wake listener waits before it looks whether it was stopped."""


class Sink(Protocol):
    """A target that is not an HTTP endpoint (the Slack app): one attempt of a delivery."""

    def deliver(self, message_id: str, type_: str, body: dict[str, Any]) -> AttemptResult: ...


@dataclass(frozen=True)
class OperatorEndpoint:
    """`Webhooks.Operator`: its URL and the secret that signs (never shown)."""

    url: str
    secret: str

    def __repr__(self) -> str:
        return f"OperatorEndpoint(url={self.url!r})"


def operator_endpoint(
    settings: WebhooksSettings, environ: Mapping[str, str]
) -> OperatorEndpoint | None:
    """The operator's endpoint of configuration, checked as the process starts: its URL by
    the destination rules of endpoints, its events known, its secret a `whsec_` one."""
    operator = settings.operator
    if operator is None:
        return None
    policy = Destinations(settings.allow_http, settings.allow_private_networks)
    problem = url_problem(operator.url, policy)
    if problem is not None:
        raise ConfigurationError("Webhooks.Operator.Url", problem)
    unknown = unknown_types(list(operator.events), operator=True)
    if unknown:
        raise ConfigurationError("Webhooks.Operator.Events", f"{unknown[0]!r} is not an event type")
    secret = environ.get(operator.secret_env)
    if secret is None:
        raise ConfigurationError(
            "Webhooks.Operator.SecretEnv",
            f"names the environment variable {operator.secret_env}, which is not set",
        )
    try:
        signing.secret_key(secret)
    except ValueError as exc:
        raise ConfigurationError(
            "Webhooks.Operator.SecretEnv", f"{operator.secret_env}: {exc}"
        ) from None
    return OperatorEndpoint(operator.url, secret)


def _nothing(error: str) -> AttemptResult:
    return AttemptResult(None, 0, error, "")


class Attempts:
    """One attempt of a claimed delivery, at its target."""

    def __init__(
        self,
        sender: Sender,
        operator: OperatorEndpoint | None = None,
        slack: Sink | None = None,
        clock: Any = time.time,
    ) -> None:
        self.sender = sender
        self.operator = operator
        self.slack = slack
        self.clock = clock

    def gone(self, claimed: Claimed) -> str | None:
        """Why the delivery's target no longer takes deliveries, or None."""
        if claimed.target == OPERATOR:
            return None if self.operator else "Webhooks.Operator is no longer configured"
        if claimed.target == SLACK:
            return None if self.slack else "Integrations.Slack is no longer configured"
        return None if claimed.url else "the endpoint was removed or disabled"

    def attempt(self, claimed: Claimed) -> AttemptResult:
        if claimed.target == SLACK:
            assert self.slack is not None
            return self.slack.deliver(claimed.message_id, claimed.type, json.loads(claimed.body))
        if claimed.target == OPERATOR:
            assert self.operator is not None
            return self._post(claimed, self.operator.url, (self.operator.secret,))
        assert claimed.url is not None
        return self._post(claimed, claimed.url, claimed.secrets)

    def _post(self, claimed: Claimed, url: str, secrets: tuple[str, ...]) -> AttemptResult:
        body = claimed.body.encode()
        headers = signing.headers(claimed.message_id, int(self.clock()), body, secrets)
        return self.sender.send(url, body, headers)


class Deliverer:
    """Fans out and delivers, on a thread of its own with a pool of attempts (module doc)."""

    def __init__(
        self,
        store: DeliveryStore,
        attempts: Attempts,
        client: redis.Redis,
        subscriptions: Subscriptions,
        *,
        concurrency: int,
        poll_seconds: float,
        draining: threading.Event | None = None,
        owner: str | None = None,
    ) -> None:
        self.store = store
        self.attempts = attempts
        self.client = client
        self.subscriptions = subscriptions
        self.concurrency = concurrency
        self.poll_seconds = poll_seconds
        self.draining = draining or threading.Event()
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.listening = threading.Event()  # the wake listener is subscribed
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._in_flight: set[Future[Outcome]] = set()
        self._lock = threading.Lock()
        self._full = False  # the last claim took every free slot: more may be due
        self._pending = False  # the last look saw deliveries pending (due now or later)
        self._told = False  # a wake-up came on WAKE_CHANNEL since the last look
        self._threads: list[threading.Thread] = []
        self._warned = Repeated(log)  # a failure that goes on is not logged every poll
        self._pool: ThreadPoolExecutor | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            return
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="webhook-attempt")
        for target, name in (
            (self._listen_forever, "webhook-wake"),
            (self._run, "webhook-deliverer"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, wait: float | None = None) -> None:
        """Claim nothing more; with `wait`, give the attempts in flight that long to end."""
        self._stopped.set()
        self._wake.set()
        if wait is not None:
            for thread in self._threads:
                thread.join(wait)
        if self._pool is not None:
            self._pool.shutdown(wait=wait is not None)

    def wake(self) -> None:
        self._wake.set()

    # -- one look ---------------------------------------------------------------------------

    def look(self) -> int:
        """Fan out what waits, then claim and start attempts for the free slots; how many
        deliveries it started (the loop's turn; tests call it on their thread)."""
        if self._full and not self._told:
            # an attempt ended after a claim that took every free slot: more are likely due,
            # and nothing new was written (no wake-up came), so claim without looking first
            due = Due(messages=False, deliveries=True, pending=True)
        else:
            due = self.store.due()  # one read: a look that finds nothing writes nothing
        self._told = False
        self._pending = due.pending or due.messages
        if due.messages:
            while self.store.fan_out() and not self._stopped.is_set():
                pass  # a full batch: there may be more
        with self._lock:
            free = self.concurrency - len(self._in_flight)
        if free <= 0 or self._stopping() or not (due.messages or due.deliveries):
            return 0
        claimed = self.store.claim(self.owner, free)
        self._full = len(claimed) >= free
        for delivery in claimed:
            self._start(delivery)
        return len(claimed)

    def deliver(self, claimed: Claimed) -> Outcome:
        """One attempt of `claimed`, and its outcome recorded."""
        target = claimed.target if claimed.target in (OPERATOR, SLACK) else "endpoint"
        why = self.attempts.gone(claimed)
        if why is not None:
            canceled = self.store.cancel(claimed, why)
            metrics.webhook_attempt(target, canceled.status, None)
            return canceled
        started = time.monotonic()
        try:
            result = self.attempts.attempt(claimed)
        except Exception as exc:  # a sink's own bug: a failed attempt, retried on schedule
            log.exception("webhook delivery %s: the attempt raised", claimed.id)
            result = _nothing(f"the attempt raised {type(exc).__name__}")
        seconds = time.monotonic() - started
        outcome = self.store.record(claimed, result)
        shown = "retried" if outcome.status == PENDING else outcome.status
        metrics.webhook_attempt(target, shown, seconds)
        if outcome.disabled is not None:
            log.warning(
                "webhook endpoint %s disabled: %s",
                outcome.disabled.get("id"),
                outcome.disabled.get("disabledReason"),
            )
            changed(self.client)  # every process: what is wanted changed
            self._publish_wake()
        return outcome

    def _start(self, claimed: Claimed) -> None:
        assert self._pool is not None
        future = self._pool.submit(self.deliver, claimed)
        with self._lock:
            self._in_flight.add(future)
        future.add_done_callback(self._ended)

    def _ended(self, future: Future[Outcome]) -> None:
        with self._lock:
            self._in_flight.discard(future)
        exc = future.exception()
        if exc is not None:  # the record failed (the database): the claim runs out, then retried
            log.warning("webhook delivery not recorded (sent again later): %s", exc)
        if self._full:
            self._wake.set()

    def _stopping(self) -> bool:
        return self._stopped.is_set() or self.draining.is_set()

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping():
            self._wake.clear()
            found = 0
            try:
                found = self.look()
                self._warned.ended("look")
            except Exception as exc:  # the database or Redis is away: the next turn tries again
                self._warned.warn("look", "webhook deliveries not looked for: %s", exc)
            self._wake.wait(self._interval(found))

    def _interval(self, found: int) -> float:
        if found or self._pending or self._in_flight or not self.listening.is_set():
            return self.poll_seconds
        wanted = self.subscriptions.current()
        if wanted.tenants or wanted.everyone:
            return self.poll_seconds
        return max(self.poll_seconds, LISTENING_POLL_SECONDS)

    def _listen_forever(self) -> None:
        while not self._stopping():
            try:
                self._listen()
            except Exception as exc:  # a lost connection: the poll covers the gap
                self.listening.clear()
                if not self._stopping():
                    self._warned.warn("redis", "webhook wake listener lost Redis: %s", exc)
                self._stopped.wait(self.poll_seconds)

    def _listen(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(WAKE_CHANNEL)
            self.listening.set()
            self._warned.ended("redis")
            self._told = True
            self._wake.set()  # what was written before this subscription heard of it
            while not self._stopping():
                message = pubsub.get_message(timeout=STOP_SECONDS)
                if message is not None and message.get("type") == "message":
                    self._told = True
                    self._wake.set()
        finally:
            self.listening.clear()
            with contextlib.suppress(Exception):
                pubsub.close()

    def _publish_wake(self) -> None:
        try:
            self.client.publish(WAKE_CHANNEL, "1")
        except redis.RedisError as exc:
            log.warning("webhook deliverers not woken (they poll): %s", exc)
