"""SQLite's write lock between processes: a writer polls for it every 0.2-2 ms instead of
SQLite's busy handler, which sleeps 1, 2, 5, ... up to 100 ms between tries. Two `Database`
objects on one file behave as two processes do (each has its own in-process writer lock)."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from tracon_jobs.db import Database

HOLD_SECONDS = 0.24


def hold_write_lock(url: str, seconds: float, held: threading.Event) -> None:
    """Another process's writer: takes the lock, keeps it `seconds`, commits."""
    path = url.removeprefix("sqlite:///")
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("BEGIN IMMEDIATE")
    held.set()
    time.sleep(seconds)
    connection.execute("COMMIT")
    connection.close()


def test_a_writer_gets_the_lock_within_milliseconds_of_its_release(sqlite_url: str) -> None:
    db = Database(sqlite_url)
    with db.transaction():  # the engine and a pooled connection exist
        pass
    held = threading.Event()
    other = threading.Thread(target=hold_write_lock, args=(sqlite_url, HOLD_SECONDS, held))
    other.start()
    held.wait(5)
    started = time.monotonic()

    with db.transaction():
        waited = time.monotonic() - started
    other.join()

    # SQLite's own handler tries at 0, 1, 3, 8, 18, 33, 53, 78, 103, 128, 178, 228, 328 ms:
    # it would have taken the lock 90 ms after it was free
    assert HOLD_SECONDS - 0.05 < waited < HOLD_SECONDS + 0.045, waited
    db.dispose()


def test_past_the_busy_timeout_the_write_fails_and_the_connection_keeps_its_timeout(
    sqlite_url: str,
) -> None:
    db = Database(sqlite_url, sqlite_busy_timeout_ms=200)
    with db.transaction():
        pass
    held = threading.Event()
    other = threading.Thread(target=hold_write_lock, args=(sqlite_url, 1.0, held))
    other.start()
    held.wait(5)

    with pytest.raises(OperationalError, match="locked"), db.transaction():
        pass
    other.join()

    with db.read_connection() as connection:  # the same pooled connection, its timeout back
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 200
    db.dispose()
