"""The default webhook schedule is the Standard Webhooks one, written out here as the standard
states it (not read back from `defaults`): retries after 5 s, 5 min, 30 min, 2 h, 5 h, 10 h
and 10 h, and an endpoint failing for 5 days disabled."""

from __future__ import annotations

from datetime import timedelta

from tracon_jobs.settings import Settings

STANDARD_BACKOFF = [
    timedelta(seconds=5),
    timedelta(minutes=5),
    timedelta(minutes=30),
    timedelta(hours=2),
    timedelta(hours=5),
    timedelta(hours=10),
    timedelta(hours=10),
]


def test_the_default_backoff_and_disable_after_are_the_standards() -> None:
    webhooks = Settings.model_validate({}).webhooks

    assert webhooks.backoff == STANDARD_BACKOFF
    assert webhooks.disable_after == timedelta(days=5)
    # eight attempts in all, the last about 27.5 hours after the first (as docs/webhooks.md says)
    assert len(webhooks.backoff) + 1 == 8
    assert sum(webhooks.backoff, timedelta()) == timedelta(hours=27, minutes=35, seconds=5)


def test_a_configured_schedule_replaces_the_default_one() -> None:
    webhooks = Settings.model_validate(
        {"Webhooks": {"Backoff": [0.5, "00:00:02"], "DisableAfter": "1.00:00:00"}}
    ).webhooks

    assert webhooks.backoff == [timedelta(seconds=0.5), timedelta(seconds=2)]
    assert webhooks.disable_after == timedelta(days=1)
