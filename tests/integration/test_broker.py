"""The Redis transport keeps one client per channel, and its messages are kombu's own."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import state as worker_state
from kombu import Connection, Consumer, Queue

from tests.helpers import wait_until
from tracon_jobs.worker.broker import (
    ACK_DELAY_SECONDS,
    SENTINEL_TRANSPORT,
    TRANSPORT,
    Channel,
    QoS,
    transport_for,
)


def test_a_channel_hands_out_one_client_for_every_operation(redis_url: str) -> None:
    with Connection(redis_url, transport=TRANSPORT) as connection:
        channel = connection.channel()
        assert isinstance(channel, Channel)
        seen = []

        def acquire() -> None:
            with channel.conn_or_acquire() as client:
                seen.append(client)

        acquire()
        threads = [threading.Thread(target=acquire) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=5)

        assert len(seen) == 9
        assert {id(client) for client in seen} == {id(seen[0])}
        assert seen[0].connection_pool is channel.pool
        given = object()
        with channel.conn_or_acquire(given) as client:
            assert client is given


def test_a_task_sent_through_it_is_read_by_kombus_own_transport(redis_url: str) -> None:
    # Given a Celery app that sends with this transport
    app = Celery("broker-test", broker=redis_url, set_as_current=False)
    app.conf.update(broker_transport=transport_for(redis_url), task_serializer="json")
    queue = _queue_name()

    # When it sends a task
    sent = app.send_task("tracon.runs.execute", kwargs={"run_id": "r1"}, queue=queue)

    # Then kombu's stock Redis transport reads the same message
    with Connection(redis_url) as stock:
        assert type(stock.channel()).__module__ == "kombu.transport.redis"
        message = stock.SimpleQueue(Queue(queue, routing_key=queue)).get(timeout=5)
        assert message.headers["id"] == sent.id
        assert message.headers["task"] == "tracon.runs.execute"
        assert message.decode()[1] == {"run_id": "r1"}
        message.ack()


def test_only_plain_redis_urls_get_the_transport() -> None:
    assert transport_for("redis://127.0.0.1:6379/0") == TRANSPORT
    assert transport_for("rediss://example.com:6380/0") is None  # kombu turns TLS on by scheme
    # kombu's Sentinel transport with the lost-connection fix, fast paths or not
    assert transport_for("sentinel://127.0.0.1:26379") == SENTINEL_TRANSPORT


def test_ack_emulation_keeps_kombus_keys_and_restores_as_kombu_does(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Given a message delivered through this transport and not acknowledged yet
    name = _queue_name()
    with Connection(redis_url, transport=TRANSPORT) as connection:
        queue = connection.SimpleQueue(Queue(name, routing_key=name))
        queue.put({"n": 1})
        message = queue.get(timeout=5)
        tag = message.delivery_tag
        assert isinstance(queue.channel.qos, QoS) and queue.channel.qos._scripted

        # Then it waits in kombu's unacked hash and index
        assert redis_client.hexists("unacked", tag)
        assert redis_client.zscore("unacked_index", tag) is not None

        # When kombu restores what is unacknowledged (as at a worker's shutdown)
        queue.channel.qos.restore_unacked()

        # Then the message is back on its queue, and gone from both
        assert redis_client.llen(name) == 1
        assert not redis_client.hexists("unacked", tag)
        again = queue.get(timeout=5)
        assert again.payload == {"n": 1}

        # And an acknowledged message leaves both within the acknowledgements' delay
        again.ack()
        wait_until(
            lambda: not redis_client.hexists("unacked", again.delivery_tag),
            timeout=ACK_DELAY_SECONDS + 2,
            what="the acknowledged message out of the unacked hash",
        )
        assert redis_client.zscore("unacked_index", again.delivery_tag) is None
        queue.close()


def _consume(
    connection: Connection,
    name: str,
    prefetch: int,
    *,
    no_ack: bool = False,
    callback: Callable[[Any, Any], None] | None = None,
) -> tuple[Any, list[Any]]:
    """A consumer of queue `name` through this transport; what it receives goes in the list
    (or to `callback`)."""
    channel = connection.channel()
    channel.basic_qos(0, prefetch, False)
    received: list[Any] = []
    Consumer(
        channel,
        queues=[Queue(name, routing_key=name)],
        callbacks=[callback or (lambda body, message: received.append(message))],
        accept=["json"],
        no_ack=no_ack,
    ).consume()
    return channel, received


def _queue_name() -> str:
    return f"test.broker.{uuid.uuid4().hex}"


def _put(connection: Connection, name: str, count: int) -> None:
    producer = connection.Producer(serializer="json")
    for n in range(count):
        producer.publish({"n": n}, routing_key=name, declare=[Queue(name, routing_key=name)])


def test_one_brpop_brings_along_what_the_prefetch_has_room_for(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Given ten messages waiting, and a consumer with room for four
    name = _queue_name()
    with Connection(redis_url, transport=TRANSPORT) as connection:
        _put(connection, name, 10)
        channel, received = _consume(connection, name, prefetch=4)

        # When the consumer's loop reads once
        connection.drain_events(timeout=5)

        # Then it got four, in the order they were sent, and six still wait on the queue
        assert [message.payload["n"] for message in received] == [0, 1, 2, 3]
        assert redis_client.llen(name) == 6

        # And each is recorded as delivered as kombu records it: [message, exchange, key]
        for message in received:
            tag = message.delivery_tag
            assert redis_client.zscore("unacked_index", tag) is not None
            stored, exchange, routing_key = json.loads(redis_client.hget("unacked", tag) or "")
            assert stored == message._raw
            assert (exchange, routing_key) == (
                message.delivery_info["exchange"],
                message.delivery_info["routing_key"],
            )

        # And nothing more is taken until the prefetch has room again
        assert channel.qos.can_consume_max_estimate() == 0
        received[0].ack()
        connection.drain_events(timeout=5)
        assert [message.payload["n"] for message in received] == [0, 1, 2, 3, 4]

        # And what was taken and never acknowledged goes back as kombu restores it
        channel.qos.restore_unacked()
        assert redis_client.llen(name) == 5 + 4  # not the acknowledged one
        assert redis_client.hlen("unacked") == 0


class _Busy:
    """A task a worker's pool is running (Celery keeps its requests in a `WeakSet`)."""


def test_a_take_brings_along_no_more_than_the_pool_has_idle_threads_for(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Given ten messages waiting, a consumer whose prefetch has room for four, and a pool of
    # four threads, three of them running tasks already acknowledged (out of the prefetch)
    name = _queue_name()
    busy = [_Busy() for _ in range(3)]
    with Connection(redis_url, transport=TRANSPORT) as connection:
        _put(connection, name, 10)
        channel, received = _consume(connection, name, prefetch=4)
        channel.qos.idle_threads = lambda: 4 - len(worker_state.reserved_requests)  # `PoolRoom`
        worker_state.reserved_requests.update(busy)
        try:
            # When the consumer's loop reads once
            connection.drain_events(timeout=5)

            # Then it took one message, for the one idle thread; nine still wait
            assert [message.payload["n"] for message in received] == [0]
            assert redis_client.llen(name) == 9
        finally:
            for request in busy:
                worker_state.reserved_requests.discard(request)

        # And once the three tasks end, the next read brings along what the prefetch has
        # room for (three more: the first is still unacknowledged)
        connection.drain_events(timeout=5)
        assert [message.payload["n"] for message in received] == [0, 1, 2, 3]
        assert redis_client.llen(name) == 6
        channel.qos.restore_unacked()


def test_a_consumer_without_acknowledgements_takes_one_at_a_time(
    redis_url: str, redis_client: redis.Redis
) -> None:
    name = _queue_name()
    with Connection(redis_url, transport=TRANSPORT) as connection:
        _put(connection, name, 3)
        _, received = _consume(connection, name, prefetch=10, no_ack=True)

        connection.drain_events(timeout=5)

        assert [message.payload["n"] for message in received] == [0]
        assert redis_client.llen(name) == 2
        assert redis_client.hlen("unacked") == 0  # nothing waits for an ack that never comes


def test_a_message_that_is_not_kombus_stops_the_batch_and_stays_queued(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Given a kombu message, then something else on the same list
    name = _queue_name()
    with Connection(redis_url, transport=TRANSPORT) as connection:
        _put(connection, name, 1)
        redis_client.lpush(name, b"not a kombu message")
        _, received = _consume(connection, name, prefetch=10)

        connection.drain_events(timeout=5)

        # Then the kombu message is delivered, and the other is left where it was
        assert [message.payload["n"] for message in received] == [0]
        assert redis_client.lrange(name, 0, -1) == [b"not a kombu message"]


def test_what_a_failed_delivery_left_undelivered_goes_back_to_its_queue(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Given three messages taken together, and a consumer that fails on the first
    name = _queue_name()
    with Connection(redis_url, transport=TRANSPORT) as connection:
        _put(connection, name, 3)

        def fail(body: Any, message: Any) -> None:
            raise RuntimeError("the consumer broke")

        channel, _ = _consume(connection, name, prefetch=10, callback=fail)

        # When the loop reads, the delivery fails
        with pytest.raises(RuntimeError):
            connection.drain_events(timeout=5)

        # Then the two it never handed over are back on the queue, not waiting for an ack
        assert redis_client.llen(name) == 2
        assert redis_client.hlen("unacked") == 1  # the one the consumer had, as with kombu
        queued = [
            channel.Message(json.loads(raw), channel=channel)
            for raw in redis_client.lrange(name, 0, -1)
        ]
        assert sorted(message.decode()["n"] for message in queued) == [1, 2]


def test_acknowledgements_go_with_the_next_take_or_at_shutdown(
    redis_url: str, redis_client: redis.Redis
) -> None:
    name = _queue_name()
    with Connection(redis_url, transport=TRANSPORT) as connection:
        _put(connection, name, 2)
        channel, received = _consume(connection, name, prefetch=1)
        assert isinstance(channel.qos, QoS)
        channel.qos.ack_delay_seconds = 60  # only the take or a restore
        connection.drain_events(timeout=5)
        first = received[0]

        # When a message is acknowledged, it is still in Redis's unacked hash a while
        first.ack()
        assert redis_client.hexists("unacked", first.delivery_tag)

        # Then the next take removes it, in the same call
        connection.drain_events(timeout=5)
        assert not redis_client.hexists("unacked", first.delivery_tag)
        assert redis_client.zscore("unacked_index", first.delivery_tag) is None

        # And one acknowledged before a shutdown's restore is removed, not restored
        second = received[1]
        second.ack()
        channel.qos.restore_unacked()
        assert redis_client.hlen("unacked") == 0 and redis_client.llen(name) == 0


def test_thousands_of_acknowledgements_leave_in_one_call(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Given 10,000 delivered messages waiting in kombu's unacked hash and index
    tags = [f"tag-{n}" for n in range(10_000)]
    redis_client.zadd("unacked_index", dict.fromkeys(tags, 1.0))
    redis_client.hset("unacked", mapping=dict.fromkeys(tags, '[{}, "", "q"]'))
    with Connection(redis_url, transport=TRANSPORT) as connection:
        qos = connection.channel().qos
        assert isinstance(qos, QoS)

        # When all are acknowledged and flushed together (more than Lua could unpack)
        qos.flush_acks_later(tags)
        qos.flush_acks()

    # Then every one left both
    assert redis_client.hlen("unacked") == 0 and redis_client.zcard("unacked_index") == 0
