"""The fast-path switch: what it reads, what it refuses, and that each place obeys it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Connection

from tracon_jobs import fast_paths
from tracon_jobs.db import Database
from tracon_jobs.db.hot import FastConnection
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import Settings
from tracon_jobs.settings.loading import load_settings
from tracon_jobs.worker.broker import TRANSPORT, transport_for


@pytest.fixture
def switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Set `TRACON_FAST_PATHS` for this process; the cached reading is dropped before and
    after, so no other test sees it."""
    fast_paths._off.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    fast_paths._off.cache_clear()


@pytest.mark.parametrize(
    ("value", "off"),
    [
        ("", set()),
        ("on", set()),
        (" OFF ", set(fast_paths.NAMES)),
        ("off:sqlite", {"sqlite"}),
        ("off:broker, envelope", {"broker", "envelope"}),
    ],
)
def test_the_switch_reads_on_off_and_a_list(value: str, off: set[str]) -> None:
    assert fast_paths.read({fast_paths.ENV_VAR: value}) == off


@pytest.mark.parametrize("value", ["no", "off:", "off:sqlite,nothing", "true"])
def test_a_value_it_cannot_read_fails_at_startup_naming_the_variable(
    value: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load_settings(tmp_path / "absent.json", environ={fast_paths.ENV_VAR: value})
    assert raised.value.setting == "TRACON_FAST_PATHS"
    assert "broker" in raised.value.rule  # it lists the names it takes


def test_with_fast_paths_off_every_place_takes_the_librarys_own_path(
    switch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = "redis://127.0.0.1:1/0"
    settings = Settings.model_validate(
        {"Database": {"Url": f"sqlite:///{tmp_path / 'x.db'}"}, "Redis": {"Url": url}}
    )
    database = Database(settings.database.url)
    assert transport_for(url) == TRANSPORT
    with database._core(database.engine) as connection:
        assert isinstance(connection, FastConnection)

    switch.setenv(fast_paths.ENV_VAR, "off")
    fast_paths._off.cache_clear()

    assert transport_for(url) is None  # kombu's own Redis transport
    with database._core(database.engine) as connection:
        assert type(connection) is Connection
    database.dispose()
