"""An agent called as a tool: a child run of the same tree, executed as its own task.

Celery forbids waiting on a result inside a task, and a threads pool whose every thread is
a parent waiting for its child would starve the children. So a parent never waits on the
broker: it sends the child's message, gives any worker `CHILD_CLAIM_WAIT` seconds to
claim it, and otherwise claims and runs the child itself, inline on its own thread (the
guarded claim keeps it to one executor either way). A parent therefore only ever waits for
a child that is executing somewhere, and the tree always makes progress.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tracon_jobs.abort import AbortSignal
from tracon_jobs.coordination.cancellation import CancelBus
from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.db.models import Run
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.approvals import ApprovalStore
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.dispatch import RunDispatcher, submission
from tracon_jobs.runs.ledger import ToolOutcome
from tracon_jobs.runs.lifecycle import RunStatus
from tracon_jobs.runs.store import NewRun, RunStore

log = logging.getLogger(__name__)

CHILD_CLAIM_WAIT = 2.0
"""Seconds a parent lets other workers claim its child before running it inline."""
POLL = 1.0


def agent_tool_schema(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Ask the '{name}' agent; its final answer is the result.",
            "parameters": {
                "type": "object",
                "properties": {"message": {"type": "string"}},
                "required": ["message"],
            },
        },
    }


class SubAgents:
    """Starts the child runs of a tree and waits for their answers without starving them."""

    def __init__(
        self,
        runs: RunStore,
        feed: EventFeed,
        dispatcher: RunDispatcher,
        cancel_bus: CancelBus,
        approvals: ApprovalStore,
        *,
        claim_wait: float = CHILD_CLAIM_WAIT,
    ) -> None:
        self.runs = runs
        self.claim_wait = claim_wait
        self.approvals = approvals
        self.feed = feed
        self.dispatcher = dispatcher
        self.cancel_bus = cancel_bus

    def start(self, parent: Run, agent: str, message: str) -> str:
        """Write the child row, then try to send it; a broker that refuses is not fatal."""
        new = NewRun(
            tenant_id=parent.tenant_id,
            agent=agent,
            input={"message": message},
            session_id=parent.session_id,
            parent_run_id=parent.id,
            root_run_id=parent.root_run_id,
            depth=parent.depth + 1,
            currency=parent.cost_currency,
            priority=parent.priority,
        )
        with submission(new) as traced:  # a child of the tool call's span, when traced
            child = self.runs.create(traced)
            self.send(child.id)
        return child.id

    def send(self, child_id: str) -> None:
        """Send a child written `Queued`; a broker that refuses is not fatal (the parent
        runs it, or the requeue scan sends it again)."""
        try:
            self.dispatcher.send(child_id)
        except EnqueueError as exc:
            log.warning("child %s not sent now (%s)", child_id, exc)

    def cancel(self, child_id: str) -> None:
        """Cancel a child and its own tree, wherever it is (a fail-fast fan-out's others)."""
        child = self.runs.get(child_id)
        if child is not None and not RunStatus(child.status).is_terminal:
            cancel_tree(self.runs, self.cancel_bus, self.approvals, child)

    def answer(
        self, child_id: str, signal: AbortSignal, run_inline: Callable[[str], object]
    ) -> ToolOutcome:
        """The child's answer as the tool's outcome; `run_inline` runs it if nobody claimed it."""
        claimed = self._wait(child_id, signal, lambda run: run.status != "Queued", self.claim_wait)
        if not claimed and not signal.aborted:
            run_inline(child_id)  # dropped if a worker claimed it meanwhile
        self._wait(child_id, signal, lambda run: RunStatus(run.status).is_terminal, None)
        child = self.runs.get(child_id)
        assert child is not None
        if signal.aborted and not RunStatus(child.status).is_terminal:
            cancel_tree(self.runs, self.cancel_bus, self.approvals, child)
            return ToolOutcome(ok=False, error_code="CANCELLED", error_message="parent canceled")
        return child_outcome(child)

    def _wait(
        self, run_id: str, signal: AbortSignal, done: Callable[[Run], bool], timeout: float | None
    ) -> bool:
        """Until `done(run)`, the signal fires, or `timeout` passes; whether `done` held."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not signal.aborted:
            position = self.feed.position(run_id)
            run = self.runs.get(run_id)
            if run is not None and done(run):
                return True
            remaining = POLL if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.feed.wait(run_id, position, min(POLL, remaining))
        return False


def child_outcome(child: Run) -> ToolOutcome:
    if child.status == RunStatus.COMPLETED.value:
        return ToolOutcome(ok=True, result=(child.output or {}).get("text", ""))
    return ToolOutcome(
        ok=False,
        error_code="AGENT_FAILED" if child.status == "Failed" else "AGENT_CANCELED",
        error_message=f"agent '{child.agent}' run {child.id} ended {child.status}: "
        f"{child.error_message or ''}".rstrip(": "),
    )
