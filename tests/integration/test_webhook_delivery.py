"""Webhook delivery end to end in one process: a run's state change, its outbox message, the
deliverer's fan-out, claims and attempts, and a real HTTP receiver on 127.0.0.1 whose every
request is checked with the `standardwebhooks` package (an implementation not ours).

What is held: one signed request per event and endpoint; retries of non-2xx answers, dropped
connections and timeouts on `Webhooks.Backoff`, all with one `webhook-id`; nothing more after
a 2xx; `failed` once the schedule runs out; a redelivery with the same id and bytes; both
secrets signing during a rotation's grace; destinations refused at the attempt (a name that
resolves to loopback, a private address, a redirect to one); an endpoint removed or disabled
gets nothing more; one failing for `Webhooks.DisableAfter` is disabled, with its
`webhook.disabled`; the operator's endpoint; approvals to Slack through its sink; and an idle
deliverer that looks once a minute while nobody wants anything.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
import standardwebhooks
from prometheus_client import REGISTRY

from tests import tools
from tests.fake_slack import FakeSlack
from tests.helpers import MakeRuntime, Script, ThreadWorker, scripted_agent, wait_until
from tests.webhook_receiver import Answer, Receiver
from tests.webhook_rows import delivery
from tracon_jobs.db.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookMessage
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.webhooks import deliverer as deliverer_module
from tracon_jobs.webhooks.deliveries import Claimed
from tracon_jobs.webhooks.endpoints import EndpointStore
from tracon_jobs.webhooks.sender import AttemptResult

ANSWER: Script = [{"Text": "It shipped."}]
CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]
QUICK = {
    "AllowHttp": True,
    "AllowPrivateNetworks": True,
    "PollInterval": 0.05,
    "Backoff": [0.1, 0.1, 0.1],
    "Timeout": 1,
}
SLACK_TOKEN = "xoxb-fake-0123456789-abcdefghij"
OPS_SECRET = "whsec_" + "b3BlcmF0b3Itc2VjcmV0LWZvci10ZXN0cw=="


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    tools.calls.clear()
    monkeypatch.setenv("OPS_SECRET", OPS_SECRET)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver().start()
    yield server
    server.stop()


def runtime_for(
    make_runtime: MakeRuntime, sql_url: str, script: Script = ANSWER, **webhooks: Any
) -> Runtime:
    config = scripted_agent(script, ["close_account"])
    config["Webhooks"] = {**QUICK, **webhooks}
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    runtime.deliverer.start()
    return runtime


def endpoint(
    runtime: Runtime, url: str, events: list[str], tenant: str = "acme"
) -> tuple[str, str]:
    """(endpoint id, secret), created as the API creates it, and this process told."""
    store = EndpointStore(runtime.db)
    made, secret = store.create(runtime.tenants.ensure_tenant(tenant), url, events)
    runtime.subscriptions.changed()
    return made.id, secret


def run(runtime: Runtime, tenant: str = "acme") -> str:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    run_id = runtime.runs.create(NewRun(tenant_id, "demo", {"message": "go"})).id
    runtime.executor.execute(run_id)
    return run_id


def deliveries(runtime: Runtime, target: str | None = None) -> list[WebhookDelivery]:
    query = sa.select(WebhookDelivery).order_by(WebhookDelivery.created_at)
    if target is not None:
        query = query.where(WebhookDelivery.target == target)
    with runtime.db.read() as session:
        return list(session.scalars(query))


def attempts(runtime: Runtime, delivery_id: str) -> list[WebhookAttempt]:
    with runtime.db.read() as session:
        query = sa.select(WebhookAttempt).where(WebhookAttempt.delivery_id == delivery_id)
        return list(session.scalars(query.order_by(WebhookAttempt.id)))


def settled(runtime: Runtime, target: str | None = None, count: int = 1) -> list[WebhookDelivery]:
    """The deliveries (to `target`) once `count` are no longer pending."""
    found: list[WebhookDelivery] = []

    def done() -> bool:
        nonlocal found
        found = deliveries(runtime, target)
        return sum(d.status != "pending" for d in found) >= count

    wait_until(done, timeout=15, what=f"{count} settled webhook deliveries")
    return found


def attempt_counts() -> dict[str, float]:
    """This process's `tracon_webhook_attempts_total` of endpoint targets, by outcome."""
    return {
        outcome: REGISTRY.get_sample_value(
            "tracon_webhook_attempts_total", {"target": "endpoint", "outcome": outcome}
        )
        or 0.0
        for outcome in ("delivered", "retried", "failed", "canceled")
    }


def row(runtime: Runtime, model: Any, id_: str) -> Any:
    with runtime.db.read() as session:
        return session.get(model, id_)


# -- one event, one signed request ----------------------------------------------------------


def test_a_completed_run_is_delivered_once_signed_as_the_standard_verifies_it(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    hook, secret = endpoint(runtime, receiver.url(), ["run.completed"])

    run_id = run(runtime)

    [got] = receiver.wait_for(1)
    payload = got.verified(secret)  # the reference implementation checks the signature
    assert payload["type"] == "run.completed"
    assert payload["data"]["id"] == run_id and payload["data"]["status"] == "Completed"
    [delivery] = settled(runtime, hook)
    assert delivery.status == "delivered" and delivery.attempts == 1
    assert got.webhook_id == delivery.message_id and got.webhook_id.startswith("msg_")
    assert got.headers["content-type"] == "application/json"
    assert abs(int(got.headers["webhook-timestamp"]) - time.time()) < 5
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook("whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB").verify(
            got.body, got.headers
        )
    # And nothing more comes: a 2xx ends the delivery
    time.sleep(0.5)
    assert len(receiver.received) == 1


def test_each_subscribed_endpoint_gets_its_own_delivery_and_others_none(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    first, first_secret = endpoint(runtime, receiver.url("/a"), ["run.completed"])
    second, second_secret = endpoint(runtime, receiver.url("/b"), ["run.completed", "run.failed"])
    endpoint(runtime, receiver.url("/c"), ["run.failed"])  # not this type
    endpoint(runtime, receiver.url("/d"), ["run.completed"], tenant="globex")  # another tenant

    run(runtime)

    got = receiver.wait_for(2)
    time.sleep(0.3)
    assert sorted(r.path for r in receiver.received) == ["/a", "/b"]
    by_path = {r.path: r for r in got}
    by_path["/a"].verified(first_secret)
    by_path["/b"].verified(second_secret)
    assert by_path["/a"].webhook_id == by_path["/b"].webhook_id  # one message, two deliveries
    assert by_path["/a"].body == by_path["/b"].body
    assert {d.target for d in settled(runtime, count=2)} == {first, second}


# -- retries ---------------------------------------------------------------------------------


def test_failures_are_retried_on_the_schedule_with_one_webhook_id(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url, Backoff=[0.2, 0.4, 0.2])
    hook, secret = endpoint(runtime, receiver.url(), ["run.completed"])
    receiver.answer(Answer(500, b"boom"), Answer(drop=True), Answer(503))
    before = attempt_counts()

    run(runtime)

    got = receiver.wait_for(4)
    assert len({r.webhook_id for r in got}) == 1
    assert len({r.body for r in got}) == 1
    for request in got:
        request.verified(secret)
    gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(got)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.2
    [delivery] = settled(runtime, hook)
    assert delivery.status == "delivered" and delivery.attempts == 4
    tries = attempts(runtime, delivery.id)
    assert [t.status for t in tries] == [500, None, 503, 200]
    assert tries[0].response == "boom"
    assert tries[1].error and "disconnected" in tries[1].error
    assert row(runtime, WebhookEndpoint, hook).failing_since is None  # a success clears it
    # And /metrics counts each attempt by what it made of the delivery
    after = attempt_counts()
    assert after["retried"] - before["retried"] == 3
    assert after["delivered"] - before["delivered"] == 1


def test_a_timeout_is_a_failed_attempt_retried(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url, Timeout=0.3)
    hook, _ = endpoint(runtime, receiver.url(), ["run.completed"])
    receiver.answer(Answer(delay=3.0))

    run(runtime)

    got = receiver.wait_for(2)
    assert got[0].webhook_id == got[1].webhook_id
    [delivery] = settled(runtime, hook)
    first, second = attempts(runtime, delivery.id)
    assert first.status is None and first.error and first.error.startswith("timeout")
    assert first.latency_ms < 2500  # not the receiver's 3 s
    assert second.status == 200


def test_a_delivery_whose_schedule_runs_out_is_failed(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url, Backoff=[0.05, 0.05])
    hook, _ = endpoint(runtime, receiver.url(), ["run.completed"])
    receiver.default = Answer(500)

    run(runtime)

    [delivery] = settled(runtime, hook)
    assert delivery.status == "failed" and delivery.attempts == 3  # one, then two retries
    assert delivery.last_status == 500
    time.sleep(0.4)
    assert len(receiver.received) == 3
    assert row(runtime, WebhookEndpoint, hook).failing_since is not None


def test_a_redelivery_sends_the_same_id_and_bytes_once_more(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    hook, secret = endpoint(runtime, receiver.url(), ["run.completed"])
    run(runtime)
    [first] = receiver.wait_for(1)
    [delivery] = settled(runtime, hook)
    tenant_id = runtime.tenants.ensure_tenant("acme")

    EndpointStore(runtime.db, runtime.redis).redeliver(tenant_id, hook, delivery.id)

    _, again = receiver.wait_for(2)
    again.verified(secret)
    assert again.webhook_id == first.webhook_id and again.body == first.body
    wait_until(lambda: deliveries(runtime, hook)[0].attempts == 2, timeout=10, what="recorded")
    assert deliveries(runtime, hook)[0].status == "delivered"


# -- secrets -----------------------------------------------------------------------------------


def test_during_a_rotation_both_secrets_sign_and_after_it_only_the_new(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    from datetime import timedelta

    runtime = runtime_for(make_runtime, sql_url)
    hook, old = endpoint(runtime, receiver.url(), ["run.completed"])
    tenant_id = runtime.tenants.ensure_tenant("acme")
    store = EndpointStore(runtime.db)
    _, new = store.rotate_secret(tenant_id, hook, timedelta(hours=1))

    run(runtime)
    [during] = receiver.wait_for(1)
    assert len(during.headers["webhook-signature"].split(" ")) == 2
    during.verified(old)  # a receiver that has not switched yet
    during.verified(new)  # and one that has

    _, newest = store.rotate_secret(tenant_id, hook, timedelta(0))
    run(runtime)
    _, after = receiver.wait_for(2)
    assert len(after.headers["webhook-signature"].split(" ")) == 1
    after.verified(newest)
    for stale in (old, new):
        with pytest.raises(standardwebhooks.WebhookVerificationError):
            after.verified(stale)


# -- destinations ----------------------------------------------------------------------------


def direct_endpoint(runtime: Runtime, url: str, events: list[str]) -> str:
    """An endpoint row with a URL the API would refuse now (made while it was allowed)."""
    now = runtime.db.now()
    made = WebhookEndpoint(
        id=str(uuid.uuid4()),
        tenant_id=runtime.tenants.ensure_tenant("acme"),
        url=url,
        events=events,
        secret="whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB",
        enabled=True,
        created_at=now,
        updated_at=now,
    )
    with runtime.db.write() as session:
        session.add(made)
    runtime.subscriptions.changed()
    return made.id


@pytest.mark.parametrize(
    ("host", "kind"),
    [("localhost", "loopback"), ("10.1.2.3", "private"), ("169.254.169.254", "link-local")],
)
def test_private_destinations_are_refused_at_the_attempt(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver, host: str, kind: str
) -> None:
    runtime = runtime_for(make_runtime, sql_url, AllowPrivateNetworks=False, Backoff=[])
    hook = direct_endpoint(runtime, f"http://{host}:{receiver.port}/hook", ["run.completed"])

    run(runtime)

    [delivery] = settled(runtime, hook)
    assert delivery.status == "failed"
    [tried] = attempts(runtime, delivery.id)
    assert tried.status is None
    assert tried.error and tried.error.startswith("refused destination") and kind in tried.error
    assert receiver.received == []


def test_a_redirect_is_not_followed_even_to_loopback(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url, Backoff=[])
    hook, _ = endpoint(runtime, receiver.url("/hook"), ["run.completed"])
    inner = f"http://127.0.0.1:{receiver.port}/internal"
    receiver.answer(Answer(307, b"", {"location": inner}))

    run(runtime)

    [delivery] = settled(runtime, hook)
    assert delivery.status == "failed" and delivery.last_status == 307
    assert delivery.last_error and "/internal" in delivery.last_error
    time.sleep(0.3)
    assert [r.path for r in receiver.received] == ["/hook"]  # never to where it pointed


# -- endpoints that go away ----------------------------------------------------------------


def test_a_removed_or_disabled_endpoint_gets_nothing_more(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    # the retry 2 s after the first attempt: the removal comes before it, even on a loaded
    # machine (at 0.5 s a slow test thread let the retry go, and fail, first)
    runtime = runtime_for(make_runtime, sql_url, Backoff=[2.0])
    removed, _ = endpoint(runtime, receiver.url("/removed"), ["run.completed"])
    disabled, _ = endpoint(runtime, receiver.url("/disabled"), ["run.completed"])
    receiver.default = Answer(500)
    tenant_id = runtime.tenants.ensure_tenant("acme")
    store = EndpointStore(runtime.db)

    run(runtime)
    receiver.wait_for(2)
    store.delete(tenant_id, removed)
    store.update(tenant_id, disabled, {"enabled": False})
    runtime.subscriptions.changed()

    both = settled(runtime, count=2)
    assert {d.status for d in both} == {"canceled"}
    time.sleep(2.3)  # the retry would have come by now
    assert len(receiver.received) == 2
    run(runtime)  # and a new event goes to neither
    time.sleep(0.5)
    assert len(receiver.received) == 2


def test_an_endpoint_failing_for_disable_after_is_disabled_and_the_tenant_told(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url, Backoff=[0.2] * 20, DisableAfter=0.6)
    failing, _ = endpoint(runtime, receiver.url("/failing"), ["run.completed"])
    _watcher, watcher_secret = endpoint(runtime, receiver.url("/watcher"), ["webhook.disabled"])
    receiver.default = Answer(500)
    receiver.script = []

    run(runtime)

    wait_until(
        lambda: not row(runtime, WebhookEndpoint, failing).enabled, timeout=15, what="disabled"
    )
    hook = row(runtime, WebhookEndpoint, failing)
    assert hook.disabled_reason.startswith("failing since")
    assert hook.disabled_at is not None
    [canceled] = deliveries(runtime, failing)
    assert canceled.status == "canceled"
    # And the tenant's watcher hears of it (its answers are 500 too: the first attempt counts)
    told = receiver.wait_for(1, path="/watcher")[0]
    payload = told.verified(watcher_secret)
    assert payload["type"] == "webhook.disabled"
    assert payload["data"]["id"] == failing and payload["data"]["enabled"] is False
    assert "secret" not in told.body.decode()
    # And no more attempts go to the disabled endpoint
    count = len(receiver.wait_for(1, path="/failing"))
    time.sleep(0.5)
    assert len([r for r in receiver.received if r.path == "/failing"]) == count


# -- the operator and Slack --------------------------------------------------------------------


def test_the_operators_endpoint_gets_every_tenants_events_of_its_types(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    operator = {"Url": receiver.url("/ops"), "SecretEnv": "OPS_SECRET", "Events": ["run.completed"]}
    runtime = runtime_for(make_runtime, sql_url, Operator=operator)

    run(runtime, "acme")
    run(runtime, "globex")

    got = receiver.wait_for(2, path="/ops")
    payloads = [r.verified(OPS_SECRET) for r in got]
    assert {p["type"] for p in payloads} == {"run.completed"}
    tenants = {runtime.tenants.ensure_tenant(name) for name in ("acme", "globex")}
    assert {p["data"]["tenant"] for p in payloads} == tenants
    assert {d.target for d in settled(runtime, count=2)} == {"operator"}


def test_an_operator_endpoint_with_a_bad_secret_or_url_fails_at_startup(
    make_runtime: MakeRuntime, sql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracon_jobs.errors import ConfigurationError

    monkeypatch.setenv("OPS_SECRET", "not-a-secret")
    with pytest.raises(ConfigurationError, match=r"Webhooks\.Operator\.SecretEnv"):
        make_runtime(
            sql_url,
            Webhooks={"Operator": {"Url": "https://ops.example/h", "SecretEnv": "OPS_SECRET"}},
        )
    monkeypatch.setenv("OPS_SECRET", OPS_SECRET)
    with pytest.raises(ConfigurationError, match=r"Webhooks\.Operator\.Url"):
        make_runtime(
            sql_url,
            Webhooks={"Operator": {"Url": "http://ops.example/h", "SecretEnv": "OPS_SECRET"}},
        )
    with pytest.raises(ConfigurationError, match=r"Webhooks\.Operator\.Events"):
        make_runtime(
            sql_url,
            Webhooks={
                "Operator": {
                    "Url": "https://o.example/h",
                    "SecretEnv": "OPS_SECRET",
                    "Events": ["run.exploded"],
                }
            },
        )


def test_approvals_reach_slack_and_endpoints_through_their_deliveries_with_a_link(
    make_runtime: MakeRuntime,
    sql_url: str,
    receiver: Receiver,
    thread_worker: ThreadWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given Slack configured, one-time links, and an endpoint for the approval events
    slack = FakeSlack(SLACK_TOKEN).start()
    monkeypatch.setenv("SLACK_TEST_BOT_TOKEN", SLACK_TOKEN)
    monkeypatch.setenv("SLACK_TEST_SIGNING_SECRET", "8f742231b10e8888abcd99yyyzzz85a5")
    monkeypatch.setenv("LINKS_TEST_SECRET", "k" * 32)
    try:
        config = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"])
        config["Webhooks"] = QUICK
        config["Integrations"] = {
            "Slack": {
                "BotTokenEnv": "SLACK_TEST_BOT_TOKEN",
                "SigningSecretEnv": "SLACK_TEST_SIGNING_SECRET",
                "Channel": "#approvals",
                "ApiUrl": slack.api_url,
            },
            "ApprovalLinks": {
                "SecretEnv": "LINKS_TEST_SECRET",
                "PublicUrl": "https://tracon.example/",
            },
        }
        runtime = make_runtime(sql_url, **config)
        runtime.send_runs_with(thread_worker.sender(runtime))
        runtime.deliverer.start()
        _hook, secret = endpoint(
            runtime, receiver.url(), ["approval.requested", "approval.decided"]
        )
        tenant_id = runtime.tenants.ensure_tenant("acme")

        # When a run asks for an approval, and it is decided over the API's path
        run_id = runtime.dispatcher.submit(NewRun(tenant_id, "demo", {"message": "close"})).id
        [asked] = receiver.wait_for(1)
        requested = asked.verified(secret)
        approval_id = requested["data"]["id"]
        wait_until(lambda: len(slack.calls_of("chat.postMessage")) == 1, what="posted", timeout=10)
        runtime.approvals.decide(tenant_id, approval_id, True, "fine", "alice")

        # Then the endpoint hears both, the request with its one-time link
        _, decided = receiver.wait_for(2)
        assert requested["type"] == "approval.requested"
        assert requested["data"]["status"] == "Pending" and requested["data"]["runId"] == run_id
        assert requested["data"]["links"]["decide"].startswith(
            "https://tracon.example/approvals/links/"
        )
        assert decided.verified(secret)["data"]["status"] == "Approved"
        # And Slack's message was posted once, then updated to the outcome
        wait_until(lambda: len(slack.calls_of("chat.update")) == 1, what="updated", timeout=10)
        assert len(slack.calls_of("chat.postMessage")) == 1
        slack_deliveries = settled(runtime, "slack", count=2)
        assert [d.status for d in slack_deliveries] == ["delivered", "delivered"]
    finally:
        slack.stop()


# -- what an idle deliverer costs --------------------------------------------------------------


def test_an_idle_deliverer_looks_once_a_minute_while_nobody_wants_anything(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    runtime = runtime_for(make_runtime, sql_url)
    deliverer = runtime.deliverer
    assert deliverer.listening.wait(5)
    assert deliverer._interval(0) == deliverer_module.LISTENING_POLL_SECONDS
    endpoint(runtime, receiver.url(), ["run.completed"])
    assert deliverer._interval(0) == 0.05  # someone wants something: PollInterval
    assert deliverer.look() == 0  # and a look that finds nothing writes nothing
    with runtime.db.read() as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(WebhookMessage)) == 0


def due(runtime: Runtime) -> datetime:
    """A time every claim sees as past: a second before the database's now (a claim reads the
    database clock once a minute, offset by that read's latency, so it may lag `now()` by
    milliseconds under load)."""
    return runtime.db.now() - timedelta(seconds=1)


def test_a_claim_takes_no_more_than_its_limit_and_two_claims_share_nothing(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    # Given twenty due deliveries (the deliverer not started: the claims are this test's)
    config = scripted_agent(ANSWER, ["close_account"])
    config["Webhooks"] = QUICK
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    hook, _ = endpoint(runtime, receiver.url(), ["run.completed"])
    tenant_id = runtime.tenants.ensure_tenant("acme")
    for _ in range(20):
        delivery(runtime.db, hook, tenant_id)
    with runtime.db.write() as session:  # due now (the rows' helper makes them due in an hour)
        session.execute(sa.update(WebhookDelivery).values(next_attempt_at=due(runtime)))
    store = runtime.webhook_deliveries

    # When two deliverers claim four each, then one claims the rest
    first = store.claim("one", 4)
    second = store.claim("two", 4)
    rest = store.claim("three", 100)

    # Then each took what it asked, no delivery twice, and every one once
    assert (len(first), len(second), len(rest)) == (4, 4, 12)
    ids = [c.id for c in first + second + rest]
    assert len(set(ids)) == 20
    assert store.claim("four", 4) == []  # all held


def test_a_failed_attempt_recorded_while_its_endpoint_is_removed_does_not_deadlock(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    # Given deliveries claimed by a deliverer (not started: the claims are this test's)
    config = scripted_agent(ANSWER, ["close_account"])
    config["Webhooks"] = QUICK
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    tenant_id = runtime.tenants.ensure_tenant("acme")
    store = runtime.webhook_deliveries
    endpoints = EndpointStore(runtime.db)
    failed = AttemptResult(500, 5, "HTTP 500", "")
    errors: list[BaseException] = []

    for _ in range(25):
        hook, _ = endpoint(runtime, receiver.url(), ["run.completed"])
        for _ in range(3):
            delivery(runtime.db, hook, tenant_id)
        with runtime.db.write() as session:
            session.execute(sa.update(WebhookDelivery).values(next_attempt_at=due(runtime)))
        claimed = store.claim("one", 3)
        assert len(claimed) == 3
        barrier = threading.Barrier(4)

        def record(one: Claimed, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                store.record(one, failed)
            except BaseException as exc:
                errors.append(exc)

        def remove(hook: str = hook, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                endpoints.delete(tenant_id, hook)
            except BaseException as exc:
                errors.append(exc)

        # When each failed attempt is recorded while the endpoint is being removed
        threads = [threading.Thread(target=record, args=(one,)) for one in claimed]
        threads.append(threading.Thread(target=remove))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    # Then every write went through: none was chosen as a deadlock's victim
    assert errors == []
    assert {d.status for d in deliveries(runtime)} == {"canceled"}


def test_a_success_ends_the_failure_clock_even_when_claimed_before_the_failure(
    make_runtime: MakeRuntime, sql_url: str, receiver: Receiver
) -> None:
    # Given two deliveries of one endpoint claimed together
    config = scripted_agent(ANSWER, ["close_account"])
    config["Webhooks"] = QUICK
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    tenant_id = runtime.tenants.ensure_tenant("acme")
    hook, _ = endpoint(runtime, receiver.url(), ["run.completed"])
    for _ in range(2):
        delivery(runtime.db, hook, tenant_id)
    with runtime.db.write() as session:
        session.execute(sa.update(WebhookDelivery).values(next_attempt_at=due(runtime)))
    store = runtime.webhook_deliveries
    first, second = store.claim("one", 2)

    # When the first one's attempt fails, then the second one's succeeds
    store.record(first, AttemptResult(500, 5, "HTTP 500", ""))
    assert row(runtime, WebhookEndpoint, hook).failing_since is not None
    store.record(second, AttemptResult(200, 5, None, "ok"))

    # Then the endpoint is not failing any more: its clock starts at its next failure
    assert row(runtime, WebhookEndpoint, hook).failing_since is None
