"""A runtime on a real Redis Sentinel group (`tests/sentinels.py`: a master, a replica, three
sentinels, passwords on both): every client it builds goes to the current master, and after a
failover (`SENTINEL FAILOVER`, or the master killed with SIGKILL) its clients, a thread's held
connection, the cancel bus's and the event feed's subscriptions and a Lua script all work
against the new master within a bound."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import kombu
import pytest
import redis

from tests.helpers import MakeRuntime, wait_until
from tests.sentinels import MASTER_NAME, REDIS_PASSWORD, SENTINEL_PASSWORD, SentinelGroup
from tracon_jobs.cli import main
from tracon_jobs.coordination.connections import command
from tracon_jobs.coordination.event_feed import RedisEventFeed
from tracon_jobs.coordination.scripts import Scripts
from tracon_jobs.runtime import Runtime
from tracon_jobs.worker.envelope import RUNS_QUEUE, celery_sender

DB = 2
"""The group's database the tests use (not 0: the URL's database must reach every client)."""
KILLED_BOUND_SECONDS = 10.0
"""A killed master: judged down after 0.5 s, a replica promoted about a second later; the
rest is the clients' reconnects and the listeners' one-second retry."""
FAILOVER_BOUND_SECONDS = 25.0
"""`SENTINEL FAILOVER`: the old master goes on accepting what its open connections send until
Sentinel demotes it, 8 s after the switch (its fixed wait), and closes its clients."""


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SentinelGroup]:
    started = SentinelGroup(tmp_path / "sentinel-group")
    try:
        started.start()
        for name, value in SentinelGroup.environment().items():
            monkeypatch.setenv(name, value)
        yield started
    finally:
        started.stop()


@pytest.fixture
def runtime(group: SentinelGroup, make_runtime: MakeRuntime, sqlite_url: str) -> Runtime:
    return make_runtime(sqlite_url, Redis=group.settings(DB))


def on(group: SentinelGroup, port: int) -> redis.Redis:
    """The test's database on one server of the group, not through the sentinels."""
    return group.server(port, DB)


class Heard:
    """What a listener was told, across its reconnects."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, item: str) -> None:
        with self.lock:
            self.items.append(item)

    def has(self, item: str) -> bool:
        with self.lock:
            return item in self.items


def test_every_client_the_runtime_builds_goes_to_the_current_master(
    group: SentinelGroup, runtime: Runtime
) -> None:
    master, replica = group.master_port(), next(p for p in group.redis if p != group.master_port())
    feed = runtime.feed
    assert isinstance(feed, RedisEventFeed)

    # the runtime's client, a thread's held connection, a script
    runtime.redis.set("plain", "1")
    command(runtime.redis, "SET", "held", "1")
    feed.publish("run-1", 1)
    # Celery's broker (kombu's Sentinel transport) and the envelope pushed on our client
    celery_sender(runtime.celery)("run-a")
    celery_sender(runtime.celery, client=runtime.redis)("run-b")

    assert on(group, master).mget("plain", "held") == [b"1", b"1"]
    assert on(group, master).xlen(feed.key("run-1")) == 1
    assert on(group, master).llen(RUNS_QUEUE) == 2
    assert group.role(master) == "master" and group.role(replica) == "slave"
    # and nothing went to another database: the URL's reached every client, kombu's too
    assert redis.Redis(port=master, password=REDIS_PASSWORD).dbsize() == 0


def test_the_cli_command_that_used_to_die_on_a_sentinel_url_works(
    group: SentinelGroup,
    sqlite_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: `Redis URL must specify one of the following schemes` and a traceback
    for name in list(os.environ):
        if name.upper().startswith("TRACON"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("TRACON_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("TRACON_REDIS_URL", group.url(DB))
    monkeypatch.setenv("TRACON_REDIS_SENTINEL_MASTER", MASTER_NAME)
    monkeypatch.setenv("TRACON__REDIS__PASSWORDENV", "SENTINEL_GROUP_REDIS_PASSWORD")
    monkeypatch.setenv("TRACON__REDIS__SENTINELPASSWORDENV", "SENTINEL_GROUP_SENTINEL_PASSWORD")

    assert main(["tenants", "create", "acme"]) == 0
    assert main(["circuits"]) == 0  # reads the breakers' state from the master

    out = capsys.readouterr().out
    assert "api key (shown once): tjk_" in out
    assert REDIS_PASSWORD not in out and SENTINEL_PASSWORD not in out


@pytest.mark.parametrize("how", ["killed", "failover"])
def test_after_a_failover_the_runtime_works_against_the_new_master_within_a_bound(
    group: SentinelGroup, runtime: Runtime, how: str
) -> None:
    # Given a runtime whose clients, held connection, listeners and scripts are in use
    feed = runtime.feed
    assert isinstance(feed, RedisEventFeed)
    cancels, notified = Heard(), Heard()
    runtime.cancel_bus.subscribe(cancels)
    listening = feed.listen(notified, lambda: None)
    scripts = Scripts(runtime.redis)

    def publish_script(i: int) -> None:
        scripts("feed_publish", [feed.key(f"r{i}")], [1, 10, 60, feed.channel, "x"])

    wait_until(runtime.cancel_bus.subscribed.is_set, timeout=5, what="cancel bus subscribed")
    command(runtime.redis, "SET", "held", "before")
    publish_script(0)

    # When the master goes, by SIGKILL or a planned failover
    started = time.monotonic()
    old = group.kill_master() if how == "killed" else group.failover()
    new = group.wait_for_new_master(old)
    on(group, new).script_flush()  # the new master has never loaded our scripts: NOSCRIPT

    # Then each path works against the new master, each within the bound
    bound = KILLED_BOUND_SECONDS if how == "killed" else FAILOVER_BOUND_SECONDS
    master = on(group, new)
    worked = {  # when each path first worked, one after the other
        "client": until(
            lambda i: runtime.redis.set("plain", i),
            lambda i: master.get("plain") == str(i).encode(),
        ),
        "held connection": until(
            lambda i: command(runtime.redis, "SET", "held", i),
            lambda i: master.get("held") == str(i).encode(),
        ),
        "script": until(publish_script, lambda i: bool(master.exists(feed.key(f"r{i}")))),
        "cancel bus": until(
            lambda i: runtime.cancel_bus.publish(f"c{i}"),
            lambda i: cancels.has(f"c{i}"),
            any_so_far=True,
        ),
        "event feed": until(
            lambda i: feed.publish(f"f{i}", 1), lambda i: notified.has(f"f{i}"), any_so_far=True
        ),
    }
    listening.close()
    after = {path: round(at - started, 2) for path, at in worked.items()}
    assert max(after.values()) < bound, f"after the master was {how}: {after}"
    assert group.role(new) == "master"


def until(
    act: Callable[[int], object], done: Callable[[int], bool], *, any_so_far: bool = False
) -> float:
    """When `act(i)` first had its effect (`done(i)`), acting again while it fails: a write
    seen on the new master, or (`any_so_far`) any notice published so far heard by its
    listener (one published before the listener subscribed again is lost, as designed)."""
    attempt = 0

    def effective() -> bool:
        nonlocal attempt
        attempt += 1
        try:
            act(attempt)
        except redis.RedisError:
            return False
        tried = range(1, attempt + 1) if any_so_far else [attempt]
        return any(done(n) for n in tried)

    wait_until(effective, timeout=FAILOVER_BOUND_SECONDS + 5, interval=0.1, what="a path working")
    return time.monotonic()


def test_a_consumer_that_loses_the_master_with_messages_prefetched_closes_cleanly(
    group: SentinelGroup, runtime: Runtime
) -> None:
    # Given a consumer on the broker holding two delivered, unacknowledged messages, its
    # next BRPOP sent and not answered (as a worker waits for more)
    app = runtime.celery
    send = celery_sender(app)
    send("run-1")
    send("run-2")
    connection = app.connection_for_read()
    delivered: list[object] = []
    consumer = kombu.Consumer(
        connection.default_channel,
        [kombu.Queue(RUNS_QUEUE)],
        callbacks=[lambda _body, message: delivered.append(message)],
    )
    consumer.qos(prefetch_count=10)
    consumer.consume()
    with contextlib.suppress(TimeoutError, socket.timeout):
        for _ in range(3):
            connection.drain_events(timeout=0.5)
    assert len(delivered) == 2

    # When the master dies and the worker closes the connection as Celery does after a loss
    # (`Consumer.on_connection_error_after_connected`: collect, then close)
    group.wait_for_new_master(group.kill_master())
    connection.collect(socket_timeout=1)

    # Then closing it raises nothing (kombu's own channel: AttributeError, which stopped the
    # worker's consumer for good), and the messages are back on their queue or wait in
    # kombu's unacked hash on the new master (for the requeue scan, and kombu's restore)
    connection.close()
    master = on(group, group.master_port())
    assert master.llen(RUNS_QUEUE) + master.hlen("unacked") == 2, (
        master.keys(),
        group.master_port(),
        [(p, group.role(p)) for p in group.redis if group.redis[p].process.poll() is None],
    )
