"""Abortable HTTP: every pool of a client gets the abortable backend; an abort cuts a TLS wait."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tracon_jobs.abort import AbortSignal
from tracon_jobs.providers.abortable_http import AbortableBackend, abortable, make_abortable


def _backends(client: httpx2.Client) -> list[object]:
    transports = [client._transport, *client._mounts.values()]
    return [t._pool._network_backend for t in transports if t is not None]  # type: ignore[attr-defined]


def test_the_direct_pool_and_a_proxy_pool_are_both_made_abortable() -> None:
    client = httpx2.Client(proxy="http://127.0.0.1:9", trust_env=False)

    make_abortable(client)

    backends = _backends(client)
    assert len(backends) == 2
    assert all(isinstance(backend, AbortableBackend) for backend in backends)


def test_a_client_on_another_transport_is_refused() -> None:
    client = httpx2.Client(transport=httpx2.MockTransport(lambda request: httpx2.Response(200)))

    with pytest.raises(TypeError, match="cannot make MockTransport abortable"):
        make_abortable(client)


@pytest.fixture
def hanging_tls_server(tmp_path: Path) -> Iterator[int]:
    """A TLS server on 127.0.0.1 that reads a request and never answers; its port."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    request = [
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=localhost",
    ]
    subprocess.run(
        [openssl, *request, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            connection, _ = listener.accept()
            with context.wrap_socket(connection, server_side=True) as tls:
                tls.recv(65536)
                stop.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()


@pytest.mark.timeout(20)
def test_an_abort_cuts_a_wait_on_a_tls_connection(hanging_tls_server: int) -> None:
    # Given a call over TLS that the server will not answer for 30 s
    client = make_abortable(httpx2.Client(verify=False, timeout=15))
    signal = AbortSignal()
    threading.Timer(0.3, signal.abort).start()
    started = time.monotonic()

    # When another thread aborts it
    with pytest.raises(httpx2.TransportError), abortable(signal):
        client.post(f"https://localhost:{hanging_tls_server}/v1/chat/completions", json={})

    # Then the wait ends at once, not at the read timeout
    assert time.monotonic() - started < 5
    client.close()
