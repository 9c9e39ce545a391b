"""The console's schedules pages in chromium: create a schedule from the nav link on, see it
listed, pause and resume it, delete it; the form's rules (shown again as typed); a fired slot
and its run; CSRF and tenant isolation. Slots are fired by calling beat's pass directly (no
beat here); the runs it starts execute on the test's worker threads."""

from __future__ import annotations

from datetime import timedelta

import pytest
from playwright.sync_api import expect
from sqlalchemy import update

from tests.browser.conftest import Console
from tracon_jobs.db.models import Schedule
from tracon_jobs.schedules.definition import checked

pytestmark = pytest.mark.browser


def tenant(console: Console, name: str = "acme") -> str:
    found = console.runtime.tenants.find_tenant(name)
    assert found is not None
    return found


def schedules_of(console: Console, name: str = "acme") -> list[Schedule]:
    return console.runtime.schedules.page(tenant(console, name), 10)


def made(console: Console, name: str = "acme") -> Schedule:
    body = {
        "name": "hourly-check",
        "interval": 3600,
        "target": {"agent": "support"},
        "input": {"message": "Where is A-1?"},
    }
    spec = checked(body, console.runtime.schedule_targets)
    return console.runtime.schedules.create(tenant(console, name), spec)


def test_create_list_pause_resume_and_delete(console: Console) -> None:
    console.sign_in()
    page = console.page
    page.click("nav >> text=Schedules")
    expect(page.locator("h1")).to_have_text("Schedules")
    expect(page.locator("table.schedules")).to_contain_text("No schedules yet")

    page.fill("#schedule-name", "nightly-report")
    page.fill("#schedule-cron", "0 3 * * MON-FRI")
    page.fill("#schedule-timezone", "Europe/Paris")
    page.select_option("#schedule-target-kind", "agent")
    page.fill("#schedule-target-name", "support")
    page.fill("#schedule-input", '{"message": "Write the nightly report"}')
    page.select_option("#schedule-overlap", "queue")
    page.select_option("#schedule-catch-up", "latest")
    page.click("#create-schedule")

    expect(page.locator(".flash-ok")).to_contain_text("Schedule created")
    expect(page.locator("h1")).to_have_text("nightly-report")
    expect(page.locator("#schedule-state")).to_have_text("active")
    expect(page.locator("#schedule-cadence")).to_have_text("0 3 * * MON-FRI (Europe/Paris)")
    expect(page.locator("#schedule-next-fire")).to_contain_text("UTC")
    console.screenshot("schedule")
    [schedule] = schedules_of(console)
    assert (schedule.name, schedule.cron, schedule.timezone) == (
        "nightly-report",
        "0 3 * * MON-FRI",
        "Europe/Paris",
    )
    assert (schedule.input, schedule.overlap, schedule.catch_up) == (
        {"message": "Write the nightly report"},
        "queue",
        "latest",
    )

    page.click(".crumbs >> text=Schedules")
    row = page.locator(f"tr[data-schedule-id='{schedule.id}']")
    expect(row.locator(".cadence")).to_have_text("0 3 * * MON-FRI (Europe/Paris)")
    expect(row.locator(".target")).to_have_text("agent support")
    expect(row.locator(".schedule-state")).to_have_text("active")
    console.screenshot("schedules")

    row.locator("button.pause-schedule").click()
    expect(page.locator(".flash-ok")).to_contain_text("Schedule paused")
    expect(row.locator(".schedule-state")).to_have_text("paused")
    expect(row.locator(".next-fire")).to_have_text("—")
    assert schedules_of(console)[0].paused

    row.locator("button.resume-schedule").click()
    expect(page.locator(".flash-ok")).to_contain_text("Schedule resumed")
    expect(row.locator(".schedule-state")).to_have_text("active")
    expect(row.locator(".next-fire")).not_to_have_text("—")
    resumed = schedules_of(console)[0]
    assert not resumed.paused and resumed.next_fire_at is not None

    row.locator("a.schedule-name").click()
    page.click("button.delete-schedule")  # the confirm dialog is accepted
    expect(page.locator(".flash-ok")).to_contain_text("Schedule deleted")
    expect(page.locator("h1")).to_have_text("Schedules")
    expect(page.locator(f"tr[data-schedule-id='{schedule.id}']")).to_have_count(0)
    assert schedules_of(console) == []
    assert console.console_errors == []


def test_the_form_says_which_rule_is_broken_and_keeps_what_was_typed(console: Console) -> None:
    console.sign_in()
    page = console.page
    page.goto(console.url("/schedules"))

    page.fill("#schedule-name", "nightly")
    page.fill("#schedule-cron", "61 * * * *")
    page.fill("#schedule-target-name", "support")
    page.fill("#schedule-input", '{"message": "report"}')
    page.check("#schedule-paused")
    page.click("#create-schedule")

    expect(page.locator("#schedule-error")).to_have_text("Cron: minute: 61 is not from 0 to 59.")
    expect(page.locator("#schedule-cron")).to_have_value("61 * * * *")
    expect(page.locator("#schedule-cron")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#schedule-name")).to_have_value("nightly")
    expect(page.locator("#schedule-input")).to_have_value('{"message": "report"}')
    expect(page.locator("#schedule-paused")).to_be_checked()
    console.screenshot("schedule-refused")

    page.fill("#schedule-cron", "")
    page.fill("#schedule-interval", "PT30M")
    page.select_option("#schedule-target-kind", "workflow")
    page.fill("#schedule-target-name", "no-such-workflow")
    page.click("#create-schedule")
    expect(page.locator("#schedule-error")).to_have_text(
        "Workflow: must name a registered workflow (got 'no-such-workflow')."
    )
    expect(page.locator("#schedule-target-kind")).to_have_value("workflow")
    assert schedules_of(console) == []

    page.fill("#schedule-target-name", "three-nodes")
    page.fill("#schedule-input", '{"order": 7}')
    page.click("#create-schedule")
    expect(page.locator(".flash-ok")).to_contain_text("Schedule created")
    expect(page.locator("#schedule-cadence")).to_have_text("every 30 min")
    expect(page.locator("#schedule-state")).to_have_text("paused")
    assert [s.target_name for s in schedules_of(console)] == ["three-nodes"]


def test_a_fired_slot_links_to_its_run(console: Console) -> None:
    schedule = made(console)
    base = console.runtime.db.now().replace(microsecond=0)
    with console.runtime.db.write() as session:
        session.execute(
            update(Schedule)
            .where(Schedule.id == schedule.id)
            .values(anchor_at=base - timedelta(hours=1), next_fire_at=base)
        )
    [run_id] = console.runtime.schedule_firing.scan_once(base + timedelta(seconds=1)).runs
    console.wait_for(run_id, "Completed")
    console.sign_in()
    page = console.page

    page.goto(console.url("/schedules"))
    row = page.locator(f"tr[data-schedule-id='{schedule.id}']")
    expect(row.locator(".cadence")).to_have_text("every 1 h")
    expect(row.locator("a.last-run")).to_have_text(f"run {run_id[:8]}")
    row.locator("a.schedule-name").click()
    fire = page.locator("tr.fire")
    expect(fire).to_have_count(1)
    expect(fire.locator(".badge")).to_have_text("fired")
    console.screenshot("schedule-fires")

    fire.locator(f"a[href='/runs/{run_id}']").click()
    expect(page).to_have_url(console.url(f"/runs/{run_id}"))
    expect(page.locator("#run-live")).to_contain_text("Completed")
    assert console.console_errors == []


def test_another_tenants_schedule_is_404_and_a_form_without_its_token_is_refused(
    console: Console,
) -> None:
    theirs = made(console, "globex")
    console.sign_in()
    page = console.page

    response = page.goto(console.url(f"/schedules/{theirs.id}"))
    assert response is not None and response.status == 404
    page.goto(console.url("/schedules"))
    expect(page.locator(f"tr[data-schedule-id='{theirs.id}']")).to_have_count(0)
    token = page.locator("input[name=csrf_token]").first.get_attribute("value")
    assert token
    for action in ("pause", "delete"):
        answer = page.request.post(
            console.url(f"/schedules/{theirs.id}/{action}"), form={"csrf_token": token}
        )
        assert answer.status == 404
    mine = made(console)
    assert page.request.post(console.url(f"/schedules/{mine.id}/pause")).status == 400
    assert page.request.post(console.url(f"/schedules/{mine.id}/delete")).status == 400
    assert [s.paused for s in schedules_of(console)] == [False]
    assert [s.paused for s in schedules_of(console, "globex")] == [False]
