"""Continue an orphaned run in the same session, or say exactly why it is not continued.

A continuation is a new run (`continuedFromRunId`) with the interrupted turn's input and
parameters. Its executor answers every tool call the chain already completed from the
ledger; only calls with no recorded result run. Whether a call whose outcome is unknown
(ledger `started`, no outcome) may run again is a property of its tool: `none`/`read`
may, a write-like tool only when registered `safe_to_repeat=True`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from tracon_jobs.agents.tools import WRITE_LIKE, ToolRegistry
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, ToolCallRecord
from tracon_jobs.db.outages import retry_outages
from tracon_jobs.runs.budget import MAX_CHAIN, ChainUnreadable
from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.ledger import ToolOutcome
from tracon_jobs.runs.store import NewRun, RunStore
from tracon_jobs.settings import Settings

log = logging.getLogger(__name__)

CallKey = tuple[str, str]  # (tool, canonical arguments hash)


@dataclass(frozen=True)
class Blocked:
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)


class Continuations:
    """Decides whether an orphan is continued, and starts its continuation."""

    def __init__(
        self,
        settings: Settings,
        runs: RunStore,
        db: Database,
        tools: ToolRegistry,
        dispatcher: RunDispatcher,
    ) -> None:
        self.settings = settings
        self.runs = runs
        self.db = db
        self.tools = tools
        self.dispatcher = dispatcher

    def continue_orphan(self, run: Run) -> str | None:
        """Start the continuation of an orphan just closed, or record why not."""
        settings = self.settings
        if not (settings.run_continuation.enabled and settings.run_reconciliation.enabled):
            return None
        if run.status != "Running":  # only a run that was executing is continued
            return None
        blocked = self.why_blocked(run)
        if blocked is not None:
            log.warning("run %s not continued: %s", run.id, blocked.reason)
            data = {"reason": blocked.reason, **blocked.detail}
            self.runs.append(None, "RunContinuationBlocked", data, run_id=run.id)
            return None
        continuation = self.dispatcher.submit(
            NewRun(
                tenant_id=run.tenant_id,
                agent=run.agent,
                input=run.input,
                session_id=run.session_id,
                parameters=run.parameters,
                continued_from_run_id=run.id,
                attempt=run.attempt + 1,
                currency=run.cost_currency,
            )
        )
        data = {"continuationRunId": continuation.id}
        self.runs.append(None, "RunContinued", data, run_id=run.id)
        return continuation.id

    def why_blocked(self, run: Run) -> Blocked | None:
        checks = (
            self._not_a_root_agent_run,
            self._no_session,
            self._chain_exhausted,
            self._unsafe_call_in_flight,
        )
        for check in checks:
            blocked = check(run)
            if blocked is not None:
                return blocked
        return None

    def _not_a_root_agent_run(self, run: Run) -> Blocked | None:
        if run.kind == "workflow":
            return Blocked(
                f"a workflow run is resumed from its checkpoints: "
                f"POST /api/workflows/runs/{run.id}/resume"
            )
        if run.parent_run_id is not None:
            return Blocked(
                f"a sub-run is not continued on its own; the root of its tree "
                f"({run.root_run_id}) is continued or resumed"
            )
        agent = self.settings.agents.get(run.agent)
        if agent is None:
            return Blocked(f"agent '{run.agent}' is no longer configured")
        if agent.parameters and run.parameters is None:
            return Blocked("the agent declares parameters and the run recorded none")
        return None

    def _no_session(self, run: Run) -> Blocked | None:
        return None if run.session_id else Blocked("the run has no session")

    def _chain_exhausted(self, run: Run) -> Blocked | None:
        limit = self.settings.run_continuation.max_attempts
        if run.attempt - 1 >= limit:
            return Blocked(f"the chain reached RunContinuation.MaxAttempts ({limit})")
        return None

    def _unsafe_call_in_flight(self, run: Run) -> Blocked | None:
        for row in ledger_rows(self.db, [run.id]):
            if row.status != "started":
                continue
            spec = self.tools.get(row.tool)
            effect = spec.side_effect if spec else "unknown"
            if spec is None or (effect in WRITE_LIKE and not spec.safe_to_repeat):
                return Blocked(
                    f"tool '{row.tool}' ({effect}) was in flight when the process died and its "
                    "outcome is unknown; register it safe_to_repeat=True if repeating it is safe",
                    {"tool": row.tool, "sideEffect": effect, "executionId": row.execution_id},
                )
        return None


# -- what a continuation's executor reads ---------------------------------------------------


@dataclass
class ChainLedger:
    """The recorded outcomes of the runs a continuation continues, consumed in order."""

    recorded: dict[CallKey, deque[tuple[str, ToolOutcome]]] = field(default_factory=dict)
    in_flight: dict[CallKey, deque[str]] = field(default_factory=dict)  # idempotency keys
    run_ids: list[str] = field(default_factory=list)  # the runs continued, newest first

    def has(self, key: CallKey) -> bool:
        """Whether `answer(key)` would answer, without using the answer up."""
        return bool(self.recorded.get(key))

    def unrepeated(self, calls: set[CallKey]) -> list[CallKey]:
        """In-flight calls of the chain that `calls` (the turn after every recorded call was
        answered) does not repeat: the reliability guide stops the continuation for them."""
        if any(self.recorded.values()):
            return []  # the replay has not reached the turn the chain stopped in yet
        return [key for key, keys in self.in_flight.items() if keys and key not in calls]

    def answer(self, key: CallKey) -> tuple[str, ToolOutcome] | None:
        queue = self.recorded.get(key)
        return queue.popleft() if queue else None

    def key_for(self, key: CallKey) -> str | None:
        queue = self.in_flight.get(key)
        return queue.popleft() if queue else None


def chain_ledger(db: Database, run: Run) -> ChainLedger:
    ledger = ChainLedger()
    if run.continued_from_run_id is None:
        return ledger
    first = run.continued_from_run_id
    ledger.run_ids = retry_outages(db, lambda: _chain(db, first), "reading a chain")
    rows = retry_outages(db, lambda: ledger_rows(db, ledger.run_ids), "reading a chain's ledger")
    for row in rows:
        key = (row.tool, row.args_hash)
        if row.status == "started":
            ledger.in_flight.setdefault(key, deque()).append(row.idempotency_key)
            continue
        outcome = ToolOutcome(
            ok=row.status == "succeeded",
            result=(row.result or {}).get("value"),
            error_code=row.error_code,
            error_message=row.error_message,
            attempts=row.attempt,
        )
        ledger.recorded.setdefault(key, deque()).append((row.execution_id, outcome))
    return ledger


def _chain(db: Database, first: str) -> list[str]:
    """The interrupted run and the runs it continued, newest first (bounded)."""
    ids: list[str] = []
    current: str | None = first
    with db.read() as session:
        while current is not None and len(ids) < MAX_CHAIN:
            ids.append(current)
            current = session.scalar(select(Run.continued_from_run_id).where(Run.id == current))
    if current is not None:
        raise ChainUnreadable(f"the chain of run {first} is longer than {MAX_CHAIN} runs")
    return ids


def ledger_rows(db: Database, run_ids: list[str]) -> list[ToolCallRecord]:
    query = (
        select(ToolCallRecord).where(ToolCallRecord.run_id.in_(run_ids)).order_by(ToolCallRecord.id)
    )
    with db.read() as session:
        return list(session.scalars(query))
