"""Fan-out: many nodes at once, the parent waiting for them without a thread.

    results = ctx.parallel(
        [
            Branch.step("score", score, document),         # a function node, on this worker
            Branch.agent("support", "Draft a reply"),       # an agent node: a child run
            Branch.workflow("refund-review", {"id": 7}),   # a child workflow: a child run
        ],
        on_failure="collect",
    )

A fan-out node `name#n` starts in one fenced transaction that writes its layout and every
child run (agent and workflow branches), so a crash never leaves children without the node
that waits for them, nor a node with half its children. The children are sent to any worker;
the function branches run here meanwhile, a few at a time, each checkpointed on its own
(`<node>/<index>`). Then the run goes `Waiting` (reason `fanout`) and lets go of its thread.

Whoever sees the last branch end answers the node: the worker that finished a child
(`WorkflowResumes.child_ended`), the parent itself after its own `Waiting` commit (the child
may have ended first), or, for a child ended by a cancel or a recovery, the timer scan of
beat. The answer (every branch's outcome, in order) closes the waiting run and writes the run
that continues the chain, like a person's answer; it replays the function, and the fan-out
returns the outcomes. With `fail_fast` the first failed branch answers at once (the other
children are canceled) and the node fails the workflow; with `collect` every branch ends and
a failed one's place holds a `BranchFailed`.

Budgets count every branch: each child run is gated as a child of the tree, each function
branch as a node, and the children spend from the tree's budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

BranchKind = Literal["step", "agent", "workflow"]


class OnFailure(StrEnum):
    """What a failed branch does to its fan-out."""

    FAIL_FAST = "fail_fast"  # the fan-out ends at once, the other children canceled: it fails
    COLLECT = "collect"  # every branch ends; a failed one's place holds a `BranchFailed`


@dataclass(frozen=True)
class Branch:
    """One branch of `ctx.parallel`: a function node, an agent node or a child workflow."""

    kind: BranchKind
    name: str
    target: str = ""  # the agent or workflow a child run runs
    input: Any = None  # the agent's message, or the child workflow's input
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    retries: int = 0

    @classmethod
    def step(
        cls, name: str, fn: Callable[..., Any], *args: Any, retries: int = 0, **kwargs: Any
    ) -> Branch:
        """`fn(*args, **kwargs)` on the parent's worker, beside the others; its result is JSON."""
        if not callable(fn):
            raise TypeError(f"branch '{name}': a step runs a callable, not {type(fn).__name__}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"branch '{name}': retries is a whole number, not {retries!r}")
        return cls("step", _name(name), fn=fn, args=args, kwargs=kwargs, retries=retries)

    @classmethod
    def agent(cls, agent: str, message: str, *, name: str | None = None) -> Branch:
        """A child run of the agent `agent` on any worker; its final text."""
        if not isinstance(message, str):
            raise TypeError(f"an agent branch's message is text, not {type(message).__name__}")
        return cls("agent", _name(name or f"agent:{agent}"), target=agent, input=message)

    @classmethod
    def workflow(
        cls, workflow: str, input: dict[str, Any] | None = None, *, name: str | None = None
    ) -> Branch:
        """A child run of the workflow `workflow` on any worker; its result."""
        if input is not None and not isinstance(input, dict):
            raise TypeError(f"a child workflow's input is an object, not {type(input).__name__}")
        return cls(
            "workflow", _name(name or f"workflow:{workflow}"), target=workflow, input=input or {}
        )

    @property
    def is_child(self) -> bool:
        return self.kind != "step"


@dataclass(frozen=True)
class BranchFailed:
    """A failed branch's place in what `ctx.parallel(..., on_failure="collect")` returns
    (falsy, so `[r for r in results if r]` keeps the successes)."""

    index: int
    name: str
    error: str
    run_id: str | None = None  # the child run, for an agent or workflow branch

    def __bool__(self) -> bool:
        return False


def branches_of(
    target: Callable[..., Any] | str, items: Sequence[Any], name: str | None
) -> list[Branch]:
    """`ctx.map`'s branches: `target(item)` function nodes, or (an agent's name) agent nodes
    whose messages are the items."""
    if isinstance(target, str):
        return [Branch.agent(target, item, name=name) for item in items]
    if callable(target):
        label = name or str(getattr(target, "__name__", "map"))
        return [Branch.step(label, target, item) for item in items]
    raise TypeError(f"ctx.map takes a function or an agent's name, not {type(target).__name__}")


def policy_of(value: OnFailure | str) -> OnFailure:
    try:
        return OnFailure(value)
    except ValueError:
        raise ValueError(f"on_failure is 'fail_fast' or 'collect', not {value!r}") from None


def layout(branches: Sequence[Branch], child_ids: dict[int, str]) -> list[dict[str, Any]]:
    """What the fan-out node records of its branches (and their events say)."""
    return [
        {"index": index, "kind": branch.kind, "name": branch.name, "target": branch.target or None}
        | ({"runId": child_ids[index]} if index in child_ids else {})
        for index, branch in enumerate(branches)
    ]


def succeeded(value: Any) -> dict[str, Any]:
    return {"ok": True, "value": value}


def failed(error: str, run_id: str | None = None) -> dict[str, Any]:
    return {"ok": False, "error": error} | ({"runId": run_id} if run_id else {})


def results(
    node: str, outcomes: list[dict[str, Any]], policy: OnFailure
) -> tuple[list[Any], str | None]:
    """The fan-out's return value from its branches' recorded outcomes, and the failure that
    fails the node under `fail_fast` (None when it returns)."""
    if policy is OnFailure.FAIL_FAST:
        failure = first_failure(node, dict(enumerate(outcomes)))
        if failure is not None:
            return [], failure
    values: list[Any] = []
    for index, outcome in enumerate(outcomes):
        if outcome.get("ok"):
            values.append(outcome.get("value"))
        else:
            name, error = str(outcome.get("name") or index), str(outcome.get("error") or "failed")
            values.append(BranchFailed(index, name, error, outcome.get("runId")))
    return values, None


def first_failure(node: str, outcomes: dict[int, dict[str, Any]]) -> str | None:
    """What fails a fail-fast fan-out: its first branch that failed (not one canceled
    because another failed), as the node's error; None when none failed."""
    failures = [(index, o) for index, o in sorted(outcomes.items()) if not o.get("ok")]
    if not failures:
        return None
    index, outcome = next((f for f in failures if not f[1].get("canceled")), failures[0])
    name = outcome.get("name") or index
    return f"node '{node}' branch {index} ('{name}'): {outcome.get('error') or 'failed'}"


def _name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ValueError(f"a branch's name is 1 to 200 characters, not {name!r}")
    return name
