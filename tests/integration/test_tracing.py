"""Tracing in one process, exported over OTLP/HTTP to a local receiver: a workflow's nodes
are spans of its execution, log lines and histogram exemplars carry the trace, and a
process whose environment asks for no traces imports nothing of the SDK."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.exposition import generate_latest

from tests import workflows
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tracon_jobs import logs, metrics, tracing
from tracon_jobs.runs.store import NewRun

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """This process traces, to a receiver of its own, for the test's length."""
    with OtlpReceiver() as receiver:
        for name in [name for name in os.environ if name.startswith("OTEL_")]:
            monkeypatch.delenv(name)
        for name, value in receiver.env().items():
            monkeypatch.setenv(name, value)
        assert tracing.start("worker")
        try:
            yield receiver
        finally:
            tracing.shutdown()
    assert not tracing.on()


def test_a_workflows_nodes_are_spans_of_its_execution_in_the_submissions_trace(
    make_runtime: MakeRuntime, sql_url: str, traced: OtlpReceiver
) -> None:
    # Given a workflow submitted inside a client's trace
    workflows.ran.clear()
    config = scripted_agent([{"Text": "drafted"}])
    config["WorkflowModules"] = ["tests.workflows"]
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    tenant = runtime.tenants.ensure_tenant("acme")
    with tracing.attached(CLIENT_TRACEPARENT):
        run = runtime.dispatcher.submit(
            NewRun(tenant_id=tenant, agent="agent-then-step", kind="workflow", input={})
        )
    assert run.traceparent is not None and run.traceparent.split("-")[1] == CLIENT_TRACE

    # When it runs to its end
    assert runtime.executor.execute(run.id) == "Completed"

    # Then its execution is a child of its submission, and each node a child of that
    def spans_of(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
        return {span.name: span for span in spans if span.trace_id == CLIENT_TRACE}

    names = (
        "submit agent-then-step",
        "run_workflow agent-then-step",
        "workflow_node agent:demo",
        "workflow_node after-agent",
        "submit demo",
        "invoke_agent demo",
        "chat demo-model",
    )
    spans = spans_of(traced.wait_for(lambda got: set(names) <= set(spans_of(got))))
    submission, execution = spans["submit agent-then-step"], spans["run_workflow agent-then-step"]
    agent_node, step = spans["workflow_node agent:demo"], spans["workflow_node after-agent"]
    assert execution.parent_span_id == submission.span_id
    assert run_of(runtime, run.id).traceparent.split("-")[2] == submission.span_id  # type: ignore[union-attr]
    assert agent_node.parent_span_id == step.parent_span_id == execution.span_id
    assert agent_node.attributes["tracon.workflow.node_kind"] == "agent"
    assert step.attributes["tracon.workflow.node_kind"] == "step"
    assert step.attributes["tracon.workflow.node_attempt"] == 1
    assert step.attributes["tracon.workflow.node"] == "after-agent#1"
    # the agent node's child run nests under the node, and its model call under the child
    assert spans["submit demo"].parent_span_id == agent_node.span_id
    assert spans["invoke_agent demo"].parent_span_id == spans["submit demo"].span_id
    assert spans["chat demo-model"].parent_span_id == spans["invoke_agent demo"].span_id
    assert execution.attributes["tracon.workflow.name"] == "agent-then-step"
    assert spans["chat demo-model"].attributes["tracon.circuit.decision"] == "admitted"


def test_an_answered_workflow_continues_in_the_trace_of_the_run_it_answers(
    make_runtime: MakeRuntime, sql_url: str, traced: OtlpReceiver
) -> None:
    # Given a traced workflow that waits for a person's answer
    workflows.ran.clear()
    config = scripted_agent([{"Text": "drafted"}])
    config["WorkflowModules"] = ["tests.workflows"]
    config["Workflows"] = {"EnableCheckpointing": True}
    runtime = make_runtime(sql_url, sender=lambda _run_id: None, **config)
    tenant = runtime.tenants.ensure_tenant("acme")
    new = NewRun(tenant, "review", {"orderId": "A-1"}, kind="workflow", session_id="s")
    with tracing.attached(CLIENT_TRACEPARENT):
        first = runtime.dispatcher.submit(new)
    assert runtime.executor.execute(first.id) == "Waiting"

    # When the answer comes (outside any span: the continuation's own submission)
    waiting = run_of(runtime, first.id)
    second = runtime.workflow_resumes.respond(waiting, {"text": "send it"}, resumable=False)
    assert runtime.executor.execute(second.id) == "Completed"

    # Then the continuation is submitted in the first run's trace, linked to it
    assert first.traceparent is not None and second.traceparent is not None
    assert second.traceparent.split("-")[1] == CLIENT_TRACE
    spans = traced.wait_for(
        lambda got: (
            any(s.attributes.get("tracon.run.id") == second.id for s in got)
            and sum(s.name == "run_workflow review" for s in got) == 2
        )
    )
    [resubmitted] = [
        s for s in spans if s.name == "submit review" and s.attributes["tracon.run.id"] == second.id
    ]
    first_span = first.traceparent.split("-")[2]
    assert resubmitted.parent_span_id == first_span
    assert (CLIENT_TRACE, first_span) in {
        (link.trace_id, link.span_id) for link in resubmitted.links
    }


def test_log_lines_inside_a_span_carry_its_trace_and_span_ids(traced: OtlpReceiver) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    target = logging.Logger("tests.trace_root")
    target.addHandler(handler)
    logger = logging.Logger("tests.trace_probe")
    logger.addHandler(handler)
    logs.install(target, {"TRACON_LOG_FORMAT": "json"})

    with logs.run_context("run-1", "acme", "demo"), tracing.span("probe") as span:
        logger.warning("inside")
    logger.warning("outside")

    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert span.traceparent is not None
    _version, trace_id, span_id, _flags = span.traceparent.split("-")
    assert (inside["trace_id"], inside["span_id"], inside["run_id"]) == (trace_id, span_id, "run-1")
    assert outside["trace_id"] is None and outside["span_id"] is None


def test_histograms_carry_the_trace_as_an_exemplar(traced: OtlpReceiver) -> None:
    # Given a model call timed inside a span, and a run's delivery timed after its spans
    with tracing.span("probe") as span:
        metrics.model_call("exemplar-provider", "exemplar-model", 0.2)
    assert span.traceparent is not None
    trace_id, span_id = span.traceparent.split("-")[1:3]
    delivered = f"00-{'ab' * 16}-{'cd' * 8}-01"
    with tracing.delivered(delivered):
        metrics.run_finished("Completed", "exemplar-agent", 0.3)

    # Then the OpenMetrics exposition shows both exemplars on their buckets
    text = generate_latest(REGISTRY).decode()
    [bucket] = [
        line
        for line in text.splitlines()
        if 'provider="exemplar-provider"' in line and "# {" in line
    ]
    assert f'trace_id="{trace_id}"' in bucket and f'span_id="{span_id}"' in bucket
    [run_bucket] = [
        line for line in text.splitlines() if 'agent="exemplar-agent"' in line and "# {" in line
    ]
    assert f'trace_id="{"ab" * 16}"' in run_bucket and f'span_id="{"cd" * 8}"' in run_bucket


def test_untraced_a_process_imports_nothing_of_the_sdk_and_adds_nothing() -> None:
    # Given a process with no OTEL_* variable: the web, the worker's task and a run's code
    probe = """
import sys, logging, io, json
from tracon_jobs import logs, metrics, tracing
import tracon_jobs.worker.app, tracon_jobs.runs.executor, web
with tracing.span("x") as span:
    assert span is tracing.NO_SPAN and span.traceparent is None
    assert tracing.current_traceparent() is None and tracing.exemplar() is None
metrics.model_call("p", "m", 0.1)
stream = io.StringIO()
target = logging.Logger("probe")
target.addHandler(logging.StreamHandler(stream))
logs.install(target, {"TRACON_LOG_FORMAT": "json"})
target.warning("hello")
assert json.loads(stream.getvalue())["trace_id"] is None
assert not tracing.on()
ours = ("tracon_jobs.tracing.sdk", "opentelemetry.sdk.trace", "opentelemetry.exporter")
print(json.dumps(sorted(m for m in sys.modules if m.startswith(ours))))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    # Then neither the trace SDK nor an exporter was imported (redis-py 8 imports the API and
    # the metrics SDK for its own observability when they are installed: not a tracer)
    assert loaded == []
