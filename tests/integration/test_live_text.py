"""The live text's contract, on Redis and in memory alike: ops applied in order as if alone,
an earlier call's ops change nothing once a later call holds the run; and the worker's side,
`TurnWriter` and the process's `TextSender`: a call's first piece at once, the later ones of
every call together in one send, joined per call, in order, nothing twice, nothing missing;
a withdrawal returns once it was published."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import redis

from tracon_jobs.coordination.event_feed import Listening, Resync
from tracon_jobs.coordination.live_text import (
    APPEND,
    FORGET,
    WITHDRAW,
    LiveText,
    MemoryLiveText,
    OnDelta,
    RedisLiveText,
    TextDelta,
    TextOp,
    TextOps,
    TextSender,
    TurnText,
    TurnWriter,
    joined,
)


@pytest.fixture(params=["redis", "memory"])
def live(request: pytest.FixtureRequest) -> LiveText:
    if request.param == "memory":
        return MemoryLiveText()
    client: redis.Redis = request.getfixturevalue("redis_client")
    return RedisLiveText(client, prefix=f"tracon-test-{time.monotonic_ns()}")


class Seen:
    """Every delta of the live text, in the order they arrived."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deltas: list[TextDelta] = []
        self.ready = threading.Event()

    def __call__(self, delta: TextDelta) -> None:
        with self.lock:
            self.deltas.append(delta)

    def of(self, run_id: str) -> list[TextDelta]:
        with self.lock:
            return [d for d in self.deltas if d.run_id == run_id]

    def wait_for(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.deltas) >= count:
                    return
            time.sleep(0.005)
        raise AssertionError(f"{len(self.deltas)} deltas, not {count}")


@pytest.fixture
def seen(live: LiveText) -> Iterator[Seen]:
    seen = Seen()
    listening = live.listen(seen, seen.ready.set)
    assert seen.ready.wait(5)
    yield seen
    listening.close()


class CountingSends(TextOps):
    """A live text that keeps each `send`'s ops (the round trips a sender makes)."""

    def __init__(self, inner: LiveText) -> None:
        self.inner = inner
        self.sends: list[list[TextOp]] = []

    def send(self, ops: Sequence[TextOp]) -> None:
        self.sends.append(list(ops))
        self.inner.send(ops)

    def snapshot(self, run_id: str) -> TurnText | None:
        return self.inner.snapshot(run_id)

    def listen(self, on_delta: OnDelta, resync: Resync) -> Listening:
        return self.inner.listen(on_delta, resync)


def call_r1(live: LiveText, seconds: float, max_bytes: int = 512) -> TurnWriter:
    """A streaming call of run `r1` (call 2), on a sender of its own that waits `seconds`."""
    return TurnWriter(TextSender(live, seconds=seconds), "r1", 2, max_bytes=max_bytes)


def test_ops_of_several_runs_in_one_send_apply_in_order_as_if_alone(
    live: LiveText, seen: Seen
) -> None:
    live.send(
        [
            TextOp("r1", 3, APPEND, "Hel"),
            TextOp("r2", 5, APPEND, "é"),  # offsets count UTF-8 bytes
            TextOp("r1", 3, APPEND, "lo"),
            TextOp("r2", 5, APPEND, "x"),
            TextOp("r2", 5, WITHDRAW),
            TextOp("r3", 1, APPEND, "gone"),
            TextOp("r3", 1, FORGET),
        ]
    )
    seen.wait_for(6)
    assert [(d.call_seq, d.offset, d.text) for d in seen.of("r1")] == [
        (3, 0, b"Hel"),
        (3, 3, b"lo"),
    ]
    assert [(d.offset, d.text, d.withdrawn) for d in seen.of("r2")] == [
        (0, "é".encode(), False),
        (2, b"x", False),
        (0, b"", True),
    ]
    assert [d.text for d in seen.of("r3")] == [b"gone"]  # forgetting publishes nothing
    assert live.snapshot("r1") == TurnText(3, b"Hello")
    assert live.snapshot("r2") is None and live.snapshot("r3") is None


def test_an_earlier_calls_ops_change_nothing_once_a_later_call_holds_the_run(
    live: LiveText, seen: Seen
) -> None:
    live.append("r1", 7, "new")
    live.send([TextOp("r1", 6, APPEND, "old"), TextOp("r1", 6, WITHDRAW), TextOp("r1", 6, FORGET)])
    live.append("r1", 7, "er")
    seen.wait_for(2)
    time.sleep(0.05)  # nothing else comes
    assert [(d.call_seq, d.offset, d.text, d.withdrawn) for d in seen.of("r1")] == [
        (7, 0, b"new", False),
        (7, 3, b"er", False),
    ]
    assert live.snapshot("r1") == TurnText(7, b"newer")


def test_joined_joins_a_calls_appends_only_across_other_runs_ops() -> None:
    ops = [
        TextOp("a", 1, APPEND, "x"),
        TextOp("b", 1, APPEND, "1"),
        TextOp("a", 1, APPEND, "y"),  # joins a's first: only b's op between them
        TextOp("a", 1, WITHDRAW),
        TextOp("a", 1, APPEND, "z"),  # after a's withdrawal: stays apart
        TextOp("a", 2, APPEND, "p"),  # another call of a: apart
        TextOp("b", 1, APPEND, "2"),
    ]
    assert joined(ops) == [
        TextOp("a", 1, APPEND, "xy"),
        TextOp("b", 1, APPEND, "12"),
        TextOp("a", 1, WITHDRAW),
        TextOp("a", 1, APPEND, "z"),
        TextOp("a", 2, APPEND, "p"),
    ]


def test_many_streaming_calls_share_the_senders_round_trips_and_lose_nothing(
    live: LiveText, seen: Seen
) -> None:
    counting = CountingSends(live)
    sender = TextSender(counting, seconds=0.03)
    runs, pieces = 20, 30
    texts = {f"run-{i}": [f"{i}.{n} " for n in range(pieces)] for i in range(runs)}

    def stream(run_id: str) -> None:
        writer = TurnWriter(sender, run_id, 4)
        for piece in texts[run_id]:
            writer.text(piece)
            time.sleep(0.002)
        writer.close()

    threads = [threading.Thread(target=stream, args=(run_id,)) for run_id in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        b"".join(d.text for d in seen.of(r)) != "".join(t).encode() for r, t in texts.items()
    ):
        time.sleep(0.01)

    for run_id, text in texts.items():
        mine = seen.of(run_id)
        offset = 0
        for delta in mine:  # contiguous, in order, nothing twice
            assert delta.offset == offset and delta.call_seq == 4
            offset += len(delta.text)
        assert b"".join(d.text for d in mine) == "".join(text).encode(), run_id
        assert len(mine) <= pieces / 2, f"{run_id}: {len(mine)} deltas for {pieces} pieces"
    firsts = [s for s in counting.sends if len(s) == 1 and s[0].text.endswith(".0 ")]
    assert len(firsts) == runs  # each call's first piece alone, at once
    batched = [s for s in counting.sends if s not in firsts]
    assert len(batched) < runs * pieces / 10, f"{len(batched)} sends for the later pieces"
    assert max(len({op.run_id for op in s}) for s in batched) > 1  # several calls a send


def test_a_writers_first_piece_goes_at_once_the_next_within_the_window(
    live: LiveText, seen: Seen
) -> None:
    writer = call_r1(live, 0.2)
    started = time.monotonic()
    writer.text("first")
    seen.wait_for(1)
    assert time.monotonic() - started < 0.15  # not held for the window
    writer.text(" second")
    writer.text(" third")
    seen.wait_for(2)
    waited = time.monotonic() - started
    assert 0.15 <= waited < 1.0, waited
    assert [d.text for d in seen.of("r1")] == [b"first", b" second third"]


def test_a_piece_of_the_byte_limit_goes_without_waiting_for_the_window(
    live: LiveText, seen: Seen
) -> None:
    writer = call_r1(live, 5.0, max_bytes=10)
    writer.text("a")
    writer.text("0123456789")  # the limit: sent now, not in 5 s
    seen.wait_for(2, timeout=2)
    assert [d.text for d in seen.of("r1")] == [b"a", b"0123456789"]


def test_a_withdrawal_returns_once_published_after_the_calls_queued_text(
    live: LiveText, seen: Seen
) -> None:
    writer = call_r1(live, 5.0)
    writer.text("partial")
    writer.text(" more")  # queued for 5 s
    writer.withdraw()  # sends what waits, then the withdrawal, and returns after
    assert live.snapshot("r1") is None  # withdrawn already
    seen.wait_for(3, timeout=1)
    assert [(d.text, d.withdrawn) for d in seen.of("r1")] == [
        (b"partial", False),
        (b" more", False),
        (b"", True),
    ]
    writer.text("late")  # ignored
    assert live.snapshot("r1") is None


def test_forgetting_a_completed_call_goes_after_its_queued_text(live: LiveText, seen: Seen) -> None:
    writer = call_r1(live, 0.05)
    writer.text("a")
    writer.text("b")
    writer.close()
    writer.text("ignored")
    writer.forget()
    seen.wait_for(2)
    deadline = time.monotonic() + 2
    while live.snapshot("r1") is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.snapshot("r1") is None, "the turn text outlived its call"
    assert [d.text for d in seen.of("r1")] == [b"a", b"b"]


def test_closing_the_sender_sends_what_waits_and_a_later_op_goes_at_once(
    live: LiveText, seen: Seen
) -> None:
    writer = call_r1(live, 5.0)
    writer.text("a")
    writer.text("b")  # waits 5 s
    started = time.monotonic()
    writer.sender.close()
    assert time.monotonic() - started < 2.0
    seen.wait_for(2, timeout=1)
    writer.text("c")  # no thread any more: sent by this call
    seen.wait_for(3, timeout=1)
    assert [(d.offset, d.text) for d in seen.of("r1")] == [(0, b"a"), (1, b"b"), (2, b"c")]
