"""What the benchmarks share: a work directory (kept, with the children's logs, when a run
fails or `--keep` asks), child processes that are always stopped, a web node or a server
started and waited for, the HTTP bits the local models speak, and the report's helpers."""

from __future__ import annotations

import json
import os
import shutil
import socket
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


def start_web(
    children: Supervisor,
    env: dict[str, str],
    *,
    workers: int,
    threads: int,
    name: str = "web",
    bind: str | None = None,
    inside: Callable[[list[str]], list[str]] | None = None,
) -> str:
    """`tracon-jobs web` as child `name`, bound to `bind` (a free local port when None), its
    command run through `inside` when given (a network namespace's wrapper); its base URL once
    `/healthz` answers."""
    bind = bind or f"127.0.0.1:{free_port()}"
    argv = [*CLI, "web", "--bind", bind, "--workers", str(workers), "--threads", str(threads)]
    children.start(name, argv if inside is None else inside(argv), env)
    base_url = f"http://{bind}"
    wait_until(
        lambda: healthy(base_url),
        what=f"{name} /healthz",
        timeout=STARTUP_TIMEOUT,
        watch=children.running(),
    )
    return base_url


def start_server(
    children: Supervisor, name: str, argv: list[str], env: dict[str, str], port: int
) -> None:
    """Start child `name`, then wait until it accepts connections on 127.0.0.1:`port`."""
    children.start(name, argv, env)
    wait_until(
        lambda: listening(port),
        what=name,
        timeout=STARTUP_TIMEOUT,
        watch=children.running(),
    )


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


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


# -- what the local OpenAI-compatible models speak ---------------------------------------------

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)
"""The head of a streamed answer: chunked, so the connection stays open for the next one."""


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def sse_end() -> bytes:
    """`data: [DONE]`, then the last chunk of the body."""
    return chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def sse_data(payload: dict[str, object]) -> bytes:
    """One `data:` event of a streamed answer, as one HTTP chunk."""
    return chunked(f"data: {json.dumps(payload)}\n\n".encode())


def completion_chunk(
    model: str, delta: dict[str, str], finish: str | None, *, ident: str = "chatcmpl-bench"
) -> dict[str, object]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [choice],
    }


def command_calls(client: redis.Redis) -> dict[str, int]:
    """How often the server ran each command so far (INFO commandstats: `publish`, `evalsha`,
    ...), commands run inside scripts included, this INFO too."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in stats.items()}


def commands(client: redis.Redis) -> int:
    """Every command the server ran so far (INFO commandstats), this INFO included."""
    return sum(command_calls(client).values())


# -- report ------------------------------------------------------------------------------------


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def met(ok: bool) -> str:
    return "met" if ok else "missed"
