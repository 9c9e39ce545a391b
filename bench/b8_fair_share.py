"""B8: a quiet tenant's queue wait beside a noisy tenant's 10,000 queued runs.

Real processes: a private Redis, a fresh SQLite file, one `tracon-jobs worker` of 4 threads
(`Worker.Concurrency` 4) and a scripted provider that answers every model call after
`--call-ms` (50 ms). Runs are submitted in this process through the real dispatcher
(`runtime.dispatcher.submit`, the web's own path), so they go through the fair lines.

- **idle**: tenant `quiet` submits `--quiet-runs` runs, one every `--interval` seconds, on an
  otherwise idle system.
- **beside the backlog**: tenant `noisy` submits `--backlog` runs as fast as it can, then
  `quiet` submits as many runs as before at the same pace, while the backlog is still worked.

A run's queue wait is its row's `started_at` (set by the worker's claim) minus its
`created_at` (set as the run was submitted): both from the same clock (the database's; for a
SQLite file, this host's). The goal: the quiet tenant's p99 wait beside the backlog within
2x its idle p99. Also printed, without a goal: the same against one model call when that is
longer than the idle p99 (a run that arrives while every slot is busy waits for one to free:
no scheduler can do better without preemption or a slot kept free). See bench/README.md.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

from bench.b1_throughput import _chunks, _shown, choose_redis, run_checked, tracon_env
from bench.harness import CLI, ROOT, STARTUP_TIMEOUT, met, percentile, run_benchmark
from tracon_jobs.cli.supervisor import Supervisor, wait_until
from tracon_jobs.coordination.fair_share import Depth
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import load_settings

AGENT = "bench"
QUIET = "quiet"
NOISY = "noisy"
SLOTS = 4
GOAL_RATIO = 2.0
WARMUP = 8
SUBMIT_THREADS = 4
POLL_SECONDS = 0.02
TERMINAL = ("Completed", "Failed", "Canceled")
LEFT_SHARE = 0.1
"""The backlog must still have at least this share of its runs in line when the quiet
tenant's last run is claimed: else the quiet runs did not wait beside it."""


@dataclass(frozen=True)
class Options:
    backlog: int
    quiet_runs: int
    interval: float
    call_ms: float
    timeout: float
    keep: bool

    @property
    def call_seconds(self) -> float:
        return self.call_ms / 1000


@dataclass(frozen=True)
class Timed:
    """A run's row as it ended: its status, when it was created and claimed (naive UTC)."""

    status: str
    created: datetime
    started: datetime | None

    @property
    def wait(self) -> float | None:
        return None if self.started is None else (self.started - self.created).total_seconds()


@dataclass(frozen=True)
class Phase:
    label: str
    waits: list[float]  # seconds, one a quiet run
    ahead: list[int]  # noisy runs claimed between each quiet run's offer and its claim
    submits: list[float]  # seconds each quiet run's `submit` took (its row, its offer)

    def p(self, share: float) -> float:
        return percentile(self.waits, share)


@dataclass(frozen=True)
class Backlog:
    submitted: int
    submit_seconds: float
    after_submit: Depth  # as the quiet tenant's first run beside it was submitted
    at_last_claim: Depth  # as the quiet tenant's last run was seen claimed
    claimed: int  # noisy runs claimed by then
    claim_seconds: float  # from the first noisy claim to the last quiet one


# -- options -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b8_fair_share", description=__doc__)
    parser.add_argument("--backlog", type=int, default=10_000, help="the noisy tenant's runs")
    parser.add_argument(
        "--quiet-runs", type=int, default=20, help="the quiet tenant's runs, in each phase"
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between the quiet tenant's runs"
    )
    parser.add_argument(
        "--call-ms", type=float, default=50.0, help="milliseconds the model takes a call"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for a phase's runs")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    args = parser.parse_args(argv)
    if min(args.backlog, args.quiet_runs) < 1:
        parser.error("--backlog and --quiet-runs must be at least 1")
    if args.interval <= 0 or args.call_ms <= 0 or args.timeout <= 0:
        parser.error("--interval, --call-ms and --timeout must be above 0")
    return Options(**vars(args))


# -- the whole benchmark -------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    return run_benchmark("b8", options.keep, lambda *context: benchmark(options, *context))


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    redis_url = choose_redis(None, workdir, cleanup)  # always a private one
    database = f"sqlite:///{workdir / 'tracon.db'}"
    config = write_config(workdir, options.call_seconds)
    env = tracon_env(config, database, redis_url)
    run_checked([*CLI, "migrate"], env, ROOT)
    children.start("worker", [*CLI, "worker", "-n", "b8@%h"], env)
    runtime = Runtime(load_settings(config, environ=env))
    cleanup.callback(runtime.close)
    rows = Rows(database)
    cleanup.callback(rows.close)
    wait_until(
        lambda: runtime.fair_store.depth().slots == SLOTS,
        what="the worker's slots registered in the fair lines",
        timeout=STARTUP_TIMEOUT,
        watch=children.running(),
    )
    quiet = runtime.tenants.ensure_tenant(QUIET)
    noisy = runtime.tenants.ensure_tenant(NOISY)

    warm = [submit(runtime, quiet, f"warm-up {n}") for n in range(WARMUP)]
    if not settled(rows, warm, STARTUP_TIMEOUT, children):
        raise RuntimeError(f"warm-up runs did not complete: {_shown(rows.statuses(warm))}")

    idle_submitted = paced(runtime, quiet, options, "idle")
    idle_ids = list(idle_submitted)
    idle_done = settled(rows, idle_ids, options.timeout, children)
    idle = phase("idle", rows.timed(idle_ids), idle_submitted, {})

    started = time.monotonic()
    noisy_ids = submit_backlog(runtime, noisy, options.backlog)
    submit_seconds = time.monotonic() - started
    after_submit = runtime.fair_store.depth()
    beside_submitted = paced(runtime, quiet, options, "beside")
    beside_ids = list(beside_submitted)
    at_last_claim = await_claimed(runtime, rows, beside_ids, options.timeout, children)
    beside_done = settled(rows, beside_ids, options.timeout, children)
    noisy_rows = rows.timed(noisy_ids)
    beside_rows = rows.timed(beside_ids)
    beside = phase("beside the backlog", beside_rows, beside_submitted, noisy_rows)
    backlog = backlog_figures(
        noisy_rows, beside_rows, options.backlog, submit_seconds, after_submit, at_last_claim
    )

    complete = idle_done and beside_done
    print_report(options, idle, beside, backlog)
    if not complete:
        for label, ids in (("idle", idle_ids), ("beside the backlog", beside_ids)):
            print(f"  FAILED quiet runs {label}: {_shown(rows.statuses(ids))}")
        return 1
    if at_last_claim is None or at_last_claim.lined < LEFT_SHARE * options.backlog:
        lined = "?" if at_last_claim is None else str(at_last_claim.lined)
        print(
            f"  FAILED the backlog had {lined} runs in line when the quiet tenant's last run "
            f"was claimed, under {LEFT_SHARE:.0%} of {options.backlog}: the quiet runs did "
            "not wait beside it (a smaller --quiet-runs or --interval, or a larger --backlog)"
        )
        return 1
    return 0


def write_config(workdir: Path, call_seconds: float) -> Path:
    """One agent on a scripted provider that answers "ok" after `call_seconds`."""
    config = {
        "Providers": {
            "scripted": {
                "Kind": "scripted",
                "Script": [{"Text": "ok", "DelaySeconds": call_seconds}],
            }
        },
        "Agents": {
            AGENT: {
                "Instructions": "benchmark agent",
                "Model": {"Provider": "scripted", "Model": "bench-model"},
                "Tools": [],
            }
        },
        "Worker": {"Concurrency": SLOTS},
    }
    path = workdir / "tracon.json"
    path.write_text(json.dumps({"Tracon": config}, indent=2))
    return path


def submit(runtime: Runtime, tenant: str, message: str) -> str:
    return runtime.dispatcher.submit(NewRun(tenant, AGENT, {"message": message})).id


@dataclass(frozen=True)
class Submission:
    """A quiet run as its submitter saw it: how long `submit` took (its row, then its offer
    to the fair lines) and when it returned, on this host's clock (a SQLite file's clock)."""

    seconds: float
    offered: datetime


def paced(runtime: Runtime, tenant: str, options: Options, label: str) -> dict[str, Submission]:
    """`--quiet-runs` runs, one every `--interval` seconds (on a schedule, not after sleeps
    that a slow submission would stretch)."""
    submitted: dict[str, Submission] = {}
    started = time.monotonic()
    for n in range(options.quiet_runs):
        pause = started + n * options.interval - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        began = time.perf_counter()
        run_id = submit(runtime, tenant, f"{label} {n}")
        seconds = time.perf_counter() - began
        submitted[run_id] = Submission(seconds, datetime.now(UTC).replace(tzinfo=None))
    return submitted


def submit_backlog(runtime: Runtime, tenant: str, count: int) -> list[str]:
    """`count` runs from a few threads; on Ctrl-C the ones not submitted yet are dropped."""
    pool = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="b8-submit")
    try:
        return list(pool.map(lambda n: submit(runtime, tenant, f"noisy {n}"), range(count)))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- the rows ------------------------------------------------------------------------------


class Rows:
    """The runs' statuses and times, straight from SQL."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)

    def timed(self, ids: list[str]) -> dict[str, Timed]:
        found: dict[str, Timed] = {}
        query = sa.select(Run.id, Run.status, Run.created_at, Run.started_at)
        with self.engine.connect() as conn:
            for chunk in _chunks(ids, 500):
                for run_id, status, created, started in conn.execute(
                    query.where(Run.id.in_(chunk))
                ):
                    found[run_id] = Timed(status, created, started)
        return found

    def statuses(self, ids: list[str]) -> Counter[str]:
        return Counter(row.status for row in self.timed(ids).values())

    def close(self) -> None:
        self.engine.dispose()


def settled(rows: Rows, ids: list[str], timeout: float, children: Supervisor) -> bool:
    """Wait for every run of `ids` to end; True when they all ended `Completed`."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = rows.statuses(ids)
        if sum(statuses[s] for s in TERMINAL) >= len(ids):
            return statuses["Completed"] == len(ids)
        if time.monotonic() > deadline:
            return False
        children.check_alive()
        time.sleep(POLL_SECONDS * 5)


def await_claimed(
    runtime: Runtime, rows: Rows, ids: list[str], timeout: float, children: Supervisor
) -> Depth | None:
    """The fair lines' depth as soon as every run of `ids` was claimed; None at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(row.started is not None for row in rows.timed(ids).values()):
            return runtime.fair_store.depth()
        children.check_alive()
        time.sleep(POLL_SECONDS)
    return None


def phase(
    label: str,
    quiet: dict[str, Timed],
    submitted: dict[str, Submission],
    noisy: dict[str, Timed],
) -> Phase:
    """The quiet runs' waits, their submissions' times, and how many noisy runs were claimed
    between each quiet run's offer to the lines and its claim."""
    claims = sorted(row.started for row in noisy.values() if row.started is not None)
    waits, ahead = [], []
    for run_id, row in quiet.items():
        if row.started is None or row.wait is None:
            continue
        waits.append(row.wait)
        offered = submitted[run_id].offered
        ahead.append(bisect.bisect_left(claims, row.started) - bisect.bisect_right(claims, offered))
    return Phase(label, waits, ahead, [one.seconds for one in submitted.values()])


def backlog_figures(
    noisy: dict[str, Timed],
    quiet: dict[str, Timed],
    backlog: int,
    submit_seconds: float,
    after_submit: Depth,
    at_last_claim: Depth | None,
) -> Backlog:
    quiet_claims = [row.started for row in quiet.values() if row.started is not None]
    last = max(quiet_claims) if quiet_claims else None
    claims = [row.started for row in noisy.values() if row.started is not None]
    claimed = [at for at in claims if last is None or at <= last]
    seconds = (max(claimed) - min(claimed)).total_seconds() if len(claimed) > 1 else 0.0
    return Backlog(
        backlog,
        submit_seconds,
        after_submit,
        at_last_claim or Depth(0, 0, 0, None),
        len(claimed),
        seconds,
    )


# -- report --------------------------------------------------------------------------------


def print_report(options: Options, idle: Phase, beside: Phase, backlog: Backlog) -> None:
    call = options.call_seconds
    print(
        f"B8 fair share: a quiet tenant's {options.quiet_runs} runs, one every "
        f"{options.interval:g} s, idle, then beside a noisy tenant's {options.backlog} queued runs"
    )
    print(
        f"  one worker, {SLOTS} slots; scripted model call {options.call_ms:g} ms; "
        "SQLite, private Redis\n"
    )
    print(f"  {'quiet tenant queue wait':<28} {'N':>4} {'p50':>10} {'p99':>10} {'max':>10}")
    for one in (idle, beside):
        worst = max(one.waits) if one.waits else float("nan")
        print(
            f"  {one.label:<28} {len(one.waits):>4} {_ms(one.p(0.5)):>10} "
            f"{_ms(one.p(0.99)):>10} {_ms(worst):>10}"
        )
    print(
        "  of which the submit call (the row, then the offer): "
        + "; ".join(
            f"{one.label} p50 {_ms(percentile(one.submits, 0.5))}, "
            f"p99 {_ms(percentile(one.submits, 0.99))}"
            for one in (idle, beside)
        )
    )
    if beside.ahead:
        ahead = [float(n) for n in beside.ahead]
        print(
            f"  noisy runs claimed between a quiet run's offer and its claim: "
            f"p50 {percentile(ahead, 0.5):g}, "
            f"p99 {percentile(ahead, 0.99):g}, max {max(beside.ahead)}"
        )
    rate = backlog.claimed / backlog.claim_seconds if backlog.claim_seconds > 0 else 0.0
    print(
        f"  backlog: {backlog.submitted} runs submitted in {backlog.submit_seconds:.1f} s; "
        f"{backlog.after_submit.lined} in line as the quiet runs began, "
        f"{backlog.at_last_claim.lined} when the last was claimed "
        f"({backlog.claimed} claimed meanwhile, {rate:.1f} runs/s)"
    )
    fifo = options.backlog * call / SLOTS
    measured = f", {options.backlog / rate:.0f} s at the measured {rate:.1f} runs/s" if rate else ""
    print(
        f"  first come first served would put the whole backlog ahead: {options.backlog} x "
        f"{options.call_ms:g} ms / {SLOTS} slots = {fifo:.0f} s (computed{measured})\n"
    )
    idle_p99, beside_p99 = idle.p(0.99), beside.p(0.99)
    if rate:
        run_time = SLOTS / rate
        print(
            f"  a run's time in a slot at the measured rate: {SLOTS} / {rate:.1f} = "
            f"{_ms(run_time)}; the p99 beside the backlog is {beside_p99 / run_time:.1f} of them"
        )
    floor = max(idle_p99, call)
    raw = beside_p99 / idle_p99 if idle_p99 > 0 else float("inf")
    ratio = beside_p99 / floor
    floored = "one model call" if floor > idle_p99 else "its idle p99, above one model call"
    print(
        f"  against the longer of the idle p99 and one model call, max({_ms(idle_p99)}, "
        f"{_ms(call)}) = {_ms(floor)} ({floored}): {ratio:.2f}x (no goal)"
    )
    print(
        f"  quiet tenant's p99 queue wait beside the backlog {_ms(beside_p99)}, "
        f"{raw:.2f}x its idle p99 of {_ms(idle_p99)} (goal <= {GOAL_RATIO:.1f}x: "
        f"{met(raw <= GOAL_RATIO)})"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
