"""Run trees across real worker processes: one budget for the whole tree, and no deadlock
when every worker thread is a parent waiting for its child."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def tree_config(graph: dict[str, Any], children: int = 3) -> dict[str, Any]:
    calls = [
        {"ToolCalls": [{"Name": "helper", "Arguments": {"message": f"task {i}"}}]}
        for i in range(children)
    ]
    return {
        "Providers": {
            "boss": {"Kind": "scripted", "Script": [*calls, {"Text": "supervised"}]},
            "worker": {
                "Kind": "scripted",
                "Script": [
                    {
                        "ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A"}}],
                        "InputTokens": 100,
                        "OutputTokens": 20,
                        "DelaySeconds": 0.2,
                    },
                    {"Text": "helped", "InputTokens": 100, "OutputTokens": 20},
                ],
            },
        },
        "Agents": {
            "boss": {"Model": {"provider": "boss", "model": "boss-model"}, "SubAgents": ["helper"]},
            "helper": {
                "Model": {"provider": "worker", "model": "worker-model"},
                "Tools": ["lookup_order"],
            },
        },
        "Pricing": {
            "Models": {
                "boss-model": {"InputPerMillion": 1, "OutputPerMillion": 1},
                "worker-model": {"InputPerMillion": 100, "OutputPerMillion": 100},
            }
        },
        "ToolModules": ["tests.tools"],
        "AgentGraph": graph,
    }


def run_tree(runtime: Runtime, timeout: float = 60) -> tuple[Run, list[Run]]:
    tenant = runtime.tenants.ensure_tenant("acme")
    root_id = runtime.dispatcher.submit(NewRun(tenant, "boss", {"message": "go"})).id

    def ended() -> bool:
        run = runtime.runs.get(root_id)
        return run is not None and run.status in ("Completed", "Failed")

    wait_until(ended, timeout=timeout, what="the root run ended")
    root = runtime.runs.get(root_id)
    assert root is not None
    return root, [r for r in runtime.runs.tree(root_id, tenant) if r.id != root_id]


def refusals(runtime: Runtime, run_id: str) -> list[str]:
    return [
        e.data["error"]["message"]
        for e in runtime.runs.events(run_id)
        if e.type == "ToolCallFailed"
    ]


def owners(runtime: Runtime, runs: list[Run]) -> set[str]:
    return {
        next(e.data["owner"] for e in runtime.runs.events(r.id) if e.type == "RunStarted")
        for r in runs
    }


@pytest.mark.parametrize(
    ("graph", "children", "refused", "setting"),
    [
        ({"MaxDepth": 0}, 0, 3, "MaxDepth"),
        ({"MaxTotalRuns": 2}, 2, 1, "MaxTotalRuns"),
    ],
)
def test_child_limits_hold_across_two_worker_processes(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    graph: dict[str, Any],
    children: int,
    refused: int,
    setting: str,
) -> None:
    config = tree_config(graph)
    cluster = make_cluster(sqlite_url, **config)
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    runtime = make_runtime(sqlite_url, **config)

    root, kids = run_tree(runtime)

    assert root.status == "Completed", root.error_message
    assert len(kids) == children and all(k.status == "Completed" for k in kids)
    messages = refusals(runtime, root.id)
    assert len(messages) == refused and all(setting in m for m in messages)


@pytest.mark.parametrize(
    ("graph", "setting"),
    [
        ({"MaxTotalTokens": 500}, "MaxTotalTokens"),
        ({"MaxTotalCost": 0.05, "MaxTotalTokens": 0}, "MaxTotalCost"),
    ],
)
def test_tree_spend_limits_hold_across_two_worker_processes(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    graph: dict[str, Any],
    setting: str,
) -> None:
    # Each child spends 240 tokens (0.024 USD at the worker model's price)
    config = tree_config(graph)
    cluster = make_cluster(sqlite_url, **config)
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    runtime = make_runtime(sqlite_url, **config)

    root, kids = run_tree(runtime)

    assert root.status == "Failed" and root.error_type == "run_budget_exceeded"
    assert setting in (root.error_message or "")
    spent = sum(r.input_tokens + r.output_tokens for r in [root, *kids])
    assert 2 <= len(kids) <= 3, "the tree stopped at its limit"
    assert spent < 500 + 240 if setting == "MaxTotalTokens" else True


def test_no_deadlock_when_every_worker_thread_is_a_waiting_parent(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    config = tree_config({}, children=2)
    cluster = make_cluster(sqlite_url, **config)
    cluster.worker("only", concurrency=1)  # the parent holds the only thread
    runtime = make_runtime(sqlite_url, **config)

    started = time.monotonic()
    root, kids = run_tree(runtime, timeout=60)

    assert root.status == "Completed" and root.output == {"text": "supervised"}
    assert [k.status for k in kids] == ["Completed", "Completed"]
    assert len(owners(runtime, [root, *kids])) == 1, "the children ran inline in the parent"
    assert time.monotonic() - started < 30
