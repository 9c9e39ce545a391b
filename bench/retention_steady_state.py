"""Run retention under a steady load: tables and indexes stay bounded, and no statement of a
purge runs long.

`python -m bench.retention_steady_state [--hours 8] [--trees-per-hour 600] [--events 20]
[--retention 3600] [--scan 600] [--batch 200] [--databases sqlite,postgresql]`

Simulated time, real SQL: every `--scan` seconds of simulated time, the trees that ended in
that interval are written (a root and two children, each run with `--events` events and two
tool-call ledger rows), then one retention pass runs with that moment as `now`, as beat's
`tracon.runs.retention` would (`Runs.Retention` = `--retention`). After each simulated hour it
prints the rows of `runs` and `run_events` and the size of the tables and of their indexes
(SQLite: pages in use, from `dbstat` when the build has it; PostgreSQL: after a plain
`VACUUM`, the autovacuum's work, `pg_relation_size` and `pg_indexes_size`), and the slowest
statement the passes ran.

Goals: the `runs` table never holds more than the retention's worth of trees plus one scan
interval's; the tables' and indexes' peak size in the second half of the hours after the first
retention window is within 10% of the first half's (pages freed by deletions are reused;
PostgreSQL's b-trees over random UUIDs take a few windows to reach their steady size, and
VACUUM truncating a table's empty tail makes its size alternate); on PostgreSQL, each statement
that deletes a chunk of a full batch (`EXPLAIN ANALYZE`, rolled back, so the server's time
without the client's on a busy machine) runs in at most 100 ms, through an index. The client's
timings of the passes' statements are printed too.

PostgreSQL: a scratch database (`tracon_bench_<random>`, dropped after) on the server of
`TRACON_BENCH_POSTGRES`, as `make bench` does for B1; without one answering, that row is
skipped.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, func, insert, select, text
from sqlalchemy.engine import Engine

from bench.__main__ import POSTGRES_ADMIN, scratch_database
from bench.harness import met, percentile
from tracon_jobs.db import Database
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import Run, RunEvent, Tenant, ToolCallRecord
from tracon_jobs.runs.export import IDS_PER_STATEMENT
from tracon_jobs.runs.retention import RunRetention, delete_statements, due_roots

TABLES = ("runs", "run_events", "tool_calls")
SIZE_SLACK = 1.10
STATEMENT_GOAL_MS = 100.0


@dataclass
class Options:
    hours: int
    trees_per_hour: int
    events: int
    retention: timedelta
    scan: timedelta
    batch: int
    databases: list[str]


@dataclass
class Hour:
    hour: int
    runs: int
    events: int
    table_bytes: int
    index_bytes: int


@dataclass
class Outcome:
    name: str
    hours: list[Hour] = field(default_factory=list)
    peak_runs: int = 0
    slowest: list[tuple[str, float, float, int]] = field(default_factory=list)
    explained: list[Explained] = field(default_factory=list)
    purge_seconds: float = 0.0


class StatementClock:
    """How long each statement run while `watching` took (every engine of the process), by
    its first words (`DELETE FROM run_events`, `SELECT runs.id, runs.ended_at`)."""

    def __init__(self) -> None:
        self.watching = False
        self.times: dict[str, list[float]] = {}
        event.listen(Engine, "before_cursor_execute", self._before)
        event.listen(Engine, "after_cursor_execute", self._after)

    def _before(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        conn.info.setdefault("bench_started", []).append(time.perf_counter())

    def _after(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        started = conn.info["bench_started"].pop()
        if not self.watching:
            return
        ms = (time.perf_counter() - started) * 1000
        kind = " ".join(statement.split()[:4])
        self.times.setdefault(kind, []).append(ms)

    def slowest(self, top: int = 4) -> list[tuple[str, float, float, int]]:
        """(kind, max ms, p99 ms, count) of the kinds whose slowest took longest."""
        rows = [
            (kind, max(times), percentile(times, 0.99), len(times))
            for kind, times in self.times.items()
        ]
        return sorted(rows, key=lambda row: row[1], reverse=True)[:top]

    @contextmanager
    def watch(self) -> Iterator[None]:
        self.watching = True
        try:
            yield
        finally:
            self.watching = False


def write_trees(db: Database, tenant: str, count: int, ended: datetime, events: int) -> None:
    """`count` trees of three runs that ended at `ended`, with their events and ledger rows."""
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    created = ended - timedelta(minutes=1)
    for _ in range(count):
        root = str(uuid.uuid4())
        for depth, run_id in enumerate([root, str(uuid.uuid4()), str(uuid.uuid4())]):
            runs.append(
                {
                    "id": run_id,
                    "tenant_id": tenant,
                    "agent": "bench",
                    "status": "Completed",
                    "input": {"message": "steady"},
                    "parent_run_id": None if depth == 0 else root,
                    "root_run_id": root,
                    "depth": min(depth, 1),
                    "event_seq": events,
                    "created_at": created,
                    "ended_at": ended,
                }
            )
            rows += [
                {"run_id": run_id, "seq": seq, "type": "Step", "at": created, "data": {"n": seq}}
                for seq in range(1, events + 1)
            ]
            calls += [
                {
                    "run_id": run_id,
                    "turn": 1,
                    "call_id": f"c{n}",
                    "tool": "lookup",
                    "args_hash": "0" * 64,
                    "arguments": {"id": n},
                    "execution_id": str(uuid.uuid4()),
                    "idempotency_key": f"{run_id}:{n}",
                    "status": "succeeded",
                    "result": {"value": n},
                    "started_at": created,
                    "ended_at": ended,
                }
                for n in range(2)
            ]
    with db.write() as session:
        session.execute(insert(Run), runs)
        session.execute(insert(RunEvent), rows)
        session.execute(insert(ToolCallRecord), calls)


def sizes(db: Database) -> tuple[int, int]:
    """(tables, indexes) bytes of `TABLES`; SQLite without `dbstat`: all pages in use, as
    tables."""
    with db.engine.connect() as conn:
        if db.is_sqlite:
            try:
                found = conn.execute(
                    text("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name")
                ).all()
            except sa.exc.OperationalError:
                pages = conn.execute(text("PRAGMA page_count")).scalar_one()
                free = conn.execute(text("PRAGMA freelist_count")).scalar_one()
                size = conn.execute(text("PRAGMA page_size")).scalar_one()
                return (pages - free) * size, 0
            names = sa.inspect(conn)
            index_names = {f"sqlite_autoindex_{t}_{n}" for t in TABLES for n in range(1, 4)}
            index_names |= {str(index["name"]) for t in TABLES for index in names.get_indexes(t)}
            by_name: dict[str, int] = {str(name): int(size) for name, size in found}
            return (
                sum(int(by_name.get(table, 0)) for table in TABLES),
                sum(int(size) for name, size in by_name.items() if name in index_names),
            )
        tables = indexes = 0
        for table in TABLES:
            tables += conn.execute(text(f"SELECT pg_relation_size('{table}')")).scalar_one()
            indexes += conn.execute(text(f"SELECT pg_indexes_size('{table}')")).scalar_one()
        return tables, indexes


def vacuum(db: Database) -> None:
    """PostgreSQL: what autovacuum does on its own: freed space can be reused, and the
    planner knows the tables (an IN list of run ids is a few rows of millions)."""
    if db.is_sqlite:
        return
    with db.autocommit() as conn:
        for table in TABLES:
            conn.execute(text(f"VACUUM (ANALYZE) {table}"))


@dataclass(frozen=True)
class Explained:
    table: str
    rows: int
    execution_ms: float
    scans: str


def explain_deletes(
    db: Database, tenant: str, options: Options, ended: datetime
) -> list[Explained]:
    """PostgreSQL: the server's own execution time and plan of each statement that deletes
    one chunk (`IDS_PER_STATEMENT` runs) of a full batch, rolled back: what the client's
    clock adds on a busy machine is left out."""
    write_trees(db, tenant, options.batch, ended, options.events)
    explained: list[Explained] = []
    with db.engine.connect() as conn, conn.begin() as transaction:
        ids = list(
            conn.scalars(
                select(Run.id)
                .where(Run.ended_at == ended)
                .order_by(Run.id)
                .limit(IDS_PER_STATEMENT)
            )
        )
        # the next batch's roots, as the pass reads them, then its deletes
        statements = [("(due roots)", due_roots(tenant, ended + options.scan, None, options.batch))]
        for table, statement in [*statements, *delete_statements(ids)]:
            sql = statement.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
            [[document]] = conn.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")).all()
            plan = document[0]
            scans = sorted(set(_scans(plan["Plan"])))
            top = plan["Plan"]
            rows = int(top.get("Actual Rows", 0))
            if top["Node Type"] == "ModifyTable":  # it returns nothing: what it deleted
                rows = sum(int(child.get("Actual Rows", 0)) for child in top.get("Plans", []))
            explained.append(
                Explained(table, rows, float(plan["Execution Time"]), ", ".join(scans))
            )
        transaction.rollback()
    return explained


def _scans(node: dict[str, Any]) -> Iterator[str]:
    if "Scan" in node.get("Node Type", ""):
        index = node.get("Index Name")
        relation = node.get("Relation Name")
        yield (
            node["Node Type"]
            + (f" on {relation}" if relation else "")
            + (f" using {index}" if index else "")
        )
    for child in node.get("Plans", []):
        yield from _scans(child)


def count(db: Database, model: Any) -> int:
    with db.read() as session:
        return session.scalar(select(func.count()).select_from(model)) or 0


def measure(name: str, url: str, options: Options, clock: StatementClock) -> Outcome:
    upgrade(url)
    db = Database(url)
    outcome = Outcome(name)
    try:
        tenant = str(uuid.uuid4())
        start = datetime(2026, 1, 1)
        with db.write() as session:
            session.execute(insert(Tenant).values(id=tenant, name="bench", created_at=start))
        retention = RunRetention(db, options.retention, batch=options.batch)
        ticks_per_hour = int(timedelta(hours=1) / options.scan)
        per_tick = max(1, options.trees_per_hour // ticks_per_hour)
        clock.times = {}
        for tick in range(1, options.hours * ticks_per_hour + 1):
            now = start + tick * options.scan
            write_trees(db, tenant, per_tick, now - options.scan / 2, options.events)
            began = time.perf_counter()
            with clock.watch():
                retention.purge_once(now)
            outcome.purge_seconds += time.perf_counter() - began
            outcome.peak_runs = max(outcome.peak_runs, count(db, Run))
            if tick % ticks_per_hour == 0:
                vacuum(db)
                tables, indexes = sizes(db)
                hour = Hour(
                    tick // ticks_per_hour, count(db, Run), count(db, RunEvent), tables, indexes
                )
                outcome.hours.append(hour)
                print(
                    f"  {name} hour {hour.hour:>3}: runs {hour.runs:>6}  events {hour.events:>8}"
                    f"  tables {hour.table_bytes / 1e6:8.2f} MB  indexes "
                    f"{hour.index_bytes / 1e6:8.2f} MB",
                    flush=True,
                )
        outcome.slowest = clock.slowest()
        if not db.is_sqlite:
            outcome.explained = explain_deletes(db, tenant, options, start)
        return outcome
    finally:
        db.dispose()


def report(outcome: Outcome, options: Options) -> None:
    ticks_per_hour = int(timedelta(hours=1) / options.scan)
    per_tick = max(1, options.trees_per_hour // ticks_per_hour)
    window = int(options.retention / options.scan) + 1
    bound = (window + 1) * per_tick * 3
    print(f"{outcome.name}:")
    peak = outcome.peak_runs
    print(f"  runs rows at most {peak} (goal <= {bound}: {met(peak <= bound)})")
    first = int(options.retention / timedelta(hours=1)) + 1  # after the first full window
    middle = (first + len(outcome.hours)) // 2
    if len(outcome.hours) - middle >= 2 and middle - first >= 1:
        before, after = outcome.hours[first:middle], outcome.hours[middle:]
        for what, size in (("tables", _tables), ("indexes", _indexes)):
            early, late = max(map(size, before)), max(map(size, after))
            growth = late / early if early else 1.0
            print(
                f"  {what}: peak {late / 1e6:.2f} MB in hours {after[0].hour}-{after[-1].hour}, "
                f"{early / 1e6:.2f} MB in hours {before[0].hour}-{before[-1].hour}: "
                f"x{growth:.2f} (goal <= x{SIZE_SLACK:.2f}: {met(growth <= SIZE_SLACK)})"
            )
    for kind, slowest, p99, times in outcome.slowest:
        print(f"  {kind:<40} x{times:<6} max {slowest:7.1f} ms  p99 {p99:7.1f} ms (client)")
    for row in outcome.explained:
        print(
            f"  EXPLAIN ANALYZE {row.table:<20} {row.rows:>5} rows "
            f"{row.execution_ms:7.2f} ms  {row.scans}"
        )
    if outcome.explained:
        slowest = max(row.execution_ms for row in outcome.explained)
        print(
            f"  slowest statement of a batch ({IDS_PER_STATEMENT}-run chunks) {slowest:.1f} ms "
            "on the server "
            f"(goal <= {STATEMENT_GOAL_MS:.0f} ms: {met(slowest <= STATEMENT_GOAL_MS)})"
        )
    print(f"  all passes {outcome.purge_seconds:.2f} s")


def _tables(hour: Hour) -> int:
    return hour.table_bytes


def _indexes(hour: Hour) -> int:
    return hour.index_bytes


def parse(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.retention_steady_state")
    parser.add_argument("--hours", type=int, default=8, help="simulated hours (default 8)")
    parser.add_argument(
        "--trees-per-hour", type=int, default=600, help="trees ending per hour (default 600)"
    )
    parser.add_argument("--events", type=int, default=20, help="events per run (default 20)")
    parser.add_argument(
        "--retention", type=int, default=3600, help="Runs.Retention, seconds (default 3600)"
    )
    parser.add_argument("--scan", type=int, default=600, help="seconds between passes (600)")
    parser.add_argument("--batch", type=int, default=200, help="Runs.RetentionBatch (200)")
    parser.add_argument(
        "--databases", default="sqlite,postgresql", help="sqlite, postgresql or both"
    )
    args = parser.parse_args(argv)
    return Options(
        args.hours,
        args.trees_per_hour,
        args.events,
        timedelta(seconds=args.retention),
        timedelta(seconds=args.scan),
        args.batch,
        [name.strip() for name in args.databases.split(",") if name.strip()],
    )


def main(argv: list[str]) -> int:
    options = parse(argv)
    clock = StatementClock()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as workdir, ExitStack() as scratch:
        if "sqlite" in options.databases:
            url = f"sqlite:///{Path(workdir) / 'retention.db'}"
            outcomes.append(measure("SQLite", url, options, clock))
        if "postgresql" in options.databases:
            postgres = scratch_database(scratch)
            if postgres is None:
                print(f"PostgreSQL: skipped, none answers at {POSTGRES_ADMIN}")
            else:
                outcomes.append(measure("PostgreSQL", postgres, options, clock))
    for outcome in outcomes:
        report(outcome, options)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
