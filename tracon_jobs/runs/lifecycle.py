"""The run state machine. Pure: which transitions exist, and what each status means.

    Queued ──claim──> Running ──> Completed | Failed | Canceled
       │                 └──> Waiting (a person must answer) ──> Queued
       └──> Failed (never enqueued) | Canceled (cancelled before a worker claimed it)

The IO around it (guarded UPDATEs with the run's fence) lives in `runs.store`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class RunStatus(StrEnum):
    QUEUED = "Queued"
    RUNNING = "Running"
    WAITING = "Waiting"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELED = "Canceled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELED})

TERMINAL_EVENT = {
    RunStatus.COMPLETED: "RunCompleted",
    RunStatus.FAILED: "RunFailed",
    RunStatus.CANCELED: "RunCanceled",
}
TERMINAL_EVENTS = frozenset(TERMINAL_EVENT.values())


class ErrorClass(StrEnum):
    INFRASTRUCTURE = "Infrastructure"
    QUOTA_EXCEEDED = "QuotaExceeded"
    PROVIDER = "Provider"
    TOOL = "Tool"
    CANCELLATION = "Cancellation"
    CONFIGURATION = "Configuration"
    INTERNAL = "Internal"


@dataclass(frozen=True)
class RunError:
    """Why a run failed: `type` is the stable machine name, `error_class` its family."""

    type: str
    error_class: ErrorClass
    message: str
    retry_after: float | None = None  # seconds, when the provider or a circuit said so

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": self.type,
            "class": self.error_class.value,
            "message": self.message,
        }
        if self.retry_after is not None:
            body["retryAfter"] = self.retry_after
        return body


@dataclass(frozen=True)
class Claim:
    """Proof of ownership, made: the run is `Running` with this fence, and every later write
    of the executor is guarded by it. Every store takes one; only the run store gives one out
    (`RunStore.settle`), so a write of the ledger, an approval or a checkpoint with a claim
    that was never made does not type-check."""

    run_id: str
    fence: int
    owner: str


@dataclass(frozen=True)
class PendingClaim:
    """A claim read and not made yet (`RunStore.open_claim`): the run still waits `Queued`
    with the fence before this one. Only the run store takes it: its next fenced write makes
    it, with that write's events, and `RunStore.settle` makes it (if need be) and gives the
    `Claim` that the other stores take."""

    run_id: str
    fence: int
    owner: str


AnyClaim = Claim | PendingClaim
"""What the run store's own fenced writes take: a claim made, or read and made by the write."""
