"""The forms `Broker:Url` takes, read once: null (Celery's broker is `Redis:Url`), RabbitMQ's
`amqp://` or `amqps://` (`amqp://user:password@host:5672/vhost`), or any form `Redis:Url` takes
(`redis_url`).

Pure parsing, no connection: the settings check a URL with it at startup, so a broker no process
could use stops every command, naming the setting, before anything connects. What each form
makes of Celery's app (quorum queues, publisher confirms, which fast paths apply) is
`tracon_jobs.worker.brokers`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from tracon_jobs.settings.redis_url import (
    SENTINEL_SCHEME,
    SERVER_SCHEMES,
    check_redis_url,
    masked,
)

AMQP_SCHEMES = ("amqp", "amqps")
"""RabbitMQ's schemes, as kombu reads them (`amqps`: TLS)."""
BROKER_URL_RULE = (
    "null (Redis:Url), amqp:// or amqps:// (RabbitMQ), or a Redis URL in a form Redis:Url takes"
)
"""The rule `Broker:Url` shows in the settings reference."""


def is_amqp(url: str | None) -> bool:
    """Whether `url` names a RabbitMQ broker (None: the broker is `Redis:Url`, not RabbitMQ)."""
    return url is not None and _scheme(url) in AMQP_SCHEMES


def check_broker_url(url: str) -> None:
    """Raise ValueError, worded as a rule and with no password in it, when `url` is neither an
    AMQP URL with a host nor a form `Redis:Url` takes."""
    scheme = _scheme(url)
    if scheme in AMQP_SCHEMES:
        _check_amqp(url)
        return
    if scheme not in (*SERVER_SCHEMES, SENTINEL_SCHEME):
        schemes = ", ".join(f"{name}://" for name in (*AMQP_SCHEMES, *SERVER_SCHEMES))
        raise ValueError(f"must start with {schemes} or sentinel:// (got {masked(url)!r})")
    check_redis_url(url)


def _check_amqp(url: str) -> None:
    split = urlsplit(url.strip())
    if ";" in url:
        raise ValueError("names one RabbitMQ node (a cluster is reached through one address)")
    try:
        split.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError(
            f"the port must be a number from 1 to 65535 (got {masked(url)!r})"
        ) from None
    if not split.hostname:
        raise ValueError(
            f"must name a host (amqp://user:password@host:5672/vhost; got {masked(url)!r})"
        )


def _scheme(url: str) -> str:
    return url.strip().split("://", 1)[0].lower() if "://" in url else ""
