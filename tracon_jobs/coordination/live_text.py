"""A model call's text as it streams: published live, never stored per token in SQL.

While a call streams, its worker appends each coalesced piece of text to the run's *turn
text* in Redis (a hash: the call's seq, the text so far; a TTL renewed at every append) and
publishes the piece as a delta on one channel, in one script call (`text_append.lua`): so
every delta carries its `offset`, the UTF-8 bytes of the call's text before it, and a
follower that holds the first `n` bytes takes from any delta or snapshot exactly what comes
after them. Nothing twice, nothing missing, whichever of the live deltas and the snapshot
(read when a follower joins mid-turn) it sees first.

The call's seq is the seq of its `ModelCallStarted` event. A call that fails after some text
went out withdraws it (`reset`: the delta `withdrawn`); one that completed forgets it
(`forget`), since its `ModelCallCompleted` holds the whole text. A later call of the run
replaces the turn text; a writer with an earlier call (one that lost the run) changes nothing.

`TurnWriter` is the worker's side: it coalesces the provider's deltas (the first at once,
then at most one publication per `COALESCE_SECONDS` or `COALESCE_BYTES`), flushed by one
thread per process when a call goes quiet.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from tracon_jobs.coordination.event_feed import Listening, RedisListener, Resync
from tracon_jobs.coordination.scripts import Scripts
from tracon_jobs.timers import timers

log = logging.getLogger(__name__)

TURN_TEXT_TTL_SECONDS = 3600
"""How long a turn's text outlives its last append (a call of a worker that died)."""
COALESCE_SECONDS = 0.03
"""A delta is published at most this long after its first piece arrived."""
COALESCE_BYTES = 512
"""A delta is published as soon as it holds this many bytes."""


@dataclass(frozen=True)
class TextDelta:
    """One published piece of a call's text, or (`withdrawn`) the withdrawal of all of it."""

    run_id: str
    call_seq: int
    offset: int  # UTF-8 bytes of the call's text before `text`
    text: bytes
    withdrawn: bool = False

    @staticmethod
    def parse(payload: bytes | str) -> TextDelta | None:
        try:
            data = json.loads(payload)
            if data.get("x"):
                return TextDelta(str(data["r"]), int(data["c"]), 0, b"", withdrawn=True)
            return TextDelta(str(data["r"]), int(data["c"]), int(data["o"]), data["t"].encode())
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("unreadable text delta ignored: %r", payload[:200])
            return None


@dataclass(frozen=True)
class TurnText:
    """A run's streaming call: its seq and its text so far (UTF-8)."""

    call_seq: int
    text: bytes


OnDelta = Callable[[TextDelta], None]


class LiveText(Protocol):
    def append(self, run_id: str, call_seq: int, text: str) -> None: ...

    def reset(self, run_id: str, call_seq: int) -> None:
        """The call failed: its text so far is withdrawn (followers are told)."""
        ...

    def forget(self, run_id: str, call_seq: int) -> None:
        """The call completed: its `ModelCallCompleted` holds the text now."""
        ...

    def snapshot(self, run_id: str) -> TurnText | None: ...

    def listen(self, on_delta: OnDelta, resync: Resync) -> Listening:
        """Every run's deltas, until closed (`resync`: the subscription is (again) in place,
        anything published before it may be lost)."""
        ...


class RedisLiveText:
    """Turn texts in Redis hashes, deltas on one pub/sub channel."""

    def __init__(self, client: redis.Redis, prefix: str = "tracon") -> None:
        self.client = client
        self.prefix = prefix
        self.scripts = Scripts(client)

    def key(self, run_id: str) -> str:
        return f"{self.prefix}:turn-text:{run_id}"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:run-text"

    def append(self, run_id: str, call_seq: int, text: str) -> None:
        args = [call_seq, text, TURN_TEXT_TTL_SECONDS, self.channel, run_id]
        try:
            self.scripts("text_append", [self.key(run_id)], args)
        except redis.RedisError as exc:  # the answer goes on; followers get it whole at its end
            log.warning("live text of run %s not published: %s", run_id, exc)

    def reset(self, run_id: str, call_seq: int) -> None:
        self._reset(run_id, call_seq, publish=True)

    def forget(self, run_id: str, call_seq: int) -> None:
        self._reset(run_id, call_seq, publish=False)

    def _reset(self, run_id: str, call_seq: int, *, publish: bool) -> None:
        args = [call_seq, self.channel, run_id, "1" if publish else "0"]
        try:
            self.scripts("text_reset", [self.key(run_id)], args)
        except redis.RedisError as exc:  # the TTL forgets it; the durable events still tell
            log.warning("live text of run %s not reset: %s", run_id, exc)

    def snapshot(self, run_id: str) -> TurnText | None:
        found: Any = self.client.hmget(self.key(run_id), ["call", "text"])
        call, text = found
        if call is None:
            return None
        return TurnText(int(call), text if isinstance(text, bytes) else (text or "").encode())

    def listen(self, on_delta: OnDelta, resync: Resync) -> Listening:
        def notify(payload: str) -> None:
            delta = TextDelta.parse(payload)
            if delta is not None:
                on_delta(delta)

        listener = RedisListener(self.client, self.channel, notify, resync)
        listener.ready.wait(5.0)
        return listener


class MemoryLiveText:
    """The same contract inside one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: dict[str, TurnText] = {}
        self._listeners: list[_MemoryListening] = []

    def append(self, run_id: str, call_seq: int, text: str) -> None:
        with self._lock:
            held = self._texts.get(run_id)
            if held is not None and held.call_seq > call_seq:
                return
            before = held.text if held is not None and held.call_seq == call_seq else b""
            piece = text.encode()
            self._texts[run_id] = TurnText(call_seq, before + piece)
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_delta(TextDelta(run_id, call_seq, len(before), piece))

    def reset(self, run_id: str, call_seq: int) -> None:
        if self._forget(run_id, call_seq):
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                listener.on_delta(TextDelta(run_id, call_seq, 0, b"", withdrawn=True))

    def forget(self, run_id: str, call_seq: int) -> None:
        self._forget(run_id, call_seq)

    def _forget(self, run_id: str, call_seq: int) -> bool:
        with self._lock:
            held = self._texts.get(run_id)
            if held is not None and held.call_seq > call_seq:
                return False
            self._texts.pop(run_id, None)
            return True

    def snapshot(self, run_id: str) -> TurnText | None:
        with self._lock:
            return self._texts.get(run_id)

    def listen(self, on_delta: OnDelta, resync: Resync) -> Listening:
        listening = _MemoryListening(self, on_delta)
        with self._lock:
            self._listeners.append(listening)
        resync()
        return listening


class _MemoryListening:
    def __init__(self, live: MemoryLiveText, on_delta: OnDelta) -> None:
        self.live = live
        self.on_delta = on_delta

    def close(self) -> None:
        with self.live._lock:
            if self in self.live._listeners:
                self.live._listeners.remove(self)


class TurnWriter:
    """One streaming call's text, coalesced into deltas (see the module's docstring).

    `text` takes the provider's pieces on the call's thread; a piece waits at most
    `COALESCE_SECONDS` (the process's flusher thread publishes it when the call goes quiet).
    `close` publishes what waits; `withdraw` tells followers the text so far is withdrawn."""

    def __init__(
        self,
        live: LiveText,
        run_id: str,
        call_seq: int,
        *,
        seconds: float = COALESCE_SECONDS,
        max_bytes: int = COALESCE_BYTES,
    ) -> None:
        self.live = live
        self.run_id = run_id
        self.call_seq = call_seq
        self.seconds = seconds
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._pending_bytes = 0
        self._last_sent = 0.0  # monotonic time of the last publication (0: none yet)
        self._closed = False
        self.sent_any = False
        self.published = 0  # deltas published (the benchmark counts Redis calls by it)

    def text(self, piece: str) -> None:
        if not piece:
            return
        with self._lock:
            if self._closed:
                return
            self._pending.append(piece)
            self._pending_bytes += len(piece.encode())
            now = time.monotonic()
            due = self._last_sent + self.seconds
            if self._pending_bytes >= self.max_bytes or now >= due:
                self._send_locked(now)
                return
            schedule = len(self._pending) == 1
        if schedule:
            timers("live-text-flusher").at(due, self.flush_due)

    def flush_due(self) -> None:
        """From the flusher's thread: publish what waits, if it still does."""
        with self._lock:
            if self._pending and not self._closed:
                self._send_locked(time.monotonic())

    def close(self) -> None:
        """Publish what waits; later pieces are ignored."""
        with self._lock:
            if self._pending and not self._closed:
                self._send_locked(time.monotonic())
            self._closed = True

    def withdraw(self) -> None:
        """The call failed: drop what waits and withdraw what was published."""
        with self._lock:
            self._pending.clear()
            self._closed = True
            sent = self.sent_any
        if sent:
            self.live.reset(self.run_id, self.call_seq)

    def forget(self) -> None:
        """The call's `ModelCallCompleted` is written: the turn text is not needed any more."""
        if self.sent_any:
            self.live.forget(self.run_id, self.call_seq)

    def _send_locked(self, now: float) -> None:
        text = "".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        self._last_sent = now
        self.sent_any = True
        self.published += 1
        self.live.append(self.run_id, self.call_seq, text)  # under the lock: in order
