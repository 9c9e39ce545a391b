"""One asyncio event loop per process, on a daemon thread, for `async def` tools.

Celery's `revoke(terminate=True)` does nothing on the threads pool. Running an async tool as
a coroutine on a loop we own lets any thread cancel it through its
`concurrent.futures.Future`: the cancellation reaches the coroutine at its next `await`.
Provider calls do not come here: they run on their caller's thread, abortable at the socket
(`abortable_http.py`), so a call costs no hand-off between threads.

The loop is created lazily and again after a fork, because a forked child inherits the
loop object but not the thread that runs it.
"""

from __future__ import annotations

import asyncio
import os
import threading

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None


def _forget_loop_after_fork() -> None:
    """The child gets a copy of the lock (possibly held) and a loop with no thread: drop both."""
    global _lock, _loop, _loop_pid
    _lock = threading.Lock()
    _loop = None
    _loop_pid = None


os.register_at_fork(after_in_child=_forget_loop_after_fork)


def get_loop() -> asyncio.AbstractEventLoop:
    """The running loop of this process, started on first use (and after a fork)."""
    global _loop, _loop_pid
    with _lock:
        if _loop is None or _loop_pid != os.getpid() or _loop.is_closed():
            _loop = _start_loop()
            _loop_pid = os.getpid()
        return _loop


def _start_loop() -> asyncio.AbstractEventLoop:
    """Start a loop on a daemon thread, so that it never keeps the process alive."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    threading.Thread(target=run, name="tracon-provider-loop", daemon=True).start()
    ready.wait()
    return loop
