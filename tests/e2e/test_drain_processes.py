"""Graceful stops with real processes: a draining worker and a draining web node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, Process, wait_until
from tests.helpers import MakeRuntime, Script, scripted_agent
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def slow(seconds: float) -> dict[str, Any]:
    script: Script = [
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": seconds}}]},
        {"Text": "finished"},
    ]
    return scripted_agent(script, ["slow_step"])


def start_run(runtime: Runtime, flags: Path) -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    run_id = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "go"})).id
    log = flags / "slow_step.log"
    wait_until(lambda: log.exists() and bool(log.read_text()), timeout=30, what="tool started")
    return run_id


def sigterm_and_time_exit(process: Process, timeout: float = 30) -> float:
    started = time.monotonic()
    os.kill(process.popen.pid, signal.SIGTERM)  # the process itself, as an orchestrator does
    process.popen.wait(timeout=timeout)
    return time.monotonic() - started


def status(runtime: Runtime, run_id: str) -> str:
    run = runtime.runs.get(run_id)
    assert run is not None
    return run.status


@pytest.mark.parametrize(
    ("drain", "tool_seconds", "exits_within", "final"),
    [
        ({"Enabled": True, "Timeout": "00:00:10"}, 1.5, (1.0, 8.0), "Completed"),
        ({"Enabled": True, "Timeout": "00:00:01.500"}, 60, (1.3, 4.0), "Running"),
        ({"Enabled": False}, 60, (0.0, 1.0), "Running"),
    ],
    ids=["finishes-within-timeout", "stuck-run-cut-off", "no-drain-exits-at-once"],
)
def test_sigterm_to_a_worker(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
    drain: dict[str, Any],
    tool_seconds: float,
    exits_within: tuple[float, float],
    final: str,
) -> None:
    sections = slow(tool_seconds) | {"Drain": drain}
    worker = make_cluster(sqlite_url, **sections).worker("w1")
    runtime = make_runtime(sqlite_url, **sections)
    run_id = start_run(runtime, flags)

    took = sigterm_and_time_exit(worker)

    low, high = exits_within
    assert low <= took <= high, f"exited after {took:.2f}s"
    assert status(runtime, run_id) == final


def test_a_draining_web_node_refuses_new_runs_but_stays_reachable(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    sections = scripted_agent([{"Text": "hi"}]) | {
        "Drain": {"Enabled": True, "Timeout": "00:00:03"}
    }
    cluster = make_cluster(sqlite_url, **sections)
    web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    auth = {"Authorization": f"Bearer {key}"}

    started = time.monotonic()
    os.kill(web.popen.pid, signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 503, timeout=3, what="readyz 503")

    run = httpx.post(
        f"{base}/api/agents/demo/run",
        json={"message": "x"},
        headers={**auth, "Prefer": "respond-async"},
    )
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        headers=auth,
        json={"model": "demo", "messages": [{"role": "user", "content": "x"}]},
    )
    listing = httpx.get(f"{base}/api/runs", headers=auth)

    assert run.status_code == 503 and run.headers["content-type"] == "application/problem+json"
    assert chat.status_code == 503
    assert chat.json()["error"]["type"] == "service_unavailable"
    assert listing.status_code == 200 and listing.json()["items"] == []
    web.popen.wait(timeout=15)
    assert 2.5 <= time.monotonic() - started <= 10


def test_drain_command_makes_the_node_refuse_runs(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    cluster = make_cluster(sqlite_url, **scripted_agent([{"Text": "hi"}]))
    _web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **scripted_agent([{"Text": "hi"}]))
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret

    done = subprocess.run(
        [sys.executable, "-m", "tracon_jobs.cli", "drain"],
        env=cluster.env,
        cwd=cluster.directory,
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert done.returncode == 0, done.stderr
    response = httpx.post(
        f"{base}/api/agents/demo/run",
        json={"message": "x"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 503
    assert httpx.get(f"{base}/healthz").status_code == 200
