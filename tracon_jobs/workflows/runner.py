"""Executing a claimed workflow run: replay the function, answer finished nodes from the
chain's checkpoints, run the rest, and end with one fenced final write (or `Waiting`).

    claim -> the version that executes it recorded on the run (when it was created elsewhere)
          -> chain read once (all of it, or the run fails before its first node)
          -> versions: every checkpoint replayed was written by this code, or by a version it
             declares it replays (`compatible`, `ctx.patched`), or the run fails
             (`workflow_version_mismatch`) before its first node
          -> budget of the logical run (the chain's spend carried)
          -> fn(ctx, input): per node: checkpoint? replay : [budget gate -> run -> checkpoint]
          -> Completed {result} | Failed | Canceled
             | Waiting (a question for a person, a timer, an event: `Waits`)
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from tracon_jobs import tracing
from tracon_jobs.abort import AbortSignal
from tracon_jobs.db.models import Run
from tracon_jobs.errors import RunCanceled, RunTakenAway
from tracon_jobs.limits.budget_store import BudgetStore, Limits, Refusal
from tracon_jobs.limits.tenant_quotas import OwnQuota, Quotas
from tracon_jobs.limits.tree import ChainUnreadable, TreeBudget, open_budget
from tracon_jobs.runs.dispatch import submission
from tracon_jobs.runs.execution import stopped
from tracon_jobs.runs.lifecycle import Claim, ErrorClass, RunError, RunStatus
from tracon_jobs.runs.store import NewRun, RunStore
from tracon_jobs.runs.subagents import SubAgents
from tracon_jobs.settings import Settings
from tracon_jobs.tracing import genai
from tracon_jobs.workflows import fanout
from tracon_jobs.workflows.context import TIMED_OUT, WorkflowContext
from tracon_jobs.workflows.fanout import Branch, OnFailure
from tracon_jobs.workflows.registry import WorkflowRegistry, WorkflowSpec
from tracon_jobs.workflows.store import FANOUT, PATCH, WAITS, Recorded, WorkflowStore

log = logging.getLogger(__name__)

STEP_THREADS = 8
"""The most function branches of one fan-out that run at once on the parent's worker."""


class WorkflowStop(BaseException):
    """Ends the workflow run `Failed` with a typed error (a refused or failed node)."""

    def __init__(self, error: RunError) -> None:
        super().__init__(error.message)
        self.error = error


class Waits(BaseException):
    """The function reached a wait the chain has no answer for: the run waits (`Waiting`,
    no thread held) for a person (`ask`), a time (`timer`) or an event (`event`)."""

    def __init__(
        self,
        node: str,
        kind: str,
        *,
        payload: Any = None,
        until: datetime | timedelta | None = None,
        event: str = "",
        chain: str = "",
    ) -> None:
        super().__init__(node)
        self.node = node
        self.kind = kind
        self.payload = payload
        self.until = until  # a timer's time, an event wait's timeout (None: none)
        self.event = event
        self.chain = chain  # an event wait's chain (its first run): where its events are kept


class WorkflowRunner:
    """Runs claimed workflow runs; the executor hands it every run of kind `workflow`
    (the `runs.kinds.KindRunner` the composition root gives it)."""

    def __init__(
        self,
        settings: Settings,
        runs: RunStore,
        store: WorkflowStore,
        registry: WorkflowRegistry,
        budgets: BudgetStore,
        children: SubAgents,
        run_inline: Callable[[str], object],
        quotas: Quotas | None = None,
        event_waited: Callable[[str], object] | None = None,
        fanout_waited: Callable[[str], object] | None = None,
        ending: Callable[[str], object] | None = None,
    ) -> None:
        self.settings = settings
        self.runs = runs
        self.store = store
        self.registry = registry
        self.budgets = budgets
        self.children = children
        self.run_inline = run_inline  # executes a child nobody claimed, on this thread
        self.quotas = quotas  # tenants' cost quotas, checked where the budget is
        self.event_waited = event_waited  # gives a run that now waits the event kept for it
        self.fanout_waited = fanout_waited  # answers a fan-out whose branches ended first
        self.ending = ending  # hears of a run's end just before its final write

    def knows(self, name: str) -> bool:
        return self.registry.knows(name)

    def run(
        self, claim: Claim, run: Run, signal: AbortSignal, own_quota: OwnQuota | None = None
    ) -> RunStatus:
        """`own_quota`: the tenant's quota row as the claim read it (else read here)."""
        spec = self.registry.get(run.agent)
        assert spec is not None, "the executor checks the workflow is known before it runs"
        try:
            execution = self._prepare(claim, run, signal, own_quota)
        except ChainUnreadable as exc:
            error = RunError("chain_unreadable", ErrorClass.INFRASTRUCTURE, str(exc))
            return self._finish(claim, RunStatus.FAILED, error=error)
        except SQLAlchemyError as exc:  # outlasted `Database.OutageRetry`, or not an outage
            log.exception("workflow run %s could not be prepared", run.id)
            error = RunError("database_error", ErrorClass.INFRASTRUCTURE, _database_error(exc))
            return self._finish(claim, RunStatus.FAILED, error=error)
        except WorkflowStop as stop:  # its chain was written by code this one does not replay
            log.error("workflow run %s not replayed: %s", run.id, stop.error.message)
            return self._finish(claim, RunStatus.FAILED, error=stop.error)
        try:
            result = spec.function(WorkflowContext(execution), dict(run.input or {}))
            json.dumps(result)
            execution.flush_replays()
        except Waits as waiting:
            execution.flush_replays()
            self._wait(claim, waiting)
            log.info("workflow run %s waits (%s) at %s", run.id, waiting.kind, waiting.node)
            return RunStatus.WAITING
        except WorkflowStop as stop:
            return self._finish(claim, RunStatus.FAILED, error=stop.error)
        except RunCanceled as canceled:
            error = RunError("canceled", ErrorClass.CANCELLATION, str(canceled) or "canceled")
            return self._finish(claim, RunStatus.CANCELED, error=error)
        except RunTakenAway:
            raise
        except Exception as exc:  # the workflow's own code raised, or returned no JSON
            log.exception("workflow run %s failed", run.id)
            error = RunError("workflow_failed", ErrorClass.INTERNAL, f"{type(exc).__name__}: {exc}")
            return self._finish(claim, RunStatus.FAILED, error=error)
        return self._finish(claim, RunStatus.COMPLETED, output={"result": result})

    def _wait(self, claim: Claim, waiting: Waits) -> None:
        if waiting.kind == "ask":
            self.store.ask(claim, waiting.node, waiting.payload)
        elif waiting.kind == "timer":
            assert waiting.until is not None, "a timer has its time"
            self.store.sleep(claim, waiting.node, waiting.until)
        elif waiting.kind == FANOUT:
            self.store.wait_fanout(claim, waiting.node)
            if self.fanout_waited is not None:  # its branches may all have ended meanwhile
                self.fanout_waited(claim.run_id)
        else:
            timeout = waiting.until if isinstance(waiting.until, timedelta) else None
            self.store.await_event(claim, waiting.node, waiting.event, timeout, waiting.chain)
            if self.event_waited is not None:  # an event kept while the wait was written
                self.event_waited(claim.run_id)

    def _prepare(
        self, claim: Claim, run: Run, signal: AbortSignal, own_quota: OwnQuota | None = None
    ) -> WorkflowExecution:
        spec = self.registry.get(run.agent)
        assert spec is not None, "the executor checks the workflow is known before it runs"
        if run.workflow_version != spec.version:  # created by a process that runs other code
            self.store.record_version(claim, spec.version)
            run.workflow_version = spec.version
        lineage = self.store.lineage(run)
        chain = lineage.ids
        counted = set(lineage.since_restart) if self._checkpointing else set()
        # A run that continues nothing, claimed for the first time, has nothing recorded yet
        # (a node is written only under its run's own claim): no read for it.
        first = len(chain) == 1 and claim.fence == 1
        recorded = {} if first else self._replayable(chain, counted)
        older = _older_versions(spec, recorded)
        limits = Limits.from_settings(self.settings.agent_graph)
        currency = self.settings.pricing.currency
        budget = open_budget(
            self.budgets, self.runs.db, limits, run, currency, self.quotas, own_quota
        )
        return WorkflowExecution(
            self,
            claim,
            run,
            signal,
            budget,
            recorded,
            logical_id=chain[-1],
            older=older,
            counted=[run_id for run_id in chain if run_id in counted and run_id != run.id],
        )

    @property
    def _checkpointing(self) -> bool:
        """Whether a replay answers from checkpoints (`EnableCheckpointing`); the answers to
        waits it always has."""
        return self.settings.workflows.enable_checkpointing

    def _replayable(self, chain: list[str], counted: set[str]) -> dict[str, Recorded]:
        """What the replay answers: the answers to the waits of the whole chain (a person's,
        a timer's firing, an event: they are input, not results), and the checkpoints of
        the runs since the job last started the workflow again from its first node (none
        without `EnableCheckpointing`)."""
        recorded = self.store.recorded(chain)
        return {
            node: hit
            for node, hit in recorded.items()
            if hit.kind in WAITS or hit.kind == PATCH or hit.run_id in counted
        }

    def _finish(
        self,
        claim: Claim,
        status: RunStatus,
        *,
        output: dict[str, Any] | None = None,
        error: RunError | None = None,
    ) -> RunStatus:
        if self.ending is not None:  # (what it queues goes with the final write's publish)
            self.ending(claim.run_id)
        if self.runs.finish(claim, status, output=output, error=error) is None:
            raise RunTakenAway(claim.run_id)
        return status


@dataclass
class WorkflowExecution:
    """One execution of a workflow function: its nodes, in the order the code reaches them."""

    runner: WorkflowRunner
    claim: Claim
    run: Run
    signal: AbortSignal
    budget: TreeBudget
    recorded: dict[str, Recorded]
    logical_id: str  # the first run of the chain: node keys are stable across the chain
    older: bool = False  # another version wrote what it replays: `ctx.patched` is False
    counted: list[str] = field(default_factory=list)  # earlier runs whose checkpoints count
    counts: dict[str, int] = field(default_factory=dict)
    replayed: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # not yet written
    _local: threading.local = field(default_factory=threading.local, repr=False)

    @property
    def current(self) -> str | None:
        """The node running now on this thread (a fan-out's function branches run at once)."""
        return getattr(self._local, "node", None)

    @current.setter
    def current(self, node: str | None) -> None:
        self._local.node = node

    def flush_replays(self) -> None:
        """Write the replay events gathered so far, in one transaction: replaying a hundred
        checkpointed nodes costs one write, not a hundred."""
        if self.replayed:
            events, self.replayed = self.replayed, []
            self.runner.runs.append_all(self.claim, events)

    def node_key(self) -> str:
        node = self.current or "workflow"
        return f"tj-wf-{self.logical_id}-{node}"

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retries: int,
        exempt: bool,
    ) -> Any:
        node = self._next(name)
        hit = self._replay(node, "step")
        if hit is not None:
            return hit.value
        for attempt in range(1, retries + 2):
            self._ensure_live()
            self._event("WorkflowNodeStarted", node=node, kind="step", attempt=attempt)
            if not exempt:
                self._stop_if_refused(node, attempt, self.budget.refuse_node())
            self.current = node
            try:
                with genai.node(node, "step", attempt):
                    value = fn(*args, **kwargs)
                    json.dumps(value)
            except Exception as exc:
                self._event("WorkflowNodeFailed", node=node, attempt=attempt, error=str(exc))
                if attempt > retries:
                    raise WorkflowStop(_node_failed(node, exc)) from exc
                continue
            finally:
                self.current = None
            self._checkpoint(node, "step", value)
            return value
        raise AssertionError("unreachable: the last attempt returns or raises")

    def agent(self, name: str, agent: str, message: str) -> str:
        node = self._next(name)
        hit = self._replay(node, "agent")
        if hit is not None:
            return str(hit.value)
        self._ensure_live()
        self._event("WorkflowNodeStarted", node=node, kind="agent", agent=agent, attempt=1)
        self._stop_if_refused(node, 1, self.budget.refuse_child(self.run.depth + 1))
        children = self.runner.children
        with genai.node(node, "agent", 1) as span:  # the child run nests under it
            child_id = children.start(self.run, agent, message)
            span.set("tracon.run.child_id", child_id)
            outcome = children.answer(child_id, self.signal, self.runner.run_inline)
        if self.signal.aborted:
            raise stopped(self.signal)
        if not outcome.ok:
            error = outcome.error_message or "the agent run failed"
            self._event("WorkflowNodeFailed", node=node, attempt=1, error=error, runId=child_id)
            raise WorkflowStop(
                RunError("workflow_node_failed", ErrorClass.TOOL, f"node '{node}': {error}")
            )
        text = str(outcome.result)
        self._checkpoint(node, "agent", text, runId=child_id)
        return text

    def ask(self, name: str, payload: Any) -> Any:
        node = self._next(name)
        hit = self._replay(node, "ask")
        if hit is not None:
            return hit.value
        json.dumps(payload)
        tracing.current_span().event("tracon.workflow.ask", {"tracon.workflow.node": node})
        raise Waits(node, "ask", payload=payload)

    def sleep(self, name: str, until: datetime | timedelta) -> None:
        node = self._next(name)
        if self._replay(node, "timer") is not None:
            return
        if until <= timedelta(0) if isinstance(until, timedelta) else _passed(until):
            return  # nothing to wait for: no timer, the same on every replay
        self._ensure_live()
        tracing.current_span().event("tracon.workflow.sleep", {"tracon.workflow.node": node})
        raise Waits(node, "timer", until=until)

    def wait_for(self, name: str, event: str, timeout: timedelta | None) -> Any:
        node = self._next(name)
        hit = self._replay(node, "event")
        if hit is not None:
            return TIMED_OUT if hit.timed_out else hit.value
        self._ensure_live()
        self.flush_replays()
        kept = self.runner.store.take_event(self.claim, node, self.logical_id, event)
        if kept is not None:  # delivered before this wait: taken now, no waiting
            return kept.value
        attributes = {"tracon.workflow.node": node, "tracon.workflow.event": event}
        tracing.current_span().event("tracon.workflow.wait_for", attributes)
        raise Waits(node, "event", until=timeout, event=event, chain=self.logical_id)

    def fan_out(self, name: str, branches: Sequence[Branch], policy: OnFailure) -> list[Any]:
        """Run `branches` at once (`fanout`): the children start with the node, the function
        branches run here, and the run waits without its thread for the rest."""
        node = self._next(name)
        hit = self._replay(node, FANOUT)
        if hit is not None:
            values, failure = fanout.results(node, list(hit.value or []), policy)
            if failure is not None:
                self._event("WorkflowNodeFailed", node=node, attempt=1, error=failure)
                raise WorkflowStop(RunError("workflow_node_failed", ErrorClass.TOOL, failure))
            return values
        if not branches:
            return []
        self._ensure_live()
        self._check_targets(node, branches)
        self.flush_replays()
        store = self.runner.store
        started = store.started_fanout(self.counted, node) if self.counted else None
        child_ids: dict[int, str] = {}
        steps: dict[int, dict[str, Any]] = {}
        if started is not None:  # an earlier run of the chain started it, then stopped
            if [(b["kind"], b["name"]) for b in started.branches] != [
                (b.kind, b.name) for b in branches
            ]:
                raise WorkflowStop(_fanout_changed(node))
            # what succeeded or still runs is kept; a failed branch (or one canceled when
            # another failed) runs again, as a failed node does when a run is resumed
            steps = {index: done for index, done in started.steps.items() if done.get("ok")}
            earlier = {int(b["index"]): str(b["runId"]) for b in started.branches if b.get("runId")}
            failed = store.failed_children(list(earlier.values()))
            child_ids = {index: run for index, run in earlier.items() if run not in failed}
        for index, branch in enumerate(branches):
            if branch.is_child and index not in child_ids:
                refusal = self.budget.refuse_child(self.run.depth + 1)
                self._stop_if_refused(f"{node}/{index}", 1, refusal)
        made = {
            i: self._child(b) for i, b in enumerate(branches) if b.is_child and i not in child_ids
        }
        child_ids |= {index: new.id for index, new in made.items()}
        children = list(made.values())
        shape = fanout.layout(branches, child_ids)
        with ExitStack() as spans:  # each child's submission span, when traced
            traced = [spans.enter_context(submission(new)) for new in children]
            created = store.start_fanout(self.claim, node, policy.value, shape, traced, steps)
            for child in created:
                self.runner.children.send(child.id)
        outcomes = self._run_steps(node, branches, steps, policy)
        failure = fanout.first_failure(node, outcomes)
        if policy is OnFailure.FAIL_FAST and failure is not None:
            for child_id in child_ids.values():
                self.runner.children.cancel(child_id)
            raise WorkflowStop(RunError("workflow_node_failed", ErrorClass.TOOL, failure))
        raise Waits(node, FANOUT)

    def _check_targets(self, node: str, branches: Sequence[Branch]) -> None:
        """Every agent and workflow a branch names is configured here, or the node fails."""
        for index, branch in enumerate(branches):
            if branch.kind == "agent" and self.runner.settings.agents.get(branch.target) is None:
                missing = f"agent '{branch.target}'"
            elif branch.kind == "workflow" and not self.runner.registry.knows(branch.target):
                missing = f"workflow '{branch.target}'"
            else:
                continue
            message = f"node '{node}' branch {index} ('{branch.name}'): no {missing} is configured"
            raise WorkflowStop(RunError("configuration_error", ErrorClass.CONFIGURATION, message))

    def _child(self, branch: Branch) -> NewRun:
        """The child run of an agent or workflow branch, in this run's tree."""
        run = self.run
        workflow = branch.kind == "workflow"
        return NewRun(
            tenant_id=run.tenant_id,
            agent=branch.target,
            kind="workflow" if workflow else "agent",
            input=branch.input if workflow else {"message": branch.input},
            session_id=run.session_id,
            parent_run_id=run.id,
            root_run_id=run.root_run_id,
            depth=run.depth + 1,
            currency=run.cost_currency,
            priority=run.priority,
            workflow_version=self.runner.registry.version_of(branch.target) if workflow else None,
        )

    def _run_steps(
        self,
        node: str,
        branches: Sequence[Branch],
        done: dict[int, dict[str, Any]],
        policy: OnFailure,
    ) -> dict[int, dict[str, Any]]:
        """The function branches' outcomes by index (those `done` before, and the rest run
        now, at most `STEP_THREADS` at once, each in its own copy of the caller's context)."""
        todo = [(i, b) for i, b in enumerate(branches) if b.kind == "step" and i not in done]
        if not todo:
            return dict(done)
        one_failed = threading.Event()

        def branch_outcome(index: int, branch: Branch) -> dict[str, Any]:
            if policy is OnFailure.FAIL_FAST and one_failed.is_set():
                return {**fanout.failed("canceled: another branch failed first"), "canceled": True}
            outcome = self._branch_step(node, index, branch)
            if not outcome["ok"]:
                one_failed.set()
            return outcome

        with ThreadPoolExecutor(min(len(todo), STEP_THREADS), "tj-branch") as pool:
            futures = [
                pool.submit(contextvars.copy_context().run, branch_outcome, index, branch)
                for index, branch in todo
            ]
            ran = {index: future.result() for (index, _), future in zip(todo, futures, strict=True)}
        return {**done, **ran}

    def _branch_step(self, node: str, index: int, branch: Branch) -> dict[str, Any]:
        """One function branch, with its retries; its outcome, committed (`branch_done`)."""
        assert branch.fn is not None, "a step branch has its function"
        key = f"{node}/{index}"
        store = self.runner.store
        for attempt in range(1, branch.retries + 2):
            self._ensure_live()
            self._event("WorkflowNodeStarted", node=key, kind="step", attempt=attempt, fanOut=node)
            refusal = self.budget.refuse_node()
            if refusal is not None:
                outcome = fanout.failed(f"did not start: {refusal.message}")
                data = {"node": key, "attempt": attempt, "error": refusal.message}
                store.branch_done(
                    self.claim, node, index, outcome, {**data, "refused": refusal.type}
                )
                return {**outcome, "name": branch.name}
            self.current = key
            try:
                with genai.node(key, "step", attempt):
                    value = branch.fn(*branch.args, **branch.kwargs)
                    json.dumps(value)
            except Exception as exc:
                data = {"node": key, "attempt": attempt, "error": str(exc), "fanOut": node}
                if attempt <= branch.retries:
                    self._event("WorkflowNodeFailed", **data)
                    continue
                outcome = fanout.failed(f"{type(exc).__name__}: {exc}")
                store.branch_done(self.claim, node, index, outcome, data)
                return {**outcome, "name": branch.name}
            finally:
                self.current = None
            outcome = fanout.succeeded(value)
            data = {"node": key, "kind": "step", "fanOut": node}
            store.branch_done(self.claim, node, index, outcome, data)
            return {**outcome, "name": branch.name}
        raise AssertionError("unreachable: the last attempt returns")

    def report_usage(self, amount: Decimal, currency: str) -> None:
        counted = currency == self.runner.settings.pricing.currency and amount > 0
        data = {
            "node": self.current,
            "amount": float(amount),
            "currency": currency,
            "counted": counted,
        }
        self.flush_replays()
        if not counted:
            self.runner.runs.append(self.claim, "UsageReported", data)
            return
        self.budget.spent(released=0, tokens=0, cost=amount, unknown=False)
        self.runner.runs.add_cost(self.claim, amount, data)

    def patched(self, change: str) -> bool:
        node = self._next(f"patched:{change}")
        hit = self.recorded.get(node)
        if hit is not None and hit.kind == PATCH:  # decided in an earlier run of the chain
            applied = bool(hit.value)
            data = {"node": node, "kind": PATCH, "id": change, "applied": applied}
            self.replayed.append(("WorkflowPatched", {**data, "fromRunId": hit.run_id}))
            return applied
        applied = not self.older
        self.flush_replays()
        data = {"node": node, "kind": PATCH, "id": change, "applied": applied}
        # recorded with or without `EnableCheckpointing`: the decision holds for the chain
        self.runner.store.checkpoint(self.claim, node, PATCH, applied, data, "WorkflowPatched")
        return applied

    # -- helpers -------------------------------------------------------------------------------

    def _next(self, name: str) -> str:
        count = self.counts.get(name, 0) + 1
        self.counts[name] = count
        return f"{name}#{count}"

    def _replay(self, node: str, kind: str) -> Recorded | None:
        hit = self.recorded.get(node)
        if hit is None or hit.kind != kind:
            return None
        data = {"node": node, "kind": kind, "fromRunId": hit.run_id}
        self.replayed.append(("WorkflowNodeReplayed", data))
        return hit

    def _stop_if_refused(self, node: str, attempt: int, refusal: Refusal | None) -> None:
        """A refused node is invoked, then fails (the reliability guide's events), without
        its body running; a refusal is never retried."""
        if refusal is not None:
            data = {"node": node, "attempt": attempt, "error": refusal.message}
            self._event("WorkflowNodeFailed", **data, refused=refusal.type)
            raise WorkflowStop(_refused(node, refusal))

    def _checkpoint(self, node: str, kind: str, value: Any, **extra: Any) -> None:
        self.flush_replays()
        data = {"node": node, "kind": kind, **extra}
        if self.runner.settings.workflows.enable_checkpointing:
            self.runner.store.checkpoint(self.claim, node, kind, value, data)
        else:
            self.runner.runs.append(self.claim, "WorkflowNodeCompleted", data)

    def _event(self, type_: str, **data: Any) -> None:
        self.flush_replays()
        self.runner.runs.append(self.claim, type_, data)

    def _ensure_live(self) -> None:
        if self.signal.aborted:
            raise stopped(self.signal)


def _older_versions(spec: WorkflowSpec, recorded: dict[str, Recorded]) -> bool:
    """Whether another version of the workflow wrote some of what the run replays (a run
    written before versions were recorded counts as one); `WorkflowStop` when one of them is
    a version `spec` does not declare it replays.

    The version of a checkpoint (a node's result, a wait's answer, a patch decision) is the
    one recorded on the run that wrote it: the code that executed that run."""
    written = {hit.version for hit in recorded.values()}
    known = {version for version in written if version is not None}
    if not spec.replays(known):
        raise WorkflowStop(_version_mismatch(spec, sorted(known - {spec.version})))
    return any(version != spec.version for version in written)


def _version_mismatch(spec: WorkflowSpec, versions: list[str]) -> RunError:
    written = ", ".join(f"'{version}'" for version in versions)
    plural = "s" if len(versions) > 1 else ""
    return RunError(
        "workflow_version_mismatch",
        ErrorClass.CONFIGURATION,
        f"workflow '{spec.name}' is version '{spec.version}' here, but its chain was written "
        f"by version{plural} {written}; nothing was replayed. Deploy the code that wrote it, "
        f"or declare @workflow('{spec.name}', compatible=[{written}]) or branch with "
        "ctx.patched(), then resume the run",
    )


def _fanout_changed(node: str) -> RunError:
    return RunError(
        "workflow_fanout_changed",
        ErrorClass.CONFIGURATION,
        f"fan-out '{node}' was started with other branches by an earlier run of the chain "
        "(its children run); the code that resumes it must give it the same branches",
    )


def _passed(when: datetime) -> bool:
    """Whether `when` (a naive one is UTC) is now or before."""
    aware = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    return aware <= datetime.now(UTC)


def _database_error(exc: SQLAlchemyError) -> str:
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    return f"the database failed before the first node: {type(cause).__name__}: {cause}"


def _refused(node: str, refusal: Refusal) -> RunError:
    return RunError(
        refusal.type,
        ErrorClass.QUOTA_EXCEEDED,
        f"workflow node '{node}' did not start: {refusal.message}",
    )


def _node_failed(node: str, exc: Exception) -> RunError:
    return RunError(
        "workflow_node_failed", ErrorClass.TOOL, f"node '{node}': {type(exc).__name__}: {exc}"
    )
