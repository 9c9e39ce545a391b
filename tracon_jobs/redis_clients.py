"""Every Redis client of a process, and the Celery broker's address, built from `Redis:*` in
one place: one server (`redis://`, `rediss://`, `unix://`), or a Sentinel group
(`sentinel://host:port;sentinel://host:port/db`, Celery's notation) whose current master every
client follows.

With a Sentinel group a client is `Sentinel(...).master_for(Redis:SentinelMaster, ...)` with the
same options as a one-server client (timeouts, retry, pool size, health checks): each new
connection asks the sentinels where the master is, a connection still open to a master that was
demoted gets `READONLY` (or its blocking command `UNBLOCKED`), which redis-py turns into a
connection error, and the next command reconnects to the new master. `MasterConnection` closes
the one gap redis-py leaves: a connection that lost its socket while in use reconnects in
`send_packed_command`, to the address it had, not the sentinels' answer. Pub/sub listeners
subscribe again after any error (`coordination.event_feed`, `coordination.cancellation`, the
webhook listeners), and scripts are loaded again on `NOSCRIPT` (`coordination.scripts`), so a
failover costs the commands in flight at that moment, never a process's Redis for good.

With `Redis:ClusterUrl` the coordination state gets a client of its own, `coordination_client`:
a `RedisCluster` that finds the cluster's map from the startup nodes, with the same timeouts,
keepalives and quick retry (no idle health check: `coordination_client` says why;
docs/reliability.md, "Redis Cluster").

The passwords come from the environment (`Redis:PasswordEnv`, `Redis:SentinelPasswordEnv`,
`Redis:ClusterPasswordEnv`) or the URL, and are never logged: the broker URL that carries them
is masked wherever Celery, kombu and Flower print it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from tracon_jobs.coordination.cluster import CoordinationClient as CoordinationClient
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings.redis_url import (
    SentinelUrl,
    is_sentinel,
    parse_cluster_url,
    parse_sentinel_url,
)
from tracon_jobs.settings.sections import RedisSettings

CONNECT_TIMEOUT_SECONDS = 2.0
"""How long a client waits to connect to Redis (or to ask a sentinel) before the call fails and
the caller's `OnStoreUnavailable` decides."""
HEALTH_CHECK_SECONDS = 30
"""A connection idle this long is checked with a `PING` before its next command."""
RETRIES = 1
"""A command that lost its connection is tried once more on a new one, at once: not redis-py's
default backoff, so an unreachable Redis never stalls a provider call for seconds."""


@dataclass(frozen=True)
class RedisTarget:
    """Where this process's Redis is: the configured URL, the Sentinel group it names (None for
    one server) and the passwords read from the environment."""

    url: str
    sentinel: SentinelUrl | None
    master: str
    password: str | None  # of Redis itself (a Sentinel group's master): PasswordEnv's or the URL's
    sentinel_password: str | None


def redis_target(config: RedisSettings, environ: Mapping[str, str] | None = None) -> RedisTarget:
    """The target of `Redis:*`, with the passwords its `...Env` settings name (`environ`,
    else the process's environment)."""
    environ = os.environ if environ is None else environ
    sentinel = parse_sentinel_url(config.url) if is_sentinel(config.url) else None
    password = _secret(environ, "Redis.PasswordEnv", config.password_env)
    if password is None and sentinel is not None:
        password = sentinel.password
    return RedisTarget(
        config.url,
        sentinel,
        config.sentinel_master,
        password,
        _secret(environ, "Redis.SentinelPasswordEnv", config.sentinel_password_env),
    )


def _secret(environ: Mapping[str, str], setting: str, variable: str | None) -> str | None:
    if variable is None:
        return None
    if variable not in environ:  # settings loading says so first; a hand-built Settings here
        raise ConfigurationError(setting, f"names the environment variable {variable}, not set")
    return environ[variable] or None


DEAD_LINK: dict[int, int] = {
    socket.TCP_KEEPIDLE: 5,
    socket.TCP_KEEPINTVL: 2,
    socket.TCP_KEEPCNT: 3,
    **({socket.TCP_USER_TIMEOUT: 10_000} if hasattr(socket, "TCP_USER_TIMEOUT") else {}),
}
"""TCP options that end a connection whose link drops packets in about 10 s (an idle one by
keepalives, one with a command in flight by `TCP_USER_TIMEOUT`, on Linux), instead of the
kernel's 15 minutes of retransmissions: the command fails as Redis being unreachable, which
`OnStoreUnavailable` and the other rules handle; a blocking read on a healthy link waits as
long as it needs (the server acknowledges the probes). docs/reliability.md, "Partitions"."""


def redis_client(
    config: RedisSettings,
    environ: Mapping[str, str] | None = None,
    *,
    max_connections: int | None = None,
    connect_timeout: float = CONNECT_TIMEOUT_SECONDS,
    socket_timeout: float | None = None,
) -> redis.Redis:
    """A client of this process's Redis: the one server, or the Sentinel group's current master.

    Every client gets the same options: `connect_timeout`, `socket_timeout` (None: a reply is
    waited for as long as it takes, as blocking reads need), one quick retry, a health check of
    connections idle for `HEALTH_CHECK_SECONDS`, and a pool of at most `max_connections`
    (redis-py's default when None).
    """
    target = redis_target(config, environ)
    options: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout,
        "socket_timeout": socket_timeout,
        "socket_keepalive": True,
        "socket_keepalive_options": DEAD_LINK,
        "health_check_interval": HEALTH_CHECK_SECONDS,
        "retry": Retry(NoBackoff(), RETRIES),
    }
    if max_connections is not None:
        options["max_connections"] = max_connections
    if target.sentinel is None:
        if target.password is not None:
            options["password"] = target.password
        return redis.Redis.from_url(target.url, **options)
    return _master_client(target, target.sentinel, options)


def coordination_client(
    config: RedisSettings,
    environ: Mapping[str, str] | None = None,
    *,
    max_connections: int | None = None,
) -> RedisCluster | None:
    """The Redis Cluster of `Redis:ClusterUrl` for the coordination state; None without one
    (the state then stays on `redis_client`'s Redis).

    redis-py asks a startup node for the cluster's map as the client is built, so this
    connects: a cluster that none of the nodes answers for fails here, a `ConfigurationError`
    naming the setting (every process builds it at startup, and stops there).
    The options are `redis_client`'s where a cluster client takes them: the timeouts and
    keepalives go to every node's connections, `max_connections` is each node's pool, and
    `retry` is the cluster client's own (it sends a command again after finding the slot's
    node again, and gives each node's connections no retry of their own). No health check:
    redis-py's cluster client (6.4 to 8.x) passes `health_check_interval` to no node, so a
    connection that broke while idle fails its next command, which that one retry sends
    again on a new connection.
    """
    if config.cluster_url is None:
        return None
    environ = os.environ if environ is None else environ
    url = parse_cluster_url(config.cluster_url)
    password = _secret(environ, "Redis.ClusterPasswordEnv", config.cluster_password_env)
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_SECONDS,
        "socket_keepalive": True,
        "socket_keepalive_options": DEAD_LINK,
        "ssl": url.tls,
        "username": url.username,
        "password": password if password is not None else url.password,
    }
    if max_connections is not None:
        options["max_connections"] = max_connections
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in url.nodes],
            retry=Retry(NoBackoff(), RETRIES),
            **options,
        )
    except (RedisClusterException, redis.RedisError) as exc:
        raise ConfigurationError(
            "Redis.ClusterUrl",
            f"no node of it gives the cluster's map ({exc}): start the cluster, or correct the URL",
        ) from None


def redis_answers(config: RedisSettings, timeout: float = 0.5) -> bool:
    """Whether the Redis of `Redis:*` answers a `PING` within `timeout`: its one server, or its
    Sentinel group's master (found through the sentinels)."""
    try:
        client = redis_client(config, connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _master_client(target: RedisTarget, group: SentinelUrl, options: dict[str, Any]) -> redis.Redis:
    """`master_for` the group's master: connections that follow it across failovers."""
    asking = {
        "socket_connect_timeout": options["socket_connect_timeout"],
        # a sentinel that accepted the connection and hangs must not hang every reconnect
        "socket_timeout": options["socket_timeout"] or options["socket_connect_timeout"],
        "password": target.sentinel_password,
    }
    sentinels = Sentinel(list(group.sentinels), sentinel_kwargs=asking)
    client: redis.Redis = sentinels.master_for(
        target.master,
        redis_class=MasterClient,
        connection_pool_class=SentinelConnectionPool,
        connection_class=MasterConnection,
        db=group.db,
        username=group.username,
        password=target.password,
        **options,
    )
    return client


class MasterConnection(SentinelManagedConnection):
    """A connection to the server the sentinels call the master now, however it reconnects.

    redis-py asks the sentinels in `connect`, which the pool calls as it hands a connection
    out. A connection that lost its socket in use (a failover closed it, or it was dropped
    after `READONLY`) reconnects in `send_packed_command` instead, to the address it had: a
    command's retry, and a connection a thread keeps (`coordination.connections`), would go
    on failing against the old master, demoted or dead. Here that reconnect asks too.
    """

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is None:
            self.connect()
        super().send_packed_command(command, check_health)


class MasterClient(redis.Redis):
    """A client of a Sentinel group's master that also closes its connections to the sentinels."""

    def close(self) -> None:
        super().close()
        pool = self.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                sentinel.close()


def broker_url(config: RedisSettings, environ: Mapping[str, str] | None = None) -> str:
    """The URL Celery's broker connects with (kombu reads it).

    One server: the configured URL, with `PasswordEnv`'s password in it when set. A Sentinel
    group: Celery's `sentinel://` form with the master's credentials and the database on every
    sentinel, so whichever of them kombu connects through (it moves to the next on failure)
    reads the same ones. Both carry the password: pass them only to Celery, which masks it.
    """
    target = redis_target(config, environ)
    group = target.sentinel
    if group is None:
        if config.password_env is None or target.password is None:
            return target.url
        return _with_password(target.url, target.password)
    credentials = ""
    if target.password is not None or group.username is not None:
        user = quote(group.username or "", safe="")
        credentials = f"{user}:{quote(target.password or '', safe='')}@"
    return ";".join(
        f"sentinel://{credentials}{_host(host)}:{port}/{group.db}" for host, port in group.sentinels
    )


def broker_transport_options(
    config: RedisSettings, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """What a Sentinel group adds to Celery's `broker_transport_options`: the master's name and
    the sentinels' own connection options (their password, the client's timeouts); nothing for
    one server. Flower reads the same options for its broker view."""
    target = redis_target(config, environ)
    if target.sentinel is None:
        return {}
    asking: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_SECONDS,
        "socket_timeout": CONNECT_TIMEOUT_SECONDS,
    }
    if target.sentinel_password is not None:
        asking["password"] = target.sentinel_password
    return {"master_name": target.master, "sentinel_kwargs": asking}


def _with_password(url: str, password: str) -> str:
    """`url` with `password` as its user-info's password (its user kept)."""
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
