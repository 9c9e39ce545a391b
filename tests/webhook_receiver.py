"""A webhook receiver for the tests: a real HTTP server on 127.0.0.1 that records every
request it gets (headers, raw body, when) and answers as scripted: a status (with a body and
headers, a redirect's `Location`), a delay before the answer, a request held until the test
releases it, or a dropped connection.

It can run in this process (`Receiver().start()`) or as a process of its own
(`python -m tests.webhook_receiver PORT LOG`), which appends each request to LOG as a JSON
line, for the tests that kill workers: the receiver must outlive them.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import standardwebhooks

from tests.local_server import LocalServer
from tests.waits import TIMEOUT_SLACK


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes
    at: float

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]

    def json(self) -> Any:
        return json.loads(self.body)

    def verified(self, secret: str) -> Any:
        """The payload, verified by the `standardwebhooks` package (the reference
        implementation, not ours): it raises when the signature does not hold."""
        return standardwebhooks.Webhook(secret).verify(self.body, self.headers)


@dataclass(frozen=True)
class Answer:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds before the answer
    drop: bool = False  # close the connection without an answer
    hold: threading.Event | None = None  # answer once the test sets it


class Receiver:
    def __init__(self, log: Path | None = None) -> None:
        self.received: list[Received] = []
        self.script: list[Answer] = []  # the next answers, in order; then `default`
        self.default = Answer()
        self.log = log
        self.arrived = threading.Condition()
        self._server: LocalServer | None = None

    # -- setup -----------------------------------------------------------------------------

    def start(self, port: int = 0) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                receiver._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = LocalServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def url(self, path: str = "/hook", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def answer(self, *answers: Answer) -> None:
        self.script.extend(answers)

    # -- what arrived ----------------------------------------------------------------------

    def wait_for(
        self, count: int, timeout: float = 15.0, path: str | None = None
    ) -> list[Received]:
        """The requests (to `path`, when given) once there are `count` of them."""
        deadline = time.monotonic() + timeout * TIMEOUT_SLACK
        with self.arrived:
            while len(self._of(path)) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{len(self._of(path))} of {count} webhook requests arrived in {timeout}s"
                    )
                self.arrived.wait(left)
            return self._of(path)

    def _of(self, path: str | None) -> list[Received]:
        return [r for r in self.received if path is None or r.path == path]

    # -- serving ---------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("content-length") or 0)
        body = handler.rfile.read(length)
        got = Received(
            handler.path, {k.lower(): v for k, v in handler.headers.items()}, body, time.time()
        )
        with self.arrived:
            self.received.append(got)
            answer = self.script.pop(0) if self.script else self.default
            self.arrived.notify_all()
        if self.log is not None:
            line = {"path": got.path, "headers": got.headers, "body": body.decode(), "at": got.at}
            with self.log.open("a") as out:
                out.write(json.dumps(line) + "\n")
        if answer.hold is not None:
            answer.hold.wait(60)
        if answer.delay:
            time.sleep(answer.delay)
        if answer.drop:
            handler.close_connection = True
            handler.connection.close()
            return
        handler.send_response(answer.status)
        for name, value in answer.headers.items():
            handler.send_header(name, value)
        handler.send_header("content-length", str(len(answer.body)))
        handler.end_headers()
        handler.wfile.write(answer.body)


def logged(log: Path) -> list[Received]:
    """The requests a receiver process wrote to `log`."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text().splitlines():
        item = json.loads(line)
        found.append(Received(item["path"], item["headers"], item["body"].encode(), item["at"]))
    return found


def wait_logged(
    log: Path, count: int, timeout: float = 30.0, where: Callable[[Received], bool] | None = None
) -> list[Received]:
    deadline = time.monotonic() + timeout * TIMEOUT_SLACK
    while True:
        found = [r for r in logged(log) if where is None or where(r)]
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(found)} of {count} webhook requests arrived in {timeout}s")
        time.sleep(0.05)


def main() -> None:
    """`python -m tests.webhook_receiver PORT LOG [HOLD_FIRST_SECONDS]`: answer 200 to every
    request (the first after HOLD_FIRST_SECONDS, when given), logging each to LOG."""
    port, log = int(sys.argv[1]), Path(sys.argv[2])
    receiver = Receiver(log)
    if len(sys.argv) > 3:
        receiver.answer(Answer(delay=float(sys.argv[3])))
    receiver.start(port)
    print(f"listening on {receiver.port}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
