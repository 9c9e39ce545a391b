"""`tracon-jobs dev`: everything in the foreground on one machine. Migrates, starts an
embedded Redis when none answers, prints a development key, then supervises web, a worker,
beat and Flower until Ctrl-C (or SIGTERM, or a closed terminal) stops them all."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from tracon_jobs.cli.context import VAR, load_runtime, safe_url
from tracon_jobs.cli.processes import cmd_migrate
from tracon_jobs.cli.supervisor import Supervisor
from tracon_jobs.settings import Settings, load_settings

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "demo" / "config.json"
STOP_TIMEOUT_SECONDS = 15.0


def cmd_dev(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.embedded_redis import ensure_redis

    # The children have sessions of their own: whatever ends this process stops them here.
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)
    env = dict(os.environ)
    if not env.get("TRACON_CONFIG") and not Path("tracon.json").exists():
        env["TRACON_CONFIG"] = str(DEMO_CONFIG)
    settings = load_settings(environ=env)
    redis_url, embedded = ensure_redis(settings.redis.url, VAR / "redis")
    env["TRACON_REDIS_URL"] = redis_url
    os.environ.update(env)
    children = Supervisor(stop_timeout=STOP_TIMEOUT_SECONDS)
    try:
        cmd_migrate(args, [])
        key = _dev_key()
        _start_children(children, env)
        _print_welcome(key, redis_url, embedded is not None, load_settings(environ=env))
        children.wait_for_exit()
    except KeyboardInterrupt:
        children.signal_all(signal.SIGINT)  # as when they shared the terminal's Ctrl-C
    finally:
        _forward_while_stopping(children)
        children.stop()
        if embedded is not None:
            embedded.stop()
    return 0


def _exit(*_: Any) -> NoReturn:
    sys.exit(0)


def _forward_while_stopping(children: Supervisor) -> None:
    """A second Ctrl-C or SIGTERM goes on to the children (to Celery, a second Ctrl-C is a
    cold shutdown) instead of cutting their stop short."""

    def forward(signum: int, _frame: Any) -> None:
        children.signal_all(signal.Signals(signum))

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # to gunicorn, SIGHUP means reload


def _dev_key() -> str:
    runtime = load_runtime()
    tenant_id = runtime.tenants.ensure_tenant("dev")
    return str(runtime.tenants.issue_key(tenant_id, label="make run").secret)


def _start_children(children: Supervisor, env: dict[str, str]) -> None:
    flower_env = dict(env, FLOWER_UNAUTHENTICATED_API="true")  # local only: bound to 127.0.0.1
    me = [sys.executable, "-m", "tracon_jobs.cli"]
    children.start("web", [*me, "web", "--workers", "1"], env)
    children.start("worker", [*me, "worker", "-n", "worker1@%h"], env)
    children.start("beat", [*me, "beat"], env)
    children.start("flower", [*me, "flower", "--address=127.0.0.1", "--port=5555"], flower_env)


def _print_welcome(key: str, redis_url: str, embedded: bool, settings: Settings) -> None:
    agent = next(iter(settings.agents), "demo")
    where = "embedded redis" if embedded else "redis"
    print(
        f"""
  tracon-jobs is starting: web http://127.0.0.1:8000  ·  Flower http://127.0.0.1:5555
  {where}: {redis_url}  ·  database: {safe_url(settings.database.url)}
  development API key: {key}

  Try:
    curl -N -X POST http://127.0.0.1:8000/api/agents/{agent}/run \\
      -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\
      -d '{{"message": "Where is order A-1001?"}}'
""",
        flush=True,
    )
