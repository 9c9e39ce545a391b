"""Celery's broker, chosen once from `Broker:Url` and `Redis:*`: the Redis of the coordination
state (the default), a Redis of the messages' own, or RabbitMQ.

On RabbitMQ the queues of the runs and of the periodic ticks are quorum queues (replicated,
durable, `x-queue-type: quorum`), every publish waits for the broker's confirm, and each
fast path written against the Redis broker is off: kombu's own AMQP transport, Celery's
`send_task`, and the fair lines handing runs to the sender instead of pushing them
(docs/reliability.md, "RabbitMQ as the broker"). Messages are still acknowledged when a task
starts and prefetch stays `Worker.PrefetchMultiplier`: a worker that dies with messages
prefetched has them back in the queue as soon as its connection is gone.

A message is acknowledged as its task starts, which frees the consumer's prefetch: on its own,
a worker whose every thread is busy would go on taking messages (up to its prefetch more),
each to wait in its pool behind calls that may last minutes while another worker sits idle.
On a Redis broker at `Worker.PrefetchMultiplier` 1 (the default) a worker takes a message
only for an idle thread (`worker.pool.PoolRoom`); at 2 or more, Celery's prefetch: that many
messages a thread may wait beside the running ones. RabbitMQ pushes messages to a consumer
while its prefetch has room, and Celery has no such bound there: a busy worker may hold up to
its prefetch of messages waiting (docs/reliability.md, "RabbitMQ as the broker").

A worker's own queue (Celery's `worker_direct`, `<worker>.dq2`, where a periodic tick is
forwarded to the lease owner) stays classic: both sides declare it through Celery's
`worker_direct()`, which gives it no arguments, and a quorum queue per worker name would be a
replicated log kept for every name a worker ever had. It carries only ticks that expire with
the owner's lease; a lost one is the next tick's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kombu import Queue

from tracon_jobs.redis_clients import DEAD_LINK, broker_transport_options, broker_url
from tracon_jobs.settings import Settings
from tracon_jobs.settings.broker_url import is_amqp
from tracon_jobs.worker.broker import transport_for

DEAD_LINK_OPTIONS: Mapping[str, Any] = {
    "socket_keepalive": True,
    "socket_keepalive_options": DEAD_LINK,
}
"""kombu's Redis channels get the TCP options of every Redis client of the project
(`redis_clients.DEAD_LINK`)."""

QUORUM_QUEUE: Mapping[str, str] = {"x-queue-type": "quorum"}
"""The arguments that declare a RabbitMQ queue as a quorum queue."""
CONFIRM_PUBLISH: Mapping[str, Any] = {"confirm_publish": True}
"""kombu's AMQP transport option: each publish waits for the broker's `basic.ack` (a `nack`,
or a channel the broker closed, raises), so a run's message is on RabbitMQ's disk, replicated,
before its sender goes on."""
AMQP_HEARTBEAT_SECONDS = 5
"""The AMQP heartbeat a worker's connection asks for (Celery's default is 120 s, RabbitMQ's
own 60 s; the lower one holds), at the low end of the 5-20 s RabbitMQ recommends. RabbitMQ
pushes messages to a consumer while its prefetch has room: a worker that stops answering
without closing its connection (stopped, its host paused or cut off) keeps the ones it was
given until RabbitMQ declares the connection dead, after two or three heartbeats without one
from it (measured: 14 s at 5 s, 29 s at 10 s); they are then back in the queue for the others.
A worker killed outright closes its connection, and its messages are back at once."""
REDIS_VISIBILITY_TIMEOUT_SECONDS = 3600
"""A Redis broker gives a message prefetched by a worker that died back after this long;
the requeue pass re-sends its run long before (`runs.requeue`)."""


@dataclass(frozen=True)
class Broker:
    """What Celery's app is given of its broker, and what the process may do beside Celery."""

    url: str = field(repr=False)  # may carry a password: Celery's only, which masks it
    amqp: bool
    """RabbitMQ: quorum queues, publisher confirms, no fast path of the Redis broker."""
    coordination_redis: bool
    """The broker is `Redis:Url` itself: the runs' messages may be pushed there by this
    process's Redis client and the fair lines' script (the `envelope` fast path)."""
    transport: str | None
    transport_options: dict[str, Any]

    def celery_options(self) -> dict[str, Any]:
        """Celery's settings of this broker beside its URL and queues: the transport and its
        options, and on RabbitMQ the workers' heartbeat (`AMQP_HEARTBEAT_SECONDS`)."""
        options: dict[str, Any] = {
            "broker_transport": self.transport,
            "broker_transport_options": self.transport_options,
        }
        if self.amqp:
            options["broker_heartbeat"] = AMQP_HEARTBEAT_SECONDS
        return options

    def queues(self, names: Iterable[str]) -> list[Queue]:
        """Celery's `task_queues` of `names`: quorum queues on RabbitMQ."""
        arguments = dict(QUORUM_QUEUE) if self.amqp else None
        return [Queue(name, queue_arguments=arguments) for name in names]


def broker_of(settings: Settings, environ: Mapping[str, str] | None = None) -> Broker:
    """The broker of these settings (passwords from `environ`, else the process's)."""
    url = settings.broker.url
    if url is not None and is_amqp(url):
        return Broker(
            url,
            amqp=True,
            coordination_redis=False,
            transport=None,  # kombu's own AMQP transport
            transport_options=dict(CONFIRM_PUBLISH),
        )
    if url is None or is_coordination_redis(settings):
        # the configured Redis, or Celery's `sentinel://` form of a Sentinel group, with the
        # passwords the settings name (kombu and Flower mask them wherever they print the URL)
        return Broker(
            broker_url(settings.redis, environ),
            amqp=False,
            coordination_redis=True,
            transport=transport_for(settings.redis.url),  # one Redis client per channel
            transport_options={
                "visibility_timeout": REDIS_VISIBILITY_TIMEOUT_SECONDS,
                **DEAD_LINK_OPTIONS,  # a send on a link that drops packets fails in ~10 s
                **broker_transport_options(settings.redis, environ),  # a Sentinel group's
            },
        )
    return Broker(  # a Redis of the messages' own (one server: settings refuse other sentinels)
        url,
        amqp=False,
        coordination_redis=False,
        transport=transport_for(url),
        transport_options={
            "visibility_timeout": REDIS_VISIBILITY_TIMEOUT_SECONDS,
            **DEAD_LINK_OPTIONS,
        },
    )


def is_coordination_redis(settings: Settings) -> bool:
    """Whether Celery's broker is `Redis:Url` itself (`Broker:Url` null, or the same URL)."""
    url = settings.broker.url
    return url is None or url.strip() == settings.redis.url.strip()
