"""A worker's registration in the fair lines needs Redis only: a database that does not
answer (the tenants' weights are read from it) must not let a running worker's slots lapse,
since lined runs move only while a worker is registered."""

from __future__ import annotations

import threading

from celery import Celery

from tests.helpers import wait_until
from tracon_jobs.coordination.fair_share import MemoryFairStore
from tracon_jobs.worker.capacity import WorkerCapacity


def test_the_slots_are_registered_while_the_weights_read_hangs() -> None:
    answer = threading.Event()
    reads: list[int] = []

    def weights() -> dict[str, int]:  # SQL that does not answer, then does
        reads.append(1)
        answer.wait(60)  # past the wait below, slack included
        return {"acme": 3}

    store = MemoryFairStore()
    draining = threading.Event()
    capacity = WorkerCapacity(
        Celery(set_as_current=False),
        store,
        "w1",
        4,
        weights,
        lambda ids: None,
        draining,
        reserve=1,
        running=lambda: ["r1"],
    )
    try:
        capacity.start()
        # the registration went ahead of the weights
        wait_until(lambda: store.depth().slots == 4, timeout=5, what="the slots registered")
        assert reads and store.depth().reserve == 1
        # and the weights, once read, go with the next registrations
        answer.set()
        wait_until(lambda: capacity._weights == {"acme": 3}, timeout=5, what="weights read")
    finally:
        draining.set()
        answer.set()
