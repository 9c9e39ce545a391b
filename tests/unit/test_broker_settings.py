"""`Broker:Url`: null (Celery's broker is `Redis:Url`), RabbitMQ's `amqp://`/`amqps://`, or a
Redis URL; what Celery's app is given for each (`worker.brokers`: quorum queues, publisher
confirms, heartbeats on RabbitMQ; the Redis transport and its options on Redis), and which
processes may push runs to a Redis list themselves (only where the broker is `Redis:Url`)."""

from __future__ import annotations

import pytest
from kombu import Queue

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import Settings, load_settings
from tracon_jobs.worker.broker import TRANSPORT
from tracon_jobs.worker.brokers import (
    AMQP_HEARTBEAT_SECONDS,
    DEAD_LINK_OPTIONS,
    REDIS_VISIBILITY_TIMEOUT_SECONDS,
    broker_of,
    is_coordination_redis,
)

RABBIT = "amqp://tracon:s3cret@rabbit.internal:5672/tracon"


def arguments(queue: Queue) -> object:
    """The arguments a queue is declared with (kombu's attribute, untyped)."""
    return getattr(queue, "queue_arguments", None)


def settings(environ: dict[str, str]) -> Settings:
    return load_settings(environ={"TRACON_CONFIG": "", **environ})


@pytest.mark.parametrize(
    "url",
    [
        RABBIT,
        "amqps://tracon:s3cret@rabbit.internal/tracon",
        "AMQP://rabbit.internal",
        "redis://127.0.0.1:6380/1",
        "rediss://cache.internal:6380/0",
    ],
)
def test_the_broker_takes_amqp_and_redis_urls(url: str) -> None:
    assert settings({"TRACON_BROKER_URL": url}).broker.url == url


def test_without_a_broker_url_the_broker_is_the_redis_of_the_coordination_state() -> None:
    loaded = settings({"TRACON_REDIS_URL": "redis://10.0.0.5:6379/2"})

    broker = broker_of(loaded)

    assert loaded.broker.url is None and broker.url == "redis://10.0.0.5:6379/2"
    assert broker.coordination_redis and not broker.amqp
    assert broker.transport == TRANSPORT  # the `broker` fast path, on by default
    assert broker.transport_options == {
        "visibility_timeout": REDIS_VISIBILITY_TIMEOUT_SECONDS,
        **DEAD_LINK_OPTIONS,  # a send on a link that drops packets fails in seconds
    }
    assert [arguments(queue) for queue in broker.queues(["a", "b"])] == [None, None]


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://rabbit.internal", "must start with amqp://, amqps://, redis://"),
        ("rabbit.internal:5672", "must start with amqp://"),
        ("amqp:///tracon", "must name a host"),
        ("amqp://rabbit.internal:99999/", "the port must be a number from 1 to 65535"),
        ("amqp://a:5672;amqp://b:5672", "names one RabbitMQ node"),
        ("redis:///0", "must name a host"),
    ],
)
def test_a_url_no_broker_could_use_fails_at_startup_naming_the_setting(url: str, rule: str) -> None:
    with pytest.raises(ConfigurationError) as failed:
        settings({"TRACON_BROKER_URL": url})

    message = str(failed.value)
    assert "Broker.Url" in message and rule in message and "TRACON_BROKER_URL" in message


def test_a_refused_url_is_shown_without_its_password() -> None:
    with pytest.raises(ConfigurationError) as failed:
        settings({"TRACON_BROKER_URL": "amqp://tracon:s3cret@:5672/tracon"})

    assert "s3cret" not in str(failed.value) and "***" in str(failed.value)


def test_a_sentinel_broker_other_than_redis_url_is_refused() -> None:
    group = "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380/0"

    with pytest.raises(ConfigurationError, match="must be Redis:Url's group"):
        settings({"TRACON_BROKER_URL": group})
    same = settings({"TRACON_BROKER_URL": group, "TRACON_REDIS_URL": group})
    assert is_coordination_redis(same)


def test_the_double_underscore_form_wins_over_the_shortcut() -> None:
    loaded = settings({"TRACON_BROKER_URL": RABBIT, "TRACON__BROKER__URL": "amqp://other"})

    assert loaded.broker.url == "amqp://other"


def test_on_rabbitmq_queues_are_quorum_publishes_confirmed_and_heartbeats_short() -> None:
    broker = broker_of(settings({"TRACON_BROKER_URL": RABBIT}))

    assert broker.amqp and not broker.coordination_redis
    assert broker.url == RABBIT and "s3cret" not in repr(broker)
    assert [arguments(queue) for queue in broker.queues(["tracon.runs"])] == [
        {"x-queue-type": "quorum"}
    ]
    assert broker.celery_options() == {
        "broker_transport": None,  # kombu's own AMQP transport, no fast path
        "broker_transport_options": {"confirm_publish": True},
        "broker_heartbeat": AMQP_HEARTBEAT_SECONDS,
    }


def test_a_redis_of_the_messages_own_takes_no_pushes_of_the_coordination_client() -> None:
    loaded = settings({"TRACON_BROKER_URL": "redis://queues.internal:6379/0"})

    broker = broker_of(loaded)

    assert not broker.amqp and not broker.coordination_redis
    assert broker.url == "redis://queues.internal:6379/0" and broker.transport == TRANSPORT
    assert "broker_heartbeat" not in broker.celery_options()


def test_the_broker_url_equal_to_redis_url_is_the_coordination_redis() -> None:
    url = "redis://10.0.0.5:6379/2"
    loaded = settings({"TRACON_REDIS_URL": url, "TRACON_BROKER_URL": url})

    assert is_coordination_redis(loaded) and broker_of(loaded).coordination_redis
