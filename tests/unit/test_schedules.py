"""Slots of schedules, pure: cron expressions (grammar, the day-field rule, the next and the
previous slot in a zone across DST changes both ways), intervals, interval texts, and what the
catch-up policies fire after an outage."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from tracon_jobs.schedules.cadence import CronCadence, IntervalCadence, parse_interval
from tracon_jobs.schedules.cron import InvalidCron, parse_cron
from tracon_jobs.schedules.policies import CatchUp, plan

NEW_YORK = ZoneInfo("America/New_York")
PARIS = ZoneInfo("Europe/Paris")
MINUTE = timedelta(minutes=1)


def slots(expression: str, zone: ZoneInfo, after: datetime, count: int) -> list[datetime]:
    cron, found = parse_cron(expression), []
    for _ in range(count):
        slot = cron.next_after(after, zone)
        assert slot is not None
        found.append(slot)
        after = slot
    return found


# -- the grammar ----------------------------------------------------------------------------


def test_fields_lists_ranges_steps_and_names() -> None:
    cron = parse_cron("*/20 9-17/4 1,15 JAN-MAR mon-fri")
    assert cron.minutes == (0, 20, 40)
    assert cron.hours == (9, 13, 17)
    assert cron.days == {1, 15} and cron.months == {1, 2, 3} and cron.weekdays == {1, 2, 3, 4, 5}
    assert parse_cron("0 0 * * 7").weekdays == {0}  # 7 is Sunday too
    assert parse_cron("@hourly").minutes == (0,) and len(parse_cron("@hourly").hours) == 24


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("* * * *", "five fields"),
        ("60 * * * *", "minute: 60 is not from 0 to 59"),
        ("* 24 * * *", "hour: 24"),
        ("* * 0 * *", "day of month: 0"),
        ("* * * 13 *", "month: 13"),
        ("* * * * 8", "day of week: 8"),
        ("*/0 * * * *", "step must be at least 1"),
        ("5-1 * * * *", "range must go upwards"),
        ("a * * * *", "not a number"),
        ("1,,2 * * * *", "empty item"),
        ("0 0 30 2 *", "never fires"),
    ],
)
def test_a_broken_rule_is_named(expression: str, words: str) -> None:
    with pytest.raises(InvalidCron, match=words):
        parse_cron(expression)


def test_both_day_fields_restricted_match_either() -> None:
    # the 13th, or any Friday (Vixie cron)
    found = slots("0 12 13 * FRI", ZoneInfo("UTC"), datetime(2024, 9, 1), 4)
    assert [slot.day for slot in found] == [6, 13, 20, 27]


def test_february_29th_is_found_years_ahead() -> None:
    assert slots("0 0 29 2 *", ZoneInfo("UTC"), datetime(2024, 3, 1), 1) == [datetime(2028, 2, 29)]


# -- slots in a zone across DST ---------------------------------------------------------------


def test_a_daily_slot_follows_local_time_across_a_change() -> None:
    # 09:00 in Paris is 08:00 UTC in winter, 07:00 UTC in summer (clocks forward 31 March 2024)
    found = slots("0 9 * * *", PARIS, datetime(2024, 3, 30), 2)
    assert found == [datetime(2024, 3, 30, 8), datetime(2024, 3, 31, 7)]


def test_a_local_time_that_does_not_exist_is_skipped() -> None:
    # New York, 10 March 2024: 02:00 -> 03:00, so 02:30 never happens that day
    found = slots("30 2 * * *", NEW_YORK, datetime(2024, 3, 9, 12), 2)
    assert found == [datetime(2024, 3, 11, 6, 30), datetime(2024, 3, 12, 6, 30)]


def test_a_local_time_that_happens_twice_fires_once() -> None:
    # New York, 3 November 2024: 02:00 EDT -> 01:00 EST, so 01:30 happens twice
    found = slots("30 1 * * *", NEW_YORK, datetime(2024, 11, 2, 12), 2)
    assert found == [datetime(2024, 11, 3, 5, 30), datetime(2024, 11, 4, 6, 30)]


def test_a_frequent_slot_in_the_repeated_hour_fires_once_per_local_time() -> None:
    found = slots("*/30 * * * *", NEW_YORK, datetime(2024, 11, 3, 4, 45), 4)
    # 01:00 and 01:30 EDT (05:00Z, 05:30Z) fire; their EST repeats do not; then 02:00 EST
    assert found == [
        datetime(2024, 11, 3, 5),
        datetime(2024, 11, 3, 5, 30),
        datetime(2024, 11, 3, 7),
        datetime(2024, 11, 3, 7, 30),
    ]


def test_the_previous_slot_walks_back_across_a_change() -> None:
    cadence = CronCadence(parse_cron("*/30 * * * *"), NEW_YORK)
    found = cadence.latest(datetime(2024, 11, 3, 4), datetime(2024, 11, 3, 7, 10), 10)
    assert found == [
        datetime(2024, 11, 3, 4),
        datetime(2024, 11, 3, 4, 30),
        datetime(2024, 11, 3, 5),
        datetime(2024, 11, 3, 5, 30),
        datetime(2024, 11, 3, 7),
    ]


# -- intervals ------------------------------------------------------------------------------


def test_interval_slots_keep_to_their_anchor() -> None:
    cadence = IntervalCadence(datetime(2024, 1, 1), timedelta(seconds=90))
    assert cadence.next_after(datetime(2024, 1, 1)) == datetime(2024, 1, 1, 0, 1, 30)
    assert cadence.next_after(datetime(2024, 1, 1, 0, 3)) == datetime(2024, 1, 1, 0, 4, 30)
    late = cadence.latest(datetime(2024, 1, 1, 0, 2), datetime(2024, 1, 1, 0, 9), 3)
    assert late == [datetime(2024, 1, 1, 0, m, s) for m, s in ((6, 0), (7, 30), (9, 0))]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(1, 1), (2.5, 2.5), ("30", 30), ("PT30S", 30), ("P1DT2H", 93600), ("00:01:30", 90)],
)
def test_interval_texts(text: str | float, seconds: float) -> None:
    assert parse_interval(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", [0.5, 0, -5, "PT0S", "soon", True, "P400D"])
def test_interval_limits(text: object) -> None:
    with pytest.raises(ValueError):
        parse_interval(text)


# -- catch-up after an outage -----------------------------------------------------------------

NOW = datetime(2024, 6, 1, 12, 0, 30)
DUE = [datetime(2024, 6, 1, 11, 55) + k * MINUTE for k in range(6)]  # 11:55 ... 12:00
GRACE = timedelta(seconds=10)


@pytest.mark.parametrize(
    ("catch_up", "limit", "fired", "missed"),
    [
        (CatchUp.NONE, 100, [], DUE),
        (CatchUp.LATEST, 100, DUE[-1:], DUE[:-1]),
        (CatchUp.ALL, 100, DUE, []),
        (CatchUp.ALL, 2, DUE[-2:], DUE[:-2]),
    ],
)
def test_catch_up_policies_after_a_five_minute_outage(
    catch_up: CatchUp, limit: int, fired: list[datetime], missed: list[datetime]
) -> None:
    decided = plan(DUE, NOW, catch_up, GRACE, limit)
    assert (decided.fire, decided.missed) == (fired, missed)
    assert [slot for slot, _ in decided.slots()] == DUE


def test_a_slot_within_the_grace_is_on_time_for_every_policy() -> None:
    grace = timedelta(seconds=45)  # 12:00 is 30 s late: on time
    for catch_up in (CatchUp.NONE, CatchUp.LATEST):
        decided = plan(DUE, NOW, catch_up, grace, 100)
        assert (decided.fire, decided.missed) == (DUE[-1:], DUE[:-1])
