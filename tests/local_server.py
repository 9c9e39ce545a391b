"""The HTTP servers the tests start in their own process (the stub provider, webhook and trace
receivers, the fake Slack)."""

from __future__ import annotations

from http.server import ThreadingHTTPServer


class LocalServer(ThreadingHTTPServer):
    """A thread per request, with a listen backlog of 128 rather than `socketserver`'s 5: a
    test's twenty clients connecting at once (a web's follow-ups after twenty clicks) are all
    accepted, none reset by a full accept queue."""

    daemon_threads = True
    request_queue_size = 128
