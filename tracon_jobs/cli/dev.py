"""`tracon-jobs dev`: everything in the foreground on one machine. Checks its ports first,
migrates, starts an embedded Redis when none answers, prints a development key, then
supervises web, a worker, beat and Flower until Ctrl-C (or SIGTERM, or a closed terminal)
stops them all; a child that exits on its own stops the others too, with a non-zero exit."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from tracon_jobs.cli.context import VAR, CommandError, ensure_database_dir, load_runtime, safe_url
from tracon_jobs.cli.processes import cmd_migrate
from tracon_jobs.cli.supervisor import ChildExited, Supervisor
from tracon_jobs.settings import Settings, defaults, load_settings
from tracon_jobs.settings.loading import environment_sources
from tracon_jobs.settings.redis_url import masked

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "demo" / "config.json"
STOP_TIMEOUT_SECONDS = 15.0
HOST = "127.0.0.1"
DEFAULT_WEB_PORT = 8000
DEFAULT_FLOWER_PORT = 5555
DEV_TENANT = "dev"
"""The tenant of the development key (`runs list --tenant dev`)."""

DEMO_QUESTION = "Where is order A-1001?"
"""What the banner's `curl` asks the demo agent (another agent is greeted)."""
WEB_READY_SECONDS = 60.0
"""How long dev waits for the web port to accept connections before giving up."""


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535 (got {port})")
    return port


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether `host:port` cannot be bound now (as gunicorn and Flower would bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(web_port: int, flower_port: int) -> None:
    """Refuse to start anything when a port dev needs is taken: the message names the port
    and the option that changes it."""
    if web_port == flower_port:
        raise CommandError(
            f"tracon-jobs dev: the web API and Flower cannot share port {web_port}; "
            "give them different ports with --port N and --flower-port M"
        )
    for port, what, option, variable in (
        (web_port, "the web API", "--port", "PORT"),
        (flower_port, "Flower", "--flower-port", "FLOWER_PORT"),
    ):
        if port_in_use(port):
            raise CommandError(
                f"tracon-jobs dev: port {port} on {HOST}, wanted for {what}, is already in "
                f"use; stop what holds it, or choose another port: 'tracon-jobs dev {option} N' "
                f"(or 'make run {variable}=N'). Nothing was started."
            )


def cmd_dev(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.embedded_redis import EmbeddedRedis, ensure_redis
    from tracon_jobs.redis_clients import redis_answers

    check_ports(args.port, args.flower_port)  # before anything starts or is written
    # Ctrl-C must reach us even when started with SIGINT ignored (a background job), and the
    # children have sessions of their own: whatever ends this process stops them here.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)
    env = dict(os.environ)
    if not env.get("TRACON_CONFIG") and not Path("tracon.json").exists():
        env["TRACON_CONFIG"] = str(DEMO_CONFIG)
    settings = load_settings(environ=env)
    ensure_database_dir(settings.database.url)
    children = Supervisor(stop_timeout=STOP_TIMEOUT_SECONDS)
    embedded: EmbeddedRedis | None = None
    code = 0
    try:
        redis_url, embedded = ensure_redis(
            settings.redis.url, VAR / "redis", lambda _url: redis_answers(settings.redis)
        )
        # which setting named the Redis that did not answer: before this process names one
        redis_line = _redis_line(settings, redis_url, embedded is not None, env)
        env["TRACON_REDIS_URL"] = redis_url
        os.environ.update(env)
        cmd_migrate(args, [])
        key = _dev_key()
        _start_children(children, env, args.port, args.flower_port)
        _wait_for_web(children, args.port)
        _print_welcome(key, redis_line, args.port, args.flower_port, load_settings(environ=env))
        exited = children.wait_for_exit()
        print(
            f"tracon-jobs dev: {exited.name} exited with code {exited.popen.returncode}; "
            "stopping the others",
            file=sys.stderr,
            flush=True,
        )
        code = 1
    except ChildExited as exc:
        child = exc.child
        print(
            f"tracon-jobs dev: {child.name} exited with code {child.popen.returncode} before "
            f"the web API answered on port {args.port}; stopping the others",
            file=sys.stderr,
            flush=True,
        )
        code = 1
    except KeyboardInterrupt:
        children.signal_all(signal.SIGINT)  # as when they shared the terminal's Ctrl-C
    finally:
        _forward_while_stopping(children)
        children.stop()
        if embedded is not None:
            embedded.stop()
    return code


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
    tenant_id = runtime.tenants.ensure_tenant(DEV_TENANT)
    return str(runtime.tenants.issue_key(tenant_id, label="make run").secret)


def _start_children(
    children: Supervisor, env: dict[str, str], web_port: int, flower_port: int
) -> None:
    flower_env = dict(env, FLOWER_UNAUTHENTICATED_API="true")  # local only: bound to 127.0.0.1
    me = [sys.executable, "-m", "tracon_jobs.cli"]
    children.start("web", [*me, "web", "--workers", "1", "--bind", f"{HOST}:{web_port}"], env)
    children.start("worker", [*me, "worker", "-n", "worker1@%h"], env)
    children.start("beat", [*me, "beat"], env)
    flower = [*me, "flower", f"--address={HOST}", f"--port={flower_port}"]
    children.start("flower", flower, flower_env)


def _wait_for_web(children: Supervisor, port: int) -> None:
    """Until the web port accepts connections, so the printed `curl` line works at once;
    `ChildExited` when a child dies first (a port taken since the check, a bad setting)."""
    deadline = time.monotonic() + WEB_READY_SECONDS
    while time.monotonic() < deadline:
        children.check_alive()
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.1)


def _redis_line(settings: Settings, url: str, embedded: bool, env: dict[str, str]) -> str:
    """Which Redis is used; when an embedded one replaced the configured one, say so."""
    if not embedded:
        return f"redis: {url}"
    configured = masked(settings.redis.url)
    variable = environment_sources(env).get(("redis", "url"))
    if variable is not None:
        source = f"from {variable}"
    elif settings.redis.url != defaults.REDIS_URL:
        source = "from the configuration file"
    else:
        source = "the default"
    return f"redis: {configured} ({source}) did not answer; using an embedded redis instead: {url}"


def runnable_command() -> str:
    """How this shell runs the `tracon-jobs` of this process: its name when `PATH` finds this
    very one (an activated venv, an installed package), else its path (`.venv/bin/tracon-jobs`
    from the clone, as `make run` starts it), else `python -m tracon_jobs.cli`."""
    here = Path(sys.executable).parent / "tracon-jobs"
    found = shutil.which("tracon-jobs")
    if found is not None and here.exists() and Path(found).resolve() == here.resolve():
        return "tracon-jobs"
    if not here.exists():
        return f"{sys.executable} -m tracon_jobs.cli"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def _broker_line(settings: Settings) -> str:
    """The banner's line of a broker other than Redis (`Broker.Url`), its password masked."""
    url = settings.broker.url
    return "" if url is None else f"\n  broker: {masked(url)}"


def _print_welcome(
    key: str, redis_line: str, web_port: int, flower_port: int, settings: Settings
) -> None:
    agent = next(iter(settings.agents), "demo")
    message = DEMO_QUESTION if agent == "demo" else "Hello!"
    web = f"http://{HOST}:{web_port}"
    print(
        f"""
  tracon-jobs is running: web {web}  ·  Flower http://{HOST}:{flower_port}
  {redis_line}{_broker_line(settings)}
  database: {safe_url(settings.database.url)}
  development tenant: {DEV_TENANT}  ·  API key: {key}

  Try:
    curl -N -X POST {web}/api/agents/{agent}/run \\
      -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\
      -d '{{"message": "{message}"}}'
    {runnable_command()} runs list --tenant {DEV_TENANT}
""",
        flush=True,
    )
