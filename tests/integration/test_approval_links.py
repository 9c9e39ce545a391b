"""One-time approval links through the real Flask app, real SQL and Redis: the page a `GET`
shows (and that it decides nothing), the `POST` that decides once, expired and tampered
links, escaping, and the signing alone.

Runs are executed by the real executor on a thread standing in for a worker.
"""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime, timedelta

import pytest
from flask.testing import FlaskClient
from sqlalchemy import update

from tests.helpers import MakeRuntime, Script, ThreadWorker, scripted_agent, wait_until
from tracon_jobs.db.models import Approval
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.integrations.links import (
    MAC_BYTES,
    MIN_SECRET_CHARS,
    ApprovalLinks,
    LinkExpired,
    LinkRefused,
    approval_links,
    payload_links,
)
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings.sections import ApprovalLinksSettings
from web import create_app

KEY = "k" * 16 + "0123456789abcdef"
PUBLIC = "https://tracon.example.com"
GATED: Script = [
    {
        "ToolCalls": [
            {"Name": "close_account", "Arguments": {"account": "<script>alert(1)</script>"}}
        ]
    },
    {"Text": "Done."},
]


@pytest.fixture
def runtime(
    make_runtime: MakeRuntime,
    sql_url: str,
    thread_worker: ThreadWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> Runtime:
    monkeypatch.setenv("LINKS_TEST_SECRET", KEY)
    links = {"ApprovalLinks": {"SecretEnv": "LINKS_TEST_SECRET", "PublicUrl": PUBLIC + "/"}}
    sections = scripted_agent(GATED, ["close_account"])
    rt = make_runtime(sql_url, Integrations=links, **sections)
    rt.send_runs_with(thread_worker.sender(rt))
    return rt


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    return create_app(runtime, {"TESTING": True}).test_client()


def waiting(runtime: Runtime) -> Approval:
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "close it"})).id
    wait_until(
        lambda: bool(runtime.approval_store.pending_ids(run_id)),
        what="a pending approval",
        timeout=10,
    )
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    return current(runtime, approval_id)


def current(runtime: Runtime, approval_id: str) -> Approval:
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None
    return approval


def path_of(runtime: Runtime, approval: Approval) -> str:
    assert runtime.approval_links is not None
    url = runtime.approval_links.links(approval)["decide"]
    assert url.startswith(f"{PUBLIC}/approvals/links/")
    return url.removeprefix(PUBLIC)


def text_of(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


# -- GET: a page, never a decision ------------------------------------------------------------


def test_opening_the_link_shows_the_call_and_a_form_and_decides_nothing(
    runtime: Runtime, client: FlaskClient
) -> None:
    approval = waiting(runtime)
    path = path_of(runtime, approval)

    # When a scanner, a prefetcher and the person open it (and ask for its headers)
    pages = [client.get(path) for _ in range(3)]
    head = client.head(path)

    assert [page.status_code for page in pages] == [200] * 3 and head.status_code == 200
    html = pages[0].get_data(as_text=True)
    assert "close_account" in html and approval.run_id in html
    assert '<form method="post">' in html
    assert 'name="decision" value="approve"' in html and 'name="decision" value="reject"' in html
    assert "<script" not in html  # no script at all, and the arguments' one escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert pages[0].headers["Referrer-Policy"] == "no-referrer"
    assert pages[0].headers["Cache-Control"] == "no-store"
    assert "script-src" not in pages[0].headers["Content-Security-Policy"]
    # Then the approval still waits, undecided, and its run with it
    after = current(runtime, approval.id)
    assert (after.status, after.decided_at, after.decided_by) == ("Pending", None, None)
    run = runtime.runs.get(approval.run_id)
    assert run is not None and run.status == "Waiting"


# -- POST: the decision, once -------------------------------------------------------------


def test_posting_the_form_decides_once_and_the_run_goes_on(
    runtime: Runtime, client: FlaskClient
) -> None:
    approval = waiting(runtime)
    path = path_of(runtime, approval)

    decided = client.post(path, data={"decision": "approve", "comment": "  ok <b>go</b> "})

    assert decided.status_code == 200
    assert "Approved. The run goes on" in text_of(decided.get_data(as_text=True))
    after = current(runtime, approval.id)
    assert (after.status, after.decided_by, after.comment) == ("Approved", "link", "ok <b>go</b>")
    wait_until(
        lambda: getattr(runtime.runs.get(approval.run_id), "status", "") == "Completed",
        what="the run completed",
        timeout=10,
    )

    # And a second post (the person again, or a form sent twice) reports the outcome
    again = client.post(path, data={"decision": "reject"})
    assert again.status_code == 409
    shown = text_of(again.get_data(as_text=True))
    assert "Already approved" in shown and "changed nothing" in shown
    assert current(runtime, approval.id).status == "Approved"
    # And opening the link now says so, with no form
    page = client.get(path).get_data(as_text=True)
    assert "Already approved" in page and "<form" not in page


def test_reject_through_the_link(runtime: Runtime, client: FlaskClient) -> None:
    approval = waiting(runtime)

    answer = client.post(path_of(runtime, approval), data={"decision": "reject"})

    assert answer.status_code == 200
    after = current(runtime, approval.id)
    assert (after.status, after.decided_by, after.comment) == ("Rejected", "link", None)


@pytest.mark.parametrize(
    ("form", "rule"),
    [
        ({}, "decision: must be approve or reject"),
        ({"decision": "yes"}, "decision: must be approve or reject"),
        ({"decision": "approve", "comment": "x" * 2001}, "comment: at most 2000 characters"),
    ],
)
def test_a_form_without_a_valid_decision_decides_nothing(
    runtime: Runtime, client: FlaskClient, form: dict[str, str], rule: str
) -> None:
    approval = waiting(runtime)

    answer = client.post(path_of(runtime, approval), data=form)

    assert answer.status_code == 400 and rule in answer.get_data(as_text=True)
    assert current(runtime, approval.id).status == "Pending"


# -- expired and tampered links -------------------------------------------------------------


def test_an_expired_link_says_so_and_decides_nothing(runtime: Runtime, client: FlaskClient) -> None:
    approval = waiting(runtime)
    assert runtime.approval_links is not None
    past = datetime.now(UTC) - timedelta(seconds=1)
    path = runtime.approval_links.link_for(approval.id, past).removeprefix(PUBLIC)

    for answer in (client.get(path), client.post(path, data={"decision": "approve"})):
        assert answer.status_code == 410
        assert "has expired" in answer.get_data(as_text=True)
    assert current(runtime, approval.id).status == "Pending"


def test_an_expired_approval_says_so(runtime: Runtime, client: FlaskClient) -> None:
    approval = waiting(runtime)
    path = path_of(runtime, approval)
    with runtime.db.write() as session:  # its time runs out, and the expiry pass runs
        session.execute(
            update(Approval)
            .where(Approval.id == approval.id)
            .values(expires_at=runtime.db.now() - timedelta(seconds=1))
        )
    assert len(runtime.approvals.expire_once(runtime.db.now())) == 1

    page = client.get(path)
    decision = client.post(path, data={"decision": "approve"})

    assert page.status_code == 200 and "Already expired" in page.get_data(as_text=True)
    assert decision.status_code == 409 and "Already expired" in decision.get_data(as_text=True)
    assert "<form" not in decision.get_data(as_text=True)
    assert current(runtime, approval.id).status == "Expired"


def _tampered(token: str) -> list[str]:
    raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    flipped = raw[:5] + bytes([raw[5] ^ 1]) + raw[6:]
    other = ApprovalLinks("z" * MIN_SECRET_CHARS, PUBLIC)
    text = raw[:-MAC_BYTES].decode()  # the MAC is raw bytes: it may hold a "." of its own
    approval_id, expiry = text[:-1].split(".")
    later = datetime.fromtimestamp(int(expiry) + 3600, UTC)
    return [
        base64.urlsafe_b64encode(flipped).decode().rstrip("="),  # another approval's id
        token[:-2],  # cut short
        token[:10] + "!" + token[10:],  # a character the decoder would skip
        other.token_for(approval_id, later),  # signed with another key
        "",
        "AAAA",
    ]


def test_a_tampered_link_is_404_and_decides_nothing(runtime: Runtime, client: FlaskClient) -> None:
    approval = waiting(runtime)
    token = path_of(runtime, approval).rsplit("/", 1)[1]

    for bad in _tampered(token):
        path = f"/approvals/links/{bad}"
        for answer in (client.get(path), client.post(path, data={"decision": "approve"})):
            assert answer.status_code == 404, (bad, answer.status_code)
    assert current(runtime, approval.id).status == "Pending"


def test_without_links_configured_the_pages_are_404(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    client = create_app(make_runtime(sql_url), {"TESTING": True}).test_client()
    token = ApprovalLinks(KEY, PUBLIC).token_for("a", datetime.now(UTC) + timedelta(hours=1))
    assert client.get(f"/approvals/links/{token}").status_code == 404


# -- the signing alone ----------------------------------------------------------------------


def test_a_token_names_its_approval_until_it_expires() -> None:
    links = ApprovalLinks(KEY, PUBLIC + "/")
    expires = datetime(2030, 1, 1, 12, 0, 0)  # naive: UTC, as the database gives it
    url = links.link_for("0b1f3c1e-4f5a-4d7e-9e1a-2c3d4e5f6a7b", expires)
    token = url.removeprefix(f"{PUBLIC}/approvals/links/")

    assert re.fullmatch(r"[A-Za-z0-9_-]+", token)
    before = datetime(2030, 1, 1, 11, 59, 59, tzinfo=UTC)
    assert links.verify(token, before) == "0b1f3c1e-4f5a-4d7e-9e1a-2c3d4e5f6a7b"
    with pytest.raises(LinkExpired) as expired:
        links.verify(token, datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC))
    assert expired.value.approval_id == "0b1f3c1e-4f5a-4d7e-9e1a-2c3d4e5f6a7b"
    with pytest.raises(LinkRefused):
        ApprovalLinks("q" * MIN_SECRET_CHARS, PUBLIC).verify(token, before)


def test_a_short_or_missing_key_fails_at_startup_naming_the_setting() -> None:
    settings = ApprovalLinksSettings.model_validate({"SecretEnv": "LINKS_KEY", "PublicUrl": PUBLIC})
    with pytest.raises(ConfigurationError, match=r"Integrations\.ApprovalLinks\.SecretEnv"):
        approval_links(settings, {"LINKS_KEY": "short"})
    assert approval_links(None, {}) is None
    made = approval_links(settings, {"LINKS_KEY": KEY})
    assert made is not None and made.public_url == PUBLIC


def test_links_for_a_payload(runtime: Runtime) -> None:
    approval = waiting(runtime)
    assert runtime.approval_links is not None

    hook = payload_links(runtime.approval_links)
    assert hook is not None and payload_links(None) is None
    found = hook(approval)
    assert found is not None

    assert list(found) == ["decide"]
    token = found["decide"].rsplit("/", 1)[1]
    assert runtime.approval_links.verify(token, datetime.now(UTC)) == approval.id
