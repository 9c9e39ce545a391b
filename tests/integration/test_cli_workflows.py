"""`tracon-jobs workflows list|runs|resume` through the cli's `main`, with `TRACON_CONFIG`
naming a config on the test's database and Redis."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.cli import main
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime


@pytest.fixture
def runtime(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Runtime:
    config: dict[str, Any] = scripted_agent([{"Text": "-"}])
    config |= {
        "WorkflowModules": ["tests.workflows"],
        "Workflows": {"EnableCheckpointing": True},
        "AgentGraph": {"MaxTotalCost": 0.5},
    }
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url}, **config)
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    return make_runtime(sqlite_url, sender=lambda _run_id: None, **config)


def test_list_shows_the_registered_workflows(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["workflows", "list"]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["WORKFLOW", "DESCRIPTION"]
    assert any(line.startswith("review ") and "ask a person" in line for line in out)


def test_runs_lists_workflow_runs_only_and_resume_starts_the_continuation(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    tenant = runtime.tenants.ensure_tenant("acme")
    failed = runtime.runs.create(
        NewRun(tenant_id=tenant, agent="paid", kind="workflow", input={"amount": 0.5})
    )
    runtime.runs.create(NewRun(tenant_id=tenant, agent="demo", input={"message": "x"}))
    assert runtime.executor.execute(failed.id) == "Failed"  # refused by MaxTotalCost

    assert main(["workflows", "runs", "--tenant", "acme"]) == 0
    listed = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[0] for line in listed] == [failed.id]

    assert main(["workflows", "resume", failed.id, "--tenant", "acme"]) == 0
    resumed_id = capsys.readouterr().out.strip()
    resumed = runtime.runs.get(resumed_id)
    assert resumed is not None and resumed.continued_from_run_id == failed.id

    assert main(["workflows", "resume", failed.id, "--tenant", "acme"]) == 1
    assert "resumed already" in capsys.readouterr().err
