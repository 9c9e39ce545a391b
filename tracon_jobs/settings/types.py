"""The value types settings are declared with (durations, counts, ranges) and the rules they
enforce, each check next to the words the settings reference shows for it, so the two agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BeforeValidator, GetCoreSchemaHandler, PlainSerializer
from pydantic_core import CoreSchema, PydanticCustomError

from tracon_jobs.settings.durations import MAX_TIMER, format_duration, parse_duration

RULE_ERROR_TYPE = "tracon_rule"
"""The pydantic error type of a broken rule; its message is the rule's own wording."""

Number = TypeVar("Number", int, float, Decimal)

_TIMER_RANGE = "must be between 1 ms and about 49.7 days"


@dataclass(frozen=True)
class Rule:
    """A rule as the settings reference words it.

    Alone, as `Annotated` metadata, it checks nothing: it documents what a model validator
    checks across fields, or what a value means (zero is no limit). `Check` also enforces it.
    """

    text: str


@dataclass(frozen=True)
class Check(Rule):
    """A rule that pydantic enforces on the parsed value, exactly as an `AfterValidator`."""

    check: Callable[[Any], Any]

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return AfterValidator(self.check).__get_pydantic_core_schema__(source, handler)


def broken_rule(rule: str, setting: str | None = None) -> PydanticCustomError:
    """A rule violation that survives pydantic's wrapping with its wording intact.

    `setting` names the field when the check runs on the whole model (a cross-field rule),
    where pydantic's location would stop at the section.
    """
    context = {"rule": rule} if setting is None else {"rule": rule, "setting": setting}
    return PydanticCustomError(RULE_ERROR_TYPE, "{rule}", context)


def shown(value: object) -> str:
    """A value as a message quotes it: durations as the file writes them."""
    return format_duration(value) if isinstance(value, timedelta) else str(value)


def _is_finite(value: float | Decimal) -> bool:
    """Pydantic lets `inf` through a float field, and `inf` is not a usable timeout."""
    if isinstance(value, int):
        return True
    return value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)


def at_least(minimum: int) -> Check:
    def check(value: Number) -> Number:
        if not (value >= minimum and _is_finite(value)):
            raise broken_rule(f"must be at least {minimum} (got {value})")
        return value

    return Check(f"at least {minimum}", check)


def between(minimum: int, maximum: int) -> Check:
    def check(value: Number) -> Number:
        if not minimum <= value <= maximum:
            raise broken_rule(f"must be between {minimum} and {maximum} (got {value})")
        return value

    return Check(f"{minimum} to {maximum}", check)


def _positive(value: Number) -> Number:
    if not (value > 0 and _is_finite(value)):
        raise broken_rule(f"must be positive (got {value})")
    return value


def _positive_duration(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise broken_rule(f"must be positive (got {format_duration(value)})")
    return value


def _timer_duration(value: timedelta) -> timedelta:
    """The reliability guide's RunReconciliation table: HeartbeatInterval and ScanInterval run
    from 1 ms to about 49.7 days, the range a .NET (and a millisecond) timer takes."""
    if not timedelta(milliseconds=1) <= value <= MAX_TIMER:
        raise broken_rule(f"{_TIMER_RANGE} (got {format_duration(value)})")
    return value


def _at_most_max_timer(value: timedelta) -> timedelta:
    if value > MAX_TIMER:
        raise broken_rule(f"must be at most about 49.7 days (got {format_duration(value)})")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise broken_rule("must not be empty")
    return value


def _whole_number(value: object) -> object:
    """JSON `true` would otherwise count as 1; a boolean where a count belongs is a typo."""
    if isinstance(value, bool):
        raise broken_rule(f"must be a whole number (got {json.dumps(value)})")
    return value


class EnvText(str):
    """Text that came from an environment variable, where every value is a string: the one
    place a boolean may be written `"true"` or `"false"` (any case)."""


def _flag(value: object) -> bool:
    """Only JSON `true`/`false` (or their text from an environment variable): `"yes"`, `0` or
    `"off"` in a file are typos more often than intent, and pydantic would guess."""
    if isinstance(value, bool):
        return value
    if isinstance(value, EnvText) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    shown = json.dumps(str(value) if isinstance(value, str) else value, default=str)
    raise broken_rule(f"must be true or false (got {shown})")


def _duration(value: Any) -> timedelta:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise broken_rule(str(exc)) from None


def _optional_duration(value: Any) -> timedelta | None:
    return None if value is None else _duration(value)


Flag = Annotated[bool, BeforeValidator(_flag)]
"""A boolean: JSON `true` or `false`, or `true`/`false` (any case) from an environment variable."""
WholeNumber = Annotated[int, BeforeValidator(_whole_number)]
"""An integer that refuses JSON booleans."""
AtLeastZero = Annotated[WholeNumber, at_least(0)]
AtLeastOne = Annotated[WholeNumber, at_least(1)]
PositiveInt = Annotated[WholeNumber, Check("positive", _positive)]
PositiveFloat = Annotated[float, Check("positive", _positive)]
NonEmptyStr = Annotated[str, Check("not empty", _not_blank)]
NonNegativeDecimal = Annotated[Decimal, at_least(0)]

Duration = Annotated[
    timedelta,
    BeforeValidator(_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
"""A duration in any form `parse_duration` reads; written back as "hh:mm:ss" in JSON."""
PositiveDuration = Annotated[Duration, Check("positive", _positive_duration)]
TimerDuration = Annotated[Duration, Check("1 ms to about 49.7 days", _timer_duration)]
LeaseDuration = Annotated[
    Duration,
    Check("positive", _positive_duration),
    Check("at most about 49.7 days", _at_most_max_timer),
]
OptionalDuration = Annotated[
    timedelta | None,
    BeforeValidator(_optional_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json-unless-none"),
]
