"""`WorkflowContext`: what a workflow function is handed, the way durable-execution libraries
hand it: code, not a graph.

    @workflow("refund-review")
    def refund_review(ctx: WorkflowContext, input: dict) -> dict:
        order = ctx.step("load-order", load_order, input["orderId"])     # function node
        draft = ctx.agent("support", f"Draft a reply about {order}")      # agent node
        answer = ctx.ask("approve-reply", {"draft": draft})               # waits for a person
        return {"reply": answer["text"]}

Each node is named; the n-th call of a name in one execution is node `name#n`. With
`Workflows.EnableCheckpointing` every finished node's result is committed before the
next starts, and a run that continues the chain replays the function: finished nodes
answer from their checkpoints without running, the node in progress when a process died
runs again (make it idempotent with `ctx.idempotency_key`).
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any, Protocol, TypeVar

from tracon_jobs.abort import AbortSignal
from tracon_jobs.db.models import Run

T = TypeVar("T")


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

    def report_usage(self, amount: Decimal, currency: str) -> None: ...


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

    def ask(self, name: str, payload: Any = None) -> Any:
        """A question for a person: the run waits (`Waiting`, no thread held) until
        `POST /api/workflows/runs/{id}/respond` answers it in the run that continues it."""
        return self._execution.ask(name, payload)

    def report_usage(self, amount: Decimal | float, currency: str) -> None:
        """What a node spent beyond tokens; it counts against `AgentGraph.MaxTotalCost`
        when `currency` is `Pricing.Currency`."""
        self._execution.report_usage(Decimal(str(amount)), currency)
