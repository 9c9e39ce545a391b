"""`python -m bench [name ...]`: every benchmark in turn, then one summary table.

Each benchmark runs as its own process (`python -m bench.<name>`, exactly as when run alone),
its output shown as it comes. The summary takes each line that states a goal, in the form
`<figure> (goal <goal>: met|missed)` or `<figure>: goal <goal>: met|missed`. A benchmark
whose module is not there yet is reported and skipped; the exit code is 1 when a benchmark
that ran did not complete (its own exit code was not 0), else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BENCHMARKS: tuple[str, ...] = (
    "b1_throughput",
    "b1_throughput@postgresql",
    "b1_throughput@tracing",
    "tracing_off",
    "b2_inflight",
    "b2_inflight@stream",
    "b3_coordination",
    "b5_round_trips",
    "b6_streams",
    "b6_streams@stream",
    "b7_first_token",
    "b8_fair_share",
    "b9_webhooks",
    "b10_dbos",
    "b11_scale_out",
)
"""Run in this order; add a module's name here and `make bench` runs it. `name@postgresql`
runs it with `--database` on a scratch database of the PostgreSQL server that
`TRACON_BENCH_POSTGRES` names (default: the local one), skipped when none answers;
`name@stream` runs it with `--stream` (streaming model calls); `name@tracing` with `--tracing`
(tracing off and on, exporting to a local OTLP receiver)."""

POSTGRES_ADMIN = os.environ.get(
    "TRACON_BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)

GOAL_LINE = re.compile(
    r"^\s*(?P<figure>.*?)[\s(:]*\bgoal\s+(?P<goal>.+?):\s*(?P<verdict>met|missed)\)?\s*$"
)


@dataclass
class Outcome:
    name: str
    status: str  # "ok", "failed (exit N)", "missing"
    seconds: float = 0.0
    goals: list[tuple[str, str, str]] = field(default_factory=list)  # figure, goal, verdict

    @property
    def failed(self) -> bool:
        return self.status.startswith("failed")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: {BENCHMARKS})")
    args = parser.parse_args(argv)
    names = args.names or list(BENCHMARKS)
    outcomes = [run_one(name) for name in names]
    print_summary(outcomes)
    return 1 if any(outcome.failed for outcome in outcomes) else 0


def run_one(name: str) -> Outcome:
    base, _, variant = name.partition("@")
    module = f"bench.{base}"
    if importlib.util.find_spec(module) is None:
        print(f"== {name}: no module {module} (bench/{base}.py), skipped\n", flush=True)
        return Outcome(name, "missing")
    with ExitStack() as cleanup:
        extra: list[str] = []
        if variant == "postgresql":
            database = scratch_database(cleanup)
            if database is None:
                print(f"== {name}: no PostgreSQL answers at {POSTGRES_ADMIN}, skipped\n")
                return Outcome(name, "missing")
            extra = ["--database", database]
        elif variant in ("stream", "tracing"):
            extra = [f"--{variant}"]
        elif variant:
            raise SystemExit(
                f"unknown variant '{variant}' of {base} (known: postgresql, stream, tracing)"
            )
        return run_module(name, module, extra)


def scratch_database(cleanup: ExitStack) -> str | None:
    """A fresh database on the PostgreSQL server, dropped when `cleanup` closes."""
    import sqlalchemy as sa

    engine = sa.create_engine(POSTGRES_ADMIN, isolation_level="AUTOCOMMIT")
    name = f"tracon_bench_{uuid.uuid4().hex[:8]}"
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError:
        engine.dispose()
        return None

    def drop() -> None:
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        engine.dispose()

    cleanup.callback(drop)
    url = sa.engine.make_url(POSTGRES_ADMIN).set(database=name)
    return url.render_as_string(hide_password=False)


def run_module(name: str, module: str, extra: list[str]) -> Outcome:
    print(f"== {name}: python -m {module} {' '.join(extra)}".rstrip(), flush=True)
    started = time.monotonic()
    lines = stream([sys.executable, "-m", module, *extra])
    code = lines.pop()
    seconds = time.monotonic() - started
    status = "ok" if code == "0" else f"failed (exit {code})"
    print(f"== {name}: {status} in {seconds:.0f} s\n", flush=True)
    return Outcome(name, status, seconds, goals_in(lines))


def stream(argv: list[str]) -> list[str]:
    """Run `argv`, echoing its output line by line; its lines, then its exit code."""
    with subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as child:
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
    return [*lines, str(child.returncode)]


def goals_in(lines: list[str]) -> list[tuple[str, str, str]]:
    found = []
    for line in lines:
        match = GOAL_LINE.match(line)
        if match:
            figure, goal = (" ".join(match[part].split()) for part in ("figure", "goal"))
            found.append((figure, goal, match["verdict"]))
    return found


def print_summary(outcomes: list[Outcome]) -> None:
    rows = [("benchmark", "figure", "goal", "result")]
    for outcome in outcomes:
        if not outcome.goals or outcome.status != "ok":
            rows.append((outcome.name, "-", "-", outcome.status))
        for figure, goal, verdict in outcome.goals:
            rows.append((outcome.name, figure, goal, verdict))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    print("Summary")
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(("  " + "  ".join(cells)).rstrip())
    failed = [outcome.name for outcome in outcomes if outcome.failed]
    missing = [outcome.name for outcome in outcomes if outcome.status == "missing"]
    if missing:
        print(f"  not there yet: {', '.join(missing)}")
    print(f"  {'FAILED: ' + ', '.join(failed) if failed else 'every benchmark completed'}")


if __name__ == "__main__":
    sys.exit(main())
