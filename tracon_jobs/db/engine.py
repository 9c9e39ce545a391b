"""Engines and sessions for SQLite and PostgreSQL, created lazily per process.

SQLite needs three things to be shared by web, workers and beat: WAL (readers never block
the writer), a busy timeout, and `BEGIN IMMEDIATE` for write transactions (a deferred
transaction that upgrades from read to write fails with SQLITE_BUSY whatever the timeout).
Engines are created after fork: a pooled connection must never cross a process boundary.

A process opens a connection when a thread first needs one, and never more than
`Database.MaxConnections` of them: PostgreSQL's `max_connections` is shared by every process
of the cluster, so what each may hold is a budget (docs/operations.md, "Connections").
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, DateTime, Engine, bindparam, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, QueuePool
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from tracon_jobs import fast_paths
from tracon_jobs.db.hot import FastConnection
from tracon_jobs.db.urls import normalize_url, prepare_threshold

__all__ = ["ConnectionsExhausted", "Database", "normalize_url"]

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite write waits for another writer's lock before it fails."""

log = logging.getLogger(__name__)


class StatementClock(FunctionElement[datetime]):
    """The database clock read inside the statement that needs it: no extra round trip.

    PostgreSQL: `statement_timestamp()` in UTC, one value however often the statement
    names it (a claim's `started_at`, `heartbeat_at` and event time are the same instant).
    SQLite: the bound parameter `now` (`Database.clock_params`), this host's clock, as in
    `Database.now` (a SQLite file is local to one host).
    """

    type = DateTime()
    name = "statement_clock"
    inherit_cache = True


CLOCK_PARAM = "now"
_CLOCK_BIND = bindparam(CLOCK_PARAM, type_=DateTime())


@compiles(StatementClock)
def _bound_clock(element: StatementClock, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(_CLOCK_BIND, **kw)


@compiles(StatementClock, "postgresql")
def _postgres_clock(element: StatementClock, compiler: SQLCompiler, **kw: Any) -> str:
    return "(statement_timestamp() AT TIME ZONE 'UTC')"


PG_CONNECT_TIMEOUT_SECONDS = 3
"""A server that does not answer fails a connection attempt quickly (then it is retried, or
the web answers 503), instead of hanging a thread for the kernel's TCP timeout."""

IDLE_PING_SECONDS = 10.0
"""A pooled connection unused for this long is pinged when it is checked out (a server that
restarted meanwhile left it dead, and the ping replaces it); a connection in steady use is
not: a ping on every checkout cost every transaction a round trip. A connection that died
while in use fails its statement, the pool drops every connection older than the failure,
and the caller's outage retry (`db.outages`) or the web's 503 takes it from there."""

POOL_RECYCLE_SECONDS = 1800
"""Connections are replaced after this long, before a proxy or server idle limit cuts them."""

MAX_CONNECTIONS = 10
"""The most connections one process opens when no cap is given (`Database.MaxConnections`)."""

CONNECTION_WAIT_SECONDS = 30.0
"""How long a thread waits for a connection while the process holds its cap of them, then
fails with `ConnectionsExhausted`: a statement takes milliseconds, so a wait this long means
the cap is far too low for the process's threads, not that the database is busy."""


class ConnectionsExhausted(PoolTimeout):
    """Every connection the process may open was in use for the whole wait.

    A `sqlalchemy.exc.TimeoutError`, so whatever handles SQLAlchemy's errors handles it;
    its message names the setting that caps the connections."""

    def __init__(self, cap: int, waited: float) -> None:
        super().__init__(
            f"all {cap} database connections this process may open "
            f"(Tracon:Database:MaxConnections) were in use for {waited:g} s: raise "
            "Database.MaxConnections, or run fewer threads in this process"
        )
        self.cap = cap
        self.waited = waited


class CappedPool(QueuePool):
    """A `QueuePool` of at most `pool_size` connections, each opened when a thread first
    needs it (none ahead of use), kept open once opened; a thread that needs one beyond the
    cap waits up to the pool's timeout, then gets `ConnectionsExhausted`."""

    def _do_get(self) -> ConnectionPoolEntry:
        try:
            return super()._do_get()
        except ConnectionsExhausted:
            raise
        except PoolTimeout as exc:
            raise ConnectionsExhausted(self.size(), self.timeout()) from exc


class Database:
    """One database URL; engines and session factories per process, thread-safe."""

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        prepared_statements: bool = True,
        outage_retry_seconds: float = 0,
        sqlite_busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
        connection_wait_seconds: float = CONNECTION_WAIT_SECONDS,
    ) -> None:
        self.url = normalize_url(url)
        self.max_connections = max_connections  # the pool's cap: see `CappedPool`
        self.prepared_statements = prepared_statements  # see `_postgres_connect_args`
        self.connection_wait_seconds = connection_wait_seconds
        self.outage_retry_seconds = outage_retry_seconds  # see `db.outages`
        self.sqlite_busy_timeout_ms = sqlite_busy_timeout_ms
        self._lock = threading.Lock()
        self._pid = -1
        self._engine: Engine | None = None
        self._write: sessionmaker[Session] | None = None
        self._read: sessionmaker[Session] | None = None
        self._read_core: Engine | None = None
        self._autocommit: Engine | None = None
        self._writer = threading.RLock()  # SQLite: see `_one_writer`

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")

    @property
    def engine(self) -> Engine:
        self._ensure_engine()
        assert self._engine is not None
        return self._engine

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session whose transaction takes the write lock up front, committed on success."""
        self._ensure_engine()
        assert self._write is not None
        with self._one_writer(), self._write.begin() as session:
            yield session

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """`write` as a Core connection, for the executor's hot writes (Core statements only).

        No Session is built and closed around the statements. Rolled back when the block
        raises. On SQLite this process's writer lock is taken before the connection, as
        `write` takes it: a thread that held a connection while it waited for the lock, and
        a writer that held the lock while it waited for a connection, would each wait for
        the other whenever every connection the process may open was taken."""
        self._ensure_engine()
        assert self._engine is not None
        with self._one_writer(), self._core(self._engine) as connection, connection.begin():
            yield connection

    def _core(self, engine: Engine) -> Connection:
        """A Core connection of `engine`; on SQLite, one that runs the store's `hot`
        statements straight on the driver (`db/hot.py`)."""
        if self.is_sqlite and fast_paths.enabled("sqlite"):
            return FastConnection(engine)
        return engine.connect()

    def _one_writer(self) -> AbstractContextManager[Any]:
        """SQLite: this process's write transactions queue on a lock of its own.

        SQLite takes one writer at a time, and its busy handler waits by sleeping (up to
        100 ms a try), so a hundred threads queued on the database's lock sleep through the
        moments it is free. A lock in the process hands the turn on at once; writers of
        other processes still meet the busy timeout. Reentrant, and waited for no longer
        than the busy timeout, so a nested or stuck write fails as it did without it.
        """
        return self._queued_writer() if self.is_sqlite else nullcontext()

    @contextmanager
    def _queued_writer(self) -> Iterator[None]:
        writer = self._writer
        acquired = writer.acquire(timeout=self.sqlite_busy_timeout_ms / 1000)
        try:
            yield
        finally:
            if acquired:
                writer.release()

    @contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """PostgreSQL: a connection whose every statement commits as it runs, for a write
        that is one statement (atomic on its own): no BEGIN and COMMIT round trips."""
        assert not self.is_sqlite, "SQLite writes take BEGIN IMMEDIATE (`write`)"
        self._ensure_engine()
        assert self._autocommit is not None
        with self._autocommit.connect() as connection:
            yield connection

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads only; on SQLite it never blocks or is blocked by a writer."""
        self._ensure_engine()
        assert self._read is not None
        with self._read() as session:
            yield session

    @contextmanager
    def read_connection(self) -> Iterator[Connection]:
        """`read` as a Core connection, for hot reads of Core statements (no Session)."""
        self._ensure_engine()
        assert self._read_core is not None
        with self._core(self._read_core) as connection:
            yield connection

    def check(self) -> None:
        """One `SELECT 1` on a pooled connection: raises when the database cannot answer."""
        with self.read() as session:
            session.execute(text("SELECT 1"))

    def now(self) -> datetime:
        """The database clock, naive UTC: the one clock every host compares against.

        A SQLite file is local to one host, so its clock is this host's clock.
        """
        if self.is_sqlite:
            return _utc_now()
        with self.read() as session:
            value = session.execute(
                text("SELECT clock_timestamp() AT TIME ZONE 'UTC'")
            ).scalar_one()
        assert isinstance(value, datetime)
        return value

    def clock_params(self) -> dict[str, Any]:
        """The parameters a statement with a `StatementClock` needs (none on PostgreSQL)."""
        return {CLOCK_PARAM: _utc_now()} if self.is_sqlite else {}

    def dispose(self) -> None:
        with self._lock:
            if self._engine is not None:
                self._engine.dispose()
            self._engine = None
            self._pid = -1

    def _ensure_engine(self) -> None:
        if self._pid == os.getpid() and self._engine is not None:
            return
        with self._lock:
            if self._pid == os.getpid() and self._engine is not None:
                return
            engine = self._create_engine()
            self._engine = engine
            self._write = sessionmaker(engine, expire_on_commit=False)
            self._read_core = self._read_engine(engine)
            self._read = sessionmaker(self._read_core, expire_on_commit=False)
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
            self._writer = threading.RLock()  # one a fork left held would never be released
            self._pid = os.getpid()

    def _read_engine(self, engine: Engine) -> Engine:
        """Reads on PostgreSQL run in autocommit: a statement each, no BEGIN and ROLLBACK
        around it. Under READ COMMITTED every statement takes a fresh snapshot anyway, so a
        read session sees what it saw before. SQLite keeps its transaction (one snapshot
        for the whole read, no round trip to save)."""
        if self.is_sqlite:
            return engine.execution_options(tracon_read_only=True)
        return engine.execution_options(tracon_read_only=True, isolation_level="AUTOCOMMIT")

    def connect_options(self) -> tuple[str, dict[str, Any]]:
        """The URL the driver is given and its connect options: SQLite's busy timeout;
        PostgreSQL's connect timeout and prepared statements (`_postgres_connect_args`)."""
        if self.is_sqlite:
            return self.url, {"timeout": self.sqlite_busy_timeout_ms / 1000}
        return _postgres_connect_args(self.url, self.prepared_statements)

    def _create_engine(self) -> Engine:
        url, connect_args = self.connect_options()
        pool: dict[str, Any] = {
            "poolclass": CappedPool,
            "pool_size": self.max_connections,
            "max_overflow": 0,
            "pool_timeout": self.connection_wait_seconds,
            "connect_args": connect_args,
        }
        if not self.is_sqlite:
            engine = create_engine(
                url,
                **pool,
                pool_use_lifo=True,  # the busy connections stay busy, idle ones get pinged
                pool_recycle=POOL_RECYCLE_SECONDS,
            )
            _install_idle_ping(engine)
            return engine
        _ensure_sqlite_dir(self.url)
        engine = create_engine(url, **pool)
        _install_sqlite_hooks(engine, self.sqlite_busy_timeout_ms)
        return engine


DEAD_LINK: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
"""libpq's options that end a connection whose link drops packets in about 10 s (an idle one
by keepalives, one with a statement in flight by `tcp_user_timeout`), instead of the kernel's
15 minutes of retransmissions: the statement fails as an outage (`Database.OutageRetry`)
and the thread goes on; a healthy link acknowledges at once, however long a statement runs.
The URL's own values win (docs/reliability.md, "Partitions")."""


def _postgres_connect_args(url: str, prepared_statements: bool) -> tuple[str, dict[str, Any]]:
    """The URL psycopg is given and its options: the connect timeout, and the threshold of
    prepared statements (psycopg prepares a statement a connection has run five times).

    `prepared_statements` off (`Database.PreparedStatements`), or the URL's own
    `prepare_threshold=none`, prepares nothing: behind a pooler in transaction mode
    (PgBouncer before 1.21, or without `max_prepared_statements`) each transaction may get
    another server session, where the statement was never prepared."""
    url, threshold, given = prepare_threshold(url)
    connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_SECONDS}
    chosen = make_url(url).query
    connect_args |= {key: value for key, value in DEAD_LINK.items() if key not in chosen}
    if not prepared_statements:
        connect_args["prepare_threshold"] = None
    elif given:
        connect_args["prepare_threshold"] = threshold
    return url, connect_args


def _utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _ensure_sqlite_dir(url: str) -> None:
    database = make_url(url).database
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)


def _install_idle_ping(engine: Engine) -> None:
    """Ping a connection on checkout only when it sat idle for `IDLE_PING_SECONDS`."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < IDLE_PING_SECONDS:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:  # the pool replaces it (up to three attempts)
            raise DisconnectionError(f"an idle pooled connection is dead: {exc}") from exc


WRITE_LOCK_POLL_SECONDS = (0.0002, 0.002)
"""How often a writer of one process tries again for the database's write lock held by
another process: from 0.2 ms, doubling up to 2 ms."""


def _begin_immediate(driver: sqlite3.Connection, busy_timeout_ms: int) -> None:
    """`BEGIN IMMEDIATE`, waiting for another process's write lock by trying again every
    0.2-2 ms for up to the busy timeout (the connection's own timeout is off meanwhile).

    SQLite's own busy handler sleeps 1, 2, 5, 10, ... up to 100 ms between tries: between
    the web's processes and a worker, each holding the lock for about a millisecond at a
    time, a writer slept through the moments the lock was free while the process that held
    it took it again for its next transaction. Only this wait polls: every other statement
    keeps the busy timeout (a reader in WAL mode is not blocked by the writer).
    """
    deadline = time.monotonic() + busy_timeout_ms / 1000
    delay, longest = WRITE_LOCK_POLL_SECONDS
    driver.execute("PRAGMA busy_timeout=0")
    try:
        while True:
            try:
                driver.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, longest)
    finally:
        driver.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY, plain or extended (its low byte)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_BUSY


def _install_sqlite_hooks(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # straight to the driver: `exec_driver_sql` costs a whole statement execution,
        # paid by every transaction; a failure is still SQLAlchemy's OperationalError
        read_only = conn.get_execution_options().get("tracon_read_only", False)
        statement = "BEGIN" if read_only else "BEGIN IMMEDIATE"
        driver = conn.connection.driver_connection
        try:
            if read_only:
                driver.execute(statement)
            else:
                _begin_immediate(driver, busy_timeout_ms)
        except sqlite3.Error as exc:
            raise OperationalError(statement, None, exc) from exc
