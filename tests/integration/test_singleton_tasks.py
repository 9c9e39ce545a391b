"""The periodic task bodies under singleton leases, through real Runtimes sharing one Redis:
the retention purge runs only in the lease owner; the requeue of unclaimed runs is always
on; with `SingletonExecution.Enabled: false` every process runs every body, as before."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import beat_schedules
from beat_schedules.schedule import IDEMPOTENCY_PURGE_TASK, REQUEUE_TASK
from beat_schedules.tasks import run_periodic
from tests.helpers import MakeRuntime
from tracon_jobs.runtime import Runtime


@pytest.fixture
def runtimes(make_runtime: MakeRuntime, sqlite_url: str) -> Iterator[Callable[..., Runtime]]:
    """Runtimes on one database and one Redis, with the periodic tasks installed on their
    Celery apps; their lease threads stop at the end."""
    built: list[Runtime] = []

    def make(owner: str, enabled: bool = True) -> Runtime:
        runtime = make_runtime(
            sqlite_url,
            Retention={"Enabled": True},
            SingletonExecution={"Enabled": enabled, "OwnerId": owner, "LeaseDuration": "00:00:30"},
        )
        beat_schedules.install(runtime.celery, runtime)  # the periodic tasks, as a worker has
        built.append(runtime)
        return runtime

    yield make
    for runtime in built:
        runtime.leases.release_all()


def run(runtime: Runtime, task: str) -> Any:
    return runtime.celery.tasks[task]()


def test_the_purge_runs_only_in_the_lease_owner(runtimes: Callable[..., Runtime]) -> None:
    a, b = runtimes("worker-a"), runtimes("worker-b")

    assert run(a, IDEMPOTENCY_PURGE_TASK) == {"enabled": True, "deleted": 0}
    assert run(b, IDEMPOTENCY_PURGE_TASK) is None
    assert a.leases.store.owner_of(IDEMPOTENCY_PURGE_TASK) == "worker-a"


def test_the_owner_hands_over_when_it_releases(runtimes: Callable[..., Runtime]) -> None:
    a, b = runtimes("worker-a"), runtimes("worker-b")
    assert run(a, IDEMPOTENCY_PURGE_TASK) is not None

    a.leases.release_all()

    assert run(b, IDEMPOTENCY_PURGE_TASK) == {"enabled": True, "deleted": 0}
    assert run(a, IDEMPOTENCY_PURGE_TASK) is None


def test_the_requeue_task_is_never_under_a_lease(runtimes: Callable[..., Runtime]) -> None:
    a, b = runtimes("worker-a"), runtimes("worker-b")
    assert run(a, IDEMPOTENCY_PURGE_TASK) is not None  # a owns the periodic leases

    assert run(b, REQUEUE_TASK) == {"resent": 0, "failed": 0}


class FakeTask:
    """Stands in for a bound Celery task: its worker hostname, and what it re-sent."""

    def __init__(self, hostname: str) -> None:
        self.request = type("Request", (), {"hostname": hostname})()
        self.sent: list[dict[str, Any]] = []

    def apply_async(self, **options: Any) -> None:
        self.sent.append(options)


def test_a_tick_delivered_to_a_non_owner_is_forwarded_to_the_owner_once(
    runtimes: Callable[..., Runtime],
) -> None:
    a, b = runtimes("worker-a"), runtimes("worker-b")
    ran: list[str] = []
    on_a, on_b = FakeTask("a@host"), FakeTask("b@host")

    assert run_periodic(a, on_a, "tracon.test", False, lambda: ran.append("a")) is None
    forwarded = run_periodic(b, on_b, "tracon.test", False, lambda: ran.append("b"))
    again = run_periodic(b, on_b, "tracon.test", True, lambda: ran.append("b"))

    assert ran == ["a"]
    assert forwarded == {"forwardedTo": "a@host"} and again is None
    assert [options["queue"].name for options in on_b.sent] == ["a@host.dq2"]
    assert on_b.sent[0]["kwargs"] == {"forwarded": True}


def test_disabled_every_process_runs_the_purge(runtimes: Callable[..., Runtime]) -> None:
    a, b = runtimes("worker-a", enabled=False), runtimes("worker-b", enabled=False)

    assert run(a, IDEMPOTENCY_PURGE_TASK) == {"enabled": True, "deleted": 0}
    assert run(b, IDEMPOTENCY_PURGE_TASK) == {"enabled": True, "deleted": 0}
    assert a.leases.store.owner_of(IDEMPOTENCY_PURGE_TASK) is None


def test_the_runtime_builds_the_elector_from_the_settings(
    make_runtime: MakeRuntime, sqlite_url: str
) -> None:
    default = make_runtime(sqlite_url)
    configured = make_runtime(
        sqlite_url, SingletonExecution={"Enabled": True, "LeaseDuration": "00:00:09"}
    )

    assert (default.leases.enabled, default.leases.ttl_ms) == (False, 60_000)
    assert (configured.leases.enabled, configured.leases.ttl_ms) == (True, 9_000)
    assert configured.leases.renew_interval_ms == 3_000
    assert configured.leases.owner == configured.settings.singleton_execution.resolved_owner_id()
    assert default.leases.owner != configured.leases.owner  # generated, one per instance
