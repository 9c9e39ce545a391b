"""B10: tracon beside DBOS Transact on the same three durable-workflow workloads, in one
invocation (issue 33).

`python -m bench.b10_dbos [--workflows 1000] [--parked 1000] [--recovery-runs 200]
[--threads 8] [--concurrency 16] [--slow-step 2] [--workloads w1,w3,recovery]
[--systems tracon,dbos] [--keep]`; see bench/README.md.

How: the two systems run one after the other, each on a scratch PostgreSQL database of its own
(`tracon_bench_<random>` on `TRACON_BENCH_POSTGRES`, dropped after) with the machine to itself.
tracon: `tracon-jobs web` (2 x 32 threads), one `tracon-jobs worker` (`Worker.Concurrency`
16), a private Redis, workflows of `bench.b10_workflows` (checkpoints, `ResumeInterruptedRuns`
and the orphan scan on) submitted over HTTP with `Prefer: respond-async`. DBOS: one
`bench.b10_dbos_app` process whose queue runs 16 workflows at once, polled every 0.05 s,
workflows enqueued by a `DBOSClient`. Every step of both writes a row of `b10_effects`.

- **W1 throughput**: `--workflows` 3-step workflows from `--threads` client threads, timed from
  the first submission to the last completion (the system's own end time); then as many
  0-step ones (the floor). CPU per workflow of every process (user + system, `/proc`); a step's
  CPU is (3-step - 0-step) / 3, the fixed CPU a workflow is the rest.
- **W3 parked waits, then bulk answers**: `--parked` workflows each wait for an answer
  (`ctx.ask`; `DBOS.recv` on a topic), are held `--hold` seconds, then all answered from the
  client threads (tracon: `--answer-batch` answers a `POST /api/workflows/answers`, or the
  respond route with 1; DBOS: `DBOSClient.send`, one a call). Threads of the worker process (the
  DBOS process) while parked over idle, seconds to answer all, answer-to-completion p50.
- **Recovery after kill -9**: `--recovery-runs` workflows with a slow step (`--slow-step` s);
  once `--kill-at` of them completed, one process is killed with SIGKILL (tracon: one of two
  workers, with beat running the scans; DBOS: its process, then one with the same executor
  id started at once). Seconds from the kill to the last completion, and to the last of the
  runs the kill interrupted; runs sent to a worker again (tracon's requeue), steps run twice
  (`b10_effects`: the step in flight at the kill running again is told apart).

Goals (issue 33): W1 tracon/DBOS throughput >= 1.0 with 3 steps and with none, tracon's fixed
CPU a workflow <= 1.5x DBOS's; W3 answers at least as fast as DBOS's sends (>= 1.0) and no
thread held per waiting run; recovery's last completion within `RunReconciliation.
OrphanThreshold` plus one `ScanInterval` of the kill (300 + 60 s at the defaults), no run
sent or executed twice. Without the `dbos` package (`pip install '.[bench-dbos]'`) DBOS's side is
skipped and only tracon's own goals are judged.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa

from bench import b10_workflows as flows
from bench.__main__ import POSTGRES_ADMIN, scratch_database
from bench.b10_effects import create_table
from bench.b10_sides import DbosSide, Shape, Side, TraconSide, dbos_version
from bench.harness import met, run_benchmark
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.settings import defaults

T = TypeVar("T")
WORKLOADS = ("w1", "w3", "recovery")
SYSTEMS = ("tracon", "dbos")
WARMUP = 20
POLL_SECONDS = 0.02
"""How often the completion count is read (one indexed count; the by-key read only when it
says the workflows may all have ended), as B1 does."""
PARK_POLL_SECONDS = 0.1
"""How often the parked count, the count before the kill and the recovery's completions are
read: minutes of waiting for the orphan scan at 20 ms would be thousands of queries."""
THROUGHPUT_GOAL = 1.0
FIXED_CPU_GOAL = 1.5
ANSWER_GOAL = 1.0
THREADS_GOAL = 0.01
"""Extra threads per waiting run below this: none kept per run (a few for the whole load
would not pass 0.01 at the default 1000)."""
CLIENT = "bench client"
POSTGRES = "postgres"
"""CPU of the PostgreSQL backends connected to the system's scratch database."""


@dataclass(frozen=True)
class Options:
    workflows: int
    parked: int
    recovery_runs: int
    threads: int
    concurrency: int
    poll: float
    slow_step: float
    kill_at: float
    hold: float
    answer_batch: int
    orphan_threshold: float | None
    scan_interval: float | None
    heartbeat_interval: float | None
    workloads: tuple[str, ...]
    systems: tuple[str, ...]
    timeout: float
    keep: bool

    @property
    def shape(self) -> Shape:
        return Shape(
            self.concurrency,
            self.threads,
            self.poll,
            self.orphan_threshold,
            self.scan_interval,
            self.heartbeat_interval,
        )

    @property
    def recovery_bound(self) -> float:
        """tracon's goal: the orphan threshold plus one scan interval, in seconds."""
        threshold = self.orphan_threshold or defaults.ORPHAN_THRESHOLD.total_seconds()
        scan = self.scan_interval or defaults.SCAN_INTERVAL.total_seconds()
        return threshold + scan


# -- measurements ------------------------------------------------------------------------------


@dataclass
class Throughput:
    count: int
    done: int
    seconds: float
    cpu: dict[str, float]
    problems: list[str] = field(default_factory=list)

    @property
    def per_second(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Parked:
    count: int
    idle_threads: int
    parked_threads: int
    park_seconds: float
    answer_seconds: float
    latencies: list[float]
    hold_seconds: float
    cpu: dict[str, float]  # parking and answering, together
    cpu_hold: dict[str, float]
    problems: list[str] = field(default_factory=list)

    @property
    def extra_threads(self) -> int:
        return max(0, self.parked_threads - self.idle_threads)

    @property
    def answers_per_second(self) -> float:
        return self.count / self.answer_seconds if self.answer_seconds > 0 else 0.0


@dataclass
class Effects:
    """What `b10_effects` says of a workload's keys (`read_effects`)."""

    done_rows: int
    complete: int  # keys with every step done
    twice: set[str]  # a step run twice other than across the kill: a second delivery
    rerun: set[str]  # a step in flight on the killed process, run again after the kill
    committed_twice: set[str]  # of `rerun`, those whose effect committed on both


@dataclass
class Recovery:
    count: int
    done: int
    kill_after: float  # seconds from the first submission to the kill
    seconds: float  # from the kill to the last completion
    hit: int  # workflows the kill interrupted (in flight on the killed process, or held by it)
    hit_seconds: float | None  # from the kill to the last of them completed
    effects: Effects
    resent_lost: set[str]  # keys sent again as their message died with the killed worker
    resent: set[str]  # keys sent again by age (`Runs.RequeueAfter`): no record said why
    dropped: int  # deliveries dropped, their run claimed already: a second message
    facts: list[str]
    cpu: dict[str, float]
    problems: list[str] = field(default_factory=list)

    @property
    def twice(self) -> int:
        """Sent or executed twice: a second message of a run whose first one a worker held
        and ran (a delivery dropped), or a step run again other than across the kill."""
        return self.dropped + len(self.effects.twice)


@dataclass
class Results:
    system: str
    three: Throughput | None = None
    none: Throughput | None = None
    parked: Parked | None = None
    recovery: Recovery | None = None

    @property
    def problems(self) -> list[str]:
        found = []
        for label, part in (
            ("W1 3 steps", self.three),
            ("W1 0 steps", self.none),
            ("W3", self.parked),
            ("recovery", self.recovery),
        ):
            if part is not None:
                found += [f"{self.system} {label}: {problem}" for problem in part.problems]
        return found


# -- options -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b10_dbos", description=__doc__)
    add = parser.add_argument
    add("--workflows", type=int, default=1000, help="W1: workflows timed, 3-step and 0-step")
    add("--parked", type=int, default=1000, help="W3: workflows parked, then answered")
    add("--recovery-runs", type=int, default=200, help="recovery: workflows with a slow step")
    add("--threads", type=int, default=8, help="client threads submitting and answering")
    add("--concurrency", type=int, default=16, help="workflows a worker runs at once")
    add("--poll", type=float, default=0.05, help="DBOS's queue polling interval, seconds")
    add("--slow-step", type=float, default=2.0, help="recovery: the slow step, seconds")
    add("--kill-at", type=float, default=0.25, help="recovery: kill once this share completed")
    add("--hold", type=float, default=5.0, help="W3: seconds parked before the answers")
    add(
        "--answer-batch",
        type=int,
        default=100,
        help="W3: answers a request carries on tracon's side (POST /api/workflows/answers; 1: "
        "the respond route, a request each); DBOS sends each with DBOSClient.send",
    )
    add("--orphan-threshold", type=float, help="tracon's OrphanThreshold, s (default: its own)")
    add("--scan-interval", type=float, help="tracon's ScanInterval, s (default: its own)")
    add("--heartbeat-interval", type=float, help="tracon's HeartbeatInterval, s (default: its own)")
    add("--workloads", default=",".join(WORKLOADS), help=f"some of {','.join(WORKLOADS)}")
    add("--systems", default=",".join(SYSTEMS), help=f"some of {','.join(SYSTEMS)}")
    add("--timeout", type=float, default=600.0, help="seconds a phase may take (recovery: more)")
    add("--keep", action="store_true", help="keep the work dir and the processes' logs")
    args = parser.parse_args(argv)
    workloads = tuple(w for w in WORKLOADS if w in args.workloads.split(","))
    systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    if not workloads or not systems:
        parser.error(f"--workloads: some of {WORKLOADS}; --systems: some of {SYSTEMS}")
    if min(args.workflows, args.parked, args.recovery_runs, args.threads, args.concurrency) < 1:
        parser.error("counts, --threads and --concurrency must be at least 1")
    if not 0 < args.kill_at < 1:
        parser.error("--kill-at is a share of the runs, between 0 and 1")
    return Options(
        **{k: v for k, v in vars(args).items() if k not in ("workloads", "systems")},
        workloads=workloads,
        systems=systems,
    )


# -- the whole benchmark -----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    return run_benchmark("b10", options.keep, lambda *context: benchmark(options, *context))


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    version = dbos_version()
    systems = list(options.systems)
    if "dbos" in systems and version is None:
        print(
            "DBOS Transact is not importable here: its side is skipped "
            "(pip install '.[bench-dbos]', or .venv/bin/pip install 'dbos>=3.4,<4')\n"
        )
        systems.remove("dbos")
    results: dict[str, Results] = {}
    for system in systems:
        with ExitStack() as scope:
            database = scratch_database(scope)
            if database is None:
                print(f"no PostgreSQL answers at {safe_url(POSTGRES_ADMIN)}: {system} skipped")
                break
            create_table(database)
            side = make_side(system, options, database, workdir, children, scope)
            scope.callback(side.close)
            scope.callback(children.stop)  # before the database is dropped
            results[system] = run_side(side, options, children)
    if not results:
        return 0
    print_report(options, version, results)
    return 1 if any(r.problems for r in results.values()) else 0


def make_side(
    system: str,
    options: Options,
    database: str,
    workdir: Path,
    children: Supervisor,
    scope: ExitStack,
) -> Side:
    if system == "tracon":
        return TraconSide(options.shape, database, workdir, children, scope)
    return DbosSide(options.shape, database, children)


def run_side(side: Side, options: Options, children: Supervisor) -> Results:
    results = Results(side.name)
    wanted = options.workloads
    if "w1" in wanted or "w3" in wanted:
        print(f"{side.name}: W1/W3 processes starting", flush=True)
        side.start(recovery=False)
        warm_up(side, options, children, [flows.THREE_STEPS, flows.NO_STEPS])
        if "w1" in wanted:
            results.three = throughput(side, options, children, flows.THREE_STEPS, "w1-3-")
            print(f"{side.name}: W1 3 steps {results.three.per_second:.1f}/s", flush=True)
            results.none = throughput(side, options, children, flows.NO_STEPS, "w1-0-")
            print(f"{side.name}: W1 0 steps {results.none.per_second:.1f}/s", flush=True)
        if "w3" in wanted:
            results.parked = parked(side, options, children)
            print(f"{side.name}: W3 {results.parked.answers_per_second:.1f} answers/s", flush=True)
        children.stop()
    if "recovery" in wanted:
        print(f"{side.name}: recovery processes starting", flush=True)
        side.start(recovery=True)
        warm_up(side, options, children, [flows.THREE_STEPS], prefix="warm-r-")
        results.recovery = recovery(side, options, children)
        print(f"{side.name}: recovery {results.recovery.seconds:.1f} s after the kill", flush=True)
        children.stop()
    return results


def warm_up(
    side: Side,
    options: Options,
    children: Supervisor,
    workflows: list[str],
    prefix: str = "warm-",
) -> None:
    """A few of each workflow, not timed: every process and pool is up and warm."""
    for number, workflow in enumerate(workflows):
        part = f"{prefix}{number}-"
        keys = [f"{part}{i:06d}" for i in range(WARMUP)]
        open_before = side.open_count()
        submit_all(side, workflow, keys, options.threads)
        done, _ = wait_done(side, part, WARMUP, open_before, options.timeout, children)
        if done != WARMUP:
            raise RuntimeError(f"{side.name}: only {done} of {WARMUP} warm-up workflows completed")


# -- W1 ----------------------------------------------------------------------------------------


def throughput(
    side: Side, options: Options, children: Supervisor, workflow: str, prefix: str
) -> Throughput:
    """`--workflows` of `workflow`, from the first submission to the last completion."""
    count = options.workflows
    keys = [f"{prefix}{i:06d}" for i in range(count)]
    open_before = side.open_count()
    meter = Meter(children, side.engine)
    started = time.time()
    submit_all(side, workflow, keys, options.threads)
    done, last = wait_done(side, prefix, count, open_before, options.timeout, children)
    cpu = meter.stop()
    seconds = (last or time.time()) - started
    measured = Throughput(count, done, seconds, cpu)
    if done != count:
        measured.problems.append(f"only {done} of {count} workflows completed")
    steps = 3 if workflow == flows.THREE_STEPS else 0
    effects = read_effects(side.engine, prefix, [], steps)
    if effects.done_rows != steps * count or effects.twice:
        measured.problems.append(
            f"{effects.done_rows} step rows for {steps * count} steps, "
            f"{len(effects.twice)} workflows with a step run twice"
        )
    return measured


# -- W3 ----------------------------------------------------------------------------------------


def parked(side: Side, options: Options, children: Supervisor) -> Parked:
    """Park `--parked` workflows, hold them `--hold` s, answer them all, wait for the ends."""
    count, prefix = options.parked, "w3-"
    keys = [f"{prefix}{i:06d}" for i in range(count)]
    holder = side.holder()
    idle = threads_of(children, holder)
    open_before = side.open_count()
    meter = Meter(children, side.engine)
    started = time.time()
    ids = submit_all(side, flows.PARKED, keys, options.threads)
    waiting = wait_parked(side, prefix, count, options.timeout, children)
    park_seconds = time.time() - started
    held = threads_of(children, holder)
    parking = meter.stop()
    hold = Meter(children, side.engine)
    time.sleep(options.hold)
    cpu_hold = hold.stop()
    meter = Meter(children, side.engine)
    answering = time.time()
    sent = answer_all(side, ids, options.threads, options.answer_batch)
    answer_seconds = time.time() - answering
    done, _ = wait_done(side, prefix, count, open_before, options.timeout, children)
    answered = meter.stop()
    ends = side.answered(prefix)
    latencies = [ends[ident] - sent[ident] for ident in ids if ident in ends]
    cpu = {name: parking.get(name, 0.0) + answered.get(name, 0.0) for name in parking | answered}
    measured = Parked(
        count,
        idle,
        held,
        park_seconds,
        answer_seconds,
        latencies,
        options.hold,
        cpu,
        cpu_hold,
    )
    if waiting != count:
        measured.problems.append(f"only {waiting} of {count} workflows parked")
    if done != count or len(latencies) != count:
        measured.problems.append(f"only {done} of {count} answered workflows completed")
    return measured


def wait_parked(side: Side, prefix: str, count: int, timeout: float, children: Supervisor) -> int:
    deadline = time.monotonic() + timeout
    while True:
        waiting = side.parked(prefix)
        if waiting >= count or time.monotonic() > deadline:
            return waiting
        children.check_alive()
        time.sleep(PARK_POLL_SECONDS)


# -- recovery ----------------------------------------------------------------------------------


def recovery(side: Side, options: Options, children: Supervisor) -> Recovery:
    """`--recovery-runs` slow workflows; kill -9 once `--kill-at` of them completed; the
    seconds from the kill to the last completion."""
    count, prefix = options.recovery_runs, "rec-"
    keys = [f"{prefix}{i:06d}" for i in range(count)]
    open_before = side.open_count()
    meter = Meter(children, side.engine)
    started = time.time()
    submit_all(side, flows.SLOW, keys, options.threads, seconds=options.slow_step)
    kill_when = max(1, int(count * options.kill_at))
    before_kill = wait_count(side, prefix, kill_when, options.timeout, children)
    meter.sample()  # the killed process's CPU up to now
    killed_at = time.time()
    killed = side.kill()
    timeout = recovery_timeout(options)
    done, last = wait_done(
        side, prefix, count, open_before, timeout, children, poll=PARK_POLL_SECONDS
    )
    cpu = meter.stop()
    hit, hit_last = side.hit(prefix)
    measured = Recovery(
        count,
        done,
        killed_at - started,
        (last or time.time()) - killed_at,
        hit,
        None if hit_last is None else hit_last - killed_at,
        read_effects(side.engine, prefix, killed, 3),
        *side.resent(prefix),
        side.dropped(),
        side.facts(prefix),
        cpu,
    )
    if before_kill < kill_when:
        measured.problems.append(f"only {before_kill} workflows completed before the kill")
    if done != count:
        measured.problems.append(f"only {done} of {count} workflows completed")
    if measured.effects.complete != count:
        measured.problems.append(f"only {measured.effects.complete} of {count} with every step")
    return measured


def recovery_timeout(options: Options) -> float:
    """Long enough for tracon's scans at their settings: the threshold and a scan, a
    requeue of the killed worker's reserved messages, the slow steps run again."""
    work = options.recovery_runs * options.slow_step / options.concurrency
    requeue = defaults.REQUEUE_AFTER.total_seconds() * 1.5
    return max(options.timeout, options.recovery_bound + requeue + work + 120.0)


def wait_count(side: Side, prefix: str, count: int, timeout: float, children: Supervisor) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, _ = side.done(prefix)
        if done >= count or time.monotonic() > deadline:
            return done
        children.check_alive()
        time.sleep(PARK_POLL_SECONDS)


EFFECT_ROWS = sa.text("SELECT key, step, phase, pid FROM b10_effects WHERE key LIKE :p")


def read_effects(engine: sa.Engine, prefix: str, killed: list[int], steps: int) -> Effects:
    """The rows of `prefix`'s keys, step by step. A step written twice by live processes (or
    twice by the killed one) ran twice: a second delivery. A step with rows from both the
    killed process and a live one was in flight at the kill and ran again (the recovery's
    at-least-once window), its effect committed twice when both wrote `done`."""
    with engine.connect() as conn:
        rows = conn.execute(EFFECT_ROWS, {"p": f"{prefix}%"}).all()
    by_step: dict[tuple[str, str], list[tuple[str, bool]]] = {}
    for key, step, phase, pid in rows:
        by_step.setdefault((str(key), str(step)), []).append((str(phase), pid in killed))
    effects = Effects(sum(1 for row in rows if row.phase == "done"), 0, set(), set(), set())
    done_steps: dict[str, int] = {}
    for (key, _step), found in by_step.items():
        live = [phase for phase, on_killed in found if not on_killed]
        dead = [phase for phase, on_killed in found if on_killed]
        if any(side.count(phase) > 1 for side in (live, dead) for phase in ("start", "done")):
            effects.twice.add(key)
        elif live and dead:
            effects.rerun.add(key)
            if "done" in live and "done" in dead:
                effects.committed_twice.add(key)
        if "done" in live or "done" in dead:
            done_steps[key] = done_steps.get(key, 0) + 1
    effects.complete = sum(1 for number in done_steps.values() if number == steps)
    return effects


# -- clients -----------------------------------------------------------------------------------


def submit_all(
    side: Side, workflow: str, keys: list[str], threads: int, seconds: float | None = None
) -> list[str]:
    """Every key submitted, spread over `threads` client threads; the ids, in key order
    per thread."""
    shares = [keys[i::threads] for i in range(threads)]

    def send(client: int) -> list[str]:
        return [side.submit(client, workflow, key, seconds) for key in shares[client]]

    return [ident for part in in_threads(send, threads) for ident in part]


def answer_all(side: Side, ids: list[str], threads: int, batch: int) -> dict[str, float]:
    """Every parked workflow answered from `threads` client threads, up to `batch` of them a
    call (`Side.answer_many`); id -> when its answer was sent (epoch s)."""
    shares = [ids[i::threads] for i in range(threads)]

    def send(client: int) -> dict[str, float]:
        sent: dict[str, float] = {}
        share = shares[client]
        for start in range(0, len(share), batch):
            idents = share[start : start + batch]
            now = time.time()
            sent |= dict.fromkeys(idents, now)
            side.answer_many(client, idents)
        return sent

    return {ident: at for part in in_threads(send, threads) for ident, at in part.items()}


def in_threads(work: Callable[[int], T], threads: int) -> list[T]:
    with ThreadPoolExecutor(threads, thread_name_prefix="b10-client") as pool:
        return list(pool.map(work, range(threads)))


def wait_done(
    side: Side,
    prefix: str,
    count: int,
    open_before: int,
    timeout: float,
    children: Supervisor,
    *,
    poll: float = POLL_SECONDS,
) -> tuple[int, float | None]:
    """Completed workflows of `prefix` and the last one's end, once `count` completed (or at
    the timeout): the by-key count is read only when the open count is back to before. The
    end is the system's own time of it, so `poll` moves only when this notices."""
    deadline = time.monotonic() + timeout
    while True:
        late = time.monotonic() > deadline
        if side.open_count() <= open_before or late:
            done, last = side.done(prefix)
            if done >= count or late:
                return done, last
        children.check_alive()
        time.sleep(poll)


# -- processes: CPU and threads ----------------------------------------------------------------


def group_stat(pgid: int) -> tuple[float, int] | None:
    """CPU seconds (user + system) and threads of the live processes of group `pgid`
    (Linux `/proc`; None elsewhere, or when none is left)."""
    cpu, threads, found = 0, 0, False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            cpu += int(fields[11]) + int(fields[12])
            threads += int(fields[17])
            found = True
    return (cpu / os.sysconf("SC_CLK_TCK"), threads) if found else None


def process_cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_of(children: Supervisor, name: str) -> int:
    child = next(c for c in children.running() if c.name == name)
    stat = group_stat(child.popen.pid)
    return stat[1] if stat else 0


BACKENDS = sa.text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")


class Meter:
    """CPU seconds spent from now to `stop` by each child (its whole process group), this
    process (`bench client`) and the PostgreSQL backends of the system's database. A child
    started meanwhile counts from zero; one gone counts to its last `sample`."""

    def __init__(self, children: Supervisor, engine: sa.Engine) -> None:
        self.children = children
        self.engine = engine
        self.client = time.process_time()
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.backends_first: dict[int, float] = {}
        self.backends_last: dict[int, float] = {}
        self.sample(first=True)

    def sample(self, first: bool = False) -> None:
        for child in self.children.running():
            stat = group_stat(child.popen.pid)
            if stat is not None:
                self.first.setdefault(child.name, stat[0] if first else 0.0)
                self.last[child.name] = stat[0]
        with self.engine.connect() as conn:
            pids = [int(pid) for (pid,) in conn.execute(BACKENDS)]
        for pid in pids:
            spent = process_cpu(pid)
            if spent is not None:
                self.backends_first.setdefault(pid, spent if first else 0.0)
                self.backends_last[pid] = spent

    def stop(self) -> dict[str, float]:
        self.sample()
        seconds = {name: self.last[name] - self.first[name] for name in self.last}
        seconds[CLIENT] = time.process_time() - self.client
        seconds[POSTGRES] = sum(
            spent - self.backends_first[pid] for pid, spent in self.backends_last.items()
        )
        return seconds


def server_cpu(cpu: dict[str, float]) -> float:
    """The system's own processes: every child (web, workers, beat; the DBOS process)."""
    return sum(spent for name, spent in cpu.items() if name not in (CLIENT, POSTGRES))


# -- report ------------------------------------------------------------------------------------


def print_report(options: Options, version: str | None, results: dict[str, Results]) -> None:
    tracon, dbos = results.get("tracon"), results.get("dbos")
    print(f"\nB10: tracon beside DBOS Transact {version or '(not installed)'}")
    print(f"  {workload_line(options)}")
    if tracon is not None:
        print(f"  tracon: {tracon_settings(options)}")
    if dbos is not None:
        print(
            f"  DBOS: queue 'b10' worker_concurrency {options.concurrency}, polling "
            f"{options.poll:g} s; 'b10-parked' unlimited; sync workflows, a DBOSClient"
        )
    print()
    rows = figure_rows(tracon, dbos)
    if rows:
        print(f"  {'figure':<48} {'tracon':>10} {'DBOS':>10} {'tracon/DBOS':>12}")
        for label, ours, theirs in rows:
            ratio = ratio_shown(ours, theirs)
            print(f"  {label:<48} {shown(ours):>10} {shown(theirs):>10} {ratio:>12}")
    print()
    for line in cpu_lines(results):
        print(f"  {line}")
    for line in fact_lines(results):
        print(f"  {line}")
    problems = [problem for one in results.values() for problem in one.problems]
    for problem in problems:
        print(f"  FAILED {problem}")
    print()
    for line in goal_lines(options, tracon, dbos):
        print(f"  {line}")
    print()
    for line in CAVEATS:
        print(f"  {line}")


def workload_line(options: Options) -> str:
    parts = []
    if "w1" in options.workloads:
        parts.append(f"W1 {options.workflows} workflows x 2 (3 steps, 0 steps)")
    if "w3" in options.workloads:
        parts.append(f"W3 {options.parked} parked, held {options.hold:g} s")
    if "recovery" in options.workloads:
        parts.append(
            f"recovery {options.recovery_runs} runs, slow step {options.slow_step:g} s, "
            f"kill -9 at {options.kill_at:.0%} completed"
        )
    return (
        "; ".join(parts) + f"; {options.threads} client threads, worker concurrency "
        f"{options.concurrency}"
    )


def tracon_settings(options: Options) -> str:
    def seconds(value: float | None, default: timedelta) -> str:
        if value is None:
            return f"{default.total_seconds():g} s (default)"
        return f"{value:g} s"

    return (
        "EnableCheckpointing, ResumeInterruptedRuns, RunReconciliation on; OrphanThreshold "
        f"{seconds(options.orphan_threshold, defaults.ORPHAN_THRESHOLD)}, ScanInterval "
        f"{seconds(options.scan_interval, defaults.SCAN_INTERVAL)}, HeartbeatInterval "
        f"{seconds(options.heartbeat_interval, defaults.HEARTBEAT_INTERVAL)}"
    )


Row = tuple[str, float | None, float | None]


def figure_rows(tracon: Results | None, dbos: Results | None) -> list[Row]:
    rows: list[Row] = []

    def add(label: str, pick: Callable[[Results], float | None]) -> None:
        ours = pick(tracon) if tracon else None
        theirs = pick(dbos) if dbos else None
        if ours is not None or theirs is not None:
            rows.append((label, ours, theirs))

    add("W1 3 steps: workflows/s", lambda r: r.three.per_second if r.three else None)
    add("W1 0 steps: workflows/s", lambda r: r.none.per_second if r.none else None)
    add("W1 3 steps: server CPU ms a workflow", lambda r: per_workflow_ms(r.three))
    add("W1 0 steps: server CPU ms a workflow", lambda r: per_workflow_ms(r.none))
    add("W1 3 steps: all CPU ms (+ client, postgres)", lambda r: all_ms(r.three))
    add("W1 0 steps: all CPU ms (+ client, postgres)", lambda r: all_ms(r.none))
    add("W1 CPU ms a step ((3 steps - 0 steps) / 3)", step_ms)
    add("W1 fixed CPU ms a workflow (3 steps - 3 x step)", fixed_ms)
    add("W3 seconds to park them all", lambda r: r.parked.park_seconds if r.parked else None)
    add("W3 threads of the process, idle", lambda r: r.parked.idle_threads if r.parked else None)
    add(
        "W3 threads of the process, parked", lambda r: r.parked.parked_threads if r.parked else None
    )
    add("W3 threads held while parked, extra over idle", extra_threads)
    add("W3 extra threads per waiting run", threads_per_run)
    add("W3 seconds to answer them all", lambda r: r.parked.answer_seconds if r.parked else None)
    add("W3 answers/s", lambda r: r.parked.answers_per_second if r.parked else None)
    add("W3 answer to completion p50, ms", lambda r: latency_ms(r.parked, 0.50))
    add("W3 answer to completion p95, ms", lambda r: latency_ms(r.parked, 0.95))
    add("W3 server CPU ms a second while parked", hold_ms)
    add("recovery: s from the kill to the last completion", recovery_seconds)
    add("recovery: runs the kill interrupted", lambda r: r.recovery.hit if r.recovery else None)
    add("recovery: s from the kill to their last completion", hit_seconds)
    add("recovery: runs sent again, their worker killed", lambda r: count_of(r, "lost"))
    add("recovery: runs sent again by age", lambda r: count_of(r, "resent"))
    add("recovery: deliveries dropped, run claimed already", dropped)
    add("recovery: runs with a step run twice otherwise", lambda r: count_of(r, "twice"))
    add("recovery: runs whose step at the kill ran again", lambda r: count_of(r, "rerun"))
    add("recovery:   of which its effect committed twice", lambda r: count_of(r, "committed"))
    return rows


def per_workflow_ms(measured: Throughput | None) -> float | None:
    if measured is None or not measured.done:
        return None
    return server_cpu(measured.cpu) * 1000 / measured.done


def all_ms(measured: Throughput | None) -> float | None:
    """Every process's CPU a workflow: the system's, the bench client's, PostgreSQL's."""
    if measured is None or not measured.done:
        return None
    return sum(measured.cpu.values()) * 1000 / measured.done


def step_ms(results: Results) -> float | None:
    three, none = per_workflow_ms(results.three), per_workflow_ms(results.none)
    return None if three is None or none is None else (three - none) / 3


def fixed_ms(results: Results) -> float | None:
    three, step = per_workflow_ms(results.three), step_ms(results)
    return None if three is None or step is None else three - 3 * step


def extra_threads(results: Results) -> float | None:
    return float(results.parked.extra_threads) if results.parked else None


def threads_per_run(results: Results) -> float | None:
    parked_ = results.parked
    return parked_.extra_threads / parked_.count if parked_ else None


def latency_ms(measured: Parked | None, share: float) -> float | None:
    if measured is None or not measured.latencies:
        return None
    ordered = sorted(measured.latencies)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] * 1000


def hold_ms(results: Results) -> float | None:
    parked_ = results.parked
    if parked_ is None or parked_.hold_seconds <= 0:
        return None
    return server_cpu(parked_.cpu_hold) * 1000 / parked_.hold_seconds


def recovery_seconds(results: Results) -> float | None:
    return results.recovery.seconds if results.recovery else None


def dropped(results: Results) -> float | None:
    return float(results.recovery.dropped) if results.recovery else None


def hit_seconds(results: Results) -> float | None:
    return results.recovery.hit_seconds if results.recovery else None


def count_of(results: Results, which: str) -> float | None:
    """How many keys of the recovery workload: `lost` (sent again, the kill lost their
    message), `resent` (sent again otherwise), `twice` (a step run twice other
    than across the kill), `rerun` (a step at the kill ran again), `committed` (twice)."""
    measured = results.recovery
    if measured is None:
        return None
    keys = {
        "lost": measured.resent_lost,
        "resent": measured.resent,
        "twice": measured.effects.twice,
        "rerun": measured.effects.rerun,
        "committed": measured.effects.committed_twice,
    }[which]
    return float(len(keys))


def shown(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}" if value else "0"


def ratio_shown(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}"


def cpu_lines(results: dict[str, Results]) -> list[str]:
    """CPU ms a workflow of every process, per workload and system."""
    lines = ["CPU ms a workflow, while timed (user + system):"]
    for label, pick in (
        ("W1 3 steps", lambda r: (r.three.cpu, r.three.done) if r.three else None),
        ("W1 0 steps", lambda r: (r.none.cpu, r.none.done) if r.none else None),
        ("W3 park + answer", lambda r: (r.parked.cpu, r.parked.count) if r.parked else None),
        (
            "recovery (kill and wait included)",
            lambda r: (r.recovery.cpu, r.recovery.done) if r.recovery else None,
        ),
    ):
        parts = []
        for one in results.values():
            picked: tuple[dict[str, float], int] | None = pick(one)
            if picked is None or not picked[1]:
                continue
            cpu, done = picked
            each = ", ".join(f"{name} {spent * 1000 / done:.2f}" for name, spent in cpu.items())
            parts.append(f"{one.system}: {each}")
        if parts:
            lines.append(f"  {label}: " + "; ".join(parts))
    return lines


def fact_lines(results: dict[str, Results]) -> list[str]:
    lines = []
    for one in results.values():
        if one.recovery is not None:
            measured = one.recovery
            lines.append(
                f"{one.system} recovery: killed {measured.kill_after:.1f} s after the first "
                f"submission; " + "; ".join(measured.facts)
            )
    return lines


def goal_lines(options: Options, tracon: Results | None, dbos: Results | None) -> list[str]:
    """One line per goal in the form `make bench`'s summary reads; a goal against DBOS is
    not judged (no verdict) when DBOS was not measured."""
    lines = []
    if tracon is None:
        return ["tracon was not measured: no goal judged"]

    def against(label: str, ours: float | None, theirs: float | None, goal: str, ok: bool) -> None:
        if ours is None:
            return
        if theirs is None or not theirs:
            lines.append(f"{label}: tracon {shown(ours)}, DBOS not measured (not judged)")
            return
        lines.append(
            f"{label} tracon/DBOS = {ours / theirs:.2f} (tracon {shown(ours)}, DBOS "
            f"{shown(theirs)})   (goal {goal}: {met(ok)})"
        )

    for label, pick in (
        ("W1 3-step throughput", lambda r: r.three.per_second if r.three else None),
        ("W1 0-step throughput", lambda r: r.none.per_second if r.none else None),
    ):
        ours, theirs = pick(tracon), pick(dbos) if dbos else None
        ok = bool(ours and theirs and ours / theirs >= THROUGHPUT_GOAL)
        against(label, ours, theirs, f">= {THROUGHPUT_GOAL:.2f}", ok)
    ours, theirs = fixed_ms(tracon), fixed_ms(dbos) if dbos else None
    ok = bool(ours is not None and theirs and ours / theirs <= FIXED_CPU_GOAL)
    against("W1 fixed CPU ms a workflow", ours, theirs, f"<= {FIXED_CPU_GOAL:.2f}", ok)
    if tracon.parked is not None:
        ours = tracon.parked.answers_per_second
        theirs = dbos.parked.answers_per_second if dbos and dbos.parked else None
        ok = bool(theirs and ours / theirs >= ANSWER_GOAL)
        against("W3 answer throughput", ours, theirs, f">= {ANSWER_GOAL:.2f}", ok)
        per_run = threads_per_run(tracon) or 0.0
        theirs_per_run = threads_per_run(dbos) if dbos else None
        lines.append(
            f"W3 extra threads per waiting run, tracon worker: {per_run:.3f} "
            f"({tracon.parked.extra_threads} for {tracon.parked.count}; DBOS "
            f"{shown(theirs_per_run)})   (goal < {THREADS_GOAL}: {met(per_run < THREADS_GOAL)})"
        )
    if tracon.recovery is not None:
        measured = tracon.recovery
        theirs = dbos.recovery.seconds if dbos and dbos.recovery else None
        bound = options.recovery_bound
        ok = measured.done == measured.count and measured.seconds <= bound
        lines.append(
            f"recovery, tracon's last completion {measured.seconds:.1f} s after the kill "
            f"(DBOS {shown(theirs)} s)   (goal <= {bound:g} s, OrphanThreshold + ScanInterval: "
            f"{met(ok)})"
        )
        theirs_twice = dbos.recovery.twice if dbos and dbos.recovery else None
        lines.append(
            f"recovery, tracon runs sent twice while a worker held them, or executed twice: "
            f"{measured.twice} ({measured.dropped} deliveries dropped, "
            f"{len(measured.effects.twice)} with a step run twice other than across the kill; "
            f"sent again: {len(measured.resent_lost)} as their worker died, "
            f"{len(measured.resent)} by age; DBOS {shown(theirs_twice)})   "
            f"(goal 0: {met(not measured.twice)})"
        )
    return lines


CAVEATS = (
    "Fairness: tracon's submissions are HTTP requests to a web tier that authenticates, writes",
    "the run and its events, and sends a Celery message through Redis to the worker, which keeps",
    "an event log and a live feed; DBOS's client writes straight to its tables and its process",
    "polls them. tracon's web and worker CPU both count as its server CPU; DBOS's enqueue work is",
    "in the bench client's. A DBOS workflow parked in DBOS.recv holds a thread (an async",
    "workflow's recv_async would not). The two run one after the other on one shared machine:",
    "compare ratios measured on a quiet one. PostgreSQL's CPU is its backends on each scratch",
    "database, sampled at the ends (a backend that exits meanwhile is not counted).",
)


def safe_url(url: str) -> str:
    return sa.engine.make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    sys.exit(main())
