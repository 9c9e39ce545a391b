"""The `@workflow` decorator and the process-wide workflow registry.

A workflow is a plain Python function `(ctx, input) -> result` registered under a name;
the modules in `WorkflowModules` are imported at startup so their decorators run.

Each workflow has a code version: the one declared (`@workflow("name", version="3")`), else a
hash of its module's source. A run records the version that executed it, and a run that
continues a chain replays checkpoints written by another version only when the workflow
declares it can (`compatible=[...]`, or `ctx.patched` in its code; `runner`).
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from tracon_jobs.errors import ToolRegistrationError

WorkflowFunction = Callable[..., Any]
"""`fn(ctx: WorkflowContext, input: dict) -> JSON`."""

VERSION_MAX = 64
"""The longest version a run records (`runs.workflow_version`)."""


@dataclass(frozen=True)
class WorkflowSpec:
    name: str
    function: WorkflowFunction
    description: str = ""
    version: str = ""  # empty: `code_version(function)`
    compatible: frozenset[str] = frozenset()  # versions whose chains this code replays
    patches: bool = field(default=False, init=False)  # its code calls `ctx.patched`

    def __post_init__(self) -> None:
        if not self.version:
            object.__setattr__(self, "version", code_version(self.function))
        object.__setattr__(self, "compatible", frozenset(self.compatible))
        object.__setattr__(self, "patches", calls_patched(self.function))

    def replays(self, versions: Iterable[str]) -> bool:
        """Whether this code may replay checkpoints written by `versions`: its own, those it
        lists as `compatible`, and any when its code calls `ctx.patched` (it branches on
        what the chain was written by)."""
        foreign = set(versions) - {self.version}
        return not foreign or self.patches or foreign <= self.compatible


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

    def version_of(self, name: str) -> str | None:
        """The code version of the workflow `name` here (None: not registered here)."""
        spec = self._specs.get(name)
        return None if spec is None else spec.version


registry = WorkflowRegistry()


def workflow(
    name: str,
    *,
    description: str | None = None,
    version: str | None = None,
    compatible: Iterable[str] = (),
    into: WorkflowRegistry | None = None,
) -> Callable[[WorkflowFunction], WorkflowFunction]:
    """Register `fn(ctx, input)` as the workflow `name` (`POST /api/workflows/{name}/run`).

    `version`: the code version its runs record (default: a hash of the function's module
    source, so any change of the module is a new version); `compatible`: the versions whose
    chains this code replays as its own (see "Deploying new workflow code" in the docs).
    """
    if not name or "/" in name:
        raise ToolRegistrationError(f"workflow name {name!r}: must be non-empty, without '/'")
    if isinstance(compatible, str):
        raise ToolRegistrationError(f"workflow '{name}': compatible is a list of versions")
    for declared in (version, *compatible):
        if declared is not None and not (0 < len(declared) <= VERSION_MAX):
            raise ToolRegistrationError(
                f"workflow '{name}': a version is 1 to {VERSION_MAX} characters ({declared!r})"
            )

    def decorate(fn: WorkflowFunction) -> WorkflowFunction:
        if len(inspect.signature(fn).parameters) != 2:
            raise ToolRegistrationError(f"workflow '{name}': takes (ctx, input)")
        doc = description if description is not None else inspect.getdoc(fn) or ""
        spec = WorkflowSpec(name, fn, doc.split("\n\n")[0], version or "", frozenset(compatible))
        (into or registry).register(spec)
        return fn

    return decorate


def code_version(fn: WorkflowFunction) -> str:
    """12 hex digits of the SHA-256 of the source of `fn`'s module (of its bytecode when the
    source cannot be read: a function made by `exec`, a module shipped without sources)."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    try:
        if module is None:
            raise TypeError("no module")
        text = inspect.getsource(module).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        text = code.co_code if isinstance(code, CodeType) else repr(fn).encode()
    return hashlib.sha256(text).hexdigest()[:12]


def calls_patched(fn: WorkflowFunction) -> bool:
    """Whether the code of `fn` (its nested functions and lambdas included) calls
    `.patched(...)`: such a workflow branches on the version of its chain by itself."""
    code = getattr(fn, "__code__", None)
    return isinstance(code, CodeType) and _names_patched(code)


def _names_patched(code: CodeType) -> bool:
    if "patched" in code.co_names:
        return True
    return any(isinstance(const, CodeType) and _names_patched(const) for const in code.co_consts)
