"""Reading and writing configuration durations: .NET TimeSpan text or a number of seconds.

The Tracon reliability guide's examples come from a .NET product, so operators paste values like
`"00:00:30"` or `"1.02:03:04.5"`, while environment variables and quick edits are easier as
seconds; both forms parse to a `timedelta`, and messages quote durations back as TimeSpan text.
"""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal, InvalidOperation

MAX_TIMER = timedelta(milliseconds=2**32 - 2)
"""The longest interval a timer may have (about 49.7 days).

It is the .NET timer limit behind the reliability guide's "1 ms to about 49.7 days" range for
`RunReconciliation.HeartbeatInterval` and `ScanInterval`; keeping to it also keeps every interval
inside what a 32-bit millisecond counter (and Redis `PX`) accepts.
"""

_TIMESPAN = re.compile(
    r"^(?P<sign>-)?(?:(?P<days>\d+)\.)?"
    r"(?P<hours>\d{1,2}):(?P<minutes>\d{1,2}):(?P<seconds>\d{1,2})"
    r"(?:\.(?P<fraction>\d{1,7}))?$"
)
_SECONDS = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")
_FORMS = '"hh:mm:ss", "hh:mm:ss.fff", "d.hh:mm:ss.fff" or a number of seconds'


def parse_duration(value: str | int | float | timedelta) -> timedelta:
    """Read a duration in any form the configuration accepts.

    Negative values parse: whether they are allowed is the caller's rule (the
    `AgentGraph` limits give them a meaning, most other settings reject them).
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a duration ({_FORMS}), got {value!r}")
    if isinstance(value, str):
        return _parse_text(value.strip())
    return _from_seconds(Decimal(repr(value)) if isinstance(value, float) else Decimal(value))


def format_duration(duration: timedelta) -> str:
    """Write a duration the way the configuration file does, so messages quote it back."""
    sign = "-" if duration < timedelta(0) else ""
    micros = abs(duration) // timedelta(microseconds=1)
    seconds, micros = divmod(micros, 1_000_000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    text = f"{hours:02d}:{minutes:02d}:{seconds:02d}{_fraction(micros)}"
    return f"{sign}{days}.{text}" if days else f"{sign}{text}"


def _fraction(micros: int) -> str:
    if micros == 0:
        return ""
    return f".{micros // 1000:03d}" if micros % 1000 == 0 else f".{micros:06d}"


def _parse_text(text: str) -> timedelta:
    if _SECONDS.match(text):
        return _from_seconds(Decimal(text))
    match = _TIMESPAN.match(text)
    if match is None:
        raise ValueError(f"expected a duration ({_FORMS}), got {text!r}")
    return _from_timespan(match)


def _from_timespan(match: re.Match[str]) -> timedelta:
    hours, minutes, seconds = (int(match[name]) for name in ("hours", "minutes", "seconds"))
    if hours > 23 or minutes > 59 or seconds > 59:
        raise ValueError(
            f"hours must be 0-23 and minutes and seconds 0-59 in {match.string!r}; "
            'write longer spans as "d.hh:mm:ss"'
        )
    total = Decimal(int(match["days"] or 0) * 86_400 + hours * 3_600 + minutes * 60 + seconds)
    total += Decimal(f"0.{match['fraction'] or 0}")
    return _from_seconds(-total if match["sign"] else total)


def _from_seconds(seconds: Decimal) -> timedelta:
    """Round to the microsecond, the finest step a `timedelta` holds."""
    try:
        return timedelta(microseconds=int((seconds * 1_000_000).to_integral_value()))
    except (InvalidOperation, OverflowError, ValueError):
        raise ValueError(f"duration is not finite or out of range: {seconds} seconds") from None
