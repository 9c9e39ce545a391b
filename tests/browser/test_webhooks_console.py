"""The console's webhooks pages in chromium: create an endpoint (its secret shown once, never
again), see a delivery and its attempts, send it again, edit its URL and events, disable and
enable, rotate the secret, delete; the form's rules; CSRF and tenant isolation. Deliveries are
written into SQL as the deliverer leaves them (no worker delivers here)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import Console
from tests.webhook_rows import Tried, delivery, delivery_row
from tracon_jobs.webhooks.endpoints import Endpoint, EndpointStore

pytestmark = pytest.mark.browser

URL = "https://hooks.example.com/tracon"


def store(console: Console) -> EndpointStore:
    return EndpointStore(console.runtime.db)


def tenant(console: Console, name: str = "acme") -> str:
    found = console.runtime.tenants.find_tenant(name)
    assert found is not None
    return found


def only_endpoint(console: Console) -> Endpoint:
    [endpoint] = store(console).page(tenant(console), 10)
    return endpoint


def create_in_the_page(console: Console) -> str:
    """Fill the new-endpoint form from the nav link on; the secret the page shows."""
    page = console.page
    page.click("nav >> text=Webhooks")
    expect(page.locator("h1")).to_have_text("Webhooks")
    page.fill("#webhook-url", URL)
    page.check("input[name=events][value='run.completed']")
    page.check("input[name=events][value='approval.requested']")
    page.fill("#webhook-description", "billing")
    page.click("#create-webhook")
    expect(page.locator(".flash-ok")).to_contain_text("Endpoint created")
    secret = page.locator("#webhook-secret").inner_text().strip()
    assert secret.startswith("whsec_")
    return secret


def test_create_shows_the_secret_once_then_redeliver_makes_a_delivery_pending(
    console: Console,
) -> None:
    console.sign_in()

    secret = create_in_the_page(console)

    endpoint = only_endpoint(console)
    assert endpoint.secret == secret and endpoint.url == URL
    assert endpoint.events == ["run.completed", "approval.requested"]
    console.screenshot("webhook-created")
    # Given: a delivery the deliverer gave up on after two attempts
    failed, message = delivery(
        console.runtime.db,
        endpoint.id,
        tenant(console),
        status="failed",
        tried=(Tried(None, 10_000, "timed out after 10.0 s"), Tried(503, 42, "HTTP 503", "busy")),
    )
    page = console.page
    page.goto(console.url(f"/webhooks/{endpoint.id}"))
    assert secret not in page.content()  # shown once: never again
    expect(page.locator("#webhook-secret")).to_have_count(0)
    row = page.locator(f"tr.delivery[data-delivery-id='{failed}']")
    expect(row.locator(".badge")).to_have_text("failed")
    expect(row).to_contain_text("run.completed")
    expect(row).to_contain_text(message)
    attempts = page.locator(f"tr.attempt[data-delivery-id='{failed}']")
    expect(attempts).to_have_count(2)
    expect(attempts.first).to_contain_text("no answer")
    expect(attempts.first).to_contain_text("timed out after 10.0 s")
    expect(attempts.nth(1)).to_contain_text("HTTP 503")
    console.screenshot("webhook")

    row.locator("button.redeliver").click()

    expect(page.locator(".flash-ok")).to_contain_text("pending again")
    again = page.locator(f"tr.delivery[data-delivery-id='{failed}'] .badge")
    expect(again).to_have_text("pending")
    assert delivery_row(console.runtime.db, failed).status == "pending"
    assert console.console_errors == []


def test_disable_enable_rotate_and_delete(console: Console) -> None:
    console.sign_in()
    first = create_in_the_page(console)
    endpoint = only_endpoint(console)
    page = console.page

    page.click("#disable-webhook")
    expect(page.locator("#webhook-state")).to_have_text("disabled")
    page.goto(console.url("/webhooks"))
    listed = page.locator(f"tr[data-endpoint-id='{endpoint.id}'] td.state")
    expect(listed).to_contain_text("disabled by the tenant")
    page.goto(console.url(f"/webhooks/{endpoint.id}"))
    page.click("#enable-webhook")
    expect(page.locator("#webhook-state")).to_have_text("enabled")
    assert only_endpoint(console).disabled_at is None

    page.click("#rotate-webhook")  # the confirm dialog is accepted
    expect(page.locator(".flash-ok")).to_contain_text("Secret rotated")
    second = page.locator("#webhook-secret").inner_text().strip()
    rotated = only_endpoint(console)
    assert second.startswith("whsec_") and second != first
    assert (rotated.secret, rotated.previous_secret) == (second, first)
    expect(page.locator("#webhook-secret-panel")).to_contain_text("previous secret signs")

    pending, _ = delivery(console.runtime.db, endpoint.id, tenant(console))
    page.goto(console.url(f"/webhooks/{endpoint.id}"))
    page.click("#delete-webhook")
    expect(page.locator(".flash-ok")).to_contain_text("1 pending deliveries canceled")
    expect(page.locator(f"tr[data-endpoint-id='{endpoint.id}']")).to_have_count(0)
    assert store(console).page(tenant(console), 10) == []
    assert delivery_row(console.runtime.db, pending).status == "canceled"


def test_edit_the_url_and_events_and_see_them_on_the_page(console: Console) -> None:
    console.sign_in()
    create_in_the_page(console)
    endpoint = only_endpoint(console)
    page = console.page
    page.goto(console.url(f"/webhooks/{endpoint.id}"))
    form = page.locator("#edit-webhook")
    expect(form.locator("#edit-webhook-url")).to_have_value(URL)
    expect(form.locator("input[name=events][value='run.completed']")).to_be_checked()

    page.fill("#edit-webhook-url", URL + "/v2")
    form.locator("input[name=events][value='run.completed']").uncheck()
    form.locator("input[name=events][value='run.failed']").check()
    page.fill("#edit-webhook-description", "")
    page.click("#save-webhook")

    expect(page.locator(".flash-ok")).to_contain_text("Endpoint saved")
    expect(page.locator("h1")).to_have_text(URL + "/v2")
    facts = page.locator("dl.facts")
    expect(facts).to_contain_text("run.failed, approval.requested")
    expect(facts).not_to_contain_text("run.completed")
    expect(form.locator("#edit-webhook-url")).to_have_value(URL + "/v2")
    expect(form.locator("input[name=events][value='run.failed']")).to_be_checked()
    expect(form.locator("input[name=events][value='run.completed']")).not_to_be_checked()
    console.screenshot("webhook-edited")
    edited = only_endpoint(console)
    assert (edited.url, edited.events, edited.description) == (
        URL + "/v2",
        ["run.failed", "approval.requested"],
        None,
    )
    page.goto(console.url("/webhooks"))
    listed = page.locator(f"tr[data-endpoint-id='{endpoint.id}']")
    expect(listed).to_contain_text(URL + "/v2")
    expect(listed).to_contain_text("run.failed, approval.requested")
    assert console.console_errors == []


def test_the_form_says_which_rule_a_url_or_the_events_break(console: Console) -> None:
    console.sign_in()
    page = console.page
    page.goto(console.url("/webhooks"))

    page.fill("#webhook-url", "http://hooks.example.com/")
    page.check("input[name=events][value='run.failed']")
    page.click("#create-webhook")
    expect(page.locator("#webhook-error")).to_contain_text("The URL must be an https URL")
    expect(page.locator("#webhook-url")).to_have_value("http://hooks.example.com/")
    expect(page.locator("input[name=events][value='run.failed']")).to_be_checked()

    page.fill("#webhook-url", URL)
    page.uncheck("input[name=events][value='run.failed']")
    page.click("#create-webhook")
    expect(page.locator("#webhook-error")).to_contain_text(
        "Events must name at least one event type"
    )
    assert store(console).page(tenant(console), 10) == []


def test_another_tenants_endpoint_is_404_and_a_form_without_its_token_is_refused(
    console: Console,
) -> None:
    theirs, _ = store(console).create(tenant(console, "globex"), URL, ["run.completed"])
    failed, _ = delivery(console.runtime.db, theirs.id, tenant(console, "globex"), status="failed")
    console.sign_in()
    page = console.page

    response = page.goto(console.url(f"/webhooks/{theirs.id}"))
    assert response is not None and response.status == 404
    redeliver = console.url(f"/webhooks/{theirs.id}/deliveries/{failed}/redeliver")
    token = page.locator("input[name=csrf_token]").first.get_attribute("value")
    assert token
    assert page.request.post(redeliver, form={"csrf_token": token}).status == 404
    assert page.request.post(console.url(f"/webhooks/{theirs.id}/delete")).status == 400
    page.goto(console.url("/webhooks"))
    expect(page.locator(f"tr[data-endpoint-id='{theirs.id}']")).to_have_count(0)
    assert delivery_row(console.runtime.db, failed).status == "failed"
    assert store(console).get(tenant(console, "globex"), theirs.id) is not None
