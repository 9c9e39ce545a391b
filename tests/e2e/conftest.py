"""Fixtures of the real-process tests: clusters of tracon-jobs processes, stopped after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.e2e.cluster import Cluster


@pytest.fixture
def flags(tmp_path: Path) -> Path:
    """A folder the test tools of every process write their external counters to."""
    directory = tmp_path / "flags"
    directory.mkdir()
    return directory


@pytest.fixture
def make_cluster(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    flags: Path,
    broker_sections: dict[str, Any],
) -> Iterator[Callable[..., Cluster]]:
    """`make(sql_url, **sections)`: a cluster on a config of those sections (on a clean
    Redis database, and RabbitMQ's with `TRACON_TEST_BROKER=amqp`); every process it started
    is stopped after the test."""
    clusters: list[Cluster] = []

    def make(sql_url: str, **sections: Any) -> Cluster:
        cluster = Cluster.create(tmp_path, sql_url, redis_url, **{**broker_sections, **sections})
        cluster.env["TRACON_TEST_FLAGS"] = str(flags)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()
