"""Five-field cron expressions and their slots in a time zone, DST-correct.

A small parser of its own rather than `croniter`: the rules at a DST change are the point of
a schedule that fires exactly once per slot, and here they are ours, written down and tested
(a local time that does not exist that day is skipped; a local time that happens twice fires
once, at its first occurrence), with no dependency whose behaviour at those edges has changed
between releases. The grammar is the classic one: `minute hour day-of-month month
day-of-week`, each field `*`, a value, a range `a-b`, a step `*/n`, `a-b/n` or `a/n`, or a
comma-separated list of those; months and weekdays also by name (`JAN`, `MON`); weekday 0 and 7
are Sunday; when both day fields are restricted a day matches either (Vixie cron's rule).
`@hourly`, `@daily` (`@midnight`), `@weekly`, `@monthly` and `@yearly` (`@annually`) stand for
their usual expressions.

Every time in and out is naive UTC, as the database holds it; the zone only decides which
instants the local wall times are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
WEEKDAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")

SEARCH_DAYS = 366 * 28 + 7
"""How far a search for the next (or previous) slot looks: one whole cycle of leap years and
weekdays, so an expression that matches some day (Feb 29 on a Monday) is always found, and one
that never does (Feb 30) is known never to fire."""

DST_MARGIN = timedelta(hours=3)
"""Wall-time slack when a search starts inside a day: more than any UTC offset changes at once."""


class InvalidCron(ValueError):
    """The expression breaks a rule; the message says which."""


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    names_from: int = 0


_FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day of month", 1, 31),
    _Field("month", 1, 12, MONTHS, 1),
    _Field("day of week", 0, 7, WEEKDAYS, 0),
)


@dataclass(frozen=True)
class Cron:
    """A parsed expression: the values each field allows."""

    text: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_restricted: bool
    weekdays_restricted: bool

    def matches_day(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        by_date = day.day in self.days
        by_weekday = day.isoweekday() % 7 in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return by_date or by_weekday
        return by_date and by_weekday

    def next_after(self, after: datetime, zone: ZoneInfo) -> datetime | None:
        """The first slot strictly after `after` (naive UTC); None when it never fires."""
        start = _local(after, zone) - DST_MARGIN
        for wall in self._walls(start, forward=True):
            instant = _instant(wall, zone)
            if instant is not None and instant > after:
                return instant
        return None

    def previous_at_or_before(self, until: datetime, zone: ZoneInfo) -> datetime | None:
        """The last slot at or before `until` (naive UTC); None when none in the search."""
        start = _local(until, zone) + DST_MARGIN
        for wall in self._walls(start, forward=False):
            instant = _instant(wall, zone)
            if instant is not None and instant <= until:
                return instant
        return None

    def _walls(self, start: datetime, *, forward: bool) -> Iterator[datetime]:
        """The local wall times the expression names, from `start` on (or back), in order."""
        step = timedelta(days=1 if forward else -1)
        hours = self.hours if forward else tuple(reversed(self.hours))
        minutes = self.minutes if forward else tuple(reversed(self.minutes))
        day = start.date()
        for _ in range(SEARCH_DAYS):
            if self.matches_day(day):
                for hour in hours:
                    for minute in minutes:
                        wall = datetime.combine(day, time(hour, minute))
                        if (wall >= start) if forward else (wall <= start):
                            yield wall
            day += step


def _local(instant: datetime, zone: ZoneInfo) -> datetime:
    """The naive UTC `instant` as a wall time in `zone`."""
    return instant.replace(tzinfo=UTC).astimezone(zone).replace(tzinfo=None)


def _instant(wall: datetime, zone: ZoneInfo) -> datetime | None:
    """The naive UTC instant of a local wall time: its first occurrence when the clocks go
    back (it fires once), None when the clocks jumped over it (it is skipped)."""
    aware = wall.replace(tzinfo=zone, fold=0)
    utc = aware.astimezone(UTC)
    if utc.astimezone(zone).replace(tzinfo=None) != wall:
        return None
    return utc.replace(tzinfo=None)


def parse_cron(text: str) -> Cron:
    """Parse a five-field expression (or a macro); `InvalidCron` naming the broken rule."""
    if not isinstance(text, str):
        raise InvalidCron("must be a string of five fields")
    expanded = MACROS.get(text.strip().lower(), text)
    parts = expanded.split()
    if len(parts) != 5:
        raise InvalidCron(
            f"must have five fields (minute hour day-of-month month day-of-week), got {len(parts)}"
        )
    values = [_values(part, spec) for part, spec in zip(parts, _FIELDS, strict=True)]
    weekdays = frozenset(0 if day == 7 else day for day in values[4])
    cron = Cron(
        text=" ".join(text.split()),
        minutes=tuple(sorted(values[0])),
        hours=tuple(sorted(values[1])),
        days=frozenset(values[2]),
        months=frozenset(values[3]),
        weekdays=weekdays,
        days_restricted=not parts[2].startswith("*"),
        weekdays_restricted=not parts[4].startswith("*"),
    )
    if not any(_possible(cron, month) for month in cron.months):
        raise InvalidCron("never fires: no month has that day")
    return cron


def _possible(cron: Cron, month: int) -> bool:
    """Whether some day of `month` (in a leap year) can match the day fields: a restricted
    weekday occurs in every month, whichever rule joins the two fields."""
    if cron.weekdays_restricted:
        return True
    longest = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)[month - 1]
    return any(day <= longest for day in cron.days)


def _values(part: str, spec: _Field) -> set[int]:
    values: set[int] = set()
    for item in part.split(","):
        if not item:
            raise InvalidCron(f"{spec.name}: an empty item in {part!r}")
        values |= _item(item, spec)
    return values


def _item(item: str, spec: _Field) -> set[int]:
    """One item of a list: `*`, `v`, `a-b`, each with an optional `/step`."""
    body, _, step_text = item.partition("/")
    step = 1
    if step_text:
        step = _number(step_text, spec, "step")
        if step < 1:
            raise InvalidCron(f"{spec.name}: a step must be at least 1 (got {item!r})")
    if body == "*":
        low, high = spec.low, spec.high
    elif "-" in body:
        first, _, last = body.partition("-")
        low, high = _value(first, spec), _value(last, spec)
        if low > high:
            raise InvalidCron(f"{spec.name}: a range must go upwards (got {item!r})")
    else:
        low = _value(body, spec)
        high = spec.high if step_text else low
    return set(range(low, high + 1, step))


def _value(text: str, spec: _Field) -> int:
    upper = text.upper()
    if upper in spec.names:
        return spec.names.index(upper) + spec.names_from
    value = _number(text, spec, "value")
    if not spec.low <= value <= spec.high:
        raise InvalidCron(f"{spec.name}: {value} is not from {spec.low} to {spec.high}")
    return value


def _number(text: str, spec: _Field, what: str) -> int:
    if not text.isdigit():
        raise InvalidCron(f"{spec.name}: {what} {text!r} is not a number")
    return int(text)
