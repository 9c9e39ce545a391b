"""`Database.MaxConnections`: a process opens a database connection when a thread first needs
one, never more than the cap, and a thread that needs one beyond it waits for one to come
back, for a bounded time, then fails with an error naming the setting (a `503` on the web).
On both backends: SQLite connections are files, but a cap is a cap."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.pool import QueuePool

from tests.conftest import ConfigFactory
from tests.helpers import (
    MakeRuntime,
    Script,
    ThreadWorker,
    auth,
    scripted_agent,
    wait_for_status,
)
from tracon_jobs.db import Database
from tracon_jobs.db.engine import ConnectionsExhausted
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import load_settings
from web import create_app


@pytest.fixture
def capped(sql_url: str) -> Iterator[Database]:
    """A database capped at two connections, whose threads wait for one up to 5 s."""
    db = Database(sql_url, max_connections=2, connection_wait_seconds=5)
    yield db
    db.dispose()


def pool_of(db: Database) -> QueuePool:
    pool = db.engine.pool
    assert isinstance(pool, QueuePool)
    return pool


def test_a_connection_is_opened_when_a_thread_first_needs_one(capped: Database) -> None:
    pool = pool_of(capped)
    assert (pool.checkedin(), pool.checkedout()) == (0, 0)  # none opened ahead

    with capped.read_connection() as connection:
        assert connection.execute(text("SELECT 1")).scalar_one() == 1
        assert pool.checkedout() == 1
    with capped.read_connection():  # the same one again, kept open
        pass

    assert (pool.checkedin(), pool.checkedout()) == (1, 0)


def test_a_thread_beyond_the_cap_waits_for_a_connection_to_come_back(capped: Database) -> None:
    # Given both connections of the process in use
    with ExitStack() as held:
        for _ in range(2):
            held.enter_context(capped.read_connection())
        got: list[float] = []
        started = time.monotonic()

        def third() -> None:
            with capped.read_connection() as connection:
                connection.execute(text("SELECT 1"))
                got.append(time.monotonic() - started)

        waiter = threading.Thread(target=third)
        waiter.start()

        # When a third thread asks for one, it waits
        time.sleep(0.3)
        assert got == [] and waiter.is_alive()
        # until one comes back (the stack closes the two held connections)
    waiter.join(5)

    # Then it goes on with that one, and no third connection was ever opened
    assert len(got) == 1 and got[0] >= 0.3
    assert pool_of(capped).checkedin() == 2


def test_past_the_bounded_wait_the_error_names_the_setting(sql_url: str) -> None:
    db = Database(sql_url, max_connections=1, connection_wait_seconds=0.2)
    with db.read_connection():
        started = time.monotonic()
        with pytest.raises(ConnectionsExhausted) as raised, db.write() as session:
            session.execute(text("SELECT 1"))  # a session takes its connection here
        waited = time.monotonic() - started
    assert 0.2 <= waited < 2
    assert "all 1 database connections this process may open" in str(raised.value)
    assert "Tracon:Database:MaxConnections" in str(raised.value)
    with db.write() as session:  # and the connection serves again once it is back
        session.execute(text("SELECT 1"))
    db.dispose()


def test_the_web_answers_503_while_every_connection_of_its_process_is_busy(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    runtime = make_runtime(
        sql_url, Database={"Url": sql_url, "MaxConnections": 1}, **scripted_agent([])
    )
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    client = create_app(runtime, {"TESTING": True}).test_client()
    runtime.db.engine.pool._timeout = 0.2  # type: ignore[attr-defined]  # not 30 s

    with runtime.db.read_connection() as held:
        assert isinstance(held, Connection)
        busy = client.get("/api/runs", headers=auth(key))
    after = client.get("/api/runs", headers=auth(key))

    assert busy.status_code == 503, busy.get_data(as_text=True)
    assert busy.headers["Retry-After"] == "5"
    assert after.status_code == 200


OPERATOR = {"Url": "https://ops.example/hook", "SecretEnv": "OPS_SECRET"}


def test_runs_submitted_and_executed_take_one_connection_at_a_time(
    make_runtime: MakeRuntime,
    sql_url: str,
    thread_worker: ThreadWorker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A thread that holds a connection and asks for another would wait for itself at the
    cap: with a cap of one, every path of a run (submission with its idempotency key, claim,
    tool ledger, events and their webhook messages, final write) must hold one at a time."""
    script: Script = [
        {"ToolCalls": [{"Name": "lookup_order", "Arguments": {"order_id": "A-1"}}]},
        {"Text": "A-1 shipped."},
    ]
    monkeypatch.setenv("OPS_SECRET", "whsec_" + "b3BlcmF0b3Itc2VjcmV0LWZvci10ZXN0cw==")
    runtime = make_runtime(
        sql_url,
        Database={"Url": sql_url, "MaxConnections": 1},
        Webhooks={"Operator": {**OPERATOR, "Events": ["run.completed", "run.failed"]}},
        **scripted_agent(script, ["lookup_order"]),
    )
    runtime.db.connection_wait_seconds = 2.0  # a thread waiting for itself fails in 2 s
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    runtime.read_before_serving()  # as a worker or web process starts
    runtime.send_runs_with(thread_worker.sender(runtime))
    client = create_app(runtime, {"TESTING": True}).test_client()

    ids = []
    for n in range(3):
        answer = client.post(
            "/api/agents/demo/run",
            headers={**auth(key), "Prefer": "respond-async", "Idempotency-Key": f"k{n}"},
            json={"message": "Where is A-1?"},
        )
        assert answer.status_code == 202, answer.get_data(as_text=True)
        ids.append(answer.get_json()["runId"])

    for run_id in ids:
        run = wait_for_status(client, key, run_id, "Completed", "Failed", timeout=20)
        assert run["status"] == "Completed", run
    # (a wait that ran out is caught in places: the subscriptions' read logs and goes on)
    assert "Tracon:Database:MaxConnections" not in caplog.text


def test_the_cap_is_a_setting_of_at_least_one(write_config: ConfigFactory) -> None:
    def cap(value: object, environ: dict[str, str] | None = None) -> int:
        path = write_config(Database={"MaxConnections": value})
        return load_settings(path, environ=environ or {}).database.max_connections

    assert load_settings(write_config(), environ={}).database.max_connections == 10
    assert cap(1) == 1 and cap(64) == 64
    for wrong in (0, -3, True, "ten"):
        with pytest.raises(ConfigurationError, match=r"Database\.MaxConnections: must be"):
            cap(wrong)
    with pytest.raises(ConfigurationError, match="TRACON__DATABASE__MAXCONNECTIONS"):
        cap(4, {"TRACON__DATABASE__MAXCONNECTIONS": "0"})
