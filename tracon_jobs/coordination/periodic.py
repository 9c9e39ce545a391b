"""Where the owner of a singleton lease can be reached: a route advertised next to the lease.

The owner of a periodic service's lease writes its own worker's name under the service's
route key, with the lease's TTL; a process that is not the owner reads it to forward the
work there. Redis only: what is forwarded, and how, is the caller's business.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)


def route_key(name: str) -> str:
    return f"tracon:lease-route:{{{name}}}"


class LeaseRoutes:
    """The advertised address of each lease owner, expiring with the lease."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def advertise(self, name: str, address: str, ttl_ms: int) -> None:
        """Best effort: a failed write only means the next tick is not forwarded."""
        try:
            self.client.set(route_key(name), address, px=ttl_ms)
        except redis.RedisError as exc:
            log.warning("lease route of %s not advertised: %s", name, exc)

    def owner_address(self, name: str) -> str | None:
        try:
            value = self.client.get(route_key(name))
        except redis.RedisError:
            return None
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)
