"""The spans of a run's execution, named and attributed per the OpenTelemetry GenAI
semantic conventions (`gen_ai.*`), with what only tracon-jobs knows in its own namespace
(`tracon.*`): cost, fallback position, circuit, waits, side-effect class, attempts.

Message contents (the conversation, a tool's arguments and result) are recorded only with
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`, through the conventions'
attributes (`gen_ai.input.messages`, `gen_ai.output.messages`, `gen_ai.tool.call.arguments`,
`gen_ai.tool.call.result`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from tracon_jobs import tracing
from tracon_jobs.tracing import Span

if TYPE_CHECKING:
    from tracon_jobs.db.models import Run
    from tracon_jobs.providers.base import Message, ModelRequest, ModelResponse

STOPS_EXPECTED: tuple[type[BaseException], ...] = ()
"""Exceptions that end an execution's span without an error (set by `runs.executor`:
the run waits for a person, parks, or its claim went to another worker)."""


def execution(
    run: Run, expected: tuple[type[BaseException], ...] = ()
) -> AbstractContextManager[Span]:
    """One execution of a claimed run on this worker: a child of the run's submission
    (its `traceparent`), linked to the span that sent this delivery when that is another
    one (a respond, a resume, the requeue scan's resend)."""
    if not tracing.on():
        return tracing.OFF
    delivered = tracing.delivered_with()
    links = [delivered] if delivered and delivered != run.traceparent else []
    agent = run.kind == "agent"
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent" if agent else None,
        "gen_ai.agent.name": run.agent if agent else None,
        "tracon.workflow.name": None if agent else run.agent,
        "tracon.run.id": run.id,
        "tracon.run.kind": run.kind,
        "tracon.run.attempt": run.attempt,
        "tracon.run.depth": run.depth,
        "tracon.run.parent_id": run.parent_run_id,
        "tracon.run.root_id": run.root_run_id,
        "tracon.run.continued_from": run.continued_from_run_id,
        "tracon.tenant.id": run.tenant_id,
        "tracon.session.id": run.session_id,
    }
    name = f"invoke_agent {run.agent}" if agent else f"run_workflow {run.agent}"
    return tracing.span(
        name,
        kind=tracing.CONSUMER,
        attributes=attributes,
        parent=run.traceparent or delivered,
        links=links,
        expected=expected,
    )


def model_call(
    provider_kind: str,
    provider_name: str,
    position: int,
    request: ModelRequest,
    turn: int,
    expected: tuple[type[BaseException], ...] = (),
) -> AbstractContextManager[Span]:
    """One model call (`chat <model>`), from its rate-limit and slot waits to its answer."""
    if not tracing.on():
        return tracing.OFF
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider_kind,
        "gen_ai.request.model": request.model,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_p": request.top_p,
        "gen_ai.request.max_tokens": request.max_output_tokens,
        "gen_ai.request.seed": request.seed,
        "gen_ai.request.stop_sequences": request.stop or None,
        "tracon.provider": provider_name,
        "tracon.fallback.position": position,
        "tracon.turn": turn,
        "tracon.tools.offered": len(request.tools),
    }
    if tracing.capture_content():
        attributes["gen_ai.input.messages"] = _messages(request.messages)
    return tracing.span(
        f"chat {request.model}",
        kind=tracing.CLIENT,
        attributes=attributes,
        expected=expected,
    )


def answered(
    response: ModelResponse, amount: Decimal, currency: str, source: str, cached: bool
) -> None:
    """The current model call's answer: model, tokens, finish reason, cost."""
    span = tracing.current_span()
    if span is tracing.NO_SPAN:
        return
    usage = response.usage
    span.set_many(
        {
            "gen_ai.response.model": response.model,
            "gen_ai.response.finish_reasons": [response.finish_reason],
            "gen_ai.usage.input_tokens": usage.input_tokens,
            "gen_ai.usage.output_tokens": usage.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": usage.cached_input_tokens or None,
            "gen_ai.usage.cache_creation.input_tokens": usage.cache_write_input_tokens or None,
            "tracon.cost.amount": float(amount),
            "tracon.cost.currency": currency,
            "tracon.cost.source": source,
            "tracon.cache.hit": cached,
            "tracon.tool_calls": len(response.tool_calls),
        }
    )
    if tracing.capture_content():
        span.set("gen_ai.output.messages", _messages([response.as_message()]))


def tool_call(
    name: str,
    call_id: str,
    tool_type: str,
    side_effect: str | None,
    arguments: str,
) -> AbstractContextManager[Span]:
    """One tool call (`execute_tool <name>`); a child run it starts nests under it."""
    if not tracing.on():
        return tracing.OFF
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
        "gen_ai.tool.type": tool_type,
        "tracon.tool.side_effect": side_effect,
    }
    if tracing.capture_content():
        attributes["gen_ai.tool.call.arguments"] = arguments
    return tracing.span(
        f"execute_tool {name}",
        attributes=attributes,
        expected=STOPS_EXPECTED,
    )


def tool_answered(
    span: Span, ok: bool, code: str | None, attempts: int, source: str, result: Any
) -> None:
    if span is tracing.NO_SPAN:
        return
    span.set_many(
        {
            "tracon.tool.outcome": "ok" if ok else (code or "error"),
            "tracon.tool.attempts": attempts,
            "tracon.tool.source": source,
            "error.type": None if ok else (code or "tool_error"),
        }
    )
    if not ok:
        span.fail(code or "tool_error")
    if tracing.capture_content():
        span.set("gen_ai.tool.call.result", json.dumps(result, default=str))


def node(
    key: str, kind: str, attempt: int, expected: tuple[type[BaseException], ...] = ()
) -> AbstractContextManager[Span]:
    """One node of a workflow (a step's attempt, an agent node); `key` is its key in the
    run (`name#occurrence`), the span's name its name alone."""
    if not tracing.on():
        return tracing.OFF
    return tracing.span(
        f"workflow_node {key.rpartition('#')[0] or key}",
        attributes={
            "tracon.workflow.node": key,
            "tracon.workflow.node_kind": kind,
            "tracon.workflow.node_attempt": attempt,
        },
        expected=expected,
    )


def _messages(messages: list[Message]) -> str:
    return json.dumps(list(_shown(messages)), default=str, ensure_ascii=False)


def _shown(messages: list[Message]) -> Iterator[dict[str, Any]]:
    for message in messages:
        yield dict(message)
