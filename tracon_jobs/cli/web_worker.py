"""The gunicorn worker of `tracon-jobs web`: gthread, with four changes.

- Its own error answers (a request line too long: 414, header fields too large: 431, a
  malformed request: 400) are problem+json like every answer of the app, instead of
  gunicorn's HTML page. gunicorn writes those answers before any WSGI app sees the request,
  through `gunicorn.util.write_error`; the worker replaces that function in its own process
  (after the fork), so nothing else in gunicorn changes.
- A live event stream does not keep a thread. When the app answers with a stream it can
  hand over (a `tracon_jobs.handoff.Handoff` in the WSGI environ), the worker sends the answer's
  head and gives the connection to the handoff (the process's stream hub, one thread for all
  its followers), frees the thread for the next request and forgets the connection: gunicorn
  neither closes it nor counts it against `worker_connections`.
- A quit signal (SIGINT, SIGQUIT) cannot deadlock the worker (`ProblemThreadWorker.handle_quit`).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from datetime import datetime
from typing import Any

from gunicorn import util
from gunicorn.http import wsgi
from gunicorn.workers.base import Worker
from gunicorn.workers.gthread import ThreadWorker

from tracon_jobs.handoff import HANDOFF, Handoff
from tracon_jobs.startup import freeze_startup_objects


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
    """gunicorn's gthread worker answering its own errors as problem+json and handing live
    streams to the app's stream hub."""

    alive: bool
    quitting = False  # a quit signal came: the worker is exiting

    def init_process(self) -> None:
        util.write_error = write_problem
        self.handed_over: set[Any] = set()
        self.handed_over_lock = threading.Lock()
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        freeze_startup_objects()

    def handle_quit(self, sig: int, frame: Any) -> None:
        """gunicorn's quick exit (SIGINT, SIGQUIT), without shutting the pool down from the
        signal handler.

        gthread's handler calls the pool's `shutdown`, whose lock is not reentrant; a handler
        that runs while the main thread holds that lock waits for it forever. It did: a
        Ctrl-C of `tracon-jobs dev` reaches every process of the web, the master then sends
        its workers SIGQUIT, and the second handler ran inside the first one's `shutdown`
        (the worker hung until it was killed: 3 stops of about 150). The main thread
        also holds that lock in the pool's `submit`, for every request. Here the handler only
        stops the worker and exits, as gunicorn's base worker does; the pool's threads are
        told to stop at the interpreter's exit, as every pool's are.

        A second quit signal while the first one's exit unwinds (the Ctrl-C and then the
        master's SIGQUIT) does nothing: raising again there, inside a lock's release in
        `threading`, ended the worker with "release unlocked lock", a traceback and exit 255.
        """
        if self.quitting:
            return
        self.quitting = True
        Worker.handle_quit(self, sig, frame)

    def finish_request(self, conn: Any, fs: Any) -> None:
        with self.handed_over_lock:
            handed = conn in self.handed_over
            self.handed_over.discard(conn)
        if handed:  # the stream hub owns its socket: no close, no keep-alive
            self.nr_conns -= 1
            return
        super().finish_request(conn, fs)

    def handle_request(self, req: Any, conn: Any) -> bool:
        """gunicorn 27's `ThreadWorker.handle_request`, plus the handoff of a live stream."""
        environ: dict[str, Any] = {}
        resp = None
        try:
            self.cfg.pre_request(self, req)
            request_start = datetime.now()
            resp, environ = wsgi.create(req, conn.sock, conn.client, conn.server, self.cfg)
            environ["wsgi.multithread"] = True
            self.nr += 1
            if self.nr >= self.max_requests:
                if self.alive:
                    self.log.info("Autorestarting worker after current request.")
                    self.alive = False
                resp.force_close()

            if (
                not self.alive
                or not self.cfg.keepalive
                or len(self.keepalived_conns) >= self.max_keepalived
            ):
                resp.force_close()

            respiter = self.wsgi(environ, resp.start_response)
            handoff: Handoff | None = environ.get(HANDOFF)
            try:
                if handoff is not None and self.hand_over(handoff, req, resp, conn):
                    return False
                if isinstance(respiter, environ["wsgi.file_wrapper"]):
                    resp.write_file(respiter)
                else:
                    for item in respiter:
                        resp.write(item)

                resp.close()
            finally:
                request_time = datetime.now() - request_start
                self.log.access(resp, req, environ, request_time)
                if hasattr(respiter, "close"):
                    respiter.close()

            if resp.should_close():
                self.log.debug("Closing connection.")
                return False
        except OSError:
            util.reraise(*sys.exc_info())
        except (Exception, SystemExit):
            if resp and resp.headers_sent:
                # Timeout abort is SystemExit. If we already started the
                # response, writing a 500 on the same socket corrupts it.
                self.log.exception("Error handling request")
                util.close_graceful(conn.sock)
                raise StopIteration() from None
            raise
        finally:
            try:
                self.cfg.post_request(self, req, environ, resp)
            except Exception:
                self.log.exception("Exception in post_request hook")

        return True

    def hand_over(self, handoff: Handoff, req: Any, resp: Any, conn: Any) -> bool:
        """Send the head and give the connection to `handoff`; False to stream it here."""
        alive: bool = self.alive
        if resp.status_code != 200 or req.method == "HEAD" or not alive:
            return False  # a stopping worker finishes its streams itself, as before
        resp.force_close()  # the stream ends with the connection
        resp.send_headers()
        handoff.adopt(conn.sock, resp.chunked)
        with self.handed_over_lock:
            self.handed_over.add(conn)
        return True
