"""`tracon-jobs approvals list|decide` through the cli's `main`, with `TRACON_CONFIG` naming a
config on the test's database and Redis (both SQL backends)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import MakeRuntime, Script, scripted_agent
from tracon_jobs.cli import main
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

CLOSE_THEN_ANSWER: Script = [
    {"ToolCalls": [{"Name": "close_account", "Arguments": {"account": "acc-1"}}]},
    {"Text": "Done."},
]


@pytest.fixture
def runtime(
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Runtime:
    """The test's runtime (runs are sent nowhere) and `TRACON_CONFIG` for the cli, alike."""
    config: dict[str, Any] = scripted_agent(CLOSE_THEN_ANSWER, ["close_account"])
    path = write_config(Database={"Url": sql_url}, Redis={"Url": redis_url}, **config)
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    return make_runtime(sql_url, sender=lambda _run_id: None, **config)


def waiting(runtime: Runtime, tenant: str = "acme") -> tuple[str, str]:
    """A run stopped `Waiting` for one approval: (run id, approval id)."""
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    run_id = runtime.runs.create(
        NewRun(tenant_id=tenant_id, agent="demo", input={"message": "go"})
    ).id
    assert runtime.executor.execute(run_id) == "Waiting"
    [approval_id] = runtime.approval_store.pending_ids(run_id)
    return run_id, approval_id


def test_list_prints_a_header_and_one_line_per_approval(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id, approval_id = waiting(runtime)
    other_run, other = waiting(runtime, "globex")

    assert main(["approvals", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["id", "status", "tool", "run", "requested", "expires"]
    assert {line.split()[0] for line in lines[1:]} == {approval_id, other}

    assert main(["approvals", "list", "--tenant", "acme", "--status", "pending"]) == 0
    [_, line] = capsys.readouterr().out.splitlines()
    fields = line.split()
    assert fields[:4] == [approval_id, "Pending", "close_account", run_id]

    assert main(["approvals", "list", "--run", other_run]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [other]
    assert main(["approvals", "list", "--status", "Approved"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_decide_prints_the_decision_once_then_fails_with_one_line(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id, approval_id = waiting(runtime)

    args = ["approvals", "decide", approval_id, "--approve", "--comment", "fine", "--tenant"]
    assert main([*args, "acme"]) == 0
    decided = json.loads(capsys.readouterr().out)
    assert decided["id"] == approval_id and decided["status"] == "Approved"
    assert decided["comment"] == "fine" and decided["decidedBy"] == "cli"
    run = runtime.runs.get(run_id)
    assert run is not None and run.status == "Queued"

    assert main(["approvals", "decide", approval_id, "--reject", "--tenant", "acme"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and "already approved" in captured.err


def test_decide_of_an_unknown_or_another_tenants_approval_fails(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    _, approval_id = waiting(runtime)
    runtime.tenants.ensure_tenant("globex")

    assert main(["approvals", "decide", approval_id, "--reject", "--tenant", "globex"]) == 1
    assert main(["approvals", "decide", "nope", "--approve", "--tenant", "acme"]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all("no approval" in line for line in errors)
    approval = runtime.approval_store.get(approval_id)
    assert approval is not None and approval.status == "Pending"


def test_decide_needs_exactly_one_verdict() -> None:
    with pytest.raises(SystemExit):
        main(["approvals", "decide", "x", "--tenant", "acme"])
    with pytest.raises(SystemExit):
        main(["approvals", "decide", "x", "--approve", "--reject", "--tenant", "acme"])
