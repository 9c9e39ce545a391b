"""Run retention with real processes: beat's pass (under the singleton lease, every second
here) deletes a group of runs once every run of it ended longer ago than `Runs.Retention`
(a workflow's fan-out: the workflow, its two agent children and the run that continued it),
archives it first, and leaves alone a group that is still live however old, and one that ended
too recently, until that one's time comes too."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.test_approvals_processes import status_is
from tests.e2e.test_workflow_waits_processes import chain_end, ended
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

RETENTION_SECONDS = 8


def group(runtime: Runtime, first: str) -> list[str]:
    """Every run of the chain from `first`, with each one's subtree."""
    ids: list[str] = []
    run_id: str | None = first
    while run_id is not None:
        run = run_of(runtime, run_id)
        ids += [member.id for member in runtime.runs.subtree(run)]
        following = (run.output or {}).get("continuedIn")
        run_id = str(following) if following else None
    return ids


def gone(runtime: Runtime, ids: list[str]) -> bool:
    return all(runtime.runs.get(run_id) is None for run_id in ids)


def test_beat_deletes_exactly_the_groups_that_ended_before_the_retention(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sqlite_url: str, tmp_path: Path
) -> None:
    archive = tmp_path / "archive"
    sections = scripted_agent([{"Text": "done"}]) | {
        "WorkflowModules": ["tests.workflows"],
        "Workflows": {"EnableCheckpointing": True},
        "Runs": {
            "Retention": f"00:00:0{RETENTION_SECONDS}",
            "RetentionScanInterval": "00:00:01",
            "ArchiveDirectory": str(archive),
        },
    }
    cluster = make_cluster(sqlite_url, **sections)
    cluster.worker("w1")
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")

    def submit(name: str, body: dict[str, object], kind: str = "workflow") -> str:
        new = NewRun(tenant, name, body, kind=kind, session_id="s", resumable=True)
        return runtime.dispatcher.submit(new).id

    # Given a fan-out that completed (a group of four runs) and a workflow waiting for an event
    old = submit("fan-agents", {"n": 2})
    live = submit("await-payment", {})
    assert run_of(runtime, ended(runtime, old)).status == "Completed"
    status_is(runtime, live, "Waiting", 30)
    doomed = group(runtime, old)
    assert len(doomed) == 4, doomed
    # and, 0.6 of the retention later, an agent run that completes then (the old group's time
    # comes that much before its: the window beat's passes have to tell the two apart)
    time.sleep(RETENTION_SECONDS * 0.6)
    recent = submit("demo", {"message": "hi"}, kind="agent")
    status_is(runtime, recent, "Completed", 30)

    # When beat's passes go on, the fan-out's whole group goes once its retention passed
    wait_until(lambda: gone(runtime, doomed), timeout=60, what="the old group deleted")

    # Then the recent run is still there, and the live workflow, older than the retention
    assert runtime.runs.get(recent) is not None
    assert run_of(runtime, live).status == "Waiting"
    assert chain_end(runtime, live).id == live
    assert sorted(p.name for p in archive.iterdir()) == [f"{old}.jsonl"]

    # And the recent run goes in its turn; the live one stays
    wait_until(lambda: gone(runtime, [recent]), timeout=60, what="the recent run deleted")
    assert run_of(runtime, live).status == "Waiting"
    assert sorted(p.name for p in archive.iterdir()) == sorted([f"{old}.jsonl", f"{recent}.jsonl"])
