"""`WorkflowContext`: what a workflow function is handed, the way durable-execution libraries
hand it: code, not a graph.

    @workflow("refund-review")
    def refund_review(ctx: WorkflowContext, input: dict) -> dict:
        order = ctx.step("load-order", load_order, input["orderId"])     # function node
        draft = ctx.agent("support", f"Draft a reply about {order}")      # agent node
        answer = ctx.ask("approve-reply", {"draft": draft})               # waits for a person
        ctx.sleep(timedelta(hours=1))                                     # a durable timer
        paid = ctx.wait_for("payment", timeout=timedelta(days=2))         # an external event
        if paid is TIMED_OUT:
            return {"reply": answer["text"], "paid": False}
        return {"reply": answer["text"], "paid": True}

A wait (`ask`, `sleep`, `wait_for`) ends the run `Waiting` without holding a worker; what
answers it (a person, the timer scan of beat, `POST /api/workflows/runs/{id}/events/{name}`,
the wait's timeout) writes the run that continues the chain, which replays the function to
the wait and goes on from its answer.

Each node is named; the n-th call of a name in one execution is node `name#n`. With
`Workflows.EnableCheckpointing` every finished node's result is committed before the
next starts, and a run that continues the chain replays the function: finished nodes
answer from their checkpoints without running, the node in progress when a process died
runs again (make it idempotent with `ctx.idempotency_key`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Protocol, TypeVar

from tracon_jobs.abort import AbortSignal
from tracon_jobs.db.models import Run
from tracon_jobs.workflows.fanout import Branch, OnFailure, branches_of, policy_of

T = TypeVar("T")


class _TimedOut:
    """What `ctx.wait_for` returns when its timeout came before the event (falsy)."""

    def __repr__(self) -> str:
        return "TIMED_OUT"

    def __bool__(self) -> bool:
        return False


TIMED_OUT = _TimedOut()


class Nodes(Protocol):
    """What runs the nodes behind a context (the runner's execution of one run)."""

    run: Run
    signal: AbortSignal

    def node_key(self) -> str: ...

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retries: int,
        exempt: bool,
    ) -> Any: ...

    def agent(self, name: str, agent: str, message: str) -> str: ...

    def ask(self, name: str, payload: Any) -> Any: ...

    def sleep(self, name: str, until: datetime | timedelta) -> None: ...

    def wait_for(self, name: str, event: str, timeout: timedelta | None) -> Any: ...

    def report_usage(self, amount: Decimal, currency: str) -> None: ...

    def patched(self, change: str) -> bool: ...

    def fan_out(self, name: str, branches: Sequence[Branch], policy: OnFailure) -> list[Any]: ...


class WorkflowContext:
    """The handle a workflow function uses for every node it runs."""

    def __init__(self, execution: Nodes) -> None:
        self._execution = execution

    @property
    def run_id(self) -> str:
        return self._execution.run.id

    @property
    def session_id(self) -> str | None:
        return self._execution.run.session_id

    @property
    def signal(self) -> AbortSignal:
        """Fires when the run is canceled (or taken away); long nodes should watch it."""
        return self._execution.signal

    @property
    def cancelled(self) -> bool:
        return self._execution.signal.aborted

    @property
    def idempotency_key(self) -> str:
        """The key of the node running now, the same in every run of the chain that runs it
        (a node re-run after a crash gets the key its first run had)."""
        return self._execution.node_key()

    def step(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        retries: int = 0,
        starts_when_budget_is_spent: bool = False,
        **kwargs: Any,
    ) -> T:
        """A function node: `fn(*args, **kwargs)`, checkpointed; its result must be JSON.

        Checked against `AgentGraph.MaxTotalCost` and `MaxDuration` before it starts and
        before each of its `retries`; `starts_when_budget_is_spent=True` exempts a node
        that must run afterwards (it spends nothing, e.g. storing what was paid for).
        """
        value: T = self._execution.step(
            name, fn, args, kwargs, retries, starts_when_budget_is_spent
        )
        return value

    def agent(self, agent: str, message: str, *, name: str | None = None) -> str:
        """An agent node: a child run of this run's tree (its tools, fallbacks, approvals
        and budget); its final text, checkpointed."""
        return self._execution.agent(name or f"agent:{agent}", agent, message)

    def parallel(
        self,
        branches: Sequence[Branch],
        *,
        on_failure: OnFailure | str,
        name: str = "parallel",
    ) -> list[Any]:
        """Run `branches` at once and return their results in order: function nodes
        (`Branch.step`) on this worker, agent nodes (`Branch.agent`) and child workflows
        (`Branch.workflow`) as child runs on any worker, each checkpointed on its own. The
        run waits for the children without holding a worker (`Waiting`, reason `fanout`)
        and is continued when the last branch ends. `on_failure` is required:
        `"fail_fast"` (the first failed branch cancels the others and fails the workflow)
        or `"collect"` (every branch ends; a failed one's place holds a `BranchFailed`)."""
        listed = list(branches)
        for branch in listed:
            if not isinstance(branch, Branch):
                raise TypeError(f"ctx.parallel takes Branch values, not {type(branch).__name__}")
        return self._execution.fan_out(name, listed, policy_of(on_failure))

    def map(
        self,
        target: Callable[..., Any] | str,
        items: Sequence[Any],
        *,
        on_failure: OnFailure | str,
        name: str | None = None,
    ) -> list[Any]:
        """`ctx.parallel` over `items`: `target(item)` function nodes, or, when `target` is
        an agent's name, that agent's runs with the items as messages."""
        branches = branches_of(target, list(items), name)
        label = name or (target if isinstance(target, str) else getattr(target, "__name__", ""))
        return self._execution.fan_out(f"map:{label}", branches, policy_of(on_failure))

    def workflow(
        self, workflow: str, input: dict[str, Any] | None = None, *, name: str | None = None
    ) -> Any:
        """A child workflow: a child run of this tree on any worker (its own waits, budget
        shared); its result. The run waits for it without holding a worker; a child that
        fails fails this node."""
        branch = Branch.workflow(workflow, input, name=name)
        return self._execution.fan_out(branch.name, [branch], OnFailure.FAIL_FAST)[0]

    def ask(self, name: str, payload: Any = None) -> Any:
        """A question for a person: the run waits (`Waiting`, no thread held) until
        `POST /api/workflows/runs/{id}/respond` answers it in the run that continues it."""
        return self._execution.ask(name, payload)

    def sleep(self, duration: timedelta | float, *, name: str = "sleep") -> None:
        """A durable timer: the run waits `duration` (a `timedelta`, or seconds) without
        holding a worker, and the timer scan of beat continues it then, within about
        `Workflows.TimerScanInterval`. It survives a worker's or beat's restart; the time
        waited does not count toward `AgentGraph.MaxDuration`; a cancel ends it."""
        self._execution.sleep(name, _duration("duration", duration))

    def sleep_until(self, when: datetime, *, name: str = "sleep") -> None:
        """`sleep` until `when` (a naive `datetime` is UTC); a time passed returns at once."""
        if not isinstance(when, datetime):
            raise TypeError(f"sleep_until takes a datetime, not {type(when).__name__}")
        self._execution.sleep(name, when)

    def wait_for(
        self,
        event: str,
        *,
        timeout: timedelta | float | None = None,
        name: str | None = None,
    ) -> Any:
        """Wait for the event `event` (`POST /api/workflows/runs/{id}/events/{event}`, the
        CLI's `workflows event`, the console) and return its payload, or `TIMED_OUT` when
        `timeout` passes first. An event delivered before this wait is kept for it
        (`Workflows.BufferEvents`) and returned at once, oldest first."""
        if not event or len(event) > 200:
            raise ValueError("an event's name is 1 to 200 characters")
        limit = None if timeout is None else _duration("timeout", timeout)
        return self._execution.wait_for(name or f"event:{event}", event, limit)

    def report_usage(self, amount: Decimal | float, currency: str) -> None:
        """What a node spent beyond tokens; it counts against `AgentGraph.MaxTotalCost`
        when `currency` is `Pricing.Currency`."""
        self._execution.report_usage(Decimal(str(amount)), currency)

    def patched(self, change: str) -> bool:
        """Whether this chain takes the code of the change `change` (1 to 200 characters):
        True in a chain this version of the workflow wrote alone (a new one), False in a
        chain another version wrote before (it began before the change), so the old path
        stays for it:

            if ctx.patched("fee-in-cents"):
                fee = ctx.step("fee", fee_in_cents, order)
            else:
                fee = ctx.step("fee", fee_in_units, order)

        The decision is recorded (a `patch` node, `WorkflowPatched`) and holds for the
        chain: every later continuation replays it. A workflow whose code calls
        `ctx.patched` replays chains other versions of it wrote (see "Deploying new workflow
        code"); remove a patch, and its old path, once no chain older than it is in flight."""
        if not change or len(change) > 200:
            raise ValueError("a change's id is 1 to 200 characters")
        return self._execution.patched(change)


def _duration(what: str, value: timedelta | float) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise TypeError(f"{what} is a timedelta or seconds, not {type(value).__name__}")
    duration = value if isinstance(value, timedelta) else timedelta(seconds=value)
    if duration < timedelta(0):
        raise ValueError(f"{what} must not be negative (got {duration})")
    return duration
