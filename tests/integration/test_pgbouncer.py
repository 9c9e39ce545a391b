"""The run store, the executor and the idempotency store through PgBouncer in transaction mode
(tests/pgbouncer.py): each transaction may run on another server session, so nothing a session
sets may be relied on across transactions (docs/operations.md, "PgBouncer").

Every test of the modules below that runs on `sql_url` runs here once more, with `sql_url` the
session's PostgreSQL database through PgBouncer, prepared statements off; and why they must be
off: a statement psycopg prepared in one transaction is missing from the next one's session.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import ProgrammingError

from tests.integration import (
    test_durability,
    test_executor,
    test_idempotency_store,
    test_tenant_runs,
)
from tests.pgbouncer import PgBouncer, sql_url_tests_of
from tracon_jobs.db import Database
from tracon_jobs.db.migrate import upgrade
from tracon_jobs.db.models import Run


def _adopt(*modules: Any) -> dict[str, Any]:
    adopted: dict[str, Any] = {}
    for module in modules:
        for name, value in sql_url_tests_of(module).items():
            assert adopted.setdefault(name, value) is value, f"two modules define {name}"
    return adopted


globals().update(_adopt(test_executor, test_durability, test_idempotency_store, test_tenant_runs))


@pytest.fixture
def sql_url(pgbouncer_url: str) -> str:
    """The adopted tests' database: the session's PostgreSQL, through PgBouncer."""
    return pgbouncer_url


@pytest.fixture
def scratch_database(postgres_url: str) -> Iterator[str]:
    """A database of this test's own on the session's server (dropped after): its name."""
    name = f"tracon_bouncer_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield name
    with admin.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


REPEATED = sa.text("SELECT CAST(:n AS integer) + 1")


def _repeat_across_sessions(db: Database) -> None:
    """Run one statement, then again while another connection holds the server session it
    ran on: PgBouncer hands the most recently freed session out first, so the other
    connection's transaction takes it, and the second run gets another session."""
    with db.engine.connect() as first:
        first.execute(REPEATED, {"n": 1})
        first.commit()  # its session goes back to PgBouncer
        with db.engine.connect() as second, second.begin():
            second.execute(sa.text("SELECT 1"))  # takes that session for the transaction
            assert first.execute(REPEATED, {"n": 2}).scalar_one() == 3
            first.commit()


def test_a_prepared_statement_is_missing_from_the_next_transactions_session(
    pgbouncer: PgBouncer, pgbouncer_url: str
) -> None:
    # Given psycopg preparing every statement at once (`prepare_threshold=0` in the URL)
    database = sa.engine.make_url(pgbouncer_url).database
    assert database is not None
    eager = pgbouncer.url(database, prepared_statements=True) + "?prepare_threshold=0"

    # When a statement prepared in one transaction runs in another one, on another session
    with pytest.raises(ProgrammingError, match=r"prepared statement .* does not exist"):
        _repeat_across_sessions(Database(eager))

    # Then it fails, unless prepared statements are off (the setting, or the URL's own)
    _repeat_across_sessions(Database(eager, prepared_statements=False))
    _repeat_across_sessions(Database(pgbouncer_url))


def test_the_migrations_run_through_pgbouncer(pgbouncer: PgBouncer, scratch_database: str) -> None:
    url = pgbouncer.url(scratch_database, prepared_statements=True)

    upgrade(url, prepared_statements=False)  # as `tracon-jobs migrate` passes the setting

    db = Database(url, prepared_statements=False)
    with db.read() as session:
        assert session.execute(sa.select(sa.func.count()).select_from(Run)).scalar_one() == 0
    db.dispose()
