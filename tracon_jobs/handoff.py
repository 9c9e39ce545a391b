"""How an answer offers its connection to the server, so a long stream keeps no thread.

The app puts a `Handoff` in the WSGI environ under `HANDOFF`; a server that knows the key
(`tracon-jobs web`'s worker) sends the answer's head, then calls `adopt` with the
connection and stops serving it. A server that does not know it iterates the answer's body
as usual, so the same app runs anywhere.
"""

from __future__ import annotations

import socket
from typing import Protocol

HANDOFF = "tracon.stream_handoff"


class Handoff(Protocol):
    def adopt(self, sock: socket.socket, chunked: bool) -> None:
        """Own the connection from now on: the head is sent, the body is the handoff's
        (HTTP/1.1 chunks when `chunked`, else raw until the connection closes)."""
        ...
