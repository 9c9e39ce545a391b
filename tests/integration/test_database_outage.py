"""A database that does not answer: the web answers 503 problem+json with Retry-After (as for
a Redis outage, never a 500), `/readyz` says which store is down, and an executor's SQL call
is retried until the database is back, within `Database.OutageRetry`."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.db.outages import retry_outages
from web import create_app

DEAD = "postgresql+psycopg://postgres@127.0.0.1:1/tracon"


def test_the_web_answers_503_with_retry_after_when_sql_does_not_answer(
    make_runtime: MakeRuntime,
) -> None:
    runtime = make_runtime(DEAD, **scripted_agent([]))
    client = create_app(runtime, {"TESTING": True}).test_client()

    response = client.get("/api/runs", headers={"Authorization": "Bearer tjk_abc_def"})
    ready = client.get("/readyz")

    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["code"] == "database_unavailable"
    assert ready.status_code == 503
    assert ready.get_json()["checks"] == {"sql": False, "redis": True}


class Flaky:
    """Fails like a dropped connection until `back` is set."""

    outage_retry_seconds = 2.0

    def __init__(self) -> None:
        self.back = threading.Event()
        self.calls = 0

    def call(self) -> str:
        self.calls += 1
        if not self.back.is_set():
            raise OperationalError("SELECT 1", None, Exception("server closed the connection"))
        return "written"


def test_a_call_is_retried_until_the_database_is_back() -> None:
    flaky = Flaky()
    threading.Timer(0.4, flaky.back.set).start()

    assert retry_outages(flaky, flaky.call, "a write") == "written"
    assert flaky.calls > 2


def test_retries_stop_at_the_outage_budget() -> None:
    flaky = Flaky()
    flaky.outage_retry_seconds = 0.3
    started = time.monotonic()

    with pytest.raises(OperationalError):
        retry_outages(flaky, flaky.call, "a write")
    assert time.monotonic() - started < 1.5
