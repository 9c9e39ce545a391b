"""Wake-ups for live event tails.

SQL holds the events; the feed only says "run X has something new", so a tail never
misses an event and never sends one twice: it takes the feed's position, reads SQL after
the last sequence it sent, and only then blocks on the feed from that position. A lost
notification costs at most one keep-alive interval, never an event.

A web process that follows many runs at once does not block per run: it `listen`s once
for every run's notifications (one Redis subscription per process, whatever the number of
followers) and reads SQL for the runs it follows when one arrives.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis

from tracon_jobs.coordination.scripts import Call, Scripts

log = logging.getLogger(__name__)

STREAM_MAXLEN = 100
STREAM_TTL_SECONDS = 24 * 3600

LISTEN_RETRY_SECONDS = 1.0
LISTEN_READY_SECONDS = 5.0

Notify = Callable[[str], None]
"""Called with a run id when the run has something new (from the listener's thread)."""
Resync = Callable[[], None]
"""Called once the listener is (again) subscribed: anything published before may be lost."""


class Listening(Protocol):
    def close(self) -> None: ...


class EventFeed(Protocol):
    def publish(self, run_id: str, seq: int) -> None: ...

    def publish_all(self, events: Sequence[tuple[str, int]]) -> None:
        """`publish` of several (run id, seq), in order: one round trip where it can."""
        ...

    def position(self, run_id: str) -> str: ...

    def wait(self, run_id: str, position: str, timeout: float) -> str | None:
        """Block until something is published after `position`; the new position, or None."""
        ...

    def listen(self, notify: Notify, resync: Resync) -> Listening:
        """Every run's notifications, until closed; returns once subscribed (or given up
        waiting: `resync` says when the subscription is in place)."""
        ...


class RedisEventFeed:
    """One capped Redis stream per run, expiring a day after its last event."""

    def __init__(self, client: redis.Redis, prefix: str = "tracon") -> None:
        self.client = client
        self.prefix = prefix
        self.scripts = Scripts(client)  # with the spends and records deferred before it

    def key(self, run_id: str) -> str:
        return f"{self.prefix}:run-events:{run_id}"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:run-events"

    def publish(self, run_id: str, seq: int) -> None:
        try:
            self.scripts("feed_publish", [self.key(run_id)], self._args(run_id, seq))
        except redis.RedisError as exc:  # SQL has the event; tails fall back to polling
            log.warning("event feed publish failed for run %s: %s", run_id, exc)

    def publish_all(self, events: Sequence[tuple[str, int]]) -> None:
        """The publishes composed into one EVALSHA (`Scripts.run_all`), sent now whatever
        is deferred on this thread."""
        calls = [Call("feed_publish", [self.key(r)], self._args(r, seq)) for r, seq in events]
        if not calls:
            return
        try:
            self.scripts.run_all(calls)
        except redis.RedisError as exc:  # SQL has the events; tails fall back to polling
            runs = sorted({run_id for run_id, _ in events})
            log.warning("event feed publish failed for runs %s: %s", runs, exc)

    def _args(self, run_id: str, seq: int) -> list[str | int]:
        return [seq, STREAM_MAXLEN, STREAM_TTL_SECONDS, self.channel, run_id]

    def position(self, run_id: str) -> str:
        try:
            last: Any = self.client.xrevrange(self.key(run_id), count=1)
        except redis.RedisError:
            return "0-0"
        return _decode(last[0][0]) if last else "0-0"

    def wait(self, run_id: str, position: str, timeout: float) -> str | None:
        try:
            reply: Any = self.client.xread(
                {self.key(run_id): position}, count=100, block=max(1, int(timeout * 1000))
            )
        except redis.RedisError as exc:
            log.warning("event feed wait failed for run %s: %s", run_id, exc)
            threading.Event().wait(min(timeout, 1.0))
            return position
        if not reply:
            return None
        entries = reply[0][1]
        return _decode(entries[-1][0])

    def listen(self, notify: Notify, resync: Resync) -> Listening:
        listener = RedisListener(self.client, self.channel, notify, resync)
        listener.ready.wait(LISTEN_READY_SECONDS)
        return listener


class RedisListener:
    """One subscription to the notification channel, in a daemon thread that subscribes
    again after a lost connection (and says so through `resync`)."""

    def __init__(self, client: redis.Redis, channel: str, notify: Notify, resync: Resync) -> None:
        self.client = client
        self.channel = channel
        self.notify = notify
        self.resync = resync
        self.ready = threading.Event()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self.run, name="event-feed-listener", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.closed.is_set():
            try:
                self.listen_once()
            except Exception as exc:  # the connection, or its client closed under it
                if self.closed.is_set():
                    return
                log.warning("event feed subscription lost (%s); subscribing again", exc)
            self.closed.wait(LISTEN_RETRY_SECONDS)

    def listen_once(self) -> None:
        pubsub = self.client.pubsub()
        try:
            pubsub.subscribe(self.channel)
            while not self.closed.is_set():
                message = pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    self.resync()
                    self.ready.set()
                elif message["type"] == "message":
                    self.notify(_decode(message["data"]))
        finally:
            pubsub.close()

    def close(self) -> None:
        self.closed.set()


class MemoryEventFeed:
    """The same contract inside one process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._counters: dict[str, int] = defaultdict(int)
        self._listeners: list[MemoryListener] = []

    def publish_all(self, events: Sequence[tuple[str, int]]) -> None:
        for run_id, seq in events:
            self.publish(run_id, seq)

    def publish(self, run_id: str, seq: int) -> None:
        with self._cond:
            self._counters[run_id] += 1
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener.notify(run_id)

    def listen(self, notify: Notify, resync: Resync) -> Listening:
        listener = MemoryListener(self, notify)
        with self._cond:
            self._listeners.append(listener)
        resync()
        return listener

    def position(self, run_id: str) -> str:
        with self._cond:
            return str(self._counters[run_id])

    def wait(self, run_id: str, position: str, timeout: float) -> str | None:
        with self._cond:
            changed = self._cond.wait_for(
                lambda: str(self._counters[run_id]) != position, timeout=timeout
            )
            return str(self._counters[run_id]) if changed else None


class MemoryListener:
    def __init__(self, feed: MemoryEventFeed, notify: Notify) -> None:
        self.feed = feed
        self.notify = notify

    def close(self) -> None:
        with self.feed._cond:
            self.feed._listeners.remove(self)


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
