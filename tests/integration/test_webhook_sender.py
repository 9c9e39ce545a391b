"""One webhook attempt over real HTTP: receivers on 127.0.0.1 started by the test record every
connection and request. What arrives, how failures read, the attempt's one deadline, no
redirect followed, a bounded excerpt; destinations refused before any connection; https
verified against the URL's host name while the connection goes to the pinned address."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.local_server import LocalServer
from tracon_jobs.webhooks import signing
from tracon_jobs.webhooks.addresses import Destinations
from tracon_jobs.webhooks.sender import AttemptResult, Sender

pytestmark = pytest.mark.timeout(30)

OPEN = Destinations(allow_http=True, allow_private_networks=True)
"""A development setup's policy: the receivers of these tests live on 127.0.0.1."""

HTTP_ONLY = Destinations(allow_http=True)
"""Plain http allowed, private networks not: what must be refused is refused for its address."""

SECRET = signing.new_secret()
BODY = b'{"type": "run.completed", "data": {"id": "run_1", "note": "caf\xc3\xa9"}}'
LARGE = b"0123456789" * 100_000
HANG = 10.0
"""Seconds a slow handler holds its answer at most, well past any sender timeout here."""


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class _Server(LocalServer):
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        super().__init__(("127.0.0.1", 0), _Handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.receiver.connections += 1  # every accepted TCP connection, before any byte
        return True

    def finish_request(self, request: Any, client_address: Any) -> None:
        tls = self.receiver.tls
        if tls is not None:
            request = tls.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (a timeout, a refused certificate): expected here


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so reused connections can be seen
    server: _Server

    def do_POST(self) -> None:
        receiver = self.server.receiver
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        path = urlsplit(self.path).path
        receiver.record(Received("POST", self.path, dict(self.headers.items()), body))
        answer = getattr(self, f"_answer_{path.strip('/').replace('-', '_')}", self._answer_ok)
        answer()

    def _answer_ok(self) -> None:
        self._reply(200, b"thanks")

    def _answer_fail(self) -> None:
        self._reply(500, b"it broke")

    def _answer_slow(self) -> None:
        self.server.receiver.release.wait(HANG)
        self._reply(200, b"late")

    def _answer_drip(self) -> None:
        # a byte of the status line at a time: each read is quick, the whole never ends
        for byte in b"HTTP/1.1 200 OK\r\n" * 100:
            if self.server.receiver.release.wait(0.05):
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()

    def _answer_redirect(self) -> None:
        target = parse_qs(urlsplit(self.path).query)["to"][0]
        self._reply(302, b"", location=target)

    def _answer_large(self) -> None:
        self._reply(200, LARGE)

    def _reply(self, status: int, body: bytes, location: str | None = None) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        if location is not None:
            self.send_header("location", location)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Receiver:
    """An HTTP(S) server on 127.0.0.1 recording connections and requests; the path picks the
    answer (`/ok`, `/fail`, `/slow`, `/drip`, `/redirect?to=`, `/large`)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.connections = 0
        self.requests: list[Received] = []
        self.server_names: list[str | None] = []
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._server = _Server(self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), daemon=True
        )
        self._thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{host}:{self.port}{path}"

    def record(self, received: Received) -> None:
        with self._lock:
            self.requests.append(received)

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def other_receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def open_sender() -> Iterator[Sender]:
    sender = Sender(OPEN, timeout=5.0)
    yield sender
    sender.close()


def send(sender: Sender, url: str, body: bytes = BODY) -> AttemptResult:
    headers = signing.headers(signing.message_id(), int(time.time()), body, [SECRET])
    return sender.send(url, body, headers)


def test_a_post_arrives_with_its_headers_and_exact_body(
    receiver: Receiver, open_sender: Sender
) -> None:
    now = int(time.time())
    headers = signing.headers("msg_test_1", now, BODY, [SECRET])

    result = open_sender.send(receiver.url("/hooks/tracon?tenant=acme"), BODY, headers)

    assert result == AttemptResult(200, result.latency_ms, None, "thanks")
    assert result.succeeded
    [received] = receiver.requests
    assert (received.method, received.path, received.body) == (
        "POST",
        "/hooks/tracon?tenant=acme",
        BODY,
    )
    got = {name.lower(): value for name, value in received.headers.items()}
    assert got["host"] == f"127.0.0.1:{receiver.port}"
    assert got["content-type"] == "application/json"
    assert got["content-length"] == str(len(BODY))
    assert got["webhook-id"] == "msg_test_1"
    assert got["user-agent"].startswith("tracon-jobs-webhooks/")
    signing.verify(SECRET, received.headers, received.body, now=now)


def test_a_host_name_is_sent_as_the_host_header_though_its_address_is_dialed(
    receiver: Receiver, open_sender: Sender
) -> None:
    result = send(open_sender, receiver.url("/ok", host="localhost"))

    assert result.status == 200, result
    assert receiver.requests[0].headers["Host"] == f"localhost:{receiver.port}"


def test_a_connection_is_reused_by_the_next_attempt_to_the_same_destination(
    receiver: Receiver, open_sender: Sender
) -> None:
    for _ in range(3):
        assert send(open_sender, receiver.url("/ok")).succeeded
    assert receiver.connections == 1

    assert send(open_sender, receiver.url("/ok", host="localhost")).succeeded
    assert receiver.connections == 2  # another host name: a pool of its own


def test_attempts_from_many_threads_at_once(receiver: Receiver, open_sender: Sender) -> None:
    results: list[AttemptResult] = []
    lock = threading.Lock()

    def deliver(index: int) -> None:
        for turn in range(5):
            result = send(open_sender, receiver.url("/ok"), b'{"n": %d}' % (index * 10 + turn))
            with lock:
                results.append(result)

    threads = [threading.Thread(target=deliver, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)

    assert len(results) == 40 and all(result.succeeded for result in results)
    assert sorted(r.body for r in receiver.requests) == sorted(
        b'{"n": %d}' % n for n in range(80) if n % 10 < 5
    )


def test_a_failing_status_is_reported_with_the_answer(
    receiver: Receiver, open_sender: Sender
) -> None:
    result = send(open_sender, receiver.url("/fail"))

    assert (result.status, result.error, result.response_excerpt) == (500, "HTTP 500", "it broke")
    assert not result.succeeded


def test_a_slow_receiver_times_out_at_the_timeout(receiver: Receiver) -> None:
    sender = Sender(OPEN, timeout=0.5)
    started = time.monotonic()

    result = send(sender, receiver.url("/slow"))

    took = time.monotonic() - started
    sender.close()
    assert (result.status, result.error) == (None, "timeout after 0.5 s")
    assert 0.45 <= took < 5, took  # not the receiver's 10 s
    assert len(receiver.requests) == 1


def test_a_dripping_receiver_cannot_stretch_the_attempt(receiver: Receiver) -> None:
    # Given a receiver answering a byte every 50 ms, so no single read waits 0.5 s
    sender = Sender(OPEN, timeout=0.5)
    started = time.monotonic()

    # When an attempt of 0.5 s in all reads its answer
    result = send(sender, receiver.url("/drip"))

    # Then the attempt's one deadline ends it
    took = time.monotonic() - started
    sender.close()
    assert (result.status, result.error) == (None, "timeout after 0.5 s")
    assert took < 4, took  # not the drip's 5 s


def test_a_redirect_is_not_followed(
    receiver: Receiver, other_receiver: Receiver, open_sender: Sender
) -> None:
    target = other_receiver.url("/ok")

    result = send(open_sender, receiver.url(f"/redirect?to={target}"))

    assert result.status == 302
    assert result.error == f"redirect not followed (302 to {target})"
    assert not result.succeeded
    assert (other_receiver.connections, other_receiver.requests) == (0, [])


def test_a_redirect_to_the_metadata_service_is_not_followed(
    receiver: Receiver, open_sender: Sender
) -> None:
    metadata = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"

    started = time.monotonic()
    result = send(open_sender, receiver.url(f"/redirect?to={metadata}"))

    assert result.error == f"redirect not followed (302 to {metadata})"
    assert time.monotonic() - started < 3  # nothing was dialed that could hang (5 s)
    assert len(receiver.requests) == 1


def test_a_large_answer_is_cut_at_the_excerpt_size(receiver: Receiver) -> None:
    sender = Sender(OPEN, timeout=5.0, max_response_bytes=100)

    result = send(sender, receiver.url("/large"))

    sender.close()
    assert result.status == 200 and result.error is None
    assert result.response_excerpt == LARGE[:100].decode()


def test_no_excerpt_at_all_when_none_is_wanted(receiver: Receiver) -> None:
    sender = Sender(OPEN, timeout=5.0, max_response_bytes=0)
    result = send(sender, receiver.url("/fail"))
    sender.close()
    assert (result.status, result.response_excerpt) == (500, "")


def test_a_closed_port_is_connection_refused(open_sender: Sender) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: a connect is refused

        result = send(open_sender, f"http://127.0.0.1:{port}/")

    assert (result.status, result.error) == (None, "connection refused")


def test_loopback_destinations_are_refused_without_a_connection(receiver: Receiver) -> None:
    sender = Sender(HTTP_ONLY, timeout=5.0)

    by_address = send(sender, receiver.url("/ok"))
    by_name = send(sender, receiver.url("/ok", host="localhost"))
    sender.close()

    assert by_address.error == "refused destination: 127.0.0.1 is a loopback address"
    assert by_name.error is not None
    assert by_name.error.startswith("refused destination: localhost resolves to ")
    assert by_name.error.endswith(", a loopback address")
    assert by_address.status is None and by_name.status is None
    assert (receiver.connections, receiver.requests) == (0, [])


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("http://10.0.0.1/", "refused destination: 10.0.0.1 is a private address"),
        (
            "http://169.254.169.254/latest/meta-data/",
            "refused destination: 169.254.169.254 is a link-local address",
        ),
        ("http://[::1]:9/", "refused destination: ::1 is a loopback address"),
        ("http://0x7f.1:9/", "refused destination: 0x7f.1 is a loopback address"),
    ],
)
def test_private_destinations_are_refused_before_any_network_wait(url: str, error: str) -> None:
    sender = Sender(HTTP_ONLY, timeout=5.0)
    started = time.monotonic()

    result = send(sender, url)

    sender.close()
    assert (result.status, result.error) == (None, error)
    assert time.monotonic() - started < 3  # no connect was tried, let alone timed out (5 s)


def test_plain_http_is_refused_when_not_allowed(receiver: Receiver) -> None:
    sender = Sender(Destinations(allow_private_networks=True), timeout=5.0)
    result = send(sender, receiver.url("/ok"))
    sender.close()

    assert result.error == (
        "refused destination: the URL must be an https URL (Webhooks.AllowHttp is off)"
    )
    assert receiver.connections == 0


def test_a_context_that_skips_verification_is_refused() -> None:
    lax = ssl.create_default_context()
    lax.check_hostname = False
    lax.verify_mode = ssl.CERT_NONE
    with pytest.raises(ValueError, match="must verify certificates and host names"):
        Sender(OPEN, timeout=1.0, verify=lax)


# https: a certificate for the name `localhost` only, made by the openssl command line


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for DNS name `localhost` (and no IP address), its key."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=20,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def tls_receiver(certificate: tuple[Path, Path]) -> Iterator[Receiver]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    server: Receiver | None = None

    def seen(_socket: Any, name: str | None, _context: Any) -> None:
        assert server is not None
        server.server_names.append(name)

    context.sni_callback = seen
    server = Receiver(tls=context)
    yield server
    server.close()


def test_https_to_the_pinned_address_is_verified_for_the_host_name(
    tls_receiver: Receiver, certificate: tuple[Path, Path]
) -> None:
    sender = Sender(OPEN, timeout=5.0, verify=str(certificate[0]))

    result = send(sender, tls_receiver.url("/ok", host="localhost"))

    sender.close()
    assert (result.status, result.error, result.response_excerpt) == (200, None, "thanks")
    assert tls_receiver.server_names == ["localhost"]  # SNI: the name, not the address
    [received] = tls_receiver.requests
    assert received.headers["Host"] == f"localhost:{tls_receiver.port}"
    assert received.body == BODY


def test_https_to_an_address_the_certificate_does_not_name_is_refused(
    tls_receiver: Receiver, certificate: tuple[Path, Path]
) -> None:
    sender = Sender(OPEN, timeout=5.0, verify=str(certificate[0]))

    result = send(sender, tls_receiver.url("/ok", host="127.0.0.1"))

    sender.close()
    assert result.status is None and result.error is not None
    assert result.error.startswith("TLS certificate not accepted: "), result.error
    assert "127.0.0.1" in result.error
    assert tls_receiver.requests == []


def test_https_with_the_system_trust_refuses_a_self_signed_certificate(
    tls_receiver: Receiver,
) -> None:
    sender = Sender(OPEN, timeout=5.0)

    result = send(sender, tls_receiver.url("/ok", host="localhost"))

    sender.close()
    assert result.error is not None
    assert result.error.startswith("TLS certificate not accepted: "), result.error
    assert tls_receiver.requests == []


def test_nothing_of_the_headers_body_or_path_is_logged(
    receiver: Receiver, open_sender: Sender, caplog: pytest.LogCaptureFixture
) -> None:
    headers = signing.headers("msg_logged", int(time.time()), BODY, [SECRET])
    with caplog.at_level("DEBUG"):
        open_sender.send(receiver.url("/token-in-path-abc123"), BODY, headers)
        send(open_sender, receiver.url("/fail"))

    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert f"http://127.0.0.1:{receiver.port}" in logged
    for secret_part in (headers["webhook-signature"][3:], "msg_logged", "token-in-path", "café"):
        assert secret_part not in logged
    assert BODY.decode() not in logged
