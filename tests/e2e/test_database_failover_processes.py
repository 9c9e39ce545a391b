"""A PostgreSQL failover under load, with real processes: a primary and its streaming replica
of the test's own (synchronous, so no acknowledged write is lost), a web process and a worker
on a URL that names both hosts with `target_session_attrs=read-write`; the primary stops
(immediate mode) while tool bodies run, the replica is promoted, and every run in flight and
every run submitted after completes, each tool body having run once, as across a restart
(`Database.OutageRetry`: tests/e2e/test_database_outage_processes.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.test_database_outage_processes import _binaries, _free_port, _lines, _statuses
from tests.helpers import MakeRuntime, Script, auth, scripted_agent
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import ToolCallRecord

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 1.5}}]},
    {"Text": "done"},
]
STANDBY = "tracon_standby"
"""The replica's `application_name`, which the primary waits for (synchronous replication)."""


class Server:
    """One PostgreSQL server of the pair, run as the `postgres` user on a port of its own."""

    def __init__(self, bin_dir: Path, data: Path) -> None:
        self.bin = bin_dir
        self.data = data
        self.port = _free_port()

    def run(self, tool: str, *args: str) -> None:
        command = ["runuser", "-u", "postgres", "--", str(self.bin / tool), *args]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self, *settings: str) -> None:
        options = " ".join(
            [f"-p {self.port} -k {self.data}", "-c listen_addresses=127.0.0.1", *settings]
        )
        log = str(self.data.parent / f"{self.data.name}.log")  # the server outlives pg_ctl
        self.run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self.run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def sql(self, statement: str) -> list[tuple[object, ...]]:
        engine = sa.create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        try:
            with engine.connect() as connection:
                result = connection.execute(sa.text(statement))
                return [tuple(row) for row in result] if result.returns_rows else []
        finally:
            engine.dispose()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


class Pair:
    """A primary and its synchronous streaming replica, in a temporary directory."""

    def __init__(self, bin_dir: Path, directory: Path) -> None:
        self.primary = Server(bin_dir, directory / "primary")
        self.replica = Server(bin_dir, directory / "replica")
        self.primary.run("initdb", "-D", str(self.primary.data), "-A", "trust", "-U", "postgres")
        # on the command line, not in postgresql.conf: the replica's copy must not wait for a
        # standby of its own once it is promoted
        self.primary.start(
            "-c wal_level=replica",
            "-c max_wal_senders=4",
            f"-c synchronous_standby_names={STANDBY}",
            "-c fsync=off",
        )
        source = f"host=127.0.0.1 port={self.primary.port} user=postgres application_name={STANDBY}"
        self.replica.run(
            "pg_basebackup", "-d", source, "-D", str(self.replica.data), "-R", "-X", "stream"
        )
        self.replica.start("-c hot_standby=on", "-c fsync=off")
        wait_until(self._streaming_in_sync, timeout=30, what="the replica streaming, in sync")

    def _streaming_in_sync(self) -> bool:
        rows = self.primary.sql("SELECT state, sync_state FROM pg_stat_replication")
        return rows == [("streaming", "sync")]

    @property
    def url(self) -> str:
        """Both hosts in one URL, as an operator writes it (`db.urls` reads it)."""
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.replica.port}"
        return f"postgresql://postgres@/postgres?host={hosts}&target_session_attrs=read-write"

    def fail_over(self) -> None:
        """The primary dies (immediate mode: no checkpoint, connections cut) and the replica
        is promoted, as an operator or a failover manager would."""
        self.primary.stop("immediate")
        self.replica.run("pg_ctl", "-D", str(self.replica.data), "-w", "promote")

    def stop(self) -> None:
        for server in (self.primary, self.replica):
            with contextlib.suppress(subprocess.CalledProcessError):
                server.stop("immediate")


@pytest.fixture
def pair() -> Iterator[Pair]:
    bin_dir = _binaries()
    if bin_dir is None or os.geteuid() != 0 or not (bin_dir / "pg_basebackup").exists():
        pytest.skip("needs PostgreSQL's server binaries and root (to run them as postgres)")
    directory = Path(tempfile.mkdtemp(prefix="tracon-failover-"))  # pytest's are root-only
    directory.chmod(0o777)
    servers = Pair(bin_dir, directory)
    yield servers
    servers.stop()
    shutil.rmtree(directory, ignore_errors=True)


def submit(base: str, key: str, count: int, *, retry_for: float = 0) -> list[str]:
    """Runs submitted over HTTP; a 503 (no primary yet) is sent again for `retry_for` s."""
    ids: list[str] = []
    deadline = time.monotonic() + retry_for
    while len(ids) < count:
        answer = httpx.post(
            f"{base}/api/agents/demo/run",
            headers={**auth(key), "Prefer": "respond-async"},
            json={"message": f"m{len(ids)}"},
            timeout=30,
        )
        if answer.status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        assert answer.status_code == 202, answer.text
        ids.append(answer.json()["runId"])
    return ids


def test_runs_in_flight_survive_a_failover_to_the_promoted_replica(
    pair: Pair, make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, flags: Path
) -> None:
    url = pair.url
    upgrade(url)
    sections = scripted_agent(SCRIPT, ["slow_step"]) | {
        "Database": {"Url": url, "OutageRetry": "00:01:00"}
    }
    runtime = make_runtime(url, **sections)
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    runtime.db.dispose()
    cluster = make_cluster(url, **sections)
    worker = cluster.worker("w1", concurrency=12)
    _, base = cluster.web(workers=1, threads=8)

    # Given runs in flight, their tool bodies running, through the primary
    in_flight = submit(base, key, 12)
    wait_until(lambda: _lines(flags) >= 6, timeout=30, what="tool bodies running")

    # When the primary dies and the replica is promoted
    pair.fail_over()
    after = submit(base, key, 4, retry_for=60)  # the web finds the new primary

    # Then every run completes on the new primary, each tool body having run once
    every = in_flight + after
    promoted = pair.replica.url
    try:  # (within the test's own timeout, so that a miss says what the worker saw)
        wait_until(lambda: _statuses(promoted, every) == {"Completed"}, timeout=80, what="all done")
    except TimeoutError as exc:
        depth = runtime.fair_store.depth()
        raise AssertionError(
            f"{exc}; fair lines {depth}; worker:\n{worker.text()[-6000:]}"
        ) from exc
    assert _lines(flags) == len(every)
    engine = sa.create_engine(promoted)
    with engine.connect() as connection:
        ledger = connection.execute(
            sa.select(ToolCallRecord.status).where(ToolCallRecord.run_id.in_(every))
        ).all()
    engine.dispose()
    assert sorted(status for (status,) in ledger) == ["succeeded"] * len(every)
    assert pair.replica.sql("SELECT pg_is_in_recovery()") == [(False,)]
    # And they did ride the failover out: their connections to the dead primary broke (a write
    # then waited for the new primary; or the pool, invalidated, reconnected to it at once, as
    # the multi-host URL tries the next host, which may already be promoted; or the statement
    # that met the broken connection first was another's, the heartbeat's say, logged with the
    # driver's error and retried at its next interval)
    text = worker.text()
    rode_out = ("database unavailable during", "invalidated", "psycopg.OperationalError")
    assert any(line in text for line in rode_out), text[-3000:]
