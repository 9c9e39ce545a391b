"""A real PgBouncer in transaction mode in front of a test's PostgreSQL server.

Started from Debian's `pgbouncer` package (`apt-get install -y pgbouncer`), on a free port of
its own, with its files in a directory of its own; it lets any database of the server through
(`* = host=... port=...`), and a test names its own scratch database (never another one's).
Transaction mode hands each transaction whichever server connection is free: nothing a
session sets survives it, prepared statements included (PgBouncer < 1.21 cannot keep them, and
Debian 12 ships 1.18), which is what `Database.PreparedStatements` is for.
"""

from __future__ import annotations

import inspect
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa

from tracon_jobs.embedded_redis import free_port

PREPARED_OFF = "prepare_threshold=none"
"""What a URL through PgBouncer carries: psycopg prepares nothing (`db.urls`)."""

START_SECONDS = 15.0
"""How long PgBouncer may take to accept connections."""

SERVER_POOL_SIZE = 40
"""Server connections PgBouncer opens per database and user (its clients, the processes of a
real-process test, may hold more: a transaction waits for a free one)."""

UNPRIVILEGED = "nobody"
"""Who PgBouncer runs as when the tests run as root (it refuses to run as root)."""


def binary() -> str | None:
    """The `pgbouncer` binary (Debian installs it in /usr/sbin, off a user's PATH)."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")


class PgBouncer:
    """One PgBouncer process in transaction mode in front of `server_url`'s server."""

    def __init__(self, executable: str, server_url: str) -> None:
        self.server = sa.engine.make_url(server_url)
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="tracon-pgbouncer-"))
        self.directory.chmod(0o755)  # pytest's own folders are the root user's alone
        self.log = self.directory / "pgbouncer.log"
        config = self._write_config()
        command = [executable, str(config)]
        if os.geteuid() == 0:
            command += ["-u", UNPRIVILEGED]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_listening()

    def _write_config(self) -> Path:
        user = self.server.username or "postgres"
        target = f"host={self.server.host or '127.0.0.1'} port={self.server.port or 5432}"
        if self.server.password:
            target += f" user={user} password={self.server.password}"
        users = self.directory / "userlist.txt"
        users.write_text(f'"{user}" ""\n')
        config = self.directory / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = {target}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {SERVER_POOL_SIZE}\n"
            "max_client_conn = 1000\n"
            "server_check_delay = 0\n"
            "ignore_startup_parameters = extra_float_digits\n"
        )
        for path in (users, config):
            path.chmod(0o644)
        return config

    def _wait_until_listening(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer did not listen within {START_SECONDS:g} s")

    def url(self, database: str, *, prepared_statements: bool = False) -> str:
        """A URL of `database` through PgBouncer; without prepared statements unless asked."""
        url = self.server.set(host="127.0.0.1", port=self.port, database=database, password=None)
        text = url.render_as_string(hide_password=False)
        return text if prepared_statements else f"{text}?{PREPARED_OFF}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def sql_url_tests_of(module: ModuleType, *only: str) -> dict[str, Any]:
    """The tests of `module` that take `sql_url`, themselves or through the module's own
    fixtures, with every fixture of the module they take: for a module that runs them again
    with `sql_url` overridden (through PgBouncer). `only` names some of them (all if none)."""
    local = vars(module)

    def closure(name: str) -> set[str]:
        """`name` and the module's fixtures it takes, and theirs."""
        found, todo = {name}, [name]
        while todo:
            for parameter in inspect.signature(local[todo.pop()]).parameters:
                if callable(local.get(parameter)) and parameter not in found:
                    found.add(parameter)
                    todo.append(parameter)
        return found

    adopted: dict[str, Any] = {}
    for name in sorted(local):
        if not name.startswith("test_") or (only and name not in only):
            continue
        names = closure(name)
        if any("sql_url" in inspect.signature(local[n]).parameters for n in names):
            adopted.update({n: local[n] for n in names})
    missing = set(only) - set(adopted)
    assert not missing, f"not tests of {module.__name__} on sql_url: {sorted(missing)}"
    return adopted
