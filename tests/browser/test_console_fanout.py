"""A workflow waiting for its fan-out, in chromium: its run page lists the branches, which of
them ended, and links each child run to its own page."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import Console
from tracon_jobs.runs.cancel import cancel_tree

pytestmark = pytest.mark.browser


def test_a_waiting_fan_out_lists_its_branches_and_links_its_children(console: Console) -> None:
    response = console.api().post(
        "/api/workflows/fan-long/run",
        json={"input": {}},
        headers={"Authorization": f"Bearer {console.key}", "Prefer": "respond-async"},
    )
    assert response.status_code == 202, response.get_data(as_text=True)
    run_id = response.get_json()["runId"]
    try:
        shows_the_branches_and_links_the_child(console, run_id)
    finally:  # free the worker thread the minute-long child holds, whatever happened
        rt = console.runtime
        parent = rt.runs.get(run_id)
        assert parent is not None
        cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, parent)
    [child] = [run for run in console.runtime.runs.subtree(parent) if run.id != run_id]
    console.wait_for(child.id, "Canceled")
    assert console.console_errors == []


def shows_the_branches_and_links_the_child(console: Console, run_id: str) -> None:
    console.wait_for(run_id, "Waiting")
    console.sign_in()
    page = console.page
    page.goto(console.url(f"/runs/{run_id}"))

    panel = page.locator("#workflow-fanout")
    expect(panel).to_be_visible()
    expect(panel.locator("h2")).to_contain_text("Waiting for its branches")
    expect(panel.locator("h2")).to_contain_text("1 of 2 ended")
    expect(panel.locator("tr[data-branch='0']")).to_contain_text("done")
    expect(panel.locator("tr[data-branch='1']")).to_contain_text("running")
    expect(page.locator("#answer-form")).to_have_count(0)  # nothing to answer
    console.screenshot("workflow-fanout")

    # the child's link is to the child run's page, which opens. Followed by its address, not
    # by a click: the panel is drawn again by the page's live poll, and on a loaded machine a
    # click once left the browser on the parent's page (the child's page was requested, then
    # the parent's again).
    href = panel.locator("tr[data-branch='1'] a").get_attribute("href")
    assert href is not None and href.startswith("/runs/") and run_id not in href
    child_id = href.rsplit("/", 1)[-1]
    assert console.runtime.runs.get(child_id).parent_run_id == run_id  # type: ignore[union-attr]
    page.goto(console.url(href))
    expect(page.locator("h1")).to_contain_text("Run")
