"""Slack's button clicks against real processes: a real worker's webhook deliverer posts the
approval request, twenty people click Approve on the message at the same moment, over real
HTTP, on two gunicorn workers; a real worker resumes the run; the official `slack_sdk` of the
web and of the worker talks to a fake of Slack's Web API in this test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.cluster import Cluster, wait_until
from tests.fake_slack import FakeSlack, click, signed
from tests.helpers import MakeRuntime, Script, run_of, scripted_agent
from tests.helpers import log_lines as lines
from tracon_jobs.db.models import SlackMessage, WebhookDelivery
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runs.views import approval_json
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKEN = "xoxb-e2e-0123456789-abcdefghij"
SECRET = "e2e-signing-secret-0123456789abcdef"
CLICKS = 20
CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]


@pytest.fixture
def fake_slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(TOKEN).start()
    yield fake
    fake.stop()


def recorded(runtime: Runtime, approval_id: str) -> bool:
    """Whether the approval's Slack message is recorded (its channel and ts)."""
    with runtime.db.read() as session:
        return session.get(SlackMessage, approval_id) is not None


def test_twenty_concurrent_clicks_make_one_decision_one_resume_and_one_update(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    flags: Path,
    fake_slack: FakeSlack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"SLACK_E2E_BOT_TOKEN": TOKEN, "SLACK_E2E_SIGNING_SECRET": SECRET}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    slack = {
        "BotTokenEnv": "SLACK_E2E_BOT_TOKEN",
        "SigningSecretEnv": "SLACK_E2E_SIGNING_SECRET",
        "Channel": "#approvals",
        "ApiUrl": fake_slack.api_url,
    }
    sections = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"]) | {
        "Integrations": {"Slack": slack}
    }
    cluster = make_cluster(sql_url, **sections)
    cluster.env.update(env)
    cluster.worker("w1")
    web, base = cluster.web(workers=2)
    wait_until(lambda: web.text().count("Booting worker") == 2, timeout=30, what="two web workers")
    runtime = make_runtime(sql_url, **sections)
    assert runtime.slack is not None

    # Given a run waiting for its approval, whose request the worker's deliverer posts to Slack
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "go"})).id
    wait_until(
        lambda: run_of(runtime, run_id).status == "Waiting", timeout=30, what="the run waits"
    )
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    # (its ts is recorded just after Slack's answer: a retry in between would post again)
    wait_until(lambda: recorded(runtime, approval_id), timeout=30, what="the post recorded")
    assert len(fake_slack.calls_of("chat.postMessage")) == 1
    assert runtime.slack.post(approval_id).status == 204  # posted once: a retry posts nothing

    # When twenty people click Approve at the same moment, each on a connection of their own
    barrier = threading.Barrier(CLICKS)
    answers: list[tuple[int, float]] = []

    def press(serial: int) -> None:
        body = click(approval_id, user=f"U{serial:04d}", serial=serial)
        with httpx.Client(timeout=30) as client:
            barrier.wait()
            started = time.monotonic()
            response = client.post(
                f"{base}/integrations/slack/interactions",
                content=body,
                headers=signed(SECRET, body),
            )
            answers.append((response.status_code, time.monotonic() - started))

    threads = [threading.Thread(target=press, args=(serial,)) for serial in range(CLICKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    # Then Slack got its 200 quickly every time
    assert sorted(code for code, _ in answers) == [200] * CLICKS, cluster.logs()
    assert max(seconds for _, seconds in answers) < 3, answers
    # And exactly one decision won, the run was resumed once, and the tool body ran once
    wait_until(
        lambda: run_of(runtime, run_id).status == "Completed", timeout=30, what="run completed"
    )
    events = runtime.runs.events(run_id)
    assert [e.type for e in events].count("ApprovalDecided") == 1
    assert sum(1 for e in events if e.type == "RunQueued" and e.data.get("after")) == 1
    assert len(lines(flags, "close_account")) == 1
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.status == "Approved"
    assert approval.decided_by is not None and approval.decided_by.startswith("slack:U")
    # And the message shows the outcome, written once; the nineteen others were told
    wait_until(
        lambda: len(fake_slack.calls_of("chat.postEphemeral")) == CLICKS - 1,
        timeout=15,
        what="nineteen notes",
    )
    posted = fake_slack.only_message()
    assert posted.updates == 1 and len(fake_slack.calls_of("chat.update")) == 1
    assert not [block for block in posted.blocks if block["type"] == "actions"]
    assert f"by {approval.decided_by}" in str(posted.blocks)
    notes = {call.body["user"] for call in fake_slack.calls_of("chat.postEphemeral")}
    assert approval.decided_by.removeprefix("slack:") not in notes and len(notes) == CLICKS - 1
    # And the decision's delivery, sent by the worker's deliverer after, finds the message
    # already settled; so does one sent again
    wait_until(lambda: slack_delivered(runtime) == 2, timeout=30, what="the two Slack deliveries")
    body = {"type": "approval.decided", "timestamp": "", "data": approval_json(approval)}
    assert runtime.slack.deliver("msg_e2e", "approval.decided", body).status == 204
    assert len(fake_slack.calls_of("chat.update")) == 1
    assert len(fake_slack.calls_of("chat.postMessage")) == 1


def slack_delivered(runtime: Runtime) -> int:
    """The `slack` deliveries that are `delivered` (the request's and the decision's)."""
    with runtime.db.read() as session:
        query = sa.select(sa.func.count()).where(
            WebhookDelivery.target == "slack", WebhookDelivery.status == "delivered"
        )
        return int(session.scalar(query) or 0)
