"""The run page types a streaming answer as it arrives: a real OpenAI-compatible stream
(the stub, through the official client) read by the worker, its text published live, and
the page's panel growing in Chromium."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect
from werkzeug.serving import BaseWSGIServer, make_server

from tests.browser.conftest import WAIT_SECONDS
from tests.helpers import MakeRuntime, ThreadWorker, wait_until
from tests.stub_provider import Reply, StubProvider
from web import create_app

ANSWER = " ".join(f"word{i}" for i in range(40))


@pytest.fixture
def stub() -> Iterator[StubProvider]:
    with StubProvider() as started:
        yield started


def test_the_run_page_types_the_answer_as_it_streams(
    browser: Browser,
    make_runtime: MakeRuntime,
    sqlite_url: str,
    thread_worker: ThreadWorker,
    stub: StubProvider,
) -> None:
    stub.enqueue(Reply(ANSWER, chunks=40, chunk_delay=0.1))
    runtime = make_runtime(
        sqlite_url,
        Providers={"typist": {"Kind": "openai", "BaseUrl": stub.base_url, "TimeoutSeconds": 30}},
        Agents={"typist": {"Model": {"provider": "typist", "model": "typist-model"}}},
    )
    runtime.send_runs_with(thread_worker.sender(runtime))
    app = create_app(runtime, {"TESTING": True, "SECRET_KEY": "browser-tests"})
    server: BaseWSGIServer = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_SECONDS * 1000)
        page.goto(base + "/signin")
        page.fill("#key", key)
        page.click("button[type=submit]")
        page.wait_for_url(base + "/")

        submitted = app.test_client().post(
            "/api/agents/typist/run",
            json={"message": "Say forty words."},
            headers={"Authorization": f"Bearer {key}", "Prefer": "respond-async"},
        )
        assert submitted.status_code == 202, submitted.get_data(as_text=True)
        run_id = submitted.get_json()["runId"]
        page.goto(f"{base}/runs/{run_id}")

        seen: list[str] = []

        def typed_on() -> bool:
            text = page.locator("#turn-text-body").text_content() or ""
            if text and (not seen or seen[-1] != text):
                seen.append(text)
            return len(seen) >= 3

        wait_until(typed_on, what="three states of the answer on the page", timeout=WAIT_SECONDS)
        assert all(ANSWER.startswith(state) for state in seen), seen
        assert all(len(a) < len(b) for a, b in itertools.pairwise(seen)), seen
        assert len(seen[-1]) < len(ANSWER), "the page showed only the whole answer"
        expect(page.locator("#run-live[data-status=Completed]")).to_have_count(1)
        expect(page.locator("#turn-text")).to_be_hidden()
        expect(page.locator(".panel.summary")).to_contain_text("word39")
    finally:
        context.close()
        server.shutdown()
