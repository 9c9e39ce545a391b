"""`tracon-jobs schedules ...`: a tenant's schedules and the slots they recorded, through the
same store and the same rules as `/api/schedules` (`schedules.definition`). A schedule is
named by its id or its name."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tracon_jobs.cli.context import CommandError, load_runtime
from tracon_jobs.db.models import Schedule
from tracon_jobs.numbers import json_text
from tracon_jobs.schedules.definition import InvalidSchedule, checked
from tracon_jobs.schedules.store import (
    ScheduleExists,
    ScheduleNotFound,
    ScheduleStore,
    fire_json,
    schedule_json,
)

if TYPE_CHECKING:
    from tracon_jobs.runtime import Runtime

OPTIONS = {"catchUp": "--catch-up", "input": "--input", "target": "--agent/--workflow"}
"""The option each body field is given with, where its name differs."""


def _opened(args: argparse.Namespace) -> tuple[Runtime, ScheduleStore, str]:
    runtime = load_runtime()
    tenant_id = runtime.tenants.find_tenant(args.tenant)
    if tenant_id is None:
        raise CommandError(f"no tenant '{args.tenant}'")
    return runtime, runtime.schedules, tenant_id


def _found(store: ScheduleStore, tenant_id: str, args: argparse.Namespace) -> Schedule:
    try:
        return store.find(tenant_id, args.schedule)
    except ScheduleNotFound:
        raise CommandError(f"no schedule '{args.schedule}' of tenant '{args.tenant}'") from None


def _option(field: str) -> str:
    top = field.split(".")[0]
    return OPTIONS.get(top, f"--{top}")


def _body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"name": args.name}
    for field in ("cron", "timezone", "interval", "overlap"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    if args.catch_up is not None:
        body["catchUp"] = args.catch_up
    if (args.agent is None) == (args.workflow is None):
        raise CommandError("give exactly one of --agent and --workflow")
    body["target"] = {"agent": args.agent} if args.agent else {"workflow": args.workflow}
    if args.message is not None:
        body["input"] = {"message": args.message}
    if args.input is not None:
        try:
            body["input"] = json.loads(args.input)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--input: not JSON: {exc}") from None
    if args.paused:
        body["paused"] = True
    return body


def cmd_schedules_create(args: argparse.Namespace, rest: list[str]) -> int:
    runtime, store, tenant_id = _opened(args)
    try:
        spec = checked(_body(args), runtime.schedule_targets)
        schedule = store.create(tenant_id, spec)
    except InvalidSchedule as invalid:
        raise CommandError(f"{_option(invalid.field)}: {invalid.rule}") from None
    except ScheduleExists as exists:
        raise CommandError(str(exists)) from None
    print(f"schedule {schedule.id} ({schedule.name}): next slot {_time(schedule.next_fire_at)}")
    return 0


SCHEDULE_HEADER = f"{'id':<36}  {'name':<20}  {'when':<24}  {'target':<24}  {'state':<7}  next slot"


def _when(schedule: Schedule) -> str:
    if schedule.cron is not None:
        return f"{schedule.cron} {schedule.timezone}"
    return f"every {(schedule.interval_ms or 0) / 1000:g}s"


def _time(at: datetime | None) -> str:
    return "-" if at is None else at.isoformat(sep=" ", timespec="seconds")


def schedule_line(schedule: Schedule) -> str:
    state = "paused" if schedule.paused else "active"
    target = f"{schedule.target_kind}:{schedule.target_name}"
    return (
        f"{schedule.id:<36}  {schedule.name[:20]:<20}  {_when(schedule)[:24]:<24}  "
        f"{target[:24]:<24}  {state:<7}  {_time(schedule.next_fire_at)}"
    )


def cmd_schedules_list(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    print(SCHEDULE_HEADER)
    for schedule in store.page(tenant_id, args.limit):
        print(schedule_line(schedule))
    return 0


def cmd_schedules_show(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    print(json_text(schedule_json(_found(store, tenant_id, args))))
    return 0


def cmd_schedules_pause(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    schedule = store.pause(tenant_id, _found(store, tenant_id, args).id)
    print(f"schedule {schedule.id} paused")
    return 0


def cmd_schedules_resume(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    schedule = store.resume(tenant_id, _found(store, tenant_id, args).id)
    print(f"schedule {schedule.id} active: next slot {_time(schedule.next_fire_at)}")
    return 0


def cmd_schedules_delete(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    schedule = _found(store, tenant_id, args)
    store.delete(tenant_id, schedule.id)
    print(f"schedule {schedule.id} deleted with its fires; its runs stay")
    return 0


FIRE_HEADER = f"{'slot':<19}  {'outcome':<8}  {'run':<36}  {'fired at':<19}  detail"


def cmd_schedules_fires(args: argparse.Namespace, rest: list[str]) -> int:
    _, store, tenant_id = _opened(args)
    schedule = _found(store, tenant_id, args)
    print(FIRE_HEADER)
    for fire in store.fires(tenant_id, schedule.id, args.limit):
        view = fire_json(fire)
        print(
            f"{_time(fire.slot_at):<19}  {fire.outcome:<8}  {view['runId'] or '-':<36}  "
            f"{_time(fire.fired_at):<19}  {fire.detail or ''}"
        )
    return 0
