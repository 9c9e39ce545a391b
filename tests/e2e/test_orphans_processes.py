"""Reconciliation with continuation off, with real processes: a worker killed mid-run leaves a
`Running` record the orphan scan closes `Failed` (`orphaned`), and nothing continues it: no
new run in its session, no tool run again, however many scans pass after."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.e2e.cluster import FAST_RECONCILE, Cluster, Process, wait_until
from tests.helpers import MakeRuntime, Script, event_types, run_of, scripted_agent
from tests.helpers import log_lines as lines
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "record_step", "Arguments": {"step": "A"}}]},
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 60}}]},
    {"Text": "all done"},
]
SCAN = re.compile(r"tracon\.reconcile\.scan\[[^\]]+\] succeeded in [^:]+: (\{'orphaned'[^}]*\})")
"""A reconcile pass's log line in the worker that ran it, with its result."""


def scans(worker: Process) -> list[str]:
    """The results of the reconcile passes `worker` ran, in order."""
    return SCAN.findall(worker.text())


def runs_in_database(runtime: Runtime) -> int:
    with runtime.db.read() as session:
        return int(session.execute(select(func.count()).select_from(Run)).scalar_one())


@pytest.mark.parametrize(
    "continuation", [{"Enabled": False}, None], ids=["continuation-off", "continuation-default"]
)
def test_a_killed_worker_s_run_is_failed_orphaned_and_nothing_continues_it(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    flags: Path,
    continuation: dict[str, Any] | None,
) -> None:
    # Given a session-bound run (one continuation would pick up) inside slow_step on a
    # worker, with reconciliation on and continuation off
    sections = scripted_agent(SCRIPT, ["record_step", "slow_step"])
    sections["RunReconciliation"] = FAST_RECONCILE
    if continuation is not None:
        sections["RunContinuation"] = continuation
    cluster = make_cluster(sql_url, **sections)
    doomed = cluster.worker("doomed")
    cluster.start("beat", "beat")
    runtime = make_runtime(sql_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant, "demo", {"message": "go"}, session_id="support-42")
    run_id = runtime.dispatcher.submit(new).id
    wait_until(lambda: len(lines(flags, "slow_step")) == 1, timeout=30, what="slow_step started")

    # When the worker executing it is killed, with another one there to scan and to take
    # any continuation
    survivor = cluster.worker("survivor")
    doomed.kill9()
    (flags / "fast").touch()  # a continuation would finish its tool at once

    # Then the orphan scan closes it Failed, orphaned, and continues nothing
    wait_until(lambda: run_of(runtime, run_id).status == "Failed", timeout=20, what="orphaned")
    closed = run_of(runtime, run_id)
    assert (closed.error_type, closed.error_class) == ("orphaned", "Infrastructure")
    # (the pass that closed it logs its result once its task returns: a moment after the row)
    closed_by_the_scan = "{'orphaned': 1, 'canceled': 0, 'continued': 0}"
    wait_until(lambda: closed_by_the_scan in scans(survivor), timeout=10, what="the scan's result")
    # And still nothing after three more passes
    after = len(scans(survivor))
    wait_until(lambda: len(scans(survivor)) >= after + 3, timeout=20, what="three more passes")
    types = event_types(runtime, run_id)
    assert types[-1] == "RunFailed", types
    assert "RunContinued" not in types and "RunContinuationBlocked" not in types, types
    assert runs_in_database(runtime) == 1, "no run was started in its session"
    assert len(lines(flags, "record_step")) == 1 and len(lines(flags, "slow_step")) == 1
