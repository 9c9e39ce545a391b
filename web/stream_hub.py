"""The stream hub: every live event stream of one web process, served by one thread.

A request thread answers a streaming request as usual (authentication, validation, the run
submitted), then the server hands the connection over (`tracon_jobs.handoff`) and the
thread is free. The hub holds the connections, non-blocking, in one selector:

- One subscription to the event feed tells it which run has something new. It reads SQL
  once per run, after the lowest sequence any of that run's followers has sent (a small
  pool of reader threads), and writes each follower the frames past its own sequence; a run
  read while a new follower joins is read again, so no follower skips an event.
- A client that goes away is noticed at once: its socket turns readable with nothing to
  read. Its connection closes and its tenant's stream place is given back.
- A quiet stream gets a keep-alive and a fresh read every keep-alive interval, so a lost
  notification costs at most one interval, never an event.
- A client that does not read lets its buffer grow to `MAX_BUFFERED` bytes, then is dropped
  (it resumes from `Last-Event-ID`).
- A second subscription, to the live text (`LiveText.listen`), carries a streaming model
  call's deltas; each follower's `TurnCursor` takes what extends what it was sent. When a
  follower's call opens (its `ModelCallStarted` delivered, or resumed mid-turn) or it sees a
  gap, the run's turn text is read once on a reader thread for all its followers; deltas that
  arrive meanwhile wait and are applied after it (their offsets drop what the snapshot
  held). A resubscription reads the snapshots again of runs with an open call.
- A follower whose `Follow` says `cancel_on_disconnect` cancels its run when its client
  goes away before the stream ended (`/v1` under `Runs.CancelOnDisconnect`).
- A follower of a run whose worker died follows on into the run that continues it
  (`web.continuing`): it moves to that run's followers, from its first event.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from tracon_jobs.coordination.event_feed import EventFeed, Listening
from tracon_jobs.coordination.live_text import LiveText, TextDelta, TurnText
from tracon_jobs.coordination.streams import RENEW_SECONDS, StreamPlace, StreamPlaces
from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS
from tracon_jobs.runs.store import Event, Run, RunStore
from web.continuing import BLOCKED, Chain, FollowOn, Step
from web.live_turn import LiveItem, TurnCursor
from web.sse import KEEPALIVE, KEEPALIVE_SECONDS, Follow

log = logging.getLogger(__name__)

READERS = 4
"""Threads reading SQL for the hub: one read serves every follower of a run."""
MAX_BUFFERED = 1024 * 1024
"""Bytes a follower's unsent output may reach before the hub drops a client that stopped reading."""
SWEEP_SECONDS = 0.5
READ_LIMIT = 1000  # RunStore.events' page: a full page is followed by another read
LAST_CHUNK = b"0\r\n\r\n"
ENDS = TERMINAL_EVENTS | {BLOCKED}
"""The events that may end a stream: a closing that needs its run reads it with them."""


class Follower:
    """One client's stream: its connection, what it was sent, what waits to be written."""

    __slots__ = (
        "chain",
        "chunked",
        "cursor",
        "ending",
        "follow",
        "last",
        "out",
        "place",
        "quiet_until",
        "sock",
    )

    def __init__(
        self,
        sock: socket.socket,
        follow: Follow,
        last: int,
        place: StreamPlace,
        chunked: bool,
        chain: Chain,
    ) -> None:
        self.chain = chain
        self.cursor = TurnCursor()
        self.sock = sock
        self.follow = follow
        self.last = last
        self.place = place
        self.chunked = chunked
        self.out = bytearray()
        self.quiet_until = 0.0
        self.ending = False  # the closing is queued: the connection closes once it is out

    def queue(self, text: str) -> None:
        if not text:
            return
        data = text.encode()
        if self.chunked:
            self.out += b"%x\r\n" % len(data)
            self.out += data
            self.out += b"\r\n"
        else:
            self.out += data

    def end(self, run: Run | None) -> None:
        """Queue the stream's closing; the connection closes once it is out."""
        self.queue(self.follow.closing(run))
        if self.chunked:
            self.out += LAST_CHUNK
        self.ending = True

    def queue_live(self, items: list[LiveItem], encoded: dict[LiveItem, str] | None = None) -> None:
        """Queue the frames of `items`; `encoded`, the frames of this run's items encoded
        so far, is used and filled when the follow's `live` depends on the item alone."""
        for item in items:
            if encoded is not None and self.follow.live_shared:
                text = encoded.get(item)
                if text is None:
                    text = encoded[item] = self.follow.live(item)
            else:
                text = self.follow.live(item)
            self.queue(text)
            if self.follow.done and not self.ending:  # the stream ends here
                if self.chunked:
                    self.out += LAST_CHUNK
                self.ending = True
                return


class StreamHub:
    """The live streams of one process (see the module's docstring)."""

    def __init__(
        self,
        runs: RunStore,
        feed: EventFeed,
        places: StreamPlaces,
        keepalive: float = KEEPALIVE_SECONDS,
        readers: int = READERS,
        *,
        max_buffered: int = MAX_BUFFERED,
        live_text: LiveText | None = None,
        cancel: Callable[[str], None] | None = None,
        follows_on: bool = False,
    ) -> None:
        self.follows_on = follows_on  # streams follow orphans into their continuations
        self.runs = runs
        self.places = places
        self.keepalive = keepalive
        self.max_buffered = max_buffered
        self.selector = selectors.DefaultSelector()
        self.wake_in, self.wake_out = socket.socketpair()
        self.wake_in.setblocking(False)
        self.wake_out.setblocking(False)
        self.selector.register(self.wake_in, selectors.EVENT_READ, None)
        self.inbox: deque[Callable[[], None]] = deque()
        self.followers: dict[str, set[Follower]] = {}
        self.reading: set[str] = set()
        self.again: set[str] = set()
        self.returning: list[StreamPlace] = []  # dropped followers' places, given back at once
        self.live_text = live_text
        self.cancel = cancel  # cancels a run (a follower that cancels on disconnect)
        self.snapshotting: dict[str, list[TextDelta]] = {}  # deltas held during the read
        self.snapshot_again: set[str] = set()
        self.pool = ThreadPoolExecutor(readers, thread_name_prefix="stream-reader")
        self.closed = False
        self.thread = threading.Thread(target=self.loop, name="stream-hub", daemon=True)
        self.thread.start()
        self.listening = feed.listen(self.notified, self.resync)
        self.text_listening: Listening | None = None
        if live_text is not None:
            self.text_listening = live_text.listen(self.text_delta, self.text_resync)

    # -- from any thread -----------------------------------------------------------------

    def call(self, work: Callable[[], None]) -> None:
        """Run `work` on the hub's thread."""
        self.inbox.append(work)
        with contextlib.suppress(OSError):  # a full wake-up pipe: the hub is awake anyway
            self.wake_out.send(b"\0")

    def adopt(
        self,
        sock: socket.socket,
        follow: Follow,
        after: int,
        place: StreamPlace,
        chunked: bool,
        resume: int | None = None,
    ) -> None:
        """`resume`: the call open at `after` (`web.sse.open_call`), for a mid-turn rejoin."""
        sock.setblocking(False)
        follower = Follower(sock, follow, after, place, chunked, Chain(self.follows_on))
        if resume is not None:
            follower.cursor.resume(resume)
        follower.queue(follow.opening() or KEEPALIVE)
        self.call(lambda: self.join(follower))

    def notified(self, run_id: str) -> None:
        if run_id in self.followers:  # most runs of a cluster are followed by nobody here
            self.call(lambda: self.read(run_id))

    def resync(self) -> None:
        """The subscription is (again) in place: whatever it missed is read now."""
        self.call(lambda: self.read_all(self.followers))

    def text_delta(self, delta: TextDelta) -> None:
        if delta.run_id in self.followers:
            self.call(lambda: self.on_delta(delta))

    def text_resync(self) -> None:
        """The text subscription is (again) in place: open calls' text is read again."""
        self.call(self.snapshot_open_calls)

    def count(self) -> int:
        return sum(len(group) for group in list(self.followers.values()))

    def close(self) -> None:
        self.closed = True
        self.listening.close()
        if self.text_listening is not None:
            self.text_listening.close()
        self.call(lambda: None)

    # -- the hub's thread ----------------------------------------------------------------

    def loop(self) -> None:
        next_sweep = time.monotonic() + SWEEP_SECONDS
        next_renewal = time.monotonic() + RENEW_SECONDS
        while not self.closed:
            try:
                timeout = max(0.0, next_sweep - time.monotonic())
                for key, mask in self.selector.select(timeout):
                    if key.data is None:
                        self.run_inbox()
                        continue
                    follower: Follower = key.data
                    if mask & selectors.EVENT_READ and not self.client_is_there(follower):
                        self.drop(follower)
                    elif mask & selectors.EVENT_WRITE:
                        self.flush(follower)
                self.give_back_dropped()
                now = time.monotonic()
                if now >= next_sweep:
                    self.sweep(now)
                    next_sweep = now + SWEEP_SECONDS
                if now >= next_renewal:
                    places = [f.place for group in self.followers.values() for f in group]
                    if places:
                        self.pool.submit(self.renew, places)
                    next_renewal = now + RENEW_SECONDS
            except Exception:  # one bad follower or frame must not stop every stream
                log.exception("stream hub iteration failed")
        for group in list(self.followers.values()):
            for follower in list(group):
                self.drop(follower)
        self.give_back_dropped()
        self.pool.shutdown(wait=False)

    def run_inbox(self) -> None:
        try:
            while self.wake_in.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while self.inbox:
            work = self.inbox.popleft()
            try:
                work()
            except Exception:
                log.exception("stream hub work failed")

    def join(self, follower: Follower) -> None:
        self.selector.register(follower.sock, selectors.EVENT_READ, follower)
        self.followers.setdefault(follower.follow.run_id, set()).add(follower)
        follower.quiet_until = time.monotonic() + self.keepalive
        self.flush(follower)
        self.read(follower.follow.run_id)
        self.snapshot_if_needed(follower.follow.run_id)

    def client_is_there(self, follower: Follower) -> bool:
        """A readable follower socket: the client closed it (or sent something to ignore)."""
        try:
            return bool(follower.sock.recv(4096))
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def read(self, run_id: str) -> None:
        group = self.followers.get(run_id)
        if not group:
            return
        if run_id in self.reading:
            self.again.add(run_id)
            return
        self.reading.add(run_id)
        after = min(f.last for f in group)
        needs_run = any(f.follow.needs_run for f in group)
        self.pool.submit(self.fetch, run_id, after, needs_run)

    def read_all(self, run_ids: Iterable[str]) -> None:
        for run_id in list(run_ids):
            self.read(run_id)

    def fetch(self, run_id: str, after: int, needs_run: bool) -> None:
        """On a reader thread: the run's events after `after` (and the run, once ended)."""
        events: list[Event] | None
        run: Run | None = None
        try:
            events = self.runs.events(run_id, after, limit=READ_LIMIT)
            if needs_run and any(e.type in ENDS for e in events):
                run = self.runs.get(run_id)
        except Exception as exc:  # SQL away: the next sweep reads again
            log.warning("live stream read of run %s failed: %s", run_id, exc)
            events = None
        self.call(lambda: self.fetched(run_id, after, events, run))

    def fetched(self, run_id: str, after: int, events: list[Event] | None, run: Run | None) -> None:
        self.reading.discard(run_id)
        if events:
            self.deliver(run_id, after, events, run)
        if run_id in self.again or (events is not None and len(events) >= READ_LIMIT):
            self.again.discard(run_id)
            self.read(run_id)

    def deliver(self, run_id: str, after: int, events: list[Event], run: Run | None) -> None:
        shared: dict[int, str] = {}
        moving: list[tuple[Follower, str]] = []
        now = time.monotonic()
        for follower in list(self.followers.get(run_id, ())):
            if follower.last < after or follower.ending:
                continue  # joined during the read: the read that follows serves it
            for event in events:
                if event.seq <= follower.last:
                    continue
                if event.type in ENDS and follower.follow.needs_run and run is None:
                    self.again.add(run_id)  # joined after the read began: read the run too
                    break
                if follower.follow.shared:
                    text = shared.get(event.seq)
                    if text is None:
                        text = shared[event.seq] = follower.follow.frames(event)
                else:
                    text = follower.follow.frames(event)
                follower.queue_live(follower.cursor.before(event))
                if follower.ending:
                    break
                follower.queue(text)
                follower.last = event.seq
                step = follower.chain.step(event)
                if isinstance(step, FollowOn):
                    moving.append((follower, step.run_id))
                    break
                if step is Step.END:
                    follower.end(run)
                    break
            follower.quiet_until = now + self.keepalive
            self.flush(follower)
        for follower, continuation in moving:
            self.move(follower, continuation)
        self.snapshot_if_needed(run_id)

    def move(self, follower: Follower, run_id: str) -> None:
        """A follower of an orphan follows on into the run that continues it."""
        group = self.followers.get(follower.follow.run_id)
        if group is None or follower not in group:
            return  # dropped meanwhile
        group.discard(follower)
        if not group:
            del self.followers[follower.follow.run_id]
        follower.follow.follow_on(run_id)
        follower.last = 0
        follower.cursor = TurnCursor()
        self.followers.setdefault(run_id, set()).add(follower)
        self.read(run_id)

    def give_up(self, follower: Follower) -> None:
        """The orphan's scan said nothing more in time: end the stream (with its run, when
        the closing needs it)."""
        run_id = follower.follow.run_id

        def read() -> None:
            try:
                run = self.runs.get(run_id) if follower.follow.needs_run else None
            except Exception as exc:  # SQL away: the next sweep tries again
                log.warning("live stream read of run %s failed: %s", run_id, exc)
                self.call(lambda: setattr(follower.chain, "waiting_since", 0.0))
                return
            self.call(lambda: self.ended_waiting(follower, run))

        self.pool.submit(read)

    def ended_waiting(self, follower: Follower, run: Run | None) -> None:
        if follower.ending or follower not in self.followers.get(follower.follow.run_id, ()):
            return
        follower.end(run)
        self.flush(follower)

    # -- live text (the hub's thread) ------------------------------------------------------

    def on_delta(self, delta: TextDelta) -> None:
        held = self.snapshotting.get(delta.run_id)
        if held is not None:  # applied once the snapshot is in
            held.append(delta)
            return
        self.apply(delta.run_id, delta)

    def apply(self, run_id: str, delta: TextDelta) -> None:
        now = time.monotonic()
        encoded: dict[LiveItem, str] = {}  # the run's followers mostly get the same items
        for follower in list(self.followers.get(run_id, ())):
            if follower.ending:
                continue
            items = follower.cursor.delta(delta)
            if items:
                follower.queue_live(items, encoded)
                follower.quiet_until = now + self.keepalive
                self.flush(follower)
        self.snapshot_if_needed(run_id)

    def snapshot_if_needed(self, run_id: str) -> None:
        group = self.followers.get(run_id, ())
        if any(f.cursor.needs_snapshot and not f.ending for f in group):
            self.read_snapshot(run_id)

    def snapshot_open_calls(self) -> None:
        for run_id, group in list(self.followers.items()):
            if any(f.cursor.open is not None for f in group):
                self.read_snapshot(run_id)

    def read_snapshot(self, run_id: str) -> None:
        if self.live_text is None:
            return
        if run_id in self.snapshotting:
            self.snapshot_again.add(run_id)
            return
        self.snapshotting[run_id] = []
        self.pool.submit(self.fetch_snapshot, run_id)

    def fetch_snapshot(self, run_id: str) -> None:
        """On a reader thread: the run's turn text so far."""
        assert self.live_text is not None
        turn: TurnText | None = None
        ok = True
        try:
            turn = self.live_text.snapshot(run_id)
        except Exception as exc:  # the durable ModelCallCompleted still carries the text
            log.warning("live text of run %s not read: %s", run_id, exc)
            ok = False
        self.call(lambda: self.snapshotted(run_id, turn, ok))

    def snapshotted(self, run_id: str, turn: TurnText | None, ok: bool) -> None:
        held = self.snapshotting.pop(run_id, [])
        now = time.monotonic()
        for follower in list(self.followers.get(run_id, ())):
            if follower.ending:
                continue
            items = follower.cursor.snapshot(turn) if ok else []
            for delta in held:
                items += follower.cursor.delta(delta)
            if items:
                follower.queue_live(items)
                follower.quiet_until = now + self.keepalive
                self.flush(follower)
        if run_id in self.snapshot_again:
            self.snapshot_again.discard(run_id)
            self.read_snapshot(run_id)
        elif ok:
            self.snapshot_if_needed(run_id)

    def flush(self, follower: Follower) -> None:
        out = follower.out
        while out:
            try:
                sent = follower.sock.send(out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.drop(follower)
                return
            del out[:sent]
        if out and len(out) > self.max_buffered:
            log.info(
                "live stream of run %s dropped: its client stopped reading", follower.follow.run_id
            )
            self.drop(follower)
            return
        if not out and follower.ending:
            self.drop(follower)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0)
        if self.selector.get_key(follower.sock).events != events:
            self.selector.modify(follower.sock, events, follower)

    def drop(self, follower: Follower) -> None:
        """Close the connection and give the tenant's place back (once)."""
        group = self.followers.get(follower.follow.run_id)
        if group is None or follower not in group:
            return
        left = not follower.ending and not self.closed and self.cancel is not None
        if left and cancels_on_disconnect(follower.follow):
            self.pool.submit(self.cancel_run, follower.follow.run_id)
        group.discard(follower)
        if not group:
            del self.followers[follower.follow.run_id]
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(follower.sock)
        with contextlib.suppress(OSError):
            follower.sock.close()
        self.returning.append(follower.place)

    def give_back_dropped(self) -> None:
        """The places of the followers dropped since the last call, in one Redis call (a burst
        of runs ending must not queue a call per follower before the readers' SQL)."""
        if self.returning:
            places, self.returning = self.returning, []
            self.pool.submit(self.give_back, places)

    def sweep(self, now: float) -> None:
        """Keep-alives for quiet streams, and a read of their runs in case a wake-up was lost."""
        quiet: set[str] = set()
        for run_id, group in list(self.followers.items()):
            for follower in list(group):
                if follower.chain.given_up(now) and not follower.ending:
                    follower.chain.waiting_since = None  # one read of its run ends it
                    self.give_up(follower)
                if follower.quiet_until <= now and not follower.ending:
                    follower.queue(KEEPALIVE)
                    follower.quiet_until = now + self.keepalive
                    quiet.add(run_id)
                    self.flush(follower)
        self.read_all(quiet)

    def cancel_run(self, run_id: str) -> None:
        assert self.cancel is not None
        try:
            self.cancel(run_id)
        except Exception as exc:
            log.warning("run %s not canceled after its client went away: %s", run_id, exc)

    def give_back(self, places: list[StreamPlace]) -> None:
        try:
            self.places.give_back_all(places)
        except Exception as exc:  # their leases run out instead
            log.warning("%d stream places not given back: %s", len(places), exc)

    def renew(self, places: list[StreamPlace]) -> None:
        try:
            self.places.renew(places)
        except Exception as exc:
            log.warning("stream places not renewed: %s", exc)


def cancels_on_disconnect(follow: Follow) -> bool:
    """Whether the run ends with its stream's client (`/v1` under `Runs.CancelOnDisconnect`)."""
    return bool(getattr(follow, "cancel_on_disconnect", False))
