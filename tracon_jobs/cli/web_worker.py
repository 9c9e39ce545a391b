"""The gunicorn worker of `tracon-jobs web`: gthread, whose own error answers (a request line
too long: 414, header fields too large: 431, a malformed request: 400) are problem+json like
every answer of the app, instead of gunicorn's HTML page.

gunicorn writes those answers before any WSGI app sees the request, through
`gunicorn.util.write_error`; the worker replaces that function in its own process (after the
fork), so nothing else in gunicorn changes.
"""

from __future__ import annotations

import json
import socket

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker


def write_problem(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """gunicorn's error answer as RFC 9457 problem+json; the connection closes after it."""
    body = json.dumps(
        {"type": "about:blank", "title": reason, "status": status, "detail": message or reason}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/problem+json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin-1") + body)


class ProblemThreadWorker(ThreadWorker):
    """gunicorn's gthread worker answering its own errors as problem+json."""

    def init_process(self) -> None:
        util.write_error = write_problem
        super().init_process()
