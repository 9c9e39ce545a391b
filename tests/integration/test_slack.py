"""Approvals in Slack, through the real Flask app, real SQL and Redis, and the official
`slack_sdk` talking HTTP to a fake of Slack's Web API (`tests/fake_slack.py`).

Runs are executed by the real executor on a thread standing in for a worker. The deliveries
are made by calling the sink as the webhook deliverer does (`deliver(message_id, type,
body)`), with the body the outbox renders (`{"type", "timestamp", "data"}`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import update
from werkzeug.test import TestResponse

from tests.fake_slack import FakeSlack, channel_id, click, signed
from tests.helpers import MakeRuntime, Script, ThreadWorker, scripted_agent, wait_until
from tracon_jobs.coordination.leases import MemoryLeaseStore
from tracon_jobs.db.models import Approval, SlackMessage
from tracon_jobs.integrations.slack import SlackApprovals
from tracon_jobs.integrations.slack_requests import (
    RequestRefused,
    SlackRequests,
    signature,
    verify,
)
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runs.views import approval_json
from tracon_jobs.runtime import Runtime
from web import create_app

TOKEN = "xoxb-fake-0123456789-abcdefghij"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-<1>&"}}]},
    {"Text": "Done."},
]


@pytest.fixture
def fake_slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(TOKEN).start()
    yield fake
    fake.stop()


def slack_section(fake: FakeSlack, **more: Any) -> dict[str, Any]:
    return {
        "Slack": {
            "BotTokenEnv": "SLACK_TEST_BOT_TOKEN",
            "SigningSecretEnv": "SLACK_TEST_SIGNING_SECRET",
            "Channel": "#approvals",
            "ApiUrl": fake.api_url,
            "Users": {"U0ALICE": "alice@example.com"},
            **more,
        }
    }


@pytest.fixture
def make_slack_runtime(
    make_runtime: MakeRuntime,
    sql_url: str,
    thread_worker: ThreadWorker,
    fake_slack: FakeSlack,
    monkeypatch: pytest.MonkeyPatch,
) -> Any:
    monkeypatch.setenv("SLACK_TEST_BOT_TOKEN", TOKEN)
    monkeypatch.setenv("SLACK_TEST_SIGNING_SECRET", SECRET)

    def make(**slack: Any) -> Runtime:
        sections = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"])
        rt = make_runtime(sql_url, Integrations=slack_section(fake_slack, **slack), **sections)
        rt.send_runs_with(thread_worker.sender(rt))
        return rt

    return make


@pytest.fixture
def runtime(make_slack_runtime: Any) -> Runtime:
    rt: Runtime = make_slack_runtime()
    return rt


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    return create_app(runtime, {"TESTING": True}).test_client()


@pytest.fixture
def slack(runtime: Runtime) -> SlackApprovals:
    assert runtime.slack is not None
    return runtime.slack


def waiting_approval(runtime: Runtime, tenant: str = "acme", agent: str = "demo") -> str:
    """A run of `agent` for `tenant`, once it waits for its one approval: the approval's id."""
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    run_id = runtime.dispatcher.submit(NewRun(tenant_id, agent, {"message": "close it"})).id
    wait_until(
        lambda: bool(runtime.approval_store.pending_ids(run_id)),
        what="a pending approval",
        timeout=10,
    )
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    return approval_id


def body_of(runtime: Runtime, type_: str, approval_id: str) -> dict[str, Any]:
    """The outbox's payload of an approval event, as the deliverer hands it to the sink."""
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None
    return {"type": type_, "timestamp": "2026-01-01T00:00:00.000Z", "data": approval_json(approval)}


def deliver(runtime: Runtime, type_: str, approval_id: str) -> Any:
    assert runtime.slack is not None
    return runtime.slack.deliver("msg_test", type_, body_of(runtime, type_, approval_id))


def post_click(client: FlaskClient, body: bytes, **headers: str) -> TestResponse:
    response = client.post(
        "/integrations/slack/interactions", data=body, headers=signed(SECRET, body) | headers
    )
    response.close()  # what a server does once it sent the answer: the follow-up runs
    return response


def actions_of(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [block for block in blocks if block["type"] == "actions"]


def recorded(runtime: Runtime, approval_id: str) -> SlackMessage:
    with runtime.db.read() as session:
        row = session.get(SlackMessage, approval_id)
    assert row is not None
    return row


def status_of(runtime: Runtime, approval_id: str) -> str:
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None
    return approval.status


# -- posting ------------------------------------------------------------------------------


def test_a_requested_approval_is_posted_with_its_buttons_and_recorded(
    runtime: Runtime, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)

    result = deliver(runtime, "approval.requested", approval_id)

    assert result.succeeded and result.status == 200 and result.error is None
    [call] = fake_slack.calls_of("chat.postMessage")
    assert call.authorization == f"Bearer {TOKEN}"
    assert call.body["channel"] == "#approvals"
    posted = fake_slack.only_message()
    [actions] = actions_of(posted.blocks)
    buttons = {b["action_id"]: b["value"] for b in actions["elements"]}
    assert buttons == {"tracon_approve": approval_id, "tracon_reject": approval_id}
    shown = str(posted.blocks)
    assert "close_account" in shown and "acc-&lt;1&gt;&amp;" in shown  # Slack's escapes
    assert "acc-<1>" not in shown
    row = recorded(runtime, approval_id)
    assert (row.channel, row.ts, row.updated_status) == (
        channel_id("#approvals"),
        posted.ts,
        None,
    )


@pytest.mark.parametrize(
    ("slack", "agent", "tenant", "expected"),
    [
        ({"AgentChannels": {"demo": "#agent-demo"}}, "demo", "acme", "#agent-demo"),
        ({"TenantChannels": {"acme": "#acme"}}, "demo", "acme", "#acme"),
        (
            {"AgentChannels": {"other": "#other"}, "TenantChannels": {"globex": "#globex"}},
            "demo",
            "acme",
            "#approvals",
        ),
        (
            {"AgentChannels": {"demo": "#agent-demo"}, "TenantChannels": {"acme": "#acme"}},
            "demo",
            "acme",
            "#agent-demo",
        ),
    ],
    ids=["agent", "tenant", "default", "agent-before-tenant"],
)
def test_the_channel_is_the_agents_else_the_tenants_else_the_default(
    make_slack_runtime: Any,
    fake_slack: FakeSlack,
    slack: dict[str, Any],
    agent: str,
    tenant: str,
    expected: str,
) -> None:
    runtime: Runtime = make_slack_runtime(**slack)
    approval_id = waiting_approval(runtime, tenant=tenant, agent=agent)

    assert deliver(runtime, "approval.requested", approval_id).succeeded

    [call] = fake_slack.calls_of("chat.postMessage")
    assert call.body["channel"] == expected
    assert recorded(runtime, approval_id).channel == channel_id(expected)


def test_without_any_channel_the_attempt_fails_saying_what_to_set(
    make_slack_runtime: Any, fake_slack: FakeSlack
) -> None:
    runtime: Runtime = make_slack_runtime(Channel=None, TenantChannels={"globex": "#globex"})
    approval_id = waiting_approval(runtime)

    result = deliver(runtime, "approval.requested", approval_id)

    assert not result.succeeded and result.status is None
    assert "no Slack channel for agent 'demo' of tenant 'acme'" in (result.error or "")
    assert "Integrations.Slack.Channel" in (result.error or "")
    assert fake_slack.calls == []


def test_a_retried_request_delivery_does_not_post_twice(
    runtime: Runtime, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    assert deliver(runtime, "approval.requested", approval_id).status == 200

    again = deliver(runtime, "approval.requested", approval_id)

    assert again.succeeded and again.status == 204 and "already posted" in again.response_excerpt
    assert len(fake_slack.calls_of("chat.postMessage")) == 1


def test_a_failed_post_records_nothing_and_its_retry_posts(
    runtime: Runtime, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    fake_slack.fail_next("chat.postMessage", status=503, error="Service Unavailable")

    failed = deliver(runtime, "approval.requested", approval_id)
    assert (failed.succeeded, failed.status) == (False, 503)
    assert "chat.postMessage" in (failed.error or "")
    with runtime.db.read() as session:
        assert session.get(SlackMessage, approval_id) is None

    assert deliver(runtime, "approval.requested", approval_id).status == 200
    assert len(fake_slack.messages) == 1


@pytest.mark.parametrize(
    ("failure", "status", "error"),
    [
        ({"status": 200, "error": "channel_not_found"}, None, "channel_not_found"),
        ({"status": 200, "error": "not_in_channel"}, None, "not_in_channel"),
        ({"status": 500, "error": "Internal Server Error"}, 500, "chat.postMessage 500"),
        ({"status": 429, "retry_after": 30}, 429, "retry after 30 s"),
    ],
    ids=["ok-false", "not-in-channel", "http-500", "rate-limited"],
)
def test_slack_refusals_are_failed_attempts_naming_the_cause(
    runtime: Runtime,
    fake_slack: FakeSlack,
    failure: dict[str, Any],
    status: int | None,
    error: str,
) -> None:
    approval_id = waiting_approval(runtime)
    fake_slack.fail_next("chat.postMessage", **failure)

    result = deliver(runtime, "approval.requested", approval_id)

    assert not result.succeeded
    assert result.status == status
    assert error in (result.error or ""), result


def test_a_wrong_token_fails_the_attempt_and_is_never_logged(
    make_slack_runtime: Any,
    fake_slack: FakeSlack,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrong = "xoxb-wrong-9999999999-zzzzzzzzzz"
    monkeypatch.setenv("SLACK_TEST_BOT_TOKEN", wrong)
    runtime: Runtime = make_slack_runtime()
    approval_id = waiting_approval(runtime)
    caplog.set_level(logging.DEBUG)

    refused = deliver(runtime, "approval.requested", approval_id)
    fake_slack.stop()  # and Slack unreachable: the error names the failure, not the token
    unreachable = deliver(runtime, "approval.requested", approval_id)

    assert "invalid_auth" in (refused.error or "")
    assert unreachable.status is None and "did not reach Slack" in (unreachable.error or "")
    shown = caplog.text + repr(refused) + repr(unreachable) + repr(runtime.slack)
    assert fake_slack.calls and wrong not in shown
    assert "(redacted)" in caplog.text  # slack_sdk's debug line, with the header hidden


# -- outcomes -----------------------------------------------------------------------------


def test_a_decision_made_elsewhere_updates_the_message_once(
    runtime: Runtime, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    assert deliver(runtime, "approval.requested", approval_id).succeeded
    tenant = runtime.tenants.find_tenant("acme")
    assert tenant is not None
    runtime.approvals.decide(tenant, approval_id, True, "fine", decided_by="key:abc123")

    result = deliver(runtime, "approval.decided", approval_id)
    again = deliver(runtime, "approval.decided", approval_id)

    assert result.status == 200 and again.status == 204
    posted = fake_slack.only_message()
    assert posted.updates == 1
    assert actions_of(posted.blocks) == []
    shown = str(posted.blocks)
    assert "*Approved*" in shown and "by key:abc123" in shown and "fine" in shown
    assert recorded(runtime, approval_id).updated_status == "Approved"


def test_an_expired_approval_updates_the_message_to_expired(
    runtime: Runtime, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    assert deliver(runtime, "approval.requested", approval_id).succeeded
    expire_now(runtime, approval_id)

    result = deliver(runtime, "approval.expired", approval_id)

    assert result.status == 200
    posted = fake_slack.only_message()
    assert actions_of(posted.blocks) == [] and "*Expired*" in str(posted.blocks)
    assert recorded(runtime, approval_id).updated_status == "Expired"


def expire_now(runtime: Runtime, approval_id: str) -> None:
    """The approval's time runs out (its expiry moved to the past), and the expiry pass runs."""
    with runtime.db.write() as session:
        session.execute(
            update(Approval)
            .where(Approval.id == approval_id)
            .values(expires_at=runtime.db.now() - timedelta(seconds=1))
        )
    expired = runtime.approvals.expire_once(runtime.db.now())
    assert [d.approval.id for d in expired] == [approval_id]


def test_an_outcome_before_its_request_was_posted_is_posted_decided(
    runtime: Runtime, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    tenant = runtime.tenants.find_tenant("acme")
    assert tenant is not None
    runtime.approvals.decide(tenant, approval_id, False, decided_by="key:abc123")

    outcome = deliver(runtime, "approval.decided", approval_id)  # no message yet: nothing
    request = deliver(runtime, "approval.requested", approval_id)

    assert outcome.status == 204 and request.status == 200
    posted = fake_slack.only_message()
    assert actions_of(posted.blocks) == [] and "*Rejected*" in str(posted.blocks)
    assert posted.updates == 0
    assert recorded(runtime, approval_id).updated_status == "Rejected"


def test_a_failed_update_is_written_by_the_retry(runtime: Runtime, fake_slack: FakeSlack) -> None:
    approval_id = waiting_approval(runtime)
    assert deliver(runtime, "approval.requested", approval_id).succeeded
    tenant = runtime.tenants.find_tenant("acme")
    assert tenant is not None
    runtime.approvals.decide(tenant, approval_id, True, decided_by="key:abc123")
    fake_slack.fail_next("chat.update", status=200, error="ratelimited")

    failed = deliver(runtime, "approval.decided", approval_id)
    assert not failed.succeeded and recorded(runtime, approval_id).updated_status is None

    assert deliver(runtime, "approval.decided", approval_id).status == 200
    assert fake_slack.only_message().updates == 1


def test_the_web_and_a_delivery_writing_the_same_outcome_update_it_once(
    runtime: Runtime, fake_slack: FakeSlack, slack: SlackApprovals
) -> None:
    approval_id = waiting_approval(runtime)
    assert deliver(runtime, "approval.requested", approval_id).succeeded
    tenant = runtime.tenants.find_tenant("acme")
    assert tenant is not None
    runtime.approvals.decide(tenant, approval_id, True, decided_by="key:abc123")
    fake_slack.delay = 0.3  # each Slack call takes a while: the two overlap

    # When the web's quick update (no waiting) and the delivery's start at the same moment
    outcomes: list[Any] = []
    barrier = threading.Barrier(2)

    def write(attempt: Any) -> None:
        barrier.wait()
        outcomes.append(attempt())

    threads = [
        threading.Thread(target=write, args=(lambda: slack.answering.show_outcome(approval_id),)),
        threading.Thread(
            target=write, args=(lambda: deliver(runtime, "approval.decided", approval_id),)
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)

    # Then both succeed (one wrote it, the other found it written) and Slack got one update
    assert len(outcomes) == 2 and all(r.succeeded for r in outcomes), outcomes
    assert sorted(r.status for r in outcomes) == [200, 204]
    assert len(fake_slack.calls_of("chat.update")) == 1


# -- interactions -------------------------------------------------------------------------


def test_a_signed_click_decides_resumes_the_run_and_updates_the_message(
    runtime: Runtime, client: FlaskClient, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    assert deliver(runtime, "approval.requested", approval_id).succeeded

    started = time.monotonic()
    response = post_click(client, click(approval_id, user="U0ALICE"))

    assert response.status_code == 200 and response.data == b""
    assert time.monotonic() - started < 3
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None
    assert (approval.status, approval.decided_by) == ("Approved", "alice@example.com")
    posted = fake_slack.only_message()
    assert posted.updates == 1 and actions_of(posted.blocks) == []
    assert "by alice@example.com" in str(posted.blocks)
    wait_until(
        lambda: (runtime.runs.get(approval.run_id) or approval).status == "Completed",
        what="the run completed",
        timeout=10,
    )
    # And the delivery of the decision that follows finds nothing left to do
    assert deliver(runtime, "approval.decided", approval_id).status == 204
    assert len(fake_slack.calls_of("chat.update")) == 1


def test_a_click_by_an_unlisted_user_is_recorded_by_their_slack_id(
    runtime: Runtime, client: FlaskClient
) -> None:
    approval_id = waiting_approval(runtime)

    assert post_click(client, click(approval_id, approve=False, user="U0BOB")).status_code == 200

    approval = runtime.approval_store.get(approval_id)
    assert approval is not None
    assert (approval.status, approval.decided_by) == ("Rejected", "slack:U0BOB")


def test_a_click_on_a_decided_approval_gets_a_note_only_the_clicker_sees(
    runtime: Runtime, client: FlaskClient, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    assert deliver(runtime, "approval.requested", approval_id).succeeded
    assert post_click(client, click(approval_id, user="U0ALICE", serial=1)).status_code == 200

    late = post_click(client, click(approval_id, approve=False, user="U0BOB", serial=2))

    assert late.status_code == 200
    [note] = fake_slack.calls_of("chat.postEphemeral")
    assert note.body["user"] == "U0BOB" and note.body["channel"] == "C0APPROVALS"
    assert "already approved by alice@example.com" in note.body["text"]
    assert status_of(runtime, approval_id) == "Approved"
    assert len(fake_slack.calls_of("chat.update")) == 1


def _refusal(kind: str, approval_id: str) -> tuple[bytes, dict[str, str]]:
    body = click(approval_id)
    now = int(time.time())
    headers = signed(SECRET, body)
    if kind == "bad-signature":
        headers = signed("another-secret-of-the-same-length", body)
    # (well past the 300 s allowed: a loaded machine takes seconds to reach the check, which
    # brings a timestamp 301 s ahead back within them)
    elif kind == "stale":
        headers = signed(SECRET, body, timestamp=now - 330)
    elif kind == "ahead":
        headers = signed(SECRET, body, timestamp=now + 330)
    elif kind == "no-timestamp":
        del headers["X-Slack-Request-Timestamp"]
    elif kind == "no-signature":
        del headers["X-Slack-Signature"]
    elif kind == "changed-body":
        body = click(approval_id, approve=False)
    return body, headers


@pytest.mark.parametrize(
    ("kind", "detail"),
    [
        ("bad-signature", "X-Slack-Signature: does not match"),
        ("changed-body", "X-Slack-Signature: does not match"),
        ("stale", "X-Slack-Request-Timestamp: more than 300 seconds"),
        ("ahead", "X-Slack-Request-Timestamp: more than 300 seconds"),
        ("no-timestamp", "X-Slack-Request-Timestamp: the header is missing"),
        ("no-signature", "X-Slack-Signature: the header is missing"),
    ],
)
def test_a_request_slack_did_not_sign_now_is_refused_and_decides_nothing(
    runtime: Runtime, client: FlaskClient, fake_slack: FakeSlack, kind: str, detail: str
) -> None:
    approval_id = waiting_approval(runtime)
    body, headers = _refusal(kind, approval_id)

    response = client.post("/integrations/slack/interactions", data=body, headers=headers)

    assert response.status_code == 401
    assert response.mimetype == "application/problem+json"
    assert detail in response.get_json()["detail"]
    assert status_of(runtime, approval_id) == "Pending"
    assert fake_slack.calls == []


def test_a_replayed_request_is_refused(
    runtime: Runtime, client: FlaskClient, fake_slack: FakeSlack
) -> None:
    approval_id = waiting_approval(runtime)
    body = click(approval_id, approve=False)
    headers = signed(SECRET, body)
    path = "/integrations/slack/interactions"
    assert client.post(path, data=body, headers=headers).status_code == 200

    replay = client.post(path, data=body, headers=headers)

    assert replay.status_code == 401
    assert "already received" in replay.get_json()["detail"]


def test_a_payload_that_is_not_a_click_is_acknowledged_and_ignored(
    runtime: Runtime, client: FlaskClient
) -> None:
    approval_id = waiting_approval(runtime)
    for payload in (b'payload={"type":"view_submission"}', b"payload=%7B%7D"):
        assert post_click(client, payload).status_code == 200
    garbage = post_click(client, b"payload=not-json")
    assert garbage.status_code == 400 and garbage.get_json()["field"] == "payload"
    assert status_of(runtime, approval_id) == "Pending"


def test_without_slack_configured_the_route_is_404(make_runtime: MakeRuntime, sql_url: str) -> None:
    client = create_app(make_runtime(sql_url), {"TESTING": True}).test_client()
    body = click("a")
    response = client.post(
        "/integrations/slack/interactions", data=body, headers=signed(SECRET, body)
    )
    assert response.status_code == 404


# -- the checks alone ---------------------------------------------------------------------


def test_verify_accepts_slack_sdks_signature_and_refuses_a_tampered_one() -> None:
    body = b"payload=%7B%7D"
    headers = signed(SECRET, body, timestamp=1_700_000_000)

    assert verify(SECRET, headers, body, now=1_700_000_299) == headers["X-Slack-Signature"]
    tampered = headers | {"X-Slack-Signature": headers["X-Slack-Signature"][:-1] + "0"}
    if tampered == headers:
        tampered = headers | {"X-Slack-Signature": headers["X-Slack-Signature"][:-1] + "1"}
    with pytest.raises(RequestRefused, match="does not match"):
        verify(SECRET, tampered, body, now=1_700_000_000)
    with pytest.raises(RequestRefused, match="more than 300 seconds"):
        verify(SECRET, headers, body, now=1_700_000_301)
    with pytest.raises(RequestRefused, match="number of seconds"):
        verify(SECRET, headers | {"X-Slack-Request-Timestamp": "1e9"}, body, now=1e9)


def test_replays_race_and_exactly_one_request_is_accepted() -> None:
    checks = SlackRequests(SECRET, MemoryLeaseStore())
    body = b"payload=%7B%7D"
    headers = signed(SECRET, body)
    accepted: list[bool] = []
    barrier = threading.Barrier(8)

    def present() -> None:
        barrier.wait()
        try:
            checks.check(headers, body, time.time())
            accepted.append(True)
        except RequestRefused:
            accepted.append(False)

    threads = [threading.Thread(target=present) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(accepted) == [False] * 7 + [True]
    assert SECRET not in repr(checks)


def test_an_empty_signing_secret_accepts_nothing() -> None:
    body = b"payload=%7B%7D"
    stamp = str(int(time.time()))
    headers = {
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": signature("", stamp, body),  # what anyone can compute
    }
    with pytest.raises(RequestRefused, match="empty"):
        SlackRequests("", MemoryLeaseStore()).check(headers, body, time.time())
