"""Server-sent events: frames, and what a live stream of one run sends.

A stream follows one run: SQL is the source of truth, read after the last sequence sent;
the event feed only says when to read again. Two ways to serve it, sending the same bytes:

- Under `tracon-jobs web`, the answer's connection is handed to the process's stream hub
  (`web.stream_hub`): one thread and one Redis subscription for every follower, so streams
  never take a request thread (see `tracon_jobs.cli.web_worker`).
- Under any other server (the test client, a WSGI server of one's own), the answer's body
  iterates `followed`, which blocks the request's thread while the run is quiet.

`web.streams.live_stream` answers with one; `Follow` says what it sends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from flask import Response, stream_with_context

from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.coordination.streams import RENEW_SECONDS
from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS
from tracon_jobs.runs.store import Event, Run, RunStore

KEEPALIVE_SECONDS = 15.0
KEEPALIVE = ": keep-alive\n\n"


def frame(event: Event) -> str:
    payload = json.dumps(event.as_json(), separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.type}\ndata: {payload}\n\n"


class Follow(Protocol):
    """What a live stream of one run sends: its opening, frames per event, its closing."""

    run_id: str
    shared: bool
    """Whether `frames` depends on the event alone (a hub encodes each event once)."""
    needs_run: bool
    """Whether `closing` needs the ended run (read once the terminal event is in)."""

    def opening(self) -> str: ...

    def frames(self, event: Event) -> str: ...

    def closing(self, run: Run | None) -> str: ...


class EventFrames:
    """The run's own events, one SSE frame each, `id` their sequence (`Last-Event-ID`)."""

    shared = True
    needs_run = False

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def opening(self) -> str:
        return ""

    def frames(self, event: Event) -> str:
        return frame(event)

    def closing(self, run: Run | None) -> str:
        return ""


def tail(
    store: RunStore,
    feed: EventFeed,
    run_id: str,
    after_seq: int = 0,
    keepalive: float = KEEPALIVE_SECONDS,
) -> Iterator[Event | None]:
    """Yield the run's events after `after_seq` until its terminal event; None = quiet.

    It records the feed's position *before* each SQL read, so an event committed after the
    read is always announced after that position: nothing written before the subscription
    is missed and nothing is sent twice."""
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


def followed(
    follow: Follow,
    store: RunStore,
    feed: EventFeed,
    after: int,
    keepalive: float,
    renew: Callable[[], None] | None = None,
) -> Iterator[str]:
    """A stream's text, following the run in the calling thread."""
    yield follow.opening() or KEEPALIVE  # the head goes out at once, before the run moves
    renewed = time.monotonic()
    for event in tail(store, feed, follow.run_id, after, keepalive):
        if event is not None:
            yield follow.frames(event)
            continue
        yield KEEPALIVE
        if renew is not None and time.monotonic() - renewed >= RENEW_SECONDS:
            renew()
            renewed = time.monotonic()
    run = store.get(follow.run_id) if follow.needs_run else None
    yield follow.closing(run)


def sse_response(frames: Iterator[str], **headers: Any) -> Response:
    response = Response(stream_with_context(frames), mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.headers.update(headers)
    return response
