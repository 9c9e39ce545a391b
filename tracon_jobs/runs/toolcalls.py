"""Answering the tool calls of one model turn, each through the ledger.

    ledger answer (continuation chain | earlier fallback link)
      | budget gate -> approval (where the tool asks) -> ledger `started` -> attempts
        under the retry policy -> outcome

A call to an agent is a child run of the tree (see `subagents`). Every outcome, refusals
included, is committed to the ledger before the model reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

from tracon_jobs import logs
from tracon_jobs.agents.tools import ToolContext, ToolSpec
from tracon_jobs.db.models import Approval
from tracon_jobs.errors import RunTakenAway, ToolCanceledError, ToolError
from tracon_jobs.providers.base import Message, ToolCall
from tracon_jobs.runs.approvals import ApprovalRequest, ApprovalStatus, ApprovalStore
from tracon_jobs.runs.execution import Execution, Link, RunFailure
from tracon_jobs.runs.ledger import ApprovalUsed, Ledger, ToolOutcome, arguments_hash
from tracon_jobs.runs.lifecycle import ErrorClass, RunError
from tracon_jobs.runs.retries import Sleep, run_with_retries
from tracon_jobs.runs.store import RunStore
from tracon_jobs.runs.subagents import SubAgents


class WaitingForPerson(Exception):
    """Calls of this turn need a person first; nothing of the turn has run."""

    def __init__(self, requests: list[ApprovalRequest]) -> None:
        super().__init__(f"{len(requests)} tool calls wait for approval")
        self.requests = requests


_DECLINED = {
    ApprovalStatus.REJECTED.value: ("approval_rejected", "a person rejected the call"),
    ApprovalStatus.EXPIRED.value: (
        "approval_expired",
        "nobody decided before the approval expired",
    ),
    ApprovalStatus.CANCELED.value: ("approval_canceled", "the approval was canceled"),
}


class ToolCalls:
    """Runs a turn's tool calls: ledger first, then the budget gate, then the body."""

    def __init__(
        self,
        runs: RunStore,
        ledger: Ledger,
        approvals: ApprovalStore,
        children: SubAgents,
        run_inline: Callable[[str], object],
        *,
        currency: str,
        concurrent: bool,
        sleep: Sleep | None = None,
    ) -> None:
        self.runs = runs
        self.ledger = ledger
        self.approvals = approvals
        self.children = children
        self.run_inline = run_inline  # executes a child nobody claimed, on this thread
        self.currency = currency
        self.concurrent = concurrent  # `ToolLoop.AllowConcurrentToolCalls`
        self.sleep = sleep  # retry backoff; tests pass one that records instead of waiting

    def answer_turn(
        self, ex: Execution, link: Link, call_no: int, calls: list[ToolCall]
    ) -> list[Message]:
        """The turn's calls in order, or started together with `AllowConcurrentToolCalls`
        (then every call passes the budget gate before any reports its spend, the hazard the
        reliability guide names for concurrent tool calls). Raises `WaitingForPerson` before
        any call runs when some call still needs an approval."""
        stop_unless_repeated(ex, calls)
        self._ask_for_approvals(ex, call_no, calls)
        if not self.concurrent or len(calls) < 2:
            results = []
            for call in calls:
                ex.ensure_live()
                results.append(self.answer(ex, link, call_no, call))
            return results
        ex.ensure_live()
        with ThreadPoolExecutor(len(calls), thread_name_prefix="tool-call") as pool:
            answer = logs.carry(lambda call: self.answer(ex, link, call_no, call))
            return list(pool.map(answer, calls))

    def answer(self, ex: Execution, link: Link, call_no: int, call: ToolCall) -> Message:
        arguments, parse_error = parse_arguments(call.arguments)
        spec = ex.tools.get(call.name)
        outcome = None
        if spec is None and call.name in ex.agent.sub_agents:
            outcome = self._call_agent(ex, call_no, call, arguments, parse_error)
            return {"role": "tool", "tool_call_id": call.id, "content": outcome.as_model_content()}
        if parse_error is None and spec is not None:
            outcome = self._answer_from_chain(ex, call, arguments)
        if outcome is None and link.position > 0 and parse_error is None and spec is not None:
            outcome = self._answer_from_ledger(ex, call, arguments)
        if outcome is None and spec is not None and parse_error is None:
            outcome = self._refused_by_budget(ex, call_no, call, arguments)
        approval = None
        if outcome is None and spec is not None and parse_error is None and gated(ex, spec):
            approval, outcome = self._approval(ex, call_no, call, arguments)
        if outcome is None:
            outcome = self._execute(ex, call_no, call, spec, arguments, parse_error, approval)
        return {"role": "tool", "tool_call_id": call.id, "content": outcome.as_model_content()}

    # -- approvals ---------------------------------------------------------------------------

    def _ask_for_approvals(self, ex: Execution, call_no: int, calls: list[ToolCall]) -> None:
        """Ask a person for every gated call of the turn that has no approval yet."""
        requests = []
        for call in calls:
            spec = ex.tools.get(call.name)
            arguments, parse_error = parse_arguments(call.arguments)
            if spec is None or parse_error is not None or not gated(ex, spec):
                continue
            if self._find_approval(ex, call_no, call, arguments) is not None:
                continue
            if ex.chain.has((call.name, arguments_hash(arguments))):
                continue  # answered from the chain's ledger, never run again
            if ex.tree_budget().refuse_tool_call() is not None:
                continue  # refused at its turn, with nothing to approve
            request = ApprovalRequest(
                call_no, call.id, call.name, arguments, arguments_hash(arguments)
            )
            requests.append(request)
        if requests:
            raise WaitingForPerson(requests)

    def _find_approval(
        self, ex: Execution, call_no: int, call: ToolCall, arguments: dict[str, Any]
    ) -> Approval | None:
        """This call's approval, or one a crashed run of the chain got and never used."""
        found = self.approvals.for_call(ex.run.id, call_no, call.id)
        if found is None and ex.chain.run_ids:
            found = self.approvals.approved_in_chain(
                ex.chain.run_ids, call.name, arguments_hash(arguments)
            )
        return found

    def _approval(
        self, ex: Execution, call_no: int, call: ToolCall, arguments: dict[str, Any]
    ) -> tuple[Approval | None, ToolOutcome | None]:
        """An approval to consume, or the outcome the model reads instead of the body."""
        approval = self._find_approval(ex, call_no, call, arguments)
        if approval is not None and approval.status == ApprovalStatus.APPROVED.value:
            if approval.consumed_at is None:
                return approval, None
            code, message = "approval_used", "the approval of this call was already used"
        elif approval is None:
            code, message = "approval_missing", "the call has no approval"
        else:
            code, message = _DECLINED.get(approval.status, ("approval_pending", "not decided"))
            if approval.comment:
                message = f"{message}: {approval.comment}"
        outcome = ToolOutcome(ok=False, error_code=code, error_message=message, attempts=0)
        self.ledger.refuse(ex.claim, call_no, call.id, call.name, arguments, outcome)
        return None, outcome

    def _call_agent(
        self,
        ex: Execution,
        call_no: int,
        call: ToolCall,
        arguments: dict[str, Any],
        parse_error: str | None,
    ) -> ToolOutcome:
        """A child run of the tree; a refused child is the tool's error, the parent goes on."""
        ledger_name = f"agent:{call.name}"
        message = arguments.get("message")
        refusal = ex.tree_budget().refuse_child(ex.run.depth + 1)
        if parse_error or not isinstance(message, str) or refusal:
            code = "INVALID_ARGUMENTS"
            if refusal:
                code = refusal.tool_code if refusal.quota else "CHILD_REFUSED"
            outcome = ToolOutcome(
                ok=False,
                error_code=code,
                error_message=(refusal.message if refusal else None)
                or parse_error
                or "message: a string is required",
                attempts=0,
            )
            self.ledger.refuse(ex.claim, call_no, call.id, ledger_name, arguments, outcome)
            return outcome
        entry = self.ledger.start(ex.claim, call_no, call.id, ledger_name, arguments)
        child_id = self.children.start(ex.run, call.name, message)
        outcome = self.children.answer(child_id, ex.signal, self.run_inline)
        self.ledger.finish(ex.claim, entry, ledger_name, outcome)
        return outcome

    def _refused_by_budget(
        self, ex: Execution, call_no: int, call: ToolCall, arguments: dict[str, Any]
    ) -> ToolOutcome | None:
        """A spent tree does not start a tool: nothing would read its result."""
        refusal = ex.tree_budget().refuse_tool_call()
        if refusal is None:
            return None
        outcome = ToolOutcome(
            ok=False,
            error_code=refusal.tool_code,
            attempts=0,
            error_message=f"{refusal.message}. The tool call did not start.",
        )
        self.ledger.refuse(ex.claim, call_no, call.id, call.name, arguments, outcome)
        return outcome

    def _report_usage(
        self, ex: Execution, spec: ToolSpec, amount: Decimal | float, currency: str
    ) -> None:
        """Spend a tool reports beyond tokens; only the pricing currency can count."""
        value = Decimal(str(amount))
        counted = currency == self.currency and value > 0
        data = {"tool": spec.name, "amount": float(value), "currency": currency, "counted": counted}
        if not counted:
            self.runs.append(ex.claim, "UsageReported", data)
            return
        ex.tree_budget().spent(released=0, tokens=0, cost=value, unknown=False)
        self.runs.add_cost(ex.claim, value, data)

    def _answer_from_chain(
        self, ex: Execution, call: ToolCall, arguments: dict[str, Any]
    ) -> ToolOutcome | None:
        """In a continuation, a call the interrupted chain completed is answered, not rerun."""
        found = ex.chain.answer((call.name, arguments_hash(arguments)))
        if found is None:
            return None
        execution_id, outcome = found
        data = {
            "tool": call.name,
            "callId": call.id,
            "executionId": execution_id,
            "source": "continuation",
            "continuedFromRunId": ex.run.continued_from_run_id,
        }
        self.runs.append(ex.claim, "ToolCallAnsweredFromLedger", data)
        return outcome

    def _answer_from_ledger(
        self, ex: Execution, call: ToolCall, arguments: dict[str, Any]
    ) -> ToolOutcome | None:
        """On a fallback link, a call an earlier link of this turn completed is not rerun.

        Only calls of the earlier links count (a repeat within one link is a new execution),
        and each of their executions answers at most once.
        """
        found = self.ledger.completed(
            ex.claim.run_id,
            call.name,
            arguments_hash(arguments),
            turns=(ex.first_call, ex.link_first_call),
            exclude=frozenset(ex.answered),
        )
        if found is None:
            return None
        execution_id, outcome = found
        ex.answered.add(execution_id)
        self.runs.append(
            ex.claim,
            "ToolCallAnsweredFromLedger",
            {"tool": call.name, "callId": call.id, "executionId": execution_id},
        )
        return outcome

    def _execute(
        self,
        ex: Execution,
        call_no: int,
        call: ToolCall,
        spec: ToolSpec | None,
        arguments: dict[str, Any],
        parse_error: str | None,
        approval: Approval | None = None,
    ) -> ToolOutcome:
        reused_key = ex.chain.key_for((call.name, arguments_hash(arguments)))
        try:
            entry = self.ledger.start(
                ex.claim,
                call_no,
                call.id,
                call.name,
                arguments,
                reused_key,
                execution_id=approval.execution_id if approval else None,
                consume=(lambda session: self.approvals.consume_in(session, approval))
                if approval
                else None,
            )
        except ApprovalUsed as used:  # another process used it: the body must not run
            outcome = ToolOutcome(ok=False, error_code="approval_used", error_message=str(used))
            self.ledger.refuse(ex.claim, call_no, call.id, call.name, arguments, outcome)
            return outcome
        if parse_error is not None or spec is None:
            outcome = ToolOutcome(
                ok=False,
                error_code="INVALID_ARGUMENTS" if spec else "UNKNOWN_TOOL",
                error_message=parse_error or f"no tool named '{call.name}' is available",
            )
        else:
            outcome = self._attempt(ex, spec, arguments, entry.execution_id, entry.idempotency_key)
        self.ledger.finish(ex.claim, entry, call.name, outcome)
        return outcome

    def _attempt(
        self,
        ex: Execution,
        spec: ToolSpec,
        arguments: dict[str, Any],
        execution_id: str,
        key: str,
    ) -> ToolOutcome:
        context = ToolContext(
            run_id=ex.claim.run_id,
            tool_name=spec.name,
            execution_id=execution_id,
            idempotency_key=key,
            attempt=1,
            signal=ex.signal,
            report_usage=lambda amount, currency: self._report_usage(ex, spec, amount, currency),
        )

        def announce_retry(attempt: int, error: ToolError) -> None:
            data = {
                "tool": spec.name,
                "executionId": execution_id,
                "attempt": attempt,
                "previousError": error.code,
            }
            self.runs.append(ex.claim, "CapabilityRetried", data)

        def still_ours() -> None:
            """The fence and the cancel flag, read from SQL right before the body starts."""
            reason = self.runs.still_owned(ex.claim)
            if reason == "taken_away":
                raise RunTakenAway(f"run {ex.claim.run_id} was taken away before {spec.name}")
            if reason == "canceled":
                raise ToolCanceledError(f"the run was canceled before '{spec.name}' started")

        try:
            done = run_with_retries(
                spec,
                arguments,
                context,
                on_retry=announce_retry,
                sleep=self.sleep,
                before_attempt=still_ours,
            )
        except ToolError as exc:
            return ToolOutcome(
                ok=False, error_code=exc.code, error_message=str(exc), attempts=exc.attempts
            )
        return ToolOutcome(ok=True, result=done.result, attempts=done.attempts)


def stop_unless_repeated(ex: Execution, calls: list[ToolCall]) -> None:
    """A continuation goes on only while the model repeats, with the same arguments, each
    call the interrupted run had in flight (its outcome unknown); else it stops here."""
    keys = {(call.name, arguments_hash(parse_arguments(call.arguments)[0])) for call in calls}
    missing = ex.chain.unrepeated(keys)
    if missing:
        tool, _hash = missing[0]
        raise RunFailure(
            RunError(
                "continuation_blocked",
                ErrorClass.INFRASTRUCTURE,
                f"the continuation did not repeat '{tool}' with the arguments the interrupted "
                "run called it with, and its outcome is unknown; nothing else was started",
            ),
            blocked={"tool": tool, "reason": "in-flight call not repeated"},
        )


def gated(ex: Execution, spec: ToolSpec) -> bool:
    """Whether a call of `spec` waits for a person: by its registration or its agent's config."""
    return spec.requires_approval or spec.name in ex.agent.require_approval


def unanswered_calls(messages: list[Message]) -> list[ToolCall]:
    """The tool calls of a turn the run stopped in to wait for a person (none otherwise)."""
    if not messages or messages[-1].get("role") != "assistant":
        return []
    return [
        ToolCall(part["id"], part["function"]["name"], part["function"]["arguments"])
        for part in messages[-1].get("tool_calls") or []
    ]


def parse_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        return {"_raw": raw}, f"arguments are not valid JSON: {exc}"
    if not isinstance(value, dict):
        return {"_raw": raw}, "arguments must be a JSON object"
    return value, None
