"""The run store's writes: creating and enqueueing runs, and the executor's fenced writes, with
the claim that the first of them makes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    and_,
    or_,
    select,
)
from sqlalchemy.sql.dml import Insert, Update
from sqlalchemy.sql.elements import ColumnElement

from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run
from tracon_jobs.db.outages import rides_out_outages
from tracon_jobs.errors import ClaimedElsewhere, RunTakenAway
from tracon_jobs.limits.tenant_quotas import OwnQuota
from tracon_jobs.runs.lifecycle import (
    TERMINAL_EVENT,
    AnyClaim,
    Claim,
    PendingClaim,
    RunError,
    RunStatus,
)
from tracon_jobs.runs.store.statements import (
    _APPEND,
    _APPEND_COST,
    _APPEND_FENCED,
    _APPEND_MANY_FENCED,
    _APPEND_SPEND,
    _CLOSE,
    _CLOSE_FENCED,
    _CLOSE_IN_ONE,
    _CLOSE_SPEND,
    _CREATE,
    _CREATE_QUEUED,
    _MAKE_CLAIM,
    _MAKE_CLAIM_IN_ONE,
    _MARK_ENQUEUED,
    _READ_CLAIMABLE,
    _SAVE_TURN,
    Executes,
    _detached_run,
    _insert_event,
    _insert_events,
    _new_row,
    _numbered,
    _spend_params,
)
from tracon_jobs.runs.store.values import (
    Event,
    NewRun,
    TurnSpend,
)


class RunWrites:
    """A run's life from its `Queued` row to its final write; every write of an executor is
    guarded by the claim's fence (the claim read, then made by the first write)."""

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
            values.pop("own_max_runs"),
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
