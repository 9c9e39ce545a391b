"""`-c N` given to `tracon-jobs worker` means `Worker.Concurrency` N: Celery's pool gets the
reserve threads on top (`Worker.FairReserve`), in every spelling Celery accepts."""

from __future__ import annotations

import pytest

from tracon_jobs.cli.processes import concurrency_with_reserve


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["-c", "4"], ["-c", "5"]),
        (["--concurrency", "4"], ["--concurrency", "5"]),
        (["--concurrency=4"], ["--concurrency=5"]),
        (["-c4"], ["-c5"]),
        (["-n", "w1@%h", "-c", "1", "-E"], ["-n", "w1@%h", "-c", "2", "-E"]),
        (["-n", "w1@%h"], ["-n", "w1@%h"]),  # none given: Worker.Concurrency decides
        (["-c"], ["-c"]),  # left for Celery to refuse
    ],
)
def test_the_pool_is_the_slots_given_and_the_reserve(given: list[str], expected: list[str]) -> None:
    assert concurrency_with_reserve(given, 1) == expected


def test_without_a_reserve_the_arguments_are_unchanged() -> None:
    assert concurrency_with_reserve(["-c", "4", "--concurrency=3"], 0) == [
        "-c",
        "4",
        "--concurrency=3",
    ]
