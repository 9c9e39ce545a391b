"""A worker opens a Redis connection per thread, and starts the threads, as it starts, so
that a backlog's first runs find theirs open and waiting instead of all opening them at the
same moment. Database connections are not opened ahead: each counts against the server's
`max_connections`, and a thread opens one when it first needs one (B2 measured no gain
from opening them ahead; tests/integration/test_connection_cap.py)."""

from __future__ import annotations

import gc
import logging
import threading

import pytest
from celery.concurrency import get_implementation

from tests.helpers import MakeRuntime, scripted_agent

DEAD = "postgresql+psycopg://postgres@127.0.0.1:1/tracon"


def test_the_redis_pool_holds_one_open_connection_per_worker_thread_and_sql_none(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(sql_url, Worker={"Concurrency": 6}, **scripted_agent([]))

    runtime.open_connections()  # 6 slots and Worker.FairReserve's 1 thread

    pool = runtime.db.engine.pool
    assert pool.checkedin() == 0 and pool.checkedout() == 0  # type: ignore[attr-defined]
    redis_pool = runtime.redis.connection_pool
    idle = redis_pool._available_connections
    assert len(idle) == 7 and all(connection._sock is not None for connection in idle)
    runtime.redis.ping()  # and they work
    with runtime.db.read_connection() as connection:
        assert connection.exec_driver_sql("SELECT 1").scalar() == 1


def test_a_database_that_refuses_leaves_the_worker_starting(
    make_runtime: MakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = make_runtime(DEAD, Worker={"Concurrency": 2, "FairReserve": 1}, **scripted_agent([]))

    with caplog.at_level(logging.WARNING):
        runtime.open_connections()  # does not raise: runs open theirs when they need one

    assert "database" not in caplog.text  # it was not asked for anything
    assert len(runtime.redis.connection_pool._available_connections) == 3


def test_the_worker_pool_starts_every_thread_before_the_first_task(
    make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    runtime = make_runtime(sqlite_url, Worker={"Concurrency": 7}, **scripted_agent([]))
    pool = get_implementation(runtime.celery.conf.worker_pool)(limit=7)

    gc.unfreeze()
    pool.start()
    try:
        started = set(pool.executor._threads)
        assert len(started) == 7 and all(thread.is_alive() for thread in started)
        # and what the process built to start is out of the collector's reach
        assert gc.get_freeze_count() > 1000
        # and a task runs on one of them: none is started for it
        ran_on = pool.executor.submit(threading.current_thread).result(timeout=5)
        assert ran_on in started and set(pool.executor._threads) == started
    finally:
        pool.stop()
        gc.unfreeze()
