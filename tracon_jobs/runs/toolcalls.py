"""Answering the tool calls of one model turn, each through the ledger, by these steps in
this order (the first that answers ends the call):

    a recorded answer: the continuation chain's, then an earlier fallback link's
      | the tenant's quota and the tree's budget (a refusal)
      | an approval (where the tool asks for one) -> ledger `started` -> attempts under
        the retry policy -> outcome

Whether a turn must wait for a person is read from the same steps, before any call of the
turn runs: a call waits only when it would reach the approval step and has no approval. A
call to an agent is a child run of the tree (see `subagents`). Every outcome, refusals
included, is committed to the ledger before the model reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from tracon_jobs import logs, tracing
from tracon_jobs.agents.tools import ToolContext, ToolSpec
from tracon_jobs.db.models import Approval
from tracon_jobs.errors import RunTakenAway, ToolCanceledError, ToolError
from tracon_jobs.limits.budget_store import Refusal
from tracon_jobs.providers.base import Message, ToolCall
from tracon_jobs.runs.approvals import ApprovalRequest, ApprovalStatus, ApprovalStore
from tracon_jobs.runs.execution import Execution, Link, RunFailure
from tracon_jobs.runs.ledger import ApprovalUsed, Ledger, ToolOutcome, arguments_hash
from tracon_jobs.runs.lifecycle import Claim, ErrorClass, RunError
from tracon_jobs.runs.retries import Sleep, run_with_retries
from tracon_jobs.runs.store import RunStore
from tracon_jobs.runs.subagents import SubAgents
from tracon_jobs.tracing import genai


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


@dataclass(frozen=True)
class Recorded:
    """An earlier execution of the same call answers it, instead of the body running again."""

    execution_id: str
    outcome: ToolOutcome
    source: Literal["continuation", "fallback"]  # the chain's record, or an earlier link's


@dataclass(frozen=True)
class Gate:
    """What stands between a call with no recorded answer and its body."""

    refusal: Refusal | None = None  # the tenant's quota or the tree's budget refuses it
    gated: bool = False  # the tool waits for a person
    approval: Approval | None = None  # the approval found for it, whatever its state

    @property
    def asks(self) -> bool:
        """Whether the call waits for a person: it reaches its approval, and has none."""
        return self.refusal is None and self.gated and self.approval is None


class ToolCalls:
    """Runs a turn's tool calls: a recorded answer first, then the gates, then the body."""

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

    def _made(self, ex: Execution) -> Claim:
        """The run's claim, made: the ledger takes no other. The turn's model call made it;
        one that was not made yet is made here (`RunStore.settle`)."""
        claim = ex.claim if isinstance(ex.claim, Claim) else self.runs.settle(ex.claim)
        ex.claim = claim
        return claim

    def answer_turn(
        self, ex: Execution, link: Link, call_no: int, calls: list[ToolCall]
    ) -> list[Message]:
        """The turn's calls in order, or started together with `AllowConcurrentToolCalls`
        (then every call passes the budget gate before any reports its spend, the hazard the
        reliability guide names for concurrent tool calls). Raises `WaitingForPerson` before
        any call runs when some call still needs an approval."""
        stop_unless_repeated(ex, calls, self._taken(ex, link))
        plan = self._plan(ex, link, call_no, calls)
        if not self.concurrent or len(calls) < 2:
            results = []
            for call, recorded in zip(calls, plan, strict=True):
                ex.ensure_live()
                results.append(self.answer(ex, call_no, call, recorded))
            return results
        ex.ensure_live()
        with ThreadPoolExecutor(len(calls), thread_name_prefix="tool-call") as pool:
            answer = logs.carry(lambda planned: self.answer(ex, call_no, *planned))
            return list(pool.map(answer, zip(calls, plan, strict=True)))

    def answer(
        self, ex: Execution, call_no: int, call: ToolCall, recorded: Recorded | None = None
    ) -> Message:
        """One call: its recorded answer when the turn's plan found one, else the gates,
        then the body."""
        arguments, parse_error = parse_arguments(call.arguments)
        spec = ex.tools.get(call.name)
        calls_an_agent = _calls_an_agent(ex, call)
        with genai.tool_call(
            call.name,
            call.id,
            "agent" if calls_an_agent else "function",
            None if spec is None else spec.side_effect,
            call.arguments,
        ) as span:
            if calls_an_agent:
                source = "child_run"
                outcome = self._call_agent(ex, call_no, call, arguments, parse_error)
            elif recorded is not None:
                source = "ledger"
                outcome = self._answer_from_record(ex, call, recorded)
            elif spec is None or parse_error is not None:
                source = "refused"
                outcome = self._execute(ex, call_no, call, spec, arguments, parse_error)
            else:
                source = "executed"
                outcome = self._through_gates(ex, call_no, call, arguments, spec)
            genai.tool_answered(
                span,
                outcome.ok,
                outcome.error_code,
                outcome.attempts,
                source,
                outcome.result if outcome.ok else outcome.error_message,
            )
        return {"role": "tool", "tool_call_id": call.id, "content": outcome.as_model_content()}

    # -- the steps, in order -----------------------------------------------------------------

    def _plan(
        self, ex: Execution, link: Link, call_no: int, calls: list[ToolCall]
    ) -> list[Recorded | None]:
        """Each call's recorded answer (None: it goes on to the gates), and whether the turn
        waits: a call waits for a person only when no recorded answer and no refusal comes
        first (only a gated tool reads its gates here: the others cannot wait). Raises
        `WaitingForPerson`, before anything of the turn runs, when one does."""
        taken = set(self._taken(ex, link))
        plan: list[Recorded | None] = []
        requests = []
        for call in calls:
            arguments, parse_error = parse_arguments(call.arguments)
            spec = ex.tools.get(call.name)
            recorded = None
            if spec is not None and parse_error is None:
                recorded = self._recorded(ex, link, call, arguments, taken)
                if recorded is not None:
                    taken.add(recorded.execution_id)
                elif gated(ex, spec) and self._gate(ex, call_no, call, arguments, spec).asks:
                    requests.append(
                        ApprovalRequest(
                            call_no, call.id, call.name, arguments, arguments_hash(arguments)
                        )
                    )
            plan.append(recorded)
        if requests:
            raise WaitingForPerson(requests)
        self._taken(ex, link).update(taken)
        return plan

    def _recorded(
        self,
        ex: Execution,
        link: Link,
        call: ToolCall,
        arguments: dict[str, Any],
        taken: set[str],
    ) -> Recorded | None:
        """A call the interrupted chain completed, then (on a fallback link) one an earlier
        link of this turn completed, is answered, not rerun; each of their executions
        answers one call of a link's conversation at most (a repeat is a new execution)."""
        args_hash = arguments_hash(arguments)
        found = ex.chain.first((call.name, args_hash), taken)
        if found is not None:
            return Recorded(*found, source="continuation")
        if link.position == 0:
            return None
        found = self.ledger.completed(
            ex.claim.run_id,
            call.name,
            args_hash,
            turns=(ex.first_call, ex.link_first_call),
            exclude=frozenset(taken),
        )
        return None if found is None else Recorded(*found, source="fallback")

    def _gate(
        self,
        ex: Execution,
        call_no: int,
        call: ToolCall,
        arguments: dict[str, Any],
        spec: ToolSpec,
    ) -> Gate:
        """The tenant's quota and the tree's budget first (a spent tree does not start a
        tool, nor ask a person about one), then the approval where the tool asks for one."""
        refusal = ex.tree_budget().refuse_tool_call()
        if refusal is not None:
            return Gate(refusal=refusal)
        if not gated(ex, spec):
            return Gate()
        return Gate(gated=True, approval=self._find_approval(ex, call_no, call, arguments))

    def _through_gates(
        self,
        ex: Execution,
        call_no: int,
        call: ToolCall,
        arguments: dict[str, Any],
        spec: ToolSpec,
    ) -> ToolOutcome:
        """The gates read again at the call's own turn (an earlier call of the turn may
        have spent the budget), then the body."""
        gate = self._gate(ex, call_no, call, arguments, spec)
        if gate.refusal is not None:
            return self._refused_by_budget(ex, call_no, call, arguments, gate.refusal)
        approval = None
        if gate.gated:
            approval, refused = self._approval(ex, call_no, call, arguments, gate.approval)
            if refused is not None:
                return refused
        return self._execute(ex, call_no, call, spec, arguments, None, approval)

    def _taken(self, ex: Execution, link: Link) -> set[str]:
        """The recorded executions that already answered a call of this link's conversation."""
        return ex.answered.setdefault(link.position, set())

    # -- approvals ---------------------------------------------------------------------------

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
        self,
        ex: Execution,
        call_no: int,
        call: ToolCall,
        arguments: dict[str, Any],
        approval: Approval | None,
    ) -> tuple[Approval | None, ToolOutcome | None]:
        """An approval to consume, or the outcome the model reads instead of the body."""
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
        self.ledger.refuse(self._made(ex), call_no, call.id, call.name, arguments, outcome)
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
            self.ledger.refuse(self._made(ex), call_no, call.id, ledger_name, arguments, outcome)
            return outcome
        entry = self.ledger.start(self._made(ex), call_no, call.id, ledger_name, arguments)
        child_id = self.children.start(ex.run, call.name, message)
        outcome = self.children.answer(child_id, ex.signal, self.run_inline)
        self.ledger.finish(self._made(ex), entry, ledger_name, outcome)
        return outcome

    def _refused_by_budget(
        self,
        ex: Execution,
        call_no: int,
        call: ToolCall,
        arguments: dict[str, Any],
        refusal: Refusal,
    ) -> ToolOutcome:
        """A spent tree does not start a tool: nothing would read its result."""
        outcome = ToolOutcome(
            ok=False,
            error_code=refusal.tool_code,
            attempts=0,
            error_message=f"{refusal.message}. The tool call did not start.",
        )
        self.ledger.refuse(self._made(ex), call_no, call.id, call.name, arguments, outcome)
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

    def _answer_from_record(self, ex: Execution, call: ToolCall, recorded: Recorded) -> ToolOutcome:
        data: dict[str, Any] = {
            "tool": call.name,
            "callId": call.id,
            "executionId": recorded.execution_id,
        }
        if recorded.source == "continuation":
            data["source"] = "continuation"
            data["continuedFromRunId"] = ex.run.continued_from_run_id
        self.runs.append(ex.claim, "ToolCallAnsweredFromLedger", data)
        return recorded.outcome

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
                self._made(ex),
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
            self.ledger.refuse(self._made(ex), call_no, call.id, call.name, arguments, outcome)
            return outcome
        if parse_error is not None or spec is None:
            outcome = ToolOutcome(
                ok=False,
                error_code="INVALID_ARGUMENTS" if spec else "UNKNOWN_TOOL",
                error_message=parse_error or f"no tool named '{call.name}' is available",
            )
        else:
            outcome = self._attempt(ex, spec, arguments, entry.execution_id, entry.idempotency_key)
        self.ledger.finish(self._made(ex), entry, call.name, outcome)
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
            tracing.current_span().event(
                "tracon.tool.retry", {"tracon.tool.attempt": attempt, "error.type": error.code}
            )

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


def stop_unless_repeated(
    ex: Execution, calls: list[ToolCall], taken: Collection[str] = frozenset()
) -> None:
    """A continuation goes on only while the model repeats, with the same arguments, each
    call the interrupted chain had in flight (its outcome unknown) in the first turn that
    asks for anything the chain has no record of (or answers); else it stops there, before
    that turn runs. A sub-agent call neither keeps nor leaves the record: it runs again."""
    keys = [
        (call.name, arguments_hash(parse_arguments(call.arguments)[0]))
        for call in calls
        if not _calls_an_agent(ex, call)
    ]
    if calls and not keys:
        return
    missing = ex.chain.unrepeated(keys, taken)
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


def _calls_an_agent(ex: Execution, call: ToolCall) -> bool:
    return call.name not in ex.tools and call.name in ex.agent.sub_agents


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
