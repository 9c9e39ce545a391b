"""B2: a backlog of runs that each wait 200 ms on a model, through tracon's openai provider,
beside plain Celery making the same call with the official `openai` client.

Both sides start one worker process at the same concurrency on a backlog already queued and
are timed from the first start to the last end, in one invocation, against one local model
server (`bench/b2_stub.py`) that counts the calls it holds at once. With N slots and a model
that takes d seconds, the ideal span is runs / N x d; `ratio = tracon / celery` says how much
of it tracon loses to its own work, and the stub's maximum in flight says whether every
slot was busy.

With `--stream` the model streams its answer (the same delay, as chunks), tracon's provider
streams (`Stream: true`: its text is published live, coalesced, as a run's followers get it)
and the Celery task calls the client with `stream=True` and reads every chunk; the report adds
the Redis commands, the publishes and the coalesced deltas a streamed run costs. See
bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from bench.b1_throughput import (
    ID_CHUNK,
    RUN_POLL_SECONDS,
    TERMINAL,
    RunCounter,
    _chunks,
    _safe_url,
    _shown,
    await_runs,
    child_env,
    choose_redis,
    import_baseline,
)
from bench.b2_stub import MODEL, STREAM_PIECES, SlowModel
from bench.harness import CLI, STARTUP_TIMEOUT, GroupCpu, command_calls, met, run_benchmark
from tracon_jobs.cli.supervisor import Child, Supervisor, wait_until
from tracon_jobs.coordination.live_text import RedisLiveText
from tracon_jobs.db.models import Run

AGENT = "bench"
GOAL_RATIO = 1.2
GOAL_STREAM_RATIO = 1.0
GOAL_PUBLISHES_PER_DELTA = 1.0
GOAL_IN_FLIGHT_SHARE = 0.95
SUBMIT_THREADS = 8
READY_MARK = " ready."
READY_POLL_SECONDS = 0.01


@dataclass(frozen=True)
class Options:
    runs: int
    concurrency: int
    delay: float
    database: str | None
    redis: str | None
    timeout: float
    tracon_only: bool
    stream: bool
    keep: bool

    @property
    def goal_ratio(self) -> float:
        return GOAL_STREAM_RATIO if self.stream else GOAL_RATIO


@dataclass(frozen=True)
class RedisCost:
    """What the tracon side cost Redis, all processes: every command the server ran (INFO
    commandstats, inside scripts too), its PUBLISHes, and what the live text channel
    carried (a subscriber's count of its messages, and the distinct deltas among them)."""

    commands: int
    publishes: int
    text_publishes: int
    deltas: int
    withdrawn: int


@dataclass(frozen=True)
class Measurement:
    """One side: how many ended well, the span, and what the model and the worker saw."""

    label: str
    count: int
    done: int
    span: float
    max_in_flight: int | None
    connections: int | None
    cpu_seconds: float | None
    problem: str = ""
    redis: RedisCost | None = None

    @property
    def complete(self) -> bool:
        return self.done == self.count and not self.problem

    @property
    def cpu_ms_per_run(self) -> float | None:
        if self.cpu_seconds is None or not self.done:
            return None
        return self.cpu_seconds / self.done * 1000


# -- options -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b2_inflight", description=__doc__)
    parser.add_argument("--runs", type=int, default=1000, help="runs and tasks in each backlog")
    parser.add_argument("--concurrency", type=int, default=100, help="worker threads, each side")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds the model takes")
    parser.add_argument("--database", help="SQL URL (default: a fresh SQLite file)")
    parser.add_argument("--redis", help="Redis URL, flushed (default: a private server)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--tracon-only", action="store_true", help="skip the Celery lines")
    parser.add_argument(
        "--stream", action="store_true", help="the model streams, and so do both sides"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    args = parser.parse_args(argv)
    if min(args.runs, args.concurrency) < 1 or args.delay < 0:
        parser.error("--runs and --concurrency must be at least 1, --delay at least 0")
    return Options(**vars(args))


# -- the whole benchmark -------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    return run_benchmark("b2", options.keep, lambda *context: benchmark(options, *context))


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    redis_url = choose_redis(options.redis, workdir, cleanup)
    database = options.database or f"sqlite:///{workdir / 'tracon.db'}"
    model = cleanup.enter_context(SlowModel(options.delay))
    rows = [measure_tracon(options, workdir, database, redis_url, model, children)]
    children.stop()  # each side gets the machine to itself
    if not options.tracon_only:
        baseline = import_baseline(redis_url)
        chat = baseline.chat_stream if options.stream else baseline.chat
        for task in (chat, baseline.sleep):
            rows.append(measure_celery(options, baseline, task, redis_url, model, children))
            children.stop()
    print_report(options, redis_url, database, model.base_url, rows)
    return 0 if all(row.complete for row in rows) else 1


# -- measure A: tracon ---------------------------------------------------------------------


def write_config(workdir: Path, model_url: str, concurrency: int, stream: bool) -> Path:
    """One agent whose one turn is one call to the slow model through the openai provider
    (streamed or not, as `stream` says)."""
    provider = {"Kind": "openai", "BaseUrl": model_url, "ApiKey": "bench", "Stream": stream}
    config = {
        "Providers": {"slow": provider},
        "Agents": {
            AGENT: {
                "Instructions": "benchmark agent",
                "Model": {"Provider": "slow", "Model": MODEL},
                "Tools": [],
            }
        },
        "Pricing": {"Models": {MODEL: {"InputPerMillion": 1, "OutputPerMillion": 2}}},
        "Worker": {"Concurrency": concurrency},
    }
    path = workdir / "tracon.json"
    path.write_text(json.dumps({"Tracon": config}, indent=2))
    return path


def measure_tracon(
    options: Options,
    workdir: Path,
    database: str,
    redis_url: str,
    model: SlowModel,
    children: Supervisor,
) -> Measurement:
    config = write_config(workdir, model.base_url, options.concurrency, options.stream)
    env = child_env(
        TRACON_CONFIG=str(config), TRACON_DATABASE_URL=database, TRACON_REDIS_URL=redis_url
    )
    redis.Redis.from_url(redis_url).flushdb()
    ids = queue_backlog(env, options.runs)
    model.reset()
    tally = RedisTally(redis_url) if options.stream else None
    worker = children.start("worker", [*CLI, "worker", "-n", "b2@%h"], env)
    cpu = WorkerCpu(worker, children)
    runs = RunSpans(database, queued=len(ids))  # all still Queued: no worker ran before
    try:
        statuses = await_runs(runs, ids, options.timeout, children)
        cpu.stop()
        span = runs.span(ids)
        cost = tally.stop() if tally is not None else None
    finally:
        runs.close()
        if tally is not None:
            tally.close()
    done = statuses["Completed"]
    problem = "" if done == options.runs else f"not all Completed: {_shown(statuses)}"
    return Measurement(
        "tracon runs (openai)" if not options.stream else "tracon runs (streamed)",
        options.runs,
        done,
        span,
        model.max_in_flight,
        model.connections,
        cpu.seconds,
        problem,
        cost,
    )


class RedisTally:
    """From now to `stop`: the commands and PUBLISHes the Redis server ran, and every message
    on the live text channel (counted by a subscriber of this process)."""

    SETTLE_SECONDS = 0.5  # the runs' last writes after their `ended_at`

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.channel = RedisLiveText(self.client).channel
        self.lock = threading.Lock()
        self.text_publishes = 0
        self.withdrawn = 0
        self.deltas: set[tuple[str, int, int]] = set()
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(**{self.channel: self._message})
        self.thread = self.pubsub.run_in_thread(sleep_time=0.05, daemon=True)
        wait_until(
            lambda: self._subscribed(), what="text channel subscriber", timeout=STARTUP_TIMEOUT
        )
        self.before = command_calls(self.client)

    def _subscribed(self) -> bool:
        counts = dict(self.client.pubsub_numsub(self.channel))
        return int(counts.get(self.channel.encode(), 0)) > 0

    def _message(self, message: dict[str, Any]) -> None:
        data = json.loads(message["data"])
        with self.lock:
            self.text_publishes += 1
            if data.get("x"):
                self.withdrawn += 1
            else:
                self.deltas.add((str(data["r"]), int(data["c"]), int(data["o"])))

    def stop(self) -> RedisCost:
        time.sleep(self.SETTLE_SECONDS)
        after = command_calls(self.client)
        total = sum(after.values()) - sum(self.before.values()) - 1  # less this INFO
        publishes = after.get("publish", 0) - self.before.get("publish", 0)
        with self.lock:
            return RedisCost(
                total, publishes, self.text_publishes, len(self.deltas), self.withdrawn
            )

    def close(self) -> None:
        self.thread.stop()
        self.thread.join(timeout=5)
        self.pubsub.close()
        self.client.close()


def queue_backlog(env: dict[str, str], count: int) -> list[str]:
    """Migrate, then submit `count` runs as the web does (row, then message): the backlog."""
    from tracon_jobs.db.migrate import upgrade
    from tracon_jobs.runs.store import NewRun
    from tracon_jobs.runtime import Runtime
    from tracon_jobs.settings import load_settings

    settings = load_settings(env["TRACON_CONFIG"], environ=env)
    upgrade(settings.database.url)
    runtime = Runtime(settings)
    try:
        tenant = runtime.tenants.ensure_tenant(AGENT)

        def submit(index: int) -> str:
            new = NewRun(tenant, AGENT, {"message": f"bench run {index}"})
            return runtime.dispatcher.submit(new).id

        with ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="b2-submit") as pool:
            return list(pool.map(submit, range(count)))
    finally:
        runtime.close()


class RunSpans(RunCounter):
    """Statuses and the span of a set of runs, straight from SQL."""

    def span(self, ids: list[str]) -> float:
        """Seconds from the first `started_at` to the last `ended_at`."""
        starts: list[datetime] = []
        ends: list[datetime] = []
        with self.engine.connect() as conn:
            for chunk in _chunks(ids, ID_CHUNK):
                query = sa.select(sa.func.min(Run.started_at), sa.func.max(Run.ended_at)).where(
                    Run.id.in_(chunk)
                )
                first, last = conn.execute(query).one()
                starts += [first] if first else []
                ends += [last] if last else []
        if not starts or not ends:
            return 0.0
        return (max(ends) - min(starts)).total_seconds()


# -- measure B: plain Celery ---------------------------------------------------------------


def measure_celery(
    options: Options,
    baseline: Any,
    task: Any,
    redis_url: str,
    model: SlowModel,
    children: Supervisor,
) -> Measurement:
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
        for index in range(options.runs):
            task.delay(f"bench task {index}")
        model.reset()
        worker = start_baseline_worker(options, baseline, task, redis_url, model, children)
        cpu = WorkerCpu(worker, children)
        counts = await_done(lambda: celery_counts(client, baseline), options, children)
        cpu.stop()
        span = celery_span(client, baseline.SPANS_KEY)
    finally:
        client.close()
    done = counts["Completed"]
    problem = "" if done == options.runs else f"not all done: {_shown(counts)}"
    calls = task is not baseline.sleep
    label = "celery + openai stream" if task is baseline.chat_stream else "celery + openai client"
    return Measurement(
        label if calls else f"celery sleep {options.delay * 1000:.0f} ms",
        options.runs,
        done,
        span,
        model.max_in_flight if calls else None,
        model.connections if calls else None,
        cpu.seconds,
        problem,
    )


def start_baseline_worker(
    options: Options,
    baseline: Any,
    task: Any,
    redis_url: str,
    model: SlowModel,
    children: Supervisor,
) -> Child:
    env = child_env(
        BENCH_REDIS_URL=redis_url,
        BENCH_MODEL_URL=model.base_url,
        BENCH_MODEL_DELAY=str(options.delay),
    )
    worker = (
        f"worker --pool threads -c {options.concurrency} --prefetch-multiplier 1 -Q {task.name}"
    )
    argv = [sys.executable, "-m", "celery", "-A", "bench.baseline_app", *worker.split()]
    name = f"baseline-worker-{task.name.rsplit('.', 1)[-1]}"  # one log per measurement
    return children.start(name, [*argv, "--loglevel", "INFO", "-n", "b2@%h"], env)


def celery_counts(client: redis.Redis, baseline: Any) -> Counter[str]:
    done, failed = client.mget(baseline.DONE_KEY, baseline.FAILED_KEY)
    return Counter({"Completed": int(done or 0), "Failed": int(failed or 0)})


def celery_span(client: redis.Redis, key: str) -> float:
    pairs = [entry.split() for entry in client.lrange(key, 0, -1)]
    if not pairs:
        return 0.0
    return max(float(end) for _, end in pairs) - min(float(start) for start, _ in pairs)


# -- shared --------------------------------------------------------------------------------


def await_done(
    count: Callable[[], Counter[str]], options: Options, children: Supervisor
) -> Counter[str]:
    """Counts once every run or task ended (or at the timeout, with some still open)."""
    deadline = time.monotonic() + options.timeout
    while True:
        counts = count()
        if sum(counts[s] for s in TERMINAL) >= options.runs or time.monotonic() > deadline:
            return counts
        children.check_alive()
        time.sleep(RUN_POLL_SECONDS)


class WorkerCpu:
    """CPU seconds a worker process spends once it said it is ready (Linux `/proc`)."""

    def __init__(self, worker: Child, children: Supervisor) -> None:
        self.worker = worker
        wait_until(
            lambda: READY_MARK in worker.text(),
            what=f"{worker.name} ready",
            timeout=STARTUP_TIMEOUT,
            watch=children.running(),
            interval=READY_POLL_SECONDS,
        )
        self.cpu = GroupCpu({worker.name: worker.popen.pid})  # its own process group
        self.seconds: float | None = None

    def stop(self) -> None:
        self.cpu.stop()
        self.seconds = self.cpu.seconds.get(self.worker.name)


# -- report --------------------------------------------------------------------------------


def print_report(
    options: Options, redis_url: str, database: str, model_url: str, rows: list[Measurement]
) -> None:
    ideal = options.runs / options.concurrency * options.delay
    streamed = f", streamed as {STREAM_PIECES} chunks" if options.stream else ""
    print(
        f"B2 in flight: a backlog of {options.runs} runs of one {options.delay * 1000:.0f} ms "
        f"model call{streamed}, one worker process at concurrency {options.concurrency}"
    )
    print(f"  database {_safe_url(database)}  ·  redis {redis_url}  ·  model {model_url}\n")
    print(
        f"  {'measure':<24} {'N':>6} {'done':>6} {'span s':>8} {'in flight':>10} "
        f"{'conns':>6} {'CPU ms/run':>11}"
    )
    for row in rows:
        print(
            f"  {row.label:<24} {row.count:>6} {row.done:>6} {row.span:>8.2f} "
            f"{_or_dash(row.max_in_flight):>10} {_or_dash(row.connections):>6} "
            f"{_or_dash(row.cpu_ms_per_run, '.2f'):>11}"
        )
    for row in rows:
        if row.problem:
            print(f"  FAILED {row.label}: {row.problem}")
    sizes = f"{options.runs} / {options.concurrency} x {options.delay} s"
    print(f"\n  ideal span = {sizes} = {ideal:.2f} s")
    tracon = rows[0]
    if len(rows) > 1:
        print(f"  {ratio_line(tracon, rows[1], options.goal_ratio)}")
    print(f"  {in_flight_line(tracon, options.concurrency)}")
    if tracon.redis is not None and tracon.done:
        for line in stream_lines(tracon.redis, tracon.done):
            print(f"  {line}")


def ratio_line(tracon: Measurement, celery: Measurement, goal: float) -> str:
    ratio = tracon.span / celery.span if celery.span else float("inf")
    return (
        f"span ratio = tracon / celery = {ratio:.2f}x   (goal <= {goal:.2f}x: {met(ratio <= goal)})"
    )


def stream_lines(cost: RedisCost, runs: int) -> list[str]:
    """The Redis cost of a streamed run, and its live text publishes per coalesced delta."""
    per_delta = cost.text_publishes / cost.deltas if cost.deltas else float("inf")
    goal = GOAL_PUBLISHES_PER_DELTA
    lines = [
        f"Redis commands a streamed run (every process, the worker's start included): "
        f"{cost.commands / runs:.1f}",
        f"publishes a streamed run: {cost.publishes / runs:.2f} (every PUBLISH; "
        f"{cost.text_publishes / runs:.2f} of them on the live text channel)",
        f"coalesced deltas a streamed run: {cost.deltas / runs:.2f} (distinct deltas on the live "
        f"text channel; the model sends {STREAM_PIECES} chunks)",
        f"publishes per coalesced delta {per_delta:.2f} (goal <= {goal:.0f}: "
        f"{met(per_delta <= goal)})",
    ]
    if cost.withdrawn:
        lines.append(f"withdrawn texts: {cost.withdrawn}")
    return lines


def in_flight_line(tracon: Measurement, concurrency: int) -> str:
    wanted = round(concurrency * GOAL_IN_FLIGHT_SHARE)
    seen = tracon.max_in_flight or 0
    verdict = met(seen >= wanted)
    return f"tracon max in flight = {seen} of {concurrency}   (goal >= {wanted}: {verdict})"


def _or_dash(value: float | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
