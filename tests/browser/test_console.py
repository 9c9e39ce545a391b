"""The web console in chromium: sign-in, runs, a run's timeline and tree live, cancel,
approvals, circuits, statistics, CSRF and tenant isolation. Each page is screenshotted."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import SECTIONS, Console
from tests.helpers import wait_until
from tracon_jobs.runs.cancel import cancel_tree
from web.console.blueprint import duration

pytestmark = pytest.mark.browser

SCIENTIFIC = re.compile(r"(?<![\w-])\d+(?:\.\d+)?e-\d+")
"""A number in scientific notation (5.3e-05); a page's run ids are taken out first."""


def test_a_bad_key_is_refused_and_a_good_one_lands_on_the_runs(console: Console) -> None:
    page = console.page
    page.goto(console.url("/"))
    expect(page).to_have_url(re.compile(r"/signin\?next=/$"))

    page.fill("#key", "tjk_0000_not-a-key")
    page.click("button[type=submit]")
    expect(page.locator("#signin-error")).to_contain_text("not valid")
    console.screenshot("signin")

    page.fill("#key", console.key)
    page.click("button[type=submit]")
    expect(page).to_have_url(console.url("/"))
    expect(page.locator("h1")).to_have_text("Runs")
    cookie = next(c for c in page.context.cookies() if c["name"] == "tracon_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax"
    secret = console.key.split("_", 2)[2]  # the key's secret part may itself hold "_"
    assert secret not in cookie["value"] and console.key not in cookie["value"]

    page.click("text=Sign out")
    expect(page).to_have_url(console.url("/signin"))
    page.goto(console.url("/approvals"))
    expect(page).to_have_url(re.compile(r"/signin\?next=/approvals$"))


def test_the_runs_list_shows_a_completed_run_and_filters(console: Console) -> None:
    done = console.submit("support")
    console.wait_for(done, "Completed")
    console.sign_in()

    row = console.page.locator(f"tr[data-run-id='{done}']")
    expect(row.locator(".badge")).to_have_text("Completed")
    expect(row).to_contain_text("support-model")
    console.screenshot("runs")

    console.page.select_option("select[name=status]", "Failed")
    console.page.click("form.filters button[type=submit]")
    expect(console.page.locator(f"tr[data-run-id='{done}']")).to_have_count(0)
    console.page.select_option("select[name=status]", "Completed")
    console.page.select_option("select[name=agent]", "support")
    console.page.fill("input[name=session]", "ticket-4182")
    console.page.click("form.filters button[type=submit]")
    expect(console.page.locator(f"tr[data-run-id='{done}']")).to_have_count(1)


def test_the_run_page_shows_the_timeline_and_the_tree(console: Console) -> None:
    root = console.submit("triage")
    console.wait_for(root, "Completed")
    child = next(r for r in console.runtime.runs.tree(root, r_tenant(console, root)) if r.depth)
    console.sign_in()

    console.page.goto(console.url(f"/runs/{child.id}"))

    tool = console.page.locator("li.step-tool").first
    expect(tool).to_contain_text("lookup_order")
    expect(tool.locator("pre.json").first).to_contain_text('"order_id": "A-1"')
    expect(tool.locator("pre.json").nth(1)).to_contain_text('"status": "shipped"')
    expect(tool).to_contain_text("1 attempt")
    expect(console.page.locator("li.step-model")).to_have_count(2)
    tree = console.page.locator(".tree-panel")
    expect(tree.locator(".node")).to_have_count(2)
    expect(tree.locator(".node.current")).to_contain_text("support")
    expect(tree.locator(".node").first).to_contain_text("triage")
    console.screenshot("run")
    assert console.console_errors == []


def test_a_running_run_updates_live_on_its_page_and_in_the_list(console: Console) -> None:
    console.sign_in()
    listed = console.submit("steady")
    console.wait_for_event(listed, "ToolCallStarted")
    console.page.goto(console.url("/"))
    listed_badge = console.page.locator(f"tr[data-run-id='{listed}'] .badge")
    expect(listed_badge).to_have_text("Running")
    expect(listed_badge).to_have_text("Completed")

    run_id = console.submit("steady")
    console.wait_for_event(run_id, "ToolCallStarted")
    console.page.goto(console.url(f"/runs/{run_id}"))
    expect(console.page.locator("li.step-tool.state-running")).to_have_count(1)
    console.screenshot("run-live")

    expect(console.page.locator("#run-live[data-status=Completed]")).to_have_count(1)
    expect(console.page.locator("li.step-tool.state-ok")).to_contain_text("slow done")
    expect(console.page.locator("h1 .badge")).to_have_text("Completed")


def test_cancel_from_the_run_page(console: Console) -> None:
    run_id = console.submit("long")
    console.wait_for_event(run_id, "ToolCallStarted")
    console.sign_in()
    console.page.goto(console.url(f"/runs/{run_id}"))

    console.page.click("#cancel-run")  # the confirm dialog is accepted

    expect(console.page.locator(".flash-ok")).to_contain_text("Cancel requested")
    expect(console.page.locator("#run-live[data-status=Canceled]")).to_have_count(1)
    assert console.wait_for(run_id, "Canceled").cancel_requested_at is not None
    expect(console.page.locator("#cancel-run")).to_have_count(0)


def test_a_model_call_cut_by_a_cancel_is_shown_ended_not_running(console: Console) -> None:
    run_id = console.submit("stuck")  # its model answers in a minute
    console.wait_for_event(run_id, "ModelCallStarted")
    console.sign_in()
    console.page.goto(console.url(f"/runs/{run_id}"))
    call = console.page.locator("li.step-model")
    expect(call.locator(".tag", has_text="running")).to_have_count(1)

    console.page.click("#cancel-run")

    expect(console.page.locator("#run-live[data-status=Canceled]")).to_have_count(1)
    expect(call).to_have_class(re.compile(r"\bstate-stopped\b"))
    expect(call.locator(".tag", has_text="running")).to_have_count(0)
    expect(call.locator(".tag-stopped")).to_have_text("canceled")
    expect(call).to_contain_text('"kind": "canceled"')
    events = {e.type: e for e in console.runtime.runs.events(run_id)}
    lasted = (events["ModelCallFailed"].at - events["ModelCallStarted"].at).total_seconds()
    # the call's time is the span up to its end event, on the page and after a reload
    expect(call.locator(".step-time")).to_contain_text(f" · {duration(lasted * 1000)}")
    console.page.reload()
    expect(call.locator(".step-time")).to_contain_text(f" · {duration(lasted * 1000)}")
    console.screenshot("run-canceled-call")


def test_a_tiny_cost_reads_the_same_on_every_page(console: Console) -> None:
    run_id = console.submit("tiny")  # 130 tokens in, 100 out: 0.000053 USD
    console.wait_for(run_id, "Completed")
    console.sign_in()

    row = console.page.locator(f"tr[data-run-id='{run_id}']")
    expect(row).to_contain_text("0.000053 USD")
    row_text = row.inner_text()
    console.page.goto(console.url(f"/runs/{run_id}"))
    expect(console.page.locator(".summary [data-money]")).to_have_text("0.000053 USD")
    call = console.page.locator("li.step-model")
    expect(call.locator(".tag").first).to_contain_text("cost 0.000053 USD")
    expect(call).to_contain_text("0.000053 USD (Configured)")
    run_text = console.page.locator("main").inner_text()
    console.page.goto(console.url("/statistics"))
    expect(console.page.locator("[data-count=cost] .big")).to_have_text("0.000053")
    totals = console.page.locator(".chart-total", has_text="USD")
    expect(totals).to_have_count(2)  # the cost plots, by agent and by model
    for index in range(2):
        expect(totals.nth(index)).to_have_text("0.000053 USD in all")
    statistics_text = console.page.locator("main").inner_text()
    for text in (row_text, run_text, statistics_text):
        assert not SCIENTIFIC.search(text.replace(run_id, "").replace(run_id[:8], "")), text
    console.screenshot("statistics-tiny-cost")


def test_the_approvals_inbox_approves_and_rejects(console: Console) -> None:
    approved_run, rejected_run = console.submit("closer"), console.submit("closer")
    for run_id in (approved_run, rejected_run):
        console.wait_for(run_id, "Waiting")
    store = console.runtime.approval_store
    pending = {
        a.run_id: a.id
        for a in store.page(None, status="Pending", run_id=None, limit=9, before=None)
    }
    console.sign_in()
    console.page.goto(console.url("/approvals"))
    expect(console.page.locator("article.approval")).to_have_count(2)
    expect(console.page.locator("article.approval").first).to_contain_text('"account": "ACME-7"')
    console.screenshot("approvals")

    card = console.page.locator(f"#approval-{pending[approved_run]}")
    card.locator("textarea").fill("checked with the customer")
    card.locator("button[value=approve]").click()
    expect(console.page.locator(".flash-ok")).to_contain_text("Approved")
    console.page.locator(f"#approval-{pending[rejected_run]} button[value=reject]").click()
    expect(console.page.locator(".flash-ok")).to_contain_text("Rejected")
    expect(console.page.locator("article.approval")).to_have_count(0)

    approval = store.get(pending[approved_run])
    assert approval is not None
    assert (approval.status, approval.comment) == ("Approved", "checked with the customer")
    assert approval.decided_by == f"key:{console.key.split('_')[1]}"
    rejected = store.get(pending[rejected_run])
    assert rejected is not None and rejected.status == "Rejected"
    console.wait_for(approved_run, "Completed")
    console.wait_for(rejected_run, "Completed", "Failed")
    console.page.goto(console.url("/approvals?status=all"))
    expect(console.page.locator("article.approval .badge.status-approved")).to_have_count(1)
    expect(console.page.locator("article.approval .badge.status-rejected")).to_have_count(1)


def test_the_circuits_page_lists_every_provider(console: Console) -> None:
    console.sign_in()
    console.page.goto(console.url("/circuits"))

    rows = console.page.locator("tr[data-provider]")
    expect(rows).to_have_count(len(SECTIONS["Providers"]))
    expect(console.page.locator("tr[data-provider=scripted]")).to_contain_text("closed")
    console.screenshot("circuits")


def test_the_statistics_page_plots_runs_tokens_and_cost(console: Console) -> None:
    for agent in ("support", "triage"):
        console.wait_for(console.submit(agent), "Completed")
    console.sign_in()

    console.page.goto(console.url("/statistics"))

    expect(console.page.locator("svg.plot")).to_have_count(6)
    by_agent = console.page.locator("section.panel").nth(1)
    expect(by_agent.locator(".legend").first).to_contain_text("support")
    expect(by_agent.locator(".legend").first).to_contain_text("triage")
    assert console.page.locator("svg.plot rect").count() >= 6
    expect(console.page.locator("section.totals")).to_contain_text("3")  # two roots, a child
    console.screenshot("statistics")
    console.page.click("text=Last 7 days")
    expect(console.page.locator("svg.plot")).to_have_count(6)


def test_the_statistics_page_shows_the_tenants_runs_in_dispatch_and_the_rate_limits(
    console: Console,
) -> None:
    rt = console.runtime
    acme = rt.tenants.ensure_tenant("acme")
    # Given a Running run, a Waiting one, and one parked by its provider's rate limit
    running = console.submit("long")
    console.wait_for_event(running, "ToolCallStarted")
    console.wait_for(console.submit("closer"), "Waiting")
    rt.rate_limits.learn("held", "support-model", 120)  # the provider said: wait 2 minutes
    console.wait_for_event(console.submit("held"), "RunParked")
    # and another tenant's parked run, which acme's page must not count
    console.wait_for_event(console.submit("held", key=console.other_key), "RunParked")
    # and a worker of one slot, whose one place the Running run holds: acme's next two runs
    # wait in acme's fair line, Queued
    rt.fair_store.register("w1", 1, {acme: 3})
    rt.tenants.set_weight(acme, 3)
    rt.tenants.set_max_concurrent_runs(acme, 4)
    # (the parked runs' places go as their executions end, just after `RunParked`)
    wait_until(lambda: rt.fair_store.depth().running == 1, timeout=5, what="one run running")
    lined = [console.submit("support"), console.submit("support")]
    assert rt.fair_store.lines() == {acme: 2}
    console.sign_in()

    console.page.goto(console.url("/statistics"))

    dispatch = console.page.locator("#dispatch")
    expect(dispatch.locator("[data-count=queued] .big")).to_have_text("3")  # 2 lined, 1 parked
    expect(dispatch.locator("[data-count=lined] .big")).to_have_text("2")
    expect(dispatch.locator("[data-count=running] .big")).to_have_text("1")
    expect(dispatch.locator("[data-count=waiting] .big")).to_have_text("1")
    expect(dispatch.locator("[data-setting=weight] .big")).to_have_text("3")
    expect(dispatch.locator("[data-setting=max-concurrent-runs] .big")).to_have_text("4")
    expect(dispatch.locator("table.parked tbody tr")).to_have_count(1)
    expect(dispatch.locator("tr[data-reason=rate_limit] td.num")).to_have_text("1")
    expect(dispatch).to_contain_text("cluster-wide")
    held = dispatch.locator("tr[data-scope=held]")
    expect(held).to_contain_text("/ 600 a minute")
    expect(held).to_contain_text("/ 100000 a minute")
    expect(held.locator("td").nth(4)).to_contain_text(" s")  # the provider's wait holds it
    expect(dispatch.locator("table.rate-limits tbody tr")).to_have_count(1)
    console.screenshot("statistics-dispatch")

    # and the other tenant sees its own runs only
    console.page.context.clear_cookies()
    console.sign_in(console.other_key)
    console.page.goto(console.url("/statistics"))
    expect(dispatch.locator("[data-count=queued] .big")).to_have_text("1")
    expect(dispatch.locator("[data-count=lined] .big")).to_have_text("0")
    expect(dispatch.locator("[data-count=running] .big")).to_have_text("0")
    expect(dispatch.locator("tr[data-reason=rate_limit] td.num")).to_have_text("1")
    expect(dispatch.locator("[data-setting=weight] .big")).to_have_text("1")
    assert [console.wait_for(run_id, "Queued").status for run_id in lined] == ["Queued"] * 2
    long_run = rt.runs.get(running)
    assert long_run is not None
    cancel_tree(rt.runs, rt.cancel_bus, rt.approval_store, long_run)
    console.wait_for(running, "Canceled")


def test_a_post_without_the_csrf_token_is_refused(console: Console) -> None:
    run_id = console.submit("closer")
    console.wait_for(run_id, "Waiting")
    (approval_id,) = console.runtime.approval_store.pending_ids(run_id)
    console.sign_in()
    request = console.page.request
    path = console.url(f"/approvals/{approval_id}/decision")

    missing = request.post(path, form={"decision": "approve"})
    forged = request.post(path, form={"decision": "approve", "csrf_token": "forged"})

    assert (missing.status, forged.status) == (400, 400)
    assert "security token" in missing.text()
    approval = console.runtime.approval_store.get(approval_id)
    assert approval is not None and approval.status == "Pending"


def test_another_tenants_run_is_404(console: Console) -> None:
    theirs = console.submit("support", key=console.other_key)
    console.wait_for(theirs, "Completed")
    console.sign_in()

    response = console.page.goto(console.url(f"/runs/{theirs}"))

    assert response is not None and response.status == 404
    expect(console.page.locator("h1")).to_contain_text("404")
    assert console.page.request.get(console.url(f"/console/live/runs/{theirs}")).status == 404
    console.page.goto(console.url("/"))
    expect(console.page.locator(f"tr[data-run-id='{theirs}']")).to_have_count(0)


def r_tenant(console: Console, run_id: str) -> str:
    run = console.runtime.runs.get(run_id)
    assert run is not None
    return run.tenant_id
