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

kombu hands a consumer one message per `BRPOP`, and records it as delivered in a second round
trip: two waits of the worker's main thread per message, each for the interpreter's lock
once the reply is in, which the pool's busy threads hold. A worker that starts on a backlog
then fills its threads one message every few milliseconds. Here the message `BRPOP` returns
is recorded together with as many more as the consumer's prefetch has room for, taken from
the same lists in the same order, in one script: a backlog fills every free thread in one
turn of the main thread's loop. No more messages are reserved than kombu's own prefetch
allows, nor than the worker's pool has idle threads for (`QoS.idle_threads`), and each one
is recorded in kombu's unacked hash before it leaves the script, so a worker that dies
holding them has them restored as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from queue import Empty
from time import time
from typing import Any

import redis
from kombu import transport as kombu_transport
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps, loads

from tracon_jobs import fast_paths

log = logging.getLogger(__name__)

TRANSPORT = "tracon_jobs.worker.broker:Transport"
"""Celery's `broker_transport` for a `redis://` broker URL."""
SENTINEL_TRANSPORT = "tracon_jobs.worker.broker:SentinelTransport"
"""Celery's `broker_transport` for a `sentinel://` broker URL, fast paths on or off."""


def transport_for(url: str) -> str | None:
    """The transport of a broker URL: this module's for `redis://` (the `broker` fast path)
    and for `sentinel://` (kombu's Sentinel transport with `SentinelChannel`'s fix, fast
    paths on or off); None (kombu's choice) for any other.

    `rediss://` is left to kombu: it turns TLS on by the URL's scheme, which a transport
    given by name would skip. A `sentinel://` URL also points kombu's `sentinel` alias here:
    a connection that fails moves to the URL's next sentinel and takes that URL's transport
    by its scheme, not the one given by name.
    """
    if url.strip().lower().startswith("sentinel://"):
        kombu_transport.TRANSPORT_ALIASES["sentinel"] = SENTINEL_TRANSPORT
        return SENTINEL_TRANSPORT
    if not fast_paths.enabled("broker"):
        return None  # kombu's own Redis transport
    return TRANSPORT if url.startswith("redis://") else None


class LostConnectionIsConnectionError:
    """A channel whose kombu connection is gone says so with a connection error.

    A worker that loses the broker has Celery close the kombu connection after letting go of
    its transport (`Connection.collect`); its threads still acknowledge the messages they
    start, and the channel is closed again, restoring the messages it had prefetched. kombu
    builds a new pool from the connection for each of these, finds it gone and raises
    `AttributeError`, which stops the worker's consumer for good (seen after a Sentinel
    failover). As a connection error, Celery logs the acknowledgement it could not send, the
    close goes on, and the consumer reconnects: the messages stay in kombu's unacked hash,
    their runs are sent again by the requeue scan after `Runs.RequeueAfter` (kombu restores
    the messages after the visibility timeout; the claim drops the repeat).
    """

    connection: Any

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport is None or getattr(transport, "client", None) is None:
            raise redis.ConnectionError("this channel's broker connection was closed")
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[misc]
        return params


DELIVERED_LUA = """-- A delivered message waits for its ack: kombu's unacked hash and index.
-- KEYS[1] unacked_index (zset)   KEYS[2] unacked (hash)
-- ARGV[1] delivery time   ARGV[2] delivery tag   ARGV[3] [message, exchange, routing key]
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
"""

TAKE_LUA = """-- The message BRPOP handed over, and up to ARGV[3] more, recorded as delivered.
-- KEYS[1] unacked_index (zset)   KEYS[2] unacked (hash)   KEYS[3..] lists, in BRPOP's order
-- ARGV[1] delivery time   ARGV[2] the message BRPOP popped   ARGV[3] how many more
-- ARGV[4..] delivery tags acknowledged since the last call: out of the hash and index first
-- Returns {1 if ARGV[2] was recorded else 0, list, message, list, message, ...}. A message
-- that is not kombu's (no delivery tag) is not recorded: popped here, it goes back.
local function record(item)
  local ok, message = pcall(cjson.decode, item)
  if not ok or type(message) ~= 'table' or type(message['properties']) ~= 'table' then
    return false
  end
  local properties = message['properties']
  local info = properties['delivery_info']
  local tag = properties['delivery_tag']
  if type(tag) ~= 'string' or type(info) ~= 'table' then
    return false
  end
  local exchange = cjson.encode(info['exchange'] or '')
  local routing_key = cjson.encode(info['routing_key'] or '')
  redis.call('ZADD', KEYS[1], ARGV[1], tag)
  redis.call('HSET', KEYS[2], tag, '[' .. item .. ',' .. exchange .. ',' .. routing_key .. ']')
  return true
end
for i = 4, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
local taken = {record(ARGV[2]) and 1 or 0}
local wanted = tonumber(ARGV[3])
for i = 3, #KEYS do
  while wanted > 0 do
    local item = redis.call('RPOP', KEYS[i])
    if not item then
      break
    end
    if not record(item) then
      redis.call('RPUSH', KEYS[i], item)
      return taken
    end
    taken[#taken + 1] = KEYS[i]
    taken[#taken + 1] = item
    wanted = wanted - 1
  end
end
return taken
"""
TAKE_MAX = 128
"""The most messages one `BRPOP` brings along, whatever room the prefetch has."""

ACKED_LUA = """-- Acknowledged (or dropped) messages leave kombu's unacked hash and index.
-- KEYS[1] unacked_index (zset)   KEYS[2] unacked (hash)   ARGV delivery tags (any number)
for i = 1, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
"""
ACK_DELAY_SECONDS = 0.05
"""How long an acknowledgement may wait to go with others (see `QoS.ack`)."""


class QoS(kombu_redis.QoS):
    """kombu's ack emulation, each of its two transactions as one script."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acks: list[str] = []  # acknowledged here, not yet out of Redis
        self._acks_lock = threading.Lock()
        self._acks_timer: threading.Timer | None = None
        # kombu builds the QoS of each channel, so its ack delay is set on the instance
        self.ack_delay_seconds = ACK_DELAY_SECONDS
        self.recorded: set[str] = set()  # tags the take script put in the unacked hash
        self.idle_threads: Callable[[], int] | None = None
        """The worker pool's idle threads, once its consumer has started (`worker.pool.
        PoolRoom`): a take brings along no more messages than that. None: kombu's prefetch
        alone (a process that only publishes, or a worker of Celery's own prefetch)."""

    def can_consume_max_estimate(self) -> int | None:
        """kombu's room in the prefetch, bounded by the pool's idle threads. A message is
        acknowledged as its task starts, which frees its place in the prefetch: the idle
        threads are what keeps a busy worker from taking messages it cannot start."""
        estimate: int | None = super().can_consume_max_estimate()
        if self.idle_threads is None:
            return estimate
        idle = max(self.idle_threads(), 0)
        return idle if estimate is None else min(estimate, idle)

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.recorded:  # by the script that took it (`Channel._take`)
            self.recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
            return None
        if not self._scripted:
            return super().append(message, delivery_tag)
        delivery = message.delivery_info
        state = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        keys = [self.unacked_index_key, self.unacked_key]
        self._delivered_script(keys=keys, args=[time(), delivery_tag, state])
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        """Acknowledged at once in this process; in Redis with the others of the next 50 ms.

        A worker acknowledges each message as its task starts, on the pool's thread: one
        round trip each, in the run's path before its first model call. Here the tag waits
        for the channel's next take of messages (the same script) or for a timer, whichever
        comes first, and all waiting tags leave the unacked hash in one call. A worker that
        dies within that time leaves them in the hash; kombu restores them after the
        visibility timeout, and the run's claim drops the repeated delivery.
        """
        if not self._scripted:
            return super().ack(delivery_tag)
        self.flush_acks_later([delivery_tag])
        virtual.QoS.ack(self, delivery_tag)

    def flush_acks_later(self, delivery_tags: list[str]) -> None:
        """Tags to remove from Redis with the next take, or when the timer fires."""
        with self._acks_lock:
            self._acks.extend(delivery_tags)
            if self._acks_timer is None:
                self._acks_timer = threading.Timer(self.ack_delay_seconds, self.flush_acks)
                self._acks_timer.daemon = True
                self._acks_timer.start()

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue or not self._scripted:
            return super().reject(delivery_tag, requeue)
        self._forget([delivery_tag])
        virtual.QoS.ack(self, delivery_tag)

    def take_acks(self) -> list[str]:
        """The acknowledged tags not yet out of Redis, for a script that removes them."""
        with self._acks_lock:
            acks, self._acks = self._acks, []
            return acks

    def flush_acks(self) -> None:
        """Remove every acknowledged tag still in Redis, now."""
        with self._acks_lock:
            acks, self._acks = self._acks, []
            self._acks_timer = None
        if not acks:
            return
        try:
            self._forget(acks)
        except Exception as exc:  # restored after the visibility timeout, then dropped
            log.warning("could not remove %d acknowledged messages: %s", len(acks), exc)

    def restore_unacked(self, client: Any = None) -> None:
        self.flush_acks()
        super().restore_unacked(client)

    def _forget(self, delivery_tags: list[str]) -> None:
        keys = [self.unacked_index_key, self.unacked_key]
        self._acked_script(keys=keys, args=delivery_tags)

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

    @cached_property
    def take_script(self) -> Any:
        with self.channel.conn_or_acquire() as client:
            return client.register_script(TAKE_LUA)


TakingQoS = QoS  # the name `QoS` inside `Channel` is kombu's class attribute


class Channel(LostConnectionIsConnectionError, kombu_redis.Channel):
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

    @cached_property
    def _acked_queues(self) -> set[str]:
        """Queues consumed with acknowledgements: only those are taken from in batches."""
        return set()

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._acked_queues.discard(queue)
        else:
            self._acked_queues.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def _brpop_read(self, **options: Any) -> bool:
        """kombu's, but the popped message brings along what the prefetch has room for."""
        qos = self.qos
        if not isinstance(qos, TakingQoS) or not qos._scripted:
            return bool(super()._brpop_read(**options))
        try:
            try:
                popped = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # kombu reconnects on its next turn
                raise
            if not popped:
                raise Empty()
            taken = self._take(qos, *popped)
            for index, (queue, payload) in enumerate(taken):
                try:
                    self._queue_cycle.rotate(queue)
                    self.connection._deliver(payload, queue)
                except BaseException:  # what was not handed over goes back to its queue
                    self._give_back(qos, taken[index + 1 :])
                    raise
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # as kombu does
            self._flush_brpop_reauth()

    def _take(self, qos: TakingQoS, key: bytes, item: bytes) -> list[tuple[str, dict[str, Any]]]:
        """The popped message, recorded as delivered with up to the prefetch's room more:
        (queue, message) in the order BRPOP would have handed them over."""
        queue = self._queue_of(key)
        if queue not in self._acked_queues:  # nothing to record, nothing to bring along
            return [(queue, loads(kombu_redis.bytes_to_str(item)))]
        room = qos.can_consume_max_estimate()
        more = max(min(TAKE_MAX, room - 1), 0) if room else 0
        lists = [
            self._q_for_pri(name, priority)
            for priority in self.priority_steps
            for name in self.active_queues
            if name in self._acked_queues
        ]
        keys = [qos.unacked_index_key, qos.unacked_key, *lists]
        acks = qos.take_acks()
        try:
            reply = qos.take_script(keys=keys, args=[time(), item, more, *acks])
        except Exception:  # delivered as kombu would: its own record, or its own error
            log.warning("could not record messages taken after a BRPOP", exc_info=True)
            if acks:
                qos.flush_acks_later(acks)
            return [(queue, loads(kombu_redis.bytes_to_str(item)))]
        recorded, rest = reply[0], reply[1:]
        taken = [(key, item, bool(recorded))]
        taken += [(k, i, True) for k, i in zip(rest[::2], rest[1::2], strict=True)]
        messages = []
        for list_key, raw, in_unacked in taken:
            payload = loads(kombu_redis.bytes_to_str(raw))
            if in_unacked:
                qos.recorded.add(payload["properties"]["delivery_tag"])
            messages.append((self._queue_of(list_key), payload))
        return messages

    def _give_back(self, qos: TakingQoS, messages: list[tuple[str, dict[str, Any]]]) -> None:
        """Messages taken but not delivered: out of the unacked hash, back on their queues."""
        for _, payload in messages:
            tag = payload["properties"]["delivery_tag"]
            if tag in qos.recorded:
                qos.recorded.discard(tag)
                qos.restore_by_tag(tag)

    def _queue_of(self, key: bytes | str) -> str:
        """The queue of one of its lists (kombu keeps one list per priority step)."""
        return kombu_redis.bytes_to_str(key).rsplit(self.sep, 1)[0]


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(LostConnectionIsConnectionError, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel (the master asked of the sentinels at each new pool), with a
    lost connection fixed (`LostConnectionIsConnectionError`); none of the fast paths."""


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel
