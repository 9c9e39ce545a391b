"""SQL persistence of runs and their events, every executor write guarded by its fence.

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
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, cast

from sqlalchemy import (
    Column,
    Connection,
    Table,
    and_,
    bindparam,
    case,
    exists,
    func,
    insert,
    inspect,
    literal,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.orm import Session, configure_mappers, make_transient_to_detached
from sqlalchemy.sql.dml import Insert, Update
from sqlalchemy.sql.elements import BindParameter, ColumnElement, TextClause

from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.db import Database
from tracon_jobs.db.engine import StatementClock
from tracon_jobs.db.hot import hot
from tracon_jobs.db.models import Run, RunEvent, TenantQuotaOverride
from tracon_jobs.db.outages import rides_out_outages
from tracon_jobs.errors import ClaimedElsewhere, RunTakenAway
from tracon_jobs.limits.tenant_quotas import OwnQuota
from tracon_jobs.runs.lifecycle import (
    TERMINAL_EVENT,
    AnyClaim,
    Claim,
    ErrorClass,
    PendingClaim,
    RunError,
    RunStatus,
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
    .returning(RUNS.c.event_seq, RUNS.c.heartbeat_at.label("at"))
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
    .returning(RUNS.c.event_seq, _NOW.label("at"))
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


def _with_events(guarded: Update, count: int) -> Insert:
    """PostgreSQL: `guarded` (an `UPDATE ... RETURNING event_seq, at` that handed out `count`
    sequence numbers) and the insert of its `count` events in one statement; no row comes
    back when the guard stopped the update. Event `i` takes bind parameters `p_type_i` and
    `p_data_i`."""
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
    return (
        insert(EVENTS)
        .from_select(["run_id", "seq", "type", "at", "data"], source)
        .returning(EVENTS.c.seq, EVENTS.c.at)
        .add_cte(changed, nest_here=True)
    )


_CLOSE_IN_ONE = {
    id(_CLOSE): _with_events(_CLOSE, 1),
    id(_CLOSE_FENCED): _with_events(_CLOSE_FENCED, 1),
    id(_CLOSE_SPEND): _with_events(_CLOSE_SPEND, 2),
}
_MAKE_CLAIM_IN_ONE = {count: _with_events(_MAKE_CLAIM[count], count) for count in (1, 2)}


@dataclass(frozen=True)
class Event:
    run_id: str
    seq: int
    type: str
    at: datetime
    data: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, "at": iso(self.at), "data": self.data}


@dataclass(frozen=True)
class NewRun:
    tenant_id: str
    agent: str
    input: dict[str, Any]
    kind: str = "agent"
    session_id: str | None = None
    parameters: dict[str, Any] | None = None
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int = 0
    continued_from_run_id: str | None = None
    attempt: int = 1
    currency: str = "USD"
    resumable: bool = False  # a job owns it (submitted respond-async): it may be resumed
    id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass(frozen=True)
class TurnSpend:
    """What one model call cost, priced at the model that answered."""

    model_id: str
    input_tokens: int
    output_tokens: int
    cost: Decimal
    cost_source: str


@dataclass(frozen=True)
class RunFilter:
    status: str | None = None
    agent: str | None = None
    session_id: str | None = None
    kind: str | None = None  # "agent" | "workflow"


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat(timespec="milliseconds") + "Z"


class RunStore:
    """Runs and their events in SQL; every executor write is guarded by the claim's fence."""

    def __init__(self, db: Database, feed: EventFeed | None = None) -> None:
        self.db = db
        self.feed = feed
        # run id -> a claim read and not made yet: the claim's next write makes it
        self._pending: dict[str, PendingClaim] = {}
        # run id -> a claim that was never made: another process claimed the run first, with
        # the same fence number maybe; every write of it is refused until `let_go`
        self._taken: dict[str, PendingClaim] = {}
        # run id -> the fence of a claim whose executor is making its last change of the run
        # (the final write, or the wait for a person): the run leaves `Running` by its own
        # hand, and a heartbeat that no longer finds it there is no take-over
        self._ending: dict[str, int] = {}

    def publish(self, event: Event | None) -> Event | None:
        if event is not None and self.feed is not None:
            self.feed.publish(event.run_id, event.seq)
        return event

    # -- creating and enqueueing -------------------------------------------------------

    def create(self, new: NewRun) -> Run:
        """Write the `Queued` row and its `RunQueued` event before any message is sent.

        Nothing is published: no tail can be waiting on the feed of a run that did not
        exist, and a tail reads SQL before it first waits, so it finds `RunQueued` there."""
        if self.db.is_sqlite:
            with self.db.transaction() as connection:  # Core: no Session around two statements
                run, _event = self.create_in(connection, new)
            return run
        row = _new_row(new)  # PostgreSQL: the row and its event in one statement
        params = {f"p_{key}": value for key, value in row.items()}
        with self.db.autocommit() as connection:
            now = connection.execute(
                _CREATE_QUEUED, {**params, "p_data": {"agent": new.agent}}
            ).scalar_one()
        row.update(created_at=now, enqueued_at=now)
        return _detached_run(row)

    def create_in(self, session: Executes, new: NewRun) -> tuple[Run, Event]:
        """`create` inside a transaction of the caller's; the caller publishes the event."""
        row = _new_row(new)
        now = session.execute(_CREATE, {**row, **self.db.clock_params()}).scalar_one()
        _insert_event(session, new.id, 1, "RunQueued", now, {"agent": new.agent})
        row.update(created_at=now, enqueued_at=now)
        return _detached_run(row), Event(new.id, 1, "RunQueued", now, {"agent": new.agent})

    def mark_enqueued(self, run_id: str) -> None:
        with self.db.write() as session:
            session.execute(_MARK_ENQUEUED, {"p_id": run_id, **self.db.clock_params()})

    def fail_unsent(self, run_id: str, error: RunError) -> bool:
        """Close a run whose message the broker refused, unless a worker has it already."""
        return (
            self._close(run_id, RunStatus.QUEUED, None, RunStatus.FAILED, error=error) is not None
        )

    def unclaimed(self, now: datetime, older_than: timedelta, limit: int) -> list[str]:
        """`Queued` runs nobody claimed: sent before the deadline, or never recorded as sent."""
        deadline = now - older_than
        query = (
            select(Run.id)
            .where(
                Run.status == RunStatus.QUEUED.value,
                or_(
                    Run.enqueued_at < deadline,
                    and_(Run.enqueued_at.is_(None), Run.created_at < deadline),
                ),
            )
            .order_by(Run.created_at)
            .limit(limit)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    # -- the executor's fenced writes --------------------------------------------------

    def claim_and_load(self, run_id: str, owner: str) -> tuple[Claim, Run] | None:
        """The claim and the claimed row, the claim made at once: `open_claim`, then
        `settle` (for a caller whose next step is no model call)."""
        claimed = self.open_claim(run_id, owner)
        if claimed is None:
            return None
        pending, run, _own_quota = claimed
        try:
            claim = self.settle(pending)
        except ClaimedElsewhere:  # claimed by another process since it was read
            return None
        finally:
            self.let_go(pending)  # forgets a claim that was not made; nothing once it is
        return claim, run

    @rides_out_outages
    def open_claim(self, run_id: str, owner: str) -> tuple[PendingClaim, Run, OwnQuota] | None:
        """The claim of a `Queued` run, and the row as the claim leaves it; None when the run
        is not `Queued`.

        The row is read (no lock, no write). The claim is made by its next fenced write
        through this store, or `settle`, in that write's transaction, guarded by the fence
        read (`_make_claim`): the executor's first `ModelCallStarted` commits with the
        claim and `RunStarted` in one statement on PostgreSQL (one turn on the write lock
        on SQLite), and nothing is held across the Redis calls before it. A process that
        claimed the run in between wins, and that write raises `ClaimedElsewhere`, before any
        model call. Until then the run is this process's to the heartbeat while it waits
        `Queued` with the fence read; a claim never made (the executor let go without a
        write) leaves it `Queued`, for the requeue scan to send again. A second delivery
        of the run to this process while its claim is read and not made (a re-send taken
        in the same batch) finds it claimed: only one thread of a process holds a claim.
        """
        with self.db.read_connection() as connection:
            params = {"p_id": run_id, **self.db.clock_params()}
            row = connection.execute(_READ_CLAIMABLE, params).one_or_none()
        if row is None:
            return None
        values = row._asdict()
        own_quota = OwnQuota(
            bool(values.pop("own_quota_found")),
            values.pop("own_quota_period"),
            values.pop("own_quota_limit"),
        )
        now = values.pop("read_at")
        claim = PendingClaim(run_id=run_id, fence=values["fence"] + 1, owner=owner)
        values.update(  # as `settle` leaves it, with `RunStarted` alone
            status=RunStatus.RUNNING.value,
            fence=claim.fence,
            owner=owner,
            started_at=values["started_at"] or now,
            heartbeat_at=now,
            event_seq=values["event_seq"] + 1,
        )
        if self._pending.setdefault(run_id, claim) is not claim:  # atomic: one thread wins
            return None
        return claim, _detached_run(values), own_quota

    @rides_out_outages
    def settle(self, claim: AnyClaim) -> Claim:
        """The claim made: a claim read by `open_claim` is made now if no write made it yet
        (`ClaimedElsewhere` when another process made it first); a made one as it is."""
        return self._settle(claim)

    def _settle(self, claim: AnyClaim) -> Claim:
        if isinstance(claim, Claim):
            return claim
        if self._is_pending(claim):
            self._make_claim(claim, None)
        return Claim(claim.run_id, claim.fence, claim.owner)

    def let_go(self, claim: AnyClaim) -> None:
        """The executor is done with `claim`: forget it, if it was never made (the run is
        still `Queued`, unclaimed, and the requeue scan sends it again) or never could be."""
        for forgotten in (self._pending, self._taken):
            if forgotten.get(claim.run_id) == claim:
                del forgotten[claim.run_id]
        if self._ending.get(claim.run_id) == claim.fence:
            del self._ending[claim.run_id]

    def _is_pending(self, claim: AnyClaim | None) -> bool:
        """Whether `claim` is read and not made yet; `ClaimedElsewhere` for a claim that another
        process made first (its fence number may be theirs: nothing of it may be written)."""
        if not isinstance(claim, PendingClaim):
            return False  # a `Claim` is made: only `settle` gives one out
        if self._taken.get(claim.run_id) == claim:
            raise ClaimedElsewhere(f"run {claim.run_id} was claimed by another process")
        return self._pending.get(claim.run_id) == claim

    def _make_claim(self, claim: PendingClaim, second: tuple[str, dict[str, Any]] | None) -> Event:
        """The claim, `RunStarted` and `second`, committed and published at once.

        Left pending when the write fails (the next write tries again); `ClaimedElsewhere`
        (a `RunTakenAway`), for good, when the run was claimed, canceled or closed since it
        was read."""
        typed = [("RunStarted", {"owner": claim.owner})] + ([second] if second else [])
        params: dict[str, Any] = {
            "p_id": claim.run_id,
            "p_owner": claim.owner,
            "p_read_fence": claim.fence - 1,
            **self.db.clock_params(),
        }
        in_one = None if self.db.is_sqlite else _MAKE_CLAIM_IN_ONE[len(typed)]
        event = self._write_with_events(
            claim.run_id, _MAKE_CLAIM[len(typed)], in_one, params, typed
        )
        del self._pending[claim.run_id]
        if event is None:
            self._taken[claim.run_id] = claim
            raise ClaimedElsewhere(f"run {claim.run_id} was claimed by another process")
        self.publish(event)
        return event

    def _write_with_events(
        self,
        run_id: str,
        guarded: Update,
        in_one: Insert | None,
        params: dict[str, Any],
        typed: Sequence[tuple[str, dict[str, Any]]],
    ) -> Event | None:
        """`guarded` (an `UPDATE ... RETURNING event_seq, at` that hands out `len(typed)`
        sequence numbers) and the events `typed`, committed at once: the last event, not
        published yet, or None when the guard matched no row (nothing is written).

        With `in_one` (PostgreSQL, `_with_events(guarded, ...)`), one statement in
        autocommit; else one transaction of the update and a multi-row insert."""
        if in_one is not None:
            for i, (type_, data) in enumerate(typed):
                params.update({f"p_type_{i}": type_, f"p_data_{i}": data})
            with self.db.autocommit() as connection:
                rows = connection.execute(in_one, params).all()
            if not rows:
                return None
            seq, at = max(rows)
            return _numbered(run_id, seq, at, typed)[-1]
        with self.db.transaction() as session:
            row = session.execute(guarded, params).one_or_none()
            if row is None:
                return None
            events = _numbered(run_id, row[0], row[1], typed)
            _insert_events(session, events)
        return events[-1]

    @rides_out_outages
    def append(
        self,
        claim: AnyClaim | None,
        type_: str,
        data: dict[str, Any],
        *,
        run_id: str | None = None,
    ) -> Event:
        """Append and publish one event (fenced when `claim` is given; with the claim itself,
        when it is read and not made yet)."""
        if isinstance(claim, PendingClaim) and self._is_pending(claim):
            return self._make_claim(claim, (type_, data))
        made = None if claim is None else self._settle(claim)
        with self.db.transaction() as session:
            event = self.append_in(session, made, type_, data, run_id=run_id)
        self.publish(event)
        return event

    @rides_out_outages
    def append_all(self, claim: AnyClaim, events: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Append several fenced events at once: one seq update, one multi-row insert and
        one wake-up of the followers, however many events."""
        if not events:
            return
        claim = self._settle(claim)
        params = {"p_id": claim.run_id, "p_fence": claim.fence, "p_count": len(events)}
        with self.db.transaction() as session:
            row = session.execute(
                _APPEND_MANY_FENCED, {**params, **self.db.clock_params()}
            ).one_or_none()
            if row is None:
                raise RunTakenAway(f"run {claim.run_id} is no longer owned by fence {claim.fence}")
            last, at = row
            first = last - len(events) + 1
            rows = [
                Event(claim.run_id, first + i, type_, at, data)
                for i, (type_, data) in enumerate(events)
            ]
            _insert_events(session, rows)
        self.publish(rows[-1])

    def append_in(
        self,
        session: Executes,
        claim: Claim | None,
        type_: str,
        data: dict[str, Any],
        *,
        run_id: str | None = None,
    ) -> Event:
        """Append one event inside `session`; guarded by the fence when a claim is given."""
        if claim is None:
            assert run_id is not None
            return self._append(session, _APPEND, run_id, None, type_, data, {})
        return self._append(session, _APPEND_FENCED, claim.run_id, claim, type_, data, {})

    def _append(
        self,
        session: Executes,
        statement: Update,
        run_id: str,
        claim: Claim | None,
        type_: str,
        data: dict[str, Any],
        params: dict[str, Any],
    ) -> Event:
        """Run `statement` (a `_next_seq` with more SET values maybe), then insert the event."""
        params.update(self.db.clock_params(), p_id=run_id)
        if claim is not None:
            params["p_fence"] = claim.fence
        row = session.execute(statement, params).one_or_none()
        if row is None:
            raise RunTakenAway(f"run {run_id} is no longer owned by fence {claim and claim.fence}")
        seq, at = row
        _insert_event(session, run_id, seq, type_, at, data)
        return Event(run_id=run_id, seq=seq, type=type_, at=at, data=data)

    @rides_out_outages
    def record_spend(self, claim: AnyClaim, spend: TurnSpend, event_data: dict[str, Any]) -> Event:
        """Add a model call's tokens and cost to the run, with its `ModelCallCompleted`."""
        claim = self._settle(claim)
        params = _spend_params(spend)
        with self.db.transaction() as session:
            event = self._append(
                session,
                _APPEND_SPEND,
                claim.run_id,
                claim,
                "ModelCallCompleted",
                event_data,
                params,
            )
        self.publish(event)
        return event

    @rides_out_outages
    def add_cost(self, claim: AnyClaim, amount: Decimal, data: dict[str, Any]) -> None:
        """Spend a tool reported beyond tokens, with its `UsageReported` event."""
        claim = self._settle(claim)
        params = {"p_cost_amount": amount}
        with self.db.transaction() as session:
            event = self._append(
                session, _APPEND_COST, claim.run_id, claim, "UsageReported", data, params
            )
        self.publish(event)

    @rides_out_outages
    def save_turn(self, claim: AnyClaim, messages: Sequence[dict[str, Any]], turns: int) -> None:
        """Persist the conversation after a finished turn, so the run resumes from SQL."""
        claim = self._settle(claim)
        params = {
            "p_id": claim.run_id,
            "p_fence": claim.fence,
            "p_messages": list(messages),
            "p_turns_completed": turns,
        }
        with self.db.transaction() as session:
            changed = session.execute(_SAVE_TURN, params).scalar_one_or_none()
            if changed is None:
                raise RunTakenAway(f"run {claim.run_id} was taken away")

    @rides_out_outages
    def finish(
        self,
        claim: AnyClaim,
        status: RunStatus,
        *,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
        attempts: list[dict[str, Any]] | None = None,
        spend: tuple[TurnSpend, dict[str, Any]] | None = None,
    ) -> Event | None:
        """The one fenced final write; None when the run was taken away meanwhile.

        `spend`: the last model call's spend and its `ModelCallCompleted` data, written in
        the same statement (one transaction for the answer and the end of the run)."""
        claim = self._settle(claim)
        self._ending[claim.run_id] = claim.fence
        return self._close(
            claim.run_id, RunStatus.RUNNING, claim, status, output, error, attempts, spend=spend
        )

    def _close(
        self,
        run_id: str,
        expected: RunStatus,
        claim: Claim | None,
        status: RunStatus,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
        attempts: list[dict[str, Any]] | None = None,
        extra_guard: Sequence[ColumnElement[bool]] = (),
        *,
        spend: tuple[TurnSpend, dict[str, Any]] | None = None,
    ) -> Event | None:
        statement = _CLOSE if claim is None else _CLOSE_FENCED
        if spend is not None:
            assert claim is not None, "a spend is closed by its executor"
            statement = _CLOSE_SPEND
        if extra_guard:
            statement = statement.where(*extra_guard)
        params = {
            "p_id": run_id,
            "p_expected": expected.value,
            "p_fence": claim and claim.fence,
            "p_status": status.value,
            "p_output": output,
            "p_error_type": error.type if error else None,
            "p_error_class": error.error_class.value if error else None,
            "p_error_message": error.message if error else None,
            "p_error_retry_after": error.retry_after if error else None,
            "p_model_attempts": attempts,
            **self.db.clock_params(),
            **(_spend_params(spend[0]) if spend else {}),
        }
        data: dict[str, Any] = {"status": status.value}
        if output is not None:
            data["output"] = output
        if error is not None:
            data["error"] = error.as_json()
        typed = [(TERMINAL_EVENT[status], data)]
        if spend is not None:
            typed.insert(0, ("ModelCallCompleted", spend[1]))
        in_one = None if self.db.is_sqlite or extra_guard else _CLOSE_IN_ONE[id(statement)]
        return self.publish(self._write_with_events(run_id, statement, in_one, params, typed))

    # -- liveness, cancellation, reconciliation ----------------------------------------

    def heartbeat(self, owned: dict[str, int]) -> set[str]:
        """One bulk heartbeat for the runs this process executes (run id -> fence).

        Returns the ids still owned: a run missing from the answer was closed or claimed
        by someone else, and its executor must stop. A run whose executor is making its last
        change is still its own: that change is fenced, and tells it if it is too late.

        A claim is ours in either of its two states, judged on the row itself, never on
        this process's memory of which state the claim is in: read and not made yet (the
        row still waits `Queued` with the fence read; the claim's next write makes it) or
        made (the row is `Running`, or `Queued` again, with the fence; its heartbeat is
        written). A claim only ever goes from the first state to the second, so asking for
        the first and then for the second finds every claim of ours in one of them, however
        the claim's write falls between the two; asked the other way round (or split by
        which state this process believes), a claim made in between matches neither, and a
        live executor is told its run was taken away.
        """
        # a claim that another process made first is not ours, whatever its fence number
        owned = {
            run_id: fence
            for run_id, fence in owned.items()
            if (taken := self._taken.get(run_id)) is None or taken.fence != fence
        }
        if not owned:
            return set()
        read = or_(
            *(and_(RUNS.c.id == rid, RUNS.c.fence == fence - 1) for rid, fence in owned.items())
        )
        with self.db.read() as session:
            held = set(
                session.scalars(
                    select(RUNS.c.id).where(read, RUNS.c.status == RunStatus.QUEUED.value)
                )
            )
        made = {rid: fence for rid, fence in owned.items() if rid not in held}
        if made:
            held |= self._beat(made)
        return held | {rid for rid, fence in owned.items() if self._ending.get(rid) == fence}

    def _beat(self, made: dict[str, int]) -> set[str]:
        """Write the heartbeat of claims made (run id -> fence); the ids it found."""
        still_ours = or_(
            *(and_(RUNS.c.id == rid, RUNS.c.fence == fence) for rid, fence in made.items())
        )
        statement = (
            update(RUNS)
            .where(still_ours, RUNS.c.status.in_([RunStatus.RUNNING.value, RunStatus.QUEUED.value]))
            .values(heartbeat_at=_NOW)
            .returning(RUNS.c.id)
        )
        with self.db.write() as session:
            return set(session.execute(statement, self.db.clock_params()).scalars())

    def cancel_requested(self, run_ids: Sequence[str]) -> set[str]:
        if not run_ids:
            return set()
        query = select(Run.id).where(Run.id.in_(run_ids), Run.cancel_requested_at.is_not(None))
        with self.db.read() as session:
            return set(session.scalars(query))

    def request_cancel(self, runs: Sequence[Run]) -> list[str]:
        """Persist the cancel request of every live run given (before anyone is told)."""
        now = self.db.now()
        marked: list[str] = []
        events: list[Event] = []
        with self.db.write() as session:
            for run in runs:
                changed = session.execute(
                    update(Run)
                    .where(
                        Run.id == run.id, Run.status.in_(LIVE), Run.cancel_requested_at.is_(None)
                    )
                    .values(cancel_requested_at=now)
                    .returning(Run.id)
                ).scalar_one_or_none()
                if changed is not None:
                    marked.append(run.id)
                    events.append(
                        self.append_in(session, None, "CancelRequested", {}, run_id=run.id)
                    )
        for event in events:
            self.publish(event)
        return marked

    def cancel_queued(self, run_id: str) -> bool:
        """Close a run no worker claimed yet; its message, when delivered, is dropped."""
        error = RunError("canceled", ErrorClass.CANCELLATION, "canceled before it started")
        return (
            self._close(run_id, RunStatus.QUEUED, None, RunStatus.CANCELED, error=error) is not None
        )

    @rides_out_outages
    def still_owned(self, claim: AnyClaim) -> str | None:
        """Why the claim may no longer start work (`taken_away`, `canceled`), or None: read
        right before a tool body starts, so a paused owner never starts one late."""
        claim = self._settle(claim)  # a claim not made yet is made here, or RunTakenAway
        query = select(RUNS.c.status, RUNS.c.fence, RUNS.c.cancel_requested_at).where(
            RUNS.c.id == claim.run_id
        )
        with self.db.read() as session:
            row = session.execute(query).one_or_none()
        if row is None or row.fence != claim.fence or row.status != RunStatus.RUNNING.value:
            return "taken_away"
        return "canceled" if row.cancel_requested_at is not None else None

    def wait_in(self, session: Session, claim: Claim, since: datetime, **saved: Any) -> None:
        """`Running` -> `Waiting` inside the caller's transaction: the run lets go of its
        owner and heartbeat, remembers when it started waiting, and saves `saved` (its
        conversation) for whoever continues it; `RunTakenAway` when it is no longer ours."""
        self._ending[claim.run_id] = claim.fence
        changed = session.execute(
            update(RUNS)
            .where(RUNS.c.id == claim.run_id, *_OWNED)
            .values(
                status=RunStatus.WAITING.value,
                owner=None,
                heartbeat_at=None,
                waiting_since=since,
                **saved,
            )
            .returning(RUNS.c.id),
            {"p_id": claim.run_id, "p_fence": claim.fence},
        ).scalar_one_or_none()
        if changed is None:
            raise RunTakenAway(f"run {claim.run_id} was taken away")

    @rides_out_outages
    def release(self, claim: AnyClaim, reason: str) -> bool:
        """Give a claimed run back to the queue untouched, for a worker that can run it.

        Its send time is kept, so the requeue scan re-sends it once `Runs.RequeueAfter`
        has passed since then; nothing of the run itself changed.
        """
        claim = self._settle(claim)
        with self.db.write() as session:
            event = self.append_in(session, claim, "RunReleased", {"reason": reason})
            session.execute(
                update(RUNS)
                .where(RUNS.c.id == claim.run_id, *_OWNED)
                .values(status=RunStatus.QUEUED.value, owner=None, heartbeat_at=None),
                {"p_fence": claim.fence},
            )
        self.publish(event)
        return True

    def close_waiting(self, run_id: str, error: RunError) -> bool:
        """Close a run that waits for a person; it holds no worker, so nothing else stops."""
        closed = self._close(run_id, RunStatus.WAITING, None, RunStatus.CANCELED, error=error)
        return closed is not None

    def subtree(self, run: Run) -> list[Run]:
        """The run and all its descendants, by parent links (breadth first)."""
        found, frontier = [run], [run.id]
        with self.db.read() as session:
            while frontier:
                children = list(session.scalars(select(Run).where(Run.parent_run_id.in_(frontier))))
                found += children
                frontier = [child.id for child in children]
        return found

    def orphans(self, now: datetime, threshold: timedelta, limit: int) -> list[Run]:
        """`Running` runs, and `Queued` runs that heartbeated, silent for `threshold`."""
        query = (
            select(Run)
            .where(
                Run.status.in_([RunStatus.RUNNING.value, RunStatus.QUEUED.value]),
                Run.heartbeat_at < now - threshold,
            )
            .order_by(Run.heartbeat_at)
            .limit(limit)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def close_orphan(
        self, run: Run, status: RunStatus, error: RunError, silent_since: datetime
    ) -> Event | None:
        """Close a silent run, unless it heartbeated or changed hands since it was read."""
        guard = [RUNS.c.fence == run.fence, RUNS.c.heartbeat_at < silent_since]
        return self._close(
            run.id, RunStatus(run.status), None, status, error=error, extra_guard=guard
        )

    # -- reads -------------------------------------------------------------------------

    def get(self, run_id: str, tenant_id: str | None = None) -> Run | None:
        with self.db.read() as session:
            run = session.get(Run, run_id)
        if run is None or (tenant_id is not None and run.tenant_id != tenant_id):
            return None
        return run

    def exists(self, run_id: str, tenant_id: str) -> bool:
        """Whether the tenant has this run: one indexed read, no row loaded."""
        with self.db.read_connection() as connection:
            return (
                connection.execute(_RUN_OF_TENANT, {"p_id": run_id, "p_tenant": tenant_id}).first()
                is not None
            )

    def events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]:
        """A page of the run's events after `after_seq` (Core: every live stream's read)."""
        params = {"p_id": run_id, "p_after": after_seq, "p_limit": limit}
        with self.db.read_connection() as connection:
            rows = connection.execute(_EVENTS_AFTER, params).all()
        return [Event(run_id, seq, type_, at, data) for seq, type_, at, data in rows]

    def page(
        self, tenant_id: str, filters: RunFilter, *, limit: int, before: tuple[datetime, str] | None
    ) -> list[Run]:
        """Newest first; `before` is the (created_at, id) of the last row of the prior page."""
        query = select(Run).where(Run.tenant_id == tenant_id)
        if filters.status:
            query = query.where(Run.status == filters.status)
        if filters.agent:
            query = query.where(Run.agent == filters.agent)
        if filters.session_id:
            query = query.where(Run.session_id == filters.session_id)
        if filters.kind:
            query = query.where(Run.kind == filters.kind)
        if before is not None:
            created, run_id = before
            query = query.where(
                or_(Run.created_at < created, and_(Run.created_at == created, Run.id < run_id))
            )
        query = query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
        with self.db.read() as session:
            return list(session.scalars(query))

    def tree(self, root_run_id: str, tenant_id: str) -> list[Run]:
        query = (
            select(Run)
            .where(Run.root_run_id == root_run_id, Run.tenant_id == tenant_id)
            .order_by(Run.depth, Run.created_at)
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def statistics(self, tenant_id: str, agent: str | None = None) -> RunStatistics:
        """A tenant's runs (of one agent when named) counted per status, and their runs,
        tokens and cost per model that answered, ordered by model."""
        filters = [Run.tenant_id == tenant_id]
        if agent:
            filters.append(Run.agent == agent)
        by_status = select(Run.status, func.count()).where(*filters).group_by(Run.status)
        by_model = (
            select(
                Run.model_id,
                func.count(),
                func.sum(Run.input_tokens),
                func.sum(Run.output_tokens),
                func.sum(Run.cost_amount),
            )
            .where(*filters)
            .group_by(Run.model_id)
            .order_by(Run.model_id)
        )
        with self.db.read() as session:
            statuses = {status: count for status, count in session.execute(by_status)}
            rows = session.execute(by_model).all()
        return RunStatistics(
            statuses,
            [
                ModelUsage(model, runs, int(inputs or 0), int(outputs or 0), float(cost or 0))
                for model, runs, inputs, outputs, cost in rows
            ],
        )


@dataclass(frozen=True)
class ModelUsage:
    """The runs of one model (None: runs that never got an answer) and what they used."""

    model: str | None
    runs: int
    input_tokens: int
    output_tokens: int
    cost: float


@dataclass(frozen=True)
class RunStatistics:
    by_status: dict[str, int]
    by_model: list[ModelUsage]


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
    params: dict[str, Any] = {}
    for i, e in enumerate(events):
        params.update({f"run_id_{i}": e.run_id, f"seq_{i}": e.seq, f"type_{i}": e.type})
        params.update({f"at_{i}": e.at, f"data_{i}": e.data})
    session.execute(_insert_many(len(events)), params)


_EVENT_COLUMNS = ("run_id", "seq", "type", "at", "data")


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


def _insert_event(
    session: Executes, run_id: str, seq: int, type_: str, at: datetime, data: dict[str, Any]
) -> None:
    """A Core insert: events are append-only, they never need the ORM's unit of work."""
    session.execute(
        _INSERT_EVENT, {"run_id": run_id, "seq": seq, "type": type_, "at": at, "data": data}
    )
