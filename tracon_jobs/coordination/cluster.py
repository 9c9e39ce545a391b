"""What the coordination stores need of a client that may be a Redis Cluster's.

The stores of coordination state (circuits, slots, rate windows, budgets, quotas, tenants'
running places, stream places, leases, the response cache) take either client: one server (or
a Sentinel group's master) by default, a `RedisCluster` with `Redis:ClusterUrl`. Their scripts
and commands keep each call's keys in one hash slot, so both run them alike; the one thing a
cluster refuses that they did is `TIME` in a pipeline (redis-py's cluster pipeline routes a
command by its key, and `TIME` has none). `reads_at_server_time` is the one place that knows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import redis
from redis.client import Pipeline
from redis.cluster import ClusterPipeline, RedisCluster

CoordinationClient: TypeAlias = redis.Redis | RedisCluster
"""The client of the coordination stores: `Runtime.coordination`."""

Reads = Callable[[Pipeline | ClusterPipeline], object]
"""Queues the reads on a pipeline (their replies come back in the order queued)."""


def reads_at_server_time(
    client: CoordinationClient, key: str, reads: Reads
) -> tuple[list[Any], int]:
    """The replies of `reads` and the server's time then (ms), in one round trip on one server.

    On a cluster the reads go in a pipeline, then `TIME` is asked of the node that owns `key`
    (the reads' own node, so the clock is the one the scripts read there): two round trips, and
    the time comes a moment after the reads, which only makes a lease read as a little older.
    """
    if isinstance(client, RedisCluster):
        pipe: Pipeline | ClusterPipeline = client.pipeline(transaction=False)
        reads(pipe)
        replies = pipe.execute()
        seconds, micros = client.time(target_nodes=client.get_node_from_key(key))
    else:
        pipe = client.pipeline(transaction=False)
        reads(pipe)
        pipe.time()
        *replies, (seconds, micros) = pipe.execute()
    return list(replies), int(seconds) * 1000 + int(micros) // 1000
