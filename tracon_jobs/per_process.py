"""One object in each process that asks for it, built on first use.

A forked child builds its own: what the parent's holds (a client's pooled connections, a
thread) belongs to the parent, and two processes reading one socket would take each other's
answers. The lock that guards the building is replaced in the child, since a lock another
thread held at the fork stays held there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)

_build_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _build_lock
    _build_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


class PerProcess(Generic[C]):
    """What `build` makes, once in each process that asks for it."""

    def __init__(self, build: Callable[[], C]) -> None:
        self._build = build
        self._made: C | None = None
        self._pid: int | None = None

    def get(self) -> C:
        made = self._made
        if made is not None and self._pid == os.getpid():
            return made
        with _build_lock:
            made = self._made
            if made is None or self._pid != os.getpid():
                made = self._build()
                self._made, self._pid = made, os.getpid()
            return made

    def close(self) -> None:
        """Close this process's object (a forked child's is its parent's: left alone)."""
        made, self._made = self._made, None
        if made is not None and self._pid == os.getpid():
            made.close()
