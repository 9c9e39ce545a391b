"""Instructions a trivial run costs the executor, and a POST the web's app, in one process.

`python -m bench.instructions [--runs 200] [--posts 300] [--redis URL]` (needs valgrind).
Each part runs in a Python process under `valgrind --tool=callgrind` with instrumentation
off until the measured loop starts (`callgrind_control -i on`) and off again when it ends,
so start-up, migrations and the warm-up are not counted. Instructions are counted, not
seconds: the same code gives the same figure (within about 0.5%) whatever else the machine
is doing, where CPU seconds of the same code move by a tenth from one minute to the next on
a shared 2-CPU machine. Compare two commits by running this on each. Not part of
`make bench`: it takes a few minutes, and the rates are what the goals are about.

- executor: `RunExecutor.execute` of queued runs, one thread, scripted provider ("ok", no
  tools), SQLite file, Redis (the run's scripts and event publishes; the Redis server's own
  work is not counted).
- web POST: `POST /api/agents/bench/run` with `Prefer: respond-async` through the WSGI app
  (Flask, authentication, the row and `RunQueued`, the message pushed to Redis), no HTTP
  server in front.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

from bench.b1_throughput import AGENT, tracon_env, write_config
from bench.harness import ROOT
from tracon_jobs.embedded_redis import start_embedded

WORKER_CONCURRENCY = 16
"""B1's default: it sizes the pools, as in the worker B1 measures."""
WARMUP = 50
COLLECTED = re.compile(r"Collected : (\d+)")
MIN_PER_STEP = 100_000
"""Fewer instructions than this a run or a POST: the measured loop was not counted."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("--runs", type=int, default=200, help="executor runs counted")
    parser.add_argument("--posts", type=int, default=300, help="POSTs counted")
    parser.add_argument("--redis", help="Redis URL, flushed (default: an embedded server)")
    parser.add_argument("--child", choices=["executor", "web"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        measure_in_this_process(args.child, args.runs if args.child == "executor" else args.posts)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench.instructions needs valgrind (apt install valgrind)", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="tracon-instructions-"))
    embedded = None
    try:
        url = args.redis
        if url is None:
            embedded = start_embedded(workdir / "redis")
            url = embedded.url
        print(f"instructions in one process (callgrind), redis {url}")
        for part, count, unit in (("executor", args.runs, "run"), ("web", args.posts, "POST")):
            redis.Redis.from_url(url).flushdb()
            total = under_callgrind(part, count, workdir, url)
            label = "executor (RunExecutor.execute)" if part == "executor" else "web POST (WSGI)"
            print(f"  {label:<32} {total / count / 1e6:7.3f} M instructions a {unit}  (N={count})")
    finally:
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def under_callgrind(part: str, count: int, workdir: Path, redis_url: str) -> int:
    """Instructions the measured loop of `part` executed (valgrind's "Collected")."""
    config = write_config(workdir, WORKER_CONCURRENCY)  # B1's agent
    env = tracon_env(config, f"sqlite:///{workdir / part}.db", redis_url)
    flag = "--runs" if part == "executor" else "--posts"
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={workdir / part}.callgrind",
        sys.executable,
        "-m",
        "bench.instructions",
        "--child",
        part,
        flag,
        str(count),
    ]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    found = COLLECTED.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{part} under callgrind failed ({done.returncode}):\n{done.stderr}")
    total = int(found[-1])
    if total < count * MIN_PER_STEP:  # the switch never came: nothing (or little) was counted
        raise RuntimeError(f"{part}: callgrind counted {total} instructions; was it switched on?")
    return total


def measure_in_this_process(part: str, count: int) -> None:
    """Set up, warm up, then count the loop's instructions (callgrind's switch)."""
    from tracon_jobs.db.migrate import upgrade
    from tracon_jobs.settings import load_settings

    settings = load_settings()
    upgrade(settings.database.url)
    one = executor_step(settings, count) if part == "executor" else web_step()
    for _ in range(WARMUP):
        one()
    instrument("on")
    for _ in range(count):
        one()
    instrument("off")


def instrument(state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], capture_output=True)


def executor_step(settings: Any, count: int) -> Callable[[], None]:
    from tracon_jobs.runs.store import NewRun
    from tracon_jobs.runtime import Runtime

    runtime = Runtime(settings, sender=lambda _run_id: None)
    tenant = runtime.tenants.create_tenant(AGENT)
    queued = [
        runtime.dispatcher.submit(NewRun(tenant, AGENT, {"message": "x"}, resumable=True)).id
        for _ in range(count + WARMUP)
    ]
    queued.reverse()  # the oldest first

    def one() -> None:
        runtime.executor.execute(queued.pop())

    return one


def web_step() -> Callable[[], None]:
    from web import create_app

    app = create_app()
    tenants = app.extensions["tracon"].tenants
    key = tenants.issue_key(tenants.create_tenant(AGENT)).secret
    body = json.dumps({"message": "bench run"}).encode()

    def one() -> None:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": f"/api/agents/{AGENT}/run",
            "SERVER_NAME": "bench",
            "SERVER_PORT": "80",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "HTTP_AUTHORIZATION": f"Bearer {key}",
            "HTTP_PREFER": "respond-async",
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": "http",
            "wsgi.version": (1, 0),
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
        statuses: list[str] = []

        def start_response(status: str, _headers: Any, _exc_info: Any = None) -> Any:
            statuses.append(status)
            return lambda _data: None

        answer = app(environ, start_response)
        b"".join(answer)
        getattr(answer, "close", lambda: None)()
        if not statuses or not statuses[0].startswith("202"):
            raise RuntimeError(f"POST answered {statuses}")

    return one


if __name__ == "__main__":
    sys.exit(main())
