"""`tracon-jobs workflows list|runs|respond|event|resume` through the cli's `main`, with
`TRACON_CONFIG` naming a config on the test's database and Redis."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import MakeRuntime, run_of, scripted_agent
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


def waiting_review(runtime: Runtime, tenant: str = "acme") -> str:
    """A `review` run that loaded its order, drafted a reply and waits for a person."""
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    new = NewRun(tenant_id=tenant_id, agent="review", kind="workflow", input={"orderId": "o-1"})
    run_id = runtime.runs.create(new).id
    assert runtime.executor.execute(run_id) == "Waiting"
    return run_id


def test_respond_answers_the_question_and_the_continuation_completes_with_it(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    waiting = waiting_review(runtime)
    answer = '{"text": "ok"}'

    assert main(["workflows", "respond", waiting, "--tenant", "acme", "--answer", answer]) == 0

    continuation_id = capsys.readouterr().out.strip()
    continuation = run_of(runtime, continuation_id)
    assert continuation.continued_from_run_id == waiting and continuation.status == "Queued"
    assert continuation.resumable  # a job owns it, as after a respond under respond-async
    closed = run_of(runtime, waiting)
    assert closed.status == "Completed" and closed.output == {"continuedIn": continuation_id}
    assert runtime.executor.execute(continuation_id) == "Completed"
    assert run_of(runtime, continuation_id).output == {"result": {"reply": "o-1: ok"}}

    # a second answer finds nothing waiting: the store's conflict, as the route's 409
    assert main(["workflows", "respond", waiting, "--tenant", "acme", "--answer", answer]) == 1
    err = capsys.readouterr().err
    assert f"run '{waiting}' is not waiting for an answer" in err and "Completed" in err


def test_respond_reads_the_answer_from_a_file_or_stdin(
    runtime: Runtime,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from_file, from_stdin = waiting_review(runtime), waiting_review(runtime)
    answer = tmp_path / "answer.json"
    answer.write_text('{"text": "from a file"}')

    assert main(["workflows", "respond", from_file, "--tenant", "acme", "--file", str(answer)]) == 0
    by_file = capsys.readouterr().out.strip()
    monkeypatch.setattr("sys.stdin", io.StringIO('{"text": "from stdin"}'))
    assert main(["workflows", "respond", from_stdin, "--tenant", "acme", "--file", "-"]) == 0
    by_stdin = capsys.readouterr().out.strip()

    for run_id, text in ((by_file, "from a file"), (by_stdin, "from stdin")):
        assert runtime.executor.execute(run_id) == "Completed"
        assert run_of(runtime, run_id).output == {"result": {"reply": f"o-1: {text}"}}


def awaiting_payment(runtime: Runtime, *, started: bool = True, tenant: str = "acme") -> str:
    """An `await-payment` run that opened its order and waits for the event `paid` (or,
    not `started`, one written but not run yet: no wait is open)."""
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    new = NewRun(tenant_id=tenant_id, agent="await-payment", kind="workflow", input={})
    run_id = runtime.runs.create(new).id
    if started:
        assert runtime.executor.execute(run_id) == "Waiting"
    return run_id


def test_event_answers_the_wait_and_the_continuation_completes_with_its_payload(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    waiting = awaiting_payment(runtime)
    command = ["workflows", "event", waiting, "paid", "--tenant", "acme"]

    assert main([*command, "--payload", '{"amount": 5}']) == 0

    outcome, continuation_id = capsys.readouterr().out.split()
    assert outcome == "delivered"
    continuation = run_of(runtime, continuation_id)
    assert continuation.continued_from_run_id == waiting and continuation.status == "Queued"
    assert run_of(runtime, waiting).output == {"continuedIn": continuation_id}
    assert runtime.executor.execute(continuation_id) == "Completed"
    result = {"result": {"order": "A-1", "paid": {"amount": 5}}}
    assert run_of(runtime, continuation_id).output == result

    # the chain has ended: nothing will wait, as the route's 409
    assert main([*command, "--payload", "1"]) == 1
    err = capsys.readouterr().err
    assert f"run '{continuation_id}' is Completed: nothing will wait" in err
    assert runtime.workflow_store.kept_events(waiting) == 0


def test_event_before_its_wait_is_kept_and_taken_by_it(
    runtime: Runtime, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = awaiting_payment(runtime, started=False)
    payload = tmp_path / "payload.json"
    payload.write_text('"card"')

    assert (
        main(["workflows", "event", first, "paid", "--tenant", "acme", "--file", str(payload)]) == 0
    )

    assert capsys.readouterr().out.split() == ["kept", first]
    assert runtime.workflow_store.kept_events(first, "paid") == 1
    assert runtime.executor.execute(first) == "Completed"  # its wait takes it at once
    assert run_of(runtime, first).output == {"result": {"order": "A-1", "paid": "card"}}


def test_event_without_a_payload_delivers_null(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    waiting = awaiting_payment(runtime)

    assert main(["workflows", "event", waiting, "paid", "--tenant", "acme"]) == 0

    outcome, continuation_id = capsys.readouterr().out.split()
    assert outcome == "delivered"
    assert runtime.executor.execute(continuation_id) == "Completed"
    assert run_of(runtime, continuation_id).output == {"result": {"order": "A-1", "paid": None}}


def test_event_nobody_waits_for_is_refused_without_buffering(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config: dict[str, Any] = scripted_agent([{"Text": "-"}])
    config |= {
        "WorkflowModules": ["tests.workflows"],
        "Workflows": {"EnableCheckpointing": True, "BufferEvents": False},
    }
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url}, **config)
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    runtime = make_runtime(sqlite_url, sender=lambda _run_id: None, **config)
    first = awaiting_payment(runtime, started=False)

    assert main(["workflows", "event", first, "paid", "--tenant", "acme", "--payload", "1"]) == 1

    err = capsys.readouterr().err
    assert f"run '{first}' is not waiting for event 'paid'" in err and "BufferEvents" in err
    assert runtime.workflow_store.kept_events(first) == 0
    assert run_of(runtime, first).status == "Queued"


@pytest.mark.parametrize(
    ("arguments", "code", "said"),
    [
        (["paid", "--payload", "card"], 1, "--payload is not JSON (line 1, column 1"),
        (["paid", "--file", "/no/such/payload.json"], 1, "--file: cannot read /no/such/"),
        (["paid", "--payload", "1", "--file", "-"], 2, "not allowed with argument"),
        (["x" * 201], 1, "name: 1 to 200 characters"),
    ],
)
def test_event_refuses_a_payload_or_name_it_cannot_take_and_leaves_the_run_waiting(
    runtime: Runtime,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    code: int,
    said: str,
) -> None:
    waiting = awaiting_payment(runtime)

    command = ["workflows", "event", waiting, "--tenant", "acme", *arguments]
    if code == 2:  # argparse's own usage error
        with pytest.raises(SystemExit) as exited:
            main(command)
        assert exited.value.code == 2
    else:
        assert main(command) == code

    assert said in capsys.readouterr().err
    assert run_of(runtime, waiting).status == "Waiting"
    assert runtime.workflow_store.kept_events(waiting) == 0


def test_event_for_another_tenants_run_or_no_workflow_run_is_refused(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    waiting = awaiting_payment(runtime)
    runtime.tenants.ensure_tenant("globex")
    tenant_id = runtime.tenants.ensure_tenant("acme")
    agent_run = runtime.runs.create(NewRun(tenant_id=tenant_id, agent="demo", input={"m": "x"}))

    assert main(["workflows", "event", waiting, "paid", "--tenant", "globex"]) == 1
    assert f"no run '{waiting}' of tenant 'globex'" in capsys.readouterr().err
    assert main(["workflows", "event", agent_run.id, "paid", "--tenant", "acme"]) == 1
    assert f"run '{agent_run.id}' is not a workflow run" in capsys.readouterr().err
    assert run_of(runtime, waiting).status == "Waiting"
    assert runtime.workflow_store.kept_events(waiting) == 0


@pytest.mark.parametrize(
    ("arguments", "code", "said"),
    [
        (["--answer", "ok"], 1, "--answer is not JSON (line 1, column 1"),
        (["--file", "/no/such/answer.json"], 1, "--file: cannot read /no/such/answer.json"),
        ([], 2, "one of the arguments --answer --file is required"),
        (["--answer", "1", "--file", "-"], 2, "not allowed with argument"),
    ],
)
def test_respond_refuses_an_answer_it_cannot_read_and_leaves_the_run_waiting(
    runtime: Runtime,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    code: int,
    said: str,
) -> None:
    waiting = waiting_review(runtime)

    command = ["workflows", "respond", waiting, "--tenant", "acme", *arguments]
    if code == 2:  # argparse's own usage error
        with pytest.raises(SystemExit) as exited:
            main(command)
        assert exited.value.code == 2
    else:
        assert main(command) == code

    assert said in capsys.readouterr().err
    assert run_of(runtime, waiting).status == "Waiting"


def test_respond_to_another_tenants_run_or_to_no_workflow_run_is_refused(
    runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    waiting = waiting_review(runtime)
    runtime.tenants.ensure_tenant("globex")
    tenant_id = runtime.tenants.ensure_tenant("acme")
    agent_run = runtime.runs.create(NewRun(tenant_id=tenant_id, agent="demo", input={"m": "x"}))

    assert main(["workflows", "respond", waiting, "--tenant", "globex", "--answer", "1"]) == 1
    assert f"no run '{waiting}' of tenant 'globex'" in capsys.readouterr().err
    assert main(["workflows", "respond", agent_run.id, "--tenant", "acme", "--answer", "1"]) == 1
    assert f"run '{agent_run.id}' is not a workflow run" in capsys.readouterr().err
    assert run_of(runtime, waiting).status == "Waiting"
