"""Task events are flushed in batches: one scheduled flush per batch, whatever its size."""

from __future__ import annotations

from typing import Any

from tracon_jobs.worker.events import EVENT_FLUSH_SECONDS, BatchingConsumer


class FakeHub:
    """Records what the consumer asks of Celery's event loop; `run` plays the loop."""

    def __init__(self) -> None:
        self.soon: list[Any] = []
        self.later: list[tuple[float, Any]] = []

    def call_soon(self, callback: Any) -> None:
        self.soon.append(callback)

    def call_later(self, delay: float, callback: Any) -> None:
        self.later.append((delay, callback))

    def run_soon(self) -> None:
        callbacks, self.soon = self.soon, []
        for callback in callbacks:
            callback()

    def fire_timers(self) -> None:
        timers, self.later = self.later, []
        for _delay, callback in timers:
            callback()


def consumer_with(hub: FakeHub | None) -> tuple[BatchingConsumer, list[int]]:
    consumer = BatchingConsumer.__new__(BatchingConsumer)  # no broker: the hooks only
    consumer.hub = hub
    flushes: list[int] = []
    consumer._flush_events = lambda: flushes.append(1)
    return consumer, flushes


def test_the_events_of_a_batch_share_one_flush_after_the_delay() -> None:
    hub = FakeHub()
    consumer, flushes = consumer_with(hub)

    for _ in range(5):  # task-received, task-started, task-succeeded, ...
        consumer.on_send_event_buffered()
    hub.run_soon()

    assert [delay for delay, _ in hub.later] == [EVENT_FLUSH_SECONDS]
    assert flushes == []
    hub.fire_timers()
    assert flushes == [1]


def test_an_event_after_the_flush_starts_the_next_batch() -> None:
    hub = FakeHub()
    consumer, flushes = consumer_with(hub)
    consumer.on_send_event_buffered()
    hub.run_soon()
    hub.fire_timers()

    consumer.on_send_event_buffered()
    hub.run_soon()
    hub.fire_timers()

    assert flushes == [1, 1]


def test_what_is_buffered_is_flushed_when_the_consumer_stops() -> None:
    hub = FakeHub()
    consumer, flushes = consumer_with(hub)
    consumer.on_send_event_buffered()

    consumer._flush_quietly()

    assert flushes == [1]


def test_without_an_event_loop_nothing_is_scheduled() -> None:
    consumer, flushes = consumer_with(None)

    consumer.on_send_event_buffered()

    assert flushes == []
