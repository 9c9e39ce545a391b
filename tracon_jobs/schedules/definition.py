"""What a user may ask a schedule to be, held to its rules in one place: the API's body, the
console's form and the command line all come through `checked`.

Each broken rule is an `InvalidSchedule` naming the field and the rule; one that names a
target this installation does not have (an agent not configured, a workflow not registered)
is `UnknownTarget` (the API's 422: the body is well formed, what it names is not there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from tracon_jobs.schedules.cadence import parse_interval
from tracon_jobs.schedules.cron import InvalidCron, parse_cron
from tracon_jobs.schedules.policies import CatchUp, Overlap

NAME_MAX = 100
FIELDS = ("name", "cron", "timezone", "interval", "target", "input", "overlap", "catchUp", "paused")
TARGET_KINDS = ("agent", "workflow")

E = TypeVar("E", Overlap, CatchUp)


class InvalidSchedule(ValueError):
    """A field breaks a rule (400)."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class UnknownTarget(InvalidSchedule):
    """The target names no configured agent or registered workflow (422)."""


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule as asked for, every field checked."""

    name: str
    target_kind: str
    target_name: str
    cron: str | None = None
    timezone: str = "UTC"
    interval: timedelta | None = None
    input: dict[str, Any] = field(default_factory=dict)
    overlap: Overlap = Overlap.SKIP
    catch_up: CatchUp = CatchUp.NONE
    paused: bool = False


@dataclass(frozen=True)
class ScheduleTargets:
    """What this installation can run: `agent(name)` and `workflow(name)` say whether it has it."""

    agent: Callable[[str], bool]
    workflow: Callable[[str], bool]

    def knows(self, kind: str, name: str) -> bool:
        return self.agent(name) if kind == "agent" else self.workflow(name)


def checked(body: Mapping[str, Any], targets: ScheduleTargets) -> ScheduleSpec:
    """The body's fields held to the schedule rules; `InvalidSchedule` for the first broken."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise InvalidSchedule(unknown[0], f"is not a field; the fields are {', '.join(FIELDS)}")
    name = _name(body.get("name"))
    cron, timezone, interval = _cadence(body)
    kind, target = _target(body.get("target"), targets)
    return ScheduleSpec(
        name=name,
        target_kind=kind,
        target_name=target,
        cron=cron,
        timezone=timezone,
        interval=interval,
        input=_input(body.get("input", {}), kind),
        overlap=_choice(body, "overlap", Overlap, Overlap.SKIP),
        catch_up=_choice(body, "catchUp", CatchUp, CatchUp.NONE),
        paused=_flag(body.get("paused", False)),
    )


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidSchedule("name", "is required: a string of 1 to 100 characters")
    if len(value) > NAME_MAX:
        raise InvalidSchedule("name", f"must be at most {NAME_MAX} characters")
    return value


def _cadence(body: Mapping[str, Any]) -> tuple[str | None, str, timedelta | None]:
    has_cron, has_interval = body.get("cron") is not None, body.get("interval") is not None
    if has_cron == has_interval:
        raise InvalidSchedule("cron", "give exactly one of cron and interval")
    timezone = body.get("timezone")
    if has_interval:
        if timezone is not None:
            raise InvalidSchedule("timezone", "applies to cron only; an interval has no zone")
        try:
            return None, "UTC", parse_interval(body["interval"])
        except ValueError as exc:
            raise InvalidSchedule("interval", str(exc)) from None
    try:
        cron = parse_cron(body["cron"]).text
    except InvalidCron as exc:
        raise InvalidSchedule("cron", str(exc)) from None
    return cron, zone_name(timezone if timezone is not None else "UTC"), None


def zone_name(value: Any) -> str:
    """An IANA time zone name that this host's zone database knows."""
    if not isinstance(value, str) or not value or len(value) > 64:
        raise InvalidSchedule("timezone", "must be an IANA time zone name (Europe/Paris)")
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # a folder, a file not a zone
        raise InvalidSchedule(
            "timezone", f"{value!r} is not an IANA time zone name (Europe/Paris, UTC)"
        ) from None
    return value


def _target(value: Any, targets: ScheduleTargets) -> tuple[str, str]:
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in TARGET_KINDS:
        raise InvalidSchedule("target", 'must be {"agent": name} or {"workflow": name}')
    kind, name = next(iter(value.items()))
    if not isinstance(name, str) or not name:
        raise InvalidSchedule(f"target.{kind}", "must be a non-empty string")
    if not targets.knows(kind, name):
        what = "a configured agent" if kind == "agent" else "a registered workflow"
        raise UnknownTarget(f"target.{kind}", f"must name {what} (got {name!r})")
    return kind, name


def _input(value: Any, kind: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidSchedule("input", "must be a JSON object")
    if kind == "agent":
        extra = sorted(set(value) - {"message"})
        if extra:
            raise InvalidSchedule(f"input.{extra[0]}", "an agent's input has `message` only")
        message = value.get("message")
        if not isinstance(message, str) or not message:
            raise InvalidSchedule("input.message", "an agent's input needs a non-empty message")
    return dict(value)


def _choice(body: Mapping[str, Any], name: str, kind: type[E], default: E) -> E:
    value = body.get(name)
    if value is None:
        return default
    allowed = [member.value for member in kind]
    if value not in allowed:
        raise InvalidSchedule(name, f"must be one of {', '.join(allowed)}")
    return kind(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidSchedule("paused", "must be true or false")
    return value
