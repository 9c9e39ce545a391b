"""`Redis:Url` in its two forms: one server, or a Sentinel group in Celery's notation; the
settings that go with a group (its master's name, the passwords from the environment), the
errors an unusable value stops startup with, and the broker URL and options Celery is given."""

from __future__ import annotations

import pytest
from redis.sentinel import SentinelConnectionPool

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.redis_clients import (
    MasterClient,
    MasterConnection,
    broker_transport_options,
    broker_url,
    redis_client,
)
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings, load_settings
from tracon_jobs.settings.redis_url import SentinelUrl, masked, parse_sentinel_url

GROUP = "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380"


def redis_settings(environ: dict[str, str]) -> Settings:
    return load_settings(environ={"TRACON_CONFIG": "", **environ})


# -- the URL ---------------------------------------------------------------------------------


def test_a_sentinel_url_lists_its_sentinels_with_the_database_on_the_last() -> None:
    parsed = parse_sentinel_url("sentinel://:s3cret@10.0.0.1:26379;sentinel://10.0.0.2:26380/2")

    assert parsed == SentinelUrl(
        (("10.0.0.1", 26379), ("10.0.0.2", 26380)), db=2, username=None, password="s3cret"
    )


def test_a_sentinel_without_a_port_is_on_sentinels_default_port_and_the_database_is_0() -> None:
    assert parse_sentinel_url("sentinel://sentinel-a;sentinel://sentinel-b") == SentinelUrl(
        (("sentinel-a", 26379), ("sentinel-b", 26379))
    )


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("sentinel://h:1/1;sentinel://h:2/2", "different database numbers"),
        ("sentinel://:a@h:1;sentinel://:b@h:2", "different passwords"),
        ("sentinel://h:port", "the port must be a number"),
        ("sentinel://h:1;redis://h:2", "sentinel 2 ('redis://h:2'): every part must start"),
        ("sentinel://:pw@/0", "must name a host"),
        ("sentinel://h:1/zero", "the path must be a database number"),
        ("sentinel://h:1?master=x", "takes no query"),
        ("mongodb://h:1", "must start with redis://, rediss://, unix:// or sentinel://"),
        ("redis://", "must name a host"),
    ],
)
def test_an_unusable_url_stops_startup_naming_the_setting_and_the_variable(
    url: str, rule: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings({"TRACON_REDIS_URL": url})

    assert raised.value.setting == "Redis.Url"
    assert rule in raised.value.rule
    assert raised.value.rule.endswith("(from environment variable TRACON_REDIS_URL)")


def test_a_password_in_an_unusable_url_is_never_shown() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings({"TRACON_REDIS_URL": "sentinel://:hunter2@h:1;sentinel://:hunter2@h:x"})

    assert "hunter2" not in str(raised.value)
    assert "sentinel://:***@h:x" in str(raised.value)


def test_masked_hides_every_parts_password_and_keeps_the_rest() -> None:
    url = "sentinel://:pw@a:1;sentinel://user:pw@b:2/3"
    assert masked(url) == "sentinel://:***@a:1;sentinel://user:***@b:2/3"
    assert masked("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# -- the settings that go with it ------------------------------------------------------------


@pytest.mark.parametrize(
    "environ",
    [
        {"TRACON_REDIS_SENTINEL_MASTER": "cache-main"},
        {"TRACON__REDIS__SENTINELMASTER": "cache-main"},
        {"TRACON_REDIS_SENTINEL_MASTER": "other", "TRACON__REDIS__SENTINELMASTER": "cache-main"},
    ],
)
def test_the_master_name_comes_from_the_setting_or_its_shortcut_the_setting_winning(
    environ: dict[str, str],
) -> None:
    settings = redis_settings({"TRACON_REDIS_URL": GROUP, **environ})

    assert settings.redis.sentinel_master == "cache-main"
    assert broker_transport_options(settings.redis)["master_name"] == "cache-main"


def test_the_master_name_defaults_to_sentinels_own_example_name() -> None:
    assert redis_settings({"TRACON_REDIS_URL": GROUP}).redis.sentinel_master == "mymaster"


def test_a_password_variable_that_is_not_set_stops_startup_naming_the_setting() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings({"TRACON_REDIS_URL": GROUP, "TRACON__REDIS__PASSWORDENV": "REDIS_PW"})

    assert raised.value.setting == "Redis.PasswordEnv"
    assert "REDIS_PW, which is not set (set it, or remove PasswordEnv)" in raised.value.rule


def test_a_password_in_the_url_and_in_the_environment_is_one_too_many() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings(
            {
                "TRACON_REDIS_URL": "sentinel://:pw@h:1",
                "TRACON__REDIS__PASSWORDENV": "REDIS_PW",
                "REDIS_PW": "pw",
            }
        )

    assert raised.value.setting == "Redis.PasswordEnv"
    assert "keep one of the two" in raised.value.rule


def test_a_sentinels_password_needs_sentinels() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings({"TRACON__REDIS__SENTINELPASSWORDENV": "S_PW", "S_PW": "x"})

    assert raised.value.setting == "Redis.SentinelPasswordEnv"
    assert "needs a sentinel:// Url" in raised.value.rule


# -- what Celery and the clients are given ---------------------------------------------------


def test_celery_gets_its_own_sentinel_form_with_credentials_and_database_on_every_sentinel() -> (
    None
):
    settings = redis_settings(
        {
            "TRACON_REDIS_URL": "sentinel://a:1;sentinel://b:2/4",
            "TRACON__REDIS__PASSWORDENV": "REDIS_PW",
            "TRACON__REDIS__SENTINELPASSWORDENV": "SENTINEL_PW",
            "REDIS_PW": "p@ss;word",
            "SENTINEL_PW": "s3",
        }
    )

    environ = {"REDIS_PW": "p@ss;word", "SENTINEL_PW": "s3"}
    assert broker_url(settings.redis, environ) == (
        "sentinel://:p%40ss%3Bword@a:1/4;sentinel://:p%40ss%3Bword@b:2/4"
    )
    assert broker_transport_options(settings.redis, environ) == {
        "master_name": "mymaster",
        "sentinel_kwargs": {"socket_connect_timeout": 2.0, "socket_timeout": 2.0, "password": "s3"},
    }


def test_one_server_keeps_its_url_and_gets_the_environments_password_in_it() -> None:
    plain = redis_settings({"TRACON_REDIS_URL": "redis://cache:6379/1"})
    secret = redis_settings(
        {
            "TRACON_REDIS_URL": "redis://cache:6379/1",
            "TRACON__REDIS__PASSWORDENV": "REDIS_PW",
            "REDIS_PW": "pw",
        }
    )

    assert broker_url(plain.redis, {}) == "redis://cache:6379/1"
    assert broker_transport_options(plain.redis, {}) == {}
    assert broker_url(secret.redis, {"REDIS_PW": "pw"}) == "redis://:pw@cache:6379/1"


def test_a_sentinel_client_follows_the_master_through_the_sentinels_with_the_same_options() -> None:
    settings = redis_settings({"TRACON_REDIS_URL": GROUP + "/3"})

    client = redis_client(settings.redis, max_connections=7)  # connects to nothing yet

    pool = client.connection_pool
    assert isinstance(client, MasterClient) and isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mymaster" and pool.max_connections == 7
    assert pool.connection_class is MasterConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["socket_connect_timeout"], kwargs["health_check_interval"]) == (
        3,
        2.0,
        30,
    )
    assert kwargs["retry"].get_retries() == 1
    client.close()


def test_a_runtime_on_a_sentinel_url_is_built_without_a_traceback() -> None:
    # the bug this setting fixed: `Redis URL must specify one of the following schemes`
    settings = Settings.model_validate({"Redis": {"Url": GROUP}, "Database": {"Url": "sqlite://"}})

    runtime = Runtime(settings)

    assert isinstance(runtime.redis.connection_pool, SentinelConnectionPool)
    assert runtime.celery.conf.broker_transport_options["master_name"] == "mymaster"
    assert runtime.celery.conf.broker_url.startswith("sentinel://127.0.0.1:26379/0;")
    runtime.close()
