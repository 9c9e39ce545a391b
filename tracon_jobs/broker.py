"""kombu's Redis transport, with one Redis client per channel instead of one per operation.

kombu's Redis channel builds a new `redis.Redis` for every publish, ack and task event
(`Channel.conn_or_acquire`), and building one fills a table of about 170 reply callbacks:
most of a message's CPU on the web, and several times per run in the worker. A client over
a connection pool is thread-safe and keeps no state of its own between commands, so the
channel can keep one; connections still come from, and go back to, the channel's pool.
Messages, queues and acknowledgements are kombu's own, unchanged: any Celery worker, Flower
or client reads what this sends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis

TRANSPORT = "tracon_jobs.broker:Transport"
"""Celery's `broker_transport` for a `redis://` broker URL."""


def transport_for(url: str) -> str | None:
    """This transport for a plain `redis://` URL; None (kombu's choice) for any other.

    `rediss://` is left to kombu: it turns TLS on by the URL's scheme, which a transport
    given by name would skip; sentinel URLs have a transport of their own.
    """
    return TRANSPORT if url.startswith("redis://") else None


class Channel(kombu_redis.Channel):
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
