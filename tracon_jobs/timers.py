"""Timer threads: callbacks due at a time, cancelable, one thread for many.

Deadlines are set on every streaming model call and tool attempt (`AbortSignal.child`); a
`threading.Timer` each would start a thread per deadline. Here one thread keeps them in a
heap and runs each callback when it is due. `timers()` is the process's thread for
deadlines: a callback there must be quick and do no IO of its own (it sets a flag, wakes a
waiter, closes a socket), since every later deadline waits for it. Work that talks to Redis
or SQL when due (a streaming call's quiet text, a parked run sent again) has a thread of its
own: `timers("<name>")`. A forked child starts its own threads.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Timer:
    """A callback due at `when` (monotonic seconds); `cancel` keeps it from running."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback: Callable[[], None] | None = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.callback = None  # what it holds is free at once, not when it comes due

    def __lt__(self, other: Timer) -> bool:
        return self.when < other.when


class Timers:
    """The heap and its thread (see the module's docstring)."""

    def __init__(self, name: str = "timers") -> None:
        self._cond = threading.Condition()
        self._due: list[Timer] = []
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when, callback)
        with self._cond:
            heapq.heappush(self._due, timer)
            if self._due[0] is timer:
                self._cond.notify()
        return timer

    def after(self, seconds: float, callback: Callable[[], None]) -> Timer:
        return self.at(time.monotonic() + seconds, callback)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or self._due[0].when > time.monotonic():
                    timeout = None if not self._due else self._due[0].when - time.monotonic()
                    self._cond.wait(timeout)
                timer = heapq.heappop(self._due)
            callback = timer.callback
            if timer.cancelled or callback is None:
                continue
            try:
                callback()
            except Exception:
                log.exception("timer callback failed")


_lock = threading.Lock()
_instances: dict[str, tuple[int, Timers]] = {}


def timers(name: str = "timers") -> Timers:
    """This process's timer thread of that name, started on first use (after any fork)."""
    found = _instances.get(name)
    if found is not None and found[0] == os.getpid():
        return found[1]
    with _lock:
        found = _instances.get(name)
        if found is None or found[0] != os.getpid():
            found = _instances[name] = (os.getpid(), Timers(name))
        return found[1]


def _new_lock_after_fork() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)
