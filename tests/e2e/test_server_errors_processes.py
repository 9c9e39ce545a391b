"""gunicorn's own error answers from the real `tracon-jobs web` process, over raw sockets:
a request line too long (414), header fields too large (431) and a malformed request (400)
are problem+json like every answer of the app, not gunicorn's HTML page; an idle kept-alive
connection stays open for `Web.KeepAlive`."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from tests.e2e.cluster import Cluster
from tests.helpers import scripted_agent

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def exchange(base: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read the answer until the server closes: status, headers, body."""
    address = urlsplit(base)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (x.partition(":") for x in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /api/runs?q=" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 10_000 + b"\r\n\r\n", 431),
        (b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", 400),
    ],
    ids=["414-request-line", "431-header-field", "400-version", "400-header-name"],
)
def test_gunicorns_own_errors_are_problem_json(
    make_cluster: Callable[..., Cluster], sqlite_url: str, request_bytes: bytes, status: int
) -> None:
    cluster = make_cluster(sqlite_url, **scripted_agent([{"Text": "ok"}]))
    _, base = cluster.web()

    got, headers, body = exchange(base, request_bytes)

    assert got == status, body[:300]
    assert headers["content-type"] == "application/problem+json"
    problem = json.loads(body)
    assert problem["status"] == status and problem["title"] and problem["detail"]
    assert int(headers["content-length"]) == len(body)


def test_the_apps_own_answers_still_come_through(
    make_cluster: Callable[..., Cluster], sqlite_url: str
) -> None:
    cluster = make_cluster(sqlite_url, **scripted_agent([{"Text": "ok"}]))
    _, base = cluster.web()

    got, headers, body = exchange(
        base, b"DELETE /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )

    assert got == 405
    assert headers["content-type"] == "application/problem+json"
    assert "GET" in headers["allow"]
    assert json.loads(body)["status"] == 405


def one_answer(sock: socket.socket) -> int:
    """Read one answer with a Content-Length off a kept-alive connection: its status, or 0
    when the server closed the connection instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1])


@pytest.mark.parametrize(
    ("keep_alive", "answered"), [(None, True), (1, False)], ids=["default", "1s"]
)
def test_an_idle_kept_alive_connection_stays_open_for_web_keep_alive(
    make_cluster: Callable[..., Cluster], sqlite_url: str, keep_alive: int | None, answered: bool
) -> None:
    """A client reuses a connection it kept idle for up to its own limit (httpx: 5 s); the
    server must not close it first, or a request sent as it closes is lost (gunicorn's own
    default is 2 s). With `Web.KeepAlive` of 1 s the same connection is closed: the setting
    is what holds it."""
    web = {} if keep_alive is None else {"Web": {"KeepAlive": keep_alive}}
    cluster = make_cluster(sqlite_url, **scripted_agent([{"Text": "ok"}]), **web)
    _, base = cluster.web()
    address = urlsplit(base)
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(request)
        assert one_answer(sock) == 200
        time.sleep(4.5)  # past gunicorn's default and its once-a-second check of idle connections
        try:
            sock.sendall(request)
            status = one_answer(sock)
        except ConnectionResetError:
            status = 0
    assert status == (200 if answered else 0)
