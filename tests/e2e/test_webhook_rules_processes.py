"""The rules of webhook delivery and of Slack's and the links' requests, held by real
processes: a Celery worker started by the command sends every webhook, a gunicorn web started
by the command takes every HTTP request, and receivers on 127.0.0.1 in this test's process
(`tests.webhook_receiver`, `tests.fake_slack`) record what reaches them; each delivery is
checked with the `standardwebhooks` package, an implementation not ours.

What is held:

1. A non-2xx answer and a timeout are retried on `Webhooks.Backoff` under one `webhook-id`,
   the same bytes signed anew at each attempt; a redirect is not followed, not even to
   loopback where this installation may deliver; during a rotation's grace both secrets sign,
   each signature verifying alone, and after it only the new one; an endpoint disabled over
   HTTP gets nothing more (its due retry canceled unsent, new events not fanned out to it).
2. With `Webhooks.AllowPrivateNetworks` off, loopback, 10/8, the metadata address and a name
   resolving to 127.0.0.1 are refused at every attempt, each attempt recorded with its reason,
   and nothing reaches the receiver behind them.
3. A provider's circuit that opens and closes is told to the operator's endpoint of
   configuration: `circuit.opened`, then `circuit.closed`, signed with its secret.
4. Slack's interaction route refuses a forged, a stale and a replayed request, each deciding
   nothing; a one-time link's `GET` and `HEAD` decide nothing, its `POST` decides once.

And in every one: no secret (endpoint secrets, the operator's, Slack's signing secret and bot
token, the links' key, the API key, a token in an endpoint URL's query) is in any process's log.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import standardwebhooks

from tests.e2e.cluster import Cluster, wait_for_log, wait_until
from tests.fake_slack import FakeSlack, click, signed
from tests.helpers import MakeRuntime, Script, run_of, scripted_agent
from tests.helpers import event_types as events
from tests.helpers import log_lines as lines
from tests.stub_provider import StubProvider, error, reply
from tests.webhook_receiver import Answer, Received, Receiver
from tracon_jobs.db.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookMessage
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.webhooks.addresses import Destinations
from tracon_jobs.webhooks.endpoints import EndpointStore, checked
from tracon_jobs.webhooks.signing import new_secret

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ANSWER: Script = [{"Text": "It shipped."}]
CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]
TIMEOUT_SECONDS = 2
BACKOFF_SECONDS = 1.0
QUICK = {
    "AllowHttp": True,
    "AllowPrivateNetworks": True,
    "Timeout": TIMEOUT_SECONDS,
    "PollInterval": 0.2,
    "Backoff": [BACKOFF_SECONDS] * 3,
}
GRACE_SECONDS = 4
"""A rotation's grace here: long enough for a run's delivery to be claimed within it."""
QUIET_SECONDS = 2.0
"""How long a test watches for a request that must not come (longer than a retry's wait)."""
URL_TOKEN = "url-token-" + uuid.uuid4().hex
"""A token in an endpoint URL's query, as some receivers want one: never to be logged."""


# -- receivers in this process ---------------------------------------------------------------


@pytest.fixture
def receivers() -> Iterator[Callable[[], Receiver]]:
    """`start()`: a receiver on 127.0.0.1 answering 200 (or as scripted); all stopped after."""
    started: list[Receiver] = []

    def start() -> Receiver:
        receiver = Receiver().start()
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.stop()


def verifies(request: Received, secret: str, signature: str | None = None) -> bool:
    """Whether `standardwebhooks` takes the request under `secret` (with `signature` alone in
    `webhook-signature`, when given)."""
    headers = dict(request.headers)
    if signature is not None:
        headers["webhook-signature"] = signature
    try:
        standardwebhooks.Webhook(secret).verify(request.body, headers)
    except standardwebhooks.WebhookVerificationError:
        return False
    return True


def nothing_more(receiver: Receiver, count: int) -> None:
    """The receiver got `count` requests, and none more for `QUIET_SECONDS`."""
    time.sleep(QUIET_SECONDS)
    assert len(receiver.received) == count, [(r.path, r.webhook_id) for r in receiver.received]


# -- what SQL holds --------------------------------------------------------------------------


def deliveries_to(runtime: Runtime, target: str) -> list[WebhookDelivery]:
    with runtime.db.read() as session:
        query = sa.select(WebhookDelivery).where(WebhookDelivery.target == target)
        return list(session.scalars(query.order_by(WebhookDelivery.created_at)))


def attempts_of(runtime: Runtime, delivery_id: str) -> list[WebhookAttempt]:
    with runtime.db.read() as session:
        query = sa.select(WebhookAttempt).where(WebhookAttempt.delivery_id == delivery_id)
        return list(session.scalars(query.order_by(WebhookAttempt.id)))


def settled(runtime: Runtime, target: str, count: int = 1) -> list[WebhookDelivery]:
    """The target's deliveries once `count` of them are no longer pending."""
    found: list[WebhookDelivery] = []

    def done() -> bool:
        nonlocal found
        found = deliveries_to(runtime, target)
        return sum(d.status != "pending" for d in found) >= count

    wait_until(done, timeout=30, what=f"{count} settled deliveries to {target}")
    return found


def submit(runtime: Runtime) -> str:
    """A run of `demo` for `acme`, sent to the workers through Celery."""
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "go"})).id


def ended(runtime: Runtime, run_id: str, status: str) -> None:
    wait_until(
        lambda: run_of(runtime, run_id).status == status,
        timeout=30,
        what=f"run {run_id} {status}",
    )


def no_secret_logged(cluster: Cluster, secrets: Iterable[str]) -> None:
    """None of `secrets` (nor a `whsec_` secret's key alone) is in any process's log."""
    needles = set()
    for secret in secrets:
        needles.add(secret)
        needles.add(secret.removeprefix("whsec_"))
    for child in cluster.children.children:
        text = child.text()
        assert text, f"{child.name} logged nothing: the scan would prove nothing"
        leaked = [needle[:12] + "…" for needle in needles if needle in text]
        assert leaked == [], f"{child.name} logged secrets: {leaked}"


# -- 1. retries, redirects, rotations and disabling, over HTTP to a real web -------------------


def test_retries_keep_one_webhook_id_a_rotation_signs_twice_in_its_grace_and_disabled_is_final(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    receivers: Callable[[], Receiver],
    request: pytest.FixtureRequest,
) -> None:
    # Given a worker and a web on quick webhooks (private destinations allowed here: the
    # receivers are on 127.0.0.1), and a tenant's API key
    sections = scripted_agent(ANSWER) | {"Webhooks": dict(QUICK)}
    cluster = make_cluster(sql_url, **sections)
    worker = cluster.worker("w1")
    web, base = cluster.web()
    runtime = make_runtime(sql_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    key = runtime.tenants.issue_key(tenant).secret
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    request.addfinalizer(api.close)
    hooks, redirector, loopback, off = receivers(), receivers(), receivers(), receivers()
    # And, created over HTTP, an endpoint whose receiver answers 500, then too late, then 200
    made = api.post(
        "/api/webhooks",
        json={"url": hooks.url(f"/hook?token={URL_TOKEN}"), "events": ["run.completed"]},
    )
    assert made.status_code == 201, made.text
    hook, first_secret = made.json()["id"], made.json()["secret"]
    hooks.answer(Answer(500, b"boom"), Answer(delay=TIMEOUT_SECONDS + 1.0))
    # And one whose receiver redirects every request to another receiver on loopback
    inner = loopback.url("/internal")
    redirector.default = Answer(307, b"", {"location": inner})
    made = api.post("/api/webhooks", json={"url": redirector.url(), "events": ["run.completed"]})
    assert made.status_code == 201, made.text
    redirected, redirect_secret = made.json()["id"], made.json()["secret"]

    # When a run completes
    first_run = submit(runtime)

    # Then the worker sends its message three times under one webhook-id, the same bytes
    # signed anew each time: after the 500, after the timeout, and never after the 200
    got = hooks.wait_for(3, timeout=30)
    assert len({r.webhook_id for r in got}) == 1 and len({r.body for r in got}) == 1
    assert all(verifies(r, first_secret) for r in got)
    payload = got[0].json()
    assert payload["type"] == "run.completed" and payload["data"]["id"] == first_run
    assert all(r.path == f"/hook?token={URL_TOKEN}" for r in got)
    # each retry after its wait of the schedule (the timeout's after the attempt's deadline)
    assert got[1].at - got[0].at >= BACKOFF_SECONDS - 0.05, got[1].at - got[0].at
    assert got[2].at - got[1].at >= TIMEOUT_SECONDS + BACKOFF_SECONDS - 0.05
    stamps = [int(r.headers["webhook-timestamp"]) for r in got]
    assert stamps[2] > stamps[0]
    [done] = settled(runtime, hook)
    assert (done.status, done.attempts, done.message_id) == ("delivered", 3, got[0].webhook_id)
    tries = attempts_of(runtime, done.id)
    assert [(t.status, t.error) for t in tries] == [
        (500, "HTTP 500"),
        (None, f"timeout after {float(TIMEOUT_SECONDS)} s"),
        (200, None),
    ]
    assert tries[0].response == "boom"
    assert TIMEOUT_SECONDS * 1000 - 100 <= tries[1].latency_ms < TIMEOUT_SECONDS * 1000 + 900
    # as the web shows it
    listed = api.get(f"/api/webhooks/{hook}/deliveries").json()["items"]
    assert [(d["webhookId"], d["status"], d["attemptCount"]) for d in listed] == [
        (got[0].webhook_id, "delivered", 3)
    ]
    assert [a["status"] for a in listed[0]["attempts"]] == [500, None, 200]
    # And the redirect is never followed, not even to loopback, where delivering is allowed:
    # each of its four attempts fails naming where it pointed, and its schedule runs out
    [refused] = settled(runtime, redirected)
    assert (refused.status, refused.attempts, refused.last_status) == ("failed", 4, 307)
    assert [(t.status, t.error) for t in attempts_of(runtime, refused.id)] == [
        (307, f"redirect not followed (307 to {inner})")
    ] * 4
    assert [r.path for r in redirector.received] == ["/hook"] * 4
    assert all(verifies(r, redirect_secret) for r in redirector.received)
    assert loopback.received == []
    assert api.delete(f"/api/webhooks/{redirected}").status_code == 204

    # When the endpoint's secret is rotated over HTTP with a grace, and a run completes
    rotated = api.post(f"/api/webhooks/{hook}/rotate-secret", json={"graceSeconds": GRACE_SECONDS})
    assert rotated.status_code == 200, rotated.text
    second_secret = rotated.json()["secret"]
    grace_ends = datetime.fromisoformat(rotated.json()["previousSecretExpiresAt"]).timestamp()
    submit(runtime)

    # Then its delivery carries two signatures: each verifies alone, under one secret each
    during = hooks.wait_for(4, timeout=30)[3]
    signatures = during.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2
    verified_by = {
        signature: [s for s in (first_secret, second_secret) if verifies(during, s, signature)]
        for signature in signatures
    }
    assert sorted(verified_by.values()) == sorted([[first_secret], [second_secret]])
    assert verifies(during, first_secret) and verifies(during, second_secret)

    # And when the grace has run out, the next delivery is signed by the new secret alone
    time.sleep(max(0.0, grace_ends - time.time()) + 0.5)
    submit(runtime)
    after = hooks.wait_for(5, timeout=30)[4]
    assert len(after.headers["webhook-signature"].split(" ")) == 1
    assert verifies(after, second_secret) and not verifies(after, first_secret)

    # Given another endpoint, whose receiver holds its first request, then answers 500
    made = api.post("/api/webhooks", json={"url": off.url("/off"), "events": ["run.completed"]})
    assert made.status_code == 201, made.text
    disabled, disabled_secret = made.json()["id"], made.json()["secret"]
    release = threading.Event()
    off.answer(Answer(500, hold=release))
    try:
        submit(runtime)
        [held] = off.wait_for(1, timeout=30)
        # When it is disabled over HTTP while that attempt is in flight
        patched = api.patch(f"/api/webhooks/{disabled}", json={"enabled": False})
    finally:
        release.set()
    assert patched.status_code == 200, patched.text
    assert patched.json()["enabled"] is False
    assert patched.json()["disabledReason"] == "disabled by the tenant"

    # Then the attempt in flight is recorded, and its retry is canceled without being sent
    [canceled] = settled(runtime, disabled)
    assert (canceled.status, canceled.attempts) == ("canceled", 1)
    assert canceled.last_error == "the endpoint was removed or disabled"
    assert [t.status for t in attempts_of(runtime, canceled.id)] == [500]
    assert verifies(held, disabled_secret)
    # And a new event reaches the enabled endpoint, but is not even fanned out to it
    submit(runtime)
    latest = hooks.wait_for(7, timeout=30)[6]
    nothing_more(off, 1)
    assert len(deliveries_to(runtime, disabled)) == 1
    assert latest.webhook_id not in {d.message_id for d in deliveries_to(runtime, disabled)}
    assert len(hooks.received) == 7

    # And no secret, nor the URL's token, is in the worker's or the web's log, which do tell
    # of each attempt (scheme, host and port only)
    # (each line is written once its attempt or response is done: waited for, not read once)
    wait_for_log(worker, f"webhook attempt to http://127.0.0.1:{hooks.port}: HTTP 500", timeout=10)
    wait_for_log(worker, "timeout after", timeout=10)
    wait_for_log(worker, "redirect not followed", timeout=10)
    wait_for_log(web, "PATCH /api/webhooks/", timeout=10)
    no_secret_logged(
        cluster,
        [first_secret, second_secret, redirect_secret, disabled_secret, key, URL_TOKEN],
    )


# -- 2. private destinations, refused at the attempt -----------------------------------------


def endpoint_row(runtime: Runtime, url: str) -> str:
    """An endpoint row with a URL the API refuses now (as if made while it was allowed), and
    every process told."""
    now = runtime.db.now()
    made = WebhookEndpoint(
        id=str(uuid.uuid4()),
        tenant_id=runtime.tenants.ensure_tenant("acme"),
        url=url,
        events=["run.completed"],
        secret=new_secret(),
        enabled=True,
        created_at=now,
        updated_at=now,
    )
    with runtime.db.write() as session:
        session.add(made)
    runtime.subscriptions.changed()
    return made.id


def test_private_destinations_are_refused_at_every_attempt_of_a_real_worker(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    receivers: Callable[[], Receiver],
) -> None:
    # Given a worker that may not deliver to private networks, and a receiver on loopback
    strict = {**QUICK, "AllowPrivateNetworks": False, "Backoff": [0.5]}
    sections = scripted_agent(ANSWER) | {"Webhooks": strict}
    cluster = make_cluster(sqlite_url, **sections)
    worker = cluster.worker("w1")
    runtime = make_runtime(sqlite_url, **sections)
    loopback = receivers()
    port = loopback.port
    # And endpoints on loopback, a private and the metadata address (rows: the API refuses
    # these literals), and one named `localhost`, which the API's rules accept (no DNS there)
    named = f"http://localhost:{port}/name?token={URL_TOKEN}"
    checked({"url": named, "events": ["run.completed"]}, Destinations(True, False), creating=True)
    store = EndpointStore(runtime.db, runtime.redis)
    name_hook, name_secret = store.create(
        runtime.tenants.ensure_tenant("acme"), named, ["run.completed"]
    )
    expected = {
        endpoint_row(runtime, f"http://127.0.0.1:{port}/loopback?token={URL_TOKEN}"): (
            "127.0.0.1 is a loopback address"
        ),
        endpoint_row(runtime, f"http://10.1.2.3:{port}/private?token={URL_TOKEN}"): (
            "10.1.2.3 is a private address"
        ),
        endpoint_row(runtime, f"http://169.254.169.254:{port}/latest/meta-data/?t={URL_TOKEN}"): (
            "169.254.169.254 is a link-local address"
        ),
        name_hook.id: "localhost resolves to 127.0.0.1, a loopback address",
    }

    # When a run completes
    run_id = submit(runtime)
    ended(runtime, run_id, "Completed")

    # Then each delivery fails at both its attempts, each recorded with the refusal and no
    # answer, none having waited for a connection (refused before any connect)
    for hook, reason in expected.items():
        [delivery] = settled(runtime, hook)
        assert (delivery.status, delivery.attempts) == ("failed", 2), hook
        tries = attempts_of(runtime, delivery.id)
        assert [(t.status, t.error) for t in tries] == [
            (None, f"refused destination: {reason}")
        ] * 2
        assert all(t.latency_ms < 1000 for t in tries), [t.latency_ms for t in tries]
        assert delivery.last_error == f"refused destination: {reason}"
    # And nothing reached the receiver behind those addresses
    nothing_more(loopback, 0)
    # And the worker's log tells of each refusal, by host and port only, with no secret
    for host in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "localhost"):
        wait_for_log(
            worker, f"webhook attempt to http://{host}:{port}: refused destination", timeout=10
        )
    no_secret_logged(cluster, [name_secret, URL_TOKEN])


# -- 3. circuits, told to the operator's endpoint ------------------------------------------------


def test_a_circuit_that_opens_and_closes_is_told_to_the_operators_endpoint_signed(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    receivers: Callable[[], Receiver],
) -> None:
    # Given an agent on a provider whose circuit opens at its first failure, for 2 s, and the
    # operator's endpoint in configuration, its secret in the worker's environment
    ops = receivers()
    secret = new_secret()
    sections = scripted_agent([]) | {
        "Providers": {
            "a": {"Kind": "openai", "BaseUrl": stub_provider.base_url, "TimeoutSeconds": 30}
        },
        "CircuitBreaker": {"FailureThreshold": 1, "BreakDuration": "00:00:02"},
    }
    sections["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    operator = {"Url": ops.url("/ops"), "SecretEnv": "OPS_E2E_SECRET"}
    cluster = make_cluster(sqlite_url, **sections, Webhooks={**QUICK, "Operator": operator})
    cluster.env["OPS_E2E_SECRET"] = secret
    worker = cluster.worker("w1")
    # (this process has no operator's endpoint: it moves no circuit entry into the outbox)
    runtime = make_runtime(sqlite_url, **sections, Webhooks=dict(QUICK))
    assert runtime.circuit_events is None
    stub_provider.enqueue(error(500))
    stub_provider.default = reply("ok")

    # When a run's provider call fails
    failed = submit(runtime)
    ended(runtime, failed, "Failed")

    # Then the operator's endpoint is told the circuit opened, signed with its secret
    [opened] = ops.wait_for(1, timeout=30)
    assert opened.path == "/ops"
    payload = opened.verified(secret)
    assert payload["type"] == "circuit.opened"
    assert payload["data"]["provider"] == "a" and payload["data"]["state"] == "open"
    assert payload["data"]["consecutiveFailures"] == 1
    assert 0 < payload["data"]["retryAfter"] <= 2
    assert not verifies(opened, new_secret())

    # When the break is over and a run's call, the probe, succeeds
    wait_until(
        lambda: runtime.breaker.snapshot("a").state == "half_open",
        timeout=10,
        what="the break to end",
    )
    probe = submit(runtime)
    ended(runtime, probe, "Completed")

    # Then it is told the circuit closed, a message of its own, signed likewise
    closed = ops.wait_for(2, timeout=30)[1]
    again = closed.verified(secret)
    assert again["type"] == "circuit.closed" and again["data"]["state"] == "closed"
    assert again["data"]["provider"] == "a" and again["data"]["retryAfter"] is None
    assert closed.webhook_id != opened.webhook_id
    # And each was one message, delivered at its first attempt, nothing sent twice
    with runtime.db.read() as session:
        sent = session.scalars(sa.select(WebhookMessage).order_by(WebhookMessage.created_at))
        assert [(m.id, m.type, m.tenant_id) for m in sent] == [
            (opened.webhook_id, "circuit.opened", None),
            (closed.webhook_id, "circuit.closed", None),
        ]
    delivered = settled(runtime, "operator", count=2)
    assert [(d.status, d.attempts) for d in delivered] == [("delivered", 1)] * 2
    nothing_more(ops, 2)
    assert len(stub_provider.requests) == 2
    # And the worker's log tells of both attempts, without the operator's secret
    attempt = f"webhook attempt to http://127.0.0.1:{ops.port}: HTTP 200"
    wait_until(lambda: worker.text().count(attempt) >= 2, timeout=10, what="two attempts logged")
    assert worker.text().count(attempt) == 2
    no_secret_logged(cluster, [secret])


# -- 4. Slack's requests and one-time links, over HTTP to a real web ---------------------------

TOKEN = "xoxb-e2e-rules-0123456789-abcdefghij"
SIGNING_SECRET = "e2e-rules-signing-secret-0123456789ab"
LINKS_KEY = "e2e-rules-links-key-" + "0123456789abcdef"
PUBLIC = "https://tracon.example.com"
INTERACTIONS = "/integrations/slack/interactions"


@pytest.fixture
def fake_slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(TOKEN).start()
    yield fake
    fake.stop()


def one_pending(runtime: Runtime, run_id: str) -> str:
    ended(runtime, run_id, "Waiting")
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    return approval_id


def status_of(runtime: Runtime, approval_id: str) -> tuple[str, str | None]:
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None
    return approval.status, approval.decided_by


def test_slack_refuses_forged_stale_and_replayed_requests_and_a_link_decides_only_on_post(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
    fake_slack: FakeSlack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker and a web with a Slack app (its API faked here) and one-time links
    env = {
        "SLACK_E2E_BOT_TOKEN": TOKEN,
        "SLACK_E2E_SIGNING_SECRET": SIGNING_SECRET,
        "LINKS_E2E_KEY": LINKS_KEY,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    integrations = {
        "Slack": {
            "BotTokenEnv": "SLACK_E2E_BOT_TOKEN",
            "SigningSecretEnv": "SLACK_E2E_SIGNING_SECRET",
            "Channel": "#approvals",
            "ApiUrl": fake_slack.api_url,
        },
        "ApprovalLinks": {"SecretEnv": "LINKS_E2E_KEY", "PublicUrl": PUBLIC},
    }
    sections = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"]) | {"Integrations": integrations}
    cluster = make_cluster(sqlite_url, **sections)
    cluster.env.update(env)
    cluster.worker("w1")
    web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)
    # And two runs waiting for their approvals, each posted to Slack by the worker
    by_slack, by_link = submit(runtime), submit(runtime)
    slack_approval = one_pending(runtime, by_slack)
    link_approval = one_pending(runtime, by_link)
    wait_until(lambda: len(fake_slack.calls_of("chat.postMessage")) == 2, timeout=30, what="posts")

    with httpx.Client(base_url=base, timeout=10) as client:

        def post(body: bytes, headers: dict[str, str]) -> httpx.Response:
            return client.post(INTERACTIONS, content=body, headers=headers)

        # When Slack's route gets a click signed with another secret, and one signed five
        # minutes and more ago (its signature genuine for that time)
        body = click(slack_approval, user="U0MALLORY", serial=1)
        forged = post(body, signed("another-signing-secret-0123456789abc", body))
        body = click(slack_approval, user="U0MALLORY", serial=2)
        stale = post(body, signed(SIGNING_SECRET, body, timestamp=int(time.time()) - 6 * 60))

        # Then each is refused, saying why, and decides nothing, nor talks to Slack
        assert (forged.status_code, stale.status_code) == (401, 401)
        assert "X-Slack-Signature: does not match" in forged.json()["detail"]
        assert "X-Slack-Request-Timestamp: more than 300 seconds" in stale.json()["detail"]
        assert status_of(runtime, slack_approval) == ("Pending", None)
        assert run_of(runtime, by_slack).status == "Waiting"
        assert [call.method for call in fake_slack.calls] == ["chat.postMessage"] * 2

        # When a genuine click is accepted, and then replayed byte for byte
        body = click(slack_approval, user="U0ALICE", serial=3)
        headers = signed(SIGNING_SECRET, body)
        accepted = post(body, headers)
        assert accepted.status_code == 200
        wait_until(lambda: len(fake_slack.calls_of("chat.update")) == 1, timeout=15, what="update")
        replayed = post(body, headers)

        # Then the first decided, once; the replay is refused and decides nothing (a click
        # taken on a decided approval would have sent its clicker a note)
        assert replayed.status_code == 401
        assert "already received" in replayed.json()["detail"]
        assert status_of(runtime, slack_approval) == ("Approved", "slack:U0ALICE")
        ended(runtime, by_slack, "Completed")
        assert events(runtime, by_slack).count("ApprovalDecided") == 1
        time.sleep(1.0)
        assert fake_slack.calls_of("chat.postEphemeral") == []
        assert len(fake_slack.calls_of("chat.update")) == 1
        assert len(lines(flags, "close_account")) == 1

        # When the other approval's one-time link is opened twice and asked for its headers
        assert runtime.approval_links is not None
        approval = runtime.approval_store.get(link_approval)
        assert approval is not None
        link = runtime.approval_links.links(approval)["decide"].removeprefix(PUBLIC)
        opened = [client.get(link) for _ in range(2)]
        head = client.head(link)

        # Then each shows the form, and nothing is decided
        assert [page.status_code for page in opened] == [200, 200] and head.status_code == 200
        assert '<form method="post">' in opened[0].text and by_link in opened[0].text
        assert head.content == b""
        assert status_of(runtime, link_approval) == ("Pending", None)
        assert run_of(runtime, by_link).status == "Waiting"
        assert events(runtime, by_link).count("ApprovalDecided") == 0

        # When the form is posted, and then posted again with the other answer
        decided = client.post(link, data={"decision": "approve"})
        again = client.post(link, data={"decision": "reject"})

        # Then the first decides and the run goes on; the second changes nothing
        assert decided.status_code == 200 and "The run goes on" in decided.text
        assert again.status_code == 409 and "Your answer changed nothing" in again.text
        assert status_of(runtime, link_approval) == ("Approved", "link")
        ended(runtime, by_link, "Completed")
        assert events(runtime, by_link).count("ApprovalDecided") == 1
        assert len(lines(flags, "close_account")) == 2
        assert "Already approved" in client.get(link).text

    # And neither the signing secret, the bot token, the links' key nor a link's token is
    # in any log: the access log shows the link's path redacted
    wait_for_log(web, f"POST {INTERACTIONS}", timeout=10)
    wait_for_log(web, "/approvals/links/<redacted>", timeout=10)
    no_secret_logged(cluster, [SIGNING_SECRET, TOKEN, LINKS_KEY, link.rpartition("/")[2]])
