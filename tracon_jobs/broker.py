"""kombu's Redis transport, with one Redis client per channel and its ack emulation in Lua.

kombu's Redis channel builds a new `redis.Redis` for every publish, ack and task event
(`Channel.conn_or_acquire`), and building one fills a table of about 170 reply callbacks:
most of a message's CPU on the web, and several times per run in the worker. A client over
a connection pool is thread-safe and keeps no state of its own between commands, so the
channel can keep one; connections still come from, and go back to, the channel's pool.

kombu emulates acknowledgements with two transactions per message: `MULTI, ZADD, HSET, EXEC`
when a message is delivered (the message goes into the `unacked` hash, its tag into the
`unacked_index` by time) and `MULTI, ZREM, HDEL, EXEC` when it is acknowledged. Each is one
script here, as atomic as the transaction, on the same keys with the same values: kombu's
restore of unacknowledged messages (at shutdown, after the visibility timeout) reads them as
before. Messages, queues and acknowledgements are kombu's own: any Celery worker, Flower or
client reads what this sends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from time import time
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

TRANSPORT = "tracon_jobs.broker:Transport"
"""Celery's `broker_transport` for a `redis://` broker URL."""


def transport_for(url: str) -> str | None:
    """This transport for a plain `redis://` URL; None (kombu's choice) for any other.

    `rediss://` is left to kombu: it turns TLS on by the URL's scheme, which a transport
    given by name would skip; sentinel URLs have a transport of their own.
    """
    return TRANSPORT if url.startswith("redis://") else None


DELIVERED_LUA = """-- A delivered message waits for its ack: kombu's unacked hash and index.
-- KEYS[1] unacked_index (zset)   KEYS[2] unacked (hash)
-- ARGV[1] delivery time   ARGV[2] delivery tag   ARGV[3] [message, exchange, routing key]
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
"""

ACKED_LUA = """-- An acknowledged (or dropped) message leaves kombu's unacked hash and index.
-- KEYS[1] unacked_index (zset)   KEYS[2] unacked (hash)   ARGV[1] delivery tag
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
"""


class QoS(kombu_redis.QoS):
    """kombu's ack emulation, each of its two transactions as one script."""

    def append(self, message: Any, delivery_tag: str) -> None:
        if not self._scripted:
            return super().append(message, delivery_tag)
        delivery = message.delivery_info
        state = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        keys = [self.unacked_index_key, self.unacked_key]
        self._delivered_script(keys=keys, args=[time(), delivery_tag, state])
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        if not self._scripted:
            return super().ack(delivery_tag)
        self._forget(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue or not self._scripted:
            return super().reject(delivery_tag, requeue)
        self._forget(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def _forget(self, delivery_tag: str) -> None:
        keys = [self.unacked_index_key, self.unacked_key]
        self._acked_script(keys=keys, args=[delivery_tag])

    @cached_property
    def _scripted(self) -> bool:
        """kombu's own commands when keys get a global prefix (its client adds it)."""
        return not self.channel.global_keyprefix

    @cached_property
    def _delivered_script(self) -> Any:
        with self.channel.conn_or_acquire() as client:
            return client.register_script(DELIVERED_LUA)

    @cached_property
    def _acked_script(self) -> Any:
        with self.channel.conn_or_acquire() as client:
            return client.register_script(ACKED_LUA)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _shared_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._shared_client is None:
            self._shared_client = self._create_client()
        yield self._shared_client

    def close(self) -> None:
        self._shared_client = None  # its pool is disconnected with the channel
        super().close()


class Transport(kombu_redis.Transport):
    Channel = Channel
