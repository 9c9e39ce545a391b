"""Bulk answers raced through real processes: `tracon-jobs web` (two gunicorn processes) and a
worker, with many requests at once answering the same waiting workflow runs in orders of their
own. Each run is answered once, no request fails (on PostgreSQL two batches locking the same
questions in different orders deadlocked: one answered 503), and every answered run's chain
goes on in exactly one continuation, which the worker completes."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tracon_jobs.runs.store import RunFilter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

WAITING = 24
REQUESTS = 8


def test_bulk_answers_racing_across_web_processes_answer_each_run_once(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sql_url: str
) -> None:
    sections = scripted_agent([{"Text": "-"}]) | {
        "WorkflowModules": ["tests.workflows"],
        "Workflows": {"EnableCheckpointing": True},
    }
    cluster = make_cluster(sql_url, **sections)
    cluster.worker("w1", concurrency=8)
    _web, base = cluster.web(workers=2, threads=8)
    runtime = make_runtime(sql_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    headers = {"Authorization": f"Bearer {runtime.tenants.issue_key(tenant).secret}"}
    client = httpx.Client(base_url=base, headers=headers, timeout=30)

    # Given twenty-four workflow runs waiting for an answer, and one canceled while it waited
    def start() -> str:
        response = client.post(
            "/api/workflows/hundred/run", json={"input": {}}, headers={"Prefer": "respond-async"}
        )
        assert response.status_code == 202, response.text
        return str(response.json()["runId"])

    waiting = [start() for _ in range(WAITING)]
    canceled = start()

    def status_is(status: str, run_id: str) -> Callable[[], bool]:
        return lambda: run_of(runtime, run_id).status == status

    for run_id in [*waiting, canceled]:
        wait_until(status_is("Waiting", run_id), timeout=60, what=f"run {run_id} waiting")
    assert client.post(f"/api/runs/{canceled}/cancel").status_code in (200, 202)
    wait_until(lambda: run_of(runtime, canceled).status == "Canceled", timeout=30, what="canceled")

    # When eight requests at once answer them all, each in an order of its own: seven with the
    # canceled run among them (so each answers its runs one at a time, in savepoints: the
    # longest transactions, where the order of the locks matters most), one without (together)
    barrier = threading.Barrier(REQUESTS)

    def answer_all(seed: int) -> list[dict[str, Any]]:
        runs = [*waiting, canceled] if seed % 8 else waiting
        order = random.Random(seed).sample(runs, len(runs))
        body = {"answers": [{"runId": run_id, "answer": seed} for run_id in order]}
        with httpx.Client(base_url=base, headers=headers, timeout=60) as own:
            barrier.wait(timeout=30)
            response = own.post("/api/workflows/answers", json=body)
        assert response.status_code == 200, response.text
        items = list(response.json()["items"])
        assert [item["runId"] for item in items] == order
        return items

    with ThreadPoolExecutor(REQUESTS) as pool:
        answered = [item for items in pool.map(answer_all, range(REQUESTS)) for item in items]

    # Then each waiting run was answered by exactly one request, the canceled one by none, and
    # each answered run goes on in one continuation that completes with its answer
    winners = [item for item in answered if item["status"] == 202]
    assert sorted(item["runId"] for item in winners) == sorted(waiting)
    assert {item["status"] for item in answered if item["runId"] == canceled} == {409}
    for item in winners:
        continuation = item["continuationRunId"]
        wait_until(
            status_is("Completed", continuation), timeout=60, what=f"{continuation} completed"
        )
        assert run_of(runtime, continuation).continued_from_run_id == item["runId"]
    runs = runtime.runs.page(tenant, RunFilter(), limit=200, before=None)
    continued = sorted(str(run.continued_from_run_id) for run in runs if run.continued_from_run_id)
    assert continued == sorted(waiting)
    assert run_of(runtime, canceled).status == "Canceled"
    client.close()
