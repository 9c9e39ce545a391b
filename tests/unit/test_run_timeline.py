"""The console's timeline of a run: a model call cut by the run's end (a cancel, a lost
process) is stopped, not failed, and a call of an ended run that has no end event at all is
closed at the run's end, so its time never grows."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from tracon_jobs.runs.store import Event
from web.console.run_timeline import build_timeline

START = datetime(2026, 11, 30, 12, 0, 0)
CALL = {"turn": 0, "provider": "p", "model": "m"}


def events(*typed: tuple[str, dict[str, Any]]) -> list[Event]:
    """Events one second apart, from `START`."""
    return [
        Event("r", seq, type_, START + timedelta(seconds=seq), data)
        for seq, (type_, data) in enumerate(typed, start=1)
    ]


def test_a_call_cut_by_a_cancel_is_stopped_and_its_time_ends_at_its_end_event() -> None:
    written = events(
        ("ModelCallStarted", CALL),
        ("CancelRequested", {}),
        ("ModelCallFailed", {"provider": "p", "model": "m", "kind": "canceled"}),
        ("RunCanceled", {"status": "Canceled"}),
    )

    [call] = [s for s in build_timeline(written, [], live=False).steps if s.kind == "model"]

    assert (call.state, call.stopped, call.ended) == ("stopped", "canceled", written[2].at)
    assert call.duration_ms(START + timedelta(days=1)) == 2000


def test_a_call_that_failed_on_its_own_is_failed() -> None:
    written = events(
        ("ModelCallStarted", CALL),
        ("ModelCallFailed", {"provider": "p", "model": "m", "kind": "http", "status": 500}),
    )

    [call] = [s for s in build_timeline(written, [], live=True).steps if s.kind == "model"]

    assert (call.state, call.stopped) == ("failed", "")


def test_an_ended_runs_call_without_an_end_event_ends_with_the_run() -> None:
    written = events(
        ("ModelCallStarted", CALL),
        ("ToolCallStarted", {"tool": "t", "executionId": "e1"}),
        ("RunCanceled", {"status": "Canceled"}),
    )

    ended = build_timeline(written, [], live=False).steps
    going = build_timeline(written, [], live=True).steps

    stopped = [s for s in ended if s.kind in {"model", "tool"}]
    assert [(s.state, s.stopped, s.ended) for s in stopped] == [
        ("stopped", "no end recorded", written[-1].at)
    ] * 2
    assert [s.state for s in going if s.kind in {"model", "tool"}] == ["running", "running"]
