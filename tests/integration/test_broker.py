"""The Redis transport keeps one client per channel, and its messages are kombu's own."""

from __future__ import annotations

import threading
import uuid

import redis
from celery import Celery
from kombu import Connection, Queue

from tracon_jobs.broker import TRANSPORT, Channel, QoS, transport_for


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
    queue = f"test.broker.{uuid.uuid4().hex}"

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
    assert transport_for("sentinel://127.0.0.1:26379") is None


def test_ack_emulation_keeps_kombus_keys_and_restores_as_kombu_does(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Given a message delivered through this transport and not acknowledged yet
    name = f"test.broker.{uuid.uuid4().hex}"
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

        # And an acknowledged message leaves both at once
        again.ack()
        assert not redis_client.hexists("unacked", again.delivery_tag)
        assert redis_client.zscore("unacked_index", again.delivery_tag) is None
        queue.close()
