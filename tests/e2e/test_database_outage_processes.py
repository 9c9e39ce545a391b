"""A 5-second PostgreSQL restart under load, with a PostgreSQL server of the test's own and
real worker processes: every run in flight and every queued run completes, no tool body
runs twice, and none is reported in flight (the outcome written once the server is back)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from glob import glob
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime, Script, scripted_agent
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import Run, ToolCallRecord
from tracon_jobs.runs.store import NewRun

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT: Script = [
    {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 1.5}}]},
    {"Text": "done"},
]


def _binaries() -> Path | None:
    found = sorted(glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found and shutil.which("runuser") else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OwnPostgres:
    """A throwaway PostgreSQL cluster run as the `postgres` user, which can be stopped."""

    def __init__(self, bin_dir: Path, directory: Path) -> None:
        self.bin = bin_dir
        self.data = directory / "pgdata"
        self.port = _free_port()
        directory.chmod(0o777)
        self._as_postgres("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres")

    def _as_postgres(self, tool: str, *args: str) -> None:
        command = ["runuser", "-u", "postgres", "--", str(self.bin / tool), *args]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.data.parent / "server.log")  # not our pipe: the server outlives pg_ctl
        self._as_postgres("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")

    def stop(self) -> None:
        self._as_postgres("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


@pytest.fixture
def postgres() -> Iterator[OwnPostgres]:
    bin_dir = _binaries()
    if bin_dir is None or os.geteuid() != 0:
        pytest.skip("needs PostgreSQL's server binaries and root (to run them as postgres)")
    directory = Path(tempfile.mkdtemp(prefix="tracon-pg-"))  # pytest's are root-only
    server = OwnPostgres(bin_dir, directory)
    server.start()
    yield server
    with contextlib.suppress(subprocess.CalledProcessError):
        server.stop()
    shutil.rmtree(directory, ignore_errors=True)


def test_runs_in_flight_survive_a_five_second_database_restart(
    postgres: OwnPostgres,
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    flags: Path,
) -> None:
    upgrade(postgres.url)
    sections = scripted_agent(SCRIPT, ["slow_step"]) | {
        "Database": {"Url": postgres.url, "OutageRetry": "00:00:30"}
    }
    cluster = make_cluster(postgres.url, **sections)
    cluster.worker("w1", concurrency=12)
    cluster.worker("w2", concurrency=12)
    runtime = make_runtime(postgres.url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    in_flight = [
        runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": f"m{n}"})).id
        for n in range(16)
    ]
    wait_until(lambda: _lines(flags) >= 8, timeout=30, what="tool bodies running")

    # When the database stops for 5 s while tool bodies run and more runs are queued
    postgres.stop()
    queued_during = _submit_later(runtime, tenant, count=4)
    time.sleep(5)
    postgres.start()
    queued = queued_during()

    # Then every run completes, each tool body ran once, and the ledger has every outcome
    every = in_flight + queued
    wait_until(lambda: _statuses(postgres.url, every) == {"Completed"}, timeout=90, what="all done")
    assert _lines(flags) == len(every)
    engine = sa.create_engine(postgres.url)
    with engine.connect() as conn:
        ledger = conn.execute(
            sa.select(ToolCallRecord.status).where(ToolCallRecord.run_id.in_(every))
        ).all()
    engine.dispose()
    assert sorted(status for (status,) in ledger) == ["succeeded"] * len(every)


def _lines(flags: Path) -> int:
    path = flags / "slow_step.log"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _statuses(url: str, run_ids: list[str]) -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(Run.status).where(Run.id.in_(run_ids))).all()
    except sa.exc.OperationalError:
        return {"unreachable"}
    finally:
        engine.dispose()
    return {status for (status,) in rows}


def _submit_later(runtime: object, tenant: str, count: int) -> Callable[[], list[str]]:
    """Runs submitted as soon as the database answers again (the web would answer 503 until
    then); returns a function that gives their ids."""
    from tracon_jobs.runtime import Runtime

    assert isinstance(runtime, Runtime)

    def submit_all() -> list[str]:
        ids: list[str] = []
        deadline = time.monotonic() + 30
        while len(ids) < count and time.monotonic() < deadline:
            try:
                new = NewRun(tenant, "demo", {"message": f"late{len(ids)}"})
                ids.append(runtime.dispatcher.submit(new).id)
            except sa.exc.OperationalError:
                time.sleep(0.2)
        return ids

    return submit_all
