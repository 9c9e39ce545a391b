"""Child processes started, watched and always stopped: `tracon-jobs dev`, the benchmarks and
the real-process tests all run theirs through `Supervisor`.

Each child gets its own session (process group), so a gunicorn master and its workers are
signalled together, and a Ctrl-C in the terminal reaches only the supervising process, which
stops the children itself instead of leaving them to race their own shutdown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

STOP_TIMEOUT_SECONDS = 10.0
LOG_TAIL_CHARS = 3000
REAP_SECONDS = 10.0


class ChildExited(RuntimeError):
    """A child that should be running has exited; the message ends with its log."""

    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with {child.popen.returncode}:\n{child.log_tail()}")
        self.child = child


class Child:
    """One started process: its own process group, its output in `log` (or the terminal)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path | None) -> None:
        self.name = name
        self.popen = popen
        self.log = log
        self.stopped = False  # killed and reaped: its group id may belong to others now

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        """Everything it wrote so far ('' while its output goes to the terminal)."""
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.text()[-chars:]

    def send(self, signum: signal.Signals) -> None:
        """Send `signum` to its whole process group (a no-op once the group is gone)."""
        if not self.stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signum)

    def kill9(self) -> None:
        """`kill -9` of its whole group, no chance to clean up; returns once it is reaped."""
        self.send(signal.SIGKILL)
        self.popen.wait(timeout=REAP_SECONDS)
        self.stopped = True


class Supervisor:
    """The children started so far; `stop` ends them all and is safe to call again.

    `log_dir`: each child writes stdout and stderr to `<log_dir>/<name>.log`; without it,
    the children share this process's terminal.
    """

    def __init__(
        self,
        *,
        cwd: Path | None = None,
        log_dir: Path | None = None,
        stop_timeout: float = STOP_TIMEOUT_SECONDS,
    ) -> None:
        self.cwd = cwd
        self.log_dir = log_dir
        self.stop_timeout = stop_timeout
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Child:
        log = None if self.log_dir is None else self.log_dir / f"{name}.log"
        with contextlib.ExitStack() as stack:
            out = None if log is None else stack.enter_context(log.open("wb"))
            popen = subprocess.Popen(
                list(argv),
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=None if out is None else subprocess.STDOUT,
                start_new_session=True,
            )
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def running(self) -> list[Child]:
        return [child for child in self.children if not child.stopped]

    def check_alive(self) -> None:
        """Fail fast, with its log, when a child has exited instead of waiting for a timeout."""
        for child in self.running():
            if not child.alive():
                raise ChildExited(child)

    def wait_for_exit(self, interval: float = 0.5) -> Child:
        """Block until one of the children exits; that child."""
        while True:
            for child in self.running():
                if not child.alive():
                    return child
            time.sleep(interval)

    def signal_all(self, signum: signal.Signals) -> None:
        for child in self.running():
            child.send(signum)

    def stop(self, only: list[Child] | None = None) -> None:
        """SIGTERM every group at once (of `only`, when given), SIGKILL whatever outlives
        `stop_timeout`; every child is reaped, and its group swept with SIGKILL (a gunicorn
        worker left behind)."""
        children = self.running() if only is None else [c for c in only if not c.stopped]
        for child in children:
            if child.alive():
                child.send(signal.SIGTERM)
                child.send(signal.SIGCONT)  # a stopped process acts on SIGTERM once resumed
        deadline = time.monotonic() + self.stop_timeout
        for child in children:
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.send(signal.SIGKILL)
                child.popen.wait()
            child.send(signal.SIGKILL)
            child.stopped = True


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    watch: Iterable[Child] = (),
    interval: float = 0.05,
) -> None:
    """Poll `ready` until it holds: TimeoutError naming `what` when it never does, and
    `ChildExited` as soon as a child of `watch` exits without it."""
    watched = list(watch)
    deadline = time.monotonic() + timeout
    while not ready():
        exited = [child for child in watched if not child.alive()]
        if exited:
            if ready():  # it said so just before exiting
                return
            raise ChildExited(exited[0])
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(interval)
