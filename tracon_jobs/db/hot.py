"""SQLite: the store's hot statements run straight on the driver.

A process's SQLite writes take turns on one lock (`Database._one_writer`), so the CPU a
write transaction spends between `BEGIN IMMEDIATE` and `COMMIT` is paid again by every thread
queued behind it. SQLAlchemy's execution of a compiled, cached Core statement costs about
70 us on top of the driver's 25 (execution context, parameter and result set-up, event
dispatch). Run straight on the driver, a run's write transaction holds the lock for 187 us
of CPU instead of 239 (one thread, no contention), and one worker process alone completes
5% more trivial runs a second (359-370 against 342-352 at `Worker.Concurrency` 16).

A statement marked `hot` is compiled once per dialect and set of parameter names by
SQLAlchemy itself; its SQL text, the order of its parameters and SQLAlchemy's own bind and
result processors are kept, and `FastConnection.execute` runs it with the driver, processing
the parameters and the rows exactly as SQLAlchemy would (`construct_params`: the caller's
value by the parameter's key, else by its name, else the statement's own value, which is
processed once, when the plan is made). What the shortcut does not cover runs
the usual way: a statement not marked hot, an execution with options or several parameter
sets, and a statement whose compiled form needs more than text and processors (Python-side
column defaults, expanding or literal-rendered parameters, escaped parameter names, a value
computed on each execution or missing), or that
this SQLAlchemy cannot describe so (its internals moved: logged once, and nothing breaks). A
driver error is raised as SQLAlchemy raises it (`DBAPIError.instance`: `OperationalError`,
`IntegrityError`, ...), so the callers' handling, and riding out outages, are unchanged.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.engine.result import IteratorResult, SimpleResultMetaData
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import SQLCompiler

log = logging.getLogger(__name__)

Statement = TypeVar("Statement", bound=Executable)
Processor = Callable[[Any], Any] | None
Slot = tuple[str | None, Processor, Any]
"""A positional parameter: (the key of the caller's value, its bind processor, None), or
(None, None, the statement's own value, processed)."""

_hot: dict[int, Executable] = {}  # id -> the statement (kept alive: ids stay unique)
_plans: dict[tuple[int, type[Dialect], tuple[str, ...]], _Plan | None] = {}
_NO_COLUMNS = SimpleResultMetaData([])  # the result of a statement that returns no rows


def hot(statement: Statement) -> Statement:
    """Mark `statement` (a module-level constant, or one built once and cached) as run
    straight on the SQLite driver by `FastConnection`; returns it."""
    _hot[id(statement)] = statement
    return statement


class _Plan:
    """A hot statement compiled for one dialect: what running it takes, nothing more."""

    __slots__ = ("columns", "compiled", "metadata", "slots", "sql")

    def __init__(self, compiled: SQLCompiler, slots: list[Slot]) -> None:
        self.compiled = compiled
        self.sql = compiled.string
        self.slots = slots
        entries = compiled._result_columns  # what SQLAlchemy reads rows by: (key, ..., type)
        dialect = compiled.dialect
        self.columns: list[Processor] = [
            entry.type.dialect_impl(dialect).result_processor(dialect, None) for entry in entries
        ]
        keys = [entry.keyname for entry in entries]
        self.metadata = SimpleResultMetaData(keys) if keys else None

    def run(self, connection: Connection, parameters: Mapping[str, Any]) -> Any:
        args = tuple(
            value
            if key is None
            else parameters[key]
            if process is None
            else process(parameters[key])
            for key, process, value in self.slots
        )
        driver = connection.connection.driver_connection
        assert driver is not None
        try:
            cursor = driver.execute(self.sql, args)
            rows = cursor.fetchall() if self.metadata is not None else []
        except sqlite3.Error as exc:
            raise DBAPIError.instance(
                self.sql, args, exc, sqlite3.Error, dialect=self.compiled.dialect
            ) from exc
        if self.metadata is None:
            return IteratorResult(_NO_COLUMNS, iter(()))
        columns = self.columns
        processed = [
            tuple(v if fn is None else fn(v) for v, fn in zip(row, columns, strict=True))
            for row in rows
        ]
        return IteratorResult(self.metadata, iter(processed))


def _plan(statement: Executable, dialect: Dialect, keys: Sequence[str]) -> _Plan | None:
    """The plan of a hot statement for `dialect` and parameters named `keys`; None when it
    must run the usual way."""
    try:
        return _compile(statement, dialect, keys)
    except Exception as exc:  # SQLAlchemy's internals moved: the usual way still works
        log.warning("hot statement runs through SQLAlchemy instead: %r", exc)
        return None


def _compile(statement: Executable, dialect: Dialect, keys: Sequence[str]) -> _Plan | None:
    """An INSERT or UPDATE without values of its own writes the columns it is given, as
    SQLAlchemy compiles it: so does the plan."""
    compiled = statement.compile(dialect=dialect, column_keys=list(keys))  # type: ignore[attr-defined]
    assert isinstance(compiled, SQLCompiler)
    names: Sequence[str] | None = compiled.positiontup
    if (
        names is None
        or compiled.insert_prefetch
        or compiled.update_prefetch
        or compiled.literal_execute_params
        or compiled.post_compile_params
        or compiled.escaped_bind_names
    ):
        return None
    if getattr(compiled, "_collected_params", None):
        return None  # values of text clauses, collected as it compiled: merged on each call
    processors = compiled._bind_processors
    by_name = {name: bind for bind, name in compiled.bind_names.items()}
    given = set(keys)
    slots: list[Slot] = []
    for name in names:
        process = processors.get(name)
        if process is not None and not callable(process):
            return None  # a tuple of processors: an expanding tuple parameter
        bind = by_name[name]
        if bind.key in given:  # where `construct_params` looks first, then by name
            slots.append((bind.key, process, None))
        elif name in given:
            slots.append((name, process, None))
        elif bind.required or bind.callable is not None:
            return None  # SQLAlchemy raises for a missing value, or calls for it each time
        else:  # a value of the statement's own: processed once, here
            slots.append((None, None, bind.value if process is None else process(bind.value)))
    return _Plan(compiled, slots)


class FastConnection(Connection):
    """A SQLite connection that runs `hot` statements straight on the driver."""

    def execute(
        self,
        statement: Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        execution_options: Mapping[str, Any] | None = None,
    ) -> Any:
        if (
            id(statement) in _hot
            and not execution_options
            and (parameters is None or isinstance(parameters, Mapping))
        ):
            keys = tuple(sorted(parameters)) if parameters else ()
            key = (id(statement), type(self.dialect), keys)
            try:
                plan = _plans[key]
            except KeyError:
                plan = _plans[key] = _plan(statement, self.dialect, keys)
            if plan is not None:
                return plan.run(self, parameters or {})
        return super().execute(statement, parameters, execution_options=execution_options)
