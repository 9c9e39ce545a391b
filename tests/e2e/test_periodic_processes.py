"""Periodic services under a singleton lease, with real workers and beat: every tick runs
in the lease owner (ticks that reach another worker are forwarded to it), and an orphan is
still closed."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from sqlalchemy import update

from tests.e2e.cluster import Cluster, wait_for_log, wait_until
from tests.helpers import MakeRuntime, claim_run, scripted_agent
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SECTIONS = scripted_agent([{"Text": "hi"}]) | {
    "RunReconciliation": {
        "Enabled": True,
        "HeartbeatInterval": "00:00:00.200",
        "OrphanThreshold": "00:00:02",
        "ScanInterval": "00:00:00.500",
    },
    "SingletonExecution": {"Enabled": True, "LeaseDuration": "00:00:03"},
}
PASS = re.compile(r"tracon\.reconcile\.scan\[[^\]]+\] succeeded in [^:]+: \{'orphaned'")
FORWARD = re.compile(r"tracon\.reconcile\.scan\[[^\]]+\] succeeded in [^:]+: \{'forwardedTo'")


def test_every_scan_runs_in_the_lease_owner_and_closes_orphans(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
) -> None:
    cluster = make_cluster(sqlite_url, **SECTIONS)
    workers = [cluster.worker("w1"), cluster.worker("w2")]
    cluster.start("beat", "beat")
    runtime = make_runtime(sqlite_url, **SECTIONS)

    # Given a run left Running by a process that is gone
    tenant = runtime.tenants.ensure_tenant("acme")
    orphan = runtime.runs.create(NewRun(tenant, "missing-agent", {"message": "x"}))
    assert claim_run(runtime, orphan.id, "dead-process") is not None
    with runtime.db.write() as session:
        session.execute(
            update(Run)
            .where(Run.id == orphan.id)
            .values(heartbeat_at=runtime.db.now() - timedelta(minutes=5))
        )

    # When beat has sent a dozen ticks, to whichever worker took each
    wait_until(
        lambda: (
            sum(len(FORWARD.findall(w.text())) + len(PASS.findall(w.text())) for w in workers) >= 12
        ),
        timeout=60,
        what="a dozen scan ticks",
    )

    # Then the passes ran in one worker only; the other forwarded every tick it took
    passes = [len(PASS.findall(w.text())) for w in workers]
    forwards = [len(FORWARD.findall(w.text())) for w in workers]
    owner = passes.index(max(passes))
    assert passes[1 - owner] == 0 and forwards[owner] == 0
    assert passes[owner] >= forwards[1 - owner] > 0, "forwarded ticks ran in the owner"
    run = runtime.runs.get(orphan.id)
    assert run is not None and (run.status, run.error_type) == ("Failed", "orphaned")


def test_beat_stops_on_the_first_signal_and_stays_quiet_through_the_ones_after_it(
    make_cluster: Callable[..., Cluster], sqlite_url: str
) -> None:
    """Before: Celery's handler raised SystemExit on every signal, and `dev`'s SIGTERM after
    its SIGINT landed in the first handler's `Event.set` or the interpreter's exit (a
    traceback, about one stop in four here under this barrage)."""
    cluster = make_cluster(sqlite_url, **SECTIONS)
    for _ in range(3):
        beat = cluster.start("beat", "beat")
        wait_for_log(beat, "beat: Starting...", timeout=30)
        # Given beat in its loop, when SIGINT comes and then SIGTERM after SIGTERM
        beat.send(signal.SIGINT)
        sent = 0
        while beat.alive():
            beat.send(signal.SIGTERM)
            sent += 1
            time.sleep(0.0005)
        # Then it left, having kept its schedule and printed no traceback
        beat.popen.wait(timeout=10)
        out = beat.text()
        assert sent > 0
        assert "Traceback" not in out and "Exception ignored" not in out, out[-3000:]
        assert list((cluster.directory / "var").glob("celerybeat-schedule*"))
