"""Partitions between hosts, with real processes: web, two worker hosts and the stores, each
host a network namespace of its own joined to the stores' bridge by a veth pair
(tests/netns.py), on a private Redis and PostgreSQL. A link is cut by dropping its packets
both ways (no reset reaches either side), or slowed by a relay that delays every chunk.

Each case's docstring states its guarantee; docs/reliability.md#partitions has the table and
what the cases measured. Every run calls the write tool `record_step` twice (steps A and B)
around `slow_step`, a wait each host ends when the test touches its `fast` flag; each host
writes its tools' counters to a folder of its own, so a body is known by the host that ran it.
"""

from __future__ import annotations

import concurrent.futures
import signal
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from tests.e2e.cluster import FAST_RECONCILE, STARTUP_SECONDS, Cluster, Process, wait_for_log
from tests.helpers import ENDED, Script, missing_service, scripted_agent, wait_until
from tests.netns import (
    POSTGRES_PORT,
    REDIS_PORT,
    RELAY_PORT,
    DelayRelay,
    Network,
    StorePostgres,
    StoreRedis,
    postgres_binaries,
    unavailable,
)
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import Run, RunEvent, ToolCallRecord
from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

HOSTS = ("web", "w1", "w2")
WEB_PORT = 8000
TEMPLATE = "partition_template"
ORPHAN_THRESHOLD = 2.0  # FAST_RECONCILE's
SCAN_INTERVAL = 0.5  # FAST_RECONCILE's
HEARTBEAT_TICK = 1.0  # a worker writes its heartbeats on its 1-second poll (`runs.live`)
RUNS = 3

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "record_step", "Arguments": {"step": "A"}}]},
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 60}}]},
    {"ToolCalls": [{"Name": "record_step", "Arguments": {"step": "B"}}]},
    {"Text": "done"},
]
"""A write, a wait the test ends (`slow_step`, until the host's `fast` flag), a second write."""

SECTIONS: dict[str, Any] = scripted_agent(SCRIPT, ["record_step", "slow_step"]) | {
    "RunReconciliation": FAST_RECONCILE,
    "RunContinuation": {"Enabled": True},
    "Runs": {"RequeueAfter": "00:00:03"},
}


@dataclass
class Stores:
    """The module's network and stores; each test gets a fresh database and an empty Redis."""

    network: Network
    redis: StoreRedis
    postgres: StorePostgres
    relay: DelayRelay


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    """Namespaces, bridge, Redis, PostgreSQL (with a migrated template database) and the
    delay relay, for every test of the module; all of it removed after, even when a step of
    the set-up failed. Skips (fails under CI) where namespaces or nftables are missing."""
    reason = unavailable()
    if reason is not None:
        missing_service(reason)
    bin_dir = postgres_binaries()
    assert bin_dir is not None
    network = Network(HOSTS)
    directory = tmp_path_factory.mktemp("partition-stores")
    redis_server = StoreRedis(network, directory)
    postgres = StorePostgres(network, bin_dir)
    relay = DelayRelay(network, directory)
    try:
        network.create()
        redis_server.start()
        postgres.start()
        relay.start()
        upgrade(postgres.create_database(TEMPLATE))
        yield Stores(network, redis_server, postgres, relay)
    finally:
        relay.stop()
        redis_server.stop()
        postgres.stop()
        network.destroy()


@dataclass
class Hosts:
    """The processes of one test on the hosts of `stores`: `start` runs a `tracon-jobs`
    command in a host's namespace (`ip netns exec`), with that host's flags folder and
    environment (`env[host]`)."""

    stores: Stores
    cluster: Cluster
    flags: Path
    sql_url: str
    env: dict[str, dict[str, str]] = field(default_factory=dict)

    def start(self, name: str, host: str, *args: str) -> Process:
        argv = [sys.executable, "-m", "tracon_jobs.cli", *args]
        env = {**self.cluster.env, "TRACON_TEST_FLAGS": str(self.flags / host)}
        env.update(self.env.get(host, {}))
        return self.cluster.children.start(name, self.stores.network.inside(host, argv), env)

    def worker(self, host: str, concurrency: int = 4) -> Process:
        return self.start(host, host, "worker", "-n", f"{host}@%h", "-c", str(concurrency))

    def web(self) -> Process:
        bind = f"{self.stores.network.addresses['web']}:{WEB_PORT}"
        return self.start("web", "web", "web", "--bind", bind, "--workers", "1", "--threads", "8")

    @property
    def base(self) -> str:
        return f"http://{self.stores.network.addresses['web']}:{WEB_PORT}"

    def lines(self, host: str, tool: str) -> list[str]:
        """What `tool` wrote on `host`: one line per body started there."""
        path = self.flags / host / f"{tool}.log"
        return path.read_text().splitlines() if path.exists() else []

    def fast(self, host: str) -> None:
        """`slow_step` on `host` returns at once from now on."""
        (self.flags / host / "fast").touch()

    def cut(self, host: str, *ports: int) -> float:
        self.stores.network.cut(host, *ports)
        return time.monotonic()

    def heal(self, host: str) -> float:
        self.stores.network.heal(host)
        return time.monotonic()


@pytest.fixture
def hosts(stores: Stores, tmp_path: Path) -> Iterator[Hosts]:
    """A fresh database (a copy of the template) and an empty Redis; the configuration
    `SECTIONS`; every process stopped, every cut healed and the relay's delay removed after."""
    sql_url = stores.postgres.create_database(f"partition_{uuid.uuid4().hex[:8]}", TEMPLATE)
    stores.redis.flush()
    flags = tmp_path / "flags"
    for host in HOSTS:
        (flags / host).mkdir(parents=True)
    cluster = Cluster.create(tmp_path, sql_url, stores.redis.url(), **SECTIONS)
    try:
        yield Hosts(stores, cluster, flags, sql_url)
    finally:
        cluster.stop_all()
        for host in HOSTS:
            stores.network.heal(host)
        stores.relay.set(0)


class Api:
    """The web host's HTTP API, with an API key of tenant `acme` (issued in SQL)."""

    def __init__(self, base: str, sql_url: str) -> None:
        from tracon_jobs.db import Database
        from tracon_jobs.tenants import TenantStore

        db = Database(sql_url)
        try:
            tenants = TenantStore(db)
            key = tenants.issue_key(tenants.ensure_tenant("acme")).secret
        finally:
            db.dispose()
        self.base = base
        self.headers = {"Authorization": f"Bearer {key}"}

    def post(self, message: str, timeout: float = 10) -> httpx.Response:
        """`POST /api/agents/demo/run`, asynchronously, in a session of its own (so that an
        orphan of it may be continued)."""
        return httpx.post(
            f"{self.base}/api/agents/demo/run",
            json={"message": message, "sessionId": f"session-{message}"},
            headers={**self.headers, "Prefer": "respond-async"},
            timeout=timeout,
        )

    def submit(self, message: str) -> str:
        answer = self.post(message)
        assert answer.status_code == 202, answer.text
        return str(answer.json()["runId"])


class Rows:
    """Reads of the test's database, each on a connection of its own."""

    def __init__(self, sql_url: str) -> None:
        self.engine = sa.create_engine(sql_url, poolclass=sa.pool.NullPool)

    def runs(self) -> dict[str, Run]:
        with Session(self.engine) as session:
            return {run.id: run for run in session.scalars(sa.select(Run))}

    def run(self, run_id: str) -> Run:
        with Session(self.engine) as session:
            found = session.get(Run, run_id)
            assert found is not None, run_id
            return found

    def by_message(self, message: str) -> Run | None:
        """The run submitted with `message` (when its answer never came)."""
        return next((r for r in self.runs().values() if r.input.get("message") == message), None)

    def events(self, run_id: str) -> list[str]:
        query = sa.select(RunEvent.type).where(RunEvent.run_id == run_id).order_by(RunEvent.seq)
        with self.engine.connect() as conn:
            return [str(kind) for (kind,) in conn.execute(query)]

    def ledger_runs(self) -> dict[str, str]:
        """Each tool execution's idempotency key -> its run."""
        query = sa.select(ToolCallRecord.idempotency_key, ToolCallRecord.run_id)
        with self.engine.connect() as conn:
            return {str(key): str(run_id) for key, run_id in conn.execute(query)}

    def chain(self, run_id: str) -> list[Run]:
        """The run and the runs that continue it, in order."""
        runs = self.runs()
        chain = [runs[run_id]]
        while True:
            after = [r for r in runs.values() if r.continued_from_run_id == chain[-1].id]
            if not after:
                return chain
            chain.append(after[0])

    def chain_status(self, run_id: str) -> str:
        """The status of the chain's last run (a continuation's, once there is one)."""
        return self.chain(run_id)[-1].status


def owner_pid(run: Run) -> int | None:
    """The pid in a run's owner (`host/pid/suffix`): which process claimed it last."""
    parts = (run.owner or "").split("/")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def where_and_when(run: Run, w1: Process, since: float) -> tuple[str, float]:
    """Which worker host ended `run` and how long after `since` (a wall-clock time: the
    database's clock is this machine's), for the figures a case prints."""
    assert run.ended_at is not None
    host = "w1" if owner_pid(run) == w1.popen.pid else "w2"
    return host, round(run.ended_at.replace(tzinfo=UTC).timestamp() - since, 2)


def bodies(hosts: Hosts, rows: Rows) -> dict[str, list[tuple[str, str]]]:
    """Every `record_step` body that started, as (host, step), by the first run of its chain
    (its key's run in the ledger, followed back through `continuedFromRunId`)."""
    runs = rows.runs()
    ledger = rows.ledger_runs()

    def first(run_id: str) -> str:
        while (before := runs[run_id].continued_from_run_id) is not None:
            run_id = before
        return run_id

    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for host in ("w1", "w2"):
        for line in hosts.lines(host, "record_step"):
            step, key = line.split()
            assert key in ledger, f"a body on {host} with no ledger row: {line}"
            found[first(ledger[key])].append((host, step))
    return found


def each_write_once(hosts: Hosts, rows: Rows, run_ids: list[str]) -> None:
    """Each run's chain completed, and started each of its two write bodies exactly once."""
    done = bodies(hosts, rows)
    for run_id in run_ids:
        assert rows.chain_status(run_id) == "Completed", rows.chain(run_id)
        steps = sorted(step for _, step in done[run_id])
        assert steps == ["A", "B"], f"run {run_id}: write bodies {done[run_id]}"


def ended_once(rows: Rows, run_id: str) -> None:
    """The run has one terminal event, `RunCompleted`: a single final write."""
    ends = [kind for kind in rows.events(run_id) if kind in TERMINAL_EVENTS]
    assert ends == ["RunCompleted"], (run_id, ends)


def all_ended(rows: Rows, run_ids: list[str]) -> Callable[[], bool]:
    """Whether each run's chain has ended: its last run ended, and is not an orphan whose
    continuation is still to be written (the scan closes the orphan, then continues it)."""

    def ended(run_id: str) -> bool:
        last = rows.chain(run_id)[-1]
        if last.status not in ENDED:
            return False
        return last.error_type != "orphaned" or "RunContinuationBlocked" in rows.events(last.id)

    return lambda: all(ended(run_id) for run_id in run_ids)


def taken_away_logged(worker: Process, run_ids: list[str]) -> Callable[[], bool]:
    """Whether the worker logged, for each run, that it was taken away from it."""

    def logged() -> bool:
        lines = [line for line in worker.text().splitlines() if "taken away" in line]
        return all(any(run_id in line for line in lines) for run_id in run_ids)

    return logged


@dataclass
class Running:
    """Runs in `slow_step` on w1 (after their first write), with w2 ready to take over."""

    api: Api
    rows: Rows
    web: Process
    w1: Process
    w2: Process
    run_ids: list[str]


def web_answers(hosts: Hosts, web: Process) -> None:
    """Until the web host answers `/healthz` to this process, across the bridge."""

    def answers() -> bool:
        try:
            return httpx.get(f"{hosts.base}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, timeout=STARTUP_SECONDS, what="web /healthz", watch=[web])


def runs_in_flight_on_w1(hosts: Hosts) -> Running:
    """Web, w1 and beat (on w2's host) started together; `RUNS` runs submitted through the
    web, each in `slow_step` on w1 once its write A is done; then w2 started (its `slow_step`
    fast), so that every run starts on w1 and w2 can take over."""
    web = hosts.web()
    w1 = hosts.worker("w1")
    hosts.start("beat", "w2", "beat")
    wait_for_log(w1, "ready.", timeout=STARTUP_SECONDS)
    web_answers(hosts, web)
    api = Api(hosts.base, hosts.sql_url)
    rows = Rows(hosts.sql_url)
    run_ids = [api.submit(f"run-{n}") for n in range(RUNS)]
    wait_until(
        lambda: len(hosts.lines("w1", "slow_step")) == RUNS,
        timeout=30,
        what="every run in slow_step on w1",
        watch=[w1],
    )
    assert len(hosts.lines("w1", "record_step")) == RUNS
    hosts.fast("w2")
    w2 = hosts.worker("w2")
    wait_for_log(w2, "ready.", timeout=STARTUP_SECONDS)
    return Running(api, rows, web, w1, w2, run_ids)


def taken_over_and_quiet(hosts: Hosts, *ports: int) -> None:
    """The shared body of the cases where w1 loses PostgreSQL (alone, or with Redis): see
    their docstrings."""
    running = runs_in_flight_on_w1(hosts)
    rows, w1, run_ids = running.rows, running.w1, running.run_ids

    # When w1's link is cut while its runs are inside slow_step
    cut = hosts.cut("w1", *ports)
    cut_at = time.time()
    late = [running.api.submit(f"during-{n}") for n in range(2)]  # the web and w2 still work

    # Then each run is closed as orphaned within OrphanThreshold + a heartbeat + a scan, and
    # its continuation completes on w2
    orphaned = wait_until(
        lambda: all(rows.run(r).error_type == "orphaned" for r in run_ids),
        timeout=20,
        what="w1's runs closed as orphaned",
    )
    bound = ORPHAN_THRESHOLD + HEARTBEAT_TICK + SCAN_INTERVAL + 2.0  # slack: a loaded machine
    assert orphaned < bound, f"taken over {orphaned:.1f} s after the cut (bound {bound} s)"
    wait_until(all_ended(rows, run_ids), timeout=20, what="continuations ended")
    completed = time.monotonic() - cut
    for run_id in run_ids:
        continuation = rows.chain(run_id)[-1]
        assert continuation.continued_from_run_id == run_id
        assert owner_pid(continuation) == running.w2.popen.pid

    # And w1, whose wait ends now, is still cut off past OrphanThreshold + a scan: it
    # writes nothing, and starts no write body (its next one is B)
    hosts.fast("w1")
    time.sleep(ORPHAN_THRESHOLD + SCAN_INTERVAL)
    closed = {r: (rows.run(r).ended_at, rows.events(r)) for r in run_ids}

    # When the link heals, w1 hears its runs were taken away and stops
    healed = hosts.heal("w1")
    healed_at = time.time() - cut_at
    wait_until(taken_away_logged(w1, run_ids), timeout=45, what="w1 told", watch=[w1])
    quiet = time.monotonic() - healed

    # Then the system serves new runs, and w1 stayed quiet: of the runs it lost, it started
    # no write body after the cut (their B ran on w2 alone) and changed nothing (no second
    # final write); every run's writes ran once
    after = [running.api.submit(f"after-{n}") for n in range(2)]
    wait_until(all_ended(rows, late + after), timeout=45, what="later runs ended")
    late_ended = [where_and_when(rows.chain(run_id)[-1], w1, cut_at) for run_id in late]
    done = bodies(hosts, rows)
    for run_id in run_ids:
        assert done[run_id] == [("w1", "A"), ("w2", "B")], done[run_id]
        assert (rows.run(run_id).ended_at, rows.events(run_id)) == closed[run_id]
        assert "RunCompleted" not in rows.events(run_id)
    each_write_once(hosts, rows, run_ids + late + after)
    print(
        f"\n[partition {ports}] orphaned after {orphaned:.2f} s, continuations completed "
        f"{completed:.2f} s after the cut; healed at {healed_at:.1f} s, w1 told {quiet:.2f} s "
        f"after; runs submitted during the cut ended (host, s after the cut): {late_ended}"
    )


def test_a_worker_that_loses_postgres_is_taken_over_and_stays_quiet(hosts: Hosts) -> None:
    """(b) A worker host loses PostgreSQL only (it still reaches Redis).

    Guarantee: its runs are taken over within OrphanThreshold + a heartbeat + a scan (its
    heartbeats stop: they are SQL writes), continued on the other worker host and completed;
    the write that completed before the cut is answered from the ledger, never run again;
    the cut worker starts no tool body once its claim is gone (every write of it, the
    ledger's before a body included, is fenced), and once healed it stops, writing nothing.
    No run is lost: runs submitted during the cut complete, once each, at the latest after
    the heal (one that reached the cut worker waits for the link: it cannot claim it).
    """
    taken_over_and_quiet(hosts, POSTGRES_PORT)


def test_a_worker_that_loses_both_stores_is_taken_over_and_stays_quiet(hosts: Hosts) -> None:
    """(c) A worker host loses Redis and PostgreSQL.

    Guarantee: as when it loses PostgreSQL alone (taken over within OrphanThreshold + a
    heartbeat + a scan, each write once, quiet once healed); runs submitted during the cut
    all go to the other worker host, which alone reaches the broker.
    """
    taken_over_and_quiet(hosts, POSTGRES_PORT, REDIS_PORT)


def test_a_worker_that_loses_redis_keeps_its_runs(hosts: Hosts) -> None:
    """(a) A worker host loses Redis only (it still reaches PostgreSQL).

    Guarantee: nothing is taken over. The worker keeps its claims, since its heartbeats are
    SQL writes: no run of it is closed as orphaned or continued, however long the cut lasts,
    so no write can run twice. The other worker host serves new runs meanwhile. The cut
    worker's runs complete on it, each write once: they wait at their first Redis call for
    the link (a command sent on a connection whose packets are dropped gets no error until
    the kernel gives up retransmitting), and go on once it heals.
    """
    running = runs_in_flight_on_w1(hosts)
    rows, w1, run_ids = running.rows, running.w1, running.run_ids

    # When w1 loses Redis while its runs are inside slow_step, and their wait ends
    cut = hosts.cut("w1", REDIS_PORT)
    hosts.fast("w1")
    late = [running.api.submit(f"during-{n}") for n in range(2)]

    # Then new runs are served by w2 during the cut
    served = wait_until(all_ended(rows, late), timeout=20, what="new runs served by w2")
    for run_id in late:
        assert owner_pid(rows.run(run_id)) == running.w2.popen.pid
    sends = [rows.run(run_id).enqueue_count for run_id in late]

    # And past OrphanThreshold + a scan, w1's runs are still its own (its heartbeats went on)
    time.sleep(max(0.0, ORPHAN_THRESHOLD + HEARTBEAT_TICK + SCAN_INTERVAL + 2 - served))
    for run_id in run_ids:
        run = rows.run(run_id)
        assert run.status in ("Running", "Completed"), (run.status, run.error_type)
        assert owner_pid(run) == w1.popen.pid
    cut_for = time.monotonic() - cut

    # When the link heals, every run completes on w1, each write once, none continued
    healed = hosts.heal("w1")
    wait_until(all_ended(rows, run_ids), timeout=60, what="w1's runs ended", watch=[w1])
    completed = time.monotonic() - healed
    for run_id in run_ids:
        run = rows.run(run_id)
        assert (run.status, owner_pid(run)) == ("Completed", w1.popen.pid)
        assert "RunContinued" not in rows.events(run_id)
        ended_once(rows, run_id)
    done = bodies(hosts, rows)
    assert all(host == "w1" for run_id in run_ids for host, _ in done[run_id])
    each_write_once(hosts, rows, run_ids + late)
    print(
        f"\n[partition redis] new runs served in {served:.2f} s during a {cut_for:.1f} s "
        f"cut (sends each: {sends}); w1's runs completed {completed:.2f} s after the heal"
    )


def test_a_web_host_that_loses_redis_loses_no_run(hosts: Hosts) -> None:
    """(d) The web host loses Redis (the broker): the workers still reach both stores.

    Guarantee: runs in flight are not affected. A submission during the cut writes its row
    first, so it is never lost: the requeue scan (on the workers) sends it after
    `Runs.RequeueAfter`, and it executes once. Its answer says what became of it: `202` when
    it was sent, or taken by a worker while the web's own send was still failing; `503`
    only for a run closed `enqueue_failed` that never executes. A request whose send hangs
    on a connection to Redis made before the cut gets no answer until the link heals.
    """
    web = hosts.web()
    w1 = hosts.worker("w1")
    w2 = hosts.worker("w2")
    hosts.start("beat", "w2", "beat")
    for worker in (w1, w2):
        wait_for_log(worker, "ready.", timeout=STARTUP_SECONDS)
    web_answers(hosts, web)
    api = Api(hosts.base, hosts.sql_url)
    rows = Rows(hosts.sql_url)
    in_flight = [api.submit(f"run-{n}") for n in range(RUNS)]
    wait_until(
        lambda: len(hosts.lines("w1", "slow_step") + hosts.lines("w2", "slow_step")) == RUNS,
        timeout=30,
        what="every run in slow_step",
    )

    # When the web loses Redis, runs in flight go on
    cut = hosts.cut("web", REDIS_PORT)
    hosts.fast("w1")
    hosts.fast("w2")
    finished = wait_until(all_ended(rows, in_flight), timeout=20, what="runs in flight ended")

    # And runs submitted during the cut (each answer waited for up to 20 s)
    messages = [f"during-{n}" for n in range(3)]
    with concurrent.futures.ThreadPoolExecutor(len(messages)) as pool:
        answers = list(pool.map(lambda m: _answer(api, m, timeout=20), messages))

    # Then each was recorded, and the answer matches what became of it: nothing answered
    # 503 executes, everything else executes once
    wait_until(
        lambda: all((r := rows.by_message(m)) is not None and r.status in ENDED for m in messages),
        timeout=30,
        what="runs submitted during the cut ended",
    )
    executed: list[str] = []
    for message, (status, _) in zip(messages, answers, strict=True):
        run = rows.by_message(message)
        assert run is not None, f"the submission {message} left no run"
        if status == 503:
            assert (run.status, run.error_type) == ("Failed", "enqueue_failed"), message
            assert "ModelCallStarted" not in rows.events(run.id)
        else:
            executed.append(run.id)
    each_write_once(hosts, rows, in_flight + executed)
    refused = [round(s, 1) for status, s in answers if status == 503]
    accepted = [round(s, 1) for status, s in answers if status == 202]
    unanswered = sum(1 for status, _ in answers if status is None)
    cut_for = time.monotonic() - cut

    # When the link heals, the web serves new runs at once
    hosts.heal("web")
    after = [api.submit(f"after-{n}") for n in range(2)]
    wait_until(all_ended(rows, after), timeout=30, what="runs after the heal ended")
    each_write_once(hosts, rows, after)
    print(
        f"\n[partition web-redis] runs in flight ended {finished:.2f} s after the cut; "
        f"answers during a {cut_for:.0f} s cut: 202 after {accepted} s, 503 after {refused} s, "
        f"{unanswered} unanswered in 20 s; every recorded run executed once"
    )


def _answer(api: Api, message: str, timeout: float) -> tuple[int | None, float]:
    """The status of a submission (None: no answer within `timeout`) and the seconds it took."""
    started = time.monotonic()
    try:
        status: int | None = api.post(message, timeout=timeout).status_code
    except httpx.TimeoutException:
        status = None
    return status, time.monotonic() - started


def test_a_worker_with_300_ms_to_redis_is_slower_and_nothing_else(hosts: Hosts) -> None:
    """(e) 300 ms of round trip between a worker host and Redis (150 ms each way, added by
    the relay in front of Redis: the kernel here has no netem).

    Guarantee: the latency costs time and nothing else. Heartbeats are SQL writes, so no run
    is taken over; every run completes, on the worker that claimed it, each write once.
    """
    hosts.env["w1"] = {"TRACON_REDIS_URL": hosts.stores.redis.url(RELAY_PORT)}
    running = runs_in_flight_on_w1(hosts)
    rows, w1, run_ids = running.rows, running.w1, running.run_ids

    # When w1's round trip to Redis grows to 300 ms while its runs are inside slow_step,
    # and their wait ends
    hosts.stores.relay.set(150)
    started = time.monotonic()
    hosts.fast("w1")

    # Then they complete on w1, slower, none taken over (their slowest ended then)
    wait_until(all_ended(rows, run_ids), timeout=60, what="w1's runs ended", watch=[w1])
    slowest = time.monotonic() - started
    for run_id in run_ids:
        run = rows.run(run_id)
        assert (run.status, owner_pid(run)) == ("Completed", w1.popen.pid)
        assert "RunContinued" not in rows.events(run_id)
        ended_once(rows, run_id)

    # And with w2 stopped, so that they all run on w1: whole runs at 300 ms, then at none
    running.w2.send(signal.SIGTERM)
    running.w2.popen.wait(timeout=30)
    slow = [running.api.submit(f"slow-{n}") for n in range(RUNS)]
    wait_until(all_ended(rows, slow), timeout=60, what="runs at 300 ms ended", watch=[w1])
    hosts.stores.relay.set(0)
    quick = [running.api.submit(f"quick-{n}") for n in range(RUNS)]
    wait_until(all_ended(rows, quick), timeout=60, what="runs at 0 ms ended", watch=[w1])

    # Then each completes on w1, each write once, nothing orphaned
    for run_id in slow + quick:
        assert owner_pid(rows.run(run_id)) == w1.popen.pid
    each_write_once(hosts, rows, run_ids + slow + quick)
    assert not [r for r in rows.runs().values() if r.error_type == "orphaned"]
    at_300 = sorted(round(_seconds(rows.run(run_id)), 2) for run_id in slow)
    at_0 = sorted(round(_seconds(rows.run(run_id)), 2) for run_id in quick)
    print(
        f"\n[partition latency] the rest of w1's runs took {slowest:.2f} s at 300 ms; whole "
        f"runs from claim to end: {at_300} s at 300 ms, {at_0} s at 0 ms"
    )


def _seconds(run: Run) -> float:
    """From a run's claim to its end."""
    assert run.started_at is not None and run.ended_at is not None
    return (run.ended_at - run.started_at).total_seconds()
