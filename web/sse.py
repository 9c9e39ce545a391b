"""Server-sent events: frames, and a live tail of a run's events.

The tail reads SQL (the source of truth) after the last sequence it sent, and uses the
event feed only to wake up: it records the feed's position *before* each SQL read, so an
event committed after the read is always announced after that position. Nothing written
before the subscription is missed and nothing is sent twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from flask import Response, stream_with_context

from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS
from tracon_jobs.runs.store import Event, RunStore

KEEPALIVE_SECONDS = 15.0


def frame(event: Event) -> str:
    payload = json.dumps(event.as_json(), separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.type}\ndata: {payload}\n\n"


def tail(
    store: RunStore,
    feed: EventFeed,
    run_id: str,
    after_seq: int = 0,
    keepalive: float = KEEPALIVE_SECONDS,
) -> Iterator[Event | None]:
    """Yield the run's events after `after_seq` until its terminal event; None = quiet."""
    last = after_seq
    position = feed.position(run_id)
    while True:
        events = store.events(run_id, last)
        for event in events:
            yield event
            last = event.seq
            if event.type in TERMINAL_EVENTS:
                return
        if events:
            position = feed.position(run_id)
            continue
        woke = feed.wait(run_id, position, keepalive)
        if woke is None:
            yield None
        else:
            position = woke


def sse_frames(events: Iterator[Event | None]) -> Iterator[str]:
    for event in events:
        yield ": keep-alive\n\n" if event is None else frame(event)


def sse_response(frames: Iterator[str], **headers: Any) -> Response:
    response = Response(stream_with_context(frames), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.headers.update(headers)
    return response
