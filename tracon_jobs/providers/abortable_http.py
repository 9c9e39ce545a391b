"""Blocking HTTP calls that another thread can abort: the socket the call waits on is shut down.

Closing a client (or a socket) from another thread does not wake a thread blocked in `recv`;
`shutdown(SHUT_RDWR)` does, at once, and the blocked read returns end-of-stream. So every
connection an `httpx` client opens goes through `AbortableBackend`, whose streams tell the
calling thread's `CallGuard` which socket they are about to wait on; `abortable(signal)`
installs that guard for a block, and the signal's abort shuts the socket down. A connection
cut that way fails its request and is dropped from the pool; the others are untouched.

The call runs on the caller's own thread: no event loop and no hand-off between threads per
call, which matters when a hundred runs share one process and one GIL. A connect in progress
is interrupted where the OS allows it (Linux), else it ends at the client's connect timeout; a
TLS handshake ends at its timeout; every later wait (the request, the answer) ends at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore2
import httpx2
from httpcore2 import SOCKET_OPTION, NetworkStream, SyncBackend
from httpcore2._backends.sync import SyncStream  # the blocking stream over one socket

from tracon_jobs.abort import AbortSignal

_local = threading.local()


class CallGuard:
    """One thread's call: the socket it waits on right now, and whether it was aborted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting_on: socket.socket | None = None
        self.aborted = False

    def abort(self, _reason: str = "") -> None:
        with self._lock:
            self.aborted = True
            if self._waiting_on is not None:
                _shut_down(self._waiting_on)

    def enter(self, sock: socket.socket) -> None:
        """The thread is about to wait on `sock` (`leave` once it is done, whatever happened)."""
        with self._lock:
            if self.aborted:
                raise httpcore2.ReadError("the call was aborted")
            self._waiting_on = sock

    def leave(self) -> None:
        with self._lock:
            self._waiting_on = None

    @contextlib.contextmanager
    def waiting_on(self, sock: socket.socket) -> Iterator[None]:
        self.enter(sock)
        try:
            yield
        finally:
            self.leave()


@contextlib.contextmanager
def abortable(signal: AbortSignal) -> Iterator[CallGuard]:
    """Within the block, a wait of this thread on an abortable connection ends when `signal`
    fires (at once if it already has)."""
    guard = CallGuard()
    previous = getattr(_local, "guard", None)
    _local.guard = guard
    unregister = signal.on_abort(guard.abort)
    try:
        yield guard
    finally:
        unregister()
        _local.guard = previous


def _waiting(sock: socket.socket) -> contextlib.AbstractContextManager[None]:
    guard: CallGuard | None = getattr(_local, "guard", None)
    return contextlib.nullcontext() if guard is None else guard.waiting_on(sock)


def _shut_down(sock: socket.socket) -> None:
    # socket.socket's own shutdown, also for an SSLSocket: the TLS object stays with the
    # thread that is using it, only the descriptor is cut.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class AbortableStream(NetworkStream):
    """A connection whose every read, write and TLS handshake can be cut by its caller's guard."""

    def __init__(self, inner: NetworkStream, sock: socket.socket) -> None:
        self._inner = inner
        self._sock = sock

    # read and write are each chunk's path: the guard's calls inline, not a context manager
    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        guard: CallGuard | None = getattr(_local, "guard", None)
        if guard is None:
            return self._inner.read(max_bytes, timeout)
        guard.enter(self._sock)
        try:
            return self._inner.read(max_bytes, timeout)
        finally:
            guard.leave()

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        guard: CallGuard | None = getattr(_local, "guard", None)
        if guard is None:
            return self._inner.write(buffer, timeout)
        guard.enter(self._sock)
        try:
            self._inner.write(buffer, timeout)
        finally:
            guard.leave()

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> NetworkStream:
        with _waiting(self._sock):
            inner = self._inner.start_tls(ssl_context, server_hostname, timeout)
        # wrapping detached the plain socket from its descriptor: cut the TLS socket's
        return AbortableStream(inner, inner.get_extra_info("socket") or self._sock)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class AbortableBackend(SyncBackend):
    """httpcore's blocking backend, with connections its callers can abort."""

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> NetworkStream:
        try:
            sock = _connect(host, port, timeout, local_address, list(socket_options or ()))
        except TimeoutError as exc:
            raise httpcore2.ConnectTimeout(exc) from exc
        except OSError as exc:
            raise httpcore2.ConnectError(exc) from exc
        return AbortableStream(SyncStream(sock), sock)


def _connect(
    host: str,
    port: int,
    timeout: float | None,
    local_address: str | None,
    options: list[SOCKET_OPTION],
) -> socket.socket:
    """`socket.create_connection`, with the socket known to the guard while it connects."""
    failure: OSError | None = None
    for family, kind, proto, _name, address in socket.getaddrinfo(
        host, port, 0, socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        try:
            for option in options:
                sock.setsockopt(*option)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            if local_address:
                sock.bind((local_address, 0))
            with _waiting(sock):
                sock.connect(address)
            return sock
        except httpcore2.ReadError:  # aborted before it began
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            failure = exc
    raise failure or OSError(f"no address found for {host}:{port}")


def make_abortable(client: httpx2.Client) -> httpx2.Client:
    """Give every connection pool of `client` (proxies from the environment included) the
    abortable backend; a client built some other way fails here, not at the first abort."""
    # httpx takes no network backend of its own; its transports' pools (httpcore) do. These
    # private names are checked here, so an upgrade that moves them fails at the first call.
    for transport in [client._transport, *client._mounts.values()]:
        if transport is None:
            continue
        pool = getattr(transport, "_pool", None)
        if not isinstance(pool, httpcore2.ConnectionPool) or not hasattr(pool, "_network_backend"):
            raise TypeError(f"cannot make {type(transport).__name__} abortable")
        pool._network_backend = AbortableBackend()
    return client
