"""The console in a real browser: Debian's chromium driven by Playwright, against the Flask app
served on a free port by a thread, with runs executed by the executor on threads.

Chromium is the system one (`/usr/bin/chromium`, from `apt-get install chromium`); Playwright
never downloads a browser here. Without it these tests skip, saying so; under CI (`CI` set) they
fail (`.ci/services` installs it first).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from playwright.sync_api import Browser, Page, expect, sync_playwright
from werkzeug.serving import BaseWSGIServer, make_server

from tests.helpers import (
    MakeRuntime,
    ThreadWorker,
    event_types,
    missing_service,
    wait_until,
)
from tracon_jobs.db.models import Run
from tracon_jobs.runtime import Runtime
from web import create_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ROOT = Path(__file__).resolve().parents[2]
KEPT_SCREENSHOTS = ROOT / "var" / "screenshots"
"""Where the run page and statistics page screenshots are copied, to look at after a run."""
KEPT = {"run", "statistics"}
WAIT_SECONDS = 15.0

SECTIONS: dict[str, Any] = {
    "Providers": {
        "scripted": {
            "Kind": "scripted",
            "Script": [
                {
                    "ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}],
                    "InputTokens": 120,
                    "OutputTokens": 18,
                },
                {"Text": "Order A-1 has shipped.", "InputTokens": 160, "OutputTokens": 12},
            ],
        },
        "router": {
            "Kind": "scripted",
            "Script": [
                {"ToolCalls": [{"Name": "support", "Arguments": {"message": "Where is A-1?"}}]},
                {"Text": "Support says it shipped."},
            ],
        },
        "steady": {
            "Kind": "scripted",
            "Script": [
                {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 3}}]},
                {"Text": "done waiting"},
            ],
        },
        "long": {
            "Kind": "scripted",
            "Script": [
                {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 60}}]},
                {"Text": "never"},
            ],
        },
        "held": {
            "Kind": "scripted",
            "RequestsPerMinute": 600,
            "TokensPerMinute": 100_000,
            "Script": [{"Text": "after the wait"}],
        },
        "gate": {
            "Kind": "scripted",
            "Script": [
                {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "ACME-7"}}]},
                {"Text": "Handled."},
            ],
        },
        "stuck": {"Kind": "scripted", "Script": [{"Text": "never", "DelaySeconds": 60}]},
        "tiny": {  # 130 in, 100 out at the tiny model's prices: 0.000053
            "Kind": "scripted",
            "Script": [{"Text": "Cheap.", "InputTokens": 130, "OutputTokens": 100}],
        },
        "drafter": {"Kind": "scripted", "Script": [{"Text": "Sorry for the delay."}]},
    },
    "Agents": {
        "support": {
            "Instructions": "Answer order questions.",
            "Model": {"provider": "scripted", "model": "support-model"},
            "Tools": ["lookup_order"],
        },
        "triage": {
            "Instructions": "Route the question.",
            "Model": {"provider": "router", "model": "router-model"},
            "SubAgents": ["support"],
        },
        "steady": {
            "Model": {"provider": "steady", "model": "support-model"},
            "Tools": ["slow_step"],
        },
        "long": {"Model": {"provider": "long", "model": "support-model"}, "Tools": ["slow_step"]},
        "held": {"Model": {"provider": "held", "model": "support-model"}},
        "closer": {
            "Model": {"provider": "gate", "model": "support-model"},
            "Tools": ["close_account"],
        },
        "stuck": {"Model": {"provider": "stuck", "model": "support-model"}},
        "tiny": {"Model": {"provider": "tiny", "model": "tiny-model"}},
        "demo": {"Model": {"provider": "drafter", "model": "support-model"}},  # review's drafter
    },
    "Pricing": {
        "Models": {
            "support-model": {"InputPerMillion": 2.5, "OutputPerMillion": 10},
            "router-model": {"InputPerMillion": 0.15, "OutputPerMillion": 0.6},
            "tiny-model": {"InputPerMillion": 0.1, "OutputPerMillion": 0.4},
        }
    },
    "ToolModules": ["tests.tools"],
    "WorkflowModules": ["tests.workflows"],
    "Workflows": {"EnableCheckpointing": True},
}


@dataclass
class Console:
    """The served console, its runtime, two tenants' keys, and a browser page."""

    runtime: Runtime
    app: Flask
    base: str
    page: Page
    key: str
    other_key: str
    shots: Path
    console_errors: list[str] = field(default_factory=list)

    def url(self, path: str) -> str:
        return self.base + path

    def api(self) -> FlaskClient:
        return self.app.test_client()

    def submit(self, agent: str, message: str = "Where is A-1?", key: str | None = None) -> str:
        """Start a run through the HTTP API, as a client would; its id."""
        response = self.api().post(
            f"/api/agents/{agent}/run",
            json={"message": message, "sessionId": "ticket-4182"},
            headers={"Authorization": f"Bearer {key or self.key}", "Prefer": "respond-async"},
        )
        assert response.status_code == 202, response.get_data(as_text=True)
        run_id: str = response.get_json()["runId"]
        return run_id

    def wait_for(self, run_id: str, *statuses: str) -> Run:
        seen: list[Run] = []

        def reached() -> bool:
            run = self.runtime.runs.get(run_id)
            seen[:] = [] if run is None else [run]
            return run is not None and run.status in statuses

        wait_until(reached, what=f"run {run_id} in {statuses}", timeout=WAIT_SECONDS)
        return seen[0]

    def wait_for_event(self, run_id: str, type_: str) -> None:
        wait_until(
            lambda: type_ in event_types(self.runtime, run_id),
            what=f"a {type_} event of run {run_id}",
            timeout=WAIT_SECONDS,
        )

    def sign_in(self, key: str | None = None) -> None:
        self.page.goto(self.url("/signin"))
        self.page.fill("#key", key or self.key)
        self.page.click("button[type=submit]")
        self.page.wait_for_url(self.url("/"))

    def screenshot(self, name: str) -> Path:
        """A full-page screenshot under the test session's tmp dir (and var/screenshots/
        for the run and statistics pages)."""
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        if name in KEPT:
            KEPT_SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, KEPT_SCREENSHOTS / path.name)
        return path


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        missing_service(
            f"no chromium at {CHROMIUM}: apt-get install -y chromium (see .ci/services)"
        )
    expect.set_options(timeout=WAIT_SECONDS * 1000)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots", numbered=False)


@pytest.fixture
def served(
    make_runtime: MakeRuntime, sqlite_url: str, thread_worker: ThreadWorker
) -> Iterator[tuple[Runtime, Flask, str]]:
    runtime = make_runtime(sqlite_url, **SECTIONS)
    runtime.send_runs_with(thread_worker.sender(runtime))
    app = create_app(runtime, {"TESTING": True, "SECRET_KEY": "browser-tests"})
    server: BaseWSGIServer = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield runtime, app, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(5)


@pytest.fixture
def console(browser: Browser, served: tuple[Runtime, Flask, str], shots: Path) -> Iterator[Console]:
    runtime, app, base = served
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    other = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("globex")).secret
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_SECONDS * 1000)
    found = Console(runtime, app, base, page, key, other, shots)
    page.on("console", lambda m: found.console_errors.append(m.text) if m.type == "error" else None)
    page.on("dialog", lambda dialog: dialog.accept())
    yield found
    context.close()
