"""`Database.Url` as the engine reads it (`tracon_jobs.db.urls`): PostgreSQL always through
psycopg 3, several hosts in every spelling an operator writes, each handed to psycopg as
hosts and ports that pair up, and what would connect elsewhere than meant refused at startup,
naming the setting and never the password."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from tracon_jobs.db.engine import DEAD_LINK, Database
from tracon_jobs.db.urls import check_url, normalize_url, prepare_threshold
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import load_settings

TWO_HOSTS = {"host": "10.0.0.1,10.0.0.2", "port": "5432,5433"}
"""What psycopg is given for the primary on 5432 and the standby on 5433."""


def psycopg_arguments(url: str) -> dict[str, object]:
    """The keyword arguments SQLAlchemy hands `psycopg.connect` for `url` (no connection)."""
    parsed = make_url(normalize_url(url))
    engine = create_engine(parsed)
    _, arguments = engine.dialect.create_connect_args(parsed)
    engine.dispose()
    return {key: value for key, value in arguments.items() if key != "context"}


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u@/tracon?host=10.0.0.1:5432&host=10.0.0.2:5433",
        "postgresql://u@/tracon?host=10.0.0.1,10.0.0.2&port=5432,5433",
        "postgresql://u@/tracon?host=10.0.0.1:5432,10.0.0.2:5433",
        "postgres://u@10.0.0.1:5432,10.0.0.2:5433/tracon",
    ],
    ids=["host-per-host", "hosts-and-ports", "hosts-with-ports", "libpq-uri"],
)
def test_every_spelling_of_two_hosts_reaches_psycopg_as_two_hosts(url: str) -> None:
    with_attrs = url + ("&" if "?" in url else "?") + "target_session_attrs=read-write"

    assert psycopg_arguments(check_url(with_attrs)) == {
        "dbname": "tracon",
        "user": "u",
        **TWO_HOSTS,
        "target_session_attrs": "read-write",
    }


def test_a_password_and_one_host_are_left_as_written() -> None:
    url = "postgresql+psycopg://u:p%40ss@db:5432/tracon?sslmode=require"

    assert normalize_url(url) == url
    assert psycopg_arguments(url) == {
        "dbname": "tracon",
        "user": "u",
        "password": "p@ss",
        "host": "db",
        "port": 5432,
        "sslmode": "require",
    }
    assert normalize_url("postgres://u@db/tracon") == "postgresql+psycopg://u@db/tracon"
    assert normalize_url("sqlite:///var/tracon.db") == "sqlite:///var/tracon.db"


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("postgresql://u@/t?host=a,b&port=1,2,3", "names 2 hosts and 3 ports: one port per host"),
        ("postgresql://u@/t?host=a,b&port=5432", "names 2 hosts and 1 ports"),
        ("postgresql://u@/t?host=a:5432&port=5433", "gives ports both in `host=h:port`"),
        ("postgresql://u@/t?host=a:x,b:5432", "has a port that is not a number"),
        ("postgresql://u@a:70000/t", "has a port that is not a number from 1 to 65535: 70000"),
        ("postgresql://u@/t?host=a&target_session_attrs=rw", "target_session_attrs must be one"),
        ("postgresql://u@a/t?prepare_threshold=some", "prepare_threshold must be a whole"),
        ("not a url", "must be a SQLAlchemy database URL"),
    ],
)
def test_a_url_that_would_connect_elsewhere_fails_at_startup(
    url: str, rule: str, tmp_path: Path
) -> None:
    secret = url.replace("u@", "u:hunter2@")
    config = tmp_path / "tracon.json"
    config.write_text('{"Tracon": {}}')

    with pytest.raises(ConfigurationError) as raised:
        load_settings(config, environ={"TRACON_DATABASE_URL": secret})

    assert raised.value.setting == "Database.Url" and rule in raised.value.rule
    assert "hunter2" not in str(raised.value)


def test_prepared_statements_off_by_setting_or_by_the_urls_own_option() -> None:
    url = "postgresql+psycopg://u@db/tracon"

    def given(database: Database) -> dict[str, object]:
        driver_url, arguments = database.connect_options()
        assert "prepare_threshold" not in driver_url  # never handed to psycopg as text
        return arguments

    assert "prepare_threshold" not in given(Database(url))  # psycopg's own default, 5
    assert given(Database(url, prepared_statements=False))["prepare_threshold"] is None
    assert given(Database(url + "?prepare_threshold=none"))["prepare_threshold"] is None
    assert given(Database(url + "?prepare_threshold=0"))["prepare_threshold"] == 0
    assert given(Database(url + "?prepare_threshold=0", prepared_statements=False)) == {
        "connect_timeout": 3,
        "prepare_threshold": None,
        **DEAD_LINK,
    }


def test_a_dead_link_ends_a_connection_in_seconds_unless_the_url_says_otherwise() -> None:
    url = "postgresql+psycopg://u@db/tracon"
    _, arguments = Database(url).connect_options()
    assert {key: arguments[key] for key in DEAD_LINK} == DEAD_LINK
    assert arguments["tcp_user_timeout"] == 10_000  # a statement on a link that drops packets

    _, own = Database(url + "?tcp_user_timeout=60000&keepalives=0").connect_options()
    assert "tcp_user_timeout" not in own and "keepalives" not in own  # the URL's own, kept
    assert prepare_threshold(url) == (url, None, False)
