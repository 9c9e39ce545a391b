"""SQLite's hot statements run straight on the driver (`tracon_jobs/db/hot.py`), with the same
parameters, rows and errors as SQLAlchemy gives; what the shortcut does not cover runs the
usual way. SQLAlchemy's own cursor executions are counted with its `before_cursor_execute`
event, which the shortcut does not fire."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import (
    JSON,
    Column,
    Connection,
    DateTime,
    Integer,
    MetaData,
    Numeric,
    String,
    Table,
    bindparam,
    event,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError, StatementError

from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.db import Database
from tracon_jobs.db.hot import FastConnection, hot
from tracon_jobs.runs.store import NewRun

AT_OWN = datetime(2026, 12, 1, 4, 5, 6, 7000)
METADATA = MetaData()
THINGS = Table(
    "hot_things",
    METADATA,
    Column("id", String, primary_key=True),
    Column("count", Integer, nullable=False),
    Column("at", DateTime, nullable=True),
    Column("data", JSON, nullable=True),
    Column("price", Numeric(12, 6), nullable=True),
)
INSERT = hot(insert(THINGS))
BUMP = hot(
    update(THINGS)
    .where(THINGS.c.id == bindparam("p_id"))
    .values(count=THINGS.c.count + bindparam("p_by"), at=bindparam("p_at", type_=DateTime))
    .returning(THINGS.c.count, THINGS.c.at, THINGS.c.data, THINGS.c.price)
)
TEXT_INSERT = hot(
    text("INSERT INTO hot_things (id, count, data) VALUES (:id, :count, :data)").bindparams(
        bindparam("data", type_=JSON)
    )
)
EXPANDING = hot(select(THINGS.c.id).where(THINGS.c.id.in_(bindparam("ids", expanding=True))))
OWN_VALUES = hot(
    update(THINGS)
    .where(THINGS.c.id == bindparam("p_id"))
    .values(count=7, at=AT_OWN, data={"own": True})
    .returning(THINGS.c.count, THINGS.c.at, THINGS.c.data)
)
NOT_HOT = select(THINGS.c.count).where(THINGS.c.id == bindparam("p_id"))
AT = datetime(2026, 11, 30, 12, 34, 56, 789000)


@pytest.fixture
def db(sqlite_url: str) -> Iterator[Database]:
    database = Database(sqlite_url)
    METADATA.create_all(database.engine)
    yield database
    database.engine.dispose()


class Counted:
    """SQLAlchemy's own cursor executions on `db`'s engine."""

    def __init__(self, db: Database) -> None:
        self.statements: list[str] = []
        event.listen(db.engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.statements.append(statement)


def seed(connection: Connection, id_: str = "a") -> None:
    connection.execute(
        INSERT,
        {"id": id_, "count": 1, "at": None, "data": {"k": [1, "x"]}, "price": Decimal("0.25")},
    )


def test_a_hot_statement_gives_what_sqlalchemy_gives_without_sqlalchemy_executing_it(
    db: Database,
) -> None:
    counted = Counted(db)
    with db.transaction() as connection:
        assert isinstance(connection, FastConnection)
        seed(connection)
        fast = connection.execute(BUMP, {"p_id": "a", "p_by": 2, "p_at": AT}).one()
        text_params = {"id": "t", "count": 5, "data": {"n": None}}
        connection.execute(TEXT_INSERT, text_params)
    assert counted.statements == [], "the hot statements went through SQLAlchemy"

    with db.engine.connect() as plain:  # SQLAlchemy's own execution, for comparison
        usual = plain.execute(BUMP, {"p_id": "a", "p_by": 2, "p_at": AT}).one()
        text_row = plain.execute(
            select(THINGS.c.count, THINGS.c.data).where(THINGS.c.id == "t")
        ).one()
        plain.rollback()
    assert counted.statements, "the comparison ran through SQLAlchemy"

    assert (fast.count, fast.at, fast.data, fast.price) == (3, AT, {"k": [1, "x"]}, Decimal("0.25"))
    assert fast._asdict() == {**usual._asdict(), "count": 3}  # one bump fewer than `usual`
    assert type(fast.at) is type(usual.at) is datetime
    assert type(fast.price) is type(usual.price) is Decimal
    assert tuple(text_row) == (5, {"n": None})


def test_a_statements_own_values_are_bound_as_sqlalchemy_binds_them(db: Database) -> None:
    # Given a hot statement carrying values of its own (a datetime and JSON: processed)
    counted = Counted(db)
    with db.transaction() as connection:
        seed(connection)
        fast = connection.execute(OWN_VALUES, {"p_id": "a"}).one()
        # a statement's value the caller gives, by the bind's key, wins as in SQLAlchemy
        given = connection.execute(OWN_VALUES, {"p_id": "a", "count": 9}).one()
    assert counted.statements == []

    with db.engine.connect() as plain:
        usual = plain.execute(OWN_VALUES, {"p_id": "a"}).one()
        usual_given = plain.execute(OWN_VALUES, {"p_id": "a", "count": 9}).one()
        plain.rollback()
    assert fast._asdict() == usual._asdict() == {"count": 7, "at": AT_OWN, "data": {"own": True}}
    assert given._asdict() == usual_given._asdict()
    assert given.count == 9


def test_a_missing_value_is_refused_as_sqlalchemy_refuses_it(db: Database) -> None:
    with pytest.raises(StatementError, match="p_by"), db.transaction() as connection:
        connection.execute(BUMP, {"p_id": "a", "p_at": AT})


def test_no_row_is_none_and_a_scalar_is_its_first_column(db: Database) -> None:
    with db.transaction() as connection:
        seed(connection)
        assert (
            connection.execute(BUMP, {"p_id": "nope", "p_by": 1, "p_at": AT}).one_or_none() is None
        )
        count = connection.execute(BUMP, {"p_id": "a", "p_by": 1, "p_at": AT}).scalar_one()
    assert count == 2


def test_a_driver_error_is_raised_as_sqlalchemy_raises_it(db: Database) -> None:
    with pytest.raises(IntegrityError), db.transaction() as connection:
        seed(connection)
        seed(connection)  # the same primary key
    with db.transaction() as connection:  # rolled back, the connection still good
        assert connection.execute(NOT_HOT, {"p_id": "a"}).one_or_none() is None


def test_what_the_shortcut_does_not_cover_runs_through_sqlalchemy(db: Database) -> None:
    counted = Counted(db)
    with db.transaction() as connection:
        seed(connection)
        seed(connection, "b")
        assert counted.statements == []
        # not marked hot; an expanding IN; execution options; several parameter sets
        assert connection.execute(NOT_HOT, {"p_id": "a"}).scalar_one() == 1
        ids = connection.execute(EXPANDING, {"ids": ["a", "b", "c"]}).scalars().all()
        assert sorted(ids) == ["a", "b"]
        connection.execute(
            BUMP, {"p_id": "a", "p_by": 1, "p_at": AT}, execution_options={"foo": 1}
        ).all()
        connection.execute(
            INSERT,
            [{"id": "c", "count": 1, "at": None, "data": None, "price": None}] * 1
            + [{"id": "d", "count": 2, "at": None, "data": None, "price": None}],
        )
    assert len(counted.statements) == 4


def test_a_runs_writes_and_the_hot_reads_on_sqlite_take_the_shortcut(
    make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    """The executor's and the submit's writes (the run's row, its claim, its events, its
    spend, its final write) and the reads of every request and live stream (the API key,
    whether the tenant has the run, its events): none reaches SQLAlchemy's execution."""
    runtime = make_runtime(
        sqlite_url, sender=lambda _run_id: None, **scripted_agent([{"Text": "hi"}])
    )
    tenant = runtime.tenants.ensure_tenant("acme")
    key = runtime.tenants.issue_key(tenant).secret
    runtime.tenants.authenticate_tenant(key)  # its last use written (once a minute)
    counted = Counted(runtime.db)

    authenticated = runtime.tenants.authenticate_tenant(key)
    run = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "x"}))
    runtime.executor.execute(run.id)
    events = [e.type for e in runtime.runs.events(run.id)]
    found = runtime.runs.exists(run.id, tenant), runtime.runs.exists(run.id, "someone-else")

    assert counted.statements == []
    assert authenticated is not None and authenticated.tenant_id == tenant
    assert not authenticated.own_quota.found
    assert events == [
        "RunQueued",
        "RunStarted",
        "ModelCallStarted",
        "ModelCallCompleted",
        "RunCompleted",
    ]
    assert found == (True, False)
    done = runtime.runs.get(run.id)
    assert done is not None and done.status == "Completed"
