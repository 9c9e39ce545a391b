"""B10's DBOS Transact process: `python -m bench.b10_dbos_app --database URL --executor-id ID
[--concurrency 16] [--poll 0.05]`.

The twins of `bench.b10_workflows`' tracon workflows as `@DBOS.workflow`s whose `@DBOS.step`s
call the same `bench.b10_effects` functions, and two queues on the system database (`--database`,
which also holds `b10_effects`): `b10` (worker concurrency `--concurrency`, what W1 and the
recovery run on) and `b10-parked` (no limit: W3's waiting workflows, each holds its thread).
Both are polled every `--poll` seconds. Prints `READY` once launched, then runs until SIGTERM.
Started again after a kill -9 with the same `--executor-id` (and the same application version),
`DBOS.launch` recovers the workflows the killed process left pending, as DBOS documents.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from dbos import DBOS, DBOSConfig

from bench.b10_effects import EFFECTS_ENV, record, slow

APP_NAME = "b10-bench"
APP_VERSION = "b10"
"""Fixed, so a process started after a kill recovers what the killed one left (DBOS recovers
only the workflows of its own application version)."""
QUEUE = "b10"
PARKED_QUEUE = "b10-parked"
TOPIC = "answer"
PARK_SECONDS = 3600.0
"""How long a W3 workflow waits for its answer (`DBOS.recv`'s timeout)."""
READY = "b10 dbos ready"

THREE_STEPS = "b10-three-steps"
NO_STEPS = "b10-no-steps"
PARKED = "b10-parked"
SLOW = "b10-slow"


@DBOS.step(name="b10-record")
def record_step(key: str, step: str) -> str:
    return record(key, step)


@DBOS.step(name="b10-slow-step")
def slow_step(key: str, step: str, seconds: float) -> str:
    return slow(key, step, seconds)


@DBOS.workflow(name=THREE_STEPS)
def three_steps(key: str) -> str:
    for step in ("one", "two", "three"):
        record_step(key, step)
    return key


@DBOS.workflow(name=NO_STEPS)
def no_steps(key: str) -> str:
    return key


@DBOS.workflow(name=PARKED)
def parked(key: str) -> Any:
    return DBOS.recv(TOPIC, timeout_seconds=PARK_SECONDS)


@DBOS.workflow(name=SLOW)
def slow_steps(key: str, seconds: float) -> str:
    record_step(key, "one")
    slow_step(key, "two", seconds)
    record_step(key, "three")
    return key


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.b10_dbos_app", description=__doc__)
    parser.add_argument("--database", required=True, help="the system database's URL")
    parser.add_argument("--executor-id", required=True)
    parser.add_argument("--concurrency", type=int, default=16, help="queue b10's per worker")
    parser.add_argument("--poll", type=float, default=0.05, help="queue polling, seconds")
    args = parser.parse_args(argv)
    os.environ.setdefault(EFFECTS_ENV, args.database)
    config: DBOSConfig = {
        "name": APP_NAME,
        "system_database_url": args.database,
        "executor_id": args.executor_id,
        "application_version": APP_VERSION,
    }
    DBOS(config=config)
    DBOS.launch()
    for name, limit in ((QUEUE, args.concurrency), (PARKED_QUEUE, None)):
        DBOS.register_queue(
            name,
            worker_concurrency=limit,
            polling_interval_sec=args.poll,
            on_conflict="always_update",
        )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(READY, flush=True)
    stop.wait()
    DBOS.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
