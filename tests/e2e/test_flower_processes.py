"""What operators see of real processes: Flower's task list (a failed run is a failed task
with the run's error, a canceled one revoked, run id, agent and tenant in the kwargs, no
periodic ticks), the worker's metrics port and JSON logs, and `/metrics` of a gunicorn web
with several workers (multiprocess mode)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, Process, wait_until
from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.metrics import WORKER_PORT_ENV
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def agents() -> dict[str, Any]:
    """`demo` completes; `broken` meets a 400; `slow` waits 60 s; `toolish` calls a tool
    that raises; requeue ticks every second."""
    sections = scripted_agent([{"Text": "done"}])
    providers, defined = sections["Providers"], sections["Agents"]
    for name, script, tools in [
        ("broken", [{"ErrorStatus": 400}], []),
        ("slow", [{"Text": "late", "DelaySeconds": 60}], []),
        (
            "toolish",
            [
                {"ToolCalls": [{"Name": "failing_tool", "Arguments": {"reason": "kaboom"}}]},
                {"Text": "the tool broke"},
            ],
            ["failing_tool"],
        ),
    ]:
        providers[name] = {"Kind": "scripted", "Script": script}
        defined[name] = {
            "Instructions": name,
            "Model": {"provider": name, "model": "demo-model"},
            "Tools": tools,
        }
    sections["Runs"] = {"RequeueAfter": "00:00:04"}
    return sections


def flower_tasks(base: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{base}/api/tasks", timeout=5)
    response.raise_for_status()
    tasks: dict[str, dict[str, Any]] = response.json()
    return tasks


def task_of(base: str, run_id: str) -> dict[str, Any] | None:
    for task in flower_tasks(base).values():
        if run_id in str(task.get("kwargs")) or run_id in str(task.get("args")):
            return task
    return None


def wait_task_state(base: str, run_id: str, state: str, timeout: float = 30) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def reached() -> bool:
        task = task_of(base, run_id)
        if task is not None:
            found.update(task)
        return task is not None and task.get("state") == state

    wait_until(reached, timeout=timeout, what=f"Flower task of run {run_id} {state}: {found}")
    return found


def submit(runtime: Runtime, tenant: str, agent: str) -> str:
    return runtime.dispatcher.submit(NewRun(tenant, agent, {"message": "go"})).id


def status_of(runtime: Runtime, run_id: str) -> str:
    run = runtime.runs.get(run_id)
    assert run is not None
    return run.status


def has_status(runtime: Runtime, run_id: str, status: str) -> Callable[[], bool]:
    return lambda: status_of(runtime, run_id) == status


def start_flower(cluster: Cluster) -> tuple[Process, str]:
    port = free_port()
    cluster.env["FLOWER_UNAUTHENTICATED_API"] = "true"  # bound to 127.0.0.1 only
    flower = cluster.start("flower", "flower", "--address=127.0.0.1", f"--port={port}")
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(f"{base}/api/tasks", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, timeout=30, what="Flower's API", watch=[flower])
    return flower, base


def test_flower_shows_failed_runs_as_failed_tasks_with_run_ids_and_no_periodic_ticks(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    sections = agents()
    cluster = make_cluster(sqlite_url, **sections)
    metrics_port = free_port()
    cluster.env[WORKER_PORT_ENV] = f"127.0.0.1:{metrics_port}"
    cluster.env["TRACON_LOG_FORMAT"] = "json"
    worker = cluster.worker("w1")
    _flower, flower = start_flower(cluster)
    beat = cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")

    # Flower follows events from when it connects: wait until it saw a first run
    def flower_sees_a_run() -> bool:
        run_id = submit(runtime, tenant, "demo")
        try:
            wait_task_state(flower, run_id, "SUCCESS", timeout=3)
        except Exception:
            return False
        return True

    wait_until(flower_sees_a_run, timeout=40, what="Flower following task events")

    # When runs complete, fail, call a tool that raises, and get canceled
    completed = submit(runtime, tenant, "demo")
    failed = submit(runtime, tenant, "broken")
    tool_run = submit(runtime, tenant, "toolish")
    slow = submit(runtime, tenant, "slow")
    wait_until(lambda: status_of(runtime, slow) == "Running", timeout=20, what="slow run Running")
    slow_row = runtime.runs.get(slow)
    assert slow_row is not None
    cancel_tree(runtime.runs, runtime.cancel_bus, runtime.approval_store, slow_row)
    for run_id, status in [
        (completed, "Completed"),
        (failed, "Failed"),
        (tool_run, "Completed"),
        (slow, "Canceled"),
    ]:
        wait_until(has_status(runtime, run_id, status), timeout=30, what=f"{run_id} {status}")

    # Then Flower shows the completed run as SUCCESS, named by run id, agent and tenant
    task = wait_task_state(flower, completed, "SUCCESS")
    assert task["name"] == "tracon.runs.execute"
    assert f"'run_id': '{completed}'" in task["kwargs"]
    assert "'agent': 'demo'" in task["kwargs"] and "'tenant': 'acme'" in task["kwargs"]
    assert "Completed" in str(task["result"])
    # the failed run as FAILURE with the run's error
    task = wait_task_state(flower, failed, "FAILURE")
    assert "RunEndedFailed" in task["exception"]
    run = runtime.runs.get(failed)
    assert run is not None and run.error_type and run.error_type in task["exception"]
    assert "'agent': 'broken'" in task["kwargs"]
    # the canceled run as REVOKED, with why
    task = wait_task_state(flower, slow, "REVOKED")
    assert "canceled" in str(task.get("exception")).lower()

    # and the periodic requeue, ticking every second, never shows in the task list
    wait_until(
        lambda: worker.text().count("tracon.runs.requeue_unclaimed") >= 4,
        timeout=30,
        what="requeue ticks in the worker",
        watch=[beat],
    )
    # (a task Flower met mid-way, its `task-received` missed, has no name: not a periodic one)
    names = {t["name"] for t in flower_tasks(flower).values()} - {None}
    assert names == {"tracon.runs.execute"}, names

    # The worker's own metrics port shows what it executed
    response = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
    assert response.headers["Content-Type"] == CONTENT_TYPE
    text = response.text
    assert 'tracon_run_duration_seconds_count{agent="demo",status="Completed"}' in text
    assert 'tracon_run_deliveries_total{outcome="Failed"} 1.0' in text
    assert 'tracon_run_deliveries_total{outcome="Canceled"} 1.0' in text
    assert 'tracon_tool_calls_total{outcome="failed",tool="failing_tool"} 1.0' in text
    assert "tracon_worker_draining 0.0" in text

    # and its JSON log holds the tool's traceback on a line naming the run
    lines = [json.loads(line) for line in worker.text().splitlines() if line.startswith("{")]
    [tool_line] = [line for line in lines if line["logger"] == "tracon_jobs.runs.toolrunner"]
    assert tool_line["level"] == "ERROR"
    assert (tool_line["run_id"], tool_line["tenant"], tool_line["agent"]) == (
        tool_run,
        "acme",
        "toolish",
    )
    assert "ValueError: kaboom" in tool_line["exc_info"]


def test_metrics_of_a_web_with_several_workers_add_up_and_show_runs_from_sql(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    sections = scripted_agent([{"Text": "done"}])
    cluster = make_cluster(sqlite_url, **sections)
    cluster.worker("w1")
    _web, base = cluster.web(workers=3)
    runtime = make_runtime(sqlite_url, **sections)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    headers = {"Authorization": f"Bearer {key}", "Prefer": "respond-async"}

    # When 9 runs are submitted to whichever gunicorn worker takes each request
    def post(_: int) -> str:
        body = {"message": "go"}
        response = httpx.post(f"{base}/api/agents/demo/run", headers=headers, json=body)
        assert response.status_code == 202, response.text
        return str(response.json()["runId"])

    with ThreadPoolExecutor(9) as pool:  # at once, so that several workers take some
        run_ids = list(pool.map(post, range(9)))
    for run_id in run_ids:
        wait_until(has_status(runtime, run_id, "Completed"), timeout=30, what=run_id)

    # Then every scrape, whichever worker answers it, counts all 9 messages and all 9 runs
    for _ in range(6):
        with httpx.Client(timeout=10) as client:  # a new connection: maybe another worker
            response = client.get(f"{base}/metrics")
        assert response.headers["Content-Type"] == CONTENT_TYPE
        text = response.text
        assert 'tracon_run_messages_sent_total{outcome="sent"} 9.0' in text, text
        assert 'tracon_runs{agent="demo",status="Completed",tenant="acme"} 9.0' in text, text
