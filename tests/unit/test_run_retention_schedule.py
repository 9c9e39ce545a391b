"""Beat sends `tracon.runs.retention` only while some run retention is set: `Runs.Retention`,
or a tenant's own (which `install` reads from SQL and passes as `tenant_retention`), every
`Runs.RetentionScanInterval`, each tick expiring within it."""

from __future__ import annotations

from typing import Any

import pytest

from beat_schedules.schedule import RUN_RETENTION_TASK, build_schedule
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import Settings


def retention_entries(settings: Settings, tenant_retention: bool = False) -> list[dict[str, Any]]:
    schedule = build_schedule(settings, tenant_retention)
    return [entry for entry in schedule.values() if entry["task"] == RUN_RETENTION_TASK]


def test_not_scheduled_without_any_retention() -> None:
    assert retention_entries(Settings.model_validate({})) == []
    assert retention_entries(Settings.model_validate({"Runs": {"Retention": None}})) == []
    # the idempotency records' retention is another matter
    assert retention_entries(Settings.model_validate({"Retention": {"Enabled": True}})) == []


def test_scheduled_with_runs_retention_every_scan_interval() -> None:
    settings = Settings.model_validate(
        {"Runs": {"Retention": "30.00:00:00", "RetentionScanInterval": "00:05:00"}}
    )

    [entry] = retention_entries(settings)

    assert entry["schedule"] == 300
    assert entry["options"] == {"expires": 300, "queue": "tracon.control"}


def test_scheduled_when_only_a_tenant_has_its_own_retention() -> None:
    [entry] = retention_entries(Settings.model_validate({}), tenant_retention=True)

    assert entry["schedule"] == 600  # the default scan interval


@pytest.mark.parametrize("value", ["0", "-00:00:01", "soon"])
def test_a_retention_that_is_no_positive_duration_fails_at_startup(value: str) -> None:
    with pytest.raises(ConfigurationError, match=r"Runs\.Retention: "):
        Settings.from_mapping({"Runs": {"Retention": value}})
