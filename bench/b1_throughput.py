"""B1: end-to-end agent runs per second through tracon, beside plain Celery no-ops per second.

Both are timed in one invocation on the same Redis, one worker process each with the same
pool, concurrency and prefetch, so `ratio = tracon / celery` says how much of the broker's
throughput survives tracon's own work per run (HTTP, SQL rows and events, fences, feed).
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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import sqlalchemy as sa

from bench.harness import CLI, ROOT, STARTUP_TIMEOUT, GroupCpu, run_benchmark, start_web
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.db.engine import normalize_url
from tracon_jobs.db.models import Run
from tracon_jobs.embedded_redis import answers, start_embedded

LOCAL_REDIS_EXAMPLE = "redis://127.0.0.1:6379/14"
AGENT = "bench"
RUN_PATH = f"/api/agents/{AGENT}/run"
ASYNC = {"Prefer": "respond-async"}
GOALS = {"sqlite": 0.45, "postgresql": 0.40}
"""The ratio each database is held to; PostgreSQL's is lower for its network round trips."""
WARMUP = 20
ROUNDS = 3
"""Pairs of measurements (tracon, then Celery) in one invocation: the ratio held to the goal
is their median, as one pair moves by a tenth either way on a shared 2-CPU machine."""
RUN_POLL_SECONDS = 0.02
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


@dataclass(frozen=True)
class Measurement:
    label: str
    count: int
    seconds: float
    done: int
    problem: str = ""
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds, timed part

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
    """Ours plus `extra`, with the project root importable (`bench` is not installed)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


# -- measure A: tracon ---------------------------------------------------------------------


def measure_tracon(
    options: Options, env: dict[str, str], database: str, children: Supervisor
) -> tuple[Measurement, Submitted]:
    api_key = issue_api_key(env)
    base_url = start_tracon(env, children)
    counter = RunCounter(database)
    clients = [api_client(base_url, api_key) for _ in range(options.concurrency)]
    try:
        warm_up_tracon(clients, counter, children)
        cpu = GroupCpu({child.name: child.popen.pid for child in children.running()})
        started, client_cpu = time.perf_counter(), time.process_time()
        submitted = submit_runs(clients, options.runs)
        statuses = await_runs(counter, submitted.ids, options.timeout, children)
        seconds = time.perf_counter() - started
        cpu.stop()
        cpu.seconds["bench client"] = time.process_time() - client_cpu
    finally:
        for client in clients:
            client.close()
        counter.close()
    done = statuses["Completed"]
    problem = "" if done == options.runs else f"not all Completed: {_shown(statuses)}"
    measured = Measurement("tracon runs (HTTP)", options.runs, seconds, done, problem, cpu.seconds)
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
    worker = f"worker --pool threads -c {concurrency} --prefetch-multiplier 1 -E -Q bench.noop"
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


def _safe_url(url: str) -> str:
    return sa.engine.make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    sys.exit(main())
