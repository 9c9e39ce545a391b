"""The run store's writes: creating and enqueueing runs, and the executor's fenced writes, with
the claim that the first of them makes; and the webhook messages their events cause, written
in the same transaction (`Outbox`)."""

from __future__ import annotations

import functools
import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import (
    and_,
    insert,
    or_,
    select,
)
from sqlalchemy.sql.dml import Insert, Update
from sqlalchemy.sql.elements import ColumnElement

from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run
from tracon_jobs.db.outages import retry_outages, rides_out_outages
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
    EVENTS,
    RUNS,
    Executes,
    _append_in_one,
    _detached_run,
    _insert_event,
    _insert_events,
    _new_row,
    _numbered,
    _spend_params,
    _with_events,
    message_insert,
)
from tracon_jobs.runs.store.values import (
    Event,
    NewRun,
    TurnSpend,
)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

Typed = Sequence[tuple[str, dict[str, Any]]]
"""The events of one write, as (type, data), before they are numbered."""


@dataclass(frozen=True)
class Message:
    """A webhook message that run events cause (`Outbox.messages`), as the run store writes it
    into `webhook_messages`, in the events' transaction: its tenant is read from the run row by
    the insert itself, its time is the events'.

    `gated`: written only when the run's tenant has an enabled endpoint that subscribes to
    `type` (no one else wants it). `dedupe_key`: a message written once however often it is
    caused (`quota.exceeded`, once a tenant's quota window)."""

    id: str
    type: str
    subject_id: str
    data: dict[str, Any]
    gated: bool = True
    dedupe_key: str | None = None


class Outbox(Protocol):
    """Which webhook messages run events cause, and what follows their commit
    (`tracon_jobs.webhooks.outbox`)."""

    def messages(self, run_id: str, events: Typed) -> list[Message]:
        """The messages `events` of run `run_id` cause: none, at no cost, when nobody
        listens. Asked before the events' transaction begins where the store owns it."""
        ...

    def committed(self, messages: Sequence[Message], wrote: bool) -> None:
        """`messages` are in SQL now, their transaction committed; `wrote`: that transaction
        wrote some of them (the others, once-only ones, were written before): wake the
        deliverers."""
        ...


def _shape(message: Message) -> tuple[bool, bool]:
    """How its insert is built (`statements.MessageShape`)."""
    return message.gated, message.dedupe_key is not None


def _message_params(prefix: str, message: Message) -> dict[str, Any]:
    """A message's bind parameters, named `<prefix><column>`."""
    return {
        f"{prefix}id": message.id,
        f"{prefix}type": message.type,
        f"{prefix}subject_id": message.subject_id,
        f"{prefix}data": message.data,
        f"{prefix}dedupe_key": message.dedupe_key,
    }


AFTER_COMMIT_KEPT = 1024
"""Messages written in transactions whose events were never published (they rolled back)
are forgotten beyond this many, oldest first."""


@dataclass
class Tries:
    """The events the tries of one write got back from SQL before committing. A try that then
    failed on the connection may have committed all the same; `RunWrites.landed` looks its
    event up by these, so that the write is not made twice (an event twice, a spend counted
    twice)."""

    tried: list[list[Event]] = field(default_factory=list)  # each try's events, in order

    def begin(self) -> None:
        """A new try."""
        self.tried.append([])

    def wrote(self, event: Event) -> None:
        """An event of the current try, numbered, not committed yet."""
        if not self.tried:
            self.begin()
        self.tried[-1].append(event)


def events_written_once(method: F) -> F:
    """For a method of a store whose `runs` is the `RunWrites` it writes a run's events
    through (`runs.append_in`, in one transaction, published after it) and that returns None:
    tried again through a database outage as `rides_out_outages` does, except that a try whose
    commit landed though its caller saw it fail is not made again (its events and its rows
    once: `RunWrites.retried`)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        runs: RunWrites = self.runs
        tries = Tries()

        def once() -> None:
            with runs.recording(tries):
                method(self, *args, **kwargs)

        runs.retried(method.__name__, once, tries)

    return cast(F, wrapper)


def _as_stored(data: dict[str, Any]) -> Any:
    """`data` as a JSON column gives it back."""
    return json.loads(json.dumps(data))


class RunWrites:
    """A run's life from its `Queued` row to its final write; every write of an executor is
    guarded by the claim's fence (the claim read, then made by the first write)."""

    def __init__(
        self, db: Database, feed: EventFeed | None = None, outbox: Outbox | None = None
    ) -> None:
        self.db = db
        self.feed = feed
        self.outbox = outbox
        self._recording = threading.local()  # `.tries`: where this thread's events go
        # (run id, seq) of an event written with messages -> those messages (and whether
        # each was new), told to the outbox when the event is published, after its commit;
        # one entry a transaction
        self._after_commit: dict[tuple[str, int], list[tuple[Message, bool]]] = {}
        self._marked: weakref.WeakKeyDictionary[Executes, tuple[str, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._marking = threading.Lock()
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
        """Tell the followers of a committed event, and the outbox of the messages its
        transaction wrote."""
        if event is not None and self.feed is not None:
            self.feed.publish(event.run_id, event.seq)
        if event is not None:
            self._committed(event)
        return event

    def publish_all(self, events: Sequence[Event]) -> None:
        """`publish` of the events one transaction committed, their notifications in one
        round trip."""
        if self.feed is not None:
            self.feed.publish_all([(event.run_id, event.seq) for event in events])
        for event in events:
            self._committed(event)

    def _committed(self, event: Event) -> None:
        if self._after_commit:
            written = self._after_commit.pop((event.run_id, event.seq), None)
            if written and self.outbox is not None:
                self.outbox.committed([m for m, _ in written], any(new for _, new in written))

    # -- the webhook messages of events --------------------------------------------------

    def _messages(self, run_id: str, typed: Typed) -> list[Message]:
        return [] if self.outbox is None else self.outbox.messages(run_id, typed)

    def _write_messages(
        self, session: Executes, events: Sequence[Event], messages: Sequence[Message]
    ) -> None:
        """Insert `messages` (of `events`) in the events' transaction, each with its tenant
        read from the run row; those written wait for the publication of `events[-1]`."""
        found = [(m, self._insert_message(session, events[-1], m)) for m in messages]
        written = [(m, id_ == m.id) for m, id_ in found if id_ is not None]
        if written:
            self._after(session, (events[-1].run_id, events[-1].seq), written)

    def _insert_message(self, session: Executes, event: Event, message: Message) -> str | None:
        """The id of the message in the outbox now: its own (written here), or that of the
        one written first with its `dedupe_key`; None when its gate stopped it."""
        statement = message_insert(
            of_run=True,
            gated=message.gated,
            once=message.dedupe_key is not None,
            on_sqlite=self.db.is_sqlite,
        )
        params = {
            **_message_params("p_", message),
            "p_source_id": event.run_id,
            "p_created_at": event.at,
        }
        row = session.execute(statement, params).first()
        return None if row is None else str(row[0])

    def _after(
        self, session: Executes, key: tuple[str, int], written: list[tuple[Message, bool]]
    ) -> None:
        """Keep `written` for the publication of the event `key` after the commit: a
        transaction's messages gather under its first such event, so its commit wakes the
        deliverers once however many it wrote."""
        with self._marking:
            first = self._marked.get(session)
            if first is not None and first in self._after_commit:
                self._after_commit[first].extend(written)
                return
            self._marked[session] = key
            self._after_commit[key] = written  # over an entry of a transaction rolled back
            while len(self._after_commit) > AFTER_COMMIT_KEPT:
                del self._after_commit[next(iter(self._after_commit))]

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

    def create_many_in(
        self, session: Executes, news: Sequence[NewRun], now: datetime
    ) -> list[tuple[Run, Event]]:
        """`create_in` of several runs in one insert, at `now` (the transaction's time: what
        each one's own statement would record), without their events: the caller inserts
        the `RunQueued` events given back, with its own, and publishes them."""
        rows = [_new_row(new) | {"created_at": now, "enqueued_at": now} for new in news]
        session.execute(insert(RUNS), rows)
        return [
            (_detached_run(row), Event(new.id, 1, "RunQueued", now, {"agent": new.agent}))
            for new, row in zip(news, rows, strict=True)
        ]

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

    def _make_claim(
        self,
        claim: PendingClaim,
        second: tuple[str, dict[str, Any]] | None,
        tries: Tries | None = None,
    ) -> Event:
        """The claim, `RunStarted` and `second`, committed and published at once (recorded
        in `tries` before it is published: `second` is the write of a caller of `retried`).

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
        ) or self._already_written(claim.run_id, claim.fence, claim.owner, typed[-1])
        del self._pending[claim.run_id]
        if event is None:
            self._taken[claim.run_id] = claim
            raise ClaimedElsewhere(f"run {claim.run_id} was claimed by another process")
        if tries is not None:
            tries.wrote(event)
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
        autocommit, the webhook messages the events cause included; else one transaction of
        the update, a multi-row insert and the messages' inserts."""
        messages = self._messages(run_id, typed)
        if in_one is not None:
            return self._write_in_one(run_id, guarded, in_one, params, typed, messages)
        with self.db.transaction() as session:
            row = session.execute(guarded, params).one_or_none()
            if row is None:
                return None
            events = self._insert_numbered(session, run_id, row, typed, messages)
        return events[-1]

    def _insert_numbered(
        self,
        session: Executes,
        run_id: str,
        last: Sequence[Any],
        typed: Typed,
        messages: Sequence[Message],
    ) -> list[Event]:
        """The events `typed`, numbered up to the seq and at the time of `last` (the guarded
        update's row), inserted with the webhook messages they cause."""
        events = _numbered(run_id, last[0], last[1], typed)
        _insert_events(session, events)
        if messages:
            self._write_messages(session, events, messages)
        return events

    def _write_in_one(
        self,
        run_id: str,
        guarded: Update,
        in_one: Insert,
        params: dict[str, Any],
        typed: Typed,
        messages: Sequence[Message],
    ) -> Event | None:
        """`_write_with_events` on PostgreSQL: the update, the events and their messages in
        one statement (`_with_events`), committed as it runs."""
        for i, (type_, data) in enumerate(typed):
            params.update({f"p_type_{i}": type_, f"p_data_{i}": data})
        if messages:
            in_one = _with_events(guarded, len(typed), tuple(_shape(m) for m in messages))
            for j, message in enumerate(messages):
                params.update(_message_params(f"p_m{j}_", message))
        with self.db.autocommit() as connection:
            rows = connection.execute(in_one, params).all()
            if not rows:
                return None
            last = max(rows, key=lambda row: int(row[0]))
            event = _numbered(run_id, last[0], last[1], typed)[-1]
            found = zip(messages, last[2:], strict=True)
            written = [(m, id_ == m.id) for m, id_ in found if id_ is not None]
            if written:
                self._after(connection, (run_id, event.seq), written)
        return event

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
        tries = Tries()

        def once() -> Event:
            if isinstance(claim, PendingClaim) and self._is_pending(claim):
                return self._make_claim(claim, (type_, data), tries)
            made = None if claim is None else self._settle(claim)
            with self.db.transaction() as session:
                event = self.append_in(session, made, type_, data, run_id=run_id, tries=tries)
            self.publish(event)
            return event

        event: Event = self.retried("append", once, tries)
        return event

    def append_all(self, claim: AnyClaim, events: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Append several fenced events at once: one seq update, one multi-row insert and
        one wake-up of the followers, however many events."""
        if not events:
            return
        tries = Tries()

        def once() -> Event:
            made = self._settle(claim)
            params = {"p_id": made.run_id, "p_fence": made.fence, "p_count": len(events)}
            messages = self._messages(made.run_id, events)
            with self.db.transaction() as session:
                row = session.execute(
                    _APPEND_MANY_FENCED, {**params, **self.db.clock_params()}
                ).one_or_none()
                if row is None:
                    raise RunTakenAway(
                        f"run {made.run_id} is no longer owned by fence {made.fence}"
                    )
                rows = self._insert_numbered(session, made.run_id, row, events, messages)
                tries.wrote(rows[-1])  # one transaction: its last event stands for all
            self.publish(rows[-1])
            return rows[-1]

        self.retried("append_all", once, tries)

    def retried(self, what: str, once: Callable[[], Any], tries: Tries) -> Any:
        """`once()` (one transaction that appends events and records them in `tries` before
        it commits), tried again through a database outage; after a try lost on the
        connection, the newest event of the try whose commit landed all the same is the
        outcome (its events published now: its try failed before it could)."""

        def attempt() -> Any:
            tries.begin()
            return once()

        def found() -> Event | None:
            events = self.landed(tries)
            for event in events:
                self.publish(event)
            return events[-1] if events else None

        return retry_outages(self.db, attempt, what, found)

    @contextmanager
    def recording(self, tries: Tries) -> Iterator[None]:
        """Every event this thread appends meanwhile is recorded in `tries`."""
        outer = getattr(self._recording, "tries", None)
        self._recording.tries = tries
        try:
            yield
        finally:
            self._recording.tries = outer

    def _already_written(
        self, run_id: str, fence: int, owner: str, last: tuple[str, dict[str, Any]]
    ) -> Event | None:
        """The run's newest event, when it is `last` and the run is still this claim's (its
        fence and owner): a guarded write that matched no row finds there what an earlier try
        of its own wrote, committed though its caller saw it fail (a claim, a final write: one
        statement, whose seq the caller never saw)."""
        query = (
            select(EVENTS.c.seq, EVENTS.c.at, EVENTS.c.type, EVENTS.c.data)
            .join(RUNS, RUNS.c.id == EVENTS.c.run_id)
            .where(
                RUNS.c.id == run_id,
                RUNS.c.fence == fence,
                RUNS.c.owner == owner,
                EVENTS.c.seq == RUNS.c.event_seq,
            )
        )
        with self.db.read() as session:
            row = session.execute(query).first()
        if row is None or (row[2], row[3]) != (last[0], _as_stored(last[1])):
            return None
        log.warning("run %s: a write had committed before the database failed; it stands", run_id)
        return Event(run_id=run_id, seq=row[0], type=row[2], at=row[1], data=last[1])

    def landed(self, tries: Tries) -> list[Event]:
        """The events of the newest try whose last event is in SQL as the try wrote it (its
        seq, type and data): that try committed though its caller saw it fail. Empty when
        none did."""
        for events in reversed(tries.tried):
            if not events:
                continue
            event = events[-1]
            query = select(EVENTS.c.type, EVENTS.c.data).where(
                EVENTS.c.run_id == event.run_id, EVENTS.c.seq == event.seq
            )
            with self.db.read() as session:
                row = session.execute(query).first()
            if row is not None and (row[0], row[1]) == (event.type, _as_stored(event.data)):
                return events
        return []

    def append_in(
        self,
        session: Executes,
        claim: Claim | None,
        type_: str,
        data: dict[str, Any],
        *,
        run_id: str | None = None,
        tries: Tries | None = None,
    ) -> Event:
        """Append one event inside `session`; guarded by the fence when a claim is given.
        `tries`: the write's record of what its tries wrote (`retried`)."""
        if claim is None:
            assert run_id is not None
            return self._append(session, _APPEND, run_id, None, type_, data, {}, tries)
        return self._append(session, _APPEND_FENCED, claim.run_id, claim, type_, data, {}, tries)

    def _append(
        self,
        session: Executes,
        statement: Update,
        run_id: str,
        claim: Claim | None,
        type_: str,
        data: dict[str, Any],
        params: dict[str, Any],
        tries: Tries | None = None,
    ) -> Event:
        """Run `statement` (a `_next_seq` with more SET values maybe), then insert the event
        and the webhook messages it causes; recorded in `tries` before the commit."""
        params.update(self.db.clock_params(), p_id=run_id)
        if claim is not None:
            params["p_fence"] = claim.fence
        if self.db.is_sqlite:
            row = session.execute(statement, params).one_or_none()
            if row is not None:
                _insert_event(session, run_id, row[0], type_, row[1], data)
        else:  # the seq and the event in one round trip
            event_params = {**params, "type": type_, "data": data}
            row = session.execute(_append_in_one(statement), event_params).one_or_none()
        if row is None:
            raise RunTakenAway(f"run {run_id} is no longer owned by fence {claim and claim.fence}")
        seq, at = row
        event = Event(run_id=run_id, seq=seq, type=type_, at=at, data=data)
        tries = tries or getattr(self._recording, "tries", None)
        if tries is not None:
            tries.wrote(event)
        messages = self._messages(run_id, ((type_, data),))
        if messages:
            self._write_messages(session, (event,), messages)
        return event

    def record_spend(self, claim: AnyClaim, spend: TurnSpend, event_data: dict[str, Any]) -> Event:
        """Add a model call's tokens and cost to the run, with its `ModelCallCompleted`
        (counted once, whatever a database outage does: `retried`)."""
        tries = Tries()

        def once() -> Event:
            made = self._settle(claim)
            params = _spend_params(spend)
            with self.db.transaction() as session:
                event = self._append(
                    session,
                    _APPEND_SPEND,
                    made.run_id,
                    made,
                    "ModelCallCompleted",
                    event_data,
                    params,
                    tries,
                )
            self.publish(event)
            return event

        return self.retried("record_spend", once, tries)

    def add_cost(self, claim: AnyClaim, amount: Decimal, data: dict[str, Any]) -> None:
        """Spend a tool reported beyond tokens, with its `UsageReported` event (counted once,
        as `record_spend`)."""
        tries = Tries()

        def once() -> Event:
            made = self._settle(claim)
            params = {"p_cost_amount": amount}
            with self.db.transaction() as session:
                event = self._append(
                    session, _APPEND_COST, made.run_id, made, "UsageReported", data, params, tries
                )
            self.publish(event)
            return event

        self.retried("add_cost", once, tries)

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
        before: Sequence[tuple[str, dict[str, Any]]] = (),
    ) -> Event | None:
        """The final write; `before`: events written ahead of the terminal one, in it."""
        statement = _CLOSE if claim is None else _CLOSE_FENCED
        if spend is not None:
            assert claim is not None and not before, "a spend is closed by its executor"
            statement = _CLOSE_SPEND
        if before:
            statement = statement.values(event_seq=RUNS.c.event_seq + len(before) + 1)
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
        typed = [*before, (TERMINAL_EVENT[status], data)]
        if spend is not None:
            typed.insert(0, ("ModelCallCompleted", spend[1]))
        made_here = bool(extra_guard or before)  # a statement of its own: none in one
        in_one = None if self.db.is_sqlite or made_here else _CLOSE_IN_ONE[id(statement)]
        event = self._write_with_events(run_id, statement, in_one, params, typed)
        if event is None and claim is not None:
            event = self._already_written(run_id, claim.fence, claim.owner, typed[-1])
        return self.publish(event)
