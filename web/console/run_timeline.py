"""A run's timeline as the console draws it: its events folded into steps (a model call, a tool
call from start to outcome, or a single event), each tool call joined to its ledger row for
the arguments and the result.

Pure: it takes what the stores returned and computes offsets and durations from the events'
times, so a live run and a finished one are drawn by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tracon_jobs.runs.store import Event
from web.console.money import money

MODEL_ENDS = {"ModelCallCompleted", "ModelCallFailed"}
TOOL_ENDS = {"ToolCallCompleted", "ToolCallFailed"}
STOPPED_KINDS = {"canceled", "interrupted"}
"""The kinds of a `ModelCallFailed` the run's end wrote: the call was cut, it did not fail."""


@dataclass
class Step:
    """One row of the timeline; `ended` is None while it is still going."""

    kind: str  # model | tool | event
    title: str
    state: str  # running | ok | failed | stopped (cut by the run's end: see `stopped`) | info
    seq: int
    started: datetime
    ended: datetime | None = None
    subtitle: str = ""
    note: str = ""  # what a finished model call used, shown beside its title
    details: list[tuple[str, Any]] = field(default_factory=list)
    attempts: int | None = None
    stopped: str = ""  # what cut a stopped call: canceled, interrupted, no end recorded

    def duration_ms(self, now: datetime) -> int:
        return _ms(self.started, self.ended or now)


@dataclass(frozen=True)
class Timeline:
    steps: list[Step]
    start: datetime | None
    end: datetime | None

    def span_ms(self, now: datetime) -> int:
        if self.start is None:
            return 0
        return max(1, _ms(self.start, self.end or now))

    def bar(self, step: Step, now: datetime) -> tuple[float, float]:
        """Where the step sits in the run's span, as (left, width) in percent."""
        if self.start is None:
            return 0.0, 100.0
        span = self.span_ms(now)
        left = 100 * _ms(self.start, step.started) / span
        width = max(0.6, 100 * step.duration_ms(now) / span)
        return min(left, 99.4), min(width, 100 - min(left, 99.4))


def build_timeline(
    events: list[Event], calls: list[dict[str, Any]], live: bool, currency: str = ""
) -> Timeline:
    """Fold `events` (in seq order) into steps; `calls` are the ledger rows as JSON, and
    `currency` the run's (model calls' costs are written in it)."""
    by_execution = {call["executionId"]: call for call in calls}
    steps: list[Step] = []
    open_models: list[Step] = []
    open_tools: dict[str, Step] = {}
    for event in events:
        if event.type == "ModelCallStarted":
            open_models.append(_model_step(event))
            steps.append(open_models[-1])
        elif event.type in MODEL_ENDS:
            if not _end_model(open_models, event, currency):
                steps.append(_event_step(event))
        elif event.type == "ToolCallStarted":
            step = _tool_step(event, by_execution.get(event.data.get("executionId", "")))
            open_tools[event.data.get("executionId", "")] = step
            steps.append(step)
        elif event.type in TOOL_ENDS:
            if not _end_tool(open_tools, event, by_execution):
                steps.append(_event_step(event))
        elif event.type == "CapabilityRetried" and event.data.get("executionId") in open_tools:
            retried = open_tools[event.data["executionId"]]
            retried.details.append((f"attempt {event.data.get('attempt')} after", event.data))
        else:
            steps.append(_event_step(event))
    end = events[-1].at if events and not live else None
    if end is not None:
        for step in [*open_models, *open_tools.values()]:
            _ended_with_the_run(step, end)
    return Timeline(steps, events[0].at if events else None, end)


def _ended_with_the_run(step: Step, end: datetime) -> None:
    """A call of an ended run that has no end event (written before calls cut by a cancel
    or a lost process got one): it lasted until the run's last event, and did not succeed."""
    step.ended = end
    step.state, step.stopped = "stopped", "no end recorded"
    step.details.append(("error", "no end was recorded: the run ended while it was going"))


def _model_step(event: Event) -> Step:
    data = event.data
    return Step(
        kind="model",
        title=f"Model call · turn {data.get('turn', '?')}",
        subtitle=f"{data.get('provider', '?')} / {data.get('model', '?')}",
        state="running",
        seq=event.seq,
        started=event.at,
    )


def _end_model(open_models: list[Step], event: Event, currency: str) -> bool:
    """Close the latest open model call of the same provider and model (a failure names no
    turn); False when none is open."""
    wanted = f"{event.data.get('provider', '?')} / {event.data.get('model', '?')}"
    for step in reversed(open_models):
        if step.subtitle == wanted:
            open_models.remove(step)
            step.ended = event.at
            if event.type == "ModelCallCompleted":
                step.state = "ok"
                step.note = _spend(event.data, currency)
                step.details += _model_answer(event.data, currency)
            else:
                kind = event.data.get("kind")
                step.state = "stopped" if kind in STOPPED_KINDS else "failed"
                step.stopped = str(kind) if kind in STOPPED_KINDS else ""
                step.details.append(("error", _without(event.data, "provider", "model")))
            return True
    return False


def _model_answer(data: dict[str, Any], currency: str) -> list[tuple[str, Any]]:
    details: list[tuple[str, Any]] = [("finish reason", data.get("finishReason"))]
    if data.get("text"):
        details.append(("answer", data["text"]))
    if data.get("toolCalls"):
        details.append(("tool calls requested", data["toolCalls"]))
    details += [("usage", data.get("usage")), ("cost", _cost(data, currency))]
    return [(label, value) for label, value in details if value is not None]


def _cost(data: dict[str, Any], currency: str) -> str | None:
    """The call's cost as every page writes money, with where its price came from."""
    cost = data.get("cost") or {}
    if "amount" not in cost:
        return None
    source = f" ({cost['source']})" if cost.get("source") else ""
    return f"{money(cost['amount'])} {currency}".rstrip() + source


def _spend(data: dict[str, Any], currency: str) -> str:
    usage, cost = data.get("usage") or {}, data.get("cost") or {}
    tokens = f"{usage.get('inputTokens', 0):,} in · {usage.get('outputTokens', 0):,} out"
    if "amount" not in cost:
        return tokens
    return f"{tokens} · cost {money(cost['amount'])} {currency}".rstrip()


def _tool_step(event: Event, call: dict[str, Any] | None) -> Step:
    data = event.data
    step = Step(
        kind="tool",
        title=f"Tool call · {data.get('tool', '?')}",
        subtitle=f"turn {data.get('turn', '?')} · call {data.get('callId', '?')}",
        state="running",
        seq=event.seq,
        started=event.at,
    )
    if call is not None:
        step.details.append(("arguments", call.get("arguments")))
    return step


def _end_tool(open_tools: dict[str, Step], event: Event, calls: dict[str, Any]) -> bool:
    """Close the call; its result is the ledger's (the event carries none)."""
    execution_id = event.data.get("executionId", "")
    step = open_tools.pop(execution_id, None)
    if step is None:
        return False
    step.ended = event.at
    step.attempts = event.data.get("attempts")
    if event.type == "ToolCallCompleted":
        step.state = "ok"
        step.details.append(("result", (calls.get(execution_id) or {}).get("result")))
    else:
        step.state = "failed"
        step.details.append(("error", event.data.get("error")))
    return True


def _event_step(event: Event) -> Step:
    state = "failed" if event.type in {"RunFailed", "ModelCallFailed", "ToolCallFailed"} else "info"
    details = [("data", event.data)] if event.data else []
    return Step(
        kind="event",
        title=event.type,
        state=state,
        seq=event.seq,
        started=event.at,
        ended=event.at,
        details=details,
    )


def _without(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {key: value for key, value in data.items() if key not in keys}


def _ms(start: datetime, end: datetime) -> int:
    return max(0, round((end - start).total_seconds() * 1000))
