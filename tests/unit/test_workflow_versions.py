"""A workflow's code version: declared, else a hash of its module's source (of its bytecode
without one); what it declares it replays (`compatible`, a call of `ctx.patched`)."""

from __future__ import annotations

import hashlib
import inspect
import sys
from typing import Any

import pytest

from tracon_jobs.errors import ToolRegistrationError
from tracon_jobs.workflows import WorkflowContext, WorkflowRegistry, WorkflowSpec, workflow
from tracon_jobs.workflows.registry import calls_patched, code_version


def plain(ctx: WorkflowContext, input: dict[str, Any]) -> int:
    return int(ctx.step("one", lambda: 1))


def guarded(ctx: WorkflowContext, input: dict[str, Any]) -> int:
    def inner() -> int:
        return 2 if ctx.patched("two") else 1

    return inner()


def test_the_default_version_hashes_the_module_source() -> None:
    source = inspect.getsource(sys.modules[__name__]).encode()
    expected = hashlib.sha256(source).hexdigest()[:12]

    assert code_version(plain) == expected == WorkflowSpec("plain", plain).version
    assert code_version(guarded) == expected  # one module, one version


def test_without_its_source_the_version_hashes_the_bytecode() -> None:
    scope: dict[str, Any] = {}
    exec("def made(ctx, input):\n    return 1\n", scope)  # no source file, no module
    made = scope["made"]

    assert code_version(made) == hashlib.sha256(made.__code__.co_code).hexdigest()[:12]


def test_a_declared_version_wins_and_compatible_lists_what_it_replays() -> None:
    registry = WorkflowRegistry()
    workflow("w", version="3", compatible=["2"], into=registry)(plain)
    spec = registry.get("w")

    assert spec is not None and spec.version == "3" == registry.version_of("w")
    assert spec.replays(["3"]) and spec.replays(["2", "3"]) and spec.replays([])
    assert not spec.replays(["1"]) and not spec.replays(["1", "2"])
    assert registry.version_of("nothing") is None


def test_code_that_calls_ctx_patched_replays_any_version() -> None:
    assert calls_patched(guarded)  # in a nested function, too
    assert not calls_patched(plain)
    assert WorkflowSpec("g", guarded, version="2").replays(["1"])


@pytest.mark.parametrize(
    ("version", "compatible"), [("", ()), ("x" * 65, ()), ("1", ["x" * 65]), ("1", "0")]
)
def test_a_bad_version_is_refused_at_registration(version: str, compatible: Any) -> None:
    with pytest.raises(ToolRegistrationError):
        workflow("w", version=version, compatible=compatible, into=WorkflowRegistry())
