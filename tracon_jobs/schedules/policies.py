"""What a pass does with a schedule's due slots and with its previous run: pure values and
functions of the slots, the policies and `now`.

Catch-up (the slots due when a pass comes, `plan`): a slot at most `MisfireGrace` old is on
time and fires. Older ones were missed (beat or the workers were down, the schedule's pass
was late):

- `none`: each missed slot is recorded `missed`; the next slot fires when it comes;
- `latest`: one run for the most recent missed slot (when no slot is on time), the others
  `missed`;
- `all`: every missed slot fires, at most `MaxCatchUp` (the newest), older ones `missed`.

A pass looks at no more than the latest `2 * MaxCatchUp` due slots of a schedule: the slots
of a longer outage before those are not recorded one by one.

Overlap (a slot that fires while the schedule's previous run has not ended, `Overlap`):
`skip` records the slot `skipped`; `queue` records it `queued` and starts it once the
previous run ends (one queued at a time: another slot meanwhile is `skipped`);
`cancel_previous` asks the previous run to cancel, through the cancel path of
`POST /api/runs/{id}/cancel`, and fires. The slots one pass fires for a schedule (a catch-up)
are judged together against the run before them, not against each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum


class CatchUp(StrEnum):
    NONE = "none"
    LATEST = "latest"
    ALL = "all"


class Overlap(StrEnum):
    SKIP = "skip"
    QUEUE = "queue"
    CANCEL_PREVIOUS = "cancel_previous"


class Outcome(StrEnum):
    """What became of a slot (a `schedule_fires` row)."""

    FIRED = "fired"  # its run was created
    SKIPPED = "skipped"  # the previous run had not ended (`skip`, or a slot already queued)
    QUEUED = "queued"  # waits for the previous run to end (`queue`), then `fired`
    MISSED = "missed"  # late beyond the grace, and the catch-up policy did not fire it
    FAILED = "failed"  # its target is no longer configured: no run


@dataclass(frozen=True)
class Plan:
    """The due slots of one pass, oldest first, each to fire or to record missed."""

    fire: list[datetime]
    missed: list[datetime]

    def slots(self) -> list[tuple[datetime, bool]]:
        """(slot, fires) in slot order."""
        both = [(slot, True) for slot in self.fire] + [(slot, False) for slot in self.missed]
        return sorted(both)


def window(max_catch_up: int) -> int:
    """How many of the latest due slots a pass looks at."""
    return 2 * max_catch_up


def plan(
    due: list[datetime], now: datetime, catch_up: CatchUp, grace: timedelta, max_catch_up: int
) -> Plan:
    """Which of the `due` slots (oldest first, all at or before `now`) fire."""
    on_time = [slot for slot in due if now - slot <= grace]
    late = [slot for slot in due if now - slot > grace]
    if catch_up is CatchUp.ALL:
        kept = due[-max_catch_up:] if max_catch_up > 0 else []
        return Plan(kept, due[: len(due) - len(kept)])
    if catch_up is CatchUp.LATEST and late and not on_time:
        return Plan([late[-1]], late[:-1])
    return Plan(on_time, late)
