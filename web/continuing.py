"""A live stream through a run's continuations: where it ends, and which run it follows.

A run whose worker died is closed by the orphan scan (`RunFailed`, error type `orphaned`),
and the same scan then writes `RunContinued` (naming the run that continues it, in the same
session) or `RunContinuationBlocked`. A stream that follows the orphan does not end at its
`RunFailed` when continuation is on: it waits for the next of those two events, at most
`WAIT_SECONDS`, and after `RunContinued` it follows the continuation run on the same
connection, from that run's first event (its turns stream again).

The stored events of a continuation are numbered by their own run, so a native stream names
them `<run id>:<seq>` (`ChainPosition`), and a client that comes back with that
`Last-Event-ID` resumes in the continuation (`web.runs.run_events`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

from tracon_jobs.limits.tree import MAX_CHAIN
from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS
from tracon_jobs.runs.store import Event, RunStore

WAIT_SECONDS = 10.0
"""How long a stream waits after an orphan's end for the scan's next word on it."""
CONTINUED = "RunContinued"
BLOCKED = "RunContinuationBlocked"
ORPHANED = "orphaned"


class Step(Enum):
    GO = "go"  # send the event, read on
    END = "end"  # send the event, then the stream's closing


@dataclass(frozen=True)
class FollowOn:
    """Send the event, then follow `run_id` from its first event."""

    run_id: str


def orphaned(event: Event) -> bool:
    """An orphan's end, which the scan that wrote it may follow with a continuation."""
    error = event.data.get("error")
    return event.type == "RunFailed" and isinstance(error, dict) and error.get("type") == ORPHANED


class Chain:
    """One stream's place in its run's chain (see the module's docstring). `follows_on`:
    whether this deployment continues orphans (`RunContinuation` and `RunReconciliation`
    both enabled); without it a stream ends at the terminal event, as always."""

    __slots__ = ("follows_on", "waiting_since")

    def __init__(self, follows_on: bool) -> None:
        self.follows_on = follows_on
        self.waiting_since: float | None = None

    def step(self, event: Event) -> Step | FollowOn:
        if self.waiting_since is not None:
            if event.type == CONTINUED:
                self.waiting_since = None
                return FollowOn(str(event.data["continuationRunId"]))
            return Step.END if event.type == BLOCKED else Step.GO
        if event.type not in TERMINAL_EVENTS:
            return Step.GO
        if self.follows_on and orphaned(event):
            self.waiting_since = time.monotonic()
            return Step.GO
        return Step.END

    @property
    def waiting(self) -> bool:
        return self.waiting_since is not None

    def given_up(self, now: float) -> bool:
        """The scan said nothing more in `WAIT_SECONDS`: the stream ends."""
        return self.waiting_since is not None and now - self.waiting_since >= WAIT_SECONDS


@dataclass(frozen=True)
class ChainPosition:
    """A native stream's `Last-Event-ID`: a seq of the run the stream opened on, or
    `<run id>:<seq>` of a continuation it followed on into."""

    run_id: str | None  # None: the stream's own run
    seq: int

    @classmethod
    def parse(cls, raw: str) -> tuple[str | None, str]:
        """(the continuation's id or None, the seq's text) of a raw `Last-Event-ID`."""
        run_id, sep, seq = raw.rpartition(":")
        return (run_id, seq) if sep else (None, raw)

    def __str__(self) -> str:
        return str(self.seq) if self.run_id is None else f"{self.run_id}:{self.seq}"


def continues(runs: RunStore, origin: str, run_id: str, tenant_id: str) -> bool:
    """Whether run `run_id` of the tenant is in the chain of runs that continue `origin`."""
    current = run_id
    for _ in range(MAX_CHAIN):
        run = runs.get(current)
        if run is None or run.tenant_id != tenant_id or run.continued_from_run_id is None:
            return False
        if run.continued_from_run_id == origin:
            return True
        current = run.continued_from_run_id
    return False
