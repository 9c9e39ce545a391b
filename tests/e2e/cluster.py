"""Real tracon-jobs processes for crash and race tests: web, workers, beat, run by the
command's own `Supervisor` (a process group each, always stopped and reaped).

Each process writes to its own log file; `wait_for_log` blocks until a line appears, so
tests wait for facts (a worker's "ready.", a request in the access log) instead of sleeping.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests import helpers
from tracon_jobs.cli.supervisor import Child, Supervisor
from tracon_jobs.embedded_redis import free_port
from tracon_jobs.fast_paths import ENV_VAR as FAST_PATHS
from tracon_jobs.runtime import Runtime

REPO = Path(__file__).resolve().parents[2]

Process = Child
"""A started process: `popen`, its `text()` so far, `kill9()` of its whole process group."""

__all__ = ["REPO", "Cluster", "Process", "wait_for_log", "wait_until"]


@dataclass
class Cluster:
    directory: Path
    env: dict[str, str]
    children: Supervisor

    @classmethod
    def create(cls, directory: Path, sql_url: str, redis_url: str, **sections: Any) -> Cluster:
        sections.setdefault("Database", {"Url": sql_url})
        sections.setdefault("Redis", {"Url": redis_url})
        config = directory / "tracon.json"
        config.write_text(json.dumps({"Tracon": sections}))
        # the test's own TRACON_* variables stay out, but the switch of the fast paths goes in:
        # a pass with `TRACON_FAST_PATHS=off` must turn them off in every process it starts
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRACON")}
        if FAST_PATHS in os.environ:
            env[FAST_PATHS] = os.environ[FAST_PATHS]
        env.update(
            TRACON_CONFIG=str(config), PYTHONUNBUFFERED="1", C_FORCE_ROOT="1", PYTHONPATH=str(REPO)
        )
        return cls(directory, env, Supervisor(cwd=directory, log_dir=directory))

    def start(self, name: str, *args: str) -> Process:
        argv = [sys.executable, "-m", "tracon_jobs.cli", *args]
        return self.children.start(name, argv, self.env)

    def worker(self, name: str, concurrency: int = 4) -> Process:
        process = self.start(name, "worker", "-n", f"{name}@%h", "-c", str(concurrency))
        wait_for_log(process, "ready.", timeout=STARTUP_SECONDS)
        return process

    def web(self, workers: int = 1, name: str = "web", threads: int = 8) -> tuple[Process, str]:
        port = free_port()
        bind = f"127.0.0.1:{port}"
        process = self.start(
            name, "web", "--bind", bind, "--workers", str(workers), "--threads", str(threads)
        )
        base = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: _answers(base + "/healthz"),
            timeout=STARTUP_SECONDS,
            what="web /healthz",
            watch=[process],
        )
        return process, base

    def stop_all(self) -> None:
        self.children.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.text()[-4000:]}" for p in self.children.children)


STARTUP_SECONDS = 90
"""How long a process may take to start: a second or two on a quiet machine, far more on a
loaded CI runner; a process that exits first fails the test at once (`ChildExited`)."""

FAST_RECONCILE = {
    "Enabled": True,
    "HeartbeatInterval": "00:00:00.200",
    "OrphanThreshold": "00:00:02",
    "ScanInterval": "00:00:00.500",
}
"""Reconciliation settings for crash tests: an orphan is found within about 2.5 s."""


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


wait_until = functools.partial(helpers.wait_until, interval=0.05)
"""`tests.helpers.wait_until`, looking less often: the facts waited for here are other
processes'."""


def wait_for_log(process: Process, needle: str, *, timeout: float) -> None:
    """Until `needle` is in the process's log; `ChildExited` when it exits without it."""
    wait_until(
        lambda: needle in process.text(),
        timeout=timeout,
        what=f"'{needle}' in {process.name} log",
        watch=[process],
    )


def past_the_lines(runtime: Runtime) -> None:
    """`runtime` sends its runs straight to the run queue, past the fair lines, as a child
    run or an approval's resume is sent: with the worker's slots busy, the message waits in
    the run queue (or, at `Worker.PrefetchMultiplier` 2 or more, in the worker's pool,
    prefetched) instead of in a line."""
    runtime.dispatcher.fair = None
