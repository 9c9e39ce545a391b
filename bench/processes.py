"""The child processes a benchmark starts, and the promise that it stops every one of them.

Each child gets its own session (process group), so a gunicorn master and its workers stop
together, and a Ctrl-C in the terminal reaches only the benchmark, whose `finally` stops
the children in order instead of leaving them to race their own shutdown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT_SECONDS = 10.0
LOG_TAIL_CHARS = 2000


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""


class Children:
    """The processes started so far; `stop_all` is safe to call any number of times."""

    def __init__(self, log_dir: Path, cwd: Path) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self.running: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                list(argv),
                env=env,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        child = Child(name, process, log)
        self.running.append(child)
        return child

    def check_alive(self) -> None:
        """Fail fast, with its log, when a child died instead of waiting for a timeout."""
        for child in self.running:
            if not child.alive():
                raise RuntimeError(
                    f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}"
                )

    def stop_all(self) -> None:
        """SIGTERM every group at once, then SIGKILL whatever outlives the grace period."""
        for child in self.running:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for child in self.running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child, signal.SIGKILL)
                child.process.wait()
            _signal_group(child, signal.SIGKILL)  # a gunicorn worker left behind its master
        self.running = []


def _signal_group(child: Child, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, signum)


def run_checked(argv: Sequence[str], env: dict[str, str], cwd: Path) -> str:
    """Run a one-shot command to its end; its stdout, or RuntimeError with its output."""
    done = subprocess.run(list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def wait_until(
    ready: Callable[[], bool],
    what: str,
    timeout: float,
    children: Children | None = None,
    interval: float = 0.05,
) -> None:
    """Poll `ready` until it holds; TimeoutError naming `what` when it never does."""
    deadline = time.monotonic() + timeout
    while not ready():
        if children is not None:
            children.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(interval)
