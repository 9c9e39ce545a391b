"""A continuation chain interrupted twice, with real worker processes killed with -9 while a
tool is in flight, on PostgreSQL: the orphan scan continues each run, and the chain ends
`Completed` once a later run of it resolved the call the earlier ones left in flight."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.cluster import FAST_RECONCILE, Cluster, Process, wait_until
from tests.helpers import MakeRuntime, Script, run_of, scripted_agent
from tests.helpers import event_types as events
from tests.helpers import log_lines as lines
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 120}}]},
    {"Text": "all done"},
]
"""`slow_step` blocks until the test writes the `fast` flag: each run of the chain is inside
it when its worker is killed."""


def continuation_of(runtime: Runtime, run_id: str) -> str:
    """Wait for the orphan scan to close the run and continue it; the continuation's id."""
    wait_until(lambda: "RunContinued" in events(runtime, run_id), timeout=20, what="continued")
    return str(
        next(
            e.data["continuationRunId"]
            for e in runtime.runs.events(run_id)
            if e.type == "RunContinued"
        )
    )


def kill_inside_the_tool(cluster: Cluster, owner: Process, flags: Path, calls: int) -> Process:
    """Once the tool has started `calls` times in all, kill its worker; the worker started
    just before, which the orphan scan and the continuation run on."""
    wait_until(
        lambda: len(lines(flags, "slow_step")) == calls, timeout=30, what=f"slow_step #{calls}"
    )
    survivor = cluster.worker(f"survivor-{calls}")
    owner.kill9()
    return survivor


@pytest.mark.parametrize("sql_url", ["postgresql"], indirect=True)
def test_a_chain_interrupted_twice_in_the_same_read_completes(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    flags: Path,
) -> None:
    # Given a session-bound run on one worker, with reconciliation and two continuations a chain
    sections = scripted_agent(SCRIPT, ["slow_step"]) | {
        "RunReconciliation": FAST_RECONCILE,
        "RunContinuation": {"Enabled": True, "MaxAttempts": 2},
    }
    cluster = make_cluster(sql_url, **sections)
    owner = cluster.worker("owner")
    cluster.start("beat", "beat")
    runtime = make_runtime(sql_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    first = runtime.dispatcher.submit(
        NewRun(tenant, "demo", {"message": "go"}, session_id="support-42")
    ).id

    # When its worker is killed inside the read, and the continuation's worker too
    second_owner = kill_inside_the_tool(cluster, owner, flags, calls=1)
    second = continuation_of(runtime, first)
    kill_inside_the_tool(cluster, second_owner, flags, calls=2)
    third = continuation_of(runtime, second)

    # And the second continuation repeats the read, which now returns
    wait_until(lambda: len(lines(flags, "slow_step")) == 3, timeout=30, what="slow_step #3")
    (flags / "fast").touch()

    # Then the chain completes: both runs' `started` rows were the one call it resolved
    wait_until(
        lambda: run_of(runtime, third).status not in ("Queued", "Running"),
        timeout=30,
        what="the second continuation ended",
    )
    run = run_of(runtime, third)
    assert (run.status, run.error_type) == ("Completed", None), run.error_message
    assert run.output == {"text": "all done"}
    assert [run_of(runtime, r).error_type for r in (first, second)] == ["orphaned"] * 2
    keys = lines(flags, "slow_step")
    assert len(keys) == 3 and len(set(keys)) == 1, "every run repeated the read with its key"
