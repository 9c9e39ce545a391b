"""Server-sent events: frames, and what a live stream of one run sends.

A stream follows one run: SQL is the source of truth, read after the last sequence sent;
the event feed only says when to read again. Two ways to serve it, sending the same bytes:

- Under `tracon-jobs web`, the answer's connection is handed to the process's stream hub
  (`web.stream_hub`): one thread and one Redis subscription for every follower, so streams
  never take a request thread (see `tracon_jobs.cli.web_worker`).
- Under any other server (the test client, a WSGI server of one's own), the answer's body
  iterates `followed`, which blocks the request's thread while the run is quiet.

`web.streams.live_stream` answers with one; `Follow` says what it sends.

Between a model call's `ModelCallStarted` and its end, a stream also sends the call's text
as it streams (`web.live_turn.TurnCursor` keeps each follower's place in it). The hub gets
it from the live text's deltas; `followed` has no subscription of its own, so while a call
is open it reads the turn's snapshot every `LIVE_POLL_SECONDS` (its feed waits that long
instead of a keep-alive interval) and sends the bytes it had not sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from flask import Response, stream_with_context

from tracon_jobs.coordination.event_feed import EventFeed
from tracon_jobs.coordination.live_text import LiveText
from tracon_jobs.coordination.streams import RENEW_SECONDS
from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS
from tracon_jobs.runs.store import Event, Run, RunStore
from web.continuing import WAIT_SECONDS, Chain, ChainPosition, FollowOn, Step
from web.live_turn import KEEPS_OPEN, OPENS, LiveDelta, LiveItem, TurnCursor

KEEPALIVE_SECONDS = 15.0
KEEPALIVE = ": keep-alive\n\n"
LIVE_POLL_SECONDS = 0.05
"""How often `followed` reads the open call's text (the hub is told of each delta)."""


def frame(event: Event, position: str | None = None) -> str:
    """A stored event's frame; its `id` is its seq, or `position` (`ChainPosition`)."""
    payload = json.dumps(event.as_json(), separators=(",", ":"))
    return f"id: {position or event.seq}\nevent: {event.type}\ndata: {payload}\n\n"


def live_frame(item: LiveItem) -> str:
    """A live text frame: no `id`, so `Last-Event-ID` keeps counting durable events only."""
    if isinstance(item, LiveDelta):
        kind, data = "ModelTextDelta", {"callSeq": item.call_seq, "text": item.text}
    else:
        kind, data = "ModelTextReset", {"callSeq": item.call_seq}
    payload = json.dumps({"type": kind, "data": data}, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


class Follow(Protocol):
    """What a live stream of one run sends: its opening, frames per event, its closing."""

    run_id: str
    shared: bool
    """Whether `frames` depends on the event alone (a hub encodes each event once)."""
    needs_run: bool
    """Whether `closing` needs the ended run (read once the terminal event is in)."""
    done: bool
    """Set by `live` when the stream ends there (its last frames were returned)."""
    live_shared: bool
    """Whether `live` depends on the item alone (a hub encodes each live item once for all
    such followers of the run)."""

    def opening(self) -> str: ...

    def frames(self, event: Event) -> str: ...

    def live(self, item: LiveItem) -> str:
        """The open call's streaming text (a delta), or its withdrawal (a reset)."""
        ...

    def closing(self, run: Run | None) -> str: ...

    def follow_on(self, run_id: str) -> None:
        """From here on the stream follows `run_id`, the run that continues the one it
        followed (`web.continuing`)."""
        ...


class EventFrames:
    """The run's own events, one SSE frame each, `id` their sequence (`Last-Event-ID`);
    a continuation's, `<its run id>:<seq>`."""

    needs_run = False
    done = False
    live_shared = True

    def __init__(self, run_id: str, origin: str | None = None) -> None:
        self.run_id = run_id
        self.origin = origin or run_id  # the run the client asked for
        self.shared = self.run_id == self.origin

    def opening(self) -> str:
        return ""

    def frames(self, event: Event) -> str:
        if self.shared:
            return frame(event)
        return frame(event, str(ChainPosition(self.run_id, event.seq)))

    def follow_on(self, run_id: str) -> None:
        self.run_id = run_id
        self.shared = False

    def live(self, item: LiveItem) -> str:
        if isinstance(item, LiveDelta) and item.whole:
            return ""  # a call that did not stream: its ModelCallCompleted has the text
        return live_frame(item)

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


def open_call(store: RunStore, live: LiveText | None, run_id: str, after: int) -> int | None:
    """The seq of the call still open at `after` (a follower resuming mid-turn from
    `Last-Event-ID`), or None: its `ModelCallStarted` is at or before `after` and nothing
    after it up to `after` closed it."""
    if live is None or after <= 0:
        return None
    try:
        turn = live.snapshot(run_id)
    except Exception:
        return None
    if turn is None or turn.call_seq > after:
        return None
    events = store.events(run_id, turn.call_seq - 1, limit=after - turn.call_seq + 1)
    if not events or events[0].seq != turn.call_seq or events[0].type != OPENS:
        return None
    if any(e.type not in KEEPS_OPEN for e in events[1:] if e.seq <= after):
        return None
    return turn.call_seq


def followed(
    follow: Follow,
    store: RunStore,
    feed: EventFeed,
    after: int,
    keepalive: float,
    renew: Callable[[], None] | None = None,
    live: LiveText | None = None,
    resume: int | None = None,
    chain: Chain | None = None,
) -> Iterator[str]:
    """A stream's text, following the run in the calling thread (see the module's
    docstring: while a call is open its text is polled), and on into the runs that
    continue it (`chain`, `web.continuing`)."""
    yield follow.opening() or KEEPALIVE  # the head goes out at once, before the run moves
    chain = chain or Chain(follows_on=False)
    cursor = TurnCursor()
    if resume is not None:
        cursor.resume(resume)
    run_id = follow.run_id
    renewed = quiet_since = time.monotonic()
    last = after
    position = feed.position(run_id)
    while True:
        events = store.events(run_id, last)
        ended = False
        for event in events:
            out = "".join(follow.live(item) for item in cursor.before(event))
            if follow.done:
                yield out
                return
            yield out + follow.frames(event)
            last = event.seq
            step = chain.step(event)
            if isinstance(step, FollowOn):
                follow.follow_on(step.run_id)
                run_id, last, cursor = step.run_id, 0, TurnCursor()
                break
            if step is Step.END:
                ended = True
                break
        if ended:
            break
        if events:
            position = feed.position(run_id)
            quiet_since = time.monotonic()
            continue
        if chain.given_up(time.monotonic()):
            break
        polling = live is not None and cursor.open is not None
        if polling:
            assert live is not None
            try:
                text = "".join(follow.live(item) for item in cursor.snapshot(live.snapshot(run_id)))
            except Exception:  # Redis away: the durable ModelCallCompleted tells it all
                text = ""
            if text:
                quiet_since = time.monotonic()
                yield text
            if follow.done:
                return
        wait = min(LIVE_POLL_SECONDS, keepalive) if polling else keepalive
        if chain.waiting:
            wait = min(wait, WAIT_SECONDS)
        woke = feed.wait(run_id, position, wait)
        if woke is not None:
            position = woke
            continue
        now = time.monotonic()
        if now - quiet_since < keepalive:
            continue
        quiet_since = now
        yield KEEPALIVE
        if renew is not None and now - renewed >= RENEW_SECONDS:
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
