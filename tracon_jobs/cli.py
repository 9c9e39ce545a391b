"""The `tracon-jobs` command: one entry point for every process and operator task."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter

from tracon_jobs.drain import clear_web_drain, start_web_drain
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings import Settings, load_settings

DEMO_CONFIG = Path(__file__).with_name("demo") / "config.json"
VAR = Path("var")

Handler = Callable[[argparse.Namespace, list[str]], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(
        level=os.environ.get("TRACON_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return handler(args, rest)
    except ConfigurationError as exc:
        print(f"tracon-jobs: {exc}", file=sys.stderr)
        return 78  # EX_CONFIG
    except CommandError as exc:
        print(exc, file=sys.stderr)
        return 1


class CommandError(Exception):
    """An operator command that cannot do what was asked (exit code 1)."""


def _tenant(runtime: Any, name_or_id: str) -> str:
    tenant_id: str | None = runtime.tenants.find_tenant(name_or_id)
    if tenant_id is None:
        raise CommandError(f"no tenant '{name_or_id}'")
    return tenant_id


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracon-jobs", description=__doc__)
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
    return parser


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
    build_parser().parse_args([*sys.argv[1:2], "--help"])
    return 2


def _runtime() -> Any:
    from tracon_jobs.runtime import Runtime

    return Runtime(load_settings())


# -- processes -------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.db.migrate import upgrade

    settings = load_settings()
    upgrade(settings.database.url)
    print(f"database migrated: {_safe_url(settings.database.url)}")
    return 0


def _runtime_settings() -> Settings:
    return load_settings()


def cmd_drain(args: argparse.Namespace, rest: list[str]) -> int:
    path = start_web_drain()
    print(f"draining: new runs on this node get 503 until it stops (flag {path})")
    return 0


def cmd_web(args: argparse.Namespace, rest: list[str]) -> int:

    _runtime().close()  # fail at startup (settings, tool modules), not in the first request

    drain = _runtime_settings().drain

    class WebApplication(BaseApplication):
        def load_config(self) -> None:
            self.cfg.set("bind", args.bind)
            self.cfg.set("workers", args.workers)
            self.cfg.set("threads", args.threads)
            self.cfg.set("worker_class", "gthread")
            self.cfg.set("timeout", 0)  # SSE streams live as long as their runs
            self.cfg.set("graceful_timeout", 30)
            self.cfg.set("accesslog", "-")

        def load(self) -> Any:
            from web import create_app

            return create_app()

    clear_web_drain()  # a flag left by an earlier stop must not make a new node refuse
    DrainingArbiter.drain_seconds = drain.timeout.total_seconds() if drain.enabled else None
    DrainingArbiter(WebApplication()).run()
    return 0


class DrainingArbiter(Arbiter):
    """gunicorn closes its listener on SIGTERM; while draining it must still answer 503.

    With `Drain.Enabled`, the first SIGTERM only starts draining (the flag every web process
    reads), and the stop proper begins once `Drain.Timeout` has passed.
    """

    drain_seconds: float | None = None
    drain_deadline: float | None = None

    def handle_term(self) -> None:
        if self.drain_seconds is None or self.drain_deadline is not None:
            raise StopIteration
        start_web_drain()
        self.drain_deadline = time.monotonic() + self.drain_seconds
        self.log.info("draining for %.1fs before stopping", self.drain_seconds)

    def manage_workers(self) -> None:
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            clear_web_drain()
            raise StopIteration
        super().manage_workers()


def cmd_worker(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = _runtime()
    settings: Settings = runtime.settings
    argv = [
        "worker",
        "--pool",
        "threads",
        "-c",
        str(settings.worker.concurrency),
        "-E",
        "-Q",
        "tracon.runs,tracon.control",
        "--loglevel",
        "INFO",
        *rest,
    ]
    runtime.celery.worker_main(argv)
    return 0


def cmd_beat(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = _runtime()
    VAR.mkdir(exist_ok=True)
    schedule = str(VAR / "celerybeat-schedule")
    runtime.celery.start(["beat", "-s", schedule, "--loglevel", "INFO", *rest])
    return 0


def cmd_flower(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = _runtime()
    argv = ["flower", *rest] if rest else ["flower", "--address=127.0.0.1", "--port=5555"]
    runtime.celery.start(argv)
    return 0


# -- operator commands -----------------------------------------------------------------


def cmd_circuits(args: argparse.Namespace, rest: list[str]) -> int:
    from web.operations import circuits_view

    views = circuits_view(_runtime())
    print(f"{'provider':<20} {'state':<10} {'failures':>8} {'retry after':>12} {'slots':>12}")
    for view in views:
        retry = f"{view['retryAfter']:.1f}s" if view["retryAfter"] else "-"
        slots = view["slots"]
        used = f"{slots['inUse']}/{slots['limit']}+{slots['waiting']}" if slots["limit"] else "-"
        print(
            f"{view['provider']:<20} {view['state']:<10} {view['consecutiveFailures']:>8} "
            f"{retry:>12} {used:>12}"
        )
    return 0


def cmd_tenants_create(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = _runtime()
    if runtime.tenants.find_tenant(args.name):
        raise CommandError(f"tenant '{args.name}' already exists; use 'keys create'")
    tenant_id = runtime.tenants.create_tenant(args.name)
    issued = runtime.tenants.issue_key(tenant_id, label="initial")
    print(f"tenant: {args.name} ({tenant_id})\napi key (shown once): {issued.secret}")
    return 0


def cmd_keys_create(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = _runtime()
    tenant_id = _tenant(runtime, args.tenant)
    print(f"api key (shown once): {runtime.tenants.issue_key(tenant_id).secret}")
    return 0


def cmd_runs_list(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.runs.store import RunFilter

    runtime = _runtime()
    tenant_id = _tenant(runtime, args.tenant)
    runs = runtime.runs.page(
        tenant_id, RunFilter(status=args.status), limit=args.limit, before=None
    )
    for run in runs:
        print(
            f"{run.id}  {run.status:<9}  {run.agent:<16}  {run.created_at:%Y-%m-%d %H:%M:%S}"
            f"  {run.error_type or ''}"
        )
    return 0


def cmd_runs_show(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.runs.views import run_json

    runtime = _runtime()
    run = runtime.runs.get(args.run_id)
    if run is None:
        raise CommandError(f"no run '{args.run_id}'")
    body = run_json(run)
    body["events"] = [event.as_json() for event in runtime.runs.events(run.id)]
    print(json.dumps(body, indent=2, default=str))
    return 0


def cmd_idempotency_list(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.idempotency import IdempotencyStore

    runtime = _runtime()
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

    runtime = _runtime()
    tenant_id = _tenant(runtime, args.tenant)
    if not IdempotencyStore(runtime.db).release(tenant_id, args.key):
        raise CommandError(f"no InProgress record for key '{args.key}' of tenant '{args.tenant}'")
    print(f"released key '{args.key}' of tenant '{args.tenant}': a retry will execute")
    return 0


# -- dev: everything in the foreground -------------------------------------------------


def cmd_dev(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.embedded_redis import ensure_redis

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the children on SIGTERM too
    env = dict(os.environ)
    if not env.get("TRACON_CONFIG") and not Path("tracon.json").exists():
        env["TRACON_CONFIG"] = str(DEMO_CONFIG)
    settings = load_settings(environ=env)
    redis_url, embedded = ensure_redis(settings.redis.url, VAR / "redis")
    env["TRACON_REDIS_URL"] = redis_url
    os.environ.update(env)
    children: list[subprocess.Popen[bytes]] = []
    try:
        cmd_migrate(args, [])
        key = _dev_key()
        children = _start_children(env)
        _print_welcome(key, redis_url, embedded is not None, load_settings(environ=env))
        _wait(children)
    except KeyboardInterrupt:
        pass
    finally:
        _stop(children)
        if embedded is not None:
            embedded.stop()
    return 0


def _dev_key() -> str:
    runtime = _runtime()
    tenant_id = runtime.tenants.ensure_tenant("dev")
    return str(runtime.tenants.issue_key(tenant_id, label="make run").secret)


def _start_children(env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    flower_env = dict(env, FLOWER_UNAUTHENTICATED_API="true")  # local only: bound to 127.0.0.1
    me = [sys.executable, "-m", "tracon_jobs.cli"]
    return [
        subprocess.Popen([*me, "web", "--workers", "1"], env=env),
        subprocess.Popen([*me, "worker", "-n", "worker1@%h"], env=env),
        subprocess.Popen([*me, "beat"], env=env),
        subprocess.Popen([*me, "flower", "--address=127.0.0.1", "--port=5555"], env=flower_env),
    ]


def _print_welcome(key: str, redis_url: str, embedded: bool, settings: Settings) -> None:
    agent = next(iter(settings.agents), "demo")
    where = "embedded redis" if embedded else "redis"
    print(
        f"""
  tracon-jobs is starting: web http://127.0.0.1:8000  ·  Flower http://127.0.0.1:5555
  {where}: {redis_url}  ·  database: {_safe_url(settings.database.url)}
  development API key: {key}

  Try:
    curl -N -X POST http://127.0.0.1:8000/api/agents/{agent}/run \\
      -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\
      -d '{{"message": "Where is order A-1001?"}}'
""",
        flush=True,
    )


def _wait(children: list[subprocess.Popen[bytes]]) -> None:
    while all(child.poll() is None for child in children):
        time.sleep(0.5)


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    sys.exit(main())
