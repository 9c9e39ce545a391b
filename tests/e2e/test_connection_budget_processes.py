"""The connection budget with real processes: a web node of two gunicorn processes, three
workers at `Worker.Concurrency` 16 and beat, on a PostgreSQL database of the test's own,
counted in `pg_stat_activity` while a backlog of runs goes through them.

Each process opens a connection when a thread first needs one and never more than
`Database.MaxConnections`, so the cluster holds at most MaxConnections x (web processes +
workers + beat) (docs/operations.md, "Connections"), whatever the workers' concurrency;
before, each worker opened Concurrency connections as it started (16 each, 51 here before a
run came in). Each connection is told apart by its client port, owned by one process."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import sqlalchemy as sa

from tests.e2e.cluster import Cluster, Process, wait_until
from tests.helpers import MakeRuntime, Script, auth, scripted_agent
from tracon_jobs.db.migrate import upgrade

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 0.4}}], "DelaySeconds": 0.3},
    {"Text": "done", "DelaySeconds": 0.2},
]
RUNS = 144
"""Three waves of the three workers' 48 threads."""

WORKERS = 3
WEB_PROCESSES = 2
CONCURRENCY = 16
SAMPLE_SECONDS = 0.05


@pytest.fixture
def own_database(postgres_url: str) -> Iterator[tuple[str, str]]:
    """A migrated database of this test's own on the session's server: (its URL, its name);
    the only connections to it are the cluster's and this test's own."""
    name = f"tracon_budget_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(postgres_url).set(database=name)
    text = url.render_as_string(hide_password=False)
    upgrade(text)
    yield text, name
    with admin.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@dataclass
class Census:
    """The connections to one database, sampled in `pg_stat_activity` from a connection to
    another one (so that the sampler is not counted), each given to the process whose
    client port it is: `peak` per process, `total` the most at once."""

    admin_url: str
    database: str
    roles: dict[int, str]  # pid of each process of the cluster (gunicorn's too) -> its name
    server_port: int
    peak: Counter[str] = field(default_factory=Counter)
    total: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self, connection: sa.Connection) -> Counter[str]:
        rows = connection.execute(
            sa.text(
                "SELECT client_port FROM pg_stat_activity "
                "WHERE datname = :database AND backend_type = 'client backend'"
            ),
            {"database": self.database},
        ).all()
        owners = self._owners()
        now = Counter(owners.get(port, "other") for (port,) in rows)
        self.total = max(self.total, len(rows))
        for role, count in now.items():
            self.peak[role] = max(self.peak[role], count)
        return now

    def _owners(self) -> dict[int, str]:
        """Client port -> the name of the cluster's process that holds it."""
        owners: dict[int, str] = {}
        for pid, role in self.roles.items():
            try:
                connections = psutil.Process(pid).net_connections(kind="tcp")
            except psutil.Error:
                continue
            for conn in connections:
                if conn.raddr and conn.raddr.port == self.server_port:
                    owners[conn.laddr.port] = role
        return owners

    def run(self) -> None:
        engine = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            while not self.stop.is_set():
                self.sample(connection)
                time.sleep(SAMPLE_SECONDS)
        engine.dispose()


def roles_of(cluster: Cluster) -> dict[int, str]:
    """Every process of the cluster, gunicorn's workers included: pid -> name."""
    roles: dict[int, str] = {}
    for child in cluster.children.children:
        process: Process = child
        root = psutil.Process(process.popen.pid)
        roles[root.pid] = process.name
        for found in root.children(recursive=True):  # gunicorn's workers
            roles[found.pid] = f"{process.name}/{found.pid}"
    return roles


def submit_all(base: str, key: str, count: int) -> list[str]:
    """`count` runs over HTTP from 24 client threads, each with `Prefer: respond-async`."""
    ids: list[str] = []

    def submit(index: int) -> None:
        with httpx.Client(timeout=60) as client:
            answer = client.post(
                f"{base}/api/agents/demo/run",
                headers={**auth(key), "Prefer": "respond-async"},
                json={"message": f"run {index}"},
            )
            assert answer.status_code == 202, answer.text
            ids.append(answer.json()["runId"])

    def submit_every_24th(first: int) -> None:
        for index in range(first, count, 24):
            submit(index)

    threads = [threading.Thread(target=submit_every_24th, args=(n,)) for n in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return ids


@pytest.mark.parametrize("cap", [None, 4], ids=["default-cap", "cap-4"])
def test_three_workers_two_web_processes_and_beat_stay_within_the_budget(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    own_database: tuple[str, str],
    postgres_url: str,
    flags: Path,
    cap: int | None,
) -> None:
    url, name = own_database
    database = {"Url": url} | ({"MaxConnections": cap} if cap else {})
    sections = scripted_agent(SCRIPT, ["slow_step"]) | {"Database": database}
    runtime = make_runtime(url, **sections)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    limit = runtime.settings.database.max_connections
    runtime.db.dispose()  # the test's own connections are counted apart anyway ("other")

    # Given a web node of two processes, three workers of 16 threads and beat, started
    cluster = make_cluster(url, **sections)
    for n in range(WORKERS):
        cluster.worker(f"w{n + 1}", concurrency=CONCURRENCY)
    cluster.start("beat", "beat")
    _, base = cluster.web(workers=WEB_PROCESSES, threads=8)
    server_port = sa.engine.make_url(postgres_url).port or 5432
    census = Census(postgres_url, name, roles_of(cluster), server_port)
    with sa.create_engine(postgres_url).connect() as connection:
        at_rest = census.sample(connection)

    # When a backlog of runs goes through them, each a model call, a tool and another call
    sampler = threading.Thread(target=census.run, daemon=True)
    sampler.start()
    run_ids = submit_all(base, key, RUNS)

    def completed() -> int:
        answer = httpx.get(f"{base}/api/runs?status=Completed&limit=200", headers=auth(key))
        return len(answer.json()["items"])

    try:
        wait_until(lambda: completed() == RUNS, timeout=120, what=f"{RUNS} runs completed")
    finally:
        census.stop.set()
        sampler.join(5)

    # Then no process held more than the cap, and the whole cluster no more than the budget
    processes = WEB_PROCESSES + WORKERS + 1  # + beat
    budget = limit * processes
    report = f"at rest {dict(at_rest)}; peaks {dict(census.peak)}; total {census.total}"
    print(f"\nconnections (cap {limit}, budget {budget}): {report}")
    assert len(run_ids) == RUNS
    assert all(count <= limit for role, count in census.peak.items() if role != "other"), report
    assert census.total - census.peak["other"] <= budget, report
    workers = [census.peak[f"w{n + 1}"] for n in range(WORKERS)]
    assert min(workers) >= 1, report  # they did use the database (the census sees them)
    # And nothing was opened ahead: at rest, before a run came in, a worker held a few
    # connections at most (its periodic reads on their threads: the subscriptions' refresh,
    # the liveness check's `SELECT 1`), where it used to hold all 16
    assert all(at_rest[f"w{n + 1}"] <= 3 for n in range(WORKERS)), report
