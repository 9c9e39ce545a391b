"""When a schedule's slots are: the instants of a cron expression in a zone, or a fixed interval
from the schedule's anchor (its creation). Both answer the same two questions, the next slot
after an instant and the latest slots up to one, in naive UTC."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Protocol
from zoneinfo import ZoneInfo

from tracon_jobs.schedules.cron import Cron
from tracon_jobs.settings.durations import parse_duration

MIN_INTERVAL = timedelta(seconds=1)
MAX_INTERVAL = timedelta(days=366)
EPSILON = timedelta(microseconds=1)

_ISO = re.compile(
    r"^P(?:(?P<days>\d+)D)?(?:T(?:(?P<hours>\d+)H)?(?:(?P<minutes>\d+)M)?"
    r"(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?$",
    re.IGNORECASE,
)


class Cadence(Protocol):
    def next_after(self, after: datetime) -> datetime | None:
        """The first slot strictly after `after`; None when there is none."""
        ...

    def latest(self, not_before: datetime, until: datetime, limit: int) -> list[datetime]:
        """Up to `limit` of the latest slots in [`not_before`, `until`], oldest first."""
        ...


@dataclass(frozen=True)
class CronCadence:
    cron: Cron
    zone: ZoneInfo

    def next_after(self, after: datetime) -> datetime | None:
        return self.cron.next_after(after, self.zone)

    def latest(self, not_before: datetime, until: datetime, limit: int) -> list[datetime]:
        found: list[datetime] = []
        cursor = until
        while len(found) < limit:
            slot = self.cron.previous_at_or_before(cursor, self.zone)
            if slot is None or slot < not_before:
                break
            found.append(slot)
            cursor = slot - EPSILON
        return found[::-1]


@dataclass(frozen=True)
class IntervalCadence:
    """Slots at `anchor + k * interval`, k >= 1: the first one interval after creation."""

    anchor: datetime
    interval: timedelta

    def next_after(self, after: datetime) -> datetime:
        if after < self.anchor:
            return self.anchor + self.interval
        return self.anchor + ((after - self.anchor) // self.interval + 1) * self.interval

    def latest(self, not_before: datetime, until: datetime, limit: int) -> list[datetime]:
        if until < self.anchor + self.interval or limit < 1:
            return []
        last = (until - self.anchor) // self.interval
        first = max(1, last - limit + 1, -(-(not_before - self.anchor) // self.interval))
        return [self.anchor + k * self.interval for k in range(first, last + 1)]


def parse_interval(value: object) -> timedelta:
    """An interval: seconds (a number or its text), an ISO-8601 duration (`PT30S`, `P1DT2H`)
    or the configuration's `hh:mm:ss` / `d.hh:mm:ss`; from 1 s to 366 days. ValueError
    naming the rule otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a number of seconds or a duration text (PT30S, 00:00:30)")
    match = _ISO.match(value.strip()) if isinstance(value, str) else None
    if match is not None and any(match.groupdict().values()):
        interval = _iso_duration(match)
    else:
        interval = parse_duration(value)
    if not MIN_INTERVAL <= interval <= MAX_INTERVAL:
        raise ValueError("must be from 1 second to 366 days")
    return interval


def _iso_duration(match: re.Match[str]) -> timedelta:
    try:
        seconds = Decimal(match["seconds"] or 0)
    except InvalidOperation:
        raise ValueError(f"{match.string!r} is not a duration") from None
    whole = (int(match["days"] or 0) * 86_400 + int(match["hours"] or 0) * 3_600) + int(
        match["minutes"] or 0
    ) * 60
    try:
        return timedelta(microseconds=int(((whole + seconds) * 1_000_000).to_integral_value()))
    except OverflowError:
        raise ValueError("must be from 1 second to 366 days") from None
