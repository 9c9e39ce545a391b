"""A crash test and a race test with real processes (web, workers, beat) whose database is
the session's PostgreSQL through PgBouncer in transaction mode (tests/pgbouncer.py), with
prepared statements off: a worker killed mid-run is closed as orphaned and nothing continues
it; twenty concurrent decisions of one approval over two web processes make one decision and
run the tool once. `.ci/run` runs the crash and race tests of the real-process suite this way
(`TRACON_TEST_PGBOUNCER`)."""

from __future__ import annotations

import pytest

from tests.e2e import test_approvals_processes, test_orphans_processes
from tests.pgbouncer import sql_url_tests_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

globals().update(
    sql_url_tests_of(
        test_orphans_processes,
        "test_a_killed_worker_s_run_is_failed_orphaned_and_nothing_continues_it",
    )
    | sql_url_tests_of(
        test_approvals_processes,
        "test_twenty_concurrent_approvals_over_two_web_processes_one_wins_and_the_body_runs_once",
    )
)


@pytest.fixture
def sql_url(pgbouncer_url: str) -> str:
    """The adopted tests' database: the session's PostgreSQL, through PgBouncer."""
    return pgbouncer_url
