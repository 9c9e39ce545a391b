"""Runs that told the fair lines their end and are still finishing on their thread.

A run tells the fair lines its end just before its final write (`Executor.end_with_final_write`),
and the next run's message is sent then: it may reach the worker while the run's thread is
still writing. The worker's consumer (`worker.pool.PoolRoom`), which takes a message only for
an idle thread, counts such a thread as idle (and is told, `listen`, as it may have been
waiting for one); the pool forgets the mark as the task ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()
_lock = threading.Lock()
_count = 0
_listener: Callable[[], object] | None = None


def listen(listener: Callable[[], object] | None) -> None:
    """`listener()` is called on the run's thread after each `told`."""
    global _listener
    _listener = listener


def told() -> None:
    """The run on this thread told its end (once a thread, until `ended`)."""
    global _count
    if getattr(_local, "told", False):
        return
    _local.told = True
    with _lock:
        _count += 1
    listener = _listener
    if listener is not None:
        listener()


def ended() -> None:
    """The task on this thread ended: its thread is idle."""
    global _count
    if not getattr(_local, "told", False):
        return
    _local.told = False
    with _lock:
        _count -= 1


def count() -> int:
    """Threads whose run told its end and whose task has not ended yet."""
    return _count
