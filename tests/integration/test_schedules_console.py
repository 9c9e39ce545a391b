"""The console's schedules pages through the Flask test client: the nav entry and the list; the
new-schedule form creates what `POST /api/schedules` creates, and a form that breaks a rule is
shown again as typed, naming the rule in the API's own words (the same `checked`); the
schedule's page with its fires and their runs; pause, resume and delete from the list and
from the page. Another tenant's schedule is a 404 that changes nothing; a form without the
session's CSRF token is refused."""

from __future__ import annotations

import html
import re
from datetime import timedelta
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import update
from werkzeug.test import TestResponse

from tests.console_client import signed_in, text, token_of
from tests.helpers import MakeRuntime, auth, hold_queued, scripted_agent
from tracon_jobs.db.models import Schedule
from tracon_jobs.runtime import Runtime
from tracon_jobs.schedules.definition import checked
from web import create_app

FORM = {
    "name": "nightly",
    "cron": "0 3 * * MON-FRI",
    "timezone": "Europe/Paris",
    "interval": "",
    "target_kind": "agent",
    "target_name": "demo",
    "input": '{"message": "Write the nightly report"}',
    "overlap": "queue",
    "catch_up": "latest",
}
"""The new-schedule form as a user fills it (`paused` unchecked)."""


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sqlite_url: str) -> Runtime:
    sections = {**scripted_agent([{"Text": "ok"}]), "WorkflowModules": ["tests.workflows"]}
    return make_runtime(sqlite_url, sender=hold_queued, **sections)


def value_of(page: str, name: str) -> str:
    """The value a text field of the page shows."""
    found = re.search(rf'name="{name}" value="([^"]*)"', page)
    assert found is not None, name
    return html.unescape(found.group(1))


def input_of(page: str) -> str:
    """The new-schedule form's input, as its textarea shows it."""
    found = re.search(r'name="input"[^>]*>([^<]*)</textarea>', page)
    assert found is not None
    return html.unescape(found.group(1))


def tenant_of(runtime: Runtime, name: str = "acme") -> str:
    return runtime.tenants.ensure_tenant(name)


def post(client: FlaskClient, path: str, **fields: Any) -> TestResponse:
    return client.post(path, data={"csrf_token": token_of(client, "/schedules"), **fields})


def create_in_the_form(client: FlaskClient, **changes: Any) -> TestResponse:
    fields = {**FORM, **changes}
    return post(client, "/schedules", **{k: v for k, v in fields.items() if v is not None})


def schedule_of(runtime: Runtime, tenant: str = "acme", **body: Any) -> Schedule:
    body = {
        "name": "nightly",
        "interval": 60,
        "target": {"agent": "demo"},
        "input": {"message": "report"},
        **body,
    }
    return runtime.schedules.create(
        tenant_of(runtime, tenant), checked(body, runtime.schedule_targets)
    )


def reread(runtime: Runtime, schedule: Schedule) -> Schedule:
    return runtime.schedules.get(schedule.tenant_id, schedule.id)


def fire_one_slot(runtime: Runtime, schedule: Schedule) -> str:
    """As if the schedule's slot came a second ago and beat's pass came: its run's id."""
    base = runtime.db.now().replace(microsecond=0)
    with runtime.db.write() as session:
        session.execute(
            update(Schedule)
            .where(Schedule.id == schedule.id)
            .values(anchor_at=base - timedelta(minutes=1), next_fire_at=base)
        )
    result = runtime.schedule_firing.scan_once(base + timedelta(seconds=1))
    (run_id,) = result.runs
    return run_id


def test_the_nav_has_schedules_and_the_list_starts_empty(runtime: Runtime) -> None:
    client = signed_in(runtime, "acme")

    page = client.get("/schedules")

    assert page.status_code == 200
    body = page.get_data(as_text=True)
    assert '<a href="/schedules" aria-current="page">Schedules</a>' in body
    assert "No schedules yet: add one below." in text(page)
    assert 'id="create-schedule"' in body
    assert '<option value="demo">agent</option>' in body  # the targets it may name
    assert '<option value="three-nodes">workflow</option>' in body
    assert 'href="/schedules"' in client.get("/").get_data(as_text=True)


def test_the_form_creates_the_schedule_the_api_would(runtime: Runtime) -> None:
    client = signed_in(runtime, "acme")

    created = create_in_the_form(client)

    assert created.status_code in (302, 303)
    [schedule] = runtime.schedules.page(tenant_of(runtime), 10)
    assert created.headers["Location"].endswith(f"/schedules/{schedule.id}")
    assert (schedule.name, schedule.cron, schedule.timezone, schedule.interval_ms) == (
        "nightly",
        "0 3 * * MON-FRI",
        "Europe/Paris",
        None,
    )
    assert (schedule.target_kind, schedule.target_name, schedule.input) == (
        "agent",
        "demo",
        {"message": "Write the nightly report"},
    )
    assert (schedule.overlap, schedule.catch_up, schedule.paused) == ("queue", "latest", False)
    assert schedule.next_fire_at is not None
    page = client.get(f"/schedules/{schedule.id}")
    assert "Schedule created." in text(page)
    assert "0 3 * * MON-FRI (Europe/Paris)" in text(page)
    assert "No fires yet: the first slot is" in text(page)
    listed = client.get("/schedules")
    row = text(listed)
    assert "nightly 0 3 * * MON-FRI (Europe/Paris) agent demo queue latest active" in row
    # and the API reads what the console wrote
    key = runtime.tenants.issue_key(schedule.tenant_id).secret
    api = client.get(f"/api/schedules/{schedule.id}", headers=auth(key)).get_json()
    assert (api["cron"], api["timezone"], api["target"], api["catchUp"]) == (
        "0 3 * * MON-FRI",
        "Europe/Paris",
        {"agent": "demo"},
        "latest",
    )


def test_an_interval_workflow_schedule_created_paused(runtime: Runtime) -> None:
    client = signed_in(runtime, "acme")

    created = create_in_the_form(
        client,
        name="orders",
        cron="",
        timezone="",
        interval="PT1M30S",
        target_kind="workflow",
        target_name="three-nodes",
        input='{"order": 7}',
        overlap="skip",
        catch_up="none",
        paused="true",
    )

    assert created.status_code in (302, 303)
    [schedule] = runtime.schedules.page(tenant_of(runtime), 10)
    assert (schedule.cron, schedule.interval_ms, schedule.target_kind) == (None, 90_000, "workflow")
    assert (schedule.input, schedule.paused, schedule.next_fire_at) == ({"order": 7}, True, None)
    row = text(client.get("/schedules"))
    assert "orders every 1 min 30 s workflow three-nodes skip none paused" in row
    assert "— (paused)" in text(client.get(f"/schedules/{schedule.id}"))


BROKEN: list[tuple[dict[str, Any], dict[str, Any], str, int]] = [
    # (the form's changes, the same body for the API, the form's words for the field, status)
    ({"name": ""}, {"name": ""}, "Name", 400),
    ({"name": "x" * 101}, {"name": "x" * 101}, "Name", 400),
    ({"cron": "61 * * * *"}, {"cron": "61 * * * *"}, "Cron", 400),
    ({"cron": "0 0 30 2 *"}, {"cron": "0 0 30 2 *"}, "Cron", 400),
    ({"interval": "60"}, {"interval": "60"}, "Cron", 400),  # both
    ({"cron": "", "timezone": ""}, {"cron": None, "timezone": None}, "Cron", 400),  # neither
    ({"timezone": "Mars/Olympus"}, {"timezone": "Mars/Olympus"}, "Time zone", 400),
    (
        {"cron": "", "interval": "60"},
        {"cron": None, "interval": "60"},
        "Time zone",  # an interval has no zone
        400,
    ),
    (
        {"cron": "", "timezone": "", "interval": "0"},
        {"cron": None, "timezone": None, "interval": "0"},
        "Interval",
        400,
    ),
    ({"target_kind": "tool"}, {"target": {"tool": "demo"}}, "Target", 400),
    ({"target_name": ""}, {"target": {"agent": ""}}, "Agent", 400),
    ({"target_name": "nobody"}, {"target": {"agent": "nobody"}}, "Agent", 422),
    (
        {"target_kind": "workflow", "target_name": "nope"},
        {"target": {"workflow": "nope"}},
        "Workflow",
        422,
    ),
    ({"input": '{"text": "hi"}'}, {"input": {"text": "hi"}}, "Input text", 400),
    ({"input": ""}, {"input": None}, "Input message", 400),
    ({"input": "[1, 2]"}, {"input": [1, 2]}, "Input", 400),
    ({"overlap": "sometimes"}, {"overlap": "sometimes"}, "Overlap", 400),
    ({"catch_up": "most"}, {"catchUp": "most"}, "Catch-up", 400),
]


@pytest.mark.parametrize(("changes", "api_changes", "label", "status"), BROKEN)
def test_a_broken_rule_is_shown_again_as_typed_in_the_apis_words(
    runtime: Runtime, changes: dict[str, Any], api_changes: dict[str, Any], label: str, status: int
) -> None:
    client = signed_in(runtime, "acme")
    # the API's answer to the same schedule: its field and its rule
    key = runtime.tenants.issue_key(tenant_of(runtime)).secret
    body = {
        "name": "nightly",
        "cron": "0 3 * * MON-FRI",
        "timezone": "Europe/Paris",
        "target": {"agent": "demo"},
        "input": {"message": "Write the nightly report"},
        "overlap": "queue",
        "catchUp": "latest",
        **api_changes,
    }
    api = client.post(
        "/api/schedules",
        json={name: value for name, value in body.items() if value is not None},
        headers=auth(key),
    )
    assert api.status_code == status, api.get_data(as_text=True)
    rule = api.get_json()["detail"].split(": ", 1)[1]

    refused = create_in_the_form(client, **changes, paused="true")

    assert refused.status_code == status
    assert f"{label}: {rule}." in text(refused)
    page = refused.get_data(as_text=True)
    assert 'id="schedule-error"' in page and 'aria-invalid="true"' in page
    typed = {**FORM, **changes}
    for field in ("name", "cron", "timezone", "interval", "target_name"):
        assert value_of(page, field) == typed[field]
    assert input_of(page) == typed["input"]
    for field in ("overlap", "catch_up"):
        if typed[field] in ("queue", "latest"):
            assert f'<option value="{typed[field]}" selected>' in page
    assert 'name="paused" value="true" checked' in page
    assert runtime.schedules.page(tenant_of(runtime), 10) == []


def test_input_that_is_not_json_is_refused_saying_where(runtime: Runtime) -> None:
    client = signed_in(runtime, "acme")

    refused = create_in_the_form(client, input="{message: hi}")

    assert refused.status_code == 400
    assert "The input is not JSON (" in text(refused)
    assert input_of(refused.get_data(as_text=True)) == "{message: hi}"
    assert runtime.schedules.page(tenant_of(runtime), 10) == []


def test_a_name_the_tenant_has_is_refused_and_another_tenant_may_use_it(
    runtime: Runtime,
) -> None:
    schedule_of(runtime, "acme")
    schedule_of(runtime, "globex")  # a name is unique per tenant
    client = signed_in(runtime, "acme")

    refused = create_in_the_form(client)

    assert refused.status_code == 409
    assert "Name: a schedule named 'nightly' exists already." in text(refused)
    assert len(runtime.schedules.page(tenant_of(runtime), 10)) == 1


def test_the_page_lists_the_fires_with_their_runs(runtime: Runtime) -> None:
    schedule = schedule_of(runtime, overlap="skip")
    run_id = fire_one_slot(runtime, schedule)
    client = signed_in(runtime, "acme")

    page = client.get(f"/schedules/{schedule.id}")

    assert page.status_code == 200
    body = page.get_data(as_text=True)
    assert body.count(f'href="/runs/{run_id}"') == 2  # last fire, and its fire's row
    assert 'data-outcome="fired"' in body
    assert f'href="/?session=schedule:{schedule.id}"' in body
    listed = client.get("/schedules").get_data(as_text=True)
    assert f'href="/runs/{run_id}" class="last-run">run {run_id[:8]}</a>' in listed
    assert client.get(f"/runs/{run_id}").status_code == 200

    # the run still going, the next slot is skipped: its fire says so, with no run
    next_fire = reread(runtime, schedule).next_fire_at
    assert next_fire is not None
    runtime.schedule_firing.scan_once(next_fire + timedelta(seconds=1))
    body = client.get(f"/schedules/{schedule.id}").get_data(as_text=True)
    assert 'data-outcome="skipped"' in body
    assert body.index('data-outcome="skipped"') < body.index('data-outcome="fired"')  # newest


def test_pause_resume_and_delete_from_the_page_and_from_the_list(runtime: Runtime) -> None:
    schedule = schedule_of(runtime)
    client = signed_in(runtime, "acme")

    paused = post(client, f"/schedules/{schedule.id}/pause", back="page")
    assert paused.headers["Location"].endswith(f"/schedules/{schedule.id}")
    assert (reread(runtime, schedule).paused, reread(runtime, schedule).next_fire_at) == (
        True,
        None,
    )
    page = client.get(f"/schedules/{schedule.id}")
    assert "Schedule paused" in text(page)
    assert 'class="button primary resume-schedule"' in page.get_data(as_text=True)

    resumed = post(client, f"/schedules/{schedule.id}/resume", back="list")
    assert resumed.headers["Location"].endswith("/schedules")
    after = reread(runtime, schedule)
    assert not after.paused and after.next_fire_at is not None
    assert after.next_fire_at > runtime.db.now()
    assert "Schedule resumed" in text(client.get("/schedules"))

    deleted = post(client, f"/schedules/{schedule.id}/delete")
    assert deleted.headers["Location"].endswith("/schedules")
    assert runtime.schedules.page(schedule.tenant_id, 10) == []
    listed = client.get("/schedules")
    assert "Schedule deleted with its fires; its runs stay." in text(listed)
    assert f'data-schedule-id="{schedule.id}"' not in listed.get_data(as_text=True)
    assert client.get(f"/schedules/{schedule.id}").status_code == 404


def test_another_tenants_schedule_is_404_and_nothing_changes(runtime: Runtime) -> None:
    theirs = schedule_of(runtime, "globex")
    client = signed_in(runtime, "acme")

    assert client.get(f"/schedules/{theirs.id}").status_code == 404
    for action in ("pause", "resume", "delete"):
        assert post(client, f"/schedules/{theirs.id}/{action}").status_code == 404
    assert post(client, "/schedules/no-such-schedule/pause").status_code == 404
    assert f'data-schedule-id="{theirs.id}"' not in client.get("/schedules").get_data(as_text=True)
    after = reread(runtime, theirs)
    assert (after.paused, after.next_fire_at) == (False, theirs.next_fire_at)


def test_a_form_without_the_sessions_token_is_refused(runtime: Runtime) -> None:
    schedule = schedule_of(runtime)
    client = signed_in(runtime, "acme")

    assert client.post("/schedules", data={**FORM, "name": "other"}).status_code == 400
    wrong = {**FORM, "name": "other", "csrf_token": "not-the-token"}
    assert client.post("/schedules", data=wrong).status_code == 400
    for action in ("pause", "delete"):
        assert client.post(f"/schedules/{schedule.id}/{action}").status_code == 400
    assert [s.name for s in runtime.schedules.page(schedule.tenant_id, 10)] == ["nightly"]
    assert not reread(runtime, schedule).paused


def test_signed_out_the_pages_go_to_sign_in(runtime: Runtime) -> None:
    client = create_app(runtime, {"TESTING": True, "SECRET_KEY": "s"}).test_client()

    answer = client.get("/schedules")

    assert answer.status_code in (302, 303)
    assert "/signin?next=/schedules" in answer.headers["Location"]
