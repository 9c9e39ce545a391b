"""One follower's place in the text of the run's streaming model call.

A live stream sends durable events (from SQL) and, between a call's `ModelCallStarted` and
its end, the call's text as it streams (`tracon_jobs.coordination.live_text`: deltas with
byte offsets, and a snapshot of the text so far). `TurnCursor` is the pure bookkeeping that
makes the two agree for one follower: it knows the open call and how many of its UTF-8
bytes were sent, so from any delta or snapshot it takes exactly the bytes after those
(nothing twice, nothing missing), and at the call's end it sends what the live text never
delivered (from `ModelCallCompleted`'s `text`) or withdraws what it did (`LiveReset`).

It reads nothing itself: the stream hub and `web.sse.followed` feed it the durable events
in order, the deltas and the snapshots, and ask `needs_snapshot` when it saw a gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracon_jobs.coordination.live_text import TextDelta, TurnText
from tracon_jobs.runs.store import Event

OPENS = "ModelCallStarted"
COMPLETES = "ModelCallCompleted"
KEEPS_OPEN = frozenset({"CircuitStateChanged"})
"""The only durable events that may come between a call's start and its completion."""


@dataclass(frozen=True)
class LiveDelta:
    """Text of call `call_seq` that follows what the follower was sent."""

    call_seq: int
    text: str
    whole: bool = False
    """The call's whole text, from its `ModelCallCompleted`: none of it streamed (a provider
    that does not stream). The native stream sends nothing for it (the event carries it)."""


@dataclass(frozen=True)
class LiveReset:
    """The text sent of call `call_seq` is withdrawn (the call ended without completing)."""

    call_seq: int


LiveItem = LiveDelta | LiveReset


class TurnCursor:
    """See the module's docstring. Not thread-safe: one owner (a hub thread, a request)."""

    __slots__ = ("dead", "needs_snapshot", "open", "sent")

    def __init__(self) -> None:
        self.open: int | None = None  # the seq of the open call's ModelCallStarted
        self.sent = 0  # UTF-8 bytes of the open call's text sent to the follower
        self.dead = False  # the open call's text was withdrawn live: take no more of it
        self.needs_snapshot = False

    def resume(self, call_seq: int) -> None:
        """A follower that joins after the open call's `ModelCallStarted` (`Last-Event-ID`)."""
        self._open(call_seq)

    def before(self, event: Event) -> list[LiveItem]:
        """What goes out before `event`'s own frame (the event is then counted as sent)."""
        if event.type in KEEPS_OPEN:
            return []
        items: list[LiveItem] = []
        if event.type == COMPLETES and self.open is not None and not self.dead:
            full = str(event.data.get("text") or "").encode()
            if len(full) > self.sent:
                tail = full[self.sent :].decode(errors="ignore")
                if tail:
                    items.append(LiveDelta(self.open, tail, whole=self.sent == 0))
            self._close()
        elif self.open is not None:
            if self.sent and not self.dead:
                items.append(LiveReset(self.open))
            self._close()
        if event.type == OPENS:
            self._open(event.seq)
        return items

    def delta(self, delta: TextDelta) -> list[LiveItem]:
        """A live delta of the run (any call's): what it adds for this follower."""
        if delta.call_seq != self.open or self.dead:
            return []
        if delta.withdrawn:
            self.dead = True
            sent, self.sent = self.sent, 0
            return [LiveReset(delta.call_seq)] if sent else []
        return self._take(delta.call_seq, delta.offset, delta.text)

    def snapshot(self, turn: TurnText | None) -> list[LiveItem]:
        """The run's turn text as read now: what it adds (nothing, for another call's)."""
        self.needs_snapshot = False
        if turn is None or turn.call_seq != self.open or self.dead:
            return []
        return self._take(turn.call_seq, 0, turn.text)

    def _take(self, call_seq: int, offset: int, text: bytes) -> list[LiveItem]:
        if offset > self.sent:  # a delta was missed: the snapshot has it
            self.needs_snapshot = True
            return []
        end = offset + len(text)
        if end <= self.sent:
            return []
        piece = text[self.sent - offset :].decode(errors="ignore")
        self.sent = end
        return [LiveDelta(call_seq, piece)] if piece else []

    def _open(self, call_seq: int) -> None:
        self.open = call_seq
        self.sent = 0
        self.dead = False
        self.needs_snapshot = True

    def _close(self) -> None:
        self.open = None
        self.sent = 0
        self.dead = False
        self.needs_snapshot = False
