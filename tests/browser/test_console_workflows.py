"""A workflow waiting on `ask`, answered in chromium: its run page shows the question (the
node and its payload) with a form, refuses an answer that is not JSON, and the answer sent
continues the workflow in a new run, which the console shows going on to its end. A workflow
waiting for an event shows the event with a form that delivers it, likewise."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import Console

pytestmark = pytest.mark.browser


def start_review(console: Console) -> str:
    """Start the `review` workflow (tests/workflows.py) through the HTTP API; its run id."""
    response = console.api().post(
        "/api/workflows/review/run",
        json={"input": {"orderId": "A-1"}, "sessionId": "ticket-77"},
        headers={"Authorization": f"Bearer {console.key}", "Prefer": "respond-async"},
    )
    assert response.status_code == 202, response.get_data(as_text=True)
    run_id: str = response.get_json()["runId"]
    return run_id


def test_a_waiting_workflow_shows_its_question_and_is_answered_from_its_page(
    console: Console,
) -> None:
    run_id = start_review(console)
    console.sign_in()
    page = console.page
    page.goto(console.url(f"/runs/{run_id}"))  # drawn with it, or once the run waits

    question = page.locator("#workflow-question")
    expect(question).to_be_visible()
    expect(question.locator(".mono").first).to_have_text("approve-reply#1")  # name#n
    expect(question.locator("pre.json")).to_contain_text('"draft": "Sorry for the delay."')
    expect(page.locator("h1 .badge")).to_have_text("Waiting")
    console.screenshot("workflow-question")

    # an answer that is not JSON is refused, and what was typed stays
    page.fill("#answer", "send it")
    page.click("#send-answer")
    expect(page.locator("#answer-error")).to_contain_text("not JSON")
    expect(page.locator("#answer")).to_have_value("send it")
    assert console.wait_for(run_id, "Waiting").status == "Waiting"
    assert [e for e in console.console_errors if "status of 400" not in e] == []
    console.console_errors.clear()  # the refused answer's 400, logged by chromium

    page.fill("#answer", '{"text": "send it"}')
    page.click("#send-answer")

    expect(page.locator(".flash-ok")).to_contain_text("Answered")
    expect(page).not_to_have_url(re.compile(rf"/runs/{run_id}"))
    expect(page.locator("#run-live[data-status=Completed]")).to_have_count(1)
    expect(page.locator(".summary")).to_contain_text("A-1: send it")
    expect(page.locator("#workflow-question")).to_have_count(0)
    continued = page.url.rsplit("/", 1)[-1]
    run = console.runtime.runs.get(continued)
    assert run is not None and run.continued_from_run_id == run_id
    assert run.output == {"result": {"reply": "A-1: send it"}}
    waited = console.wait_for(run_id, "Completed")
    assert waited.output == {"continuedIn": continued}

    page.goto(console.url(f"/runs/{run_id}"))
    expect(page.locator("#workflow-question")).to_have_count(0)
    expect(page.locator("#continued-in")).to_have_attribute("href", f"/runs/{continued}")
    assert console.console_errors == []


def test_a_question_answered_elsewhere_leaves_the_page(console: Console) -> None:
    run_id = start_review(console)
    console.wait_for(run_id, "Waiting")
    console.sign_in()
    console.page.goto(console.url(f"/runs/{run_id}"))
    expect(console.page.locator("#workflow-question")).to_be_visible()

    answered = console.api().post(
        f"/api/workflows/runs/{run_id}/respond",
        json={"answer": {"text": "sent by the API"}},
        headers={"Authorization": f"Bearer {console.key}", "Prefer": "respond-async"},
    )

    assert answered.status_code == 202
    expect(console.page.locator("#run-live[data-status=Completed]")).to_have_count(1)
    expect(console.page.locator("#workflow-question")).to_have_count(0)


def test_a_workflow_waiting_for_an_event_shows_it_and_it_is_delivered_from_its_page(
    console: Console,
) -> None:
    response = console.api().post(
        "/api/workflows/await-payment/run",
        json={"input": {}, "sessionId": "order-A-1"},
        headers={"Authorization": f"Bearer {console.key}", "Prefer": "respond-async"},
    )
    assert response.status_code == 202, response.get_data(as_text=True)
    run_id: str = response.get_json()["runId"]
    console.sign_in()
    page = console.page
    page.goto(console.url(f"/runs/{run_id}"))  # drawn with it, or once the run waits

    wait = page.locator("#workflow-question[data-kind=event]")
    expect(wait).to_be_visible()
    expect(wait.locator("h2")).to_contain_text("Waiting for event paid")
    expect(page.locator("h1 .badge")).to_have_text("Waiting")
    console.screenshot("workflow-event")

    # a payload that is not JSON is refused, and what was typed stays
    page.fill("#payload", "five")
    page.click("#send-event")
    expect(page.locator("#payload-error")).to_contain_text("not JSON")
    expect(page.locator("#payload")).to_have_value("five")
    assert console.wait_for(run_id, "Waiting").status == "Waiting"
    assert [e for e in console.console_errors if "status of 400" not in e] == []
    console.console_errors.clear()  # the refused payload's 400, logged by chromium

    page.fill("#payload", '{"amount": 5}')
    page.click("#send-event")

    expect(page.locator(".flash-ok")).to_contain_text("Event paid delivered")
    expect(page).not_to_have_url(re.compile(rf"/runs/{run_id}"))
    expect(page.locator("#run-live[data-status=Completed]")).to_have_count(1)
    expect(page.locator(".summary")).to_contain_text('"amount": 5')
    expect(page.locator("#workflow-question")).to_have_count(0)
    continued = page.url.rsplit("/", 1)[-1]
    run = console.runtime.runs.get(continued)
    assert run is not None and run.continued_from_run_id == run_id
    assert run.output == {"result": {"order": "A-1", "paid": {"amount": 5}}}
    assert console.wait_for(run_id, "Completed").output == {"continuedIn": continued}

    page.goto(console.url(f"/runs/{run_id}"))
    expect(page.locator("#workflow-question")).to_have_count(0)
    expect(page.locator("#continued-in")).to_have_attribute("href", f"/runs/{continued}")
    assert console.console_errors == []
