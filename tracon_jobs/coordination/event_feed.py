"""Wake-ups for live event tails.

SQL holds the events; the feed only says "run X has something new", so a tail never
misses an event and never sends one twice: it takes the feed's position, reads SQL after
the last sequence it sent, and only then blocks on the feed from that position. A lost
notification costs at most one keep-alive interval, never an event.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any, Protocol

import redis

log = logging.getLogger(__name__)

STREAM_MAXLEN = 100
STREAM_TTL_SECONDS = 24 * 3600

PUBLISH_LUA = """
-- KEYS[1]: the run's stream. ARGV: seq, maxlen (approximate), ttl seconds.
-- The append and its TTL in one call: one round trip, and the stream never outlives its
-- last event by more than the TTL (a pipelined XADD + EXPIRE costs two replies to parse).
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'seq', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
"""


class EventFeed(Protocol):
    def publish(self, run_id: str, seq: int) -> None: ...

    def position(self, run_id: str) -> str: ...

    def wait(self, run_id: str, position: str, timeout: float) -> str | None:
        """Block until something is published after `position`; the new position, or None."""
        ...


class RedisEventFeed:
    """One capped Redis stream per run, expiring a day after its last event."""

    def __init__(self, client: redis.Redis, prefix: str = "tracon") -> None:
        self.client = client
        self.prefix = prefix
        self._publish = client.register_script(PUBLISH_LUA)  # reloads itself after a flush

    def key(self, run_id: str) -> str:
        return f"{self.prefix}:run-events:{run_id}"

    def publish(self, run_id: str, seq: int) -> None:
        try:
            self._publish(keys=[self.key(run_id)], args=[seq, STREAM_MAXLEN, STREAM_TTL_SECONDS])
        except redis.RedisError as exc:  # SQL has the event; tails fall back to polling
            log.warning("event feed publish failed for run %s: %s", run_id, exc)

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


class MemoryEventFeed:
    """The same contract inside one process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._counters: dict[str, int] = defaultdict(int)

    def publish(self, run_id: str, seq: int) -> None:
        with self._cond:
            self._counters[run_id] += 1
            self._cond.notify_all()

    def position(self, run_id: str) -> str:
        with self._cond:
            return str(self._counters[run_id])

    def wait(self, run_id: str, position: str, timeout: float) -> str | None:
        with self._cond:
            changed = self._cond.wait_for(
                lambda: str(self._counters[run_id]) != position, timeout=timeout
            )
            return str(self._counters[run_id]) if changed else None


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
