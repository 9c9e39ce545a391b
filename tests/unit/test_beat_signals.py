"""Beat's stop handler (`stop_once`): the first signal stops the service, wherever it lands."""

from __future__ import annotations

import signal
import threading

import pytest

from tracon_jobs.cli.processes import stop_once


class Service:
    def __init__(self, ticked: bool) -> None:
        self._is_shutdown = threading.Event()
        self._last_tick: float | None = 1.0 if ticked else None


def test_a_signal_before_the_loop_sets_the_event_and_lets_start_sync_the_schedule() -> None:
    """Before: SystemExit raised before `Service.start`'s `try` left it without syncing, so
    beat stopped just after "beat: Starting..." kept no schedule file."""
    service = Service(ticked=False)
    stop = stop_once(service)
    stop(signal.SIGINT, None)
    assert service._is_shutdown.is_set()
    stop(signal.SIGTERM, None)  # and the ones after it are quiet too


def test_a_signal_in_the_loop_raises_once_and_the_ones_after_it_are_quiet() -> None:
    service = Service(ticked=True)
    stop = stop_once(service)
    with pytest.raises(SystemExit):
        stop(signal.SIGINT, None)
    assert service._is_shutdown.is_set()
    stop(signal.SIGTERM, None)
