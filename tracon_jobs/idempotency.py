"""The SQL store behind HTTP `Idempotency-Key`: one record per (tenant, key).

    reserve ──insert──> InProgress ──complete(2xx)──> Completed (replayed from then on)
                            └──release (non-2xx, exception, operator)──> gone

The reservation is a single INSERT guarded by the unique (tenant_id, key), so two
requests with the same key can never both execute, whichever process or host they reach.
A request that finds the key taken learns, in this order, that its fingerprint differs
(`mismatch`, 422), that the first is still going (`in_progress`, 409), or gets the stored
response (`replay`). A crash between reservation and completion leaves an `InProgress`
record: only an operator (or retention) removes it, because nobody can tell whether the
side effect happened.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy import ColumnElement, delete, select, update
from sqlalchemy.exc import IntegrityError

from tracon_jobs.db import Database
from tracon_jobs.db.models import IdempotencyRecord

RESERVE_ATTEMPTS = 3


class RecordState(StrEnum):
    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"


class Outcome(StrEnum):
    RESERVED = "reserved"
    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class StoredResponse:
    """What a replay sends back: exactly what the first request answered."""

    status: int
    body: bytes
    content_type: str | None = None
    location: str | None = None
    preference_applied: str | None = None
    run_id: str | None = None


@dataclass(frozen=True)
class Reservation:
    outcome: Outcome
    stored: StoredResponse | None = None


@dataclass(frozen=True)
class RecordSummary:
    """One record as the operator sees it."""

    tenant_id: str
    key: str
    method: str
    path: str
    state: str
    run_id: str | None
    created_at: datetime
    completed_at: datetime | None


def fingerprint(method: str, path: str, body: bytes) -> str:
    """The request's identity under its key: raw bytes, so reordered JSON is a new request."""
    digest = hashlib.sha256()
    digest.update(f"{method.upper()}\n{path}\n".encode())
    digest.update(body)
    return digest.hexdigest()


class IdempotencyStore:
    """The SQL records behind `Idempotency-Key`: reserve once, store the 2xx, replay it."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def reserve(self, tenant_id: str, key: str, method: str, path: str, body: bytes) -> Reservation:
        """Take the key, or say why not (422 before 409, as the contract orders them)."""
        print_ = fingerprint(method, path, body)
        for _ in range(RESERVE_ATTEMPTS):
            if self._insert(tenant_id, key, method, path, print_):
                return Reservation(Outcome.RESERVED)
            existing = self._find(tenant_id, key)
            if existing is not None:
                return _verdict(existing, print_)
            # released between our insert and our read: try to take it again
        return Reservation(Outcome.IN_PROGRESS)

    def attach_run(self, tenant_id: str, key: str, run_id: str) -> None:
        """Name the run while it is in progress, so an operator can look at it after a crash."""
        with self.db.write() as session:
            session.execute(
                update(IdempotencyRecord).where(*_in_progress(tenant_id, key)).values(run_id=run_id)
            )

    def complete(self, tenant_id: str, key: str, response: StoredResponse) -> bool:
        """Store the 2xx; False when the reservation was released meanwhile."""
        with self.db.write() as session:
            changed = session.execute(
                update(IdempotencyRecord)
                .where(*_in_progress(tenant_id, key))
                .values(
                    state=RecordState.COMPLETED.value,
                    response_status=response.status,
                    response_body=response.body,
                    content_type=response.content_type,
                    location=response.location,
                    preference_applied=response.preference_applied,
                    run_id=response.run_id,
                    completed_at=self.db.now(),
                )
                .returning(IdempotencyRecord.id)
            ).scalar_one_or_none()
        return changed is not None

    def release(self, tenant_id: str, key: str) -> bool:
        """Delete an `InProgress` reservation so that a retry executes; a stored 2xx stays."""
        with self.db.write() as session:
            gone = session.execute(
                delete(IdempotencyRecord)
                .where(*_in_progress(tenant_id, key))
                .returning(IdempotencyRecord.id)
            ).scalar_one_or_none()
        return gone is not None

    def list_in_progress(
        self, tenant_id: str | None = None, limit: int = 100
    ) -> list[RecordSummary]:
        query = select(IdempotencyRecord).where(
            IdempotencyRecord.state == RecordState.IN_PROGRESS.value
        )
        if tenant_id is not None:
            query = query.where(IdempotencyRecord.tenant_id == tenant_id)
        query = query.order_by(IdempotencyRecord.created_at, IdempotencyRecord.id).limit(limit)
        with self.db.read() as session:
            return [_summary(row) for row in session.scalars(query)]

    def purge(self, older_than: timedelta, now: datetime) -> int:
        """Delete records (in any state) created before `now - older_than`; how many."""
        with self.db.write() as session:
            ids = session.execute(
                delete(IdempotencyRecord)
                .where(IdempotencyRecord.created_at < now - older_than)
                .returning(IdempotencyRecord.id)
            ).all()
        return len(ids)

    def _insert(self, tenant_id: str, key: str, method: str, path: str, print_: str) -> bool:
        record = IdempotencyRecord(
            tenant_id=tenant_id,
            key=key,
            method=method.upper(),
            path=path,
            fingerprint=print_,
            state=RecordState.IN_PROGRESS.value,
            created_at=self.db.now(),
        )
        try:
            with self.db.write() as session:
                session.add(record)
        except IntegrityError:
            return False
        return True

    def _find(self, tenant_id: str, key: str) -> IdempotencyRecord | None:
        query = select(IdempotencyRecord).where(
            IdempotencyRecord.tenant_id == tenant_id, IdempotencyRecord.key == key
        )
        with self.db.read() as session:
            return session.scalars(query).first()


def _in_progress(tenant_id: str, key: str) -> tuple[ColumnElement[bool], ...]:
    return (
        IdempotencyRecord.tenant_id == tenant_id,
        IdempotencyRecord.key == key,
        IdempotencyRecord.state == RecordState.IN_PROGRESS.value,
    )


def _verdict(existing: IdempotencyRecord, print_: str) -> Reservation:
    if existing.fingerprint != print_:
        return Reservation(Outcome.MISMATCH)
    if existing.state != RecordState.COMPLETED.value:
        return Reservation(Outcome.IN_PROGRESS)
    stored = StoredResponse(
        status=existing.response_status or 200,
        body=bytes(existing.response_body or b""),
        content_type=existing.content_type,
        location=existing.location,
        preference_applied=existing.preference_applied,
        run_id=existing.run_id,
    )
    return Reservation(Outcome.REPLAY, stored)


def _summary(row: IdempotencyRecord) -> RecordSummary:
    return RecordSummary(
        tenant_id=row.tenant_id,
        key=row.key,
        method=row.method,
        path=row.path,
        state=row.state,
        run_id=row.run_id,
        created_at=row.created_at,
        completed_at=row.completed_at,
    )


@dataclass(frozen=True)
class PurgeResult:
    enabled: bool
    deleted: int = 0


def purge_past_retention(
    store: IdempotencyStore, retention: timedelta | None, now: datetime
) -> PurgeResult:
    """One retention pass: delete records older than `Retention.Idempotency`, when it is on.

    A record that outlived the retention is no longer a promise anyone relies on: a client
    retrying a day later is making a new request. Both states go: an `InProgress` record
    that old is a crash nobody resolved, and keeping it would block that key forever.
    """
    if retention is None:
        return PurgeResult(enabled=False)
    return PurgeResult(enabled=True, deleted=store.purge(retention, now))
