"""The long-running processes: `migrate` before them, then `web` (gunicorn and its draining
arbiter), `worker`, `beat` and `flower` (Celery, with the periodic tasks installed)."""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import time
from typing import TYPE_CHECKING, Any

from gunicorn import glogging
from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter
from gunicorn.util import import_app

from tracon_jobs.cli.context import VAR, load_runtime, safe_url
from tracon_jobs.drain_file import clear_web_drain, start_web_drain

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    from celery import Celery
    from celery.beat import Service

    from tracon_jobs.runtime import Runtime

WEB_APP = "web:create_app()"
"""The WSGI app, named as gunicorn names one: the core never imports the `web` package."""


def cmd_migrate(args: argparse.Namespace, rest: list[str]) -> int:
    """Upgrade the database of a configuration every other command would accept: the
    runtime is built first (tool and workflow modules imported, agents' tools, secrets read
    at startup), so a configuration the processes will refuse is refused here, not after a
    deploy's migration has run. Building it connects to neither Redis nor the database."""
    from tracon_jobs.db.migrate import upgrade

    runtime = load_runtime()
    runtime.close()
    url = runtime.settings.database.url
    upgrade(url, prepared_statements=runtime.settings.database.prepared_statements)
    print(f"database migrated: {safe_url(url)}")
    return 0


# -- web -----------------------------------------------------------------------------------


def cmd_web(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs.metrics import prepare_multiprocess_dir

    # Before anything records a metric, and before gunicorn forks: its workers share one
    # directory of metric files that /metrics merges (a node's own, by its bind address).
    prepare_multiprocess_dir(VAR / "prometheus" / re.sub(r"[^\w.-]+", "_", f"web-{args.bind}"))
    runtime = load_runtime()
    runtime.close()  # fail at startup (settings, tool modules), not in the first request
    drain = runtime.settings.drain
    clear_web_drain()  # a flag left by an earlier stop must not make a new node refuse
    DrainingArbiter.drain_seconds = drain.timeout.total_seconds() if drain.enabled else None
    keepalive = math.ceil(runtime.settings.web.keep_alive.total_seconds())  # gunicorn: whole s
    DrainingArbiter(WebApplication(args.bind, args.workers, args.threads, keepalive)).run()
    return 0


class WebApplication(BaseApplication):
    """gunicorn serving `WEB_APP` on gthread workers (answering gunicorn's own errors as
    problem+json), with no request timeout."""

    def __init__(self, bind: str, workers: int, threads: int, keepalive: int) -> None:
        self.options = {
            "bind": bind,
            "workers": workers,
            "threads": threads,
            "keepalive": keepalive,
        }
        super().__init__()  # loads the config: `options` must be set first

    def load_config(self) -> None:
        for name, value in self.options.items():
            self.cfg.set(name, value)
        self.cfg.set("worker_class", "tracon_jobs.cli.web_worker.ProblemThreadWorker")
        self.cfg.set("timeout", 0)  # SSE streams live as long as their runs
        self.cfg.set("graceful_timeout", 30)
        self.cfg.set("accesslog", "-")
        self.cfg.set("logger_class", RedactingLogger)
        self.cfg.set("post_fork", _post_fork)
        self.cfg.set("post_worker_init", _post_worker_init)

    def load(self) -> Any:
        return import_app(WEB_APP)


LINKS_PATH = "/approvals/links/"
CREDENTIAL_PATHS = re.compile(r"(/approvals/links/)[^/?\s\"]+")
"""Paths whose last part is a credential: a one-time approval link's token decides alone."""


class RedactingLogger(glogging.Logger):
    """gunicorn's logger, whose access lines show `/approvals/links/<redacted>`: the link's
    token is its credential and never reaches a log, whichever atom a format names (the
    request line, the path, the referrer, a header or an environ variable)."""

    def atoms(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> Any:
        atoms = super().atoms(resp, req, environ, request_time)
        seen = f"{environ.get('RAW_URI', '')} {environ.get('HTTP_REFERER', '')}"
        if LINKS_PATH not in seen:  # every other request: nothing to look through
            return atoms
        for key, value in atoms.items():
            if isinstance(value, str) and LINKS_PATH in value:
                atoms[key] = CREDENTIAL_PATHS.sub(r"\1<redacted>", value)
        return atoms


def _post_fork(server: Any, worker: Any) -> None:
    """In each gunicorn worker, after its fork: tracing starts here, never in the master
    (the SDK's export thread would not follow the fork)."""
    from tracon_jobs import tracing

    tracing.start("web")


def _post_worker_init(worker: Any) -> None:
    """In each gunicorn worker, once it loaded the app and before its first request."""
    worker.wsgi.extensions["tracon"].read_before_serving()


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


# -- Celery --------------------------------------------------------------------------------


def celery_with_periodic_tasks(runtime: Runtime) -> Celery:
    """The runtime's Celery app with the periodic tasks and their schedule installed."""
    import beat_schedules

    beat_schedules.install(runtime.celery, runtime)
    return runtime.celery


def log_level() -> str:
    """`TRACON_LOG_LEVEL` (default `INFO`), which Celery's own setup would otherwise reset."""
    return os.environ.get("TRACON_LOG_LEVEL", "INFO").upper()


def concurrency_with_reserve(rest: list[str], reserve: int) -> list[str]:
    """Celery's `-c N` (`--concurrency`) given to `tracon-jobs worker` means what
    `Worker.Concurrency` N does: N slots, and the pool grows by `Worker.FairReserve`."""
    out: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg in ("-c", "--concurrency") and i + 1 < len(rest) and rest[i + 1].isdigit():
            out += [arg, str(int(rest[i + 1]) + reserve)]
            i += 2
            continue
        for flag in ("--concurrency=", "-c"):
            value = arg[len(flag) :]
            if arg.startswith(flag) and value.isdigit():
                arg = f"{flag}{int(value) + reserve}"
                break
        out.append(arg)
        i += 1
    return out


def cmd_worker(args: argparse.Namespace, rest: list[str]) -> int:
    runtime = load_runtime()
    app = celery_with_periodic_tasks(runtime)
    runtime.open_connections()
    runtime.read_before_serving()
    reserve = runtime.settings.worker.fair_reserve
    rest = concurrency_with_reserve(rest, reserve)
    argv = [
        "worker",
        "-c",
        str(runtime.settings.worker.threads),
        "-Q",
        "tracon.runs,tracon.control",
        # Mingle asks the other workers for their revoked task ids and waits a second for
        # the answer; runs are canceled through the run store, never by a Celery revoke.
        "--without-mingle",
        "--loglevel",
        log_level(),
        *rest,
    ]
    app.worker_main(argv)
    return 0


def stop_once(service: Service) -> Callable[[int, FrameType | None], None]:
    """Beat's SIGINT/SIGTERM handler: the first signal stops the service, the ones after it
    are ignored.

    Celery's own handler syncs the schedule and raises SystemExit on every signal. On Ctrl-C,
    `tracon-jobs dev` sends SIGINT and then SIGTERM, and the second one used to land wherever
    beat was on its way out: in the first handler's `Event.set`, or in the interpreter's wait
    for beat's threads, each a traceback. Raised once, from the service's loop, SystemExit
    reaches `Service.start`, which syncs the schedule as it leaves. Before the loop, the
    signal only sets the service's shutdown event (Celery >= 5.7 stamps `_last_tick` just
    before the loop)."""

    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        # Not SIG_IGN: a signal already caught by the interpreter's C handler would then be
        # reported as "ignored due to race condition", with a traceback.
        nonlocal stopping
        if stopping:
            return
        stopping = True
        # should the SystemExit be swallowed, the service's loop still ends at its next turn
        shutdown = getattr(service, "_is_shutdown", None)
        if shutdown is not None:
            shutdown.set()
            if getattr(service, "_last_tick", None) is None:
                # Not in its loop yet (opening the schedule, say): raised here, SystemExit
                # would leave `Service.start` before the `try` that syncs the schedule.
                # The loop sees the event at its first turn and ends there, syncing.
                return
        raise SystemExit()

    return stop


def beat_class(app: Celery) -> type:
    """The app's `Beat` with `stop_once` as its signal handler."""
    base: Any = app.Beat

    class Beat(base):
        def install_sync_handler(self, service: Service) -> None:
            handler = stop_once(service)
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)

    return Beat


def cmd_beat(args: argparse.Namespace, rest: list[str]) -> int:
    from tracon_jobs import tracing

    tracing.start("beat")  # beat forks nothing: its scans' spans go from here
    app = celery_with_periodic_tasks(load_runtime())
    app.Beat = beat_class(app)
    VAR.mkdir(exist_ok=True)
    schedule = str(VAR / "celerybeat-schedule")
    app.start(["beat", "-s", schedule, "--loglevel", log_level(), *rest])
    return 0


def cmd_flower(args: argparse.Namespace, rest: list[str]) -> int:
    app = celery_with_periodic_tasks(load_runtime())  # Flower shows the periodic tasks' names
    argv = ["flower", *rest] if rest else ["flower", "--address=127.0.0.1", "--port=5555"]
    try:
        app.start(argv)
    finally:
        # Flower's SIGTERM handler raises SystemExit wherever the main thread is. On Ctrl-C,
        # `tracon-jobs dev` passes SIGINT to every process and sends SIGTERM after it, which
        # used to land in the interpreter's wait for Flower's threads: a traceback on the
        # way out. Once Flower has stopped, a stop signal has nothing left to do.
        # (A Python handler that does nothing, not SIG_IGN: see `stop_once`.)
        signal.signal(signal.SIGTERM, _nothing)
        signal.signal(signal.SIGINT, _nothing)
    return 0


def _nothing(signum: int, frame: FrameType | None) -> None:
    pass
