"""`Redis:ClusterUrl`, the Redis Cluster of the coordination state, and its password from the
environment (`Redis:ClusterPasswordEnv`): the forms read, the errors an unusable value stops
startup with (naming the setting, the rule and the variable, never the password), and the
client built from them (it connects to nothing here: no node answers on port 1)."""

from __future__ import annotations

import pytest
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from tracon_jobs.errors import ConfigurationError
from tracon_jobs.redis_clients import RETRIES, coordination_client
from tracon_jobs.settings import Settings, load_settings
from tracon_jobs.settings.redis_url import ClusterUrl, parse_cluster_url


def redis_settings(environ: dict[str, str]) -> Settings:
    return load_settings(environ={"TRACON_CONFIG": "", **environ})


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("redis://10.0.0.1:7000", ClusterUrl((("10.0.0.1", 7000),))),
        (
            "redis://a:7000,b:7001, c:7002/0",
            ClusterUrl((("a", 7000), ("b", 7001), ("c", 7002))),
        ),
        (
            "rediss://app:p%40ss@a:7000,[::1]:7001/",
            ClusterUrl((("a", 7000), ("::1", 7001)), tls=True, username="app", password="p@ss"),
        ),
        ("REDIS://:pw@a:1", ClusterUrl((("a", 1),), password="pw")),
    ],
)
def test_a_cluster_url_lists_its_startup_nodes_and_credentials(
    url: str, parsed: ClusterUrl
) -> None:
    assert parse_cluster_url(url) == parsed


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://a:7000", "must start with redis:// or rediss://"),
        ("unix:///tmp/redis.sock", "must start with redis:// or rediss://"),
        ("sentinel://a:26379", "a Redis Cluster is not a Sentinel group"),
        ("redis://a", "node 1 ('a') of 'redis://a': every node must be host:port"),
        ("redis://a:7000,b", "node 2 ('b')"),
        ("redis://a:7000,,b:7001", "node 2 ('') of"),
        ("redis://:7000", "every node must be host:port"),
        ("redis://a:seven", "the port must be a number from 1 to 65535"),
        ("redis://a:0", "the port must be a number from 1 to 65535"),
        ("redis://a:65536", "the port must be a number from 1 to 65535"),
        ("redis://a:7000/1", "a Redis Cluster has only database 0"),
        ("redis://a:7000?ssl=true", "takes no query or fragment"),
    ],
)
def test_an_unusable_cluster_url_stops_startup_naming_the_setting_and_the_variable(
    url: str, rule: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings({"TRACON_REDIS_CLUSTER_URL": url})

    assert raised.value.setting == "Redis.ClusterUrl"
    assert rule in raised.value.rule
    assert raised.value.rule.endswith("(from environment variable TRACON_REDIS_CLUSTER_URL)")


def test_a_password_in_an_unusable_cluster_url_is_never_shown() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings({"TRACON_REDIS_CLUSTER_URL": "redis://app:hunter2@a:7000,b:x"})

    assert "hunter2" not in str(raised.value)
    assert "redis://app:***@a:7000,b:x" in str(raised.value)


@pytest.mark.parametrize(
    "environ",
    [
        {"TRACON_REDIS_CLUSTER_URL": "redis://a:7000,b:7001"},
        {"TRACON__REDIS__CLUSTERURL": "redis://a:7000,b:7001"},
        {
            "TRACON_REDIS_CLUSTER_URL": "redis://x:1",
            "TRACON__REDIS__CLUSTERURL": "redis://a:7000,b:7001",
        },
    ],
)
def test_the_cluster_url_comes_from_the_setting_or_its_shortcut_the_setting_winning(
    environ: dict[str, str],
) -> None:
    assert redis_settings(environ).redis.cluster_url == "redis://a:7000,b:7001"


def test_no_cluster_by_default_and_no_client_for_it() -> None:
    settings = redis_settings({})

    assert settings.redis.cluster_url is None
    assert coordination_client(settings.redis, {}) is None


def test_a_cluster_url_in_the_file_is_read_as_in_the_environment() -> None:
    settings = Settings.model_validate({"Redis": {"ClusterUrl": "rediss://a:7000"}})
    assert settings.redis.cluster_url == "rediss://a:7000"
    with pytest.raises(ConfigurationError) as raised:
        Settings.from_mapping({"Redis": {"ClusterUrl": "redis://a:7000/3"}})
    assert raised.value.setting == "Redis.ClusterUrl"


def test_a_cluster_password_variable_that_is_not_set_stops_startup_naming_the_setting() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings(
            {
                "TRACON_REDIS_CLUSTER_URL": "redis://a:7000",
                "TRACON__REDIS__CLUSTERPASSWORDENV": "CLUSTER_PW",
            }
        )

    assert raised.value.setting == "Redis.ClusterPasswordEnv"
    assert "CLUSTER_PW, which is not set (set it, or remove ClusterPasswordEnv)" in (
        raised.value.rule
    )


def test_a_password_in_the_cluster_url_and_in_the_environment_is_one_too_many() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings(
            {
                "TRACON_REDIS_CLUSTER_URL": "redis://:pw@a:7000",
                "TRACON__REDIS__CLUSTERPASSWORDENV": "CLUSTER_PW",
                "CLUSTER_PW": "pw",
            }
        )

    assert raised.value.setting == "Redis.ClusterPasswordEnv"
    assert "keep one of the two" in raised.value.rule
    assert "pw@" not in str(raised.value)


def test_a_cluster_password_needs_a_cluster() -> None:
    with pytest.raises(ConfigurationError) as raised:
        redis_settings({"TRACON__REDIS__CLUSTERPASSWORDENV": "CLUSTER_PW", "CLUSTER_PW": "x"})

    assert raised.value.setting == "Redis.ClusterPasswordEnv"
    assert "needs a ClusterUrl" in raised.value.rule


def test_the_cluster_password_comes_from_its_variable_and_no_one_answers_here() -> None:
    # redis-py asks a startup node for the cluster's map as the client is built; none answers
    settings = redis_settings(
        {
            "TRACON_REDIS_CLUSTER_URL": "redis://127.0.0.1:1",
            "TRACON__REDIS__CLUSTERPASSWORDENV": "CLUSTER_PW",
            "CLUSTER_PW": "s3cret",
        }
    )

    with pytest.raises(ConfigurationError) as raised:
        coordination_client(settings.redis, {"CLUSTER_PW": "s3cret"})

    assert raised.value.setting == "Redis.ClusterUrl"
    assert "no node of it gives the cluster's map" in raised.value.rule
    assert "s3cret" not in str(raised.value)


def test_the_cluster_client_gets_the_one_quick_retry_and_the_startup_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: dict[str, object] = {}

    def capture(self: RedisCluster, **kwargs: object) -> None:
        built.update(kwargs)

    monkeypatch.setattr(RedisCluster, "__init__", capture)
    settings = redis_settings({"TRACON_REDIS_CLUSTER_URL": "rediss://app:pw@a:7000,b:7001"})

    coordination_client(settings.redis, {}, max_connections=9)

    nodes = built.pop("startup_nodes")
    assert isinstance(nodes, list)
    assert [(node.host, node.port) for node in nodes] == [("a", 7000), ("b", 7001)]
    assert all(isinstance(node, ClusterNode) for node in nodes)
    retry = built.pop("retry")
    assert isinstance(retry, Retry) and retry.get_retries() == RETRIES
    assert built.pop("socket_keepalive_options")
    assert built == {
        "socket_connect_timeout": 2.0,
        "socket_keepalive": True,
        "ssl": True,
        "username": "app",
        "password": "pw",
        "max_connections": 9,
    }
