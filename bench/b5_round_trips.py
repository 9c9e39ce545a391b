"""B5: round trips per trivial run, counted by the servers themselves.

A trivial run (one model call through the scripted provider, no tools) is submitted over
HTTP with `Prefer: respond-async` and executed by a worker: real `tracon-jobs web` and
`tracon-jobs worker` processes. A private PostgreSQL logs every statement it receives
(`log_statement=all`), a private Redis reports every command (`MONITOR`); B5 counts both
over the measured runs and prints them per run, by kind. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import itertools
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from bench.b1_throughput import (
    RunCounter,
    _shown,
    api_client,
    await_runs,
    child_env,
    issue_api_key,
    submit_runs,
    write_config,
)
from bench.harness import CLI, run_benchmark, start_web
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.embedded_redis import free_port, start_embedded

GOAL_SQL = 12
GOAL_REDIS = 15
STARTUP_TIMEOUT = 60.0
SETTLE_SECONDS = 0.5  # the worker acks and reports a task after the run's final write
ROLES = ("web", "worker")
BENCH_APP = "b5-bench"
LOG_LINE = re.compile(r"^(?P<app>[^|]*)\|LOG:  (?:statement|execute [^:]*): (?P<sql>.*)$")
PING = re.compile(r"^(select 1)?\s*;?$", re.IGNORECASE)  # psycopg's pre-ping sends ";"
SQL_KINDS = ("ping", "BEGIN", "INSERT", "UPDATE", "SELECT", "DELETE", "COMMIT", "ROLLBACK")


@dataclass(frozen=True)
class Options:
    runs: int
    warmup: int
    concurrency: int
    timeout: float
    keep: bool


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b5_round_trips", description=__doc__)
    parser.add_argument("--runs", type=int, default=50, help="runs counted")
    parser.add_argument("--warmup", type=int, default=10, help="runs before counting starts")
    parser.add_argument("--concurrency", type=int, default=4, help="submitting client threads")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the runs")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    args = parser.parse_args(argv)
    if min(args.runs, args.warmup, args.concurrency) < 1:
        parser.error("--runs, --warmup and --concurrency must be at least 1")
    return Options(**vars(args))


# -- the servers that count --------------------------------------------------------------


class PrivatePostgres:
    """A throwaway cluster that logs every statement with the client's application name.

    Run as the `postgres` user when we are root (the server refuses to run as root)."""

    def __init__(self, directory: Path) -> None:
        self.bin = _pg_binaries()
        self.dir = directory
        self.data = directory / "data"
        self.log = directory / "server.log"
        self.port = free_port()
        directory.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(directory, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-N")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off "
            "-c log_statement=all -c 'log_line_prefix=%a|' -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def size(self) -> int:
        return self.log.stat().st_size

    def statements(self, start: int, end: int) -> Counter[tuple[str, str]]:
        """(application, kind) -> statements logged between two sizes of the log."""
        with self.log.open("rb") as log:
            log.seek(start)
            text = log.read(end - start).decode(errors="replace")
        counts: Counter[tuple[str, str]] = Counter()
        for line in text.splitlines():
            match = LOG_LINE.match(line)
            if match and match["app"] != BENCH_APP:
                counts[(match["app"], sql_kind(match["sql"]))] += 1
        return counts

    def _run(self, tool: str, *args: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [*prefix, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr or done.stdout}")


def _pg_binaries() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    path = Path(found[-1]) if found else Path(shutil.which("pg_ctl") or "")
    if not path.name or not path.exists():
        raise RuntimeError("PostgreSQL's server binaries (pg_ctl, initdb) are not installed")
    return path.parent


def sql_kind(sql: str) -> str:
    text = sql.strip()
    if PING.match(text):
        return "ping"
    return text.split(None, 1)[0].upper().rstrip(";") if text else "other"


@dataclass
class Monitor:
    """Every command the Redis server runs for a client (not inside scripts), with its time."""

    client: redis.Redis
    seen: list[tuple[float, str, str]] = field(default_factory=list)  # time, client, command
    _thread: threading.Thread | None = None

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._follow, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("MONITOR did not start")

    def _follow(self, ready: threading.Event) -> None:
        with (
            contextlib.suppress(redis.RedisError, OSError, ValueError),
            self.client.monitor() as monitor,
        ):
            ready.set()
            for entry in monitor.listen():
                if entry.get("client_type") == "lua":
                    continue  # a command a script ran: no round trip of its own
                name = command_name(str(entry["command"]))
                client = f"{entry.get('client_address')}:{entry.get('client_port')}"
                self.seen.append((float(entry["time"]), client, name))

    def between(self, start: float, end: float) -> list[tuple[str, str]]:
        return [(client, name) for at, client, name in list(self.seen) if start <= at <= end]


DEFERRED = ("budget_spend", "quota_spend", "breaker_record")
"""The scripts called without waiting for their reply (`Scripts.__call__(reply=False)`)."""


def script_names() -> dict[str, str]:
    """The SHA1 of every Lua script tracon loads -> its name, to tell EVALSHA calls apart;
    scripts run together in one call (`coordination.scripts.deferring`) as `a+b+c`."""
    from tracon_jobs.coordination.scripts import LUA, composed_source
    from tracon_jobs.worker import broker

    sources = {path.stem: path.read_text() for path in LUA.glob("*.lua")}
    names = sorted(sources)
    for count in (2, 3):
        for combo in itertools.product(names, repeat=count):
            sources["+".join(combo)] = composed_source(combo)
    # the deferred ones (a spend, a quota's spend, a success) ahead of the call that needs a reply
    for deferred in itertools.product(DEFERRED, repeat=3):
        for name in names:
            combo = (*deferred, name)
            sources["+".join(combo)] = composed_source(combo)
        # and a run's end told to the fair lines with its final publish
        combo = (*deferred, "fair_share", "feed_publish")
        sources["+".join(combo)] = composed_source(combo)
    sources["kombu_delivered"] = broker.DELIVERED_LUA  # kombu's ack emulation, as scripts
    sources["kombu_acked"] = broker.ACKED_LUA
    sources["kombu_take"] = broker.TAKE_LUA
    return {hashlib.sha1(text.encode()).hexdigest(): name for name, text in sources.items()}


SCRIPTS = script_names()


def command_name(command: str) -> str:
    """`EVALSHA <script name>` for a script call, else the command's name."""
    words = command.split(" ", 2)
    name = words[0].strip('"').upper()
    if name == "EVALSHA" and len(words) > 1:
        return f"EVALSHA {SCRIPTS.get(words[1].strip(chr(34)), words[1][:8])}"
    return name


def client_roles(redis_port: int, children: Supervisor) -> dict[str, str]:
    """`ip:port` of each Redis connection -> the role of the process that holds it."""
    try:
        import psutil
    except ImportError:
        return {}
    roles: dict[int, str] = {}
    for child in children.running():
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(child.popen.pid)
            for process in [parent, *parent.children(recursive=True)]:
                roles[process.pid] = child.name
    found: dict[str, str] = {}
    with contextlib.suppress(psutil.Error):
        for conn in psutil.net_connections("tcp"):
            if conn.raddr and conn.raddr.port == redis_port and conn.pid in roles:
                found[f"{conn.laddr.ip}:{conn.laddr.port}"] = roles[conn.pid]
    return found


# -- the whole benchmark -------------------------------------------------------------------


@dataclass
class Counts:
    runs: int
    sql: Counter[tuple[str, str]]  # (role, kind)
    redis: Counter[tuple[str, str]]  # (role, command)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)

    def body(workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
        print_report(options, benchmark(options, workdir, children, cleanup))
        return 0

    # the database server's user must reach its directory
    return run_benchmark("b5", options.keep, body, mode=0o755)


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> Counts:
    postgres = PrivatePostgres(workdir / "postgres")
    postgres.start()
    cleanup.callback(postgres.stop)
    embedded = start_embedded(workdir / "redis")
    cleanup.callback(embedded.stop)
    env = child_env(
        TRACON_CONFIG=str(write_config(workdir, options.concurrency)),
        TRACON_DATABASE_URL=postgres.url,
        TRACON_REDIS_URL=embedded.url,
    )
    api_key = issue_api_key(env)
    base_url = start_processes(env, postgres.url, children)
    # MONITOR waits as long as the runs take: no read timeout (a timeout ended it silently)
    monitor = Monitor(redis.Redis.from_url(embedded.url, socket_timeout=None))
    monitor.start()
    counter = RunCounter(f"{postgres.url}?application_name={BENCH_APP}")
    clients = [api_client(base_url, api_key) for _ in range(options.concurrency)]
    try:
        run_all(clients, counter, children, options.warmup, STARTUP_TIMEOUT)
        time.sleep(SETTLE_SECONDS)
        started, log_start = time.time(), postgres.size()
        run_all(clients, counter, children, options.runs, options.timeout)
        time.sleep(SETTLE_SECONDS)
        ended, log_end = time.time(), postgres.size()
        roles = client_roles(int(embedded.url.rsplit(":", 1)[1].split("/")[0]), children)
    finally:
        for client in clients:
            client.close()
        counter.close()
    commands = Counter(
        (roles.get(client, "other"), name) for client, name in monitor.between(started, ended)
    )
    return Counts(options.runs, postgres.statements(log_start, log_end), commands)


def start_processes(env: dict[str, str], url: str, children: Supervisor) -> str:
    """Web and worker, each naming itself to PostgreSQL so its statements are told apart."""
    web = dict(env, TRACON_DATABASE_URL=f"{url}?application_name=web")
    worker = dict(env, TRACON_DATABASE_URL=f"{url}?application_name=worker")
    base_url = start_web(children, web, workers=1, threads=8)
    children.start("worker", [*CLI, "worker", "-n", "b5@%h"], worker)
    return base_url


def run_all(
    clients: list[httpx.Client],
    counter: RunCounter,
    children: Supervisor,
    count: int,
    timeout: float,
) -> None:
    ids = submit_runs(clients, count).ids
    statuses = await_runs(counter, ids, timeout, children)
    if statuses["Completed"] != len(ids):
        raise RuntimeError(f"runs did not all complete: {_shown(statuses)}")


# -- report --------------------------------------------------------------------------------


def print_report(options: Options, counts: Counts) -> None:
    n = counts.runs
    print(f"B5 round trips per trivial run: {n} runs after {options.warmup} warm-up runs")
    print("  PostgreSQL statements (log_statement=all) and Redis commands (MONITOR), per run\n")
    sql_total = sum(counts.sql.values()) / n
    redis_total = sum(counts.redis.values()) / n
    kinds = [k for k in SQL_KINDS if any(kind == k for _r, kind in counts.sql)]
    kinds += sorted({kind for _r, kind in counts.sql} - set(SQL_KINDS))
    print_table("SQL", kinds, counts.sql, n)
    commands = sorted({name for _r, name in counts.redis}, key=lambda c: -_total(counts.redis, c))
    print_table("Redis", commands, counts.redis, n)
    print(f"  {verdict('SQL round trips', sql_total, GOAL_SQL)}")
    print(f"  {verdict('Redis commands', redis_total, GOAL_REDIS)}")


def _total(counts: Counter[tuple[str, str]], kind: str) -> int:
    return sum(number for (_role, k), number in counts.items() if k == kind)


def print_table(title: str, kinds: list[str], counts: Counter[tuple[str, str]], n: int) -> None:
    roles = [*ROLES, *sorted({role for role, _k in counts} - set(ROLES))]
    width = max([24, *(len(kind) + 1 for kind in kinds)])  # composed scripts have long names
    print(f"  {title:<{width}}" + "".join(f"{role:>9}" for role in roles) + f"{'total':>9}")
    for kind in kinds:
        cells = "".join(f"{counts[(role, kind)] / n:>9.2f}" for role in roles)
        print(f"  {kind:<{width}}{cells}{_total(counts, kind) / n:>9.2f}")
    cells = "".join(
        f"{sum(v for (r, _k), v in counts.items() if r == role) / n:>9.2f}" for role in roles
    )
    print(f"  {'all':<{width}}{cells}{sum(counts.values()) / n:>9.2f}\n")


def verdict(what: str, per_run: float, goal: int) -> str:
    met = "met" if per_run <= goal else "missed"
    return f"{what} per run = {per_run:.1f}   (goal <= {goal}: {met})"


if __name__ == "__main__":
    sys.exit(main())
