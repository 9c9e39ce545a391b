"""AbortSignal: one cancellation signal per execution, shared by everything it started.

A run owns one signal; each model call and each tool attempt derives a child that also
fires on its own deadline. Callbacks let a waiter (a provider future, a slot wait) be woken
the moment the signal fires instead of polling.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from tracon_jobs.timers import timers

Callback = Callable[[str], None]


class AbortSignal:
    """A thread-safe, one-shot abort flag with a reason and wake-up callbacks."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._reason = ""
        self._callbacks: list[Callback] = []

    @property
    def aborted(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str:
        return self._reason

    def abort(self, reason: str = "cancelled") -> None:
        """Fire once; later calls keep the first reason."""
        with self._lock:
            if self._event.is_set():
                return
            self._reason = reason
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until aborted or `timeout` seconds passed; True when aborted."""
        return self._event.wait(timeout)

    def on_abort(self, callback: Callback) -> Callable[[], None]:
        """Call `callback(reason)` when the signal fires (at once if it already has).

        Returns a function that unregisters the callback.
        """
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return lambda: self._discard(callback)
        callback(self._reason)
        return lambda: None

    def child(self, timeout: float | None = None) -> AbortSignal:
        """A signal that fires when this one does, or after `timeout` seconds as `"timeout"`."""
        child = AbortSignal()
        unregister = self.on_abort(child.abort)
        child.on_abort(lambda _reason: unregister())
        if timeout is not None:  # on the process's timer thread, not a thread of its own
            timer = timers().after(timeout, lambda: child.abort("timeout"))
            child.on_abort(lambda _reason: timer.cancel())
        return child

    def _discard(self, callback: Callback) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)
