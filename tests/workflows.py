"""Workflows the tests register (listed in `WorkflowModules`); each counts its node bodies in
`ran` (in-process) and, when `TRACON_TEST_FLAGS` names a folder, in `<node>.log` files there
(across processes), so a test can tell a replayed node from one that ran again."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from tracon_jobs import TIMED_OUT, Branch, BranchFailed, WorkflowContext, workflow

ran: list[str] = []
_lock = threading.Lock()


def count(node: str, detail: str = "") -> None:
    with _lock:
        ran.append(node)
    directory = os.environ.get("TRACON_TEST_FLAGS")
    if directory:
        with (Path(directory) / f"{node}.log").open("a") as handle:
            handle.write(f"{detail}\n")


def load_order(order_id: str) -> dict[str, Any]:
    count("load-order", order_id)
    return {"id": order_id, "amount": 40}


def finish(order: dict[str, Any], answer: dict[str, Any]) -> str:
    count("finish")
    return f"{order['id']}: {answer['text']}"


@workflow("review")
def review(ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
    """Load an order, draft a reply with an agent, ask a person, then finish."""
    order = ctx.step("load-order", load_order, input["orderId"])
    draft = ctx.agent("demo", f"Draft a reply about {order['id']}")
    answer = ctx.ask("approve-reply", {"draft": draft})
    return {"reply": ctx.step("finish", finish, order, answer)}


def paid_step(name: str, amount: float, ctx: WorkflowContext) -> str:
    count(name)
    ctx.report_usage(amount, "USD")
    return name


@workflow("paid")
def paid(ctx: WorkflowContext, input: dict[str, Any]) -> list[str]:
    """Three nodes that each report spend; the third is exempt from a spent budget."""
    done = [ctx.step("first", paid_step, "first", input.get("amount", 0.4), ctx)]
    done.append(ctx.step("second", paid_step, "second", input.get("amount", 0.4), ctx))
    done.append(ctx.step("store", paid_step, "store", 0, ctx, starts_when_budget_is_spent=True))
    return done


def slow_node(name: str, seconds: float, ctx: WorkflowContext) -> str:
    count(name, ctx.idempotency_key)
    flags = os.environ.get("TRACON_TEST_FLAGS")
    fast = flags is not None and (Path(flags) / "fast").exists()
    deadline = time.monotonic() + (0 if fast else seconds)
    while time.monotonic() < deadline and not ctx.cancelled:
        time.sleep(0.05)
    return name


@workflow("three-nodes")
def three_nodes(ctx: WorkflowContext, input: dict[str, Any]) -> list[str]:
    """Three function nodes; the second sleeps `seconds` (unless the `fast` flag exists)."""
    seconds = float(input.get("seconds", 0))
    return [
        ctx.step("node-1", slow_node, "node-1", 0, ctx),
        ctx.step("node-2", slow_node, "node-2", seconds, ctx),
        ctx.step("node-3", slow_node, "node-3", 0, ctx),
    ]


@workflow("hundred")
def hundred(ctx: WorkflowContext, input: dict[str, Any]) -> int:
    """A hundred small nodes, then a question: for the cost of replaying checkpoints."""
    total = sum(ctx.step("add", lambda n: n, n) for n in range(100))
    ctx.ask("go-on")
    return total


@workflow("flaky")
def flaky(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """A node that fails once, with one retry."""
    attempts: list[int] = []

    def once() -> str:
        attempts.append(1)
        count("flaky")
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")
        return "ok"

    return ctx.step("flaky", once, retries=1)


@workflow("costly-retry")
def costly_retry(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """A node whose first attempt spends `amount` and fails; it has one retry."""

    def spend_then_fail() -> str:
        count("costly")
        ctx.report_usage(input.get("amount", 1.0), "USD")
        raise RuntimeError("the first attempt spent and failed")

    return ctx.step("costly", spend_then_fail, retries=1)


@workflow("agent-then-step")
def agent_then_step(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """An agent node (it spends the model's tokens), then a function node."""
    draft = ctx.agent("demo", "Draft a reply")
    return str(ctx.step("after-agent", _counted, "after-agent", draft))


def _counted(node: str, value: str) -> str:
    count(node)
    return value


@workflow("nap")
def nap(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """A node, a durable timer of `input["seconds"]`, then another node."""
    before = ctx.step("before-nap", _counted, "before-nap", "rested")
    ctx.sleep(float(input.get("seconds", 1.0)))
    return str(ctx.step("after-nap", _counted, "after-nap", before))


@workflow("await-payment")
def await_payment(ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
    """A node, then a wait for the event `paid` (`input["timeout"]` seconds, or none)."""
    order = ctx.step("open-order", _counted, "open-order", "A-1")
    paid = ctx.wait_for("paid", timeout=input.get("timeout"))
    if paid is TIMED_OUT:
        return {"order": order, "paid": None}
    return {"order": order, "paid": paid}


def score(item: int, seconds: float = 0) -> int:
    count("score", str(item))
    time.sleep(seconds)
    return item * 10


def broken(item: int) -> int:
    count("broken", str(item))
    raise ValueError(f"item {item} is broken")


def broken_once(item: int) -> int:
    """Fails the first time it runs in this process, then returns the item."""
    count("broken-once", str(item))
    if ran.count("broken-once") == 1:
        raise ValueError(f"item {item} is broken this once")
    return item


def _shown(results: list[Any]) -> list[Any]:
    """A fan-out's results as JSON: a failed branch as its error."""
    return [{"failed": r.error} if isinstance(r, BranchFailed) else r for r in results]


@workflow("fan")
def fan(ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
    """Two function branches and an agent branch at once (a failing function branch too
    with `input["broken"]`), then a node; `input["onFailure"]` is the policy."""
    branches = [
        Branch.step("score", score, 1, float(input.get("seconds", 0))),
        Branch.agent("demo", "hello"),
        Branch.step("score", score, 2),
    ]
    if input.get("broken"):
        branches.append(Branch.step("broken", broken, 3))
    if input.get("brokenOnce"):
        branches.append(Branch.step("broken-once", broken_once, 3))
    results = ctx.parallel(branches, on_failure=input.get("onFailure", "fail_fast"))
    after = ctx.step("after-fan", _counted, "after-fan", "done")
    return {"results": _shown(results), "after": after}


@workflow("fan-agents")
def fan_agents(ctx: WorkflowContext, input: dict[str, Any]) -> list[Any]:
    """`ctx.map` of `input["agent"]` (default `demo`) over `input["n"]` messages."""
    messages = [f"item {i}" for i in range(int(input.get("n", 10)))]
    agent = str(input.get("agent", "demo"))
    return _shown(ctx.map(agent, messages, on_failure=input.get("onFailure", "collect")))


@workflow("parent-of-nap")
def parent_of_nap(ctx: WorkflowContext, input: dict[str, Any]) -> dict[str, Any]:
    """A child workflow (`nap` for `input["seconds"]`), its result returned."""
    return {"child": ctx.workflow("nap", {"seconds": input.get("seconds", 1)})}


@workflow("fan-ten")
def fan_ten(ctx: WorkflowContext, input: dict[str, Any]) -> list[Any]:
    """Ten agent branches: `demo` (whose tool may wait for an approval) and nine `plain`."""
    branches = [Branch.agent("demo", "close it")]
    branches += [Branch.agent("plain", f"item {i}") for i in range(9)]
    return _shown(ctx.parallel(branches, on_failure="collect"))


@workflow("fan-slow")
def fan_slow(ctx: WorkflowContext, input: dict[str, Any]) -> list[Any]:
    """A quick and a slow (`input["seconds"]`) function branch beside an agent branch."""
    seconds = float(input.get("seconds", 0))
    branches = [
        Branch.step("quick", _counted, "fan-quick", "q"),
        Branch.step("slow", slow_node, "fan-slow", seconds, ctx),
        Branch.agent("demo", "hello"),
    ]
    return ctx.parallel(branches, on_failure="fail_fast")


@workflow("fan-long")
def fan_long(ctx: WorkflowContext, input: dict[str, Any]) -> list[Any]:
    """A function branch and a branch of the agent `long` (a minute long), collected."""
    branches = [Branch.step("score", score, 1), Branch.agent("long", "take your time")]
    return _shown(ctx.parallel(branches, on_failure="collect"))
