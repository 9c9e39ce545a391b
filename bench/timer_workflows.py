"""The workflow `bench.workflow_timers` puts to sleep (`WorkflowModules`)."""

from __future__ import annotations

from typing import Any

from tracon_jobs.workflows import WorkflowContext, workflow


def _value(value: str) -> str:
    return value


@workflow("sleeper")
def sleeper(ctx: WorkflowContext, input: dict[str, Any]) -> str:
    """A node, a durable timer of `input["seconds"]`, then another node."""
    before = ctx.step("before", _value, "awake")
    ctx.sleep(float(input.get("seconds", 1.0)))
    return str(ctx.step("after", _value, before))
