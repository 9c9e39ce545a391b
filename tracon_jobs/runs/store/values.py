"""What the run store reads and writes besides the row: events, new runs, a turn's spend, the
filters of a listing and the statistics of a tenant's runs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any


@dataclass(frozen=True)
class Event:
    run_id: str
    seq: int
    type: str
    at: datetime
    data: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, "at": iso(self.at), "data": self.data}


@dataclass(frozen=True)
class NewRun:
    tenant_id: str
    agent: str
    input: dict[str, Any]
    kind: str = "agent"
    session_id: str | None = None
    parameters: dict[str, Any] | None = None
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int = 0
    continued_from_run_id: str | None = None
    attempt: int = 1
    currency: str = "USD"
    resumable: bool = False  # a job owns it (submitted respond-async): it may be resumed
    priority: int = 5  # 0-9, higher first within its tenant's share (`fair_share.PRIORITIES`)
    traceparent: str | None = None  # its submission's span (`tracing`), when traced
    continues_trace: str | None = None  # the traceparent of the run it continues, if any
    workflow_version: str | None = None  # a workflow run's code version where it is created
    id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass(frozen=True)
class TurnSpend:
    """What one model call cost, priced at the model that answered."""

    model_id: str
    input_tokens: int
    output_tokens: int
    cost: Decimal
    cost_source: str


@dataclass(frozen=True)
class RunFilter:
    status: str | None = None
    agent: str | None = None
    session_id: str | None = None
    kind: str | None = None  # "agent" | "workflow"


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat(timespec="milliseconds") + "Z"


@dataclass(frozen=True)
class ModelUsage:
    """The runs of one model (None: runs that never got an answer) and what they used."""

    model: str | None
    runs: int
    input_tokens: int
    output_tokens: int
    cost: float


@dataclass(frozen=True)
class RunStatistics:
    by_status: dict[str, int]
    by_model: list[ModelUsage]
