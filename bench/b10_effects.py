"""B10's own table, written by the steps of both systems: `b10_effects`, one row per step that
ran (`done`), plus one when the slow step of the recovery workload starts (`start`), each
with the key of its workflow, the step, and the pid of the process that ran it.

The steps of tracon's workflows (`bench.b10_workflows`) and of DBOS's (`bench.b10_dbos_app`)
call the same functions here, on an engine of their own process (`B10_EFFECTS_URL`), so a
step costs the same SQL on both sides. Counting the rows tells a step that ran twice: two
`done` rows of one key and step (its effect committed twice), or a step started again by a
process that was not killed.
"""

from __future__ import annotations

import os
import threading
import time

import sqlalchemy as sa

EFFECTS_ENV = "B10_EFFECTS_URL"
"""The database of the effects table, in the environment of the processes that run steps."""
POOL_SIZE = 32
"""Connections of one process's engine: the most steps of one process running at once."""

metadata = sa.MetaData()
effects = sa.Table(
    "b10_effects",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("step", sa.Text, nullable=False),
    sa.Column("phase", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

_engine: sa.Engine | None = None
_engine_lock = threading.Lock()


def create_table(url: str) -> None:
    """The effects table in the database at `url` (a fresh scratch database)."""
    engine = sa.create_engine(url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()


def engine() -> sa.Engine:
    """This process's engine on `B10_EFFECTS_URL`, made at first use."""
    global _engine
    with _engine_lock:
        if _engine is None:
            url = os.environ.get(EFFECTS_ENV)
            if not url:
                raise RuntimeError(f"{EFFECTS_ENV} is not set: no database for b10_effects")
            _engine = sa.create_engine(url, pool_size=POOL_SIZE, max_overflow=POOL_SIZE)
        return _engine


def record(key: str, step: str, phase: str = "done") -> str:
    """One row, committed on its own: the effect of a step (or the start of the slow one)."""
    with engine().begin() as conn:
        conn.execute(effects.insert().values(key=key, step=step, phase=phase, pid=os.getpid()))
    return step


def slow(key: str, step: str, seconds: float) -> str:
    """The recovery workload's slow step: its start, `seconds` of waiting, its effect."""
    record(key, step, "start")
    time.sleep(seconds)
    return record(key, step)
