"""The forms `Redis:Url` takes, read once: one server (`redis://`, `rediss://`, `unix://`, as
redis-py reads them) or a Sentinel group in Celery's own notation,
`sentinel://[:password@]host:port;sentinel://host:port/db`; and the form of `Redis:ClusterUrl`,
a Redis Cluster's startup nodes, `redis://[user:password@]host:port,host:port[/0]`.

A Sentinel URL lists one or more sentinels separated by `;`; the database number may follow
any of them (the last, as Celery's examples write it), and so may the password of the Redis
master (the first, as kombu reads it): when several carry one, they must agree. The master's
name is `Redis:SentinelMaster`, the passwords from the environment `Redis:PasswordEnv` and
`Redis:SentinelPasswordEnv` (`tracon_jobs.redis_clients` builds the clients).

Pure parsing, no connection: the settings check a URL with it at startup, so a URL no process
could use stops every command, naming the setting, before anything connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

SENTINEL_SCHEME = "sentinel"
SERVER_SCHEMES = ("redis", "rediss", "unix")
"""The schemes of one server's URL, as `redis.Redis.from_url` reads them."""
DEFAULT_SENTINEL_PORT = 26379
REDIS_URL_RULE = (
    "redis://, rediss:// or unix:// (one server), or sentinel://host:port;sentinel://host:port/db "
    "(a Sentinel group)"
)
"""The rule `Redis:Url` shows in the settings reference."""
CLUSTER_SCHEMES = ("redis", "rediss")
CLUSTER_URL_RULE = "redis:// or rediss://, then host:port of one or more nodes, comma-separated"
"""The rule `Redis:ClusterUrl` shows in the settings reference."""


@dataclass(frozen=True)
class SentinelUrl:
    """A Sentinel group's address: its sentinels, the database, and the master's credentials
    when the URL carries them."""

    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


@dataclass(frozen=True)
class ClusterUrl:
    """A Redis Cluster's address: the nodes a client asks for the cluster's map first (any
    master or replica; it learns the rest from them), TLS or not, and the credentials."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None


def is_sentinel(url: str) -> bool:
    """Whether `url` names a Sentinel group rather than one server."""
    return url.strip().lower().startswith(f"{SENTINEL_SCHEME}://")


def check_redis_url(url: str) -> None:
    """Raise ValueError, worded as a rule, when `url` is neither form."""
    if is_sentinel(url):
        parse_sentinel_url(url)
        return
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SERVER_SCHEMES:
        schemes = ", ".join(f"{name}://" for name in SERVER_SCHEMES)
        raise ValueError(f"must start with {schemes} or sentinel:// (got {masked(url)!r})")
    if scheme != "unix" and not urlsplit(url.strip()).hostname:
        raise ValueError(f"must name a host (got {masked(url)!r})")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The sentinels, database and master credentials of a `sentinel://` URL; ValueError,
    worded as a rule and with no password in it, when a part cannot be read."""
    parts = [part.strip() for part in url.split(";")]
    if not any(parts):
        raise ValueError("must list at least one sentinel")
    sentinels: list[tuple[str, int]] = []
    dbs: set[int] = set()
    users: set[str] = set()
    passwords: set[str] = set()
    for index, part in enumerate(parts, 1):
        where = f"sentinel {index} ({masked(part)!r})"
        if not part.lower().startswith(f"{SENTINEL_SCHEME}://"):
            raise ValueError(f"{where}: every part must start with sentinel://")
        split = urlsplit(part)
        try:
            port = split.port or DEFAULT_SENTINEL_PORT
        except ValueError:
            raise ValueError(f"{where}: the port must be a number from 1 to 65535") from None
        if not split.hostname:
            raise ValueError(f"{where}: must name a host (sentinel://host:port)")
        if split.query or split.fragment:
            raise ValueError(f"{where}: takes no query or fragment")
        path = split.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError(f"{where}: the path must be a database number (/0)")
            dbs.add(int(path))
        if split.username:
            users.add(unquote(split.username))
        if split.password is not None:
            passwords.add(unquote(split.password))
        sentinels.append((split.hostname, port))
    for what, values in (("database numbers", dbs), ("users", users), ("passwords", passwords)):
        if len(values) > 1:
            raise ValueError(f"the sentinels' parts name different {what}: give it once")
    return SentinelUrl(
        tuple(sentinels),
        db=next(iter(dbs), 0),
        username=next(iter(users), None),
        password=next(iter(passwords), None),
    )


def parse_cluster_url(url: str) -> ClusterUrl:
    """The startup nodes and credentials of a `Redis:ClusterUrl`; ValueError, worded as a rule
    and with no password in it, when a part cannot be read.

    Not `urlsplit`: it reads one host and port, and a list of them is the point here. A port is
    required on every node: a cluster's nodes rarely all listen on 6379, and a node left on a
    default port by mistake would be found only when the client first connects.
    """
    shown = masked(url)
    scheme, separator, rest = url.strip().partition("://")
    if not separator or scheme.lower() not in CLUSTER_SCHEMES:
        if scheme.lower() == SENTINEL_SCHEME:
            raise ValueError(
                f"a Redis Cluster is not a Sentinel group: use redis:// (got {shown!r})"
            )
        raise ValueError(f"must start with redis:// or rediss:// (got {shown!r})")
    if "?" in rest or "#" in rest:
        raise ValueError(f"takes no query or fragment (got {shown!r})")
    authority, _slash, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError(
            f"a Redis Cluster has only database 0: end the URL with /0 or nothing (got {shown!r})"
        )
    credentials, _at, hosts = authority.rpartition("@")
    user, _colon, password = credentials.partition(":")
    nodes = tuple(
        _node(part.strip(), index, shown) for index, part in enumerate(hosts.split(","), 1)
    )
    return ClusterUrl(
        nodes,
        tls=scheme.lower() == "rediss",
        username=unquote(user) or None,
        password=unquote(password) if _colon else None,
    )


def _node(part: str, index: int, shown: str) -> tuple[str, int]:
    """One `host:port` of a cluster URL (`[::1]:7000` for an IPv6 address)."""
    where = f"node {index} ({part!r}) of {shown!r}"
    if part.startswith("["):
        host, bracket, port = part[1:].partition("]")
        port = port.removeprefix(":") if bracket and port.startswith(":") else ""
    else:
        host, _colon, port = part.rpartition(":")
    if not host:
        raise ValueError(f"{where}: every node must be host:port")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}: the port must be a number from 1 to 65535")
    return host, int(port)


def password_of(url: str) -> str | None:
    """The password `url` carries (either form), None when it has none."""
    if is_sentinel(url):
        return parse_sentinel_url(url).password
    try:
        password = urlsplit(url.strip()).password
    except ValueError:
        return None
    return None if password is None else unquote(password)


def masked(url: str) -> str:
    """`url` fit to print or log: the password of each part replaced by `***`."""
    return ";".join(_masked_part(part) for part in url.split(";"))


def _masked_part(part: str) -> str:
    scheme, separator, rest = part.partition("://")
    if not separator:
        return part
    authority, slash, path = rest.partition("/")
    credentials, at, host = authority.rpartition("@")
    if not at:
        return part
    user, colon, _password = credentials.partition(":")
    hidden = f"{user}:***" if colon else "***"
    return f"{scheme}://{hidden}@{host}{slash}{path}"
