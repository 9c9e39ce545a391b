"""One Redis command on a connection this thread keeps: the hot path of scripts and sends.

redis-py runs every command through its client: a connection out of the pool and back
(two lock round trips and a process check), the command's observability records, the
response callbacks. That is about 60 us of CPU a command on top of the round trip, and a
run makes three script calls in the worker and two commands in the web. `command` sends on
a connection of the client's pool that this thread took once and keeps, with the client's
own retry policy (a dropped connection is reconnected and the command tried again, as
`Redis.execute_command` does) and health check; error replies raise as they do there.

The connection goes back to its pool when the thread ends. A process forked from this one
takes its own: a connection is never shared across a fork. `Redis.close` (the pool's
`disconnect`) closes it too; the next command opens it again.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

import redis
from hiredis import pack_command
from redis.connection import ConnectionPool, HiredisRespSerializer

from tracon_jobs import fast_paths


class _Lease:
    """A pool's connection taken by one thread; released when the thread lets go of it."""

    __slots__ = ("connection", "pid", "pool")

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = weakref.ref(pool)
        self.pid = os.getpid()
        self.connection: Any = pool.get_connection()

    def __del__(self) -> None:
        pool = self.pool()
        if pool is not None and self.pid == os.getpid():
            # a pool being torn down meanwhile: the socket closes with it
            with contextlib.suppress(Exception):
                pool.release(self.connection)


class _Held(threading.local):
    def __init__(self) -> None:
        self.leases: weakref.WeakKeyDictionary[ConnectionPool, _Lease] = weakref.WeakKeyDictionary()


_held = _Held()


def _connection(client: redis.Redis) -> Any:
    pool = client.connection_pool
    lease = _held.leases.get(pool)
    if lease is None or lease.pid != os.getpid():  # none yet, or the parent's (a fork)
        lease = _held.leases[pool] = _Lease(pool)
    return lease.connection


def _packed(connection: Any, args: tuple[Any, ...]) -> list[bytes] | None:
    """The command as redis-py's hiredis packer packs it, without its per-argument pass (it
    turns bytearrays and memoryviews into bytes; none are sent here); None: pack as usual (a
    connection of another packer, or a command name of several words)."""
    if not isinstance(connection._command_packer, HiredisRespSerializer) or " " in args[0]:
        return None
    try:
        return [pack_command(args)]
    except TypeError as exc:  # what the packer raises for an argument of another type
        raise redis.DataError(exc) from exc


def command(client: redis.Redis, *args: Any) -> Any:
    """`client.execute_command(*args)` for a command with no response callback (EVALSHA,
    LPUSH): the server's reply as it is (by that very call without fast paths)."""
    if not fast_paths.enabled("redis"):
        return client.execute_command(*args)
    connection = _connection(client)
    packed = _packed(connection, args)

    def send() -> Any:
        try:
            if packed is None:
                connection.send_command(*args)
            else:
                connection.send_packed_command(packed)
            return connection.read_response()
        except redis.ResponseError:  # an error reply, read whole: the connection is good
            raise
        except BaseException:
            # A command cut short (an interrupt between the send and the reply) would
            # leave its reply for the next command to read. The pool checks a connection
            # for that when it hands it out; a held one is dropped instead, and reconnects.
            connection.disconnect()
            raise

    def drop(_error: Exception) -> None:
        connection.disconnect()

    return connection.retry.call_with_retry(send, drop)
