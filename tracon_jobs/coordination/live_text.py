"""A model call's text as it streams: published live, never stored per token in SQL.

While a call streams, its worker appends each coalesced piece of text to the run's *turn
text* in Redis (a hash: the call's seq, the text so far; a TTL renewed at every append) and
publishes the piece as a delta on one channel, in the same script (`text_send.lua`): so
every delta carries its `offset`, the UTF-8 bytes of the call's text before it, and a
follower that holds the first `n` bytes takes from any delta or snapshot exactly what comes
after them. Nothing twice, nothing missing, whichever of the live deltas and the snapshot
(read when a follower joins mid-turn) it sees first.

The call's seq is the seq of its `ModelCallStarted` event. A call that fails after some text
went out withdraws it (`reset`: the delta `withdrawn`); one that completed forgets it
(`forget`), since its `ModelCallCompleted` holds the whole text. A later call of the run
replaces the turn text; a writer with an earlier call (one that lost the run) changes nothing.

`TurnWriter` is the worker's side. A call's first piece goes out at once, on the call's
thread; the later ones, its withdrawal and its forgetting go to the process's `TextSender`,
one thread that sends every call's waiting changes together, in one round trip, at most
`COALESCE_SECONDS` after the oldest of them was made (or as soon as a call holds
`COALESCE_BYTES`): a piece waits no longer than before, and a hundred streaming calls of one
worker cost one round trip a tick instead of one each. A call's pieces that meet in one
tick go out as one delta, so each delta is still one publication.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import redis

from tracon_jobs.coordination.event_feed import Listening, RedisListener, Resync
from tracon_jobs.coordination.scripts import Scripts

log = logging.getLogger(__name__)

TURN_TEXT_TTL_SECONDS = 3600
"""How long a turn's text outlives its last append (a call of a worker that died)."""
COALESCE_SECONDS = 0.03
"""A delta is published at most this long after its first piece arrived."""
COALESCE_BYTES = 512
"""A delta is published as soon as it holds this many bytes."""
CLOSE_SECONDS = 2.0
"""How long closing a `TextSender` waits for what it holds to be sent."""


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


APPEND: Literal["a"] = "a"
WITHDRAW: Literal["x"] = "x"
FORGET: Literal["f"] = "f"


@dataclass(frozen=True, slots=True)
class TextOp:
    """One change of a run's turn text: add `text` to call `call_seq`'s (`APPEND`), withdraw
    what was published of it (`WITHDRAW`), or forget it (`FORGET`, the call completed)."""

    run_id: str
    call_seq: int
    what: Literal["a", "x", "f"]
    text: str = ""


@dataclass(frozen=True)
class TurnText:
    """A run's streaming call: its seq and its text so far (UTF-8)."""

    call_seq: int
    text: bytes


OnDelta = Callable[[TextDelta], None]


class LiveText(Protocol):
    def send(self, ops: Sequence[TextOp]) -> None:
        """Apply `ops` in order (each as if alone), in one round trip where it can."""
        ...

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


class TextOps:
    """`append`, `reset` and `forget`, each one op `send`s."""

    def send(self, ops: Sequence[TextOp]) -> None:
        raise NotImplementedError

    def append(self, run_id: str, call_seq: int, text: str) -> None:
        self.send([TextOp(run_id, call_seq, APPEND, text)])

    def reset(self, run_id: str, call_seq: int) -> None:
        self.send([TextOp(run_id, call_seq, WITHDRAW)])

    def forget(self, run_id: str, call_seq: int) -> None:
        self.send([TextOp(run_id, call_seq, FORGET)])


class RedisLiveText(TextOps):
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

    def send(self, ops: Sequence[TextOp]) -> None:
        """One script call for all `ops`; on a cluster client (whose keys of many runs span
        slots) one each, in order. A failure loses the ops: the answer goes on, and its
        followers get its text whole from its `ModelCallCompleted` (or the TTL forgets it)."""
        batches = [[op] for op in ops] if self.scripts.cluster else [list(ops)]
        for batch in batches:
            keys = [self.key(op.run_id) for op in batch]
            args: list[Any] = [self.channel, TURN_TEXT_TTL_SECONDS]
            for op in batch:
                args += [op.what, op.call_seq, op.run_id, op.text]
            try:
                self.scripts("text_send", keys, args)
            except redis.RedisError as exc:
                runs = ", ".join(sorted({op.run_id for op in batch}))
                log.warning("live text of runs %s not sent: %s", runs, exc)

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


class MemoryLiveText(TextOps):
    """The same contract inside one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: dict[str, TurnText] = {}
        self._listeners: list[_MemoryListening] = []

    def send(self, ops: Sequence[TextOp]) -> None:
        for op in ops:
            delta = self._apply(op)
            if delta is None:
                continue
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                listener.on_delta(delta)

    def _apply(self, op: TextOp) -> TextDelta | None:
        """The op applied; the delta it publishes, if any."""
        with self._lock:
            held = self._texts.get(op.run_id)
            if held is not None and held.call_seq > op.call_seq:
                return None
            if op.what != APPEND:
                self._texts.pop(op.run_id, None)
                if op.what == WITHDRAW:
                    return TextDelta(op.run_id, op.call_seq, 0, b"", withdrawn=True)
                return None
            before = held.text if held is not None and held.call_seq == op.call_seq else b""
            piece = op.text.encode()
            self._texts[op.run_id] = TurnText(op.call_seq, before + piece)
            return TextDelta(op.run_id, op.call_seq, len(before), piece)

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


class TextSender:
    """The process's thread that sends the live text of its streaming calls (see the module's
    docstring): `put` queues an op; the thread sends everything queued, joined (a call's
    appends that follow each other are one), in one `send`, once the oldest op has waited
    `seconds`, or at once after `put(..., now=True)`; `put_and_wait` returns once its op
    was sent."""

    def __init__(self, live: LiveText, seconds: float = COALESCE_SECONDS) -> None:
        self.live = live
        self.seconds = seconds
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._ops: list[TextOp] = []
        self._oldest = 0.0  # monotonic time the oldest queued op was put
        self._now = False
        self._sent: list[threading.Event] = []  # set once the queued ops are sent
        self._thread: threading.Thread | None = None
        self._closed = False

    def put_and_wait(self, op: TextOp, timeout: float = 5.0) -> None:
        sent = threading.Event()
        self.put(op, now=True, sent=sent)
        sent.wait(timeout)

    def put(self, op: TextOp, *, now: bool = False, sent: threading.Event | None = None) -> None:
        with self._lock:
            if not self._closed:
                if sent is not None:
                    self._sent.append(sent)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="live-text", daemon=True)
                    self._thread.start()
                wake = not self._ops or (now and not self._now)  # else awake, or due anyway
                if not self._ops:
                    self._oldest = time.monotonic()
                self._ops.append(op)
                self._now = self._now or now
                if wake:
                    self._work.notify()
                return
        self.live.send([op])  # closed: sent by its caller, after what the thread held
        if sent is not None:
            sent.set()

    def close(self) -> None:
        """Send what waits and end the thread; a later op is sent at once by its caller."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._work.notify()
        if thread is not None:
            thread.join(CLOSE_SECONDS)

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._ops:
                        wait = self._oldest + self.seconds - time.monotonic()
                        if self._now or self._closed or wait <= 0:
                            break
                        self._work.wait(wait)
                    elif self._closed:
                        return
                    else:
                        self._work.wait()
                ops, self._ops, self._now = self._ops, [], False
                sent, self._sent = self._sent, []
            try:
                self.live.send(joined(ops))
            except Exception:  # the answers go on; their followers get them whole at their end
                log.exception("live text not sent")
            for event in sent:
                event.set()


def joined(ops: Sequence[TextOp]) -> list[TextOp]:
    """`ops` in order, with each append that follows another of the same call, with no op of
    its run in between, joined into it: what a follower sees is the same text."""
    out: list[TextOp] = []
    last: dict[str, int] = {}  # run -> the index in `out` of its latest op
    for op in ops:
        at = last.get(op.run_id)
        if at is not None and op.what == APPEND:
            before = out[at]
            if before.what == APPEND and before.call_seq == op.call_seq:
                out[at] = TextOp(op.run_id, op.call_seq, APPEND, before.text + op.text)
                continue
        last[op.run_id] = len(out)
        out.append(op)
    return out


class TurnWriter:
    """One streaming call's text (see the module's docstring).

    `text` takes the provider's pieces on the call's thread: the first is published at once,
    the later ones by the process's `TextSender`, at most `COALESCE_SECONDS` later (at once
    when `COALESCE_BYTES` wait). `close` ignores later pieces; `withdraw` tells followers the
    text so far is withdrawn; `forget` lets go of it once the call's `ModelCallCompleted` is
    written. Whatever the sender holds of the call goes out before the withdrawal or the
    forgetting: one thread sends them, in order."""

    def __init__(
        self,
        sender: TextSender,
        run_id: str,
        call_seq: int,
        *,
        max_bytes: int = COALESCE_BYTES,
    ) -> None:
        self.live = sender.live
        self.run_id = run_id
        self.call_seq = call_seq
        self.max_bytes = max_bytes
        self.sender = sender
        self._lock = threading.Lock()
        self._queued_bytes = 0  # bytes put since the sender was last asked to send at once
        self._closed = False
        self.sent_any = False

    def text(self, piece: str) -> None:
        if not piece:
            return
        with self._lock:
            if self._closed:
                return
            if not self.sent_any:  # the first at once, on this thread: nothing of the call
                self.sent_any = True  # waits in the sender before it
                self.live.append(self.run_id, self.call_seq, piece)
                return
            self._queued_bytes += len(piece.encode())
            now = self._queued_bytes >= self.max_bytes
            if now:
                self._queued_bytes = 0
            self.sender.put(TextOp(self.run_id, self.call_seq, APPEND, piece), now=now)

    def close(self) -> None:
        """The call's answer is whole: later pieces are ignored (the queued ones go out)."""
        with self._lock:
            self._closed = True

    def withdraw(self) -> None:
        """The call failed: withdraw what was published (after what is queued), and return once
        followers were told, so that no text of a later call (a fallback's) goes out first."""
        with self._lock:
            self._closed = True
            sent = self.sent_any
        if sent:
            self.sender.put_and_wait(TextOp(self.run_id, self.call_seq, WITHDRAW))

    def forget(self) -> None:
        """The call's `ModelCallCompleted` is written: the turn text is not needed any more."""
        with self._lock:
            self._closed = True
            if self.sent_any:
                self.sender.put(TextOp(self.run_id, self.call_seq, FORGET))
