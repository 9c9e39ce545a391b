"""A deploy of workflow code with real processes: web and worker of version 1 leave two runs
waiting for an answer; version 2, deployed in their place (stopped, the module's file
replaced, started again), refuses to replay their chains and says why, naming both versions;
version 3, which declares it replays version 1's chains, completes the other run and, resumed,
the refused one. Each node body counts its runs in a file, so a replayed node is told from one
that ran again (docs/workflows.md, "Deploying new workflow code")."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import Cluster, Process
from tests.e2e.test_approvals_processes import status_is
from tests.e2e.test_workflow_waits_processes import ended
from tests.helpers import MakeRuntime, auth, run_of
from tests.helpers import log_lines as lines

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODULE = "deploy_flow"
CODE = """
import os
from pathlib import Path

from tracon_jobs import WorkflowContext, workflow


def node(value):
    with (Path(os.environ["TRACON_TEST_FLAGS"]) / "deploy-nodes.log").open("a") as handle:
        handle.write(value + "\\n")
    return value


@workflow("deploy-flow", version={version!r}, compatible={compatible!r})
def deploy_flow(ctx: WorkflowContext, input):
    first = ctx.step("a", node, "a")
    go = ctx.ask("go?")
    return [first, go, ctx.step("fee", node, {fee!r})]
"""


def deploy(
    cluster: Cluster, code: Path, version: str, compatible: list[str]
) -> tuple[list[Process], str]:
    """Version `version` of the module written, then a worker and a web node started on it."""
    (code / f"{MODULE}.py").write_text(
        CODE.format(version=version, compatible=compatible, fee=f"fee-{version}")
    )
    worker = cluster.worker(f"worker-v{version}")
    web, base = cluster.web(name=f"web-v{version}")
    return [worker, web], base


def post(base: str, key: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {**auth(key), "Prefer": "respond-async"}
    response = httpx.post(base + path, json=body, headers=headers, timeout=30)
    assert response.status_code == 202, response.text
    return dict(response.json())


def test_a_deploy_refuses_another_version_s_chain_and_replays_one_it_declares(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
    tmp_path: Path,
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    sections = {"WorkflowModules": [MODULE], "Workflows": {"EnableCheckpointing": True}}
    cluster = make_cluster(sqlite_url, **sections)
    cluster.env["PYTHONPATH"] = os.pathsep.join([str(code), cluster.env["PYTHONPATH"]])
    cluster.env["PYTHONDONTWRITEBYTECODE"] = "1"  # each deploy compiles the file it finds
    runtime = make_runtime(sqlite_url)  # reads SQL: it needs none of the code
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret

    # Given version 1 deployed, and two runs of it waiting for an answer
    processes, base = deploy(cluster, code, "1", [])
    runs = [post(base, key, "/api/workflows/deploy-flow/run", {"input": {}})["runId"]]
    runs.append(post(base, key, "/api/workflows/deploy-flow/run", {"input": {}})["runId"])
    for run_id in runs:
        status_is(runtime, run_id, "Waiting", 30)
        assert run_of(runtime, run_id).workflow_version == "1"

    # When version 2, which declares nothing, takes their place and the first is answered
    cluster.children.stop(processes)
    processes, base = deploy(cluster, code, "2", [])
    post(base, key, f"/api/workflows/runs/{runs[0]}/respond", {"answer": "yes"})

    # Then the continuation fails before its first node, naming both versions
    refused = run_of(runtime, ended(runtime, runs[0]))
    assert (refused.status, refused.error_type) == ("Failed", "workflow_version_mismatch")
    message = refused.error_message or ""
    assert "version '2' here" in message and "written by version '1'" in message, message
    assert refused.workflow_version == "2"
    assert lines(flags, "deploy-nodes") == ["a", "a"]  # nothing replayed, nothing ran again

    # When version 3, which replays version 1's chains, takes their place
    cluster.children.stop(processes)
    processes, base = deploy(cluster, code, "3", ["1"])
    post(base, key, f"/api/workflows/runs/{runs[1]}/respond", {"answer": "yes"})

    # Then the other run replays its first node and completes with version 3's last one
    done = run_of(runtime, ended(runtime, runs[1]))
    assert done.status == "Completed", done.error_message
    assert done.output == {"result": ["a", "yes", "fee-3"]}
    assert done.workflow_version == "3"
    assert lines(flags, "deploy-nodes") == ["a", "a", "fee-3"]

    # And the refused chain, resumed under version 3, goes on from its checkpoints
    resumed_id = post(base, key, f"/api/workflows/runs/{refused.id}/resume", {})["runId"]
    resumed = run_of(runtime, ended(runtime, resumed_id))
    assert resumed.status == "Completed", resumed.error_message
    assert resumed.output == {"result": ["a", "yes", "fee-3"]}
    assert lines(flags, "deploy-nodes") == ["a", "a", "fee-3", "fee-3"]
