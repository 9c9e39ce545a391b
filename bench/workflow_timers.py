"""Durable timers at scale: 10,000 sleeping workflows wake within 1 s of their time.

`python -m bench.workflow_timers [--workflows 10000] [--spread 60] [--scan SECONDS]
[--databases sqlite,postgresql]`

Real SQL and Redis, one process: `--workflows` workflow runs (`bench.timer_workflows`'s
`sleeper`: a node, `ctx.sleep`, a node) are executed to their wait, each leaving the run
`Waiting` with no thread held. Their times are then set to start 5 s later, spread evenly over
`--spread` seconds (0: all at the same instant). One thread then does what beat and the
worker that holds the timers' lease do: every `Workflows.TimerScanInterval` (`--scan`, the
setting's default unless given) it runs the scan's pass, `WorkflowResumes.fire_due` with the
database's time, looking ahead as beat's task does (the waits due before the next tick are
answered each at its time). A wake is the run that continues the chain, written and sent (its
`created_at`, the database's time): its lateness is that time minus the timer's. The report
gives the lateness's p50, p99 and max, and how many woke.

Goal: p99 lateness at most 1 s with 10,000 timers, on SQLite and on PostgreSQL. A pass that
falls behind (more wakes due in one interval than it answers in it) shows as lateness growing
through the run, and the report prints the wakes per second the pass sustained.

PostgreSQL: a scratch database on the server of `TRACON_BENCH_POSTGRES` (dropped after); a
server that does not answer skips that row.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa

from beat_schedules.tasks import LOOK_AHEAD
from bench.__main__ import scratch_database
from bench.harness import met, percentile
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import Run, WorkflowNode
from tracon_jobs.embedded_redis import start_embedded
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings

SECOND = timedelta(seconds=1)
GOAL_SECONDS = 1.0
LEAD = timedelta(seconds=5)
"""From the end of the setup to the first timer."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workflow_timers")
    parser.add_argument("--workflows", type=int, default=10_000)
    parser.add_argument("--spread", type=float, default=60.0, help="seconds the times span")
    parser.add_argument("--scan", type=float, default=None, help="TimerScanInterval, seconds")
    parser.add_argument("--databases", default="sqlite,postgresql")
    args = parser.parse_args(argv)
    verdicts = []
    with ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="tracon-timers-"))
        cleanup.callback(shutil.rmtree, workdir, True)
        redis_server = start_embedded(workdir / "redis", executable=shutil.which("redis-server"))
        cleanup.callback(redis_server.stop)
        for database in args.databases.split(","):
            if database == "sqlite":
                url = f"sqlite:///{workdir / 'timers.db'}"
            else:
                found = scratch_database(cleanup)
                if found is None:
                    print("postgresql: no server answers; skipped")
                    continue
                url = found
            upgrade(url)
            verdicts.append(bench(database, url, redis_server.url, args))
    return 0 if all(verdicts) else 1


def bench(database: str, url: str, redis_url: str, args: argparse.Namespace) -> bool:
    sections: dict[str, object] = {
        "Database": {"Url": url},
        "Redis": {"Url": redis_url},
        "WorkflowModules": ["bench.timer_workflows"],
        "Workflows": {"EnableCheckpointing": True},
    }
    if args.scan is not None:
        sections["Workflows"] = {"EnableCheckpointing": True, "TimerScanInterval": args.scan}
    runtime = Runtime(Settings.model_validate(sections), sender=lambda _run_id: None)
    try:
        return _measure(database, runtime, args)
    finally:
        runtime.close()


def _measure(database: str, runtime: Runtime, args: argparse.Namespace) -> bool:
    tenant = runtime.tenants.ensure_tenant("bench")
    started = time.perf_counter()
    for _ in range(args.workflows):
        new = NewRun(tenant, "sleeper", {"seconds": 3600}, kind="workflow", session_id="s")
        run_id = runtime.runs.create(new).id
        assert runtime.executor.execute(run_id) == "Waiting"
    setup = time.perf_counter() - started
    nodes = sa.table(
        WorkflowNode.__tablename__, sa.column("run_id"), sa.column("kind"), sa.column("due_at")
    )
    first = runtime.db.now() + LEAD
    step = timedelta(seconds=args.spread / max(args.workflows - 1, 1))
    with runtime.db.write() as session:
        waiting = session.execute(
            sa.select(nodes.c.run_id).where(nodes.c.kind == "timer").order_by(nodes.c.run_id)
        ).scalars()
        for index, run_id in enumerate(list(waiting)):
            session.execute(
                sa.update(nodes).where(nodes.c.run_id == run_id).values(due_at=first + index * step)
            )
    interval = runtime.settings.workflows.timer_scan_interval.total_seconds()
    last = first + args.spread * timedelta(seconds=1)
    busy: list[float] = []
    stop = threading.Event()

    def scan() -> None:  # beat's tick and the lease owner's pass
        while not stop.is_set():
            began = time.perf_counter()
            runtime.workflow_resumes.fire_due(runtime.db.now(), interval * LOOK_AHEAD * SECOND)
            spent = time.perf_counter() - began
            busy.append(spent)
            stop.wait(max(interval - spent, 0.0))

    scanner = threading.Thread(target=scan, name="timers", daemon=True)
    scanner.start()
    deadline = time.monotonic() + LEAD.total_seconds() + args.spread + 120
    while _woken(runtime) < args.workflows and time.monotonic() < deadline:
        time.sleep(0.5)
    stop.set()
    scanner.join()
    late = _lateness(runtime)
    woken = len(late)
    p50, p99 = percentile(late, 0.50), percentile(late, 0.99)
    worst = max(late, default=float("nan"))
    rate = woken / max(sum(busy), 1e-9)
    ok = woken == args.workflows and p99 <= GOAL_SECONDS
    print(
        f"{database}: {woken} of {args.workflows} sleeping workflows woke "
        f"(times spread over {args.spread:g} s, scan every {interval:g} s; "
        f"set up in {setup:.0f} s); lateness p50 {p50 * 1000:.0f} ms, "
        f"p99 {p99 * 1000:.0f} ms, max {worst * 1000:.0f} ms; "
        f"the passes answered {rate:.0f} wakes a second of their own time; "
        f"last timer at +{(last - first).total_seconds():.0f} s "
        f"(goal p99 <= {GOAL_SECONDS:g} s: {met(ok)})"
    )
    return ok


def _woken(runtime: Runtime) -> int:
    with runtime.db.read() as session:
        return int(
            session.execute(
                sa.select(sa.func.count()).where(Run.continued_from_run_id.is_not(None))
            ).scalar_one()
        )


def _lateness(runtime: Runtime) -> list[float]:
    """Each wake's continuation `created_at` minus its timer's time, in seconds."""
    query = sa.select(WorkflowNode.due_at, Run.created_at).join(
        Run, Run.continued_from_run_id == WorkflowNode.run_id
    )
    with runtime.db.read() as session:
        rows = session.execute(query.where(WorkflowNode.kind == "timer")).all()
    return [(created - due).total_seconds() for due, created in rows if due is not None]


if __name__ == "__main__":
    sys.exit(main())
