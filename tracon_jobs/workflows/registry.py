"""The `@workflow` decorator and the process-wide workflow registry.

A workflow is a plain Python function `(ctx, input) -> result` registered under a name;
the modules in `WorkflowModules` are imported at startup so their decorators run.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracon_jobs.errors import ToolRegistrationError

WorkflowFunction = Callable[..., Any]
"""`fn(ctx: WorkflowContext, input: dict) -> JSON`."""


@dataclass(frozen=True)
class WorkflowSpec:
    name: str
    function: WorkflowFunction
    description: str = ""


class WorkflowRegistry:
    """The workflows this process can run, by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._specs: dict[str, WorkflowSpec] = {}

    def register(self, spec: WorkflowSpec) -> None:
        with self._lock:
            known = self._specs.get(spec.name)
            if known is not None and known.function is not spec.function:
                raise ToolRegistrationError(f"workflow '{spec.name}' is registered twice")
            self._specs[spec.name] = spec

    def get(self, name: str) -> WorkflowSpec | None:
        return self._specs.get(name)

    def knows(self, name: str) -> bool:
        return name in self._specs

    def names(self) -> list[str]:
        return sorted(self._specs)


registry = WorkflowRegistry()


def workflow(
    name: str, *, description: str | None = None, into: WorkflowRegistry | None = None
) -> Callable[[WorkflowFunction], WorkflowFunction]:
    """Register `fn(ctx, input)` as the workflow `name` (`POST /api/workflows/{name}/run`)."""
    if not name or "/" in name:
        raise ToolRegistrationError(f"workflow name {name!r}: must be non-empty, without '/'")

    def decorate(fn: WorkflowFunction) -> WorkflowFunction:
        if len(inspect.signature(fn).parameters) != 2:
            raise ToolRegistrationError(f"workflow '{name}': takes (ctx, input)")
        doc = description if description is not None else inspect.getdoc(fn) or ""
        (into or registry).register(WorkflowSpec(name, fn, doc.split("\n\n")[0]))
        return fn

    return decorate
