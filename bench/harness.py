"""What the benchmarks share: a work directory (kept, with the children's logs, when a run
fails or `--keep` asks), child processes that are always stopped, and a web node started
and waited for."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import redis
import sqlalchemy as sa

from tracon_jobs.cli.supervisor import Supervisor, wait_until
from tracon_jobs.embedded_redis import free_port

ROOT = Path(__file__).resolve().parent.parent
CLI = (sys.executable, "-m", "tracon_jobs.cli")
STARTUP_TIMEOUT = 60.0

SETUP_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError,
    TimeoutError,
    OSError,
    httpx.HTTPError,
    redis.RedisError,
    sa.exc.SQLAlchemyError,
)
"""A benchmark that fails with one of these did not complete: exit code 1, logs kept."""

Body = Callable[[Path, Supervisor, ExitStack], int]
"""A benchmark's work: (its work dir, its children, what to clean up after) -> exit code."""


def run_benchmark(name: str, keep: bool, body: Body, *, mode: int | None = None) -> int:
    """`body` in a fresh work dir with a `Supervisor` whose children are always stopped;
    130 on Ctrl-C, 1 (the work dir kept) when it fails with one of `SETUP_ERRORS`."""
    workdir = Path(tempfile.mkdtemp(prefix=f"tracon-{name}-"))
    if mode is not None:
        workdir.chmod(mode)
    try:
        with ExitStack() as cleanup:
            children = Supervisor(cwd=ROOT, log_dir=workdir)
            cleanup.callback(children.stop)
            return body(workdir, children, cleanup)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; every child process was stopped", file=sys.stderr)
        return 130
    except SETUP_ERRORS as exc:
        print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        keep = True  # the children's logs say why
        return 1
    finally:
        if keep:
            print(f"work dir and logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def start_web(children: Supervisor, env: dict[str, str], *, workers: int, threads: int) -> str:
    """`tracon-jobs web` on a free port; its base URL once `/healthz` answers."""
    bind = f"127.0.0.1:{free_port()}"
    argv = [*CLI, "web", "--bind", bind, "--workers", str(workers), "--threads", str(threads)]
    children.start("web", argv, env)
    base_url = f"http://{bind}"
    wait_until(
        lambda: healthy(base_url),
        what="web /healthz",
        timeout=STARTUP_TIMEOUT,
        watch=children.running(),
    )
    return base_url


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def group_cpu_seconds(pgid: int) -> float | None:
    """User plus system time of the live processes of process group `pgid`, all their
    threads (Linux `/proc`; None elsewhere): a web's master and workers together."""
    total, found = 0.0, False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile, or no /proc
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
            found = True
    return total / os.sysconf("SC_CLK_TCK") if found else None


class GroupCpu:
    """CPU seconds the process groups of some children spend from now to `stop`."""

    def __init__(self, pgids: dict[str, int]) -> None:
        self.pgids = pgids
        self.started = {name: group_cpu_seconds(pgid) for name, pgid in pgids.items()}
        self.seconds: dict[str, float] = {}

    def stop(self) -> None:
        for name, pgid in self.pgids.items():
            ended, started = group_cpu_seconds(pgid), self.started[name]
            if ended is not None and started is not None:
                self.seconds[name] = ended - started
