"""The webhook endpoint store on SQLite and PostgreSQL: creation with a secret returned once,
pages, changes (disabling and enabling again), removal (pending deliveries canceled, history
kept), secret rotation with its grace on the database clock, deliveries with their attempts,
redelivery, tenants kept apart, the notices to the other processes, concurrent rotations
taking turns, and the rules every surface holds a body to."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.helpers import MakeRuntime
from tests.webhook_rows import Tried, delivery, delivery_row, heard, subscribed
from tracon_jobs.db.models import WebhookAttempt
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.runtime import Runtime
from tracon_jobs.webhooks.addresses import Destinations
from tracon_jobs.webhooks.endpoints import (
    DISABLED_BY_TENANT,
    DeliveryNotFound,
    EndpointDisabled,
    EndpointNotFound,
    EndpointStore,
    InvalidEndpoint,
    checked,
    delivery_json,
    endpoint_json,
    with_secret,
)
from tracon_jobs.webhooks.events import CHANGED_CHANNEL, TENANT_EVENTS, WAKE_CHANNEL

URL = "https://hooks.example.com/tracon"
CLOCK_SLACK = timedelta(seconds=2)
"""How far apart two reads of the database clock around one call may be on a busy machine."""


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sql_url: str) -> Runtime:
    return make_runtime(sql_url)


@pytest.fixture
def store(runtime: Runtime, redis_client: redis.Redis) -> EndpointStore:
    return EndpointStore(runtime.db, redis_client)


@pytest.fixture
def acme(runtime: Runtime) -> str:
    return runtime.tenants.ensure_tenant("acme")


@pytest.fixture
def globex(runtime: Runtime) -> str:
    return runtime.tenants.ensure_tenant("globex")


def between(runtime: Runtime, moment: datetime | None, start: datetime) -> bool:
    """Whether `moment` is a database-clock time from `start` to now."""
    return moment is not None and start - CLOCK_SLACK <= moment <= runtime.db.now() + CLOCK_SLACK


# -- endpoints -----------------------------------------------------------------------------


def test_create_returns_the_secret_once_and_the_json_never_holds_it(
    store: EndpointStore, runtime: Runtime, acme: str
) -> None:
    start = runtime.db.now()
    endpoint, secret = store.create(acme, URL, ["run.completed", "run.failed"], "billing")

    assert secret.startswith("whsec_") and endpoint.secret == secret
    assert between(runtime, endpoint.created_at, start)
    shown = endpoint_json(endpoint)
    assert shown == {
        "id": endpoint.id,
        "url": URL,
        "events": ["run.completed", "run.failed"],
        "description": "billing",
        "enabled": True,
        "disabledAt": None,
        "disabledReason": None,
        "failingSince": None,
        "previousSecretExpiresAt": None,
        "createdAt": shown["createdAt"],
        "updatedAt": shown["createdAt"],
    }
    assert secret not in json.dumps(shown) and "whsec_" not in json.dumps(shown)
    assert with_secret(endpoint, secret) == {**shown, "secret": secret}
    read = store.get(acme, endpoint.id)
    assert read is not None and endpoint_json(read) == shown and read.secret == secret
    _, other_secret = store.create(acme, URL, ["run.failed"])
    assert other_secret != secret


def test_another_tenants_endpoint_is_not_found_anywhere(
    store: EndpointStore, runtime: Runtime, acme: str, globex: str
) -> None:
    endpoint, secret = store.create(acme, URL, ["run.completed"])
    delivery_id, _ = delivery(runtime.db, endpoint.id, acme, status="failed")

    assert store.get(globex, endpoint.id) is None
    assert store.page(globex, 10) == []
    calls = [
        lambda: store.update(globex, endpoint.id, {"enabled": False}),
        lambda: store.delete(globex, endpoint.id),
        lambda: store.rotate_secret(globex, endpoint.id, timedelta(hours=1)),
        lambda: store.deliveries(globex, endpoint.id, 10),
        lambda: store.delivery(globex, endpoint.id, delivery_id),
        lambda: store.redeliver(globex, endpoint.id, delivery_id),
    ]
    for call in calls:
        with pytest.raises(EndpointNotFound):
            call()
    kept = store.get(acme, endpoint.id)
    assert kept is not None and kept.enabled and kept.secret == secret
    assert delivery_row(runtime.db, delivery_id).status == "failed"


def test_pages_go_newest_first_by_the_cursor_of_the_last_row(
    store: EndpointStore, acme: str, globex: str
) -> None:
    made = [store.create(acme, f"{URL}/{n}", ["run.completed"])[0] for n in range(5)]
    store.create(globex, URL, ["run.completed"])

    first = store.page(acme, 2)
    second = store.page(acme, 2, (first[-1].created_at, first[-1].id))
    rest = store.page(acme, 10, (second[-1].created_at, second[-1].id))

    listed = [e.id for e in first + second + rest]
    expected = [e.id for e in sorted(made, key=lambda e: (e.created_at, e.id), reverse=True)]
    assert listed == expected and len(listed) == 5


def test_update_changes_only_the_fields_given(store: EndpointStore, acme: str) -> None:
    endpoint, _ = store.create(acme, URL, ["run.completed"], "old")

    changed = store.update(acme, endpoint.id, {"url": URL + "/v2", "events": ["run.failed"]})
    assert (changed.url, changed.events, changed.description) == (
        URL + "/v2",
        ["run.failed"],
        "old",
    )
    cleared = store.update(acme, endpoint.id, {"description": None})
    assert cleared.description is None and cleared.url == URL + "/v2"
    assert cleared.updated_at >= endpoint.updated_at


def test_disable_then_enable_clears_the_disabling_and_the_failure_clock(
    store: EndpointStore, runtime: Runtime, acme: str
) -> None:
    endpoint, _ = store.create(acme, URL, ["run.completed"])
    start = runtime.db.now()
    disabled = store.update(acme, endpoint.id, {"enabled": False})
    assert not disabled.enabled and disabled.disabled_reason == DISABLED_BY_TENANT
    assert between(runtime, disabled.disabled_at, start)

    # Given: the deliverer had seen it failing and disabled it with its own reason
    set_columns(runtime, endpoint.id, failing_since=start, disabled_reason="failing for 5 days")
    again = store.update(acme, endpoint.id, {"enabled": False})
    assert again.disabled_reason == "failing for 5 days"  # disabling twice keeps the first

    enabled = store.update(acme, endpoint.id, {"enabled": True})
    assert enabled.enabled
    assert (enabled.disabled_at, enabled.disabled_reason, enabled.failing_since) == (None,) * 3


def test_enabling_an_enabled_endpoint_keeps_its_failure_clock(
    store: EndpointStore, runtime: Runtime, acme: str
) -> None:
    endpoint, _ = store.create(acme, URL, ["run.completed"])
    since = runtime.db.now() - timedelta(days=2)
    set_columns(runtime, endpoint.id, failing_since=since)

    kept = store.update(acme, endpoint.id, {"enabled": True, "description": "x"})

    assert kept.failing_since == since and kept.description == "x"


def set_columns(runtime: Runtime, endpoint_id: str, **values: Any) -> None:
    """What the deliverer writes of an endpoint (its failure clock, its disabling)."""
    from sqlalchemy import update

    from tracon_jobs.webhooks.endpoints import ENDPOINTS

    with runtime.db.write() as session:
        session.execute(update(ENDPOINTS).where(ENDPOINTS.c.id == endpoint_id).values(**values))


def test_delete_cancels_pending_deliveries_and_keeps_the_history(
    store: EndpointStore, runtime: Runtime, acme: str
) -> None:
    endpoint, _ = store.create(acme, URL, ["run.completed"])
    other, _ = store.create(acme, URL, ["run.completed"])
    waiting, _ = delivery(runtime.db, endpoint.id, acme, tried=(Tried(500),))
    in_flight, _ = delivery(runtime.db, endpoint.id, acme, claimed_by="worker-1/abc")
    done, _ = delivery(runtime.db, endpoint.id, acme, status="delivered", tried=(Tried(200),))
    elsewhere, _ = delivery(runtime.db, other.id, acme)

    assert store.delete(acme, endpoint.id) == 2

    assert store.get(acme, endpoint.id) is None
    for delivery_id in (waiting, in_flight):
        row = delivery_row(runtime.db, delivery_id)
        assert (row.status, row.claimed_by, row.claim_until) == ("canceled", None, None)
    assert delivery_row(runtime.db, done).status == "delivered"
    assert delivery_row(runtime.db, elsewhere).status == "pending"
    with pytest.raises(EndpointNotFound):
        store.deliveries(acme, endpoint.id, 10)
    with pytest.raises(EndpointNotFound):
        store.delete(acme, endpoint.id)
    # the attempt that was in flight still records itself: nothing it points at is gone
    with runtime.db.write() as session:
        session.add(
            WebhookAttempt(
                delivery_id=in_flight, attempted_at=runtime.db.now(), status=200, latency_ms=5
            )
        )
    with runtime.db.read() as session:
        assert session.query(WebhookAttempt).filter_by(delivery_id=done).count() == 1


def test_rotation_keeps_the_previous_secret_for_the_grace_on_the_database_clock(
    store: EndpointStore, runtime: Runtime, acme: str
) -> None:
    endpoint, first = store.create(acme, URL, ["run.completed"])
    start = runtime.db.now()

    rotated, second = store.rotate_secret(acme, endpoint.id, timedelta(hours=24))

    assert second.startswith("whsec_") and second != first
    assert (rotated.secret, rotated.previous_secret) == (second, first)
    until = rotated.previous_secret_until
    assert until is not None and between(runtime, until - timedelta(hours=24), start)
    assert endpoint_json(rotated)["previousSecretExpiresAt"] is not None
    assert first not in json.dumps(endpoint_json(rotated))

    again, third = store.rotate_secret(acme, endpoint.id, timedelta(hours=1))
    assert (again.secret, again.previous_secret) == (third, second)  # the oldest is dropped

    cut, fourth = store.rotate_secret(acme, endpoint.id, timedelta(0))
    assert (cut.secret, cut.previous_secret, cut.previous_secret_until) == (fourth, None, None)
    stored = store.get(acme, endpoint.id)
    assert stored is not None and stored.secret == fourth


def test_concurrent_rotations_take_turns(store: EndpointStore, acme: str) -> None:
    """Each rotation replaces the secret the one before it made: the secrets form one chain,
    none is lost between two rotations that read the row at once."""
    endpoint, first = store.create(acme, URL, ["run.completed"])
    results: list[tuple[str | None, str]] = []
    lock = threading.Lock()
    gate = threading.Barrier(8)

    def rotate() -> None:
        gate.wait()
        rotated, secret = store.rotate_secret(acme, endpoint.id, timedelta(hours=1))
        with lock:
            results.append((rotated.previous_secret, secret))

    threads = [threading.Thread(target=rotate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert len(results) == 8
    replaced = {previous: secret for previous, secret in results}
    assert len(replaced) == 8, "two rotations replaced the same secret"
    chain, current = [first], first
    while current in replaced:
        current = replaced[current]
        chain.append(current)
    assert len(chain) == 9
    final = store.get(acme, endpoint.id)
    assert final is not None and final.secret == chain[-1] and final.previous_secret == chain[-2]


# -- deliveries ----------------------------------------------------------------------------


def test_deliveries_come_with_their_type_webhook_id_and_attempts(
    store: EndpointStore, runtime: Runtime, acme: str
) -> None:
    endpoint, _ = store.create(acme, URL, ["run.completed", "run.failed"])
    other, _ = store.create(acme, URL, ["run.completed"])
    now = runtime.db.now()
    tried = (
        Tried(None, 10_000, "timed out after 10.0 s"),
        Tried(503, 40, "HTTP 503", "busy"),
        Tried(200, 31, None, "ok"),
    )
    old, old_message = delivery(
        runtime.db, endpoint.id, acme, status="delivered", tried=tried, created_at=now
    )
    new, _ = delivery(
        runtime.db,
        endpoint.id,
        acme,
        type_="run.failed",
        tried=(Tried(500, 8, "HTTP 500"),),
        created_at=now + timedelta(seconds=5),
    )
    delivery(runtime.db, other.id, acme)

    found = store.deliveries(acme, endpoint.id, 10)

    assert [d.row.id for d in found] == [new, old]
    shown = delivery_json(found[1])
    assert shown["webhookId"] == old_message and shown["type"] == "run.completed"
    assert (shown["status"], shown["attemptCount"], shown["nextAttemptAt"]) == (
        "delivered",
        3,
        None,
    )
    assert [
        (a["status"], a["latencyMs"], a["error"], a["response"]) for a in shown["attempts"]
    ] == [
        (None, 10_000, "timed out after 10.0 s", ""),
        (503, 40, "HTTP 503", "busy"),
        (200, 31, None, "ok"),
    ]
    assert shown["attempts"][0]["at"] < shown["attempts"][2]["at"]
    pending = delivery_json(found[0])
    assert pending["status"] == "pending" and pending["nextAttemptAt"] is not None
    assert [d.row.id for d in store.deliveries(acme, endpoint.id, 10, status="delivered")] == [old]
    page = store.deliveries(acme, endpoint.id, 1)
    after = store.deliveries(acme, endpoint.id, 10, (page[0].row.created_at, page[0].row.id))
    assert [d.row.id for d in page + after] == [new, old]


def test_redeliver_makes_any_delivery_pending_and_due_now_and_wakes_the_deliverers(
    store: EndpointStore, runtime: Runtime, redis_client: redis.Redis, acme: str
) -> None:
    endpoint, _ = store.create(acme, URL, ["run.completed"])
    failed, _ = delivery(runtime.db, endpoint.id, acme, status="failed", tried=(Tried(500),) * 8)
    done, _ = delivery(runtime.db, endpoint.id, acme, status="delivered", tried=(Tried(200),))
    claimed, _ = delivery(runtime.db, endpoint.id, acme, claimed_by="worker-1/abc")
    listener = subscribed(redis_client, WAKE_CHANNEL)
    start = runtime.db.now()

    for delivery_id, attempts in ((failed, 8), (done, 1), (claimed, 0)):
        again = store.redeliver(acme, endpoint.id, delivery_id)
        row = delivery_row(runtime.db, delivery_id)
        assert (row.status, row.claimed_by, row.claim_until) == ("pending", None, None)
        assert row.attempts == attempts and between(runtime, row.next_attempt_at, start)
        assert again.row.status == "pending" and len(again.attempts) == attempts

    assert heard(listener, 3) == [WAKE_CHANNEL] * 3


def test_redeliver_refuses_a_disabled_endpoint_and_another_endpoints_delivery(
    store: EndpointStore, runtime: Runtime, acme: str
) -> None:
    endpoint, _ = store.create(acme, URL, ["run.completed"])
    other, _ = store.create(acme, URL, ["run.completed"])
    theirs, _ = delivery(runtime.db, other.id, acme, status="failed")
    mine, _ = delivery(runtime.db, endpoint.id, acme, status="failed")

    with pytest.raises(DeliveryNotFound):
        store.redeliver(acme, endpoint.id, theirs)
    with pytest.raises(DeliveryNotFound):
        store.delivery(acme, endpoint.id, theirs)
    store.update(acme, endpoint.id, {"enabled": False})
    with pytest.raises(EndpointDisabled):
        store.redeliver(acme, endpoint.id, mine)
    assert delivery_row(runtime.db, theirs).status == "failed"
    assert delivery_row(runtime.db, mine).status == "failed"


# -- notices -------------------------------------------------------------------------------


def test_every_change_tells_the_other_processes(
    store: EndpointStore, redis_client: redis.Redis, acme: str, globex: str
) -> None:
    listener = subscribed(redis_client, CHANGED_CHANNEL, WAKE_CHANNEL)

    endpoint, _ = store.create(acme, URL, ["run.completed"])
    store.update(acme, endpoint.id, {"events": ["run.failed"]})
    store.rotate_secret(acme, endpoint.id, timedelta(hours=1))
    store.page(acme, 10)
    store.get(acme, endpoint.id)
    store.deliveries(acme, endpoint.id, 10)
    with pytest.raises(EndpointNotFound):
        store.delete(globex, endpoint.id)  # nothing changed: nothing told
    store.delete(acme, endpoint.id)

    assert heard(listener, 4) == [CHANGED_CHANNEL] * 4


def test_a_redis_that_does_not_answer_fails_no_change(
    runtime: Runtime, acme: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The notice is for promptness only (the processes poll SQL): its loss is logged."""
    gone = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    store = EndpointStore(runtime.db, gone)

    endpoint, _ = store.create(acme, URL, ["run.completed"])
    failed, _ = delivery(runtime.db, endpoint.id, acme, status="failed")
    store.redeliver(acme, endpoint.id, failed)
    store.delete(acme, endpoint.id)

    assert store.get(acme, endpoint.id) is None
    warned = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
    assert len(warned) == 3 and CHANGED_CHANNEL in warned[0] and WAKE_CHANNEL in warned[1]


# -- the rules of a body -------------------------------------------------------------------

OPEN = Destinations(allow_http=True, allow_private_networks=True)
STRICT = Destinations()


@pytest.mark.parametrize(
    ("body", "policy", "field", "rule"),
    [
        ([], STRICT, "body", "must be a JSON object"),
        ({"events": ["run.completed"]}, STRICT, "url", "is required"),
        ({"url": URL}, STRICT, "events", "is required"),
        ({"url": URL, "events": ["run.completed"], "secret": "x"}, STRICT, "secret", "not a field"),
        ({"url": 5, "events": ["run.completed"]}, STRICT, "url", "must be a string"),
        ({"url": "http://h.example", "events": ["run.failed"]}, STRICT, "url", "https"),
        ({"url": "https://10.0.0.1/", "events": ["run.failed"]}, STRICT, "url", "private"),
        ({"url": "https://u:p@h.example/", "events": ["run.failed"]}, OPEN, "url", "credentials"),
        ({"url": "ftp://h.example/", "events": ["run.failed"]}, OPEN, "url", "http or https"),
        ({"url": URL, "events": "run.completed"}, STRICT, "events", "must be a list"),
        ({"url": URL, "events": []}, STRICT, "events", "at least one"),
        ({"url": URL, "events": ["run.completed", 3]}, STRICT, "events[1]", "must be a string"),
        (
            {"url": URL, "events": ["run.failed", "run.completed", "run.exploded"]},
            STRICT,
            "events[2]",
            "'run.exploded' is not an event type; one of run.completed",
        ),
        ({"url": URL, "events": ["circuit.opened"]}, STRICT, "events[0]", "not an event type"),
        (
            {"url": URL, "events": ["run.failed", "run.failed"]},
            STRICT,
            "events[1]",
            "'run.failed' is listed twice",
        ),
        (
            {"url": URL, "events": ["run.failed"], "description": "x" * 1001},
            STRICT,
            "description",
            "at most 1000 characters",
        ),
        ({"url": URL, "events": ["run.failed"], "description": 1}, STRICT, "description", "string"),
        ({"url": URL, "events": ["run.failed"], "enabled": True}, STRICT, "enabled", "not a field"),
    ],
)
def test_a_creation_is_held_to_the_rules(
    body: Any, policy: Destinations, field: str, rule: str
) -> None:
    with pytest.raises(InvalidEndpoint) as refused:
        checked(body, policy, creating=True)
    assert refused.value.field == field and rule in refused.value.rule, refused.value
    assert str(refused.value).startswith(f"{field}: ")


def test_an_unknown_event_type_lists_the_allowed_ones() -> None:
    with pytest.raises(InvalidEndpoint) as refused:
        checked({"url": URL, "events": ["nope"]}, STRICT, creating=True)
    assert refused.value.allowed == list(TENANT_EVENTS)


def test_what_the_rules_accept() -> None:
    every = list(TENANT_EVENTS)
    assert checked({"url": URL, "events": every}, STRICT, creating=True) == {
        "url": URL,
        "events": every,
    }
    local = {"url": "http://127.0.0.1:9000/hook", "events": ["run.failed"], "description": None}
    assert checked(local, OPEN, creating=True) == local
    change = {"enabled": False, "description": "x" * 1000}
    assert checked(change, STRICT, creating=False) == change
    for empty in ({}, {"enabled": "yes"}):
        with pytest.raises(InvalidEndpoint) as refused:
            checked(empty, STRICT, creating=False)
        assert refused.value.field in {"body", "enabled"}
