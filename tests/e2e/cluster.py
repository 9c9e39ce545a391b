"""Real tracon-jobs processes for crash and race tests: web, workers, beat.

Each process writes to its own log file; `wait_for_log` blocks until a line appears, so
tests wait for facts ("ready", "received") instead of sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tracon_jobs.embedded_redis import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill9(self) -> None:
        os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)


@dataclass
class Cluster:
    directory: Path
    env: dict[str, str]
    processes: list[Process] = field(default_factory=list)

    @classmethod
    def create(cls, directory: Path, sql_url: str, redis_url: str, **sections: Any) -> Cluster:
        sections.setdefault("Database", {"Url": sql_url})
        sections.setdefault("Redis", {"Url": redis_url})
        config = directory / "tracon.json"
        config.write_text(json.dumps({"Tracon": sections}))
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TRACON")}
        env.update(
            TRACON_CONFIG=str(config), PYTHONUNBUFFERED="1", C_FORCE_ROOT="1", PYTHONPATH=str(REPO)
        )
        return cls(directory, env)

    def start(self, name: str, *args: str) -> Process:
        log = self.directory / f"{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(
            [sys.executable, "-m", "tracon_jobs.cli", *args],
            env=self.env,
            cwd=self.directory,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # kill9 takes the whole process group
        )
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def worker(self, name: str, concurrency: int = 4) -> Process:
        process = self.start(name, "worker", "-n", f"{name}@%h", "-c", str(concurrency))
        wait_for_log(process, "ready.", timeout=30)
        return process

    def web(self, workers: int = 1, name: str = "web") -> tuple[Process, str]:
        port = free_port()
        process = self.start(
            name, "web", "--bind", f"127.0.0.1:{port}", "--workers", str(workers), "--threads", "8"
        )
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(base + "/healthz"), timeout=30, what="web /healthz")
        return process, base

    def stop_all(self) -> None:
        for process in self.processes:
            if process.popen.poll() is None:
                os.killpg(process.popen.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.text()[-4000:]}" for p in self.processes)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def wait_for_log(process: Process, needle: str, *, timeout: float) -> None:
    def seen() -> bool:
        if process.popen.poll() is not None and needle not in process.text():
            raise RuntimeError(f"{process.name} exited:\n{process.text()[-3000:]}")
        return needle in process.text()

    wait_until(seen, timeout=timeout, what=f"'{needle}' in {process.name} log")
