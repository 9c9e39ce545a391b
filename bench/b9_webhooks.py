"""B9: webhook deliveries: how fast the deliverer empties an outbox, and what a subscription
adds to a run.

Three measurements, in one invocation:

1. **Throughput.** `--messages` `run.completed` messages of real runs wait in the outbox for
   each count of `--endpoints` (1 and 4: that many deliveries each) pointing at a local
   receiver in its own process (asyncio, keep-alive, `200 ok` at once). The deliverer of a
   `Runtime` in this process (`runtime.deliverer`, `Webhooks.Concurrency` attempt threads)
   fans them out and delivers them; timed from the wake-up to the last delivery `delivered`,
   on SQLite and on a scratch PostgreSQL database. Beside each: the same signed POSTs sent by
   the same `Sender` from as many threads, with no SQL at all (the baseline of the ratio).
   A measurement stops at `--max-seconds`; its rate is then what was delivered by then.
2. **Cost added to a run.** B5's counting (`bench.b5_round_trips`: a private PostgreSQL with
   `log_statement=all`, Redis `MONITOR`, real web and worker processes): the SQL statements
   and Redis commands of a trivial run with no endpoint, then with one subscribed to
   `run.completed`, in the same processes. The worker's deliverer is hosted in this process
   for it, its every phase (look, fan-out, claim, record) on connections of its own name, so
   the run's own path and the deliverer's statements a delivery are told apart.
3. **B5 unchanged.** `bench.b5_round_trips.benchmark` itself, as `make bench` runs it (the
   webhooks code in, the worker's deliverer idle, no endpoint): its SQL and Redis a run.

See bench/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import sqlalchemy as sa

from bench import b5_round_trips as b5
from bench.__main__ import POSTGRES_ADMIN, scratch_database
from bench.b1_throughput import (
    AGENT,
    RunCounter,
    api_client,
    child_env,
    issue_api_key,
    write_config,
)
from bench.harness import (
    ROOT,
    STARTUP_TIMEOUT,
    GroupCpu,
    content_length,
    met,
    run_benchmark,
    start_server,
    start_web,
)
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.db import Database
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookMessage
from tracon_jobs.embedded_redis import free_port, start_embedded
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
from tracon_jobs.settings.defaults import WEBHOOK_CONCURRENCY
from tracon_jobs.webhooks import signing
from tracon_jobs.webhooks.deliverer import Attempts, Deliverer
from tracon_jobs.webhooks.deliveries import FAN_OUT_BATCH, Claimed, DeliveryStore, Outcome
from tracon_jobs.webhooks.endpoints import EndpointStore
from tracon_jobs.webhooks.events import WAKE_CHANNEL
from tracon_jobs.webhooks.sender import AttemptResult

EVENT = "run.completed"
WEBHOOKS = {"AllowHttp": True, "AllowPrivateNetworks": True}
"""The receiver is on 127.0.0.1 over plain HTTP; everything else is the defaults."""
RUN_THREADS = 4  # the threads that execute the runs whose messages fill the outbox
POLL_SECONDS = 0.01
PARTS = ("throughput", "cost", "b5")
DATABASES = ("sqlite", "postgresql")
PHASES = ("look", "fan-out", "claim", "record")
"""The deliverer's calls of its `DeliveryStore`: `due`, `fan_out`, `claim`, `record`."""
DELIVERER_APP = "deliverer-"
B5_SQL_BEFORE = 5.0
B5_REDIS_BEFORE = 6.1
"""B5 before the webhooks: 5.0 statements a trivial run; 5.3-5.9 Redis commands in the
history, 6.1 the top of its run-to-run spread."""
QUICK = {"messages": 200, "endpoints": [1, 2], "max_seconds": 5.0, "runs": 20, "warmup": 5}


@dataclass(frozen=True)
class Options:
    messages: int
    endpoints: list[int]
    databases: list[str]
    concurrency: int
    runs: int
    warmup: int
    timeout: float
    max_seconds: float
    skip: list[str]
    quick: bool
    keep: bool


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.b9_webhooks", description=__doc__)
    parser.add_argument("--messages", type=int, default=500, help="messages in the outbox")
    parser.add_argument(
        "--endpoints",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 4],
        help="endpoints of the tenant, one measurement each (comma-separated; default 1,4)",
    )
    parser.add_argument(
        "--databases",
        type=lambda text: text.split(","),
        default=list(DATABASES),
        help="throughput on these (comma-separated; default sqlite,postgresql)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=WEBHOOK_CONCURRENCY,
        help="Webhooks.Concurrency: the deliverer's attempt threads, and the baseline's",
    )
    parser.add_argument("--runs", type=int, default=50, help="runs counted, each side (cost)")
    parser.add_argument("--warmup", type=int, default=10, help="runs before counting (cost)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=15.0,
        help="a throughput measurement stops after this long; its rate is what was delivered",
    )
    parser.add_argument(
        "--skip", action="append", choices=PARTS, default=[], help="leave a part out (repeat)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smaller run: "
        + ", ".join(f"--{k.replace('_', '-')} {_shown(v)}" for k, v in QUICK.items()),
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir and its logs")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if min(args.messages, args.concurrency, args.runs, args.warmup, *args.endpoints) < 1:
        parser.error("--messages, --endpoints, --concurrency, --runs, --warmup: at least 1")
    if set(args.databases) - set(DATABASES):
        parser.error(f"--databases: {' and '.join(DATABASES)} only")
    return Options(**vars(args))


def _shown(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}"


# -- the receiver: its own process, asyncio, keep-alive -----------------------------------


OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Received:
    posts: int = 0
    ids: set[tuple[bytes, bytes]] = field(default_factory=set)  # (path, webhook-id)


def serve_receiver(port: int) -> None:
    """Answer every POST on 127.0.0.1:`port` with `200 ok`, counting them and their distinct
    (path, webhook-id); `GET /count` says so much, as JSON, `GET /reset` too, after it
    set them to zero. Until killed."""
    asyncio.run(_serve_forever(port, Received()))


async def _serve_forever(port: int, received: Received) -> None:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _connection(reader, writer, received)

    server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


async def _connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, received: Received
) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            await reader.readexactly(content_length(head))
            if head.startswith(b"GET /reset"):
                received.posts, received.ids = 0, set()
            if head.startswith((b"GET /count", b"GET /reset")):
                answer = json.dumps({"posts": received.posts, "ids": len(received.ids)}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(answer)}\r\n\r\n".encode()
                    + answer
                )
            else:
                received.posts += 1
                received.ids.add((head.split(b" ", 2)[1], _webhook_id(head)))
                writer.write(OK)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


def _webhook_id(head: bytes) -> bytes:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"webhook-id":
            return value.strip()
    return b""


class Receiver:
    """The receiver process, from this side: its URLs and its counts."""

    def __init__(self, children: Supervisor, env: dict[str, str]) -> None:
        self.port = free_port()
        code = f"from bench.b9_webhooks import serve_receiver; serve_receiver({self.port})"
        start_server(children, "receiver", [sys.executable, "-c", code], env, self.port)
        self.pid = next(c.popen.pid for c in children.running() if c.name == "receiver")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10.0)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def counts(self, *, reset: bool = False) -> tuple[int, int]:
        """(POSTs, distinct (path, webhook-id)) so far (since now, with `reset`)."""
        found = self.client.get("/reset" if reset else "/count").json()
        return int(found["posts"]), int(found["ids"])

    def close(self) -> None:
        self.client.close()


# -- the whole benchmark --------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    # the database server's user must reach the private clusters' directories (B5's)
    return run_benchmark(
        "b9", options.keep, lambda *context: benchmark(options, *context), mode=0o755
    )


def benchmark(options: Options, workdir: Path, children: Supervisor, cleanup: ExitStack) -> int:
    # the attempts log as a worker's do (`tracon-jobs worker` logs at INFO), to a file
    logging.basicConfig(
        filename=workdir / "b9.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the bench's own polls
    env = child_env()
    receiver = Receiver(children, env)
    cleanup.callback(receiver.close)
    print(
        f"B9 webhook deliveries: Webhooks.Concurrency {options.concurrency}, a receiver in its "
        f"own process answering 200 at once{' (--quick)' if options.quick else ''}\n",
        flush=True,
    )
    complete = True
    if "throughput" not in options.skip:
        complete &= throughput(options, workdir, receiver, cleanup)
    if "cost" not in options.skip:
        print_cost(measure_cost(options, workdir / "cost", children, receiver))
    if "b5" not in options.skip:
        print_b5(measure_b5(options, workdir / "b5"))
    return 0 if complete else 1


# -- 1. throughput ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    label: str
    count: int
    done: int
    seconds: float
    cpu: float  # this process's CPU seconds (the deliverer or the senders, and the poll)
    receiver_cpu: float | None
    problem: str = ""  # it did not work: FAILED
    note: str = ""  # it worked, but stopped at --max-seconds

    @property
    def per_second(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Pair:
    database: str
    endpoints: int
    deliverer: Timed
    sender: Timed

    @property
    def ratio(self) -> float:
        base = self.sender.per_second
        return self.deliverer.per_second / base if base else 0.0


def throughput(options: Options, workdir: Path, receiver: Receiver, cleanup: ExitStack) -> bool:
    redis_server = start_embedded(workdir / "redis-throughput")
    cleanup.callback(redis_server.stop)
    config = json.loads(write_config(workdir, RUN_THREADS).read_text())["Tracon"]
    config["Webhooks"] = {**WEBHOOKS, "Concurrency": options.concurrency}
    pairs: list[Pair] = []
    skipped: list[str] = []
    if "sqlite" in options.databases:
        sqlite = f"sqlite:///{workdir / 'throughput.db'}"
        pairs += measure_database("SQLite", sqlite, options, config, redis_server.url, receiver)
    with ExitStack() as scratch:
        postgres = scratch_database(scratch) if "postgresql" in options.databases else ""
        if postgres is None:
            skipped.append(f"PostgreSQL: none answers at {POSTGRES_ADMIN} (TRACON_BENCH_POSTGRES)")
        elif postgres:
            pairs += measure_database(
                "PostgreSQL", postgres, options, config, redis_server.url, receiver
            )
    print_throughput(options, pairs, skipped)
    return all(not (p.deliverer.problem or p.sender.problem) for p in pairs)


def measure_database(
    name: str,
    url: str,
    options: Options,
    config: dict[str, Any],
    redis_url: str,
    receiver: Receiver,
) -> list[Pair]:
    upgrade(url)
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings.model_validate(
        {**config, "Database": {"Url": url}, "Redis": {"Url": redis_url}}
    )
    runtime = Runtime(settings, sender=lambda _run_id: None)
    try:
        tenant_id = runtime.tenants.ensure_tenant(AGENT)
        endpoints = Endpoints(runtime, tenant_id, receiver)
        endpoints.use(1)
        queue_messages(runtime, tenant_id, options.messages)
        pairs = []
        for count in options.endpoints:
            secrets = endpoints.use(count)
            deliverer = time_deliverer(runtime, receiver, options, count)
            sender = time_sender(runtime, receiver, options, secrets)
            pairs.append(Pair(name, count, deliverer, sender))
            print(f"  {name}, {count} endpoint(s): measured", flush=True)
        return pairs
    finally:
        runtime.close()


class Endpoints:
    """The tenant's endpoints at the receiver, one path each; `use(k)`: exactly `k` enabled."""

    def __init__(self, runtime: Runtime, tenant_id: str, receiver: Receiver) -> None:
        self.runtime = runtime
        self.tenant_id = tenant_id
        self.receiver = receiver
        self.made: list[tuple[str, str, str]] = []  # id, url, secret

    def use(self, count: int) -> list[tuple[str, str]]:
        """(url, secret) of the `count` enabled endpoints; the others disabled."""
        store = EndpointStore(self.runtime.db)
        while len(self.made) < count:
            url = self.receiver.url(f"/hook/{len(self.made)}")
            endpoint, secret = store.create(self.tenant_id, url, [EVENT])
            self.made.append((endpoint.id, url, secret))
        ids = [made[0] for made in self.made]
        with self.runtime.db.write() as session:
            enabled = WebhookEndpoint.id.in_(ids[:count])
            session.execute(sa.update(WebhookEndpoint).values(enabled=enabled))
        self.runtime.subscriptions.changed()
        return [(url, secret) for _id, url, secret in self.made[:count]]


def queue_messages(runtime: Runtime, tenant_id: str, count: int) -> None:
    """`count` trivial runs executed here, their outbox messages written as a worker writes
    them (one endpoint subscribed; the deliverer not started yet)."""

    def one(index: int) -> None:
        run_id = runtime.runs.create(NewRun(tenant_id, AGENT, {"message": f"b9 {index}"})).id
        runtime.executor.execute(run_id)

    with ThreadPoolExecutor(RUN_THREADS, thread_name_prefix="b9-run") as pool:
        for _ in pool.map(one, range(count)):
            pass
    written = _count(runtime.db, WebhookMessage)
    if written != count:
        raise RuntimeError(f"{count} runs wrote {written} outbox messages")


def _count(db: Database, model: Any, *where: Any) -> int:
    with db.read() as session:
        query = sa.select(sa.func.count()).select_from(model).where(*where)
        return int(session.execute(query).scalar_one())


def reset_outbox(db: Database) -> None:
    """Every message back to not fanned out, no delivery, no attempt: a full outbox again."""
    with db.write() as session:
        session.execute(sa.delete(WebhookAttempt))
        session.execute(sa.delete(WebhookDelivery))
        session.execute(
            sa.update(WebhookMessage).values(body=None, fanned_at=None, claim_until=None)
        )


def time_deliverer(runtime: Runtime, receiver: Receiver, options: Options, endpoints: int) -> Timed:
    """A full outbox, then the runtime's deliverer started: until every delivery is
    `delivered` (or `--max-seconds`); stopped after, its attempts in flight recorded."""
    expected = options.messages * endpoints
    reset_outbox(runtime.db)
    receiver.counts(reset=True)
    deliverer = runtime.deliverer  # built as a worker builds it
    cpu = GroupCpu({"receiver": receiver.pid})
    started, own_cpu = time.perf_counter(), time.process_time()
    deliverer.start()  # it looks at once
    done, limit = 0, min(options.max_seconds, options.timeout)
    delivered = WebhookDelivery.status == "delivered"
    while time.perf_counter() - started < limit:
        # the receiver's count first (another process), then the rows: the last record
        if receiver.counts()[0] >= expected:
            done = _count(runtime.db, WebhookDelivery, delivered)
            if done >= expected:
                break
        time.sleep(POLL_SECONDS)
    else:
        done = _count(runtime.db, WebhookDelivery, delivered)
    seconds, own = time.perf_counter() - started, time.process_time() - own_cpu
    cpu.stop()
    deliverer.stop(wait=5.0)
    del runtime.__dict__["deliverer"]  # the next measurement starts a fresh one
    posts, ids = receiver.counts()
    attempts = _count(runtime.db, WebhookAttempt)
    problem = note = ""
    if done == 0:
        problem = f"none of {expected} delivered in {seconds:.0f} s"
    elif posts != attempts or ids != posts:
        problem = f"{posts} POSTs, {ids} distinct, {attempts} attempts recorded"
    elif done < expected:
        note = f"stopped at {seconds:.0f} s (--max-seconds): {done} of {expected} delivered"
    label = f"deliverer, {endpoints} endpoint{'s' if endpoints > 1 else ''}"
    return Timed(label, expected, done, seconds, own, cpu.seconds.get("receiver"), problem, note)


def time_sender(
    runtime: Runtime, receiver: Receiver, options: Options, endpoints: list[tuple[str, str]]
) -> Timed:
    """The same signed POSTs (the bodies the deliverer rendered, every endpoint's) from
    `Webhooks.Concurrency` threads of the runtime's own `Sender`: no SQL at all."""
    with runtime.db.read() as session:
        bodies = session.execute(sa.select(WebhookMessage.id, WebhookMessage.body)).all()
    items = [(id_, body or "", url, secret) for id_, body in bodies for url, secret in endpoints]
    sender = runtime.webhook_sender
    receiver.counts(reset=True)

    def send(share: list[tuple[str, str, str, str]]) -> int:
        failed = 0
        for message_id, text, url, secret in share:
            body = text.encode()
            headers = signing.headers(message_id, int(time.time()), body, (secret,))
            failed += not sender.send(url, body, headers).succeeded
        return failed

    threads = options.concurrency
    shares = [items[index::threads] for index in range(threads)]
    cpu = GroupCpu({"receiver": receiver.pid})
    started, own_cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads, thread_name_prefix="b9-sender") as pool:
        failed = sum(pool.map(send, shares))
    seconds, own = time.perf_counter() - started, time.process_time() - own_cpu
    cpu.stop()
    posts = receiver.counts()[0]
    problem = f"{failed} of {len(items)} not 2xx" if failed else ""
    if not problem and posts != len(items):
        problem = f"{posts} POSTs arrived of {len(items)}"
    label = f"Sender alone, {len(endpoints)} endpoint{'s' if len(endpoints) > 1 else ''}"
    done = len(items) - failed
    return Timed(label, len(items), done, seconds, own, cpu.seconds.get("receiver"), problem)


def print_throughput(options: Options, pairs: list[Pair], skipped: list[str]) -> None:
    print(
        f"\n1. Throughput: {options.messages} run.completed messages in the outbox, "
        f"{options.concurrency} attempt threads, one process"
    )
    print(
        f"  {'database':<11} {'measure':<24} {'N':>6} {'seconds':>8} {'per s':>8} "
        f"{'CPU ms':>7} {'receiver':>9}"
    )
    for pair in pairs:
        for row in (pair.deliverer, pair.sender):
            receiver = (
                "-"
                if row.receiver_cpu is None
                else f"{row.receiver_cpu * 1000 / max(row.done, 1):.2f}"
            )
            print(
                f"  {pair.database:<11} {row.label:<24} {row.count:>6} {row.seconds:>8.2f} "
                f"{row.per_second:>8.1f} {row.cpu * 1000 / max(row.done, 1):>7.2f} {receiver:>9}"
            )
    for line in skipped:
        print(f"  skipped: {line}")
    for pair in pairs:
        for row in (pair.deliverer, pair.sender):
            if row.problem:
                print(f"  FAILED {pair.database} {row.label}: {row.problem}")
            elif row.note:
                print(f"  {pair.database} {row.label}: {row.note}")
    print("  (CPU ms: this process's CPU a delivery or POST; receiver: its process's, a POST)\n")
    for pair in pairs:
        print(
            f"  deliveries/s {pair.database} {pair.endpoints} endpoint(s): "
            f"{pair.deliverer.per_second:.1f}, ratio deliverer / Sender alone = {pair.ratio:.2f} "
            f"(no goal)"
        )
    print(flush=True)


# -- 2. cost added to a run ---------------------------------------------------------------------


class PhasedStore(DeliveryStore):
    """A `DeliveryStore` whose every call runs on a database of its own phase, whose
    connections give PostgreSQL the name `deliverer-<phase>` (`application_name`): B5's log
    then tells which of the deliverer's calls sent each statement, its clock reads, `BEGIN`
    and `COMMIT` included. Same code, same statements as the runtime's store."""

    def __init__(self, base: DeliveryStore, url: str, pool_size: int) -> None:
        self.phases = {
            phase: DeliveryStore(
                Database(
                    f"{url}?application_name={DELIVERER_APP}{phase}", max_connections=pool_size
                ),
                base.targets,
                base.backoff,
                base.disable_after,
                base.claim_for,
                links=base.links,
            )
            for phase in PHASES
        }
        look = self.phases["look"]
        super().__init__(
            look.db,
            base.targets,
            base.backoff,
            base.disable_after,
            base.claim_for,
            links=base.links,
        )

    def due(self) -> Any:
        return self.phases["look"].due()

    def fan_out(self, limit: int = FAN_OUT_BATCH) -> int:
        return self.phases["fan-out"].fan_out(limit)

    def claim(self, owner: str, limit: int) -> list[Claimed]:
        return self.phases["claim"].claim(owner, limit)

    def record(self, claimed: Claimed, result: AttemptResult) -> Outcome:
        return self.phases["record"].record(claimed, result)

    def cancel(self, claimed: Claimed, why: str) -> Outcome:
        return self.phases["record"].cancel(claimed, why)

    def dispose(self) -> None:
        for store in self.phases.values():
            store.db.dispose()


def worker_without_deliverer() -> None:
    """`tracon-jobs worker` (the arguments after `-c`) whose webhook deliverer does not start:
    B9 hosts it in its own process, on connections named by phase. The run's path, its
    outbox write and wake-up included, is the worker's own."""
    from tracon_jobs.cli import main as cli

    Deliverer.start = lambda self: None  # type: ignore[method-assign]
    sys.exit(cli(sys.argv[1:]))


@dataclass
class Window:
    runs: int
    sql: Counter[tuple[str, str]]  # (app, kind)
    redis: Counter[tuple[str, str]]  # (role, command)
    seconds: float = 0.0
    wakes: int = 0  # messages on the deliverers' wake channel

    def per_run(self, role: str | None = None, *, redis_side: bool = False) -> float:
        counts = self.redis if redis_side else self.sql
        total = sum(n for (r, _kind), n in counts.items() if role is None or r == role)
        return total / self.runs


@dataclass
class Cost:
    without: Window
    with_endpoint: Window
    live: Window  # the deliverer's, per delivery, one run at a time
    backlog: Window  # the deliverer's, per delivery, a backlog of the same messages
    messages_per_run: float


class WakeCounter:
    """A subscriber of `WAKE_CHANNEL` that notes when each wake-up arrived: the outbox's
    `PUBLISH` after a commit that wrote messages, told apart from Celery's own."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client  # held: a client collected closes its pool, the pubsub's too
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(WAKE_CHANNEL)
        self.pubsub.get_message(timeout=1.0)  # the subscription's confirmation
        self.seen: list[float] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stopped.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message is not None and message.get("type") == "message":
                self.seen.append(time.time())

    def between(self, start: float, end: float) -> int:
        return sum(1 for at in list(self.seen) if start <= at <= end)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(2.0)
        self.pubsub.close()
        self.client.close()


def measure_cost(options: Options, workdir: Path, children: Supervisor, receiver: Receiver) -> Cost:
    with ExitStack() as cleanup:
        workdir.mkdir()
        workdir.chmod(0o755)
        postgres = b5.PrivatePostgres(workdir / "postgres")
        postgres.start()
        cleanup.callback(postgres.stop)
        embedded = start_embedded(workdir / "redis")
        cleanup.callback(embedded.stop)
        config_path = write_config(workdir, RUN_THREADS)
        config = json.loads(config_path.read_text())
        config["Tracon"]["Webhooks"] = dict(WEBHOOKS, Concurrency=options.concurrency)
        config_path.write_text(json.dumps(config, indent=2))
        env = child_env(
            TRACON_CONFIG=str(config_path),
            TRACON_DATABASE_URL=postgres.url,
            TRACON_REDIS_URL=embedded.url,
        )
        api_key = issue_api_key(env)
        ours = Supervisor(cwd=ROOT, log_dir=workdir)
        cleanup.callback(ours.stop)
        base_url = start_web(
            ours,
            dict(env, TRACON_DATABASE_URL=f"{postgres.url}?application_name=web"),
            workers=1,
            threads=8,
        )
        hosted_out = "from bench.b9_webhooks import worker_without_deliverer as w; w()"
        ours.start(
            "worker",
            [sys.executable, "-c", hosted_out, "worker", "-n", "b9@%h"],
            dict(env, TRACON_DATABASE_URL=f"{postgres.url}?application_name=worker"),
        )
        monitor = b5.Monitor(redis.Redis.from_url(embedded.url, socket_timeout=None))
        monitor.start()
        wakes = WakeCounter(redis.Redis.from_url(embedded.url, socket_timeout=None))
        cleanup.callback(wakes.stop)
        bench_url = f"{postgres.url}?application_name={b5.BENCH_APP}"
        counter = RunCounter(bench_url)
        cleanup.callback(counter.close)
        clients = [api_client(base_url, api_key) for _ in range(4)]
        for client in clients:
            cleanup.callback(client.close)
        settings = Settings.model_validate(
            {**config["Tracon"], "Database": {"Url": bench_url}, "Redis": {"Url": embedded.url}}
        )
        runtime = Runtime(settings, sender=lambda _run_id: None)  # the bench's: not counted
        cleanup.callback(runtime.close)
        redis_port = int(embedded.url.rsplit(":", 1)[1].split("/")[0])

        def window(runs: int, after: Callable[[], None] | None = None) -> tuple[Window, Window]:
            """Runs counted as B5 counts them (web and worker), then, after `after`, the
            deliverer's statements up to then."""
            started, log_start = time.time(), postgres.size()
            b5.run_all(clients, counter, ours, runs, options.timeout)
            time.sleep(b5.SETTLE_SECONDS)
            ended, log_end = time.time(), postgres.size()
            if after is not None:
                after()
                time.sleep(b5.SETTLE_SECONDS)
            later, log_later = time.time(), postgres.size()
            roles = b5.client_roles(redis_port, ours)
            named = [(roles.get(c, "other"), name) for c, name in monitor.between(started, ended)]
            sql = postgres.statements(log_start, log_end)
            runs_side = Window(
                runs,
                Counter({k: n for k, n in sql.items() if k[0] in b5.ROLES}),
                Counter(item for item in named if item[0] in b5.ROLES),
                ended - started,
                wakes.between(started, ended),
            )
            spent = postgres.statements(log_start, log_later)
            other = monitor.between(started, later)
            deliverer = Window(
                runs,
                Counter({k: n for k, n in spent.items() if k[0].startswith(DELIVERER_APP)}),
                Counter(
                    (role, name)
                    for role, name in ((roles.get(c, "other"), name) for c, name in other)
                    if role == "other"
                ),
            )
            return runs_side, deliverer

        b5.run_all(clients, counter, ours, options.warmup, STARTUP_TIMEOUT)
        time.sleep(b5.SETTLE_SECONDS)
        without, _nothing = window(options.runs)

        # one endpoint wants run.completed: every process told, the deliverer started here
        tenant_id = runtime.tenants.ensure_tenant(AGENT)
        EndpointStore(runtime.db).create(tenant_id, receiver.url("/cost"), [EVENT])
        runtime.subscriptions.changed()
        base = runtime.webhook_deliveries
        phased = PhasedStore(base, postgres.url, options.concurrency + 2)
        cleanup.callback(phased.dispose)
        deliverer = Deliverer(
            phased,
            Attempts(runtime.webhook_sender),
            runtime.redis,
            runtime.subscriptions,
            concurrency=options.concurrency,
            poll_seconds=settings.webhooks.poll_interval.total_seconds(),
        )
        deliverer.start()
        cleanup.callback(deliverer.stop, 5.0)
        time.sleep(b5.SETTLE_SECONDS)  # the web and the worker read what is wanted again
        b5.run_all(clients, counter, ours, options.warmup, STARTUP_TIMEOUT)
        settle_deliveries(runtime.db, options.timeout)
        time.sleep(b5.SETTLE_SECONDS)
        messages_before = _count(runtime.db, WebhookMessage)
        with_endpoint, live = window(
            options.runs, lambda: settle_deliveries(runtime.db, options.timeout)
        )
        written = _count(runtime.db, WebhookMessage) - messages_before
        live.runs = written  # one endpoint: a delivery a message

        # the same messages again, all at once: the deliverer's statements on a backlog
        queued = _count(runtime.db, WebhookMessage)
        log_start, started = postgres.size(), time.time()
        reset_outbox(runtime.db)
        runtime.outbox.wake()
        settle_deliveries(runtime.db, options.timeout)
        time.sleep(b5.SETTLE_SECONDS)
        spent = postgres.statements(log_start, postgres.size())
        roles = b5.client_roles(redis_port, ours)
        backlog = Window(
            queued,
            Counter({k: n for k, n in spent.items() if k[0].startswith(DELIVERER_APP)}),
            Counter(
                (role, name)
                for role, name in (
                    (roles.get(c, "other"), name)
                    for c, name in monitor.between(started, time.time())
                )
                if role == "other"
            ),
        )
        return Cost(without, with_endpoint, live, backlog, written / options.runs)


def settle_deliveries(db: Database, timeout: float) -> None:
    """Until every message is fanned out and no delivery is pending."""
    deadline = time.monotonic() + timeout
    waiting = [WebhookMessage.fanned_at.is_(None)]
    pending = [WebhookDelivery.status == "pending"]
    while _count(db, WebhookMessage, *waiting) or _count(db, WebhookDelivery, *pending):
        if time.monotonic() > deadline:
            raise RuntimeError(f"webhook deliveries still pending after {timeout:g} s")
        time.sleep(POLL_SECONDS * 5)
    undelivered = _count(db, WebhookDelivery, WebhookDelivery.status != "delivered")
    if undelivered:
        raise RuntimeError(f"{undelivered} webhook deliveries ended other than delivered")


def print_cost(cost: Cost) -> None:
    without, with_endpoint = cost.without, cost.with_endpoint
    print(
        f"2. Cost added to a run (B5's counting, PostgreSQL): {without.runs} trivial runs each "
        "side, web and worker\n"
    )
    print(f"  {'per trivial run':<40} {'SQL':>7} {'Redis':>7} {'wakes':>7} {'window s':>9}")
    for label, one in (("no endpoint", without), (f"one endpoint wants {EVENT}", with_endpoint)):
        print(
            f"  {label:<40} {one.per_run():>7.2f} {one.per_run(redis_side=True):>7.2f} "
            f"{one.wakes / one.runs:>7.2f} {one.seconds:>9.2f}"
        )
    sql_added = with_endpoint.per_run() - without.per_run()
    redis_added = with_endpoint.per_run(redis_side=True) - without.per_run(redis_side=True)
    print(f"  {'added by the subscription':<40} {sql_added:>+7.2f} {redis_added:>+7.2f}")
    for side, title in ((False, "SQL"), (True, "Redis")):
        changes = _kind_changes(without, with_endpoint, redis_side=side)
        if changes:
            print(f"    {title} by kind: " + ", ".join(f"{k} {d:+.2f}" for k, d in changes))
    print(f"  outbox messages written a run: {cost.messages_per_run:.2f}")
    wakes = with_endpoint.wakes / with_endpoint.runs - without.wakes / without.runs
    print(
        f"  PUBLISH on {WAKE_CHANNEL} a run, as a subscriber got them: {wakes:+.2f}; the rest "
        "of the Redis difference is Celery's own (batched task events, idle BRPOPs), which "
        "move from one window to the next\n"
    )
    sql_before, sql_after = round(without.per_run(), 1), round(with_endpoint.per_run(), 1)
    print(
        f"  SQL round trips a run with one endpoint subscribed: {sql_after:.1f}, "
        f"{sql_after - sql_before:+.1f} on {sql_before:.1f} without (no goal)"
    )
    print(
        f"  Redis commands added to a run by a subscription: the wake-up, {wakes:+.2f} "
        f"(all commands {redis_added:+.2f}) (no goal)\n"
    )
    for label, one in (
        (f"live, as the {without.runs} runs came", cost.live),
        (f"a backlog of the same {cost.backlog.runs} messages", cost.backlog),
    ):
        print_deliverer(label, one)


def _kind_changes(a: Window, b: Window, *, redis_side: bool) -> list[tuple[str, float]]:
    def per_kind(one: Window) -> Counter[str]:
        counts = one.redis if redis_side else one.sql
        kinds: Counter[str] = Counter()
        for (_role, kind), number in counts.items():
            kinds[kind] += number
        return kinds

    before, after = per_kind(a), per_kind(b)
    changes = [
        (kind, after[kind] / b.runs - before[kind] / a.runs) for kind in sorted(before | after)
    ]
    return [(kind, delta) for kind, delta in changes if abs(delta) >= 0.01]


def print_deliverer(label: str, one: Window) -> None:
    n = max(one.runs, 1)
    kinds = [k for k in b5.SQL_KINDS if any(kind == k for _a, kind in one.sql)]
    kinds += sorted({kind for _a, kind in one.sql} - set(b5.SQL_KINDS))
    print(f"  the deliverer's SQL a delivery, {label} ({one.runs} deliveries)")
    print(f"  {'phase':<10}" + "".join(f"{kind:>9}" for kind in kinds) + f"{'all':>9}")
    for phase in PHASES:
        app = DELIVERER_APP + phase
        cells = "".join(f"{one.sql[(app, kind)] / n:>9.2f}" for kind in kinds)
        total = sum(v for (a, _k), v in one.sql.items() if a == app) / n
        print(f"  {phase:<10}{cells}{total:>9.2f}")
    cells = "".join(
        f"{sum(v for (_a, k), v in one.sql.items() if k == kind) / n:>9.2f}" for kind in kinds
    )
    print(f"  {'all':<10}{cells}{sum(one.sql.values()) / n:>9.2f}")
    redis_total = sum(one.redis.values()) / n
    named = ", ".join(f"{name} {count / n:.2f}" for (_r, name), count in one.redis.most_common())
    shown = f" ({named})" if named else ""
    print(f"  Redis commands a delivery (this process): {redis_total:.2f}{shown}\n")


# -- 3. B5 itself -----------------------------------------------------------------------------


def measure_b5(options: Options, workdir: Path) -> b5.Counts:
    """`bench.b5_round_trips.benchmark` as it is, with B5's own sizes (its idle commands are
    spread over its 50 runs, whatever `--runs` says), its own cluster, Redis and processes."""
    workdir.mkdir()
    workdir.chmod(0o755)
    b5_options = b5.parse_args(["--keep"] if options.keep else [])
    with ExitStack() as cleanup:
        children = Supervisor(cwd=ROOT, log_dir=workdir)
        cleanup.callback(children.stop)
        return b5.benchmark(b5_options, workdir, children, cleanup)


def print_b5(counts: b5.Counts) -> None:
    n = counts.runs
    sql = sum(counts.sql.values()) / n
    pings = sum(number for (_role, kind), number in counts.sql.items() if kind == "ping") / n
    commands = sum(counts.redis.values()) / n
    print(
        f"3. B5 as make bench runs it (bench.b5_round_trips.benchmark): the webhooks code in, "
        f"the worker's deliverer idle, no endpoint, {n} runs"
    )
    by_role = ", ".join(
        f"{role} {sum(v for (r, _k), v in counts.sql.items() if r == role) / n:.2f}"
        for role in b5.ROLES
    )
    print(f"  SQL by process: {by_role}; B5's figure {sql:.2f}, of which idle pings {pings:.2f}")
    print("  (a pooled connection unused for 10 s is pinged at its next checkout: time, not runs)")
    by_command: Counter[str] = Counter()
    for (_role, command), number in counts.redis.items():
        by_command[command] += number
    shown = ", ".join(f"{command} {number / n:.2f}" for command, number in by_command.most_common())
    print(f"  Redis by command: {shown}")
    held = sql - pings
    print(
        f"  B5 with no endpoint, SQL round trips per run, idle pings aside = {held:.1f} "
        f"(goal <= {B5_SQL_BEFORE:.1f}, B5 before webhooks: {met(round(held, 1) <= B5_SQL_BEFORE)})"
    )
    print(
        f"  B5 with no endpoint, Redis commands per run = {commands:.1f} "
        f"(goal <= {B5_REDIS_BEFORE:.1f}, B5 before webhooks: "
        f"{met(round(commands, 1) <= B5_REDIS_BEFORE)})"
    )
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
