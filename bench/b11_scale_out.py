"""B11: runs per second with 1, 2 and 4 worker processes, each on a host of its own.

This is the "B9" of issue 31 (the name B9 was taken by the webhook benchmark): the measured
scale-out figure of `docs/scaling.md`. Hosts are network namespaces joined by a bridge
(`tests/netns.py`, the partition tests' harness): the stores (a redis-server and a PostgreSQL
cluster of the benchmark's own) in one, the web (`tracon-jobs web --workers 2 --threads 32`)
in another, and each worker process (`tracon-jobs worker`, `Worker.Concurrency` 16) in one of
its own, as on separate machines, except that every host shares this machine's cores. The
benchmark's own process, on the bridge too, submits `--runs` runs of B1's trivial agent (a
scripted model that answers "ok" at once, no tools) over HTTP with `Prefer: respond-async`
from 16 client threads, and times them from the first POST to the last run `Completed` (SQL),
after a warm-up of 20 runs that proves every worker is up.

For each worker count it prints runs per second, the speed-up against one worker and the
per-core efficiency: runs/s over min(workers, cores), relative to one worker's. On a machine
with fewer cores than workers (the shared machine has 2) the larger counts measure contention
for the cores, not scale: the web, the stores and the client share the same cores too. It also
prints the CPU seconds a run of each piece (web, the workers together, Redis, PostgreSQL, this
process), read from `/proc`: what a host of each kind must supply per run, the capacity model's
input. `--rounds` (default 2) measures the counts up then down (1, 2, 4, then 4, 2, 1), each
from an empty Redis, and reports the mean of each count's rounds, so a drift of a shared
machine weighs on every count.

Needs root, `ip netns`, `nft` and PostgreSQL's server binaries (`tests.netns.unavailable`);
without them it says what is missing and exits 0 (skipped). Goals: none; it measures.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.b1_throughput import (
    RunCounter,
    api_client,
    await_runs,
    issue_api_key,
    submit_runs,
    tracon_env,
    warm_up_tracon,
    write_config,
)
from bench.harness import CLI, STARTUP_TIMEOUT, run_benchmark, start_web
from tests.netns import Network, StorePostgres, StoreRedis, postgres_binaries, unavailable
from tracon_jobs.cli.supervisor import Child, Supervisor, wait_until

WEB_PORT = 8000
WEB_WORKERS = 2
WEB_THREADS = 32
CLIENT_THREADS = 16
WORKER_CONCURRENCY = 16
DEFAULT_WORKERS = (1, 2, 4)


@dataclass(frozen=True)
class Options:
    runs: int
    workers: tuple[int, ...]
    rounds: int
    timeout: float
    keep: bool


@dataclass(frozen=True)
class Measurement:
    workers: int
    runs: int
    seconds: float
    done: int
    cpu: dict[str, float] = field(default_factory=dict)  # piece -> CPU seconds while timed

    @property
    def per_second(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b11_scale_out", description=__doc__)
    parser.add_argument("--runs", type=int, default=2000, help="runs timed per measurement")
    parser.add_argument(
        "--workers", default="1,2,4", help="worker process counts, comma-separated (1,2,4)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="passes over the counts (up, then down, ...)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    args = parser.parse_args(argv)
    try:
        counts = tuple(sorted({int(part) for part in args.workers.split(",") if part.strip()}))
    except ValueError:
        parser.error("--workers: whole numbers separated by commas, e.g. 1,2,4")
    if not counts or min(counts) < 1 or max(counts) > 9:
        parser.error("--workers: counts from 1 to 9")
    if min(args.runs, args.rounds) < 1:
        parser.error("--runs and --rounds must be at least 1")
    return Options(args.runs, counts, args.rounds, args.timeout, args.keep)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"B11 scale-out: skipped: {reason}")
        return 0
    return run_benchmark("b11", options.keep, lambda *context: benchmark(options, *context))


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    bin_dir = postgres_binaries()
    assert bin_dir is not None  # unavailable() said so
    hosts = ["web", *(f"w{n}" for n in range(1, max(options.workers) + 1))]
    network = Network(hosts)
    cleanup.callback(network.destroy)  # after the stores and children below are stopped
    network.create()
    store_redis = StoreRedis(network, workdir)
    cleanup.callback(store_redis.stop)
    store_redis.start()
    postgres = StorePostgres(network, bin_dir)
    cleanup.callback(postgres.stop)
    postgres.start()
    cleanup.callback(children.stop)  # the processes stop before the stores (safe twice)
    database = postgres.create_database("tracon_b11")
    redis_url = store_redis.url()
    env = tracon_env(write_config(workdir, WORKER_CONCURRENCY), database, redis_url)
    api_key = issue_api_key(env)  # migrate, then the tenant's key (over the bridge)
    base_url = start_web(
        children,
        env,
        workers=WEB_WORKERS,
        threads=WEB_THREADS,
        bind=f"{network.addresses['web']}:{WEB_PORT}",
        inside=lambda argv: network.inside("web", argv),
    )
    counter = RunCounter(database)
    cleanup.callback(counter.close)
    clients = [api_client(base_url, api_key) for _ in range(CLIENT_THREADS)]
    for client in clients:
        cleanup.callback(client.close)
    stores_cpu = {
        "redis": _pid_of(store_redis.process),
        "postgresql": postmaster_pid(postgres.data),
    }
    order: list[int] = []
    for number in range(options.rounds):
        order += list(options.workers if number % 2 == 0 else reversed(options.workers))
    measured: list[Measurement] = []
    for count in order:
        flush(redis_url)  # no message or worker registration left from the last count
        row = measure(options, count, network, env, children, clients, counter, stores_cpu)
        measured.append(row)
        print(f"  measured: {count} worker(s): {row.per_second:.1f} runs/s", flush=True)
        if row.done != row.runs:
            break
    print_report(options, network, measured)
    return 0 if all(row.done == row.runs for row in measured) else 1


def flush(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _pid_of(process: subprocess.Popen[bytes] | None) -> int:
    if process is None:
        raise RuntimeError("redis-server did not start")
    return process.pid


def postmaster_pid(data: Path) -> int:
    """The postmaster's pid: the first line of `postmaster.pid` in the cluster's folder."""
    return int((data / "postmaster.pid").read_text().split()[0])


def start_workers(
    count: int, network: Network, env: dict[str, str], children: Supervisor
) -> list[Child]:
    """`count` workers, worker n in namespace `wn`, each with a name of its own; returns
    once every one has logged Celery's "ready."."""
    started = []
    for n in range(1, count + 1):
        argv = [*CLI, "worker", "-n", f"b11w{n}@%h"]
        name = f"worker{n}-of-{count}"
        started.append(children.start(name, network.inside(f"w{n}", argv), env))
    for child in started:
        wait_until(
            functools.partial(logged_ready, child),
            what=f"{child.name} ready",
            timeout=STARTUP_TIMEOUT,
            watch=started,
        )
    return started


def logged_ready(child: Child) -> bool:
    return "ready." in child.text()


def measure(
    options: Options,
    count: int,
    network: Network,
    env: dict[str, str],
    children: Supervisor,
    clients: list[httpx.Client],
    counter: RunCounter,
    stores: dict[str, int],
) -> Measurement:
    """One timed measurement with `count` workers: started, warmed up, timed, stopped."""
    workers = start_workers(count, network, env, children)
    try:
        warm_up_tracon(clients, counter, children)
        web = next(child for child in children.running() if child.name == "web")
        pids = {"web": [web.popen.pid], "workers": [w.popen.pid for w in workers]}
        pids |= {name: [pid] for name, pid in stores.items()}
        before = {name: sum(tree_cpu_seconds(pid) for pid in group) for name, group in pids.items()}
        started, client_cpu = time.perf_counter(), time.process_time()
        submitted = submit_runs(clients, options.runs)
        statuses = await_runs(counter, submitted.ids, options.timeout, children)
        seconds = time.perf_counter() - started
        cpu = {
            name: sum(tree_cpu_seconds(pid) for pid in group) - before[name]
            for name, group in pids.items()
        }
        cpu["bench client"] = time.process_time() - client_cpu
    finally:
        children.stop(workers)
    return Measurement(count, options.runs, seconds, statuses["Completed"], cpu)


def tree_cpu_seconds(pid: int) -> float:
    """User plus system time of process `pid`, of the children it has reaped (a PostgreSQL
    backend that ended), and of its live descendants (gunicorn's workers, the postmaster's
    backends): Linux `/proc`; 0 when the process is gone."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
    children: dict[int, list[int]] = {}
    for child, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(child)
    ticks, todo = 0, [pid]
    if pid in stats:
        ticks += int(stats[pid][13]) + int(stats[pid][14])  # cutime, cstime: reaped children
    while todo:
        current = todo.pop()
        if current in stats:
            ticks += int(stats[current][11]) + int(stats[current][12])  # utime, stime
            todo += children.get(current, [])
    return ticks / os.sysconf("SC_CLK_TCK")


# -- report --------------------------------------------------------------------------------


def print_report(options: Options, network: Network, measured: list[Measurement]) -> None:
    cores = len(os.sched_getaffinity(0))
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print()
    print(
        f"B11 scale-out: {options.runs} runs a measurement, {CLIENT_THREADS} HTTP threads, "
        f"worker concurrency {WORKER_CONCURRENCY}, {options.rounds} round(s); {cores} cores; "
        f"load average now {load}"
    )
    print(
        f"  hosts: namespaces on a bridge {network.net}.0/24: stores (redis-server, "
        "PostgreSQL, fsync off), web (2 gunicorn workers x 32 threads), one per worker\n"
    )
    print(f"  {'measure':<22} {'N':>6} {'seconds':>9} {'per s':>9}")
    for row in measured:
        label = f"{row.workers} worker(s)"
        print(f"  {label:<22} {row.runs:>6} {row.seconds:>9.2f} {row.per_second:>9.1f}")
        if row.done != row.runs:
            print(f"  FAILED {label}: {row.done} of {row.runs} runs Completed")
    rates: dict[int, list[float]] = {}
    for row in measured:
        rates.setdefault(row.workers, []).append(row.per_second)
    first = min(rates)  # 1 unless --workers leaves it out: the speed-up is against it
    first_rate = statistics.mean(rates[first])
    base = first_rate / min(first, cores)
    print()
    print(f"  {'workers':>7} {'runs/s':>9} {'speed-up':>9} {'per-core eff.':>14}   rounds")
    for count in sorted(rates):
        mean = statistics.mean(rates[count])
        speed_up = mean / first_rate if first_rate else 0.0
        efficiency = mean / min(count, cores) / base if base else 0.0
        each = ", ".join(f"{rate:.1f}" for rate in rates[count])
        note = "  (more processes than cores: contention)" if count > cores else ""
        print(f"  {count:>7} {mean:>9.1f} {speed_up:>8.2f}x {efficiency:>14.2f}   {each}{note}")
    print()
    print(
        f"  speed-up against {first} worker(s); per-core efficiency = (runs/s / min(workers, "
        f"cores)) / ({first} worker(s)' runs/s / {min(first, cores)}): 1.00 is linear; the web, "
        "Redis, PostgreSQL and the client share the same cores"
    )
    for count in sorted(rates):
        rows = [row for row in measured if row.workers == count]
        print(f"  CPU ms per run, {count} worker(s): {cpu_line(rows)}")


def cpu_line(rows: list[Measurement]) -> str:
    seconds: dict[str, float] = {}
    done = sum(row.done for row in rows)
    for row in rows:
        for name, spent in row.cpu.items():
            seconds[name] = seconds.get(name, 0.0) + spent
    if not done:
        return "no run completed"
    parts = [f"{name} {spent * 1000 / done:.2f}" for name, spent in seconds.items()]
    total = sum(spent for name, spent in seconds.items() if name != "bench client")
    return ", ".join(parts) + f"; all but the client {total * 1000 / done:.2f}"


if __name__ == "__main__":
    sys.exit(main())
