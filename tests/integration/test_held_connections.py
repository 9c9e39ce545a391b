"""`coordination.connections.command`: a thread's own connection of a client's pool, with the
client's retry, back to the pool when the thread ends, never shared across a fork (real
Redis, real threads and a real fork)."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tracon_jobs.coordination import connections
from tracon_jobs.coordination.connections import command
from tracon_jobs.coordination.scripts import Script


@pytest.fixture
def client(redis_client: redis.Redis, redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 1))


def test_a_thread_keeps_one_connection_for_its_commands(client: redis.Redis) -> None:
    # Given a client whose pool is empty
    pool = client.connection_pool

    # When one thread sends three commands
    for _ in range(3):
        command(client, "INCR", "held:n")

    # Then they went on one connection, held by the thread, and their replies came back
    assert client.get("held:n") == b"3"
    assert len(pool._in_use_connections) == 1


def test_the_connection_goes_back_to_the_pool_when_its_thread_ends(client: redis.Redis) -> None:
    # Given a thread that sent a command
    pool = client.connection_pool
    thread = threading.Thread(target=command, args=(client, "PING"))
    thread.start()
    thread.join()
    gc.collect()

    # Then its connection is back in the pool, open, for the next command of anyone
    assert len(pool._in_use_connections) == 0
    assert len(pool._available_connections) == 1


def test_a_dropped_connection_is_reconnected_and_the_command_tried_again(
    client: redis.Redis, redis_client: redis.Redis
) -> None:
    # Given a held connection the server has since closed
    command(client, "SET", "held:k", "1")
    own_id = command(client, "CLIENT", "ID")
    redis_client.client_kill_filter(_id=own_id)

    # When the thread sends its next command
    reply = command(client, "INCR", "held:k")

    # Then it went on a new connection, once
    assert reply == 2
    assert command(client, "CLIENT", "ID") != own_id


def test_an_error_reply_raises_as_redis_py_raises_it(client: redis.Redis) -> None:
    client.set("held:text", "abc")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        command(client, "INCR", "held:text")
    assert command(client, "PING") == b"PONG"  # the connection is still good


def test_a_script_the_server_forgot_is_loaded_again(client: redis.Redis) -> None:
    # Given a script called once, then the server's script cache flushed (a restart)
    script = Script(client, "return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert script(["held:s"], [2]) == 2
    client.script_flush()

    # When it is called again, it is loaded and runs
    assert script(["held:s"], [3]) == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_takes_a_connection_of_its_own(client: redis.Redis) -> None:
    # Given a parent whose thread holds a connection
    parent_id = command(client, "CLIENT", "ID")
    read, write = os.pipe()

    # When a forked child sends a command from the same thread
    pid = os.fork()
    if pid == 0:  # the child: report the id of the connection it used
        code = 1
        try:
            os.write(write, str(command(client, "CLIENT", "ID")).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    child_id = int(os.read(read, 64) or b"0")
    _, status = os.waitpid(pid, 0)
    os.close(read)

    # Then the child used a connection of its own, and the parent's still answers
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_id not in (0, parent_id)
    assert command(client, "CLIENT", "ID") == parent_id


def test_a_command_cut_short_leaves_no_reply_for_the_next(client: redis.Redis) -> None:
    # Given a command interrupted after it was sent, before its reply was read
    connection = _held_connection(client)
    real_read = connection.read_response

    def interrupted(*_args: object, **_kwargs: object) -> object:
        raise KeyboardInterrupt

    connection.read_response = interrupted
    with pytest.raises(KeyboardInterrupt):
        command(client, "SET", "held:cut", "1")
    connection.read_response = real_read

    # When the thread sends its next command, its own reply comes back (not the "OK")
    assert command(client, "GET", "held:cut") == b"1"


def _held_connection(client: redis.Redis) -> Any:
    command(client, "PING")
    return connections._connection(client)
