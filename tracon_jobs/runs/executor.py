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

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tracon_jobs import leaving, logs, metrics, tracing
from tracon_jobs.abort import AbortSignal
from tracon_jobs.agents.tools import ToolRegistry, ToolSpec
from tracon_jobs.coordination.live_text import LiveText, TextSender, TurnWriter
from tracon_jobs.coordination.scripts import Later, deferring
from tracon_jobs.db import Database
from tracon_jobs.db.models import Run
from tracon_jobs.errors import (
    ClaimedElsewhere,
    ConfigurationError,
    MustPark,
    ProviderError,
    RunCanceled,
    RunTakenAway,
)
from tracon_jobs.limits.budget_store import BudgetStore, Limits
from tracon_jobs.limits.tenant_quotas import OwnQuota, Quotas
from tracon_jobs.limits.tenant_runs import MemoryTenantRunStore, TenantRuns
from tracon_jobs.limits.tree import (
    DEFAULT_OUTPUT_RESERVE,
    ChainUnreadable,
    Reservation,
    TreeBudget,
    estimate_tokens,
    open_budget,
)
from tracon_jobs.per_process import PerProcess
from tracon_jobs.pricing import price_at, price_before
from tracon_jobs.providers.base import (
    Message,
    ModelRequest,
    ModelResponse,
    Provider,
    ToolCall,
    can_stream,
)
from tracon_jobs.providers.registry import ProviderRegistry
from tracon_jobs.resilience.breaker import Admission, CircuitBreaker, Ticket, Transition
from tracon_jobs.resilience.cache import (
    ResponseCache,
    request_key,
    response_from_json,
    response_to_json,
)
from tracon_jobs.resilience.classify import classify
from tracon_jobs.resilience.concurrency import Slots
from tracon_jobs.resilience.rate_limits import (
    NOT_LIMITED,
    Admitted,
    MemoryRateStore,
    RateLimits,
)
from tracon_jobs.runs.approvals import ApprovalStore
from tracon_jobs.runs.continuation import chain_ledger
from tracon_jobs.runs.dispatch import RunDispatcher
from tracon_jobs.runs.execution import (
    Execution,
    Link,
    LinkFailed,
    LinkRejected,
    RunFailure,
    RunParks,
    RunWaits,
    chain_error,
    config_failure,
    stopped,
)
from tracon_jobs.runs.kinds import KindRunner
from tracon_jobs.runs.ledger import Ledger
from tracon_jobs.runs.lifecycle import AnyClaim, ErrorClass, RunError, RunStatus
from tracon_jobs.runs.live import CANCELED, LiveRuns
from tracon_jobs.runs.request_options import call_options, with_run_options
from tracon_jobs.runs.retries import Sleep
from tracon_jobs.runs.store import RunStore, TurnSpend
from tracon_jobs.runs.subagents import SubAgents, agent_tool_schema
from tracon_jobs.runs.toolcalls import (
    ToolCalls,
    WaitingForPerson,
    stop_unless_repeated,
    unanswered_calls,
)
from tracon_jobs.settings import AgentSettings, Settings
from tracon_jobs.tracing import genai

log = logging.getLogger(__name__)

REOPEN_MARGIN_SECONDS = 0.05
"""A run parked for an open circuit goes on this long after its reopen time: the timer that
sends it again and the circuit's clock (Redis's) are not the same clock."""


@dataclass(frozen=True)
class Resilience:
    """The cluster-wide guards around a model call: circuit, slots, tree budgets."""

    breaker: CircuitBreaker
    slots: Slots
    budgets: BudgetStore
    quotas: Quotas | None = None  # tenants' cost quotas, checked at the budget's gates
    rate_limits: RateLimits | None = None  # providers' requests and tokens a minute


class RunExecutor:
    """Claims a queued run and drives its tool-call loop to one fenced final write."""

    def __init__(
        self,
        settings: Settings,
        runs: RunStore,
        db: Database,
        tools: ToolRegistry,
        providers: ProviderRegistry,
        guards: Resilience,
        live_runs: LiveRuns,
        children: SubAgents,
        approvals: ApprovalStore,
        *,
        workflows: KindRunner | None = None,
        owner_id: str,
        draining: threading.Event,
        cache: ResponseCache | None = None,
        sleep: Sleep | None = None,
        live_text: LiveText | None = None,
        resume_later: Callable[[str, float, str], None] | None = None,
        tenant_runs: TenantRuns | None = None,
        dispatcher: RunDispatcher | None = None,
        child_ended: Callable[[Run], object] | None = None,
    ) -> None:
        self.child_ended = child_ended  # a fan-out's child ended here: its parent may go on
        self.resume_later = resume_later  # sends a parked run again when it may go on
        self.dispatcher = dispatcher  # its fair lines hear of each claim and each end
        self._ends_told: set[str] = set()  # runs whose end went with their final write
        self.tenant_runs = tenant_runs or TenantRuns(MemoryTenantRunStore(), None)
        self.settings = settings
        self.runs = runs
        self.db = db
        self.tools = tools
        self.providers = providers
        self.breaker = guards.breaker
        self.slots = guards.slots
        self.budgets = guards.budgets
        self.quotas = guards.quotas
        self.rate_limits = guards.rate_limits or RateLimits(MemoryRateStore(), {})
        self.live_runs = live_runs
        self.owner_id = owner_id
        self.draining = draining  # set once a graceful stop began: claim nothing new
        self.cache = cache  # agents' cached model responses (`Agents.<name>.Cache`)
        # streaming calls' text, live to followers, from one sender thread a process
        self.text_sender = None if live_text is None else PerProcess(lambda: TextSender(live_text))
        self.ledger = Ledger(runs)
        self.approvals = approvals
        self.workflows = workflows  # runs of kind `workflow` go to it
        self.tool_calls = ToolCalls(
            runs,
            self.ledger,
            approvals,
            children,
            self.execute,
            currency=settings.pricing.currency,
            concurrent=settings.tool_loop.allow_concurrent_tool_calls,
            sleep=sleep,
        )

    def execute(self, run_id: str) -> str:
        """Claim and run `run_id`; what happened, for logs and tests."""
        if self.draining.is_set():  # left Queued: the requeue scan sends it elsewhere
            log.info("draining: run %s not claimed", run_id)
            return "draining"
        claimed = self.runs.open_claim(run_id, self.owner_id)
        if claimed is None:
            log.info("run %s is not Queued; delivery acknowledged and dropped", run_id)
            self._done(run_id)  # (canceled while in its line, say): its place is free
            return "dropped"
        claim, run, own_quota = claimed
        own_runs = own_quota.max_concurrent_runs
        if not self.tenant_runs.admit(run.tenant_id, run_id, own_runs):  # nothing written
            self.runs.let_go(claim)
            self._done(run_id)
            metrics.run_parked("tenant_concurrency")
            log.info("run %s waits: its tenant runs its most at once", run_id)
            return "waiting_for_tenant"
        elsewhere = False
        taken: Later | None = None
        try:  # the claim commits with the first model call's `ModelCallStarted` (`open_claim`)
            # Redis calls nobody waits for (a spend, a success) go with the next call on the
            # same client, at the latest with the final event's publish: one round trip
            with (
                logs.run_context(run_id, agent=run.agent),
                deferring(),
                genai.execution(run, expected=(ClaimedElsewhere,)) as span,
            ):
                if run.kind == "agent" and not unanswered_calls(run.messages or []):
                    taken = self._taken_later(run_id)  # with its first model call's gate
                else:  # a workflow, or tool calls first: the lines must not wait for them
                    self._taken(run_id)
                outcome = self._execute_claimed(claim, run, own_quota)
                span.set("tracon.run.outcome", outcome)
                return outcome
        except ClaimedElsewhere:  # a duplicate delivery that lost the race: nothing ran here
            log.info("run %s was claimed by another worker first; delivery dropped", run_id)
            elsewhere = True  # its place is the claiming worker's now
            self.tenant_runs.forget(run_id)
            return "dropped"
        finally:
            self.runs.let_go(claim)
            if not elsewhere:
                self._give_back_place(run.tenant_id, run_id)
            if taken is not None and self.dispatcher is not None:
                self.dispatcher.send_handed_over(taken)
            told = run_id in self._ends_told
            self._ends_told.discard(run_id)
            if not elsewhere and not told:  # (a duplicate that lost the race holds no place)
                self._done(run_id)

    def _taken(self, run_id: str) -> None:
        """The fair lines hear that a worker took `run_id`: it runs, its place taken."""
        if self.dispatcher is not None:
            self.dispatcher.taken(run_id)

    def _done(self, run_id: str) -> None:
        """The fair lines hear that `run_id` holds no place here any more; the runs it makes
        room for go."""
        if self.dispatcher is not None:
            self.dispatcher.done(run_id)

    def end_with_final_write(self, run_id: str) -> None:
        """The fair lines hear of the run's end with its final write's publish (one round
        trip for both; called just before that write, on the run's thread, inside `execute`);
        `execute` then tells them nothing more."""
        if self.dispatcher is not None and self.dispatcher.done_later(run_id) is not None:
            self._ends_told.add(run_id)
            leaving.told()  # the next run's message may come before this thread is idle

    def _taken_later(self, run_id: str) -> Later | None:
        """`_taken`, sent with the next Redis call of this thread (or at once)."""
        return None if self.dispatcher is None else self.dispatcher.taken_later(run_id)

    def _give_back_place(self, tenant_id: str, run_id: str) -> None:
        """The run lets go of its tenant's place: the runs given places are sent again (one
        that no longer waits, canceled meanwhile, passes its place on)."""
        limit = self.tenant_runs.limit_of(run_id)
        given = self.tenant_runs.release(tenant_id, run_id)
        while given and limit is not None:
            next_id = given.pop(0)
            waiting = self.runs.get(next_id)
            if waiting is not None and waiting.status == RunStatus.QUEUED.value:
                if self.resume_later is not None:
                    self.resume_later(next_id, 0, "tenant_concurrency")
            else:
                given += self.tenant_runs.pass_on(tenant_id, next_id, limit)

    def _execute_claimed(self, claim: AnyClaim, run: Run, own_quota: OwnQuota | None = None) -> str:
        run_id = claim.run_id
        unknown = self._unknown_here(run)
        if unknown is not None:
            return self._leave_for_another_worker(claim, run, unknown)
        signal = AbortSignal()
        self.live_runs.register(claim, signal)
        if run.cancel_requested_at is not None:  # canceled between its claim and now
            signal.abort(CANCELED)
        try:
            status = self._run_to_end(claim, run, signal, own_quota)
        except ClaimedElsewhere:
            raise
        except RunTakenAway:
            log.warning("run %s was taken away from fence %s; stopping", run_id, claim.fence)
            return "taken_away"
        finally:
            self.live_runs.unregister(run_id)
        if status.is_terminal and run.parent_run_id is not None:
            self._tell_parent(run)
        return status.value

    def _tell_parent(self, child: Run) -> None:
        """A child ended: a workflow parent waiting on a fan-out of it may go on now. Its
        end is committed already; a failure here only leaves it to the timer scan."""
        if self.child_ended is None:
            return
        try:
            self.child_ended(child)
        except Exception:
            log.exception("run %s: its parent's fan-out was not looked at", child.id)

    def _unknown_here(self, run: Run) -> str | None:
        """What this worker's configuration lacks to run `run` (an older deploy), if anything."""
        if run.kind == "workflow":
            if self.workflows is None or not self.workflows.knows(run.agent):
                return f"workflow '{run.agent}'"
            return None
        agent = self.settings.agents.get(run.agent)
        if agent is None:
            return f"agent '{run.agent}'"
        missing = [name for name in agent.tools if self.tools.get(name) is None]
        return f"tool '{missing[0]}' (of agent '{run.agent}')" if missing else None

    def _leave_for_another_worker(self, claim: AnyClaim, run: Run, unknown: str) -> str:
        """Release a run this worker cannot execute; fail it once nobody could for a while.

        A worker that knows the run re-claims it after the requeue scan re-sends it; when
        `Runs.RequeueAfter` has passed since it was submitted and it still reached only
        workers that lack it, no worker has it, and the run fails saying what is missing.
        """
        deadline = run.created_at + self.settings.runs.requeue_after
        if run.heartbeat_at is not None and run.heartbeat_at >= deadline:
            error = RunError(
                "configuration_error",
                ErrorClass.CONFIGURATION,
                f"no worker has {unknown} configured (waited Runs.RequeueAfter, "
                f"{self.settings.runs.requeue_after.total_seconds():g}s, for one)",
            )
            self.runs.finish(claim, RunStatus.FAILED, error=error)
            log.error("run %s failed: no worker has %s", run.id, unknown)
            return RunStatus.FAILED.value
        log.warning("run %s left queued: %s is not configured on %s", run.id, unknown, claim.owner)
        self.runs.release(claim, f"{unknown} is not configured on worker {claim.owner}")
        return "released"

    def _run_to_end(
        self, claim: AnyClaim, run: Run, signal: AbortSignal, own_quota: OwnQuota | None = None
    ) -> RunStatus:
        if run.kind == "workflow" and self.workflows is not None:
            # the workflow writes through stores of its own: they take the claim made
            return self.workflows.run(self.runs.settle(claim), run, signal, own_quota)
        execution: Execution | None = None
        try:
            execution = self._prepare(claim, run, signal, own_quota)
            output = self._tool_loop(execution)
        except RunWaits:  # saved `Waiting` already: no final write, the thread is free
            return RunStatus.WAITING
        except RunParks:  # saved `Queued` to go on later: no final write either
            return RunStatus.QUEUED
        except RunFailure as failure:
            self._flush_spend(execution)
            if failure.blocked is not None:
                data = {**failure.blocked, "message": failure.error.message}
                self.runs.append(claim, "RunContinuationBlocked", data)
            return self._finish(claim, RunStatus.FAILED, execution, error=failure.error)
        except RunCanceled as cancelled:
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
        claim: AnyClaim,
        status: RunStatus,
        execution: Execution | None,
        *,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
    ) -> RunStatus:
        attempts = execution.attempts if execution and execution.attempts else None
        spend = execution.pending_spend if execution else None
        self.end_with_final_write(claim.run_id)
        closed = self.runs.finish(
            claim, status, output=output, error=error, attempts=attempts, spend=spend
        )
        if closed is None:
            raise RunTakenAway(claim.run_id)
        self._forget_streamed(execution)
        return status

    @staticmethod
    def _forget_streamed(execution: Execution | None) -> None:
        if execution is not None and execution.streamed is not None:
            execution.streamed.forget()
            execution.streamed = None

    def _flush_spend(self, execution: Execution | None) -> None:
        """Write the last model call's spend now, when an event must follow it before the
        final write (which otherwise takes it along)."""
        if execution is not None and execution.pending_spend is not None:
            spend, data = execution.pending_spend
            execution.pending_spend = None
            self.runs.record_spend(execution.claim, spend, data)
            self._forget_streamed(execution)

    # -- preparation -------------------------------------------------------------------

    def _prepare(
        self, claim: AnyClaim, run: Run, signal: AbortSignal, own_quota: OwnQuota | None = None
    ) -> Execution:
        configured = self.settings.agents.get(run.agent)
        if configured is None:
            raise config_failure(f"agent '{run.agent}' is not configured")
        agent = with_run_options(configured, run.input)  # a /v1 request's temperature, ...
        tools = self._resolve_tools(agent)
        first_call = 0 if claim.fence == 1 else self.ledger.next_turn(run.id)
        try:
            chain = chain_ledger(self.db, run)
            budget = self._open_budget(run, own_quota)
        except ChainUnreadable as exc:
            error = RunError("chain_unreadable", ErrorClass.INFRASTRUCTURE, str(exc))
            raise RunFailure(error) from exc
        return Execution(
            claim, run, agent, tools, signal, first_call, first_call, chain=chain, budget=budget
        )

    def _open_budget(self, run: Run, own_quota: OwnQuota | None) -> TreeBudget:
        """The tree's shared budget, seeded from SQL (the chain read once, all or nothing)."""
        limits = Limits.from_settings(self.settings.agent_graph)
        currency = self.settings.pricing.currency
        return open_budget(self.budgets, self.db, limits, run, currency, self.quotas, own_quota)

    def _resolve_tools(self, agent: AgentSettings) -> dict[str, ToolSpec]:
        tools: dict[str, ToolSpec] = {}
        for name in agent.tools:
            spec = self.tools.get(name)
            if spec is None:
                raise config_failure(f"tool '{name}' is not registered (check ToolModules)")
            tools[name] = spec
        return tools

    def _link(self, position: int, provider_name: str, model: str) -> Link:
        try:
            provider = self.providers.get(provider_name)
        except (ProviderError, ConfigurationError) as exc:
            raise config_failure(str(exc)) from exc
        return Link(position, provider_name, model, provider)

    # -- the fallback chain ------------------------------------------------------------

    def _tool_loop(self, ex: Execution) -> dict[str, Any]:
        failures: list[tuple[Link, ProviderError]] = []
        refused: list[float] = []  # the reopen times of the links open circuits refused
        links = ex.agent.model.links()
        for position, (provider_name, model) in enumerate(links):
            link = self._link(position, provider_name, model)
            if failures:
                self._announce_fallback(ex, failures[0][0], link, failures[-1][1])
            try:
                return self._link_loop(ex, link)
            except LinkFailed as failed:
                failures.append((link, failed.error))
                if failed.refused and failed.error.retry_after:
                    refused.append(failed.error.retry_after)
                if not failed.transient:
                    break
        if self.settings.runs.park_on_open_circuit and len(refused) == len(failures) == len(links):
            # every link refused by an open circuit, each with its reopen time: nothing was
            # called, so the run goes on from where it was claimed once the first may probe
            messages = list(ex.run.messages or initial_messages(ex.agent, ex.run))
            raise self._park(
                ex,
                MustPark("circuit_open", min(refused) + REOPEN_MARGIN_SECONDS),
                messages,
                ex.run.turns_completed,
            )
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
        self.runs.append(ex.claim, "ModelFallbackUsed", data)
        tracing.current_span().event(
            "tracon.fallback",
            {
                "tracon.fallback.from": primary.provider_name,
                "tracon.fallback.to": fallback.provider_name,
                "tracon.fallback.reason": str(reason),
            },
        )

    def _link_loop(self, ex: Execution, link: Link) -> dict[str, Any]:
        """One link's whole tool-call loop, under one circuit admission.

        The admission is sent with the link's first budget gate, in one round trip, and read
        right after it, before anything reaches the provider (`_Admission`)."""
        started = time.monotonic()
        ex.link_first_call = ex.next_call
        try:
            admission = _Admission(
                self.breaker.admit_later(link.provider_name),
                self.breaker.release,
                lambda change: self._report_circuit(ex, link.provider_name, change),
            )
        except ProviderError as exc:  # the circuit is open: the provider is never called
            self._attempt_log(ex, link, started, exc, rejected=True)
            raise LinkFailed(exc, transient=True, refused=True) from exc
        try:
            output = self._conversation(ex, link, admission)
        except LinkRejected as rejected:
            self._attempt_log(ex, link, started, rejected.error, rejected=True)
            raise LinkFailed(rejected.error, transient=True, refused=True) from rejected.error
        except LinkFailed as failed:
            self._attempt_log(ex, link, started, failed.error)
            raise
        finally:
            admission.release()
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
        self.runs.append(ex.claim, "CircuitStateChanged", data)
        tracing.current_span().event(
            "tracon.circuit",
            {"tracon.provider": provider, "from": change.before, "to": change.after},
        )

    # -- one link's conversation -------------------------------------------------------

    def _conversation(self, ex: Execution, link: Link, admission: _Admission) -> dict[str, Any]:
        messages: list[Message] = list(ex.run.messages or initial_messages(ex.agent, ex.run))
        index = ex.run.turns_completed
        waited_in = unanswered_calls(messages)
        if waited_in:  # back from waiting for a person: finish that turn first
            admission.ticket()  # its tool calls run inside the link's admission
            ex.claim = self.runs.settle(ex.claim)  # made before the ledger's writes
            call_no = self.approvals.pending_turn(ex.run.id)
            assert call_no is not None, "a run waits in a turn that asked for approval"
            ex.next_call = max(ex.next_call, call_no + 1)
            ex.ensure_live()
            messages.extend(self._answer_turn(ex, link, call_no, waited_in, messages, index))
            index += 1
            self.runs.save_turn(ex.claim, messages, index)
        while index < self.settings.runs.max_turns:
            ex.ensure_live()
            try:
                response = self._model_call(ex, link, admission, messages, index)
            except MustPark as park:
                raise self._park(ex, park, messages, index) from None
            if not response.tool_calls:
                stop_unless_repeated(ex, [])  # an answer without the in-flight call is a stop
                return {"text": response.text or ""}
            messages.append(response.as_message())
            call_no = ex.next_call
            ex.next_call += 1
            messages.extend(
                self._answer_turn(ex, link, call_no, response.tool_calls, messages, index)
            )
            index += 1
            self.runs.save_turn(ex.claim, messages, index)
        raise RunFailure(
            RunError(
                "max_turns_exceeded",
                ErrorClass.QUOTA_EXCEEDED,
                f"the run used all {self.settings.runs.max_turns} model turns "
                "(raise Tracon:Runs:MaxTurns)",
            )
        )

    def _answer_turn(
        self,
        ex: Execution,
        link: Link,
        call_no: int,
        calls: list[ToolCall],
        messages: list[Message],
        index: int,
    ) -> list[Message]:
        """The turn's tool results; or the run saved `Waiting` for a person, and stopped."""
        try:
            return self.tool_calls.answer_turn(ex, link, call_no, calls)
        except WaitingForPerson as waiting:
            claim = self.runs.settle(ex.claim)  # made by the turn's model call
            ids = self.approvals.wait_for(claim, waiting.requests, messages, index)
            log.info("run %s waits for approvals %s", ex.claim.run_id, ", ".join(ids))
            tracing.current_span().event(
                "tracon.approval.wait",
                {"tracon.approval.ids": ids, "tracon.tools": [r.tool for r in waiting.requests]},
            )
            raise RunWaits(ids) from None

    def _model_call(
        self,
        ex: Execution,
        link: Link,
        admission: _Admission,
        messages: list[Message],
        index: int,
    ) -> ModelResponse:
        binding = ex.agent.model
        self.tenant_runs.renew(ex.run.tenant_id, ex.run.id)
        request = ModelRequest(
            model=link.model,
            messages=messages,
            tools=[spec.openai_schema() for spec in ex.tools.values()]
            + [agent_tool_schema(name) for name in ex.agent.sub_agents],
            temperature=binding.temperature,
            top_p=binding.top_p,
            max_output_tokens=binding.max_output_tokens,
            response_format=binding.response_format,
            **call_options(ex.run.input),  # a /v1 request's stop, seed, ...
        )
        try:
            reserved, cap = self._budget_for_model_call(ex, link, messages)  # with admission
        except RunFailure:
            admission.ticket()  # an open circuit answers first, as when asked before the gate
            raise
        if cap is not None:  # the tree's budget has less room than the call would ask
            request = dataclasses.replace(request, max_output_tokens=cap)
        # a call not made (circuit open, run taken away) or failed hands its tokens back
        with (
            self._model_call_span(link, request, index) as span,
            ex.tree_budget().reservation(reserved) as reservation,
        ):
            ticket = admission.ticket()
            span.set("tracon.circuit.decision", _decision(ticket))
            cache_key, cached = self._cached(ex, link, request)
            limited = NOT_LIMITED  # a cached answer calls nobody: no rate limit holds it
            slot = contextlib.ExitStack()  # the provider's concurrency slot, held for the call
            try:  # before the call is started: a call parked waits in no event of its own
                if cached is None:
                    waited = time.monotonic()
                    limited = self._rate_admitted(ex, link, request)
                    span.set("tracon.wait.rate_limit_ms", _ms_since(waited))
                    park_after = self.settings.runs.park_after.total_seconds()
                    waited = time.monotonic()
                    slot.enter_context(
                        self.slots.hold(link.provider_name, ex.signal, park_after=park_after)
                    )
                    span.set("tracon.wait.slot_ms", _ms_since(waited))
            except ProviderError as exc:  # canceled while it waited
                raise self._model_call_failed(ex, link, ticket, exc) from exc
            with slot:
                opened: dict[str, Any] = {"turn": index, **link.label()}
                if cap is not None:
                    opened["maxOutputTokens"] = cap
                started = self.runs.append(ex.claim, "ModelCallStarted", opened)
                if cached is not None:
                    self._record_spend(ex, link, cached, index, reservation, cached=True)
                    return cached
                writer = self._turn_writer(ex, link.provider, started.seq)
                try:
                    with metrics.timed_model_call(link.provider_name, link.model):
                        provider = link.provider
                        if writer is not None and can_stream(provider):
                            response = provider.stream(request, ex.signal, writer.text)
                            writer.close()
                        else:
                            response = provider.complete(request, ex.signal)
                except ProviderError as exc:
                    if writer is not None:
                        writer.withdraw()
                    if exc.status == 429:  # the provider's word: no call of it before then
                        self.rate_limits.learn(link.provider_name, link.model, exc.retry_after)
                    raise self._model_call_failed(ex, link, ticket, exc, started=True) from exc
                except BaseException:
                    if writer is not None:
                        writer.withdraw()
                    raise
            self._record_spend(ex, link, response, index, reservation, ticket=ticket)
            self.rate_limits.used(limited, response.usage.total_tokens)
            self.rate_limits.learn(link.provider_name, link.model, response.provider_wait)
            if writer is not None:
                if response.tool_calls:  # its ModelCallCompleted is written: text not needed
                    writer.forget()
                else:  # written with the run's final write
                    ex.streamed = writer
        if cache_key is not None and self.cache is not None:
            config = ex.agent.cache
            ttl_ms = int(config.ttl.total_seconds() * 1000)
            value = response_to_json(response)
            self.cache.put(ex.run.agent, cache_key, value, ttl_ms, config.max_entries)
        return response

    def _model_call_span(
        self, link: Link, request: ModelRequest, turn: int
    ) -> contextlib.AbstractContextManager[tracing.Span]:
        if not tracing.on():
            return tracing.OFF
        provider = self.settings.providers.get(link.provider_name)
        kind = provider.kind if provider is not None else link.provider_name
        return genai.model_call(
            kind, link.provider_name, link.position, request, turn, expected=(MustPark,)
        )

    def _rate_admitted(self, ex: Execution, link: Link, request: ModelRequest) -> Admitted:
        """Wait, if the provider's rate limits are spent, until the call may start (see
        `resilience.rate_limits`); the call's tokens are its input and its `max_tokens`.
        `MustPark` when the wait would pass `Runs.ParkAfter`."""
        if not self.rate_limits.scopes(link.provider_name, link.model):
            return NOT_LIMITED
        tokens = estimate_tokens(request.messages) + (
            request.max_output_tokens or DEFAULT_OUTPUT_RESERVE
        )
        park_after = self.settings.runs.park_after.total_seconds()
        return self.rate_limits.admit(
            link.provider_name, link.model, tokens, ex.signal, park_after=park_after
        )

    def _park(self, ex: Execution, park: MustPark, messages: list[Message], index: int) -> RunParks:
        """Save the run `Queued` with its conversation, to go on in `park.seconds` (sent
        again then by `resume_later`, or by the requeue scan after a crash)."""
        self.runs.park(ex.claim, park.seconds, park.reason, messages, index)
        metrics.run_parked(park.reason)
        tracing.current_span().event(
            "tracon.parked",
            {"tracon.park.reason": park.reason, "tracon.park.seconds": park.seconds},
        )
        log.info("run %s parked for %.1fs: %s", ex.claim.run_id, park.seconds, park.reason)
        if self.resume_later is not None:
            self.resume_later(ex.claim.run_id, park.seconds, "parked")
        return RunParks(park.seconds)

    def _turn_writer(self, ex: Execution, provider: Provider, call_seq: int) -> TurnWriter | None:
        """The live text of a streaming call (None: the provider does not stream, and the
        text reaches followers with the call's `ModelCallCompleted`)."""
        if self.text_sender is None or not can_stream(provider):
            return None
        return TurnWriter(self.text_sender.get(), ex.run.id, call_seq)

    def _cached(
        self, ex: Execution, link: Link, request: ModelRequest
    ) -> tuple[str | None, ModelResponse | None]:
        """(the request's cache key, a cached answer) when the agent caches its responses.

        Looked up here, inside the link's loop: its circuit admitted the loop already, so an
        open circuit blocks a call whatever the cache holds."""
        if self.cache is None or not ex.agent.cache.enabled:
            return None, None
        key = request_key(link.provider_name, request)
        found = self.cache.get(ex.run.agent, key)
        return key, None if found is None else response_from_json(found)

    def _budget_for_model_call(
        self, ex: Execution, link: Link, messages: list[Message]
    ) -> tuple[int, int | None]:
        """Refuse the call when the tree is spent; else (the tokens reserved for it, the
        most output tokens it may ask for, None when the budget does not cap it)."""
        price = price_before(self.settings.pricing, link.model)
        gate = ex.tree_budget().gate_model_call(messages, ex.agent.model.max_output_tokens, price)
        if gate.refusal is not None:
            refusal = gate.refusal
            raise RunFailure(RunError(refusal.type, ErrorClass.QUOTA_EXCEEDED, refusal.message))
        return gate.reserved, gate.output_cap

    def _model_call_failed(
        self,
        ex: Execution,
        link: Link,
        ticket: Ticket,
        exc: ProviderError,
        *,
        started: bool = False,
    ) -> Exception:
        """What stops the link (or the run) after a failed call; `started`: its
        `ModelCallStarted` is written, so its followers must see it end."""
        if exc.kind == "cancelled" and ex.signal.aborted:
            reason = stopped(ex.signal)
            if started and isinstance(reason, RunCanceled):  # taken away: not ours to write
                self._model_call_canceled(ex, link, reason)
            return reason
        verdict = classify(exc)
        data = {
            **link.label(),
            "status": exc.status,
            "kind": exc.kind,
            "message": str(exc),
            "counted": verdict.counts,
        }
        self.runs.append(ex.claim, "ModelCallFailed", data)
        if verdict.counts:
            change = self.breaker.failure(ticket, exc.retry_after)
            self._report_circuit(ex, link.provider_name, change)
        return LinkFailed(exc, verdict.transient)

    def _model_call_canceled(self, ex: Execution, link: Link, reason: RunCanceled) -> None:
        """The call's end, before the run's `RunCanceled`: the cancel cut it."""
        data = {
            **link.label(),
            "status": None,
            "kind": "canceled",
            "message": str(reason),
            "counted": False,
        }
        self.runs.append(ex.claim, "ModelCallFailed", data)

    def _record_spend(
        self,
        ex: Execution,
        link: Link,
        response: ModelResponse,
        index: int,
        reservation: Reservation,
        *,
        cached: bool = False,
        ticket: Ticket | None = None,
    ) -> None:
        """Count the call's spend (tree budget, tenant quota) and, with the link's `ticket`,
        record its success in the circuit: one Redis script for all three. Then the spend
        goes to SQL, with the turn or with the run's final write."""
        pricing = self.settings.pricing
        amount, source = price_at(pricing, link.model, response.model, response.usage)
        if cached:  # nothing was spent: a known zero, whatever the model's price
            amount, source = Decimal(0), "Configured"
        usage = response.usage
        currency = self.settings.pricing.currency
        genai.answered(response, amount, currency, source, cached)
        metrics.model_spend(
            link.provider_name,
            response.model,
            usage.input_tokens,
            usage.output_tokens,
            float(amount),
            currency,
        )
        with deferring():  # the spends wait for the next call that needs a reply (`execute`)
            reservation.spent_by(
                tokens=response.usage.total_tokens,
                cost=amount,
                unknown=source == "Unknown",
            )
            change = None if ticket is None else self.breaker.success(ticket)
        if ticket is not None:
            self._report_circuit(ex, link.provider_name, change)
        spend = TurnSpend(
            model_id=link.model,  # the configured model of the link that answered
            input_tokens=response.usage.input_tokens,
            output_tokens=response.usage.output_tokens,
            cost=amount,
            cost_source=source,
        )
        data = {
            "turn": index,
            "provider": link.provider_name,
            "model": link.model,
            "providerModel": response.model,  # the provider's own name for it
            "finishReason": response.finish_reason,
            "text": response.text or "",
            "toolCalls": len(response.tool_calls),
            "usage": {
                "inputTokens": spend.input_tokens,
                "outputTokens": spend.output_tokens,
                "cachedInputTokens": usage.cached_input_tokens,
                "cacheWriteInputTokens": usage.cache_write_input_tokens,
            },
            "cost": {"amount": float(amount), "source": source},
            "cached": cached,
        }
        if response.tool_calls:
            self.runs.record_spend(ex.claim, spend, data)
        else:  # the answer: its spend goes in with the run's final write
            ex.pending_spend = (spend, data)


class _Admission:
    """A link's circuit admission, read once: with the link's first budget gate (one round
    trip for both), or on its own before a resumed turn's tool calls.

    It holds only what it uses: the breaker's pending admission, the release of its
    ticket, and the report of a circuit change (the run's `CircuitStateChanged` event)."""

    def __init__(
        self,
        pending: Callable[[], Ticket],
        release: Callable[[Ticket], None],
        report: Callable[[Admission | None], None],
    ) -> None:
        self.pending: Callable[[], Ticket] | None = pending
        self.release_ticket = release
        self.report = report
        self.admitted: Ticket | None = None

    def ticket(self) -> Ticket:
        """The link's ticket; `LinkRejected` while the circuit is open (the call's
        reservation, left by this exception, hands its tokens back)."""
        if self.admitted is not None:
            return self.admitted
        assert self.pending is not None, "a rejected link is not used again"
        pending, self.pending = self.pending, None
        try:
            ticket = pending()
        except ProviderError as exc:
            tracing.current_span().set("tracon.circuit.decision", "rejected")
            raise LinkRejected(exc) from exc
        self.admitted = ticket
        self.report(ticket.change)
        return ticket

    def release(self) -> None:
        """The loop ended: free its probe lease if it held one (reading an admission the
        loop never needed, so that a probe it took is not left held)."""
        if self.admitted is None and self.pending is not None:
            try:
                self.ticket()
            except LinkRejected:
                return
        if self.admitted is not None:
            self.release_ticket(self.admitted)


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


def _decision(ticket: Ticket) -> str:
    """The breaker's word on a call, for its span: a half-open probe, admitted by a closed
    circuit, or not tracked (the breaker is off, or its store did not answer)."""
    return "probe" if ticket.probe else "admitted" if ticket.tracked else "not_tracked"


def _ms_since(started: float) -> int:
    return round((time.monotonic() - started) * 1000)
