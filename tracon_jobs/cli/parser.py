"""The command line of `tracon-jobs`: every command, its arguments and its help, each bound to
the function that runs it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from tracon_jobs.cli.dev import cmd_dev
from tracon_jobs.cli.operations import (
    cmd_approvals_decide,
    cmd_approvals_list,
    cmd_circuits,
    cmd_drain,
    cmd_idempotency_list,
    cmd_idempotency_release,
    cmd_keys_create,
    cmd_runs_list,
    cmd_runs_show,
    cmd_tenants_create,
)
from tracon_jobs.cli.processes import cmd_beat, cmd_flower, cmd_migrate, cmd_web, cmd_worker

DESCRIPTION = "The `tracon-jobs` command: one entry point for every process and operator task."

Handler = Callable[[argparse.Namespace, list[str]], int]
"""A command: its parsed arguments and, for a passthrough command, the rest of the line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracon-jobs", description=DESCRIPTION)
    sub = parser.add_subparsers(metavar="command")

    def command(name: str, handler: Handler, help_: str, passthrough: bool = False) -> Any:
        cmd = sub.add_parser(name, help=help_)
        cmd.set_defaults(handler=handler, passthrough=passthrough)
        return cmd

    command("dev", cmd_dev, "migrate, then run web, a worker, beat and Flower (Ctrl-C stops)")
    command("migrate", cmd_migrate, "upgrade the database to the latest schema")
    web = command("web", cmd_web, "serve the HTTP API with gunicorn")
    web.add_argument("--bind", default=os.environ.get("TRACON_WEB_BIND", "127.0.0.1:8000"))
    web.add_argument("--workers", type=int, default=int(os.environ.get("TRACON_WEB_WORKERS", 2)))
    web.add_argument("--threads", type=int, default=int(os.environ.get("TRACON_WEB_THREADS", 32)))
    command("drain", cmd_drain, "make the web node on this host refuse new runs (503)")
    command("circuits", cmd_circuits, "show each provider's circuit and concurrency slots")
    command("worker", cmd_worker, "run a Celery worker (extra args go to celery)", True)
    command("beat", cmd_beat, "run Celery beat (the periodic services)", True)
    command("flower", cmd_flower, "run Flower (extra args go to flower)", True)

    tenants = command("tenants", _usage, "manage tenants")
    tsub = tenants.add_subparsers(metavar="action")
    create = tsub.add_parser("create", help="create a tenant and print its first API key")
    create.add_argument("name")
    create.set_defaults(handler=cmd_tenants_create, passthrough=False)

    keys = command("keys", _usage, "manage API keys")
    ksub = keys.add_subparsers(metavar="action")
    kcreate = ksub.add_parser("create", help="issue a new API key for a tenant")
    kcreate.add_argument("tenant")
    kcreate.set_defaults(handler=cmd_keys_create, passthrough=False)

    runs = command("runs", _usage, "inspect runs")
    rsub = runs.add_subparsers(metavar="action")
    rlist = rsub.add_parser("list", help="list recent runs of a tenant")
    rlist.add_argument("--tenant", required=True)
    rlist.add_argument("--status")
    rlist.add_argument("--limit", type=int, default=20)
    rlist.set_defaults(handler=cmd_runs_list, passthrough=False)
    rshow = rsub.add_parser("show", help="show one run and its events")
    rshow.add_argument("run_id")
    rshow.set_defaults(handler=cmd_runs_show, passthrough=False)
    add_idempotency_commands(command)
    add_approval_commands(command)
    return parser


def add_approval_commands(command: Any) -> None:
    """`approvals list [--tenant T] [--status S] [--run ID]` and
    `approvals decide ID --approve|--reject [--comment TEXT] --tenant T`."""
    group = command("approvals", _usage, "list and decide approvals of tool calls")
    asub = group.add_subparsers(metavar="action")
    alist = asub.add_parser("list", help="list approvals, newest first")
    alist.add_argument("--tenant", help="only this tenant (name or id)")
    alist.add_argument("--status", help="Pending, Approved, Rejected, Expired or Canceled")
    alist.add_argument("--run", help="only the approvals of this run")
    alist.add_argument("--limit", type=int, default=50)
    alist.set_defaults(handler=cmd_approvals_list, passthrough=False)
    decide = asub.add_parser("decide", help="approve or reject a pending approval (once)")
    decide.add_argument("approval_id")
    verdict = decide.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--approve", dest="approve", action="store_true")
    verdict.add_argument("--reject", dest="approve", action="store_false")
    decide.add_argument("--comment")
    decide.add_argument("--tenant", required=True, help="tenant name or id")
    decide.set_defaults(handler=cmd_approvals_decide, passthrough=False)


def add_idempotency_commands(command: Any) -> None:
    """`idempotency list --in-progress` and `idempotency release KEY --tenant T`."""
    group = command("idempotency", _usage, "inspect and release HTTP idempotency records")
    isub = group.add_subparsers(metavar="action")
    ilist = isub.add_parser("list", help="list InProgress records (left by a crash)")
    ilist.add_argument(
        "--in-progress", action="store_true", help="InProgress records (the only ones listed)"
    )
    ilist.add_argument("--tenant", help="only this tenant (name or id)")
    ilist.add_argument("--limit", type=int, default=100)
    ilist.set_defaults(handler=cmd_idempotency_list, passthrough=False)
    release = isub.add_parser("release", help="delete an InProgress record so a retry executes")
    release.add_argument("key")
    release.add_argument("--tenant", required=True, help="tenant name or id")
    release.set_defaults(handler=cmd_idempotency_release, passthrough=False)


def _usage(args: argparse.Namespace, rest: list[str]) -> int:
    """A command group named without its action: print the group's help (argparse exits)."""
    build_parser().parse_args([*sys.argv[1:2], "--help"])
    return 2
