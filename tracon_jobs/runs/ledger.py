"""The tool-call ledger: a row committed `started` before a tool body runs, and its outcome
committed the moment it ends, each with its event in the same fenced transaction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from tracon_jobs.db.models import ToolCallRecord
from tracon_jobs.db.outages import retry_outages, rides_out_outages, transient
from tracon_jobs.runs.lifecycle import Claim
from tracon_jobs.runs.store import Event, RunStore, Tries

log = logging.getLogger(__name__)


def canonical_arguments(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def arguments_hash(arguments: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_arguments(arguments).encode()).hexdigest()


@dataclass(frozen=True)
class LedgerEntry:
    id: int
    execution_id: str
    idempotency_key: str


@dataclass(frozen=True)
class ToolOutcome:
    ok: bool
    result: Any = None
    error_code: str | None = None
    error_message: str | None = None
    attempts: int = 1

    def as_model_content(self) -> str:
        """What the model reads back as the tool's message."""
        if self.ok:
            return self.result if isinstance(self.result, str) else json.dumps(self.result)
        return json.dumps({"error": {"code": self.error_code, "message": self.error_message}})


class ApprovalUsed(Exception):
    """The approval a start consumes was used already: nothing was written, the body must
    not run."""


class Ledger:
    """The tool-call ledger of runs: what started, what it returned, and what may answer."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.db = store.db  # what `rides_out_outages` retries against

    def start(
        self,
        claim: Claim,
        turn: int,
        call_id: str,
        tool: str,
        arguments: dict[str, Any],
        idempotency_key: str | None = None,
        *,
        execution_id: str | None = None,
        consume: Callable[[Session], bool] | None = None,
    ) -> LedgerEntry:
        """A new execution; a call re-run after an unknown outcome keeps its old key.

        `consume` (an approval's one-time use) runs in the same transaction: when it says
        no, nothing is written and `ApprovalUsed` is raised, so the body never runs. Tried
        again through a database outage (`_landed_or_retried`).
        """
        execution_id = execution_id or str(uuid.uuid4())  # the same for every try
        key = idempotency_key or f"tj-{execution_id}"
        db = self.store.db

        def write() -> LedgerEntry:
            with db.write() as session:
                if consume is not None and not consume(session):
                    raise ApprovalUsed(f"the approval of {tool} was already used")
                event = self.store.append_in(
                    session,
                    claim,
                    "ToolCallStarted",
                    {"tool": tool, "callId": call_id, "turn": turn, "executionId": execution_id},
                )
                row = _record(claim, turn, call_id, tool, arguments, execution_id, key, event.at)
                session.add(row)
                session.flush()
                entry = LedgerEntry(id=row.id, execution_id=execution_id, idempotency_key=key)
            self.store.publish(event)
            return entry

        return self._landed_or_retried("start", write, claim, turn, call_id, execution_id)

    def _landed_or_retried(
        self,
        what: str,
        write: Callable[[], LedgerEntry],
        claim: Claim,
        turn: int,
        call_id: str,
        execution_id: str,
    ) -> LedgerEntry:
        """`write` (one transaction that inserts this execution's row), tried again through a
        database outage. A try that failed on the connection may have committed all the same
        (a primary that fails over as it commits: the promoted replica has the row, the
        client only the error); the next try then meets that row (or the approval it used)
        and fails. So after such a failure the row is looked for: the earlier try's, of this
        execution, stands, and is what the call goes on with."""
        lost = False

        def once() -> LedgerEntry:
            nonlocal lost
            try:
                return write()
            except DBAPIError as exc:
                lost = lost or transient(exc)
                raise

        try:
            return retry_outages(self.db, once, what)
        except (IntegrityError, ApprovalUsed):
            landed = self._row_of(claim, turn, call_id, execution_id) if lost else None
            if landed is None:
                raise
            log.warning(
                "run %s: the %s of tool call %s had committed before the database failed; "
                "it stands",
                claim.run_id,
                what,
                call_id,
            )
            return landed

    @rides_out_outages
    def _row_of(
        self, claim: Claim, turn: int, call_id: str, execution_id: str
    ) -> LedgerEntry | None:
        query = select(ToolCallRecord.id, ToolCallRecord.idempotency_key).where(
            ToolCallRecord.run_id == claim.run_id,
            ToolCallRecord.turn == turn,
            ToolCallRecord.call_id == call_id,
            ToolCallRecord.execution_id == execution_id,
        )
        with self.store.db.read() as session:
            found = session.execute(query).first()
        if found is None:
            return None
        return LedgerEntry(id=found.id, execution_id=execution_id, idempotency_key=found[1])

    def refuse(
        self,
        claim: Claim,
        turn: int,
        call_id: str,
        tool: str,
        arguments: dict[str, Any],
        outcome: ToolOutcome,
    ) -> None:
        """Record a call that was refused before it started (a spent budget); tried again
        through a database outage as `start` is."""
        execution_id = str(uuid.uuid4())  # the same for every try
        data = {
            "tool": tool,
            "callId": call_id,
            "turn": turn,
            "executionId": execution_id,
            "attempts": 0,
            "error": {"code": outcome.error_code, "message": outcome.error_message},
        }
        key = f"tj-{execution_id}"

        def write() -> LedgerEntry:
            with self.store.db.write() as session:
                event = self.store.append_in(session, claim, "ToolCallFailed", data)
                row = _record(
                    claim,
                    turn,
                    call_id,
                    tool,
                    arguments,
                    execution_id,
                    key,
                    event.at,
                    status="failed",
                    attempt=0,
                    error_code=outcome.error_code,
                    error_message=outcome.error_message,
                    ended_at=event.at,
                )
                session.add(row)
                session.flush()
                entry = LedgerEntry(id=row.id, execution_id=execution_id, idempotency_key=key)
            self.store.publish(event)
            return entry

        self._landed_or_retried("refusal", write, claim, turn, call_id, execution_id)

    def finish(self, claim: Claim, entry: LedgerEntry, tool: str, outcome: ToolOutcome) -> None:
        """The execution's outcome, on its row and as its event: written once, whatever a
        database outage does (`RunWrites.retried`)."""
        type_ = "ToolCallCompleted" if outcome.ok else "ToolCallFailed"
        data: dict[str, Any] = {"tool": tool, "executionId": entry.execution_id}
        data["attempts"] = outcome.attempts
        if not outcome.ok:
            data["error"] = {"code": outcome.error_code, "message": outcome.error_message}
        tries = Tries()

        def once() -> Event:
            with self.store.db.write() as session:
                event = self.store.append_in(session, claim, type_, data, tries=tries)
                session.execute(
                    update(ToolCallRecord)
                    .where(ToolCallRecord.id == entry.id)
                    .values(
                        status="succeeded" if outcome.ok else "failed",
                        result={"value": outcome.result} if outcome.ok else None,
                        error_code=outcome.error_code,
                        error_message=outcome.error_message,
                        attempt=outcome.attempts,
                        ended_at=event.at,
                    )
                )
            self.store.publish(event)
            return event

        self.store.retried("the end of a tool call", once, tries)

    def calls(self, run_id: str) -> list[ToolCallRecord]:
        """The run's ledger rows, in the order they were recorded (by id)."""
        query = (
            select(ToolCallRecord)
            .where(ToolCallRecord.run_id == run_id)
            .order_by(ToolCallRecord.id)
        )
        with self.store.db.read() as session:
            return list(session.scalars(query).all())

    @rides_out_outages
    def next_turn(self, run_id: str) -> int:
        """The first ledger turn number free for a new execution of this run."""
        query = select(func.max(ToolCallRecord.turn)).where(ToolCallRecord.run_id == run_id)
        with self.store.db.read() as session:
            last = session.execute(query).scalar_one_or_none()
        return 0 if last is None else last + 1

    @rides_out_outages
    def completed(
        self,
        run_id: str,
        tool: str,
        args_hash: str,
        *,
        turns: tuple[int, int],
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[str, ToolOutcome] | None:
        """The first succeeded execution of exactly this call (tool, canonical arguments)
        with a ledger turn in `[start, end)`, other than the executions in `exclude`."""
        query = (
            select(ToolCallRecord)
            .where(
                ToolCallRecord.run_id == run_id,
                ToolCallRecord.tool == tool,
                ToolCallRecord.args_hash == args_hash,
                ToolCallRecord.status == "succeeded",
                ToolCallRecord.turn >= turns[0],
                ToolCallRecord.turn < turns[1],
                ToolCallRecord.execution_id.not_in(exclude),
            )
            .order_by(ToolCallRecord.id)
            .limit(1)
        )
        with self.store.db.read() as session:
            row = session.scalars(query).first()
        if row is None:
            return None
        result = (row.result or {}).get("value")
        return row.execution_id, ToolOutcome(ok=True, result=result, attempts=row.attempt)


def _record(
    claim: Claim,
    turn: int,
    call_id: str,
    tool: str,
    arguments: dict[str, Any],
    execution_id: str,
    key: str,
    at: Any,
    **outcome: Any,
) -> ToolCallRecord:
    """A ledger row: `started` unless `outcome` says how it already ended."""
    fields: dict[str, Any] = {"status": "started", "attempt": 1, **outcome}
    return ToolCallRecord(
        run_id=claim.run_id,
        turn=turn,
        call_id=call_id,
        tool=tool,
        args_hash=arguments_hash(arguments),
        arguments=arguments,
        execution_id=execution_id,
        idempotency_key=key,
        started_at=at,
        **fields,
    )
