"""Plain helpers the tests import: configuration builders, run senders, the types of the
shared fixtures. The fixtures themselves are in tests/conftest.py, which no test imports."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn, Protocol

import pytest
from flask.testing import FlaskClient
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.waits import TIMEOUT_SLACK
from tracon_jobs.cli import supervisor
from tracon_jobs.db.models import Run
from tracon_jobs.runs.dispatch import Sender
from tracon_jobs.runs.lifecycle import Claim
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings, load_settings

Script = list[dict[str, Any]]
"""The `Script` of a scripted provider: one JSON step per model turn."""


class MakeRuntime(Protocol):
    """The `make_runtime` fixture: a `Runtime` on `sql_url` and the test's Redis, from
    configuration sections (`Agents=...`); closed after the test."""

    def __call__(
        self,
        sql_url: str,
        /,
        *,
        sender: Sender | None = None,
        child_claim_wait: float = ...,
        **sections: Any,
    ) -> Runtime: ...


def scripted_agent(script: Script, tools: list[str] | None = None) -> dict[str, Any]:
    """Providers + Agents sections for one agent `demo` on a scripted provider."""
    return {
        "Providers": {"scripted": {"Kind": "scripted", "Script": script}},
        "Agents": {
            "demo": {
                "Instructions": "test agent",
                "Model": {"provider": "scripted", "model": "demo-model"},
                "Tools": tools or [],
            }
        },
        "Pricing": {"Models": {"demo-model": {"InputPerMillion": 1, "OutputPerMillion": 2}}},
        "ToolModules": ["tests.tools"],
    }


POLL_INTERVAL = 0.02
"""Seconds between two looks of `wait_until`: short, since what a test waits for is near."""

ENDED = ("Completed", "Failed", "Canceled")
"""The statuses a run ends in."""


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    interval: float = POLL_INTERVAL,
    watch: Iterable[supervisor.Child] = (),
) -> float:
    """Poll `ready` until it holds, so a test waits for a fact rather than a fixed sleep; the
    seconds it took. TimeoutError naming `what` when it never holds, `ChildExited` as soon as
    a process of `watch` exits without it (the command's own `wait_until` does the polling)."""
    started = time.monotonic()
    supervisor.wait_until(
        ready, what=what, timeout=timeout * TIMEOUT_SLACK, watch=watch, interval=interval
    )
    return time.monotonic() - started


def wait_for_status(
    client: FlaskClient,
    key: str,
    run_id: str,
    *statuses: str,
    timeout: float = 10,
    interval: float = POLL_INTERVAL,
) -> dict[str, Any]:
    """The run JSON of `GET /api/runs/<run_id>` once its status is one of `statuses`."""
    last: dict[str, Any] = {}

    def reached() -> bool:
        last.update(client.get(f"/api/runs/{run_id}", headers=auth(key)).get_json())
        return last["status"] in statuses

    wait_until(reached, what=f"run {run_id} in {statuses}", timeout=timeout, interval=interval)
    return last


def auth(key: str, **headers: str) -> dict[str, str]:
    """Request headers authenticated with `key`, plus `headers`."""
    return {"Authorization": f"Bearer {key}", **headers}


def as_the_command_line(monkeypatch: pytest.MonkeyPatch, workdir: Path, config_path: Path) -> None:
    """Run `tracon_jobs.cli.main` as a user would, on this test's config file: none of the
    caller's `TRACON*` variables, in a directory of its own."""
    for name in list(os.environ):
        if name.upper().startswith("TRACON"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("TRACON_CONFIG", str(config_path))


def settings_from(path: Path) -> Settings:
    """The settings of a config file alone, whatever the environment says."""
    return load_settings(path, environ={})


def hold_queued(run_id: str) -> None:
    """A sender that sends nothing: every submitted run stays `Queued`."""


class ThreadWorker:
    """Stands in for a Celery worker: each sent run executes on a thread of its own.

    Every thread it starts is tracked, so the `thread_worker` fixture joins them before the
    runtimes close and the database goes away.
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def sender(self, runtime: Runtime) -> Sender:
        """A sender for `runtime.send_runs_with` that executes each run on a new thread."""

        def send(run_id: str) -> None:
            self.start(runtime.executor.execute, run_id)

        return send

    def start(self, target: Callable[[str], object], run_id: str, delay: float = 0) -> None:
        """`target(run_id)` on a tracked thread, after `delay` seconds."""
        thread = threading.Timer(delay, target, args=(run_id,))
        thread.daemon = True
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def join(self, timeout: float) -> list[threading.Thread]:
        """Wait up to `timeout` seconds in all for every thread, including those started
        meanwhile (a parent run sending its children); the ones still alive."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                threads = list(self._threads)
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            with self._lock:
                everything = list(self._threads)
            if len(everything) == len(threads) or time.monotonic() >= deadline:
                return [thread for thread in everything if thread.is_alive()]


def claim_run(runtime: Runtime, run_id: str, owner: str) -> Claim | None:
    """Claim a run as a worker would (`Queued` -> `Running`, a new fence), without running it."""
    claimed = runtime.runs.claim_and_load(run_id, owner)
    return None if claimed is None else claimed[0]


def run_once(runtime: Runtime, message: str = "go") -> Run:
    """A run of agent `demo` for tenant `acme`, executed to its end on this thread."""
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.runs.create(NewRun(tenant, "demo", {"message": message})).id
    runtime.executor.execute(run_id)
    return run_of(runtime, run_id)


def run_of(runtime: Runtime, run_id: str) -> Run:
    """The run, which must exist."""
    run = runtime.runs.get(run_id)
    assert run is not None, f"no run {run_id}"
    return run


def event_types(runtime: Runtime, run_id: str) -> list[str]:
    """The types of a run's events, in order."""
    return [event.type for event in runtime.runs.events(run_id)]


def log_lines(flags: Path, name: str) -> list[str]:
    """The lines a test tool (or workflow node) wrote to `<flags>/<name>.log`, across processes."""
    path = flags / f"{name}.log"
    return path.read_text().splitlines() if path.exists() else []


def missing_service(reason: str) -> NoReturn:
    """Skip the test for lack of a service (PostgreSQL, chromium); under CI (`CI` set, as
    `.ci/run` sets it) fail it instead, so CI never reports as run a suite that skipped."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason}; CI is set, so a missing service fails the test", pytrace=False)
    pytest.skip(reason)


def drop_idle_connections(postgres_url: str) -> None:
    """Drop every idle connection of the database, as a server restart does (and wait for
    them to go), from a connection outside the pools; fails when there was none to drop."""
    outside = create_engine(postgres_url, poolclass=NullPool)
    with outside.begin() as connection:
        dropped = connection.execute(
            text(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                " WHERE datname = current_database() AND state = 'idle'"
                " AND pid <> pg_backend_pid()"
            )
        ).all()
    outside.dispose()
    assert dropped, "the pool held no idle connection to drop"
