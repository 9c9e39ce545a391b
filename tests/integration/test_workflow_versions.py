"""Safe deploys of workflow code, in one process over real SQL (both backends) and Redis: each
run records the version of the code that executed it, and a run that continues a chain replays
checkpoints another version wrote only when the workflow declares it can (`compatible`, or
`ctx.patched`), else it ends `Failed` (`workflow_version_mismatch`) before its first node.

A deploy is simulated by two runtimes on one database, each with its own registry holding the
workflow `deploy` under its own code and version."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from sqlalchemy import update

from tests.helpers import MakeRuntime, run_of
from tests.helpers import event_types as types
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runs.views import run_json
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
from tracon_jobs.workflows import WorkflowContext, WorkflowRegistry, workflow

NAME = "deploy"
ran: list[str] = []

Deploy = Callable[..., Runtime]
"""`deploy(fn, version=None, compatible=())`: a runtime on the test's database whose workflow
`deploy` is `fn`."""


@pytest.fixture(autouse=True)
def _clean() -> None:
    ran.clear()


@pytest.fixture
def deploy(make_runtime: MakeRuntime, sql_url: str, redis_url: str) -> Iterator[Deploy]:
    """Runtimes on one database and Redis (made after `make_runtime`'s clean Redis), each
    with its own code of the workflow `deploy`; closed after the test."""
    made: list[Runtime] = []

    def make(
        fn: Callable[[WorkflowContext, dict[str, Any]], Any],
        version: str | None = None,
        compatible: Iterable[str] = (),
        **sections: Any,
    ) -> Runtime:
        registry = WorkflowRegistry()
        workflow(NAME, version=version, compatible=compatible, into=registry)(fn)
        config: dict[str, Any] = {
            "Database": {"Url": sql_url},
            "Redis": {"Url": redis_url},
            "Workflows": {"EnableCheckpointing": True},
            **sections,
        }
        runtime = Runtime(
            Settings.model_validate(config), sender=lambda _run_id: None, workflows=registry
        )
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()


def node(name: str) -> str:
    ran.append(name)
    return name


def v1(ctx: WorkflowContext, input: dict[str, Any]) -> list[Any]:
    """A node, a question, a node, a question, a node."""
    first = ctx.step("a", node, "a")
    go = ctx.ask("go")
    fee = ctx.step("fee", node, "fee-old")
    again = ctx.ask("again")
    return [first, go, fee, again, ctx.step("tail", node, "tail-old")]


def v2(ctx: WorkflowContext, input: dict[str, Any]) -> list[Any]:
    """v1 with the fee node changed."""
    first = ctx.step("a", node, "a")
    go = ctx.ask("go")
    fee = ctx.step("fee", node, "fee-new")
    again = ctx.ask("again")
    return [first, go, fee, again, ctx.step("tail", node, "tail-old")]


def v2_patched(ctx: WorkflowContext, input: dict[str, Any]) -> list[Any]:
    """v1 with the fee and the tail changed, each behind `ctx.patched("fee")`."""
    first = ctx.step("a", node, "a")
    go = ctx.ask("go")
    if ctx.patched("fee"):
        fee = ctx.step("fee-in-cents", node, "fee-new")
    else:
        fee = ctx.step("fee", node, "fee-old")
    again = ctx.ask("again")
    if ctx.patched("fee"):
        tail = ctx.step("tail-in-cents", node, "tail-new")
    else:
        tail = ctx.step("tail", node, "tail-old")
    return [first, go, fee, again, tail]


def start(runtime: Runtime) -> str:
    """A run of `deploy` as the start route writes it: with the version of the code here."""
    tenant_id = runtime.tenants.ensure_tenant("acme")
    version = runtime.workflow_registry.version_of(NAME)
    new = NewRun(tenant_id, NAME, {}, kind="workflow", session_id="s", workflow_version=version)
    return runtime.runs.create(new).id


def answer(runtime: Runtime, run_id: str, value: Any) -> str:
    """Answer the question the run waits on (in `runtime`'s process); the continuation's id."""
    return runtime.workflow_resumes.respond(run_of(runtime, run_id), value, resumable=False).id


def test_a_chain_continued_by_the_same_version_replays(deploy: Deploy) -> None:
    old = deploy(v1, version="1")
    first = start(old)
    assert old.executor.execute(first) == "Waiting"

    second = answer(old, first, "yes")
    assert old.executor.execute(second) == "Waiting"

    assert ran == ["a", "fee-old"]  # `a` replayed, not run again
    assert [run_of(old, r).workflow_version for r in (first, second)] == ["1", "1"]
    assert run_json(run_of(old, second))["workflowVersion"] == "1"


def test_a_different_version_without_a_declaration_fails_naming_both(deploy: Deploy) -> None:
    # Given a chain that v1 wrote, waiting for an answer
    old = deploy(v1, version="1")
    first = start(old)
    assert old.executor.execute(first) == "Waiting"

    # When v2, which declares nothing, continues it
    new = deploy(v2, version="2")
    second = answer(new, first, "yes")
    assert new.executor.execute(second) == "Failed"

    # Then the run fails before its first node: nothing replayed, nothing ran again
    failed = run_of(new, second)
    assert (failed.error_type, failed.error_class) == ("workflow_version_mismatch", "Configuration")
    message = failed.error_message or ""
    assert "version '2' here" in message and "written by version '1'" in message
    assert "compatible=['1']" in message and "ctx.patched()" in message
    assert failed.workflow_version == "2"
    assert ran == ["a"]
    assert "WorkflowNodeReplayed" not in types(new, second)
    assert "WorkflowNodeStarted" not in types(new, second)

    # And the code that wrote the chain resumes it (a rollback)
    resumed = old.workflow_resumes.resume(failed, resumable=False)
    assert old.executor.execute(resumed.id) == "Waiting"
    assert ran == ["a", "fee-old"]


def test_a_version_declared_compatible_replays_the_old_chain(deploy: Deploy) -> None:
    old = deploy(v1, version="1")
    first = start(old)
    assert old.executor.execute(first) == "Waiting"

    new = deploy(v2, version="2", compatible=["1"])
    second = answer(new, first, "yes")
    assert new.executor.execute(second) == "Waiting"
    third = answer(new, second, "again")
    assert new.executor.execute(third) == "Completed"

    assert run_of(new, third).output == {"result": ["a", "yes", "fee-new", "again", "tail-old"]}
    assert ran == ["a", "fee-new", "tail-old"]  # `a` replayed from v1's checkpoint
    assert [run_of(new, r).workflow_version for r in (first, second, third)] == ["1", "2", "2"]


def test_an_old_chain_takes_the_old_path_of_a_patch_in_every_continuation(
    deploy: Deploy,
) -> None:
    old = deploy(v1, version="1")
    first = start(old)
    assert old.executor.execute(first) == "Waiting"

    # When code with `ctx.patched` (nothing declared) continues the chain v1 began
    new = deploy(v2_patched, version="2")
    second = answer(new, first, "yes")
    assert new.executor.execute(second) == "Waiting"
    third = answer(new, second, "again")
    assert new.executor.execute(third) == "Completed"

    # Then it replays v1's checkpoints and takes the old path at both guards
    assert run_of(new, third).output == {"result": ["a", "yes", "fee-old", "again", "tail-old"]}
    assert ran == ["a", "fee-old", "tail-old"]
    patched = [e.data for e in new.runs.events(second) if e.type == "WorkflowPatched"]
    assert patched == [{"node": "patched:fee#1", "kind": "patch", "id": "fee", "applied": False}]
    # the decision of the second run is read back by the third, and holds at the next guard
    later = [e.data for e in new.runs.events(third) if e.type == "WorkflowPatched"]
    assert later == [
        {
            "node": "patched:fee#1",
            "kind": "patch",
            "id": "fee",
            "applied": False,
            "fromRunId": second,
        },
        {"node": "patched:fee#2", "kind": "patch", "id": "fee", "applied": False},
    ]


def test_a_new_chain_takes_the_new_path_of_a_patch(deploy: Deploy) -> None:
    new = deploy(v2_patched, version="2")
    first = start(new)
    assert new.executor.execute(first) == "Waiting"
    second = answer(new, first, "yes")
    assert new.executor.execute(second) == "Waiting"
    third = answer(new, second, "again")
    assert new.executor.execute(third) == "Completed"

    assert run_of(new, third).output == {"result": ["a", "yes", "fee-new", "again", "tail-new"]}
    assert ran == ["a", "fee-new", "tail-new"]
    applied = [e.data["applied"] for e in new.runs.events(third) if e.type == "WorkflowPatched"]
    assert applied == [True, True]  # #1 read back from the second run, #2 decided here


def test_the_worker_records_the_version_it_runs_not_the_creator_s(deploy: Deploy) -> None:
    """A rolling deploy: the web runs v2 while a v1 worker still takes runs. The run records
    the code that wrote its checkpoints, so the next version sees who wrote them."""
    old = deploy(v1, version="1")
    first = start(old)
    assert old.executor.execute(first) == "Waiting"

    new = deploy(v2, version="2")
    second = answer(new, first, "yes")  # created where v2 runs
    assert run_of(new, second).workflow_version == "2"
    assert old.executor.execute(second) == "Waiting"  # executed by v1: the chain is its own

    assert run_of(old, second).workflow_version == "1"
    assert ran == ["a", "fee-old"]
    third = answer(new, second, "again")
    assert new.executor.execute(third) == "Failed"  # v2 would replay v1's `fee`
    assert run_of(new, third).error_type == "workflow_version_mismatch"


def test_a_chain_written_before_versions_were_recorded_replays_as_old(deploy: Deploy) -> None:
    old = deploy(v1, version="1")
    first = start(old)
    assert old.executor.execute(first) == "Waiting"
    with old.db.write() as session:  # as a run written before migration 0013
        session.execute(update(Run).where(Run.id == first).values(workflow_version=None))

    new = deploy(v2_patched, version="2")
    second = answer(new, first, "yes")
    assert new.executor.execute(second) == "Waiting"
    assert ran == ["a", "fee-old"]  # replayed, and `ctx.patched` takes it for an old chain

    plain = deploy(v2, version="3")
    third = answer(plain, second, "again")
    assert plain.executor.execute(third) == "Failed"  # the second run's version is known
    assert "written by version '2'" in (run_of(plain, third).error_message or "")


def test_the_default_version_is_a_hash_of_the_module(deploy: Deploy) -> None:
    runtime = deploy(v1)
    first = start(runtime)
    assert runtime.executor.execute(first) == "Waiting"

    version = run_of(runtime, first).workflow_version
    assert version is not None and len(version) == 12
    assert version == runtime.workflow_registry.version_of(NAME)
