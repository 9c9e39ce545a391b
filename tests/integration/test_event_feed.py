"""The event feed's contract, in Redis and in memory: several events published together (one
composed call in Redis) reach a listener each, in order, and each run's stream holds them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tracon_jobs.coordination.event_feed import EventFeed, MemoryEventFeed, RedisEventFeed


@pytest.fixture(params=["memory", "redis"])
def feed(request: pytest.FixtureRequest, redis_client: redis.Redis) -> Iterator[EventFeed]:
    yield MemoryEventFeed() if request.param == "memory" else RedisEventFeed(redis_client)


def test_events_published_together_reach_a_listener_each_in_order(feed: EventFeed) -> None:
    heard: list[str] = []
    all_heard = threading.Event()

    def notify(run_id: str) -> None:
        heard.append(run_id)
        if len(heard) == 3:
            all_heard.set()

    listening = feed.listen(notify, lambda: None)
    try:
        feed.publish_all([("run-a", 1), ("run-b", 1), ("run-a", 2)])
        assert all_heard.wait(5), heard
    finally:
        listening.close()
    assert heard == ["run-a", "run-b", "run-a"]


def test_each_run_s_stream_holds_the_events_published_together(
    redis_client: redis.Redis,
) -> None:
    feed = RedisEventFeed(redis_client)
    feed.publish_all([("run-a", 1), ("run-b", 1), ("run-a", 2)])
    runs = ("run-a", "run-b")
    entries: dict[str, Any] = {run: redis_client.xrange(feed.key(run)) for run in runs}
    seqs = {run: [fields[b"seq"] for _, fields in listed] for run, listed in entries.items()}
    assert seqs == {"run-a": [b"1", b"2"], "run-b": [b"1"]}
    assert feed.wait("run-a", "0-0", 0.1) == feed.position("run-a")
