"""The operator commands: tenants and API keys, runs, circuits, idempotency records,
approvals and draining the local web node. They read and write through the core's stores,
never the web."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracon_jobs.cli.context import CommandError, load_runtime
from tracon_jobs.drain_file import clear_web_drain, drain_file, start_web_drain
from tracon_jobs.numbers import cost_text, json_text
from tracon_jobs.resilience.views import circuits_view

if TYPE_CHECKING:
    from tracon_jobs.db.models import Approval, Run
    from tracon_jobs.runs.retention import OwnRetention
    from tracon_jobs.runs.store import Event
    from tracon_jobs.runtime import Runtime


def _tenant(runtime: Runtime, name_or_id: str) -> str:
    tenant_id: str | None = runtime.tenants.find_tenant(name_or_id)
    if tenant_id is None:
        raise CommandError(f"no tenant '{name_or_id}'")
    return tenant_id


def cmd_drain(args: argparse.Namespace, rest: list[str]) -> int:
    if args.off:
        path = drain_file()
        was_draining = path.exists()
        clear_web_drain()
        state = "drain ended" if was_draining else "not draining"
        print(f"{state}: this node accepts new runs (flag {path} removed)")
        return 0
    path = start_web_drain()
    print(
        f"draining: new runs on this node get 503 until it stops or 'tracon-jobs drain --off' "
        f"(flag {path})"
    )
    return 0


def cmd_circuits(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    views = circuits_view(
        runtime.breaker, runtime.slots, runtime.settings.providers, runtime.rate_limits
    )
    print(f"{'provider':<20} {'state':<10} {'failures':>8} {'retry after':>12} {'slots':>12}")
    for view in views:
        retry = f"{view['retryAfter']:.1f}s" if view["retryAfter"] else "-"
        slots = view["slots"]
        used = f"{slots['inUse']}/{slots['limit']}+{slots['waiting']}" if slots["limit"] else "-"
        print(
            f"{view['provider']:<20} {view['state']:<10} {view['consecutiveFailures']:>8} "
            f"{retry:>12} {used:>12}"
        )
        for rate in view["rateLimits"]:
            print(f"  rate {rate_line(rate)}")
    return 0


def rate_line(rate: dict[str, Any]) -> str:
    """One limited scope's window: `openai/gpt-4o requests 12/60 tokens 3400/200000`."""
    parts = [rate["scope"]]
    if rate["requestsPerMinute"] is not None:
        parts.append(f"requests {rate['requests']}/{rate['requestsPerMinute']}")
    if rate["tokensPerMinute"] is not None:
        parts.append(f"tokens {rate['tokens']}/{rate['tokensPerMinute']}")
    if rate["blockedFor"]:
        parts.append(f"held by the provider for {rate['blockedFor']:.1f}s")
    return " ".join(parts) + " a minute"


def cmd_tenants_create(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    if runtime.tenants.find_tenant(args.name):
        raise CommandError(f"tenant '{args.name}' already exists; use 'keys create'")
    tenant_id = runtime.tenants.create_tenant(args.name)
    issued = runtime.tenants.issue_key(tenant_id, label="initial")
    print(f"tenant: {args.name} ({tenant_id})\napi key (shown once): {issued.secret}")
    return 0


def positive_int(raw: str) -> int:
    """A limit: a whole number of at least 1."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {raw})")
    return value


def weight_value(raw: str) -> int:
    """A tenant's weight: a whole number from 1 to 100."""
    value = positive_int(raw)
    if value > MAX_WEIGHT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WEIGHT} (got {raw})")
    return value


MAX_WEIGHT = 100


def cost_limit(raw: str) -> Decimal | None:
    """`--cost-limit`: a non-negative amount, or `none` for no quota."""
    if raw.strip().lower() in ("none", "null"):
        return None
    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an amount: {raw!r}") from None
    if not value.is_finite() or value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {raw})")
    return value


def cmd_tenants_quota(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    quotas = runtime.quotas
    limit_given = "cost_limit" in vars(args)  # absent unless given: `none` is None
    changes = args.period is not None or limit_given
    if args.clear and changes:
        raise CommandError("--clear takes no --period or --cost-limit")
    if args.clear:
        cleared = quotas.clear_quota(tenant_id)
        print(
            f"tenant '{args.tenant}': " + ("own quota removed" if cleared else "had no own quota")
        )
    elif changes:
        current = quotas.quota_of(tenant_id)
        limit = args.cost_limit if limit_given else current.limit
        quotas.set_quota(tenant_id, args.period or current.period, limit)
    usage = quotas.usage(tenant_id)
    source = "own" if quotas.has_own(tenant_id) else "default"
    currency = runtime.settings.pricing.currency
    limit = usage.quota.limit
    limit_text = "none" if limit is None else cost_text(limit, currency)
    left = usage.left
    print(
        f"tenant '{args.tenant}' quota ({source}): {limit_text} per {usage.quota.period}; "
        f"used {cost_text(usage.used, currency)}"
        + ("" if left is None else f", left {cost_text(left, currency)}")
        + f"; resets at {usage.window.end:%Y-%m-%dT%H:%M:%SZ}"
    )
    return 0


def cmd_tenants_concurrency(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    tenants = runtime.tenants
    if args.clear and args.limit is not None:
        raise CommandError("--clear takes no limit")
    if args.clear or args.limit is not None:
        tenants.set_max_concurrent_runs(tenant_id, args.limit)
    own = tenants.max_concurrent_runs(tenant_id)
    default = runtime.settings.tenants.max_concurrent_runs
    limit = own if own is not None else default
    source = "own" if own is not None else "Tenants.MaxConcurrentRuns"
    shown = "no limit" if limit is None else f"{limit} runs at once"
    print(f"tenant '{args.tenant}': {shown} ({source})")
    return 0


def cmd_tenants_weight(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    tenants = runtime.tenants
    if args.clear and args.weight is not None:
        raise CommandError("--clear takes no weight")
    if args.clear or args.weight is not None:
        tenants.set_weight(tenant_id, args.weight)
        # the lines read weights from Redis: the change counts now, not at the next
        # registration of a worker
        runtime.fair_store.register("", 0, {tenant_id: tenants.weight(tenant_id)})
    weight = tenants.weight(tenant_id)
    print(f"tenant '{args.tenant}': weight {weight} (share of fair dispatch; default 1)")
    return 0


NEVER = ("never", "forever")
"""The words `tenants retention` takes for a tenant whose runs are kept forever."""


def retention_value(raw: str) -> OwnRetention:
    """`tenants retention`'s duration: at least a second, or `never`."""
    from tracon_jobs.runs.retention import OwnRetention
    from tracon_jobs.settings.durations import parse_duration

    if raw.strip().lower() in NEVER:
        return OwnRetention(None)
    try:
        value = parse_duration(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < timedelta(seconds=1):
        raise argparse.ArgumentTypeError(f"must be at least 1 second, or `never` (got {raw})")
    return OwnRetention(value)


def cmd_tenants_retention(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.settings.durations import format_duration

    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    tenants = runtime.tenants
    if args.clear and args.duration is not None:
        raise CommandError("--clear takes no duration")
    if args.clear or args.duration is not None:
        tenants.set_retention(tenant_id, args.duration)
    own = tenants.retention(tenant_id)
    default = runtime.settings.runs.retention
    retention = own.retention if own is not None else default
    source = "own" if own is not None else "Runs.Retention"
    shown = (
        "kept forever"
        if retention is None
        else f"deleted {format_duration(retention)} after their tree's last run ended"
    )
    print(f"tenant '{args.tenant}': ended runs {shown} ({source})")
    if args.duration is not None and default is None and retention is not None:
        print(
            "note: beat schedules tracon.runs.retention as it starts: restart beat if it "
            "started while no retention was set"
        )
    return 0


def cmd_keys_create(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    print(f"api key (shown once): {runtime.tenants.issue_key(tenant_id).secret}")
    return 0


KEY_HEADER = (
    f"{'KEY':<18} {'TENANT':<20} {'CREATED':<17} {'LAST USED':<17} {'REVOKED':<17} TENANT ID"
)


def cmd_keys_list(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant) if args.tenant else None
    print(KEY_HEADER)
    for key in runtime.tenants.keys(tenant_id):
        name = runtime.tenants.name_of(key.tenant_id) or "-"  # read once per tenant
        print(
            f"{key.id:<18} {name:<20} {_minute(key.created_at):<17} "
            f"{_minute(key.last_used_at):<17} {_minute(key.revoked_at):<17} {key.tenant_id}"
        )
    return 0


def cmd_keys_revoke(args: argparse.Namespace, rest: list[str]) -> int:
    key_id = args.key_id.removeprefix("tjk_").split("_", 1)[0]
    if not load_runtime().tenants.revoke(key_id):
        raise CommandError(f"no unrevoked key '{key_id}'")
    print(f"key {key_id} revoked")
    return 0


def _minute(moment: datetime | None) -> str:
    return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M}"


def run_status(raw: str) -> str:
    """A run status in any case, as the store spells it; argparse reports anything else
    (exit 2) with the statuses there are."""
    from tracon_jobs.runs.lifecycle import RunStatus

    for status in RunStatus:
        if status.value.lower() == raw.strip().lower():
            return status.value
    names = ", ".join(status.value for status in RunStatus)
    raise argparse.ArgumentTypeError(f"no run status '{raw}' (one of {names})")


RUN_HEADER = (
    f"{'id':<36}  {'status':<9}  {'agent':<16}  {'tokens':>8}  {'cost':>16}  {'created':<19}  error"
)


def _run_line(run: Run) -> str:
    tokens = (run.input_tokens or 0) + (run.output_tokens or 0)
    cost = cost_text(run.cost_amount or 0, run.cost_currency)
    return (
        f"{run.id:<36}  {run.status:<9}  {run.agent:<16}  {tokens:>8}  {cost:>16}  "
        f"{run.created_at:%Y-%m-%d %H:%M:%S}  {run.error_type or ''}"
    ).rstrip()


def cmd_runs_list(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.runs.store import RunFilter

    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    runs = runtime.runs.page(
        tenant_id, RunFilter(status=args.status), limit=args.limit, before=None
    )
    print(RUN_HEADER)
    for run in runs:
        print(_run_line(run))
    return 0


def _run(runtime: Runtime, run_id: str, tenant: str | None) -> Run:
    """The run, or a `CommandError`; with `tenant`, only one of that tenant's."""
    tenant_id = _tenant(runtime, tenant) if tenant else None
    run = runtime.runs.get(run_id, tenant_id)
    if run is None:
        raise CommandError(f"no run '{run_id}'" + (f" of tenant '{tenant}'" if tenant else ""))
    return run


def cmd_workflows_list(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    registry = runtime.workflow_registry
    print(f"{'WORKFLOW':<28} DESCRIPTION")
    for name in registry.names():
        spec = registry.get(name)
        print(f"{name:<28} {spec.description if spec else ''}")
    return 0


def cmd_workflows_runs(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.runs.store import RunFilter

    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    filters = RunFilter(status=args.status, kind="workflow")
    print(RUN_HEADER)
    for run in runtime.runs.page(tenant_id, filters, limit=args.limit, before=None):
        print(_run_line(run))
    return 0


def cmd_workflows_resume(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.workflows.store import ResumeConflict

    runtime = load_runtime()
    run = _run(runtime, args.run_id, args.tenant)
    if run.kind != "workflow":
        raise CommandError(f"run '{args.run_id}' is not a workflow run")
    try:
        resumed = runtime.workflow_resumes.resume(run, resumable=True)  # bound to no connection
    except ResumeConflict as conflict:
        raise CommandError(str(conflict)) from None
    print(resumed.id)
    return 0


def cmd_workflows_respond(args: argparse.Namespace, rest: list[str]) -> int:
    """What `POST /api/workflows/runs/{id}/respond` does under `Prefer: respond-async`: the
    same run lookup, the same store call and its conflicts, a continuation a job owns."""
    from tracon_jobs.workflows.store import RequestConflict

    answer = _answer(args)
    runtime = load_runtime()
    run = _run(runtime, args.run_id, args.tenant)
    if run.kind != "workflow":
        raise CommandError(f"run '{args.run_id}' is not a workflow run")
    try:
        continuation = runtime.workflow_resumes.respond(run, answer, resumable=True)
    except RequestConflict as conflict:
        status = "" if run.status == "Waiting" else f" (it is {run.status})"
        raise CommandError(f"{conflict}{status}") from None
    print(continuation.id)
    return 0


EVENT_NAME_MAX = 200
"""The longest event name (`ctx.wait_for` and the route refuse a longer one)."""


def cmd_workflows_event(args: argparse.Namespace, rest: list[str]) -> int:
    """What `POST /api/workflows/runs/{id}/events/{name}` does: the same run lookup, the same
    delivery and its conflicts; prints the outcome and its run (`delivered`: the run that
    continues the chain; `kept`: the run it is kept for)."""
    from tracon_jobs.workflows.store import RequestConflict

    if not 1 <= len(args.name) <= EVENT_NAME_MAX:
        raise CommandError(f"name: 1 to {EVENT_NAME_MAX} characters (got {len(args.name)})")
    payload = None if args.payload is None and args.file is None else _json_of(args, "payload")
    runtime = load_runtime()
    run = _run(runtime, args.run_id, args.tenant)
    if run.kind != "workflow":
        raise CommandError(f"run '{args.run_id}' is not a workflow run")
    try:
        delivered = runtime.workflow_resumes.deliver(run, args.name, payload)
    except RequestConflict as conflict:
        raise CommandError(str(conflict)) from None
    print(f"{'kept' if delivered.kept else 'delivered'} {delivered.run.id}")
    return 0


def _answer(args: argparse.Namespace) -> Any:
    """The answer: the JSON of `--answer`, or of the file `--file` names (`-`: stdin)."""
    return _json_of(args, "answer")


def _json_of(args: argparse.Namespace, option: str) -> Any:
    """The JSON of `--OPTION`, or of the file `--file` names (`-`: stdin)."""
    if getattr(args, option) is not None:
        text, source = getattr(args, option), f"--{option}"
    elif args.file == "-":
        text, source = sys.stdin.read(), "--file - (stdin)"
    else:
        try:
            with open(args.file, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise CommandError(f"--file: cannot read {args.file}: {exc.strerror}") from None
        source = f"--file {args.file}"
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CommandError(
            f"{source} is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            f"a text {option} is quoted: '\"yes\"'"
        ) from None


def cmd_runs_show(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.runs.ledger import Ledger
    from tracon_jobs.runs.views import run_json, tool_call_json

    runtime = load_runtime()
    run = _run(runtime, args.run_id, args.tenant)
    body = run_json(run)
    body["events"] = [event.as_json() for event in runtime.runs.events(run.id)]
    body["toolCalls"] = [tool_call_json(call) for call in Ledger(runtime.runs).calls(run.id)]
    print(json_text(body))
    return 0


def cmd_runs_export(args: argparse.Namespace, rest: list[str]) -> int:
    """The run's group (its tree, and the trees of its chain) as JSON lines, to stdout or a
    file (written whole, then renamed into place)."""
    from tracon_jobs.runs.export import GroupTooLarge, group_of_run, write_lines

    runtime = load_runtime()
    run = _run(runtime, args.run_id, args.tenant)
    try:
        group = group_of_run(runtime.db, run.id)
    except GroupTooLarge as exc:
        raise CommandError(f"run '{run.id}': {exc}") from None
    if group is None:
        raise CommandError(f"no run '{args.run_id}'")
    if args.output == "-":
        write_lines(runtime.db, group, sys.stdout)
        return 0
    path = Path(args.output)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as out:
            lines = write_lines(runtime.db, group, out)
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise CommandError(f"--output: cannot write {path}: {exc.strerror or exc}") from None
    trees = len(group.roots)
    print(
        f"wrote {lines} lines to {path}: {len(group.members)} runs in "
        f"{trees} tree{'s' if trees != 1 else ''}"
    )
    return 0


TAIL_WAIT_SECONDS = 15.0
"""How long one wait on the event feed lasts before SQL is read again anyway."""


def cmd_runs_tail(args: argparse.Namespace, rest: list[str]) -> int:
    """Follow the run's events until its terminal event: SQL is the source of truth, the
    feed only wakes us; its position is taken before each read, so nothing is missed."""
    from tracon_jobs.runs.lifecycle import TERMINAL_EVENTS

    runtime = load_runtime()
    run = _run(runtime, args.run_id, args.tenant)
    last = 0
    position = runtime.feed.position(run.id)
    while True:
        events = runtime.runs.events(run.id, last)
        for event in events:
            print(_event_line(event), flush=True)
            last = event.seq
            if event.type in TERMINAL_EVENTS:
                return 0
        if events:
            position = runtime.feed.position(run.id)
            continue
        woke = runtime.feed.wait(run.id, position, TAIL_WAIT_SECONDS)
        if woke is not None:
            position = woke


def _event_line(event: Event) -> str:
    body = event.as_json()
    data = json_text(body.get("data") or {}, indent=None)
    return f"{event.seq:>4}  {body['at']}  {event.type:<26}  {data}"


def cmd_idempotency_list(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.idempotency import IdempotencyStore

    runtime = load_runtime()
    tenant_id = None
    if args.tenant:
        tenant_id = _tenant(runtime, args.tenant)
    records = IdempotencyStore(runtime.db).list_in_progress(tenant_id, limit=args.limit)
    if not records:
        print("no InProgress idempotency records")
    for record in records:
        print(
            f"{record.created_at:%Y-%m-%d %H:%M:%S}  {record.state}  tenant={record.tenant_id}"
            f"  run={record.run_id or '-'}  {record.method} {record.path}  key={record.key}"
        )
    return 0


def cmd_idempotency_release(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.idempotency import IdempotencyStore

    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    if not IdempotencyStore(runtime.db).release(tenant_id, args.key):
        raise CommandError(f"no InProgress record for key '{args.key}' of tenant '{args.tenant}'")
    print(f"released key '{args.key}' of tenant '{args.tenant}': a retry will execute")
    return 0


APPROVAL_HEADER = (
    f"{'id':<36}  {'status':<8}  {'tool':<20}  {'run':<36}  {'requested':<19}  expires"
)


def _approval_line(approval: Approval) -> str:
    return (
        f"{approval.id:<36}  {approval.status:<8}  {approval.tool:<20}  {approval.run_id:<36}"
        f"  {approval.requested_at:%Y-%m-%d %H:%M:%S}  {approval.expires_at:%Y-%m-%d %H:%M:%S}"
    )


def _approval_status(raw: str | None) -> str | None:
    from tracon_jobs.runs.approvals import ApprovalStatus

    if raw is None:
        return None
    for status in ApprovalStatus:
        if status.value.lower() == raw.lower():
            return status.value
    names = ", ".join(status.value for status in ApprovalStatus)
    raise CommandError(f"no approval status '{raw}' (one of {names})")


def cmd_approvals_list(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant) if args.tenant else None
    approvals = runtime.approval_store.page(
        tenant_id,
        status=_approval_status(args.status),
        run_id=args.run,
        limit=args.limit,
        before=None,
    )
    print(APPROVAL_HEADER)
    for approval in approvals:
        print(_approval_line(approval))
    return 0


def cmd_approvals_decide(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.runs.approvals import ApprovalConflict, ApprovalNotFound
    from tracon_jobs.runs.views import approval_json

    runtime = load_runtime()
    tenant_id = _tenant(runtime, args.tenant)
    try:
        decided = runtime.approvals.decide(
            tenant_id, args.approval_id, args.approve, args.comment, decided_by="cli"
        )
    except ApprovalNotFound:
        raise CommandError(f"no approval '{args.approval_id}' of tenant '{args.tenant}'") from None
    except ApprovalConflict as conflict:
        raise CommandError(f"approval '{args.approval_id}' cannot be decided: {conflict}") from None
    print(json_text(approval_json(decided.approval)))
    return 0
