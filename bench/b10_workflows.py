"""B10's tracon workflows (`WorkflowModules`), the twins of `bench.b10_dbos_app`'s: each takes
`{"key": ...}` and its steps write `b10_effects` rows under that key (`bench.b10_effects`)."""

from __future__ import annotations

from typing import Any

from bench.b10_effects import record, slow
from tracon_jobs.workflows import WorkflowContext, workflow

THREE_STEPS = "b10-three-steps"
NO_STEPS = "b10-no-steps"
PARKED = "b10-parked"
SLOW = "b10-slow"


@workflow(THREE_STEPS)
def three_steps(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """W1: three steps, each a row of its own, each checkpointed."""
    key = str(input["key"])
    for step in ("one", "two", "three"):
        ctx.step(step, record, key, step)
    return key


@workflow(NO_STEPS)
def no_steps(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """W1's floor: a workflow with no step at all."""
    return str(input["key"])


@workflow(PARKED)
def parked(ctx: WorkflowContext, input: dict[str, Any]) -> Any:
    """W3: waits for a person's answer (no thread held while it waits), then returns it."""
    return ctx.ask("answer", {"key": input["key"]})


@workflow(SLOW)
def slow_steps(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """Recovery: a row, a slow step (`input["seconds"]`), a row."""
    key = str(input["key"])
    ctx.step("one", record, key, "one")
    ctx.step("two", slow, key, "two", float(input["seconds"]))
    ctx.step("three", record, key, "three")
    return key
