"""A web node's drain: a flag file that its processes read on every run-starting request.

Draining is the file `TRACON_DRAIN_FILE` (default `var/drain`): SIGTERM to the gunicorn
arbiter, or `tracon-jobs drain`, creates it, and the listener stays open for
`Drain.Timeout` so the node can answer 503 while the load balancer moves away. A worker's
graceful stop is `tracon_jobs.worker.drain`.
"""

from __future__ import annotations

import os
from pathlib import Path

DRAIN_FILE_ENV = "TRACON_DRAIN_FILE"
DEFAULT_DRAIN_FILE = "var/drain"


def drain_file() -> Path:
    return Path(os.environ.get(DRAIN_FILE_ENV, DEFAULT_DRAIN_FILE))


def web_draining() -> bool:
    return drain_file().exists()


def start_web_drain() -> Path:
    path = drain_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))
    return path


def clear_web_drain() -> None:
    drain_file().unlink(missing_ok=True)
