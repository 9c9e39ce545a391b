"""The run store's SQL, built once at import: guarded statements with bind parameters, and the
few helpers that run them (the rows of a new run, its events, a spend's parameters).

The run row hands out event sequence numbers (`event_seq`), so appending an event is one
guarded `UPDATE ... RETURNING` plus an insert in the same transaction: the fence check and
the ordering come from the same statement, on SQLite and PostgreSQL alike.

The executor's writes (claim, append, spend, turn, close) are Core statements built once at
import, with bind parameters: per call only the parameters change, so SQLAlchemy neither
rebuilds them nor takes the ORM's bulk-update path, and its compiled cache always hits. The
time they record is read inside the statement (`StatementClock`), not in a round trip first.

On PostgreSQL a new run (the row and its `RunQueued`) and a run's final write (the fenced
`UPDATE` and its events) are each one statement, `WITH ... AS (INSERT/UPDATE ... RETURNING)
INSERT INTO run_events SELECT ...`, committed as it runs: atomic as a transaction would be,
without the BEGIN and COMMIT round trips, and no event is written when the guard fails.

A webhook message an event causes (`webhooks.outbox`) is one more insert in the event's
transaction, `INSERT INTO webhook_messages ... SELECT ... FROM runs WHERE runs.id = :id`, so
the tenant comes from the row itself (`message_insert`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any, cast

from sqlalchemy import (
    Column,
    Connection,
    Integer,
    Table,
    bindparam,
    case,
    exists,
    func,
    insert,
    inspect,
    literal,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, configure_mappers, make_transient_to_detached
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Insert, Update
from sqlalchemy.sql.elements import BindParameter, ColumnElement, TextClause
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.selectable import CTE, Select

from tracon_jobs.db.engine import StatementClock
from tracon_jobs.db.hot import hot
from tracon_jobs.db.models import (
    Run,
    RunEvent,
    Tenant,
    TenantQuotaOverride,
    WebhookEndpoint,
    WebhookMessage,
)
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store.values import (
    Event,
    NewRun,
    TurnSpend,
)

LIVE = [RunStatus.QUEUED.value, RunStatus.RUNNING.value, RunStatus.WAITING.value]

RUNS = cast(Table, Run.__table__)
EVENTS = cast(Table, RunEvent.__table__)
_RUN_CLASS = inspect(Run).class_manager
_NULL_RUN = dict.fromkeys(RUNS.c.keys())  # a column the insert left out is NULL in the row
_NOW = StatementClock()

Executes = Session | Connection
"""What a statement of this store runs in: a caller's session, or the Core connection of
the executor's own writes (`Database.transaction`)."""


def _param(column: Column[Any]) -> BindParameter[Any]:
    """A bind parameter typed like `column` (JSON, DateTime), named apart from the columns."""
    return bindparam(f"p_{column.key}", type_=column.type)


def _next_seq(*guard: ColumnElement[bool]) -> Update:
    """Hand out the run's next event seq (and the time) where `guard` still holds."""
    return (
        update(RUNS)
        .where(RUNS.c.id == _param(RUNS.c.id), *guard)
        .values(event_seq=RUNS.c.event_seq + 1)
        .returning(RUNS.c.event_seq, _NOW)
    )


class WaitedMs(FunctionElement[int]):
    """Milliseconds from a waiting run's `waiting_since` to the bound `p_ended_at` (at least
    0), computed in the statement that ends the wait: no read of `waiting_since` before it."""

    type = Integer()
    name = "waited_ms"
    inherit_cache = True


_ENDED_AT = _param(RUNS.c.ended_at)


@compiles(WaitedMs)
def _sqlite_waited_ms(element: WaitedMs, compiler: SQLCompiler, **kw: Any) -> str:
    ended, since = (compiler.process(e, **kw) for e in (_ENDED_AT, RUNS.c.waiting_since))
    return f"MAX(CAST((julianday({ended}) - julianday({since})) * 86400000 AS INTEGER), 0)"


@compiles(WaitedMs, "postgresql")
def _postgres_waited_ms(element: WaitedMs, compiler: SQLCompiler, **kw: Any) -> str:
    ended, since = (compiler.process(e, **kw) for e in (_ENDED_AT, RUNS.c.waiting_since))
    return f"GREATEST(CAST(FLOOR(EXTRACT(EPOCH FROM ({ended} - {since})) * 1000) AS INTEGER), 0)"


_OWNED = (RUNS.c.fence == _param(RUNS.c.fence), RUNS.c.status == RunStatus.RUNNING.value)
_APPEND = _next_seq()
_APPEND_FENCED = _next_seq(*_OWNED)
_SPEND: dict[str, Any] = dict(
    model_id=_param(RUNS.c.model_id),
    input_tokens=RUNS.c.input_tokens + _param(RUNS.c.input_tokens),
    output_tokens=RUNS.c.output_tokens + _param(RUNS.c.output_tokens),
    cost_amount=RUNS.c.cost_amount + _param(RUNS.c.cost_amount),
    # once any call of a run had no price, the run's cost is `Unknown` for good
    cost_source=case(
        (RUNS.c.cost_source == "Unknown", "Unknown"), else_=_param(RUNS.c.cost_source)
    ),
)
_APPEND_SPEND = _APPEND_FENCED.values(**_SPEND)
_APPEND_COST = _APPEND_FENCED.values(cost_amount=RUNS.c.cost_amount + _param(RUNS.c.cost_amount))
_APPEND_MANY_FENCED = _APPEND_FENCED.values(event_seq=RUNS.c.event_seq + bindparam("p_count"))

_CLOSE_ANSWERED = (
    update(RUNS)
    .where(RUNS.c.id == _param(RUNS.c.id), RUNS.c.status == RunStatus.WAITING.value)
    .values(
        status=RunStatus.COMPLETED.value,
        output=_param(RUNS.c.output),
        ended_at=_ENDED_AT,
        waiting_since=None,
        waited_ms=RUNS.c.waited_ms + WaitedMs(),
        event_seq=RUNS.c.event_seq + bindparam("p_count"),
    )
    .returning(RUNS.c.event_seq, _NOW)
)
"""`Waiting` -> `Completed` by the answer that continues the run's chain, with the seqs of its
`p_count` closing events, in one statement (`WaitingRuns.close_answered_in`)."""


@functools.cache
def _close_answered_many(count: int) -> Update:
    """`_CLOSE_ANSWERED` of `count` runs in one statement, each with its own output
    (`p_id_<i>`, `p_output_<i>`) and the same `p_count` closing events: it returns (id, seq,
    time) of each run it closed, none of one that no longer waits. Built once per count."""
    ids = [bindparam(f"p_id_{i}", type_=RUNS.c.id.type) for i in range(count)]
    outputs = [bindparam(f"p_output_{i}", type_=RUNS.c.output.type) for i in range(count)]
    return (
        update(RUNS)
        .where(RUNS.c.id.in_(ids), RUNS.c.status == RunStatus.WAITING.value)
        .values(
            status=RunStatus.COMPLETED.value,
            output=case(*[(RUNS.c.id == i, o) for i, o in zip(ids, outputs, strict=True)]),
            ended_at=_ENDED_AT,
            waiting_since=None,
            waited_ms=RUNS.c.waited_ms + WaitedMs(),
            event_seq=RUNS.c.event_seq + bindparam("p_count"),
        )
        .returning(RUNS.c.id, RUNS.c.event_seq, _NOW)
    )


_INSERT_EVENT = insert(EVENTS)
_CREATE = (
    insert(RUNS)
    # enqueued: the caller sends right after; the requeue scan covers a crash in between
    .values(created_at=_NOW, enqueued_at=_NOW)
    .returning(RUNS.c.created_at)
)
_CLAIMABLE = (RUNS.c.id == _param(RUNS.c.id), RUNS.c.status == RunStatus.QUEUED.value)
_NEW_ROW_COLUMNS = (
    "id", "tenant_id", "agent", "kind", "status", "input", "parameters", "session_id",
    "parent_run_id", "root_run_id", "depth", "continued_from_run_id", "attempt",
    "turns_completed", "input_tokens", "output_tokens", "cost_amount", "cost_currency",
    "cost_source", "fence", "event_seq", "enqueue_count", "waited_ms", "resumable",
    "priority", "traceparent", "workflow_version",
)  # fmt: skip
_NEW_RUN = (
    insert(RUNS)
    .values({name: _param(RUNS.c[name]) for name in _NEW_ROW_COLUMNS})
    .values(created_at=_NOW, enqueued_at=_NOW)
    .returning(RUNS.c.id, RUNS.c.created_at)
    .cte("new_run")
)
# PostgreSQL: the row and its `RunQueued` in one statement (`WITH new_run AS (INSERT ...)
# INSERT INTO run_events SELECT ... FROM new_run`), committed as it runs
_CREATE_QUEUED = (
    insert(EVENTS)
    .from_select(
        ["run_id", "seq", "type", "at", "data"],
        select(
            _NEW_RUN.c.id,
            literal(1),
            literal("RunQueued"),
            _NEW_RUN.c.created_at,
            bindparam("p_data", type_=EVENTS.c.data.type),
        ),
    )
    .returning(EVENTS.c.at)
    .add_cte(_NEW_RUN, nest_here=True)
)
_QUOTAS = cast(Table, TenantQuotaOverride.__table__)
_TENANTS = cast(Table, Tenant.__table__)

_RUN_BY_ID = select(*RUNS.c).where(RUNS.c.id == bindparam("p_id"))
_RUNS_BY_ID = select(*RUNS.c).where(RUNS.c.id.in_(bindparam("p_ids", expanding=True)))
_RUN_OF_TENANT = select(RUNS.c.id).where(
    RUNS.c.id == bindparam("p_id"), RUNS.c.tenant_id == bindparam("p_tenant")
)
_EVENTS_AFTER = (
    select(EVENTS.c.seq, EVENTS.c.type, EVENTS.c.at, EVENTS.c.data)
    .where(EVENTS.c.run_id == bindparam("p_id"), EVENTS.c.seq > bindparam("p_after"))
    .order_by(EVENTS.c.seq)
    .limit(bindparam("p_limit"))
)
_OWN_QUOTA = _QUOTAS.c.tenant_id == RUNS.c.tenant_id
# the tenant's own quota, which the run checks at its gates: no read of its own
_OWN_QUOTA_COLUMNS = (
    exists().where(_OWN_QUOTA).label("own_quota_found"),
    select(_QUOTAS.c.period).where(_OWN_QUOTA).scalar_subquery().label("own_quota_period"),
    select(_QUOTAS.c.cost_limit).where(_OWN_QUOTA).scalar_subquery().label("own_quota_limit"),
    select(_TENANTS.c.max_concurrent_runs)
    .where(_TENANTS.c.id == RUNS.c.tenant_id)
    .scalar_subquery()
    .label("own_max_runs"),
)
# a claim is the claimable row read (no lock), then made by the claim's first write with
# that write's events (`RunStarted`, and the executor's next one maybe): `Queued` -> `Running`
# with the next fence, only if nobody claimed the run since it was read
_READ_CLAIMABLE = select(*RUNS.c, *_OWN_QUOTA_COLUMNS, _NOW.label("read_at")).where(*_CLAIMABLE)
_MAKE_CLAIM = {
    count: update(RUNS)
    .where(*_CLAIMABLE, RUNS.c.fence == bindparam("p_read_fence"))
    .values(
        status=RunStatus.RUNNING.value,
        fence=RUNS.c.fence + 1,
        owner=_param(RUNS.c.owner),
        started_at=func.coalesce(RUNS.c.started_at, _NOW),
        heartbeat_at=_NOW,
        event_seq=RUNS.c.event_seq + count,
    )
    .returning(RUNS.c.event_seq, RUNS.c.heartbeat_at.label("at"), RUNS.c.tenant_id)
    for count in (1, 2)
}
_SAVE_TURN = (
    update(RUNS)
    .where(RUNS.c.id == _param(RUNS.c.id), *_OWNED)
    .values(messages=_param(RUNS.c.messages), turns_completed=_param(RUNS.c.turns_completed))
    .returning(RUNS.c.id)
)
_MARK_ENQUEUED = (
    update(RUNS)
    .where(RUNS.c.id == _param(RUNS.c.id))
    .values(enqueued_at=_NOW, enqueue_count=RUNS.c.enqueue_count + 1)
)
_CLOSE = (
    update(RUNS)
    .where(RUNS.c.id == _param(RUNS.c.id), RUNS.c.status == bindparam("p_expected"))
    .values(
        status=_param(RUNS.c.status),
        output=_param(RUNS.c.output),
        ended_at=_NOW,
        error_type=_param(RUNS.c.error_type),
        error_class=_param(RUNS.c.error_class),
        error_message=_param(RUNS.c.error_message),
        error_retry_after=_param(RUNS.c.error_retry_after),
        model_attempts=_param(RUNS.c.model_attempts),
        event_seq=RUNS.c.event_seq + 1,
    )
    # the tenant too: the outbox messages of a final write read it (`_message_cte`)
    .returning(RUNS.c.event_seq, _NOW.label("at"), RUNS.c.tenant_id)
)
_CLOSE_FENCED = _CLOSE.where(RUNS.c.fence == _param(RUNS.c.fence))
_CLOSE_SPEND = _CLOSE_FENCED.values(
    event_seq=RUNS.c.event_seq + 2,  # the spend's `ModelCallCompleted`, then the terminal one
    **_SPEND,
)

# SQLite runs these straight on the driver (`db/hot.py`): the executor's and the submit's
# writes, each inside the process's turn on the write lock, and every live stream's reads.
for _statement in (
    _RUN_OF_TENANT,
    _EVENTS_AFTER,
    _APPEND,
    _APPEND_FENCED,
    _APPEND_SPEND,
    _APPEND_MANY_FENCED,
    _INSERT_EVENT,
    _CREATE,
    _READ_CLAIMABLE,
    *_MAKE_CLAIM.values(),
    _SAVE_TURN,
    _MARK_ENQUEUED,
    _CLOSE,
    _CLOSE_FENCED,
    _CLOSE_SPEND,
):
    hot(_statement)


MESSAGES = cast(Table, WebhookMessage.__table__)
ENDPOINTS = cast(Table, WebhookEndpoint.__table__)
_MESSAGE_COLUMNS = ("id", "tenant_id", "type", "subject_id", "data", "dedupe_key", "created_at")

MessageShape = tuple[bool, bool]
"""What a message's insert must do: (gated, once), see `message_insert`."""


def _message_param(name: str, prefix: str = "p_") -> BindParameter[Any]:
    return bindparam(f"{prefix}{name}", type_=MESSAGES.c[name].type)


def _subscribes(
    tenant: ColumnElement[Any], type_: BindParameter[Any], *, on_sqlite: bool
) -> ColumnElement[bool]:
    """Whether `tenant` has an enabled endpoint whose `events` name the type `type_`: read
    with the insert, so an endpoint created or disabled a moment ago counts as it is."""
    names: ColumnElement[bool]
    if on_sqlite:
        listed = func.json_each(ENDPOINTS.c.events).table_valued("value")
        names = exists().select_from(listed).where(listed.c.value == type_)
    else:
        names = sql_cast(ENDPOINTS.c.events, postgresql.JSONB).has_key(type_)
    return exists().where(ENDPOINTS.c.tenant_id == tenant, ENDPOINTS.c.enabled.is_(true()), names)


def _into_outbox(
    rows: Select[Any], shape: MessageShape, *, on_sqlite: bool
) -> Insert | postgresql.Insert | sqlite.Insert:
    """`INSERT INTO webhook_messages SELECT <rows>`, written once by its key when `once`."""
    dialect_insert = sqlite.insert if on_sqlite else postgresql.insert
    statement = dialect_insert(MESSAGES).from_select(list(_MESSAGE_COLUMNS), rows)
    if not shape[1]:
        return statement
    return statement.on_conflict_do_update(
        index_elements=[MESSAGES.c.dedupe_key],
        set_={"dedupe_key": statement.excluded.dedupe_key},
    )


@functools.cache
def message_insert(*, of_run: bool, gated: bool, once: bool, on_sqlite: bool) -> Insert:
    """The insert of one outbox message, its tenant read in the same statement: from the row
    of run `p_source_id` (`of_run`), else tenant `p_source_id` itself. It returns the id of
    the row written; none when the source row is missing or the gate stopped it.

    `gated`: only when that tenant has an enabled endpoint that subscribes to the type (the
    others who may want it, the operator's endpoint and Slack, are configuration: the caller
    knows them). `once`: a message whose `dedupe_key` may be written already (by another run,
    process or request); it returns the id of the row holding the key, this one or the
    earlier one, so the caller knows the message is there either way.
    """
    source = RUNS if of_run else _TENANTS
    tenant = RUNS.c.tenant_id if of_run else _TENANTS.c.id
    where = [source.c.id == bindparam("p_source_id", type_=source.c.id.type)]
    if gated:
        where.append(_subscribes(tenant, _message_param("type"), on_sqlite=on_sqlite))
    values = [tenant if name == "tenant_id" else _message_param(name) for name in _MESSAGE_COLUMNS]
    rows = select(*values).where(*where)
    statement = _into_outbox(rows, (gated, once), on_sqlite=on_sqlite).returning(MESSAGES.c.id)
    return hot(statement) if on_sqlite else statement


def _message_cte(changed: CTE, index: int, shape: MessageShape) -> CTE:
    """PostgreSQL: message `index` of a guarded write, inserted in the write's statement with
    the tenant and the time of the row `changed`; its parameters are `p_m<index>_<column>`."""
    prefix = f"p_m{index}_"
    values = [
        changed.c.tenant_id
        if name == "tenant_id"
        else changed.c.at
        if name == "created_at"
        else _message_param(name, prefix)
        for name in _MESSAGE_COLUMNS
    ]
    where: list[ColumnElement[bool]] = [true()]  # an upsert's SELECT needs its WHERE
    if shape[0]:
        type_ = _message_param("type", prefix)
        where.append(_subscribes(changed.c.tenant_id, type_, on_sqlite=False))
    rows = select(*values).where(*where)
    statement = _into_outbox(rows, shape, on_sqlite=False)
    return statement.returning(MESSAGES.c.id).cte(f"message_{index}")


@functools.cache
def _with_events(guarded: Update, count: int, messages: tuple[MessageShape, ...] = ()) -> Insert:
    """PostgreSQL: `guarded` (an `UPDATE ... RETURNING event_seq, at, tenant_id` that handed
    out `count` sequence numbers) and the insert of its `count` events in one statement; no
    row comes back when the guard stopped the update. Event `i` takes bind parameters
    `p_type_i` and `p_data_i`.

    With `messages`, the outbox messages of those events are inserted in the same statement
    (`_message_cte`), and each row comes back as (seq, at, the id of each message written or
    found by its key, None where the gate stopped it)."""
    changed = guarded.cte("changed")
    rows = [
        select(
            bindparam("p_id", type_=EVENTS.c.run_id.type),
            changed.c.event_seq - (count - 1 - i),
            bindparam(f"p_type_{i}", type_=EVENTS.c.type.type),
            changed.c.at,
            bindparam(f"p_data_{i}", type_=EVENTS.c.data.type),
        )
        for i in range(count)
    ]
    source = rows[0] if count == 1 else union_all(*rows)
    outbox = [_message_cte(changed, j, shape) for j, shape in enumerate(messages)]
    statement = (
        insert(EVENTS)
        .from_select(["run_id", "seq", "type", "at", "data"], source)
        .returning(EVENTS.c.seq, EVENTS.c.at, *(select(m.c.id).scalar_subquery() for m in outbox))
        .add_cte(changed, nest_here=True)
    )
    for cte in outbox:
        statement = statement.add_cte(cte, nest_here=True)
    return statement


_CLOSE_IN_ONE = {
    id(_CLOSE): _with_events(_CLOSE, 1),
    id(_CLOSE_FENCED): _with_events(_CLOSE_FENCED, 1),
    id(_CLOSE_SPEND): _with_events(_CLOSE_SPEND, 2),
}
_MAKE_CLAIM_IN_ONE = {count: _with_events(_MAKE_CLAIM[count], count) for count in (1, 2)}


def _detached_run(values: dict[str, Any]) -> Run:
    """A `Run` from a whole row, as the ORM hands it out after its session closed.

    Built the way the ORM's loader builds one (a bare instance, its dict filled), then
    given its identity: a sixth of the cost of `Run(**values)` and its attribute events.
    Every column is loaded, so reading one never needs the closed session.
    """
    configure_mappers()  # a no-op once done; `new_instance` alone would not trigger it
    run = _RUN_CLASS.new_instance()
    run.__dict__.update(_NULL_RUN, **values)
    make_transient_to_detached(run)
    return run


def _numbered(
    run_id: str, last: int, at: datetime, typed: Sequence[tuple[str, dict[str, Any]]]
) -> list[Event]:
    """Events given by (type, data), numbered up to `last`."""
    first = last - len(typed) + 1
    return [Event(run_id, first + i, type_, at, data) for i, (type_, data) in enumerate(typed)]


def _new_row(new: NewRun) -> dict[str, Any]:
    """The columns of a new `Queued` run (its times are the statement's)."""
    return dict(
        id=new.id,
        tenant_id=new.tenant_id,
        agent=new.agent,
        kind=new.kind,
        status=RunStatus.QUEUED.value,
        input=new.input,
        parameters=new.parameters,
        session_id=new.session_id,
        parent_run_id=new.parent_run_id,
        root_run_id=new.root_run_id or new.id,
        depth=new.depth,
        continued_from_run_id=new.continued_from_run_id,
        attempt=new.attempt,
        turns_completed=0,
        input_tokens=0,
        output_tokens=0,
        cost_amount=Decimal(0),
        cost_currency=new.currency,
        cost_source="Configured",
        fence=0,
        event_seq=1,
        enqueue_count=1,
        waited_ms=0,
        resumable=new.resumable,
        priority=new.priority,
        traceparent=new.traceparent,
        workflow_version=new.workflow_version,
    )


def _spend_params(spend: TurnSpend) -> dict[str, Any]:
    return {
        "p_model_id": spend.model_id,
        "p_input_tokens": spend.input_tokens,
        "p_output_tokens": spend.output_tokens,
        "p_cost_amount": spend.cost,
        "p_cost_source": spend.cost_source,
    }


def _insert_events(session: Executes, events: Sequence[Event]) -> None:
    """Events of one transaction in one statement (a multi-row `INSERT ... VALUES`)."""
    if len(events) == 1:
        event = events[0]
        _insert_event(session, event.run_id, event.seq, event.type, event.at, event.data)
        return
    if len(events) > _ONE_STATEMENT_EVENTS:  # a batch's: the driver's executemany
        rows = [
            {"run_id": e.run_id, "seq": e.seq, "type": e.type, "at": e.at, "data": e.data}
            for e in events
        ]
        session.execute(_INSERT_EVENT, rows)
        return
    params: dict[str, Any] = {}
    for i, e in enumerate(events):
        params.update({f"run_id_{i}": e.run_id, f"seq_{i}": e.seq, f"type_{i}": e.type})
        params.update({f"at_{i}": e.at, f"data_{i}": e.data})
    session.execute(_insert_many(len(events)), params)


_EVENT_COLUMNS = ("run_id", "seq", "type", "at", "data")
_ONE_STATEMENT_EVENTS = 16
"""The most events inserted as one multi-row statement; more (a batch of answers' events) go
as one executemany, which psycopg sends in one pipeline: a multi-row statement that long is
parsed anew by the driver on every call (its query cache keeps short statements only)."""


@functools.cache
def _insert_many(count: int) -> TextClause:
    """The insert of `count` events, with typed bind parameters, built once per count.

    A text statement, because SQLAlchemy never caches the compiled form of a multi-row
    `insert().values([...])` (it has no cache key): that was compiled again on every call.
    """
    rows = ", ".join(
        "(" + ", ".join(f":{name}_{i}" for name in _EVENT_COLUMNS) + ")" for i in range(count)
    )
    binds = [
        bindparam(f"{name}_{i}", type_=EVENTS.c[name].type)
        for i in range(count)
        for name in _EVENT_COLUMNS
    ]
    columns = ", ".join(_EVENT_COLUMNS)
    return hot(text(f"INSERT INTO {EVENTS.name} ({columns}) VALUES {rows}").bindparams(*binds))


@functools.cache
def _append_in_one(statement: Update) -> Insert:
    """PostgreSQL: `statement` (a `_next_seq`: the run's next seq and the time, where its guard
    holds) and the insert of that event, in one statement, a data-modifying CTE; it returns
    (seq, at) as `statement` does, and no row when the guard failed (nothing inserted). One
    round trip an event where there were two. SQLite has no data-modifying CTE: it runs the
    two (`RunWrites._append`)."""
    seq = statement.returning(RUNS.c.id).cte("next_seq")
    next_seq, at, run_id = list(seq.c)
    event = select(
        run_id,
        next_seq,
        bindparam("type", type_=EVENTS.c.type.type),
        at,
        bindparam("data", type_=EVENTS.c.data.type),
    )
    return (
        insert(EVENTS)
        .from_select(["run_id", "seq", "type", "at", "data"], event)
        .returning(EVENTS.c.seq, EVENTS.c.at)
    )


def _insert_event(
    session: Executes, run_id: str, seq: int, type_: str, at: datetime, data: dict[str, Any]
) -> None:
    """A Core insert: events are append-only, they never need the ORM's unit of work."""
    session.execute(
        _INSERT_EVENT, {"run_id": run_id, "seq": seq, "type": type_, "at": at, "data": data}
    )
