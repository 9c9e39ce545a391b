"""The tool-call loop that executes one claimed run, as a set of small named steps.

    claim -> resolve agent and tools
          -> for each fallback link: circuit admits the link's loop (once)
               -> [check live -> slot -> model call -> record spend
                   -> (tool calls: ledger answer | ledger started -> attempt -> outcome)
                   -> save turn]*
             a transient failure restarts the turn from scratch on the next link
          -> one fenced final write

Every write goes through the claim's fence; `RunTakenAway` from any of them stops the
executor before its next model or tool call, and a zombie never writes a result. The
circuit breaker sits outside each link's whole loop (checked once when it starts, one
success at the first good response, one failure when a counted failure ends it); the
ledger answers an exact repeat of a completed tool call only on a fallback link.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from tracon_jobs.agents.tools import ToolContext, ToolSpec
from tracon_jobs.db.models import Run
from tracon_jobs.errors import (
    ConfigurationError,
    ProviderError,
    RunCancelled,
    RunTakenAway,
    ToolError,
)
from tracon_jobs.pricing import price
from tracon_jobs.providers.base import Message, ModelRequest, ModelResponse, Provider, ToolCall
from tracon_jobs.resilience.breaker import Admission, Ticket, Transition
from tracon_jobs.resilience.budgets import Limits
from tracon_jobs.resilience.classify import classify
from tracon_jobs.runs.budget import TreeBudget, open_budget
from tracon_jobs.runs.continuation import ChainLedger, chain_ledger
from tracon_jobs.runs.ledger import Ledger, ToolOutcome, arguments_hash
from tracon_jobs.runs.lifecycle import Claim, ErrorClass, RunError, RunStatus
from tracon_jobs.runs.live import CANCELED, TAKEN_AWAY
from tracon_jobs.runs.retries import Sleep, run_with_retries
from tracon_jobs.runs.store import TurnSpend
from tracon_jobs.runs.subagents import agent_tool_schema, await_child, start_child
from tracon_jobs.signal import AbortSignal

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime
    from tracon_jobs.settings import AgentSettings

log = logging.getLogger(__name__)


class RunFailure(Exception):
    """Ends the run `Failed` with a typed error."""

    def __init__(self, error: RunError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class Link:
    position: int
    provider_name: str
    model: str
    provider: Provider

    def label(self) -> dict[str, str]:
        return {"provider": self.provider_name, "model": self.model}


class LinkFailed(Exception):
    """A provider failure ended one link's loop."""

    def __init__(self, error: ProviderError, transient: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.transient = transient


@dataclass
class Execution:
    """What one execution of a claimed run carries from step to step."""

    claim: Claim
    run: Run
    agent: AgentSettings
    tools: dict[str, ToolSpec]
    signal: AbortSignal
    first_call: int  # ledger numbering continues after earlier executions of this row
    next_call: int = 0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    chain: ChainLedger = field(default_factory=ChainLedger)  # what a continued run recorded
    budget: TreeBudget | None = None
    link_first_call: int = 0  # the first ledger turn of the current fallback link
    answered: set[str] = field(default_factory=set)  # executions the ledger already answered


class RunExecutor:
    def __init__(self, runtime: Runtime, sleep: Sleep | None = None) -> None:
        self.rt = runtime
        self.ledger = Ledger(runtime.runs)
        self.sleep = sleep  # retry backoff; tests pass one that records instead of waiting

    def execute(self, run_id: str) -> str:
        """Claim and run `run_id`; what happened, for logs and tests."""
        if self.rt.draining.is_set():  # left Queued: the requeue scan sends it elsewhere
            log.info("draining: run %s not claimed", run_id)
            return "draining"
        claimed = self.rt.runs.claim_and_load(run_id, self.rt.owner_id)
        if claimed is None:
            log.info("run %s is not Queued; delivery acknowledged and dropped", run_id)
            return "dropped"
        claim, run = claimed
        signal = AbortSignal()
        self.rt.live_runs.register(claim, signal)
        if run.cancel_requested_at is not None:  # canceled between its claim and now
            signal.abort(CANCELED)
        try:
            return self._run_to_end(claim, run, signal).value
        except RunTakenAway:
            log.warning("run %s was taken away from fence %s; stopping", run_id, claim.fence)
            return "taken_away"
        finally:
            self.rt.live_runs.unregister(run_id)

    def _run_to_end(self, claim: Claim, run: Run, signal: AbortSignal) -> RunStatus:
        execution: Execution | None = None
        try:
            execution = self._prepare(claim, run, signal)
            output = self._tool_loop(execution)
        except RunFailure as failure:
            return self._finish(claim, RunStatus.FAILED, execution, error=failure.error)
        except RunCancelled as cancelled:
            error = RunError("canceled", ErrorClass.CANCELLATION, str(cancelled) or "canceled")
            return self._finish(claim, RunStatus.CANCELED, execution, error=error)
        except (RunTakenAway, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # a bug must close the run, not strand it
            log.exception("run %s failed unexpectedly", claim.run_id)
            error = RunError("internal_error", ErrorClass.INTERNAL, f"{type(exc).__name__}: {exc}")
            return self._finish(claim, RunStatus.FAILED, execution, error=error)
        return self._finish(claim, RunStatus.COMPLETED, execution, output=output)

    def _finish(
        self,
        claim: Claim,
        status: RunStatus,
        execution: Execution | None,
        *,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
    ) -> RunStatus:
        attempts = execution.attempts if execution and execution.attempts else None
        closed = self.rt.runs.finish(claim, status, output=output, error=error, attempts=attempts)
        if closed is None:
            raise RunTakenAway(claim.run_id)
        return status

    # -- preparation -------------------------------------------------------------------

    def _prepare(self, claim: Claim, run: Run, signal: AbortSignal) -> Execution:
        agent = self.rt.settings.agents.get(run.agent)
        if agent is None:
            raise _config_failure(f"agent '{run.agent}' is not configured")
        tools = self._resolve_tools(agent)
        first_call = 0 if claim.fence == 1 else self.ledger.next_turn(run.id)
        chain = chain_ledger(self.rt, run)
        limits = Limits.from_settings(self.rt.settings.agent_graph)
        budget = open_budget(
            self.rt.budgets, self.rt.db, limits, run, self.rt.settings.pricing.currency
        )
        return Execution(
            claim, run, agent, tools, signal, first_call, first_call, chain=chain, budget=budget
        )

    def _resolve_tools(self, agent: AgentSettings) -> dict[str, ToolSpec]:
        tools: dict[str, ToolSpec] = {}
        for name in agent.tools:
            spec = self.rt.tools.get(name)
            if spec is None:
                raise _config_failure(f"tool '{name}' is not registered (check ToolModules)")
            tools[name] = spec
        return tools

    def _link(self, position: int, provider_name: str, model: str) -> Link:
        try:
            provider = self.rt.providers.get(provider_name)
        except (ProviderError, ConfigurationError) as exc:
            raise _config_failure(str(exc)) from exc
        return Link(position, provider_name, model, provider)

    # -- the fallback chain ------------------------------------------------------------

    def _tool_loop(self, ex: Execution) -> dict[str, Any]:
        failures: list[tuple[Link, ProviderError]] = []
        links = ex.agent.model.links()
        for position, (provider_name, model) in enumerate(links):
            link = self._link(position, provider_name, model)
            if failures:
                self._announce_fallback(ex, failures[0][0], link, failures[-1][1])
            try:
                return self._link_loop(ex, link)
            except LinkFailed as failed:
                failures.append((link, failed.error))
                if not failed.transient:
                    break
        raise RunFailure(chain_error(failures))

    def _announce_fallback(
        self, ex: Execution, primary: Link, fallback: Link, reason: ProviderError
    ) -> None:
        data = {"primary": primary.label(), "fallback": fallback.label(), "reason": str(reason)}
        log.warning(
            "run %s falls back from %s to %s: %s",
            ex.claim.run_id,
            primary.provider_name,
            fallback.provider_name,
            reason,
        )
        self.rt.runs.append(ex.claim, "ModelFallbackUsed", data)

    def _link_loop(self, ex: Execution, link: Link) -> dict[str, Any]:
        """One link's whole tool-call loop, under one circuit admission."""
        started = time.monotonic()
        ex.link_first_call = ex.next_call
        try:
            ticket = self.rt.breaker.admit(link.provider_name)
        except ProviderError as exc:  # the circuit is open: the provider is never called
            self._attempt_log(ex, link, started, exc, rejected=True)
            raise LinkFailed(exc, transient=True) from exc
        self._report_circuit(ex, link.provider_name, ticket.change)
        try:
            output = self._conversation(ex, link, ticket)
        except LinkFailed as failed:
            self._attempt_log(ex, link, started, failed.error)
            raise
        finally:
            self.rt.breaker.release(ticket)
        self._attempt_log(ex, link, started, None)
        return output

    def _attempt_log(
        self,
        ex: Execution,
        link: Link,
        started: float,
        error: ProviderError | None,
        *,
        rejected: bool = False,
    ) -> None:
        outcome = "rejected" if rejected else ("failed" if error else "succeeded")
        entry: dict[str, Any] = {
            **link.label(),
            "outcome": outcome,
            "durationMs": round((time.monotonic() - started) * 1000),
        }
        if error is not None:
            entry.update(status=error.status, kind=error.kind, message=str(error))
        ex.attempts.append(entry)

    def _report_circuit(
        self, ex: Execution, provider: str, change: Transition | Admission | None
    ) -> None:
        if change is None:
            return
        data: dict[str, Any] = {"provider": provider, "from": change.before, "to": change.after}
        if isinstance(change, Transition) and change.after == "open":
            data["failures"] = change.failures
        self.rt.runs.append(ex.claim, "CircuitStateChanged", data)

    # -- one link's conversation -------------------------------------------------------

    def _conversation(self, ex: Execution, link: Link, ticket: Ticket) -> dict[str, Any]:
        messages: list[Message] = list(ex.run.messages or initial_messages(ex.agent, ex.run))
        index = ex.run.turns_completed
        while index < self.rt.settings.runs.max_turns:
            self._check_live(ex)
            response = self._model_call(ex, link, ticket, messages, index)
            if not response.tool_calls:
                return {"text": response.text or ""}
            messages.append(response.as_message())
            call_no = ex.next_call
            ex.next_call += 1
            messages.extend(self._tool_calls(ex, link, call_no, response.tool_calls))
            index += 1
            self.rt.runs.save_turn(ex.claim, messages, index)
        raise RunFailure(
            RunError(
                "max_turns_exceeded",
                ErrorClass.QUOTA_EXCEEDED,
                f"the run used all {self.rt.settings.runs.max_turns} model turns "
                "(raise Tracon:Runs:MaxTurns)",
            )
        )

    def _check_live(self, ex: Execution) -> None:
        if ex.signal.aborted:
            raise stopped(ex.signal)

    def _model_call(
        self, ex: Execution, link: Link, ticket: Ticket, messages: list[Message], index: int
    ) -> ModelResponse:
        binding = ex.agent.model
        request = ModelRequest(
            model=link.model,
            messages=messages,
            tools=[spec.openai_schema() for spec in ex.tools.values()]
            + [agent_tool_schema(name) for name in ex.agent.sub_agents],
            temperature=binding.temperature,
            top_p=binding.top_p,
            max_output_tokens=binding.max_output_tokens,
            response_format=binding.response_format,
        )
        reserved = self._budget_for_model_call(ex, messages)
        self.rt.runs.append(ex.claim, "ModelCallStarted", {"turn": index, **link.label()})
        try:
            with self.rt.slots.hold(link.provider_name, ex.signal):
                response = link.provider.complete(request, ex.signal)
        except ProviderError as exc:
            self._budget(ex).spent(released=reserved, tokens=0, cost=Decimal(0), unknown=False)
            raise self._model_call_failed(ex, link, ticket, exc) from exc
        self._report_circuit(ex, link.provider_name, self.rt.breaker.success(ticket))
        self._record_spend(ex, link, response, index, reserved)
        return response

    def _budget(self, ex: Execution) -> TreeBudget:
        assert ex.budget is not None
        return ex.budget

    def _budget_for_model_call(self, ex: Execution, messages: list[Message]) -> int:
        """Refuse the call when the tree is spent; else the tokens reserved for it."""
        refusal, reserved = self._budget(ex).refuse_model_call(
            messages, ex.agent.model.max_output_tokens
        )
        if refusal is not None:
            raise RunFailure(RunError("run_budget_exceeded", ErrorClass.QUOTA_EXCEEDED, refusal))
        return reserved

    def _model_call_failed(
        self, ex: Execution, link: Link, ticket: Ticket, exc: ProviderError
    ) -> Exception:
        if exc.kind == "cancelled" and ex.signal.aborted:
            return stopped(ex.signal)
        verdict = classify(exc)
        data = {
            **link.label(),
            "status": exc.status,
            "kind": exc.kind,
            "message": str(exc),
            "counted": verdict.counts,
        }
        self.rt.runs.append(ex.claim, "ModelCallFailed", data)
        if verdict.counts:
            change = self.rt.breaker.failure(ticket, exc.retry_after)
            self._report_circuit(ex, link.provider_name, change)
        return LinkFailed(exc, verdict.transient)

    def _record_spend(
        self, ex: Execution, link: Link, response: ModelResponse, index: int, reserved: int
    ) -> None:
        amount, source = price(self.rt.settings.pricing, response.model, response.usage)
        self._budget(ex).spent(
            released=reserved,
            tokens=response.usage.total_tokens,
            cost=amount,
            unknown=source == "Unknown",
        )
        spend = TurnSpend(
            model_id=response.model,
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            cost=amount,
            cost_source=source,
        )
        data = {
            "turn": index,
            "provider": link.provider_name,
            "model": response.model,
            "finishReason": response.finish_reason,
            "toolCalls": len(response.tool_calls),
            "usage": {
                "inputTokens": spend.input_tokens,
                "outputTokens": spend.output_tokens,
            },
            "cost": {"amount": float(amount), "source": source},
        }
        self.rt.runs.record_spend(ex.claim, spend, data)

    # -- tool calls --------------------------------------------------------------------

    def _tool_calls(
        self, ex: Execution, link: Link, call_no: int, calls: list[ToolCall]
    ) -> list[Message]:
        """The turn's calls in order, or started together with `AllowConcurrentToolCalls`
        (then every call passes the budget gate before any reports, as the spec warns)."""
        if not self.rt.settings.tool_loop.allow_concurrent_tool_calls or len(calls) < 2:
            results = []
            for call in calls:
                self._check_live(ex)
                results.append(self._tool_call(ex, link, call_no, call))
            return results
        self._check_live(ex)
        with ThreadPoolExecutor(len(calls), thread_name_prefix="tool-call") as pool:
            return list(pool.map(lambda call: self._tool_call(ex, link, call_no, call), calls))

    def _tool_call(self, ex: Execution, link: Link, call_no: int, call: ToolCall) -> Message:
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
        if outcome is None:
            outcome = self._execute_tool(ex, call_no, call, spec, arguments, parse_error)
        return {"role": "tool", "tool_call_id": call.id, "content": outcome.as_model_content()}

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
        refusal = self._budget(ex).refuse_child(ex.run.depth + 1)
        if parse_error or not isinstance(message, str) or refusal:
            outcome = ToolOutcome(
                ok=False,
                error_code="CHILD_REFUSED" if refusal else "INVALID_ARGUMENTS",
                error_message=refusal or parse_error or "message: a string is required",
                attempts=0,
            )
            self.ledger.refuse(ex.claim, call_no, call.id, ledger_name, arguments, outcome)
            return outcome
        entry = self.ledger.start(ex.claim, call_no, call.id, ledger_name, arguments)
        child_id = start_child(self.rt, ex.run, call.name, message)
        outcome = await_child(self.rt, child_id, ex.signal)
        self.ledger.finish(ex.claim, entry, ledger_name, outcome)
        return outcome

    def _refused_by_budget(
        self, ex: Execution, call_no: int, call: ToolCall, arguments: dict[str, Any]
    ) -> ToolOutcome | None:
        """A spent tree does not start a tool: nothing would read its result."""
        refusal = self._budget(ex).refuse_tool_call()
        if refusal is None:
            return None
        outcome = ToolOutcome(
            ok=False,
            error_code="BUDGET_EXCEEDED",
            attempts=0,
            error_message=f"{refusal}. The tool call did not start.",
        )
        self.ledger.refuse(ex.claim, call_no, call.id, call.name, arguments, outcome)
        return outcome

    def _report_usage(
        self, ex: Execution, spec: ToolSpec, amount: Decimal | float, currency: str
    ) -> None:
        """Spend a tool reports beyond tokens; only the pricing currency can count."""
        value = Decimal(str(amount))
        counted = currency == self.rt.settings.pricing.currency and value > 0
        data = {"tool": spec.name, "amount": float(value), "currency": currency, "counted": counted}
        if not counted:
            self.rt.runs.append(ex.claim, "UsageReported", data)
            return
        self._budget(ex).spent(released=0, tokens=0, cost=value, unknown=False)
        self.rt.runs.add_cost(ex.claim, value, data)

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
        self.rt.runs.append(ex.claim, "ToolCallAnsweredFromLedger", data)
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
        self.rt.runs.append(
            ex.claim,
            "ToolCallAnsweredFromLedger",
            {"tool": call.name, "callId": call.id, "executionId": execution_id},
        )
        return outcome

    def _execute_tool(
        self,
        ex: Execution,
        call_no: int,
        call: ToolCall,
        spec: ToolSpec | None,
        arguments: dict[str, Any],
        parse_error: str | None,
    ) -> ToolOutcome:
        reused_key = ex.chain.key_for((call.name, arguments_hash(arguments)))
        entry = self.ledger.start(ex.claim, call_no, call.id, call.name, arguments, reused_key)
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
            self.rt.runs.append(ex.claim, "CapabilityRetried", data)

        try:
            done = run_with_retries(
                spec, arguments, context, on_retry=announce_retry, sleep=self.sleep
            )
        except ToolError as exc:
            return ToolOutcome(
                ok=False, error_code=exc.code, error_message=str(exc), attempts=exc.attempts
            )
        return ToolOutcome(ok=True, result=done.result, attempts=done.attempts)


def stopped(signal: AbortSignal) -> RunCancelled | RunTakenAway:
    """Why an aborted run stops: a cancel request, or another owner took the run."""
    if signal.reason == TAKEN_AWAY:
        return RunTakenAway("the run was taken away from this process")
    return RunCancelled("the run was canceled" if signal.reason == CANCELED else signal.reason)


def initial_messages(agent: AgentSettings, run: Run) -> list[Message]:
    messages: list[Message] = []
    system = agent.instructions
    if run.parameters:
        system = f"{system}\n\nParameters: {json.dumps(run.parameters, sort_keys=True)}".strip()
    if system:
        messages.append({"role": "system", "content": system})
    history = run.input.get("messages")  # a whole conversation (the /v1 routes)
    if isinstance(history, list) and history:
        return messages + history
    messages.append({"role": "user", "content": str(run.input.get("message", ""))})
    return messages


def parse_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        return {"_raw": raw}, f"arguments are not valid JSON: {exc}"
    if not isinstance(value, dict):
        return {"_raw": raw}, "arguments must be a JSON object"
    return value, None


_ERROR_TYPES = {
    "configuration": ("configuration_error", ErrorClass.CONFIGURATION),
    "unavailable": ("provider_unavailable", ErrorClass.PROVIDER),
    "content_blocked": ("content_blocked", ErrorClass.PROVIDER),
}


def provider_error(exc: ProviderError, message: str | None = None) -> RunError:
    type_, error_class = _ERROR_TYPES.get(exc.kind, ("provider_error", ErrorClass.PROVIDER))
    return RunError(type_, error_class, message or str(exc), retry_after=exc.retry_after)


def chain_error(failures: list[tuple[Link, ProviderError]]) -> RunError:
    """The first failure, its message naming every provider the chain tried."""
    first = failures[0][1]
    if len(failures) == 1:
        return provider_error(first)
    tried = ", ".join(f"{link.provider_name} ({link.model})" for link, _error in failures)
    return provider_error(first, f"{first} (providers tried: {tried})")


def _config_failure(message: str) -> RunFailure:
    return RunFailure(RunError("configuration_error", ErrorClass.CONFIGURATION, message))
