"""The console's webhook endpoint page through the Flask test client: the edit form changes
the URL, the event types and the description as `PATCH /api/webhooks/{id}` does, and a form
that breaks a rule is shown again as typed, naming the rule (400); the rotate form takes a
grace in seconds (empty: `Webhooks.RotationGrace`), held to the rule of the API's
`graceSeconds`. Another tenant's endpoint is a 404 that changes nothing; a form without the
session's CSRF token is refused."""

from __future__ import annotations

import html
import re
from typing import Any

import pytest
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from tests.console_client import signed_in, text, token_of
from tests.helpers import MakeRuntime
from tracon_jobs.runtime import Runtime
from tracon_jobs.webhooks.endpoints import Endpoint, EndpointStore
from web.webhooks import MAX_GRACE_SECONDS

URL = "https://hooks.example.com/tracon"
NEW_URL = "https://hooks.example.com/tracon/v2"


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sqlite_url: str) -> Runtime:
    return make_runtime(sqlite_url, sender=lambda _run_id: None)


def store(runtime: Runtime) -> EndpointStore:
    return EndpointStore(runtime.db)


def endpoint_of(runtime: Runtime, tenant: str = "acme") -> Endpoint:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    endpoint, _ = store(runtime).create(tenant_id, URL, ["run.completed"], "billing")
    return endpoint


def reread(runtime: Runtime, endpoint: Endpoint) -> Endpoint:
    found = store(runtime).get(endpoint.tenant_id, endpoint.id)
    assert found is not None
    return found


def edit(client: FlaskClient, endpoint_id: str, **fields: Any) -> TestResponse:
    form = {"csrf_token": token_of(client, "/webhooks"), **fields}
    return client.post(f"/webhooks/{endpoint_id}/edit", data=form)


def rotate(client: FlaskClient, endpoint_id: str, grace: str | None) -> TestResponse:
    form = {"csrf_token": token_of(client, "/webhooks")}
    if grace is not None:
        form["grace"] = grace
    return client.post(f"/webhooks/{endpoint_id}/rotate", data=form)


def checked_boxes(response: TestResponse) -> list[str]:
    page = response.get_data(as_text=True)
    edit_form = page[page.index('id="edit-webhook"') :]
    return re.findall(r'name="events" value="([^"]+)" checked', edit_form)


def test_the_page_shows_the_edit_form_filled_with_the_endpoint(runtime: Runtime) -> None:
    endpoint = endpoint_of(runtime)
    client = signed_in(runtime, "acme")

    page = client.get(f"/webhooks/{endpoint.id}")

    assert page.status_code == 200
    body = page.get_data(as_text=True)
    assert f'id="edit-webhook-url" name="url" value="{URL}"' in body
    assert checked_boxes(page) == ["run.completed"]
    assert ">billing</textarea>" in body


def test_the_edit_form_changes_the_endpoint_as_the_api_does(runtime: Runtime) -> None:
    endpoint = endpoint_of(runtime)
    client = signed_in(runtime, "acme")

    saved = edit(
        client,
        endpoint.id,
        url=f"  {NEW_URL} ",
        events=["run.failed", "approval.requested"],
        description="",
    )

    assert saved.status_code in (302, 303)
    assert saved.headers["Location"].endswith(f"/webhooks/{endpoint.id}")
    changed = reread(runtime, endpoint)
    assert (changed.url, changed.events, changed.description) == (
        NEW_URL,
        ["run.failed", "approval.requested"],
        None,
    )
    assert changed.updated_at >= endpoint.updated_at
    assert (changed.enabled, changed.secret) == (True, endpoint.secret)  # the rest stays
    page = client.get(f"/webhooks/{endpoint.id}")
    assert "Endpoint saved." in text(page)
    assert "run.failed, approval.requested" in text(page)
    assert checked_boxes(page) == ["run.failed", "approval.requested"]  # as the form lists them
    # and the API reads what the console wrote
    key = runtime.tenants.issue_key(endpoint.tenant_id).secret
    api = client.get(f"/api/webhooks/{endpoint.id}", headers={"Authorization": f"Bearer {key}"})
    assert api.get_json()["url"] == NEW_URL


def test_a_url_that_breaks_a_rule_is_shown_again_as_typed_naming_the_rule(
    runtime: Runtime,
) -> None:
    endpoint = endpoint_of(runtime)
    client = signed_in(runtime, "acme")

    refused = edit(
        client,
        endpoint.id,
        url="http://hooks.example.com/",
        events=["run.failed"],
        description="typed",
    )

    assert refused.status_code == 400
    assert "The URL must be an https URL" in text(refused)
    body = refused.get_data(as_text=True)
    assert 'id="edit-webhook-error"' in body
    assert 'name="url" value="http://hooks.example.com/"' in body
    assert checked_boxes(refused) == ["run.failed"]
    assert ">typed</textarea>" in body
    unchanged = reread(runtime, endpoint)
    assert (unchanged.url, unchanged.events, unchanged.description) == (
        URL,
        ["run.completed"],
        "billing",
    )


def test_no_event_chosen_is_refused_naming_the_rule(runtime: Runtime) -> None:
    endpoint = endpoint_of(runtime)
    client = signed_in(runtime, "acme")

    refused = edit(client, endpoint.id, url=NEW_URL, description="kept as typed")

    assert refused.status_code == 400
    assert "Events must name at least one event type." in text(refused)
    body = refused.get_data(as_text=True)
    assert f'name="url" value="{NEW_URL}"' in body and ">kept as typed</textarea>" in body
    assert checked_boxes(refused) == []
    assert reread(runtime, endpoint).url == URL

    unknown = edit(client, endpoint.id, url=NEW_URL, events=["run.completed", "run.nope"])
    assert unknown.status_code == 400
    assert "Events 'run.nope' is not an event type" in text(unknown)
    assert reread(runtime, endpoint).events == ["run.completed"]


def test_another_tenants_endpoint_is_404_and_nothing_changes(runtime: Runtime) -> None:
    theirs = endpoint_of(runtime, "globex")
    client = signed_in(runtime, "acme")

    assert edit(client, theirs.id, url=NEW_URL, events=["run.failed"]).status_code == 404
    assert edit(client, theirs.id, url="http://x/", events=[]).status_code == 404
    assert rotate(client, theirs.id, "60").status_code == 404
    assert rotate(client, theirs.id, "-1").status_code == 404
    assert edit(client, "no-such-endpoint", url=NEW_URL, events=["run.failed"]).status_code == 404
    after = reread(runtime, theirs)
    assert (after.url, after.events, after.secret) == (URL, ["run.completed"], theirs.secret)


def test_a_form_without_the_sessions_token_is_refused(runtime: Runtime) -> None:
    endpoint = endpoint_of(runtime)
    client = signed_in(runtime, "acme")
    form = {"url": NEW_URL, "events": ["run.failed"]}

    assert client.post(f"/webhooks/{endpoint.id}/edit", data=form).status_code == 400
    wrong = {**form, "csrf_token": "not-the-token"}
    assert client.post(f"/webhooks/{endpoint.id}/edit", data=wrong).status_code == 400
    assert client.post(f"/webhooks/{endpoint.id}/rotate", data={"grace": "0"}).status_code == 400
    after = reread(runtime, endpoint)
    assert (after.url, after.secret) == (URL, endpoint.secret)


def test_the_rotate_form_takes_the_grace_chosen_else_the_default(runtime: Runtime) -> None:
    endpoint = endpoint_of(runtime)
    client = signed_in(runtime, "acme")
    default = runtime.settings.webhooks.rotation_grace.total_seconds()
    assert f'placeholder="{int(default)}"' in client.get(f"/webhooks/{endpoint.id}").get_data(
        as_text=True
    )

    short = rotate(client, endpoint.id, "60")

    assert short.status_code == 200 and "Secret rotated." in text(short)
    rotated = reread(runtime, endpoint)
    assert rotated.previous_secret == endpoint.secret
    assert rotated.previous_secret_until is not None
    left = (rotated.previous_secret_until - runtime.db.now()).total_seconds()
    assert 0 < left <= 60

    assert rotate(client, endpoint.id, "0").status_code == 200
    cut = reread(runtime, endpoint)
    assert (cut.previous_secret, cut.previous_secret_until) == (None, None)

    for empty in ("", "  ", None):
        assert rotate(client, endpoint.id, empty).status_code == 200
        until = reread(runtime, endpoint).previous_secret_until
        assert until is not None
        assert default - 60 < (until - runtime.db.now()).total_seconds() <= default


@pytest.mark.parametrize("typed", ["-1", "1.5", "an hour", str(MAX_GRACE_SECONDS + 1), "60s"])
def test_a_grace_that_breaks_the_rule_is_refused_as_the_api_refuses_it(
    runtime: Runtime, typed: str
) -> None:
    endpoint = endpoint_of(runtime)
    client = signed_in(runtime, "acme")

    refused = rotate(client, endpoint.id, typed)

    assert refused.status_code == 400
    rule = f"must be an integer from 0 to {MAX_GRACE_SECONDS}"
    assert f"The grace {rule}." in text(refused)
    body = refused.get_data(as_text=True)
    assert 'id="rotate-error"' in body
    assert f'name="grace" value="{html.escape(typed)}"' in body
    assert 'id="webhook-secret"' not in body
    after = reread(runtime, endpoint)
    assert (after.secret, after.previous_secret) == (endpoint.secret, None)
    # the API's words for the same rule
    key = runtime.tenants.issue_key(endpoint.tenant_id).secret
    api = client.post(
        f"/api/webhooks/{endpoint.id}/rotate-secret",
        json={"graceSeconds": -1},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert (api.status_code, api.get_json()["detail"]) == (400, f"graceSeconds: {rule}")
