"""A follower's text cursor: from deltas and snapshots in any order it sends every byte of
the open call once, the completion's missing tail, and a reset for text that was withdrawn."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tracon_jobs.coordination.live_text import TextDelta, TurnText
from tracon_jobs.runs.store import Event
from web.live_turn import LiveDelta, LiveReset, TurnCursor


def event(seq: int, type_: str, **data: Any) -> Event:
    return Event(run_id="r", seq=seq, type=type_, at=datetime.now(UTC), data=data)


def texts(items: list[Any]) -> str:
    return "".join(item.text for item in items if isinstance(item, LiveDelta))


def test_overlapping_snapshot_and_deltas_give_every_byte_once_and_the_tail_at_the_end() -> None:
    cursor = TurnCursor()
    assert cursor.before(event(3, "ModelCallStarted")) == [] and cursor.needs_snapshot
    out = cursor.delta(TextDelta("r", 3, 0, "héllo".encode()))
    out += cursor.snapshot(TurnText(3, "héllo wor".encode()))  # overlaps the delta
    out += cursor.delta(TextDelta("r", 3, 6, b" wor"))  # already in the snapshot
    out += cursor.delta(TextDelta("r", 3, 10, b"ld"))
    out += cursor.delta(TextDelta("r", 2, 0, b"an older call"))
    assert texts(out) == "héllo world"
    tail = cursor.before(event(4, "CircuitStateChanged"))
    tail += cursor.before(event(5, "ModelCallCompleted", text="héllo world!"))
    assert tail == [LiveDelta(3, "!")] and cursor.open is None


def test_a_gap_asks_for_a_snapshot_and_takes_nothing() -> None:
    cursor = TurnCursor()
    cursor.before(event(3, "ModelCallStarted"))
    cursor.snapshot(None)
    assert cursor.delta(TextDelta("r", 3, 5, b"later")) == [] and cursor.needs_snapshot


def test_text_is_withdrawn_once_at_a_failure_or_a_new_call() -> None:
    cursor = TurnCursor()
    cursor.before(event(3, "ModelCallStarted"))
    cursor.delta(TextDelta("r", 3, 0, b"abc"))
    assert cursor.delta(TextDelta("r", 3, 0, b"", withdrawn=True)) == [LiveReset(3)]
    assert cursor.before(event(4, "ModelCallFailed")) == []  # already withdrawn

    cursor.before(event(5, "ModelCallStarted"))
    cursor.delta(TextDelta("r", 5, 0, b"x"))
    assert cursor.before(event(6, "ModelCallStarted")) == [LiveReset(5)]
    assert cursor.open == 6 and cursor.before(event(7, "ModelCallFailed")) == []
