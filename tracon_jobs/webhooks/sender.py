"""One delivery attempt of a webhook: a POST to a destination checked at this very attempt,
whose every outcome is an `AttemptResult` rather than an exception.

How the destination check cannot be got around:

- The host is resolved here, by `addresses.resolve`, and the TCP connection goes to the very
  addresses it returned (`_PinnedBackend`): there is no second lookup, so a name that resolved
  to a public address for the check cannot resolve to 127.0.0.1 for the connect (DNS
  rebinding).
- The URL keeps its host name, so httpcore takes the Host header, the TLS server name (SNI)
  and the name the certificate is verified against from it, exactly as without pinning; only
  the connect is redirected. Certificate verification is always on for https: the sender
  takes a CA (for tests, or a private CA) but never a context that skips verification.
- A pool of connections is kept per (scheme, host, port, resolved addresses): a connection is
  reused only by an attempt whose own resolution gave the same addresses, and never across
  host names (a certificate proves one name, not every name behind an address).
- No redirect is followed (a 3xx fails the attempt, naming its Location), no cookie is kept
  (endpoints of different tenants may share a host), no proxy is taken from the environment
  (a proxy would resolve the name itself).

One deadline bounds the whole attempt: each connect, TLS handshake, write and read may take
only what is left of it (`_PinnedStream`), so a server that drips a byte at a time cannot
stretch an attempt. The name's lookup is the system resolver's, bounded by its own timeout.
The response body is read up to `max_response_bytes` (the response is closed then), and
asked for without compression, so the excerpt's size is the size read.

Nothing of the request's headers (they hold signatures), its body, or the URL's path and
query (some receivers put a token there) is logged: only scheme, host, port and outcome.
"""

from __future__ import annotations

import contextvars
import importlib.metadata
import logging
import os
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import httpcore2
import httpx2
from httpcore2 import SOCKET_OPTION, NetworkStream, SyncBackend

from tracon_jobs.webhooks.addresses import (
    DestinationRefused,
    Destinations,
    IPAddress,
    resolve,
    url_problem,
)

logger = logging.getLogger(__name__)

POOLS_KEPT = 256
"""Destinations whose idle connections are kept; the least recently used beyond are closed."""

KEEPALIVE_PER_POOL = 4
"""Idle connections kept per destination: a few workers delivering to one endpoint at once."""

KEEPALIVE_EXPIRY = 30.0
"""Seconds an idle connection is kept: below the usual 60 s of servers' own idle timeouts, so
we rarely reuse a connection the server is closing."""

LOCATION_SHOWN = 200
"""Characters of a redirect's Location kept in the error: it is the receiver's text."""

DEFAULT_PORTS = {"http": 80, "https": 443}


def _version() -> str:
    # The installed distribution's version: `tracon_jobs.__version__` would import the package's
    # public surface (agents, workflows) into the webhooks layer.
    try:
        return importlib.metadata.version("tracon-jobs")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


USER_AGENT = f"tracon-jobs-webhooks/{_version()}"
"""The User-Agent of every delivery, so receivers can tell (and allow) our requests."""


@dataclass(frozen=True)
class AttemptResult:
    """What one attempt came to, as the attempts table stores it: the status when a response
    came (None when none did), the time it took, why it failed (None when it did not) and the
    start of the response body as text."""

    status: int | None
    latency_ms: int
    error: str | None
    response_excerpt: str

    @property
    def succeeded(self) -> bool:
        """A 2xx answer: the receiver took the message; anything else is retried."""
        return self.status is not None and 200 <= self.status < 300


_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "webhook_attempt_deadline", default=None
)
"""The monotonic time the current thread's attempt must end by. Connections outlive attempts
(they are pooled), so their streams read the deadline of the attempt using them from here."""


def _bounded(timeout: float | None, expired: type[Exception]) -> float | None:
    """`timeout`, cut to what is left of the attempt; `expired` once nothing is left."""
    deadline = _deadline.get()
    if deadline is None:  # not within an attempt (a pool closing its connections)
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the attempt's time is up")
    return left if timeout is None else min(timeout, left)


class _PinnedStream(NetworkStream):
    """A connection whose every wait ends by the deadline of the attempt using it."""

    def __init__(self, inner: NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore2.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore2.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> NetworkStream:
        # `server_hostname` is the URL's host (httpcore's origin): SNI and the certificate's
        # name check are those of the name, whatever address the socket reached.
        bounded = _bounded(timeout, httpcore2.ConnectTimeout)
        return _PinnedStream(self._inner.start_tls(ssl_context, server_hostname, bounded))

    def get_extra_info(self, info: str) -> object:
        return self._inner.get_extra_info(info)


class _PinnedBackend(SyncBackend):
    """httpcore's blocking backend, connecting to addresses resolved and checked beforehand
    instead of looking the host up again: tried in the resolver's order, as
    `socket.create_connection` would (a host may list an IPv6 address this machine cannot
    reach)."""

    def __init__(self, addresses: tuple[IPAddress, ...]) -> None:
        self._addresses = addresses

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> NetworkStream:
        failure: Exception = httpcore2.ConnectError(f"no address to connect to for {host}")
        for address in self._addresses:
            bounded = _bounded(timeout, httpcore2.ConnectTimeout)
            try:
                stream = super().connect_tcp(
                    str(address), port, bounded, local_address, list(socket_options or ())
                )
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                failure = exc
                continue
            return _PinnedStream(stream)
        raise failure


_PoolKey = tuple[str, str, int, frozenset[IPAddress]]


class _Pools:
    """Connection pools per destination and resolved addresses, the least recently used
    closed beyond `POOLS_KEPT`. Closing one cuts an attempt still using it (it fails and is
    retried); with that many destinations more recent, this is rare."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self._pools: OrderedDict[_PoolKey, httpcore2.ConnectionPool] = OrderedDict()

    def pool(
        self, url: httpx2.URL, port: int, addresses: list[IPAddress]
    ) -> httpcore2.ConnectionPool:
        key = (url.scheme, url.raw_host.decode("ascii"), port, frozenset(addresses))
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = self._new_pool(tuple(addresses))
            self._pools.move_to_end(key)
            evicted = self._pools.popitem(last=False)[1] if len(self._pools) > POOLS_KEPT else None
        if evicted is not None:
            evicted.close()
        return pool

    def _new_pool(self, addresses: tuple[IPAddress, ...]) -> httpcore2.ConnectionPool:
        return httpcore2.ConnectionPool(
            ssl_context=self._tls,
            max_connections=None,  # the delivery workers' concurrency is the bound
            max_keepalive_connections=KEEPALIVE_PER_POOL,
            keepalive_expiry=KEEPALIVE_EXPIRY,
            network_backend=_PinnedBackend(addresses),
        )

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            pool.close()


def tls_context(verify: ssl.SSLContext | str | None) -> ssl.SSLContext:
    """The TLS client context of deliveries: the system's trust store (None), a CA file or
    directory (a path), or a context of the caller's, which must verify certificates and host
    names (ValueError otherwise): a webhook is signed, but only TLS keeps it from being read."""
    if verify is None:
        return httpcore2.default_ssl_context()
    if isinstance(verify, str):
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        return ssl.create_default_context(cafile=verify)
    if verify.verify_mode != ssl.CERT_REQUIRED or not verify.check_hostname:
        raise ValueError("a webhook TLS context must verify certificates and host names")
    return verify


class Sender:
    """Sends webhook attempts; one instance serves every thread of a process (its pools are
    shared, its state per attempt lives on the calling thread)."""

    def __init__(
        self,
        policy: Destinations,
        timeout: float,
        max_response_bytes: int = 2048,
        *,
        verify: ssl.SSLContext | str | None = None,
    ) -> None:
        self._policy = policy
        self._timeout = float(timeout)
        self._max_response_bytes = max_response_bytes
        self._pools = _Pools(tls_context(verify))

    def send(self, url: str, body: bytes, headers: Mapping[str, str]) -> AttemptResult:
        """POST `body` with `headers` to `url`, within the sender's timeout."""
        started = time.monotonic()
        token = _deadline.set(started + self._timeout)
        try:
            status, excerpt, error = self._attempt(url, body, headers)
        finally:
            _deadline.reset(token)
        result = AttemptResult(status, int((time.monotonic() - started) * 1000), error, excerpt)
        logger.info("webhook attempt to %s: %s", _destination(url), _outcome(result))
        return result

    def close(self) -> None:
        """Close every kept connection (at shutdown)."""
        self._pools.close()

    def _attempt(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int | None, str, str | None]:
        # The addresses are checked after resolution, where the refusal can name their kind.
        problem = url_problem(url, replace(self._policy, allow_private_networks=True))
        if problem is not None:
            return None, "", f"refused destination: the URL {problem}"
        try:
            return self._exchange(httpx2.URL(url), body, headers)
        except DestinationRefused as exc:
            return None, "", f"refused destination: {exc.reason}"
        except _TROUBLE as exc:
            return None, "", self._describe(exc)

    def _exchange(
        self, url: httpx2.URL, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, str, str | None]:
        port = url.port or DEFAULT_PORTS[url.scheme]
        addresses = resolve(url.raw_host.decode("ascii"), port, self._policy)
        pool = self._pools.pool(url, port, addresses)
        response = pool.handle_request(self._request(url, port, body, headers))
        try:
            excerpt = _excerpt(response, self._max_response_bytes)
        finally:
            response.close()
        return response.status, excerpt, _status_problem(response)

    def _request(
        self, url: httpx2.URL, port: int, body: bytes, headers: Mapping[str, str]
    ) -> httpcore2.Request:
        # httpx2's Request writes the Host header (brackets for IPv6, the port when not the
        # default) and Content-Length; httpcore2 carries it to the pinned connection.
        prepared = httpx2.Request(
            "POST",
            url,
            headers={"user-agent": USER_AGENT, "accept-encoding": "identity", **headers},
            content=body,
        )
        left = _bounded(None, httpcore2.PoolTimeout)
        return httpcore2.Request(
            method=b"POST",
            url=httpcore2.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=port, target=url.raw_path
            ),
            headers=prepared.headers.raw,
            content=body,
            extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), left)},
        )

    def _describe(self, exc: Exception) -> str:
        if isinstance(exc, httpcore2.TimeoutException):
            return f"timeout after {self._timeout} s"
        return _failure(exc)


_TROUBLE = (
    httpcore2.TimeoutException,
    httpcore2.NetworkError,
    httpcore2.ProtocolError,
    httpcore2.UnsupportedProtocol,
    httpx2.InvalidURL,
    OSError,
)
"""What a network or a receiver can do to an attempt; anything else is our own bug and
raises."""


def _failure(exc: Exception) -> str:
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, httpcore2.ConnectError):
        return _connect_failure(cause or exc)
    if isinstance(exc, OSError):
        return _connect_failure(exc)
    if isinstance(exc, httpcore2.ReadError | httpcore2.WriteError):
        return f"connection lost: {exc or cause or type(exc).__name__}"
    if isinstance(exc, httpcore2.ProtocolError):
        return f"protocol error: {exc}"
    return f"invalid URL: {exc}"


def _connect_failure(cause: BaseException) -> str:
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"TLS certificate not accepted: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError):
        return f"TLS handshake failed: {cause.reason or cause}"
    if isinstance(cause, OSError) and cause.strerror:
        return f"connection failed: {cause.strerror}"
    return f"connection failed: {cause or type(cause).__name__}"


def _excerpt(response: httpcore2.Response, limit: int) -> str:
    """The start of the body, `limit` bytes at most; what could not be read is left out (the
    status already tells whether the receiver took the message)."""
    read = bytearray()
    if limit <= 0:
        return ""
    try:
        for chunk in response.iter_stream():
            read += chunk[: limit - len(read)]
            if len(read) >= limit:
                break
    except _TROUBLE:
        pass
    return read.decode("utf-8", errors="replace")


def _status_problem(response: httpcore2.Response) -> str | None:
    status = response.status
    if 200 <= status < 300:
        return None
    if 300 <= status < 400:
        location = _header(response, b"location")
        target = location[:LOCATION_SHOWN] if location else "no Location"
        return f"redirect not followed ({status} to {target})"
    return f"HTTP {status}"


def _header(response: httpcore2.Response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _destination(url: str) -> str:
    """`scheme://host:port` of a URL, nothing of its path or query."""
    try:
        parsed = httpx2.URL(url)
    except httpx2.InvalidURL:
        return "an invalid URL"
    port = parsed.port or DEFAULT_PORTS.get(parsed.scheme)
    return f"{parsed.scheme}://{parsed.host}:{port}"


def _outcome(result: AttemptResult) -> str:
    done = f"{result.latency_ms} ms"
    if result.error is None:
        return f"HTTP {result.status} in {done}"
    return f"{result.error} in {done}"
