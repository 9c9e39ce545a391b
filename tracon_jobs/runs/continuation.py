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
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from tracon_jobs.agents.tools import WRITE_LIKE, ToolRegistry
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run, ToolCallRecord
from tracon_jobs.db.outages import retry_outages
from tracon_jobs.limits.tree import MAX_CHAIN, ChainUnreadable
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
                priority=run.priority,
                continues_trace=run.traceparent,
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
    """What the runs a continuation continues recorded: the outcome of each call they
    completed, and the idempotency key of each call whose outcome is still unknown."""

    recorded: dict[CallKey, list[tuple[str, ToolOutcome]]] = field(default_factory=dict)
    in_flight: dict[CallKey, deque[str]] = field(default_factory=dict)  # idempotency keys
    run_ids: list[str] = field(default_factory=list)  # the runs continued, newest first

    def first(
        self, key: CallKey, taken: Collection[str] = frozenset()
    ) -> tuple[str, ToolOutcome] | None:
        """The first completed execution of this call (execution id, outcome) that is not
        in `taken`: each answers one call of a conversation at most."""
        for execution_id, outcome in self.recorded.get(key, ()):
            if execution_id not in taken:
                return execution_id, outcome
        return None

    def replays(self, calls: Sequence[CallKey], taken: Collection[str] = frozenset()) -> bool:
        """Whether the chain's record answers every one of `calls` (a turn the chain
        completed, asked again)."""
        used = set(taken)
        for key in calls:
            found = self.first(key, used)
            if found is None:
                return False
            used.add(found[0])
        return True

    def unrepeated(
        self, calls: Sequence[CallKey], taken: Collection[str] = frozenset()
    ) -> list[CallKey]:
        """The calls in flight that a turn of `calls` leaves out, once that turn goes past
        the record (a call the chain has no answer for, or no call at all: the answer). The
        reliability guide stops the continuation for them, whatever turns came before."""
        if calls and self.replays(calls, taken):
            return []
        return [key for key, keys in self.in_flight.items() if keys and key not in calls]

    def key_for(self, key: CallKey) -> str | None:
        """The idempotency key a repeat of a call in flight runs with (each used once)."""
        queue = self.in_flight.get(key)
        return queue.popleft() if queue else None


def chain_ledger(db: Database, run: Run) -> ChainLedger:
    """The chain's ledger as `run` reads it: a call in flight in one run of the chain and
    resolved (repeated with its key) in a later one, or by `run` itself before it waited
    for a person, is resolved; a call in flight in several runs is one call."""
    ledger = ChainLedger()
    if run.continued_from_run_id is None:
        return ledger
    first = run.continued_from_run_id
    ledger.run_ids = retry_outages(db, lambda: _chain(db, first), "reading a chain")
    runs = [*ledger.run_ids, run.id]
    rows = retry_outages(db, lambda: ledger_rows(db, runs), "reading a chain's ledger")
    resolved = {row.idempotency_key for row in rows if row.status != "started"}
    resolved |= {row.idempotency_key for row in rows if row.run_id == run.id}
    unknown: dict[str, CallKey] = {}
    for row in rows:
        key = (row.tool, row.args_hash)
        if row.status == "started":
            if row.idempotency_key not in resolved:
                unknown.setdefault(row.idempotency_key, key)
        elif row.run_id != run.id:
            ledger.recorded.setdefault(key, []).append((row.execution_id, _outcome(row)))
    for idempotency_key, key in unknown.items():
        ledger.in_flight.setdefault(key, deque()).append(idempotency_key)
    return ledger


def _outcome(row: ToolCallRecord) -> ToolOutcome:
    return ToolOutcome(
        ok=row.status == "succeeded",
        result=(row.result or {}).get("value"),
        error_code=row.error_code,
        error_message=row.error_message,
        attempts=row.attempt,
    )


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
