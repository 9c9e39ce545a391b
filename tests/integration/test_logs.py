"""Log lines of a real run: its id, tenant and agent on every line logged while it executes
(tool threads included), each failed tool attempt logged once (a traceback only for an
unexpected exception), and the JSON format."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from tests.helpers import MakeRuntime, Script, scripted_agent
from tracon_jobs import logs, tool
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.worker.app import RunEndedFailed, describe_runs, run_task

probe_log = logging.getLogger("tests.log_probe")


@tool(side_effect="none")
def log_probe(word: str) -> str:
    """Logs from inside the tool's own thread."""
    probe_log.info("probe says %s", word)
    return word


@pytest.fixture
def captured(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog with the run filter on its handler, as `logs.install` puts it on the root's."""
    caplog.set_level(logging.INFO)
    run_filter = logs.RunContextFilter()
    caplog.handler.addFilter(run_filter)
    yield caplog
    caplog.handler.removeFilter(run_filter)


def runtime_for(make_runtime: MakeRuntime, sql_url: str, calls: list[dict[str, object]]) -> Runtime:
    script: Script = [{"ToolCalls": calls}, {"Text": "done"}]
    tools = sorted({str(call["Name"]) for call in calls})
    sections = scripted_agent(script, tools)
    sections["ToolModules"] = ["tests.tools", __name__]
    return make_runtime(sql_url, **sections)


def execute(runtime: Runtime) -> tuple[str, str]:
    """A run of `demo` for tenant `acme` through the Celery task's body; (run id, outcome)."""
    tenant = runtime.tenants.ensure_tenant("acme")
    run = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"}))
    try:
        outcome = run_task(
            runtime.executor.execute, describe_runs(runtime.db), run.id, "demo", "acme"
        )
    except RunEndedFailed as failed:
        outcome = f"failed: {failed}"
    return run.id, outcome


def test_every_line_of_a_run_carries_its_id_tenant_and_agent(
    make_runtime: MakeRuntime, sqlite_url: str, captured: pytest.LogCaptureFixture
) -> None:
    calls: list[dict[str, object]] = [
        {"Name": "log_probe", "Arguments": {"word": "hello"}},
        {"Name": "flaky_read", "Arguments": {"key": "logs-flaky"}},
    ]
    runtime = runtime_for(make_runtime, sqlite_url, calls)

    run_id, outcome = execute(runtime)

    assert outcome == "Completed"
    [probe] = [r for r in captured.records if r.name == "tests.log_probe"]
    assert probe.getMessage() == "probe says hello"
    assert (probe.run_id, probe.tenant, probe.agent) == (run_id, "acme", "demo")  # type: ignore[attr-defined]
    assert str(probe.threadName).startswith("tool")  # logged on the tool pool's thread
    # the retryable failure of flaky_read's first attempt: once, WARNING, no traceback
    [retry] = [r for r in captured.records if "flaky_read" in r.getMessage()]
    assert retry.levelno == logging.WARNING and retry.exc_info is None
    assert retry.run_id == run_id  # type: ignore[attr-defined]
    assert "attempt 1 failed" in retry.getMessage() and run_id in retry.getMessage()
    # after the run, lines carry no run
    probe_log.info("after")
    assert captured.records[-1].run_id is None  # type: ignore[attr-defined]


def test_unexpected_tool_exception_is_logged_once_at_error_with_its_traceback(
    make_runtime: MakeRuntime, sqlite_url: str, captured: pytest.LogCaptureFixture
) -> None:
    calls: list[dict[str, object]] = [{"Name": "failing_tool", "Arguments": {"reason": "boom"}}]
    runtime = runtime_for(make_runtime, sqlite_url, calls)

    run_id, outcome = execute(runtime)

    assert outcome == "Completed"  # the model reads the tool's error and answers
    failures = [r for r in captured.records if r.name == "tracon_jobs.runs.toolrunner"]
    assert len(failures) == 1
    [failure] = failures
    assert failure.levelno == logging.ERROR
    assert failure.exc_info is not None and failure.exc_info[0] is ValueError
    assert failure.run_id == run_id  # type: ignore[attr-defined]
    text = captured.text
    assert "Traceback" in text and "raise ValueError(reason)" in text and "boom" in text


def test_arguments_the_tool_rejects_are_the_models_mistake_logged_without_traceback(
    make_runtime: MakeRuntime, sqlite_url: str, captured: pytest.LogCaptureFixture
) -> None:
    calls: list[dict[str, object]] = [{"Name": "log_probe", "Arguments": {"nope": 1}}]
    runtime = runtime_for(make_runtime, sqlite_url, calls)

    execute(runtime)

    [failure] = [r for r in captured.records if r.name == "tracon_jobs.runs.toolrunner"]
    assert failure.levelno == logging.WARNING and failure.exc_info is None
    assert "INVALID_ARGUMENTS" in failure.getMessage()


def test_json_lines_hold_time_level_logger_message_run_and_exc_info() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.Logger("tests.json_probe")
    logger.addHandler(handler)
    target = logging.Logger("tests.json_root")
    target.addHandler(handler)

    logs.install(target, {"TRACON_LOG_FORMAT": "json"})
    logs.install(target, {"TRACON_LOG_FORMAT": "json"})  # idempotent
    assert len(handler.filters) == 1
    with logs.run_context("run-1", "acme", "demo"):
        try:
            raise RuntimeError("kaput")
        except RuntimeError:
            logger.exception("it broke")
        with logs.run_context("run-1", agent=None):  # inner context keeps tenant and agent
            logger.warning("still %s", "here")
    logger.info("outside")

    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [set(line) for line in lines] == [
        {
            "time",
            "level",
            "logger",
            "message",
            "run_id",
            "tenant",
            "agent",
            "trace_id",
            "span_id",
            "exc_info",
        }
    ] * 3
    first, second, third = lines
    assert first["level"] == "ERROR" and first["logger"] == "tests.json_probe"
    assert first["message"] == "it broke" and first["time"].endswith("Z")
    assert (first["run_id"], first["tenant"], first["agent"]) == ("run-1", "acme", "demo")
    assert "RuntimeError: kaput" in first["exc_info"]
    assert (second["message"], second["tenant"], second["exc_info"]) == ("still here", "acme", None)
    assert third["run_id"] is None and third["message"] == "outside"


def test_text_lines_tag_the_run() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.Logger("tests.text_probe")
    logger.addHandler(handler)

    logs.install(logger, {})
    with logs.run_context("run-2", "acme", "demo"):
        logger.warning("inside")
    logger.warning("outside")

    inside, outside = stream.getvalue().splitlines()
    assert inside.endswith("WARNING tests.text_probe [run_id=run-2 tenant=acme agent=demo] inside")
    assert outside.endswith("WARNING tests.text_probe outside")
