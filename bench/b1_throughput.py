"""B1: end-to-end agent runs per second through tracon, beside plain Celery no-ops per second.

Both are timed in one invocation on the same Redis, one worker process each with the same
pool, concurrency and prefetch, so `ratio = tracon / celery` says how much of the broker's
throughput survives tracon's own work per run (HTTP, SQL rows and events, fences, feed).

`--tracing`: tracon is timed twice a round, with tracing off (no `OTEL_*` variable at all)
and on (every span sampled, exported over OTLP/HTTP to a receiver in this process), and
`tracing on/off` (the median of the rounds' on / off rates) is held to its goal instead.
See bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import redis
import sqlalchemy as sa

from bench.harness import CLI, ROOT, STARTUP_TIMEOUT, GroupCpu, run_benchmark, start_web
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.db.engine import normalize_url
from tracon_jobs.db.models import Run
from tracon_jobs.embedded_redis import answers, start_embedded

if TYPE_CHECKING:
    from bench.otlp_receiver import OtlpReceiver, Received

LOCAL_REDIS_EXAMPLE = "redis://127.0.0.1:6379/14"
AGENT = "bench"
RUN_PATH = f"/api/agents/{AGENT}/run"
ASYNC = {"Prefer": "respond-async"}
GOALS = {"sqlite": 0.80, "postgresql": 0.70}
"""The ratio each database is held to; PostgreSQL's is lower for its network round trips."""
WARMUP = 20
ROUNDS = 3
"""Pairs of measurements (tracon, then Celery) in one invocation: the ratio held to the goal
is their median, as one pair moves by a tenth either way on a shared 2-CPU machine."""
RUN_POLL_SECONDS = 0.02
TRACING_GOAL = 0.90
"""`--tracing`: tracon's rate with tracing on (sampler always on, exporting) over its rate
with tracing off, the median of the rounds."""
TRACING_SAMPLER = "always_on"
SCHEDULE_DELAY = 5.0
"""The SDK's batch processor exports what it holds at least this often (its default,
`OTEL_BSP_SCHEDULE_DELAY` 5000 ms): quiet for longer, the processes have sent every span."""
NOOP_POLL_SECONDS = 0.005
ID_CHUNK = 500
TERMINAL = ("Completed", "Failed", "Canceled")
OPEN = ("Queued", "Running", "Waiting")
KEY_LINE = re.compile(r"api key \(shown once\): (\S+)")


@dataclass(frozen=True)
class Options:
    runs: int
    concurrency: int
    worker_concurrency: int
    database: str | None
    redis: str | None
    timeout: float
    keep: bool
    rounds: int = ROUNDS
    tracing: bool = False


@dataclass(frozen=True)
class Measurement:
    label: str
    count: int
    seconds: float
    done: int
    problem: str = ""
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds, timed part
    spans_timed: int = 0  # spans the OTLP receiver took while timed (`--tracing`, on)

    @property
    def complete(self) -> bool:
        return self.done == self.count

    @property
    def per_second(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Submitted:
    ids: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def extend(self, other: Submitted) -> None:
        self.ids += other.ids
        self.latencies += other.latencies


@dataclass(frozen=True)
class Round:
    """One pair of measurements: tracon's, then plain Celery's right after it."""

    tracon: Measurement
    baseline: Measurement
    latencies: list[float]

    @property
    def ratio(self) -> float:
        per_second = self.baseline.per_second
        return self.tracon.per_second / per_second if per_second else 0.0


@dataclass(frozen=True)
class Traced:
    """One tracon measurement of `--tracing`, and what the OTLP receiver took meanwhile:
    from the processes' start to their stop."""

    measured: Measurement
    latencies: list[float]
    received: Received

    @property
    def runs(self) -> int:
        """The runs whose spans the receiver took: the warm-up's too."""
        return WARMUP + self.measured.done


@dataclass(frozen=True)
class TracingRound:
    """tracon with tracing off and on (alternating which goes first), then plain Celery."""

    off: Traced
    on: Traced
    baseline: Measurement
    order: tuple[Traced, Traced]  # as measured

    @property
    def ratio(self) -> float:
        """on / off: the share of tracon's rate that survives tracing."""
        off = self.off.measured.per_second
        return self.on.measured.per_second / off if off else 0.0

    def against_celery(self, side: Traced) -> float:
        per_second = self.baseline.per_second
        return side.measured.per_second / per_second if per_second else 0.0

    @property
    def complete(self) -> bool:
        return all(m.complete for m in (self.off.measured, self.on.measured, self.baseline))


# -- options -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b1_throughput", description=__doc__)
    parser.add_argument("--runs", type=int, default=2000, help="runs and no-op tasks timed")
    parser.add_argument("--concurrency", type=int, default=16, help="submitting client threads")
    parser.add_argument("--worker-concurrency", type=int, default=16, help="worker threads")
    parser.add_argument("--database", help="SQL URL (default: a fresh SQLite file)")
    parser.add_argument("--redis", help=f"Redis URL, flushed, e.g. {LOCAL_REDIS_EXAMPLE}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="pairs of measurements; the median ratio counts"
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="time tracon with tracing off and on (OTLP to a local receiver) in each round",
    )
    args = parser.parse_args(argv)
    if min(args.runs, args.concurrency, args.worker_concurrency, args.rounds) < 1:
        parser.error("--runs, --concurrency, --worker-concurrency and --rounds must be at least 1")
    if args.database and sa.engine.make_url(args.database).get_backend_name() not in GOALS:
        parser.error(f"--database: B1 has goals for {' and '.join(GOALS)} only")
    return Options(**vars(args))


# -- the whole benchmark -------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    return run_benchmark("b1", options.keep, lambda *context: benchmark(options, *context))


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    redis_url = choose_redis(options.redis, workdir, cleanup)
    database = options.database or f"sqlite:///{workdir / 'tracon.db'}"
    env = tracon_env(write_config(workdir, options.worker_concurrency), database, redis_url)
    if options.tracing:
        return benchmark_tracing(options, env, redis_url, database, children, cleanup)
    rounds: list[Round] = []
    for _ in range(options.rounds):
        # each round from an empty Redis: a message a stopped worker had not acknowledged
        # yet goes back to its queue, and would run again in the next round
        redis.Redis.from_url(redis_url).flushdb()
        tracon, submitted = measure_tracon(options, env, database, children)
        children.stop()  # the baseline gets the machine to itself, as tracon had
        baseline = measure_celery(options, redis_url, children)
        children.stop()
        rounds.append(Round(tracon, baseline, submitted.latencies))
        if not (tracon.complete and baseline.complete):
            break  # a failure is reported as it is: no more rounds
    print_report(options, redis_url, database, rounds)
    return 0 if all(r.tracon.complete and r.baseline.complete for r in rounds) else 1


def benchmark_tracing(
    options: Options,
    env: dict[str, str],
    redis_url: str,
    database: str,
    children: Supervisor,
    cleanup: ExitStack,
) -> int:
    """`--tracing`: each round tracon with tracing off and on (the first of them alternating
    from round to round, so a trend of the machine or the growing database weighs on both),
    then plain Celery; every round from an empty Redis, every side with the machine to
    itself."""
    from bench.otlp_receiver import OtlpReceiver  # opentelemetry-proto: only here

    receiver = cleanup.enter_context(OtlpReceiver())
    traced = dict(
        env,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_TRACES_SAMPLER=TRACING_SAMPLER,
    )
    rounds: list[TracingRound] = []
    for number in range(options.rounds):
        sides: dict[bool, Traced] = {}
        for tracing_on in (False, True) if number % 2 == 0 else (True, False):
            redis.Redis.from_url(redis_url).flushdb()
            sides[tracing_on] = measure_traced(
                options, env, traced if tracing_on else None, database, children, receiver
            )
        redis.Redis.from_url(redis_url).flushdb()
        baseline = measure_celery(options, redis_url, children)
        children.stop()
        order = (sides[False], sides[True]) if number % 2 == 0 else (sides[True], sides[False])
        rounds.append(TracingRound(sides[False], sides[True], baseline, order))
        if not rounds[-1].complete:
            break  # a failure is reported as it is: no more rounds
    problems = tracing_problems(rounds)
    print_tracing_report(options, redis_url, database, receiver.endpoint, rounds, problems)
    return 0 if all(r.complete for r in rounds) and not problems else 1


def measure_traced(
    options: Options,
    env: dict[str, str],
    served: dict[str, str] | None,
    database: str,
    children: Supervisor,
    receiver: OtlpReceiver,
) -> Traced:
    """tracon measured with `served` as its web's and worker's environment (None: `env`,
    tracing off), stopped, and the spans the receiver took from its start to its exit.

    With tracing on, the processes are stopped only once no export has come for longer
    than the batch processor's schedule delay, after the timer: a worker stopped with
    SIGTERM (Drain off) leaves with `os._exit`, and the spans it still held would be lost
    from the count."""
    before = receiver.received()
    label = "tracing off" if served is None else "tracing on"
    measured, submitted = measure_tracon(
        options,
        env,
        database,
        children,
        served=served,
        label=label,
        spans=lambda: receiver.received().total,
    )
    if served is not None and not receiver.wait_quiet(SCHEDULE_DELAY + 1.5, timeout=60.0):
        print(f"warning: {label}: spans still coming in a minute after the runs ended")
    children.stop()
    return Traced(measured, submitted.latencies, receiver.received() - before)


def choose_redis(wanted: str | None, workdir: Path, cleanup: ExitStack) -> str:
    """`--redis`, else a private embedded server: never a shared db by default.

    The local server's db 14 was the first choice, but test sessions take a db of 8-15 by
    pid and flush it before every test: sharing one wipes our queue mid-measurement (and
    our flush wipes theirs), and their workers consume our tasks.
    """
    if wanted:
        if not answers(wanted):
            raise RuntimeError(f"no Redis answers at {wanted}")
        others = other_clients(wanted)
        if others:
            print(f"warning: {others} other clients on {wanted}; they may flush or take our work")
        return wanted
    embedded = start_embedded(workdir / "redis")
    cleanup.callback(embedded.stop)
    return embedded.url


def other_clients(url: str) -> int:
    """Connections of other processes to the db of `url` (0 when the server will not say)."""
    client = redis.Redis.from_url(url)
    try:
        me = str(client.client_id())
        db = str(client.connection_pool.connection_kwargs.get("db", 0))
        return sum(1 for c in client.client_list() if c["db"] == db and str(c["id"]) != me)
    except redis.RedisError:
        return 0
    finally:
        client.close()


def write_config(workdir: Path, worker_concurrency: int) -> Path:
    """One agent on a scripted provider that answers "ok" at once: no model time at all."""
    config = {
        "Providers": {"scripted": {"Kind": "scripted", "Script": [{"Text": "ok"}]}},
        "Agents": {
            AGENT: {
                "Instructions": "benchmark agent",
                "Model": {"Provider": "scripted", "Model": "bench-model"},
                "Tools": [],
            }
        },
        "Pricing": {"Models": {"bench-model": {"InputPerMillion": 1, "OutputPerMillion": 2}}},
        "Worker": {"Concurrency": worker_concurrency},
    }
    path = workdir / "tracon.json"
    path.write_text(json.dumps({"Tracon": config}, indent=2))
    return path


def tracon_env(config: Path, database: str, redis_url: str) -> dict[str, str]:
    return child_env(
        TRACON_CONFIG=str(config), TRACON_DATABASE_URL=database, TRACON_REDIS_URL=redis_url
    )


def child_env(**extra: str) -> dict[str, str]:
    """Ours plus `extra`, with the project root importable (`bench` is not installed), and
    without any `OTEL_*` variable: a child traces only when a benchmark says so in `extra`
    (an endpoint left in the shell would otherwise turn tracing on and export elsewhere)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return dict(inherited, PYTHONPATH=path, **extra)


# -- measure A: tracon ---------------------------------------------------------------------


def measure_tracon(
    options: Options,
    env: dict[str, str],
    database: str,
    children: Supervisor,
    *,
    served: dict[str, str] | None = None,
    label: str = "tracon runs (HTTP)",
    spans: Callable[[], int] | None = None,
) -> tuple[Measurement, Submitted]:
    """`served`: the web's and the worker's environment when not `env` (the one-shot
    commands get `env`); `spans`: a count of spans received so far, read as the timer
    starts and stops."""
    api_key = issue_api_key(env)
    base_url = start_tracon(env if served is None else served, children)
    counter = RunCounter(database)
    clients = [api_client(base_url, api_key) for _ in range(options.concurrency)]
    try:
        warm_up_tracon(clients, counter, children)
        cpu = GroupCpu({child.name: child.popen.pid for child in children.running()})
        spans_before = spans() if spans else 0
        started, client_cpu = time.perf_counter(), time.process_time()
        submitted = submit_runs(clients, options.runs)
        statuses = await_runs(counter, submitted.ids, options.timeout, children)
        seconds = time.perf_counter() - started
        cpu.stop()
        cpu.seconds["bench client"] = time.process_time() - client_cpu
        spans_timed = spans() - spans_before if spans else 0
    finally:
        for client in clients:
            client.close()
        counter.close()
    done = statuses["Completed"]
    problem = "" if done == options.runs else f"not all Completed: {_shown(statuses)}"
    measured = Measurement(label, options.runs, seconds, done, problem, cpu.seconds, spans_timed)
    return measured, submitted


def run_checked(argv: Sequence[str], env: dict[str, str], cwd: Path) -> str:
    """Run a one-shot command to its end; its stdout, or RuntimeError with its output."""
    done = subprocess.run(list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def issue_api_key(env: dict[str, str]) -> str:
    """Migrate, then a key for tenant `bench` (a reused PostgreSQL database may have it)."""
    run_checked([*CLI, "migrate"], env, ROOT)
    try:
        out = run_checked([*CLI, "tenants", "create", AGENT], env, ROOT)
    except RuntimeError as exc:
        if "already exists" not in str(exc):
            raise
        out = run_checked([*CLI, "keys", "create", AGENT], env, ROOT)
    match = KEY_LINE.search(out)
    if match is None:
        raise RuntimeError(f"no API key in the output of 'tenants create':\n{out}")
    return match.group(1)


def start_tracon(env: dict[str, str], children: Supervisor) -> str:
    base_url = start_web(children, env, workers=2, threads=32)
    children.start("worker", [*CLI, "worker", "-n", "bench@%h"], env)
    return base_url


def api_client(base_url: str, api_key: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"}
    return httpx.Client(base_url=base_url, headers=headers, timeout=30.0)


def warm_up_tracon(clients: list[httpx.Client], counter: RunCounter, children: Supervisor) -> None:
    """Runs until the worker has consumed some: proves it is up and warms every pool."""
    ids = submit_runs(clients, WARMUP).ids
    statuses = await_runs(counter, ids, STARTUP_TIMEOUT, children)
    if statuses["Completed"] != len(ids):
        raise RuntimeError(f"warm-up runs did not all complete: {_shown(statuses)}")


def submit_runs(clients: list[httpx.Client], count: int) -> Submitted:
    """`count` POSTs spread over the clients, one thread each, keep-alive connections."""
    shares = [range(i, count, len(clients)) for i in range(len(clients))]
    submitted = Submitted()
    with ThreadPoolExecutor(len(clients), thread_name_prefix="b1-http") as pool:
        for part in pool.map(post_runs, clients, shares):
            submitted.extend(part)
    return submitted


def post_runs(client: httpx.Client, indices: range) -> Submitted:
    submitted = Submitted()
    for index in indices:
        started = time.perf_counter()
        response = client.post(RUN_PATH, json={"message": f"bench run {index}"}, headers=ASYNC)
        submitted.latencies.append(time.perf_counter() - started)
        if response.status_code != 202:
            raise RuntimeError(f"POST {RUN_PATH} -> {response.status_code}: {response.text}")
        submitted.ids.append(response.json()["runId"])
    return submitted


class RunCounter:
    """Counts runs per status straight from SQL: one query, where the API would page.

    Waiting for runs to end costs the machine being measured as little as the baseline's
    Redis `GET` does: a poll counts the open runs of the whole table (an index range, no
    list of ids), and only when that count is back where it was before the runs were
    submitted are the submitted runs' statuses read by id. The by-id read of a few thousand
    ids costs milliseconds of CPU; every 20 ms it took a tenth of a core from the worker.
    """

    def __init__(self, url: str, *, queued: int = 0) -> None:
        """`queued`: runs of ours in the database already (queued before this counter)."""
        self.engine = sa.create_engine(normalize_url(url))
        self.open_before = self.open_runs() - queued  # a reused database's runs left open

    def statuses(self, ids: list[str]) -> Counter[str]:
        counts: Counter[str] = Counter()
        with self.engine.connect() as conn:
            for chunk in _chunks(ids, ID_CHUNK):
                query = (
                    sa.select(Run.status, sa.func.count())
                    .where(Run.id.in_(chunk))
                    .group_by(Run.status)
                )
                counts.update({status: number for status, number in conn.execute(query)})
        return counts

    def open_runs(self) -> int:
        """Runs of any submitter not ended yet: one count over the status index."""
        query = sa.select(sa.func.count()).select_from(Run).where(Run.status.in_(OPEN))
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def maybe_all_ended(self) -> bool:
        """False while more runs are open than before ours were submitted: some of ours
        are. True says only "look": a run open before may have ended while ours run."""
        return self.open_runs() <= self.open_before

    def close(self) -> None:
        self.engine.dispose()


def await_runs(
    counter: RunCounter, ids: list[str], timeout: float, children: Supervisor
) -> Counter[str]:
    """Statuses once every run ended (or at the timeout, with some still open)."""
    deadline = time.monotonic() + timeout
    while True:
        late = time.monotonic() > deadline
        if counter.maybe_all_ended() or late:
            statuses = counter.statuses(ids)
            if sum(statuses[s] for s in TERMINAL) >= len(ids) or late:
                return statuses
        children.check_alive()
        time.sleep(RUN_POLL_SECONDS)


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _shown(statuses: Counter[str]) -> str:
    return ", ".join(f"{number} {status}" for status, number in statuses.most_common()) or "none"


# -- measure B: plain Celery ---------------------------------------------------------------


def measure_celery(options: Options, redis_url: str, children: Supervisor) -> Measurement:
    baseline = import_baseline(redis_url)
    start_baseline_worker(options.worker_concurrency, redis_url, children)
    client = redis.Redis.from_url(redis_url)
    try:
        warm_up_celery(baseline, client, options.concurrency, children)
        cpu = GroupCpu({child.name: child.popen.pid for child in children.running()})
        started, client_cpu = time.perf_counter(), time.process_time()
        send_noops(baseline.noop, options.runs, options.concurrency)
        done = await_noops(client, baseline.COUNTER_KEY, options.runs, options.timeout, children)
        seconds = time.perf_counter() - started
        cpu.stop()
        cpu.seconds["bench client"] = time.process_time() - client_cpu
    finally:
        client.close()
    problem = "" if done == options.runs else f"only {done} no-ops ran"
    done = min(done, options.runs)
    return Measurement("celery no-op", options.runs, seconds, done, problem, cpu.seconds)


def import_baseline(redis_url: str) -> Any:
    """`bench.baseline_app`, which reads its broker from the environment when imported."""
    os.environ["BENCH_REDIS_URL"] = redis_url
    from bench import baseline_app

    if baseline_app.broker_url != redis_url:
        raise RuntimeError("bench.baseline_app was imported before its broker URL was set")
    return baseline_app


def start_baseline_worker(concurrency: int, redis_url: str, children: Supervisor) -> None:
    env = child_env(BENCH_REDIS_URL=redis_url)
    worker = f"worker --pool threads -c {concurrency} --prefetch-multiplier 1 -Q bench.noop"
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.baseline_app",
        *worker.split(),
        "--loglevel",
        "INFO",
        "-n",
        "baseline@%h",
    ]
    children.start("baseline-worker", argv, env)


def warm_up_celery(baseline: Any, client: redis.Redis, threads: int, children: Supervisor) -> None:
    send_noops(baseline.noop, WARMUP, threads)
    await_noops(client, baseline.COUNTER_KEY, WARMUP, STARTUP_TIMEOUT, children)
    client.delete(baseline.COUNTER_KEY)


def send_noops(task: Any, count: int, threads: int) -> None:
    with ThreadPoolExecutor(threads, thread_name_prefix="b1-celery") as pool:
        for _ in pool.map(lambda _: task.delay(), range(count)):
            pass


def await_noops(
    client: redis.Redis, key: str, count: int, timeout: float, children: Supervisor
) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done = int(client.get(key) or 0)
        if done >= count or time.monotonic() > deadline:
            return done
        children.check_alive()
        time.sleep(NOOP_POLL_SECONDS)


# -- report --------------------------------------------------------------------------------


def print_report(options: Options, redis_url: str, database: str, rounds: list[Round]) -> None:
    print(
        f"B1 throughput: {options.runs} runs, {options.concurrency} HTTP threads, "
        f"worker concurrency {options.worker_concurrency}, {len(rounds)} round(s)"
    )
    print(f"  database {_safe_url(database)}  ·  redis {redis_url}\n")
    print(f"  {'measure':<24} {'N':>6} {'seconds':>9} {'per s':>9}")
    for number, one in enumerate(rounds, 1):
        for row in (one.tracon, one.baseline):
            label = f"{row.label} #{number}"
            print(f"  {label:<24} {row.count:>6} {row.seconds:>9.2f} {row.per_second:>9.1f}")
    for number, one in enumerate(rounds, 1):
        for row in (one.tracon, one.baseline):
            if row.problem:
                print(f"  FAILED {row.label} #{number}: {row.problem}")
    print()
    print(f"  {ratio_line(rounds, goal_for(database))}")
    print(f"  {latency_line([latency for one in rounds for latency in one.latencies])}")
    print(f"  {cpu_line(rounds)}")


def goal_for(database: str) -> float:
    """The goal of the database's backend (`postgresql+psycopg://...` is PostgreSQL's)."""
    return GOALS[sa.engine.make_url(database).get_backend_name()]


def ratio_line(rounds: list[Round], goal: float) -> str:
    """The median of the rounds' ratios, held to `goal`; each round's ratio beside it."""
    ratio = statistics.median(one.ratio for one in rounds) if rounds else 0.0
    verdict = "met" if ratio >= goal else "missed"
    each = ", ".join(f"{one.ratio:.2f}" for one in rounds)
    median = f"median of {each}" if len(rounds) > 1 else "one round"
    return f"ratio = tracon / celery = {ratio:.2f} ({median})   (goal >= {goal:.2f}: {verdict})"


def cpu_line(rounds: list[Round]) -> str:
    """CPU milliseconds per run (per no-op) of each process while timed, over all rounds:
    where the machine's two cores went, steadier than the rates."""
    seconds: dict[str, float] = {}
    done: dict[str, int] = {}
    for one in rounds:
        for side, row in (("", one.tracon), ("celery ", one.baseline)):
            for name, spent in row.cpu.items():
                key = name if name.startswith("baseline") else side + name
                seconds[key] = seconds.get(key, 0.0) + spent
                done[key] = done.get(key, 0) + row.done
    parts = [f"{name} {seconds[name] * 1000 / done[name]:.2f}" for name in seconds if done[name]]
    return "CPU ms per run: " + (", ".join(parts) if parts else "not known here (no /proc)")


def latency_line(latencies: list[float]) -> str:
    if len(latencies) < 2:
        return "submit latency: too few POSTs to tell"
    cuts = statistics.quantiles(latencies, n=100)
    return (
        f"submit latency (POST, Prefer: respond-async): p50 {cuts[49] * 1000:.1f} ms, "
        f"p95 {cuts[94] * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
    )


# -- report of `--tracing` -----------------------------------------------------------------


def tracing_problems(rounds: list[TracingRound]) -> list[str]:
    """Why the on/off figure would be a lie: spans with tracing off, none (from the web or
    the worker) with it on, an export the receiver refused."""
    problems = []
    for number, one in enumerate(rounds, 1):
        if one.off.received.total:
            problems.append(f"tracing off #{number}: {one.off.received.total} spans received")
        got = one.on.received.spans
        if not one.on.received.total:
            problems.append(f"tracing on #{number}: no span received: tracing was not on")
        for process in ("web", "worker"):
            if not got.get(f"tracon-{process}"):
                problems.append(f"tracing on #{number}: no span of the {process} received")
        for side in (one.off, one.on):
            if side.received.rejected:
                problems.append(
                    f"{side.measured.label} #{number}: the receiver refused "
                    f"{side.received.rejected} of {side.received.requests} exports"
                )
    return problems


def print_tracing_report(
    options: Options,
    redis_url: str,
    database: str,
    endpoint: str,
    rounds: list[TracingRound],
    problems: list[str],
) -> None:
    print(
        f"B1 throughput, tracing off and on: {options.runs} runs, {options.concurrency} HTTP "
        f"threads, worker concurrency {options.worker_concurrency}, {len(rounds)} round(s)"
    )
    print(f"  database {_safe_url(database)}  ·  redis {redis_url}")
    print(f"  tracing on: OTEL_TRACES_SAMPLER={TRACING_SAMPLER}, OTLP/HTTP to {endpoint}\n")
    print(f"  {'measure':<24} {'N':>6} {'seconds':>9} {'per s':>9}")
    measured = []
    for number, one in enumerate(rounds, 1):
        measured += [(number, row) for row in (*(s.measured for s in one.order), one.baseline)]
    for number, row in measured:
        label = f"{row.label} #{number}"
        print(f"  {label:<24} {row.count:>6} {row.seconds:>9.2f} {row.per_second:>9.1f}")
    for number, row in measured:
        if row.problem:
            print(f"  FAILED {row.label} #{number}: {row.problem}")
    for problem in problems:
        print(f"  FAILED {problem}")
    print()
    print(f"  {spans_line(rounds)}")
    sides = {"off": [one.off for one in rounds], "on": [one.on for one in rounds]}
    for name, traced in sides.items():
        ratios = [one.against_celery(side) for one, side in zip(rounds, traced, strict=True)]
        print(f"  tracing {name} / celery = {_median_of(ratios)}")
    for name, traced in sides.items():
        print(f"  CPU ms per run, tracing {name}: {_cpu_per_run([s.measured for s in traced])}")
    print(f"  CPU ms per run, celery: {_cpu_per_run([one.baseline for one in rounds])}")
    for name, traced in sides.items():
        latencies = [latency for side in traced for latency in side.latencies]
        print(f"  tracing {name}: {latency_line(latencies)}")
    print(f"  {tracing_line(rounds, ok=not problems)}")


def spans_line(rounds: list[TracingRound]) -> str:
    """Spans the receiver took per run with tracing on, per process (the warm-up's runs
    counted), and how many came while the runs were timed."""
    runs = sum(one.on.runs for one in rounds)
    spans: Counter[str] = Counter()
    requests = size = timed = 0
    cpu = 0.0
    for one in rounds:
        spans.update(one.on.received.spans)
        requests += one.on.received.requests
        size += one.on.received.body_bytes
        timed += one.on.measured.spans_timed
        cpu += one.on.received.cpu_seconds
    total = sum(spans.values())
    if not runs or not total:
        return "spans per run, tracing on: none received"
    each = ", ".join(f"{name} {count / runs:.2f}" for name, count in sorted(spans.items()))
    return (
        f"spans per run, tracing on: {total / runs:.2f} ({each}; {total} spans of {runs} runs "
        f"in {requests} exports, {size / 1e6:.1f} MB; {timed / total:.0%} received while "
        f"timed; receiver CPU {cpu * 1000 / runs:.2f} ms per run)"
    )


def _cpu_per_run(rows: list[Measurement]) -> str:
    """CPU milliseconds per completed run of each process over `rows`, while timed."""
    seconds: dict[str, float] = {}
    done: dict[str, int] = {}
    for row in rows:
        for name, spent in row.cpu.items():
            seconds[name] = seconds.get(name, 0.0) + spent
            done[name] = done.get(name, 0) + row.done
    parts = [f"{name} {seconds[name] * 1000 / done[name]:.2f}" for name in seconds if done[name]]
    return ", ".join(parts) if parts else "not known here (no /proc)"


def tracing_line(rounds: list[TracingRound], *, ok: bool) -> str:
    """The median of the rounds' on / off rates, held to `TRACING_GOAL` (missed whatever
    it is when the spans say tracing was not what it should have been: `ok` False)."""
    ratio = statistics.median(one.ratio for one in rounds) if rounds else 0.0
    verdict = "met" if ok and ratio >= TRACING_GOAL else "missed"
    return (
        f"tracing on/off throughput = {_median_of([one.ratio for one in rounds])}   "
        f"(goal >= {TRACING_GOAL:.2f}: {verdict})"
    )


def _median_of(ratios: list[float]) -> str:
    if not ratios:
        return "none"
    each = ", ".join(f"{ratio:.2f}" for ratio in ratios)
    median = f"median of {each}" if len(ratios) > 1 else "one round"
    return f"{statistics.median(ratios):.2f} ({median})"


def _safe_url(url: str) -> str:
    return sa.engine.make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    sys.exit(main())
