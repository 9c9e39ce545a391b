"""The command line of `tracon-jobs`: every command, its arguments and its help, each bound to
the function that runs it. Every command and every option has a help text (a test holds it)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from tracon_jobs import __version__
from tracon_jobs.cli.dev import DEFAULT_FLOWER_PORT, DEFAULT_WEB_PORT, cmd_dev, port_number
from tracon_jobs.cli.operations import (
    cmd_approvals_decide,
    cmd_approvals_list,
    cmd_circuits,
    cmd_drain,
    cmd_idempotency_list,
    cmd_idempotency_release,
    cmd_keys_create,
    cmd_keys_list,
    cmd_keys_revoke,
    cmd_runs_export,
    cmd_runs_list,
    cmd_runs_show,
    cmd_runs_tail,
    cmd_tenants_concurrency,
    cmd_tenants_create,
    cmd_tenants_quota,
    cmd_tenants_retention,
    cmd_tenants_weight,
    cmd_workflows_event,
    cmd_workflows_list,
    cmd_workflows_respond,
    cmd_workflows_resume,
    cmd_workflows_runs,
    cost_limit,
    positive_int,
    retention_value,
    run_status,
    weight_value,
)
from tracon_jobs.cli.processes import cmd_beat, cmd_flower, cmd_migrate, cmd_web, cmd_worker
from tracon_jobs.cli.schedules import (
    cmd_schedules_create,
    cmd_schedules_delete,
    cmd_schedules_fires,
    cmd_schedules_list,
    cmd_schedules_pause,
    cmd_schedules_resume,
    cmd_schedules_show,
)
from tracon_jobs.cli.webhooks import (
    cmd_webhooks_create,
    cmd_webhooks_delete,
    cmd_webhooks_deliveries,
    cmd_webhooks_list,
    cmd_webhooks_redeliver,
    cmd_webhooks_rotate_secret,
    cmd_webhooks_show,
    cmd_webhooks_update,
    grace_seconds,
)
from tracon_jobs.webhooks.endpoints import DELIVERY_STATUSES

DESCRIPTION = (
    "The `tracon-jobs` command: one entry point for every process and operator task. "
    "Configuration: $TRACON_CONFIG, else tracon.json here, with TRACON_* overrides. The "
    "working directory is importable (first on sys.path), so ToolModules and WorkflowModules "
    "may name your own modules."
)

Handler = Callable[[argparse.Namespace, list[str]], int]
"""A command: its parsed arguments and, for a passthrough command, the rest of the line."""

Command = Callable[..., argparse.ArgumentParser]
"""Adds a command to the top level: `command(name, handler, help, passthrough=False)`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracon-jobs", description=DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(metavar="command")

    def command(
        name: str, handler: Handler | None, help_: str, passthrough: bool = False
    ) -> argparse.ArgumentParser:
        """A command; `handler` None makes a group, whose bare name prints its help (exit 2)."""
        cmd = sub.add_parser(name, help=help_, description=help_)
        cmd.set_defaults(handler=handler or _group_help(cmd), passthrough=passthrough)
        return cmd

    add_process_commands(command)
    add_tenant_commands(command)
    add_run_commands(command)
    add_idempotency_commands(command)
    add_approval_commands(command)
    add_workflow_commands(command)
    add_webhook_commands(command)
    add_schedule_commands(command)
    return parser


def add_process_commands(command: Command) -> None:
    """`dev`, `migrate`, `web`, `worker`, `beat`, `flower`, plus `drain` and `circuits`."""
    dev = command("dev", cmd_dev, "migrate, then run web, a worker, beat and Flower (Ctrl-C stops)")
    dev.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_WEB_PORT,
        help=f"port of the web API on 127.0.0.1 (default {DEFAULT_WEB_PORT})",
    )
    dev.add_argument(
        "--flower-port",
        type=port_number,
        default=DEFAULT_FLOWER_PORT,
        help=f"port of Flower on 127.0.0.1 (default {DEFAULT_FLOWER_PORT})",
    )
    command("migrate", cmd_migrate, "upgrade the database to the latest schema")
    web = command("web", cmd_web, "serve the HTTP API with gunicorn")
    web.add_argument(
        "--bind",
        default=os.environ.get("TRACON_WEB_BIND", "127.0.0.1:8000"),
        help="HOST:PORT to listen on (default $TRACON_WEB_BIND or 127.0.0.1:8000)",
    )
    web.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("TRACON_WEB_WORKERS", 2)),
        help="gunicorn worker processes (default $TRACON_WEB_WORKERS or 2)",
    )
    web.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TRACON_WEB_THREADS", 32)),
        help="threads per worker, one per open request or stream "
        "(default $TRACON_WEB_THREADS or 32)",
    )
    drain = command("drain", cmd_drain, "make the web node on this host refuse new runs (503)")
    drain.add_argument(
        "--off", action="store_true", help="end the drain: the node accepts new runs again"
    )
    command("circuits", cmd_circuits, "show each provider's circuit and concurrency slots")
    command("worker", cmd_worker, "run a Celery worker (extra args go to celery)", True)
    command("beat", cmd_beat, "run Celery beat (the periodic services)", True)
    command("flower", cmd_flower, "run Flower (extra args go to flower)", True)


def add_tenant_commands(command: Command) -> None:
    """`tenants create NAME`, `tenants quota TENANT [--period P] [--cost-limit X] [--clear]`,
    `tenants concurrency|weight|retention TENANT [VALUE] [--clear]` and
    `keys create TENANT | list [--tenant T] | revoke KEY_ID`."""
    tenants = command("tenants", None, "manage tenants")
    tsub = tenants.add_subparsers(metavar="action")
    create = tsub.add_parser(
        "create",
        help="create a tenant and print its first API key",
        description="Create a tenant and print its first API key (shown once).",
    )
    create.add_argument("name", help="the new tenant's name")
    create.set_defaults(handler=cmd_tenants_create, passthrough=False)
    quota = tsub.add_parser(
        "quota",
        help="show or set a tenant's cost quota",
        description="Show a tenant's cost quota and what it spent in the current period; with "
        "--period or --cost-limit, give it a quota of its own; with --clear, return it to "
        "Tenants.DefaultQuota.",
    )
    quota.add_argument("tenant", help="tenant name or id")
    quota.add_argument(
        "--period",
        choices=["day", "month"],
        help="the window the spend is counted in (UTC day or calendar month; default: the "
        "tenant's current period)",
    )
    quota.add_argument(
        "--cost-limit",
        type=cost_limit,
        default=argparse.SUPPRESS,
        metavar="X",
        help="what the tenant may spend per period, in Pricing.Currency; `none` for no quota",
    )
    quota.add_argument(
        "--clear", action="store_true", help="remove the tenant's own quota (use the default)"
    )
    quota.set_defaults(handler=cmd_tenants_quota, passthrough=False)
    concurrency = tsub.add_parser(
        "concurrency",
        help="show or set a tenant's most runs at once",
        description="Show the most runs of a tenant that execute at once; with a number, give "
        "it a limit of its own; with --clear, return it to Tenants.MaxConcurrentRuns.",
    )
    concurrency.add_argument("tenant", help="tenant name or id")
    concurrency.add_argument(
        "limit", nargs="?", type=positive_int, help="the tenant's own limit (at least 1)"
    )
    concurrency.add_argument(
        "--clear", action="store_true", help="remove the tenant's own limit (use the default)"
    )
    concurrency.set_defaults(handler=cmd_tenants_concurrency, passthrough=False)
    weight = tsub.add_parser(
        "weight",
        help="show or set a tenant's share of fair dispatch",
        description="Show the tenant's weight: when several tenants have runs waiting for a "
        "worker, each gets runs started in proportion to its weight (default 1). With a "
        "number (1-100), set it; with --clear, return it to 1.",
    )
    weight.add_argument("tenant", help="tenant name or id")
    weight.add_argument("weight", nargs="?", type=weight_value, help="1 to 100")
    weight.add_argument("--clear", action="store_true", help="return the tenant's weight to 1")
    weight.set_defaults(handler=cmd_tenants_weight, passthrough=False)
    retention = tsub.add_parser(
        "retention",
        help="show or set how long a tenant's ended runs are kept",
        description="Show how long the tenant's ended run trees are kept before retention "
        "deletes them; with a duration (`90.00:00:00`, `3600`), or `never` to keep them "
        "forever, give it a retention of its own; with --clear, return it to Runs.Retention.",
    )
    retention.add_argument("tenant", help="tenant name or id")
    retention.add_argument(
        "duration",
        nargs="?",
        type=retention_value,
        help="d.hh:mm:ss or seconds (at least 1 s), or `never`",
    )
    retention.add_argument(
        "--clear", action="store_true", help="remove the tenant's own retention (use the default)"
    )
    retention.set_defaults(handler=cmd_tenants_retention, passthrough=False)

    keys = command("keys", None, "manage API keys")
    ksub = keys.add_subparsers(metavar="action")
    kcreate = ksub.add_parser(
        "create",
        help="issue a new API key for a tenant",
        description="Issue a new API key for a tenant (shown once).",
    )
    kcreate.add_argument("tenant", help="tenant name or id")
    kcreate.set_defaults(handler=cmd_keys_create, passthrough=False)
    klist = ksub.add_parser(
        "list",
        help="list API keys (never their secrets)",
        description="List API keys: the public id, tenant, creation, last use (to the minute) "
        "and revocation.",
    )
    klist.add_argument("--tenant", help="only this tenant's keys (name or id)")
    klist.set_defaults(handler=cmd_keys_list, passthrough=False)
    krevoke = ksub.add_parser(
        "revoke",
        help="revoke an API key at once",
        description="Revoke an API key: every web node refuses it from its next request.",
    )
    krevoke.add_argument("key_id", help="the key's public id (the part after `tjk_`)")
    krevoke.set_defaults(handler=cmd_keys_revoke, passthrough=False)


def add_run_commands(command: Command) -> None:
    """`runs list`, `runs show ID`, `runs tail ID` and `runs export ID`."""
    runs = command("runs", None, "inspect runs")
    rsub = runs.add_subparsers(metavar="action")
    rlist = rsub.add_parser(
        "list",
        help="list recent runs of a tenant",
        description="List a tenant's runs, newest first: id, status, agent, tokens, cost, "
        "creation time and error type.",
    )
    rlist.add_argument("--tenant", required=True, help="tenant name or id (`dev` for make run)")
    rlist.add_argument(
        "--status",
        type=run_status,
        help="only runs in this status (any case): "
        "Queued, Running, Waiting, Completed, Failed or Canceled",
    )
    rlist.add_argument("--limit", type=int, default=20, help="most runs listed (default 20)")
    rlist.set_defaults(handler=cmd_runs_list, passthrough=False)
    rshow = rsub.add_parser(
        "show",
        help="show one run, its events and its tool calls",
        description="Print one run as JSON: the run, its `events` and its `toolCalls` (the "
        "ledger).",
    )
    rshow.add_argument("run_id", help="the run's id")
    rshow.add_argument("--tenant", help="only if the run belongs to this tenant (name or id)")
    rshow.set_defaults(handler=cmd_runs_show, passthrough=False)
    rtail = rsub.add_parser(
        "tail",
        help="follow a run's events live until it ends",
        description="Print a run's events, one line each, as they happen, until its terminal "
        "event (Ctrl-C stops following).",
    )
    rtail.add_argument("run_id", help="the run's id")
    rtail.add_argument("--tenant", help="only if the run belongs to this tenant (name or id)")
    rtail.set_defaults(handler=cmd_runs_tail, passthrough=False)
    rexport = rsub.add_parser(
        "export",
        help="write a run's whole tree and chain as JSON lines",
        description="Write the run's tree, with the trees of the chain continuations link to "
        "it, as JSON lines (what Runs.ArchiveDirectory keeps before retention deletes them): "
        'each run as `{"type": "run", ...}` (the run JSON of GET /api/runs/{id}), followed by '
        "its events, tool calls, workflow nodes, approvals and the events kept for its chain.",
    )
    rexport.add_argument("run_id", help="any run of the tree or chain")
    rexport.add_argument("--tenant", help="only if the run belongs to this tenant (name or id)")
    rexport.add_argument(
        "--output",
        default="-",
        metavar="FILE",
        help="the file written (replaced if it exists); `-`, the default, is stdout",
    )
    rexport.set_defaults(handler=cmd_runs_export, passthrough=False)


def add_approval_commands(command: Command) -> None:
    """`approvals list [--tenant T] [--status S] [--run ID]` and
    `approvals decide ID --approve|--reject [--comment TEXT] --tenant T`."""
    group = command("approvals", None, "list and decide approvals of tool calls")
    asub = group.add_subparsers(metavar="action")
    alist = asub.add_parser(
        "list", help="list approvals, newest first", description="List approvals, newest first."
    )
    alist.add_argument("--tenant", help="only this tenant (name or id)")
    alist.add_argument("--status", help="Pending, Approved, Rejected, Expired or Canceled")
    alist.add_argument("--run", help="only the approvals of this run")
    alist.add_argument("--limit", type=int, default=50, help="most approvals listed (default 50)")
    alist.set_defaults(handler=cmd_approvals_list, passthrough=False)
    decide = asub.add_parser(
        "decide",
        help="approve or reject a pending approval (once)",
        description="Approve or reject a pending approval; a decision is final.",
    )
    decide.add_argument("approval_id", help="the approval's id")
    verdict = decide.add_mutually_exclusive_group(required=True)
    verdict.add_argument(
        "--approve", dest="approve", action="store_true", help="let the tool call run"
    )
    verdict.add_argument(
        "--reject", dest="approve", action="store_false", help="refuse the tool call"
    )
    decide.add_argument("--comment", help="a note kept with the decision")
    decide.add_argument("--tenant", required=True, help="tenant name or id")
    decide.set_defaults(handler=cmd_approvals_decide, passthrough=False)


def add_workflow_commands(command: Command) -> None:
    """`workflows list`, `workflows runs --tenant T [--status S]`,
    `workflows respond RUN_ID --tenant T (--answer JSON | --file F)`,
    `workflows event RUN_ID NAME --tenant T [--payload JSON | --file F]` and
    `workflows resume RUN_ID --tenant T`."""
    group = command(
        "workflows",
        None,
        "list workflows and their runs; answer a waiting one; send one an event; resume a "
        "failed one",
    )
    wsub = group.add_subparsers(metavar="action")
    wlist = wsub.add_parser(
        "list",
        help="the workflows this configuration registers",
        description="The workflows the modules in WorkflowModules register, with their "
        "descriptions.",
    )
    wlist.set_defaults(handler=cmd_workflows_list, passthrough=False)
    wruns = wsub.add_parser(
        "runs",
        help="list a tenant's workflow runs",
        description="List a tenant's workflow runs, newest first (columns as `runs list`).",
    )
    wruns.add_argument("--tenant", required=True, help="tenant name or id")
    wruns.add_argument("--status", type=run_status, help="only runs in this status (any case)")
    wruns.add_argument("--limit", type=int, default=20, help="most runs listed (default 20)")
    wruns.set_defaults(handler=cmd_workflows_runs, passthrough=False)
    respond = wsub.add_parser(
        "respond",
        help="answer the question a Waiting workflow run asks",
        description="Answer the question a Waiting workflow run asks (ctx.ask), as POST "
        "/api/workflows/runs/{id}/respond does: the run is closed Completed and a new run "
        "continues the chain, its ask returning the answer; prints the new run's id.",
    )
    respond.add_argument("run_id", help="the Waiting workflow run")
    respond.add_argument("--tenant", required=True, help="tenant name or id")
    answer = respond.add_mutually_exclusive_group(required=True)
    answer.add_argument(
        "--answer",
        metavar="JSON",
        help='the answer as JSON (the respond body\'s `answer`): \'{"text": "ok"}\', \'"yes"\'',
    )
    answer.add_argument(
        "--file", metavar="PATH", help="read the answer's JSON from this file (`-`: stdin)"
    )
    respond.set_defaults(handler=cmd_workflows_respond, passthrough=False)
    event = wsub.add_parser(
        "event",
        help="deliver an event to a workflow run's chain (ctx.wait_for)",
        description="Deliver the event `name` to the chain of a workflow run (any run of it), as "
        "POST /api/workflows/runs/{id}/events/{name} does: it answers the chain's "
        "ctx.wait_for(name), and a new run continues the chain (prints `delivered` and that "
        "run's id); with no such wait open yet it is kept for the chain's next one (prints "
        "`kept` and the id of the run it is kept for; Workflows.BufferEvents).",
    )
    event.add_argument("run_id", help="a run of the workflow chain")
    event.add_argument("name", help="the event's name (1 to 200 characters)")
    event.add_argument("--tenant", required=True, help="tenant name or id")
    payload = event.add_mutually_exclusive_group()
    payload.add_argument(
        "--payload",
        metavar="JSON",
        help="the payload as JSON (what ctx.wait_for returns; default null): "
        "'{\"amount\": 5}', '\"card\"'",
    )
    payload.add_argument(
        "--file", metavar="PATH", help="read the payload's JSON from this file (`-`: stdin)"
    )
    event.set_defaults(handler=cmd_workflows_event, passthrough=False)
    resume = wsub.add_parser(
        "resume",
        help="resume a Failed workflow run from its latest checkpoint",
        description="Start the run that continues a Failed workflow run from its latest "
        "checkpoint; prints the new run's id.",
    )
    resume.add_argument("run_id", help="the Failed workflow run")
    resume.add_argument("--tenant", required=True, help="tenant name or id")
    resume.set_defaults(handler=cmd_workflows_resume, passthrough=False)


def add_idempotency_commands(command: Command) -> None:
    """`idempotency list --in-progress` and `idempotency release KEY --tenant T`."""
    group = command("idempotency", None, "inspect and release HTTP idempotency records")
    isub = group.add_subparsers(metavar="action")
    ilist = isub.add_parser(
        "list",
        help="list InProgress records (left by a crash)",
        description="List InProgress idempotency records (left by a crash), oldest first.",
    )
    ilist.add_argument(
        "--in-progress", action="store_true", help="InProgress records (the only ones listed)"
    )
    ilist.add_argument("--tenant", help="only this tenant (name or id)")
    ilist.add_argument("--limit", type=int, default=100, help="most records listed (default 100)")
    ilist.set_defaults(handler=cmd_idempotency_list, passthrough=False)
    release = isub.add_parser(
        "release",
        help="delete an InProgress record so a retry executes",
        description="Delete an InProgress idempotency record, so a retry with its key executes.",
    )
    release.add_argument("key", help="the Idempotency-Key value")
    release.add_argument("--tenant", required=True, help="tenant name or id")
    release.set_defaults(handler=cmd_idempotency_release, passthrough=False)


def add_webhook_commands(command: Command) -> None:
    """`webhooks create|list|show|update|delete|rotate-secret|deliveries|redeliver`, each
    with `--tenant T`."""
    group = command("webhooks", None, "manage a tenant's webhook endpoints and deliveries")
    wsub = group.add_subparsers(metavar="action")
    _webhook_endpoint_commands(wsub)
    _webhook_secret_and_delivery_commands(wsub)


def _webhook_action(
    wsub: Any, name: str, handler: Handler, help_: str, description: str, *, by_id: bool = True
) -> argparse.ArgumentParser:
    """One `webhooks` action, with `--tenant` and (`by_id`) the endpoint's id."""
    parser: argparse.ArgumentParser = wsub.add_parser(name, help=help_, description=description)
    parser.add_argument("--tenant", required=True, help="tenant name or id")
    if by_id:
        parser.add_argument("endpoint_id", help="the endpoint's id")
    parser.set_defaults(handler=handler, passthrough=False)
    return parser


def _webhook_endpoint_commands(wsub: Any) -> None:
    """`create`, `list`, `show`, `update`, `delete`."""
    create = _webhook_action(
        wsub,
        "create",
        cmd_webhooks_create,
        "create an endpoint and print its secret once",
        "Create a webhook endpoint of the tenant for the event types given with --event; "
        "prints its id and its signing secret (shown once).",
        by_id=False,
    )
    create.add_argument("url", help="where the events are POSTed (https unless Webhooks.AllowHttp)")
    _endpoint_fields(create, required=True)
    listed = _webhook_action(
        wsub,
        "list",
        cmd_webhooks_list,
        "list the tenant's endpoints",
        "List the tenant's endpoints, newest first: id, enabled or disabled, creation, URL and "
        "event types.",
        by_id=False,
    )
    listed.add_argument("--limit", type=int, default=50, help="most endpoints listed (default 50)")
    _webhook_action(
        wsub,
        "show",
        cmd_webhooks_show,
        "show one endpoint as JSON",
        "Print one endpoint as JSON, as GET /api/webhooks/{id} shows it (never its secret).",
    )
    update = _webhook_action(
        wsub,
        "update",
        cmd_webhooks_update,
        "change an endpoint's URL, events, description, or enable or disable it",
        "Change what is given; prints the endpoint as JSON. --enable on a disabled endpoint "
        "clears why and since when it was disabled and failing.",
    )
    update.add_argument("--url", help="the new URL")
    _endpoint_fields(update, required=False)
    state = update.add_mutually_exclusive_group()
    state.add_argument(
        "--enable", dest="enabled", action="store_true", default=None, help="deliver to it again"
    )
    state.add_argument(
        "--disable", dest="enabled", action="store_false", help="stop delivering to it"
    )
    _webhook_action(
        wsub,
        "delete",
        cmd_webhooks_delete,
        "delete an endpoint",
        "Delete an endpoint; its pending deliveries are canceled, its history stays in the "
        "database.",
    )


def _webhook_secret_and_delivery_commands(wsub: Any) -> None:
    """`rotate-secret`, `deliveries`, `redeliver`."""
    rotate = _webhook_action(
        wsub,
        "rotate-secret",
        cmd_webhooks_rotate_secret,
        "give an endpoint a new secret, printed once",
        "Give the endpoint a new signing secret (printed once); the previous one signs beside "
        "it for the grace period, so receivers can move over.",
    )
    rotate.add_argument(
        "--grace",
        type=grace_seconds,
        metavar="SECONDS",
        help="how long the previous secret still signs (default Webhooks.RotationGrace)",
    )
    deliveries = _webhook_action(
        wsub,
        "deliveries",
        cmd_webhooks_deliveries,
        "list an endpoint's deliveries and their attempts",
        "List the endpoint's deliveries, newest first, each followed by its attempts (time, "
        "HTTP status, latency, error).",
    )
    deliveries.add_argument("--status", choices=list(DELIVERY_STATUSES), help="only these")
    deliveries.add_argument(
        "--limit", type=int, default=20, help="most deliveries listed (default 20)"
    )
    redeliver = _webhook_action(
        wsub,
        "redeliver",
        cmd_webhooks_redeliver,
        "send a delivery again",
        "Make a delivery pending again and due now, whatever its status (the same webhook-id "
        "and body).",
    )
    redeliver.add_argument("delivery_id", help="the delivery's id")


def _endpoint_fields(parser: argparse.ArgumentParser, required: bool) -> None:
    """`--event` (repeated) and `--description`, of `create` and `update`."""
    parser.add_argument(
        "--event",
        dest="events",
        action="append",
        required=required,
        metavar="TYPE",
        help="an event type to receive (repeat for each: run.completed, approval.requested, ...)"
        + ("" if required else "; the list given replaces the endpoint's"),
    )
    parser.add_argument(
        "--description",
        help="a note about the endpoint" + ("" if required else " (an empty one removes it)"),
    )


def _group_help(group: argparse.ArgumentParser) -> Handler:
    """A command group named without its action: print the group's help, exit 2."""

    def show(args: argparse.Namespace, rest: list[str]) -> int:
        group.print_help()
        return 2

    return show


def add_schedule_commands(command: Command) -> None:
    """`schedules create|list|show|pause|resume|delete|fires`, each with `--tenant T`."""
    group = command(
        "schedules", None, "manage a tenant's schedules (runs at cron or interval times)"
    )
    ssub = group.add_subparsers(metavar="action")
    create = _schedule_action(
        ssub,
        "create",
        cmd_schedules_create,
        "create a schedule",
        "Create a schedule of the tenant: a run of --agent or --workflow at each slot of --cron "
        "(in --timezone) or of --interval. The rules are those of POST /api/schedules.",
        by_name=False,
    )
    create.add_argument("name", help="the schedule's name (unique per tenant, 1-100 characters)")
    create.add_argument("--cron", help="a five-field cron expression, or @daily, @hourly, ...")
    create.add_argument("--timezone", help="an IANA zone for --cron (default UTC)")
    create.add_argument("--interval", help="seconds, PT30S or 00:00:30 (at least 1 s)")
    create.add_argument("--agent", help="run this configured agent")
    create.add_argument("--workflow", help="run this registered workflow")
    create.add_argument("--message", help="the agent's message")
    create.add_argument("--input", help="the run's input as a JSON object")
    create.add_argument(
        "--overlap",
        choices=["skip", "queue", "cancel_previous"],
        help="when the previous run has not ended (default skip)",
    )
    create.add_argument(
        "--catch-up",
        dest="catch_up",
        choices=["none", "latest", "all"],
        help="what fires of the slots missed in an outage (default none)",
    )
    create.add_argument("--paused", action="store_true", help="create it paused")
    listed = _schedule_action(
        ssub,
        "list",
        cmd_schedules_list,
        "list the tenant's schedules",
        "List the tenant's schedules, newest first: id, name, cron or interval, target, state "
        "and next slot (UTC).",
        by_name=False,
    )
    listed.add_argument("--limit", type=int, default=50, help="most schedules listed (default 50)")
    for name, handler, help_ in (
        ("show", cmd_schedules_show, "print a schedule as JSON"),
        ("pause", cmd_schedules_pause, "pause a schedule: no slot fires until resumed"),
        ("resume", cmd_schedules_resume, "resume a schedule from its first slot after now"),
        ("delete", cmd_schedules_delete, "delete a schedule and its fires (its runs stay)"),
    ):
        _schedule_action(ssub, name, handler, help_, help_[0].upper() + help_[1:] + ".")
    fires = _schedule_action(
        ssub,
        "fires",
        cmd_schedules_fires,
        "list the slots a schedule recorded",
        "List the slots the schedule recorded, newest first: slot, outcome (fired, skipped, "
        "queued, missed, failed), run, when.",
    )
    fires.add_argument("--limit", type=int, default=50, help="most fires listed (default 50)")


def _schedule_action(
    ssub: Any, name: str, handler: Handler, help_: str, description: str, *, by_name: bool = True
) -> argparse.ArgumentParser:
    """One `schedules` action, with `--tenant` and (`by_name`) the schedule's id or name."""
    parser: argparse.ArgumentParser = ssub.add_parser(name, help=help_, description=description)
    parser.add_argument("--tenant", required=True, help="tenant name or id")
    if by_name:
        parser.add_argument("schedule", help="the schedule's id or name")
    parser.set_defaults(handler=handler, passthrough=False)
    return parser
