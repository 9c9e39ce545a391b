"""Traces across real processes: a web, workers and beat exporting over OTLP/HTTP to a
local receiver that decodes the protobuf. One run is one trace, rooted at the client's
`traceparent`; a continuation after kill -9 joins and links to the run it continues; a
child run nests under the tool call that started it; no message content without the
opt-in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import FAST_RECONCILE, Cluster, wait_until
from tests.helpers import MakeRuntime, run_of, scripted_agent
from tests.helpers import log_lines as lines
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.stub_provider import StubProvider, reply, tool_call
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
CONTENT_ATTRIBUTES = (
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


def traced(cluster: Cluster, receiver: OtlpReceiver, **extra: str) -> Cluster:
    cluster.env = {k: v for k, v in cluster.env.items() if not k.startswith("OTEL_")}
    cluster.env.update(receiver.env(), **extra)
    return cluster


def auth(runtime: Runtime) -> dict[str, str]:
    key = runtime.tenants.issue_key(runtime.tenants.ensure_tenant("acme")).secret
    return {"Authorization": f"Bearer {key}"}


def submit(base: str, headers: dict[str, str], agent: str, **body: Any) -> httpx.Response:
    answer = httpx.post(
        f"{base}/api/agents/{agent}/run",
        json={"message": "go", **body},
        headers={**headers, "Prefer": "respond-async"},
        timeout=10,
    )
    assert answer.status_code == 202, answer.text
    return answer


def ended(runtime: Runtime, run_id: str, timeout: float = 30) -> None:
    wait_until(
        lambda: run_of(runtime, run_id).status in ("Completed", "Failed", "Canceled"),
        timeout=timeout,
        what=f"run {run_id} ended",
    )


def in_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.trace_id == trace_id]


def has(*names: str, trace_id: str) -> Callable[[list[ReceivedSpan]], bool]:
    def found(spans: list[ReceivedSpan]) -> bool:
        seen = [span.name for span in in_trace(spans, trace_id)]
        return all(seen.count(name) >= names.count(name) for name in names)

    return found


def stub_agent(stub: StubProvider) -> dict[str, Any]:
    config = scripted_agent([], ["lookup_order"])
    config["Providers"] = {"a": {"Kind": "openai", "BaseUrl": stub.base_url, "TimeoutSeconds": 30}}
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    return config


def test_one_run_with_a_tool_call_is_one_trace_rooted_at_the_clients_traceparent(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
    receiver: OtlpReceiver,
) -> None:
    # Given a web and a worker that export traces, and a provider that calls a tool first
    sections = stub_agent(stub_provider)
    stub_provider.enqueue(
        tool_call("lookup_order", {"order_id": "A-1"}, call_id="call_1"),
        reply("shipped", input_tokens=31, output_tokens=7),
    )
    cluster = traced(make_cluster(sqlite_url, **sections), receiver)
    worker = cluster.worker("w1")
    web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)

    # When a client submits a run with its own traceparent
    answer = submit(base, {**auth(runtime), "traceparent": CLIENT_TRACEPARENT}, "demo")
    run_id = answer.json()["runId"]
    ended(runtime, run_id)

    # Then the answer and the run name the run's span, in the client's trace
    assert answer.headers["traceparent"].split("-")[1] == CLIENT_TRACE
    shown = httpx.get(f"{base}/api/runs/{run_id}", headers=auth(runtime), timeout=10).json()
    assert shown["status"] == "Completed"
    assert shown["traceparent"] == answer.headers["traceparent"]

    # And one trace holds the web's request, the submission, the execution and its calls
    names = ("POST /api/agents/<name>/run", "submit demo", "invoke_agent demo")
    wanted = has(
        *names, "chat gpt-a", "chat gpt-a", "execute_tool lookup_order", trace_id=CLIENT_TRACE
    )
    spans = in_trace(receiver.wait_for(wanted, what="the run's spans"), CLIENT_TRACE)
    by_name = {span.name: span for span in spans}
    request, submission, execution = (by_name[name] for name in names)
    assert request.parent_span_id == CLIENT_SPAN and request.kind == "server"
    assert submission.parent_span_id == request.span_id
    assert shown["traceparent"].split("-")[2] == submission.span_id
    assert execution.parent_span_id == submission.span_id and execution.kind == "consumer"
    assert request.service == submission.service == "tracon-web"
    assert execution.service == "tracon-worker"
    assert request.resource["process.pid"] not in (web.popen.pid, worker.popen.pid)  # a fork
    assert execution.resource["process.pid"] == worker.popen.pid
    assert execution.attributes["tracon.run.id"] == run_id
    assert execution.attributes["gen_ai.agent.name"] == "demo"

    # And the model calls carry the GenAI attributes and the tokens of each answer
    calls = sorted(
        (span for span in spans if span.name == "chat gpt-a"),
        key=lambda span: span.attributes["tracon.turn"],
    )
    assert all(span.parent_span_id == execution.span_id for span in calls)
    first, last = (span.attributes for span in calls)
    assert first["gen_ai.operation.name"] == "chat" and first["gen_ai.provider.name"] == "openai"
    assert first["gen_ai.request.model"] == "gpt-a" and first["tracon.provider"] == "a"
    assert (first["gen_ai.usage.input_tokens"], first["gen_ai.usage.output_tokens"]) == (10, 5)
    assert (last["gen_ai.usage.input_tokens"], last["gen_ai.usage.output_tokens"]) == (31, 7)
    assert first["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert last["gen_ai.response.finish_reasons"] == ["stop"]
    assert last["tracon.cost.currency"] == "USD" and last["tracon.cost.amount"] >= 0
    assert "tracon.wait.slot_ms" in first and "tracon.wait.rate_limit_ms" in first
    assert first["tracon.circuit.decision"] == "admitted"

    # And the tool span says which tool, which call, its side effect and its outcome
    tool = by_name["execute_tool lookup_order"]
    assert tool.parent_span_id == execution.span_id
    assert tool.attributes["gen_ai.tool.name"] == "lookup_order"
    assert tool.attributes["gen_ai.tool.call.id"] == "call_1"
    assert tool.attributes["tracon.tool.side_effect"] == "read"
    assert tool.attributes["tracon.tool.outcome"] == "ok"
    assert tool.attributes["tracon.tool.attempts"] == 1

    # And no message content was recorded without the opt-in
    recorded = {key for span in receiver.spans for key in span.attributes}
    assert recorded.isdisjoint(CONTENT_ATTRIBUTES)


def test_a_continuation_after_kill_9_joins_the_trace_and_links_to_the_interrupted_run(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    flags: Path,
    receiver: OtlpReceiver,
) -> None:
    # Given a session-bound run inside a slow read on one worker, and continuations on
    script: list[dict[str, Any]] = [
        {"ToolCalls": [{"Name": "slow_step", "Arguments": {"seconds": 120}}]},
        {"Text": "all done"},
    ]
    sections = scripted_agent(script, ["slow_step"]) | {
        "RunReconciliation": FAST_RECONCILE,
        "RunContinuation": {"Enabled": True, "MaxAttempts": 1},
    }
    cluster = traced(make_cluster(sqlite_url, **sections), receiver)
    owner = cluster.worker("owner")
    cluster.start("beat", "beat")
    _web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)
    first = submit(base, auth(runtime), "demo", sessionId="support-42").json()["runId"]
    wait_until(lambda: len(lines(flags, "slow_step")) == 1, timeout=30, what="slow_step")

    # When its worker is killed inside the tool, and another worker takes the continuation
    cluster.worker("survivor")
    owner.kill9()
    wait_until(
        lambda: run_of(runtime, first).status == "Failed", timeout=30, what="the orphan closed"
    )
    wait_until(lambda: len(lines(flags, "slow_step")) == 2, timeout=30, what="slow_step again")
    (flags / "fast").touch()
    [continuation] = [
        run_of(runtime, e.data["continuationRunId"])
        for e in runtime.runs.events(first)
        if e.type == "RunContinued"
    ]
    ended(runtime, continuation.id)

    # Then the continuation's submission is in the interrupted run's trace, linked to it
    original = run_of(runtime, first).traceparent
    assert original is not None
    _version, trace_id, original_span, _flags = original.split("-")
    again = run_of(runtime, continuation.id)
    assert again.status == "Completed" and again.traceparent is not None
    assert again.traceparent.split("-")[1] == trace_id
    spans = in_trace(
        receiver.wait_for(
            has("submit demo", "submit demo", "invoke_agent demo", trace_id=trace_id)
        ),
        trace_id,
    )
    [resubmitted] = [
        s
        for s in spans
        if s.name == "submit demo" and s.attributes.get("tracon.run.id") == again.id
    ]
    assert resubmitted.service == "tracon-worker"  # the orphan scan is a periodic task
    assert resubmitted.parent_span_id == original_span
    assert (trace_id, original_span) in {
        (link.trace_id, link.span_id) for link in resubmitted.links
    }
    assert resubmitted.attributes["tracon.run.continued_from"] == first
    [executed] = [
        s
        for s in spans
        if s.name == "invoke_agent demo" and s.attributes.get("tracon.run.id") == again.id
    ]
    assert executed.parent_span_id == resubmitted.span_id


def test_a_child_run_nests_under_its_tool_call_and_content_is_recorded_when_asked(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    receiver: OtlpReceiver,
) -> None:
    # Given a boss agent that calls a helper agent, traced with message content on
    sections: dict[str, Any] = {
        "Providers": {
            "boss": {
                "Kind": "scripted",
                "Script": [
                    {"ToolCalls": [{"Name": "helper", "Arguments": {"message": "task"}}]},
                    {"Text": "supervised"},
                ],
            },
            "worker": {"Kind": "scripted", "Script": [{"Text": "helped"}]},
        },
        "Agents": {
            "boss": {"Model": {"provider": "boss", "model": "boss-model"}, "SubAgents": ["helper"]},
            "helper": {"Model": {"provider": "worker", "model": "worker-model"}},
        },
        "ToolModules": ["tests.tools"],
    }
    capture = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true"}
    cluster = traced(make_cluster(sqlite_url, **sections), receiver, **capture)
    cluster.worker("w1", concurrency=4)
    _web, base = cluster.web()
    runtime = make_runtime(sqlite_url, **sections)

    # When the boss runs
    root = submit(base, {**auth(runtime), "traceparent": CLIENT_TRACEPARENT}, "boss")
    root_id = root.json()["runId"]
    ended(runtime, root_id)
    assert run_of(runtime, root_id).status == "Completed"

    # Then the helper's submission is a child of the boss's tool call, in the same trace
    wanted = has(
        "execute_tool helper",
        "submit helper",
        "invoke_agent helper",
        "invoke_agent boss",  # ends after the helper's: exported in a later batch
        "chat worker-model",
        trace_id=CLIENT_TRACE,
    )
    spans = in_trace(receiver.wait_for(wanted), CLIENT_TRACE)
    by_name = {span.name: span for span in spans}
    tool, child_submit = by_name["execute_tool helper"], by_name["submit helper"]
    assert tool.attributes["gen_ai.tool.type"] == "agent"
    assert child_submit.parent_span_id == tool.span_id
    assert by_name["invoke_agent helper"].parent_span_id == child_submit.span_id
    assert tool.parent_span_id == by_name["invoke_agent boss"].span_id

    # And with the opt-in, the conversation and the tool's arguments are on the spans
    chat = by_name["chat worker-model"]
    assert "task" in chat.attributes["gen_ai.input.messages"]
    assert "helped" in chat.attributes["gen_ai.output.messages"]
    assert "task" in tool.attributes["gen_ai.tool.call.arguments"]
