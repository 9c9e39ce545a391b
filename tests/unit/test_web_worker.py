"""The web's gunicorn worker on a real socket pair: its quit signals."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from gunicorn.config import Config
from gunicorn.glogging import Logger
from gunicorn.workers.gthread import TConn

from tracon_jobs.cli.web_worker import ProblemThreadWorker

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
App = Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]


@pytest.fixture
def worker() -> Iterator[ProblemThreadWorker]:
    cfg = Config()
    cfg.set("keepalive", 75)
    made = ProblemThreadWorker(0, os.getpid(), [], None, 30, cfg, Logger(cfg))
    yield made
    made.tmp.close()


def serving(worker: ProblemThreadWorker, app: App) -> tuple[TConn, socket.socket]:
    worker.wsgi = app
    server, client = socket.socketpair()
    client.settimeout(5)
    return TConn(worker.cfg, server, ("127.0.0.1", 1), ("127.0.0.1", 2)), client


def counting(calls: list[str], then: Callable[[], None] = lambda: None) -> App:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        calls.append(environ["PATH_INFO"])
        then()
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    return app


def test_a_quit_signal_while_the_pools_lock_is_held_still_exits(
    worker: ProblemThreadWorker,
) -> None:
    """The main thread holds the pool's lock inside `submit` and inside a first quit's
    `shutdown`; gthread's quit handler waited for that lock forever (a second quit signal,
    the master's SIGQUIT after `dev`'s Ctrl-C reached the whole group, hung the worker)."""
    worker.tpool = ThreadPoolExecutor(1)
    exited: Future[BaseException | None] = Future()

    def quit_now() -> None:
        try:
            worker.handle_quit(signal.SIGQUIT, None)
        except BaseException as exc:  # SystemExit, as the handler exits the process
            exited.set_result(exc)
        else:
            exited.set_result(None)

    with worker.tpool._shutdown_lock:  # held, as the main thread may hold it
        quitting = threading.Thread(target=quit_now, daemon=True)
        quitting.start()
        outcome = exited.result(timeout=5)  # gthread's own handler: TimeoutError
    assert isinstance(outcome, SystemExit)
    assert worker.alive is False
    worker.tpool.shutdown()


def test_a_second_quit_signal_leaves_the_first_ones_exit_alone(
    worker: ProblemThreadWorker,
) -> None:
    """Ctrl-C reaches every process of `dev`'s web, then the master sends its workers
    SIGQUIT: the second handler raised another SystemExit inside the first one's unwinding
    (in `threading`'s lock release: "release unlocked lock", a traceback, exit 255)."""
    with pytest.raises(SystemExit):
        worker.handle_quit(signal.SIGINT, None)

    worker.handle_quit(signal.SIGQUIT, None)  # returns: no second SystemExit

    assert worker.quitting is True and worker.alive is False
