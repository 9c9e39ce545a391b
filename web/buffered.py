"""Buffered run responses: wait for a run's end and answer once, with a status that says how
it ended (the contract's "buffered run response"), so that only a success is stored.

The wait is the SSE tail (SQL after the last seq, the event feed only to wake up), bounded
by `Runs.BufferedWaitTimeout`; a run still going then answers `202` with `Location`, and so
does a run that starts waiting for a person (nobody can tell how long that takes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from flask import Response, jsonify

from tracon_jobs.db.models import Run
from tracon_jobs.limits.budget_store import QUOTA_EXCEEDED
from tracon_jobs.limits.quota_store import utc_now, window_of
from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS, ErrorClass, RunStatus
from tracon_jobs.runs.views import run_json
from web.extensions import runtime
from web.sse import tail

WAKE_SECONDS = 1.0
STOPS_WAITING = TERMINAL_EVENTS | {"RunWaiting"}


@dataclass(frozen=True)
class Ending:
    """How a buffered answer reports a run: its HTTP status and the headers that go with it."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def wait_for_end(run_id: str) -> Run:
    """The run once it ended, or as it is when `Runs.BufferedWaitTimeout` runs out."""
    rt = runtime()
    timeout = rt.settings.runs.buffered_wait_timeout.total_seconds()
    deadline = time.monotonic() + timeout
    for event in tail(rt.runs, rt.feed, run_id, 0, min(WAKE_SECONDS, timeout)):
        if event is not None and event.type in STOPS_WAITING:
            break
        if time.monotonic() >= deadline:
            break
    run = rt.runs.get(run_id)
    assert run is not None
    return run


def ending(run: Run) -> Ending:
    """The contract's mapping from a run's end to an HTTP status."""
    status = RunStatus(run.status)
    if status is RunStatus.COMPLETED:
        return Ending(200)
    if status is RunStatus.CANCELED:
        return Ending(409)
    if status is RunStatus.FAILED:
        return failed_ending(run)
    return Ending(202, {"Location": run_location(run.id)})


def failed_ending(run: Run) -> Ending:
    if run.error_type == "provider_unavailable":
        return Ending(503, {"Retry-After": str(retry_after_seconds(run))})
    if run.error_type == QUOTA_EXCEEDED:  # the tenant's quota: it resets when its period ends
        period = runtime().quotas.quota_of(run.tenant_id).period
        return Ending(429, {"Retry-After": str(window_of(period).seconds_left(utc_now()))})
    if run.error_class == ErrorClass.QUOTA_EXCEEDED.value:
        return Ending(429)
    return Ending(502)


def retry_after_seconds(run: Run) -> int:
    """When the circuit that refused the run opens again (recorded with its error), else
    the break duration: the honest wait to suggest."""
    seconds = run.error_retry_after
    if seconds is None:
        seconds = runtime().settings.circuit_breaker.break_duration.total_seconds()
    return max(1, math.ceil(seconds))


def run_location(run_id: str) -> str:
    return f"/api/runs/{run_id}"


def buffered_run_response(run_id: str) -> tuple[Response, int, dict[str, str]]:
    """`POST /api/agents/{name}/run` with a key: the run JSON once, status by its end."""
    run = wait_for_end(run_id)
    end = ending(run)
    return jsonify(run_view(run)), end.status, end.headers


def run_view(run: Run) -> dict[str, Any]:
    """The run JSON, with the approvals it waits for while `Waiting`."""
    pending = runtime().approval_store.pending_ids(run.id) if run.status == "Waiting" else []
    return run_json(run, pending_approvals=pending)
