"""The console's run page of a workflow that waits on the world, through the Flask test
client: a timer shows when it fires, an event wait shows its event (and its timeout) with a
form that delivers it as the events route does (CSRF-checked, JSON refused when it is not,
kept when no wait is open yet), and another tenant's run is a 404 that delivers nothing."""

from __future__ import annotations

import html
import re
from typing import Any

import pytest
from flask.testing import FlaskClient

from tests import workflows
from tests.console_client import signed_in, token_of
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime


@pytest.fixture(autouse=True)
def _clean() -> None:
    workflows.ran.clear()


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sqlite_url: str) -> Runtime:
    config: dict[str, Any] = scripted_agent([{"Text": "-"}])
    config |= {"WorkflowModules": ["tests.workflows"], "Workflows": {"EnableCheckpointing": True}}
    return make_runtime(sqlite_url, sender=lambda _run_id: None, **config)


def waiting(runtime: Runtime, name: str, payload: dict[str, Any], *, run: bool = True) -> str:
    """A run of workflow `name` of tenant acme, executed until it waits (`run`), else queued."""
    tenant_id = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant_id=tenant_id, agent=name, kind="workflow", input=payload, session_id="s")
    run_id = runtime.runs.create(new).id
    if run:
        assert runtime.executor.execute(run_id) == "Waiting"
    return run_id


def text_of(client: FlaskClient, path: str) -> str:
    page = client.get(path)
    assert page.status_code == 200
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page.get_data(as_text=True))).split())


def deliver(client: FlaskClient, run_id: str, payload: str, event: str = "paid") -> Any:
    form = {"csrf_token": token_of(client, "/"), "event": event, "payload": payload}
    return client.post(f"/runs/{run_id}/event", data=form)


def test_a_sleeping_workflow_shows_when_its_timer_fires(runtime: Runtime) -> None:
    run_id = waiting(runtime, "nap", {"seconds": 600})
    node = runtime.workflow_store.request_of(run_id)
    assert node is not None and node.kind == "timer" and node.due_at is not None

    text = text_of(signed_in(runtime, "acme"), f"/runs/{run_id}")

    assert f"Sleeping until {node.due_at:%Y-%m-%d %H:%M:%S} UTC timer sleep#1" in text
    assert "Deliver event" not in text and "Send answer" not in text


def test_an_event_wait_shows_its_event_and_timeout(runtime: Runtime) -> None:
    without = waiting(runtime, "await-payment", {})
    timed = waiting(runtime, "await-payment", {"timeout": 3600})
    node = runtime.workflow_store.request_of(timed)
    assert node is not None and node.due_at is not None
    client = signed_in(runtime, "acme")

    text = text_of(client, f"/runs/{without}")
    assert "Waiting for event paid event event:paid#1" in text and "until" not in text
    assert "Deliver event" in text and "TIMED_OUT" not in text
    text = text_of(client, f"/runs/{timed}")
    assert f"Waiting for event paid until {node.due_at:%Y-%m-%d %H:%M:%S} UTC" in text
    assert "TIMED_OUT" in text


def test_the_form_delivers_the_event_and_shows_the_run_that_goes_on(runtime: Runtime) -> None:
    run_id = waiting(runtime, "await-payment", {})
    client = signed_in(runtime, "acme")

    sent = deliver(client, run_id, '{"amount": 5}')

    assert sent.status_code in (302, 303)
    continuation = str(run_of(runtime, run_id).output["continuedIn"])  # type: ignore[index]
    assert sent.headers["Location"].endswith(f"/runs/{continuation}")
    assert "Event paid delivered" in text_of(client, f"/runs/{continuation}")
    assert runtime.executor.execute(continuation) == "Completed"
    assert run_of(runtime, continuation).output == {
        "result": {"order": "A-1", "paid": {"amount": 5}}
    }
    assert workflows.ran == ["open-order"]  # replayed, not run again

    # the chain has ended: refused, naming why, and nothing kept
    again = deliver(client, run_id, "1")
    assert again.status_code in (302, 303) and again.headers["Location"].endswith(run_id)
    assert "Not delivered" in text_of(client, f"/runs/{run_id}")
    assert runtime.workflow_store.kept_events(run_id) == 0


def test_an_event_before_its_wait_is_kept_for_it(runtime: Runtime) -> None:
    run_id = waiting(runtime, "await-payment", {}, run=False)
    client = signed_in(runtime, "acme")

    sent = deliver(client, run_id, "")  # no payload: null

    assert sent.status_code in (302, 303) and sent.headers["Location"].endswith(run_id)
    assert "Event paid kept" in text_of(client, f"/runs/{run_id}")
    assert runtime.workflow_store.kept_events(run_id, "paid") == 1
    assert runtime.executor.execute(run_id) == "Completed"
    assert run_of(runtime, run_id).output == {"result": {"order": "A-1", "paid": None}}


def test_a_payload_that_is_not_json_is_refused_and_the_run_keeps_waiting(
    runtime: Runtime,
) -> None:
    run_id = waiting(runtime, "await-payment", {})
    client = signed_in(runtime, "acme")

    refused = deliver(client, run_id, "five")

    assert refused.status_code == 400
    body = html.unescape(refused.get_data(as_text=True))
    assert "The payload is not JSON" in body and ">five</textarea>" in body
    assert run_of(runtime, run_id).status == "Waiting"
    assert runtime.workflow_store.kept_events(run_id) == 0


def test_another_tenants_run_or_a_form_without_its_token_delivers_nothing(
    runtime: Runtime,
) -> None:
    run_id = waiting(runtime, "await-payment", {})
    theirs = signed_in(runtime, "globex")

    assert theirs.get(f"/runs/{run_id}").status_code == 404
    assert deliver(theirs, run_id, "1").status_code == 404
    ours = signed_in(runtime, "acme")
    forged = ours.post(f"/runs/{run_id}/event", data={"event": "paid", "payload": "1"})
    assert forged.status_code == 400
    assert run_of(runtime, run_id).status == "Waiting"
    assert runtime.workflow_store.kept_events(run_id) == 0


def test_a_fan_out_shows_its_branches_and_what_each_came_to(runtime: Runtime) -> None:
    run_id = waiting(runtime, "fan", {})
    [child] = [run for run in runtime.runs.subtree(run_of(runtime, run_id)) if run.id != run_id]

    client = signed_in(runtime, "acme")
    text = text_of(client, f"/runs/{run_id}")

    assert "Waiting for its branches fan-out parallel#1 2 of 3 ended · fail fast" in text
    assert "0 score step this run done" in text
    assert f"1 agent:demo agent demo {child.id[:8]}" in text
    assert "running" in text
    assert "Waiting for an answer" not in text and "Send answer" not in text
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    assert f'href="/runs/{child.id}"' in page
