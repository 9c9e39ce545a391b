"""The process's timer thread: callbacks run in the order they are due, a canceled one
never runs, and a deadline of `AbortSignal.child` fires as `"timeout"` on it."""

from __future__ import annotations

import threading
import time

from tracon_jobs.abort import AbortSignal
from tracon_jobs.timers import timers


def test_callbacks_run_when_due_in_order_and_a_canceled_one_never() -> None:
    ran: list[str] = []
    done = threading.Event()
    clock = timers()

    def late() -> None:
        ran.append("late")
        done.set()

    clock.after(0.15, late)
    canceled = clock.after(0.05, lambda: ran.append("canceled"))
    clock.after(0.02, lambda: ran.append("early"))
    canceled.cancel()

    assert done.wait(2)
    assert ran == ["early", "late"]


def test_a_failing_callback_does_not_stop_the_others() -> None:
    done = threading.Event()

    def fails() -> None:
        raise RuntimeError("a bad callback")

    timers().after(0.01, fails)
    timers().after(0.02, done.set)
    assert done.wait(2)


def test_a_child_signal_times_out_on_the_timer_thread_without_a_thread_of_its_own() -> None:
    parent = AbortSignal()
    threads_before = threading.active_count()
    children = [parent.child(timeout=0.1) for _ in range(50)]
    assert threading.active_count() <= threads_before + 1  # at most the timer thread itself
    started = time.monotonic()

    assert children[-1].wait(2)
    assert 0.08 <= time.monotonic() - started < 1.0
    assert all(child.wait(1) and child.reason == "timeout" for child in children)
    assert not parent.aborted


def test_a_child_that_is_done_first_never_times_out() -> None:
    child = AbortSignal().child(timeout=0.05)
    child.abort("done")
    time.sleep(0.1)
    assert child.reason == "done"
