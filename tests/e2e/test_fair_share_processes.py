"""Fair dispatch on real processes: a worker of 4 threads (`tracon-jobs worker`), runs
submitted through the real dispatcher (the web's own path) and a provider that answers in
a fixed time.

- Tenant A queues a backlog, then tenant B submits 4 runs: B's runs complete within about
  one run's time per slot, while most of A's backlog is still waiting.
- Weights 3 and 1 divide the calls between two backlogs about 3 to 1.
- Within a tenant, runs of priority 9 submitted after 40 of priority 5 go first.
- `MaxConcurrentRuns` 2: never more than 2 of the tenant's calls at once, while another
  tenant's runs go on.
- With every slot busy and a tenant's runs lined, another tenant's run starts at once on the
  worker's reserve thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import ENDED, MakeRuntime
from tests.stub_provider import Exchange, Reply, StubProvider
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ANSWER_SECONDS = 0.05
SLOTS = 4


@dataclass
class Paced:
    """Answers `echo: <message>` after `seconds`; records each message's arrival and how
    many calls of its tenant (the message's prefix before '-') were in flight at once."""

    seconds: float
    messages: list[str] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    most: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def respond(self, exchange: Exchange) -> None:
        message = str(exchange.body["messages"][-1]["content"])
        tenant = message.split("-")[0]
        with self.lock:
            self.messages.append(message)
            self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
            self.most[tenant] = max(self.most.get(tenant, 0), self.in_flight[tenant])
        try:
            time.sleep(self.seconds)
            Reply(f"echo: {message}").respond(exchange)
        finally:
            with self.lock:
                self.in_flight[tenant] -= 1

    def arrived(self) -> list[str]:
        with self.lock:
            return list(self.messages)


@pytest.fixture
def paced() -> Iterator[Callable[[float], tuple[StubProvider, Paced]]]:
    stubs: list[StubProvider] = []

    def make(seconds: float) -> tuple[StubProvider, Paced]:
        behaviour = Paced(seconds)
        stub = StubProvider(behaviour).start()
        stubs.append(stub)
        return stub, behaviour

    yield make
    for stub in stubs:
        stub.stop()


def config_for(stub: StubProvider, **sections: Any) -> dict[str, Any]:
    return {
        "Providers": {"stub": {"Kind": "openai", "BaseUrl": stub.base_url}},
        "Agents": {
            "echo": {"Instructions": "test agent", "Model": {"provider": "stub", "model": "m"}}
        },
        "Worker": {"Concurrency": SLOTS},
        **sections,
    }


def start(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    config: dict[str, Any],
) -> Runtime:
    """One worker of `SLOTS` threads, registered in the fair lines; the test's runtime."""
    cluster = make_cluster(sql_url, **config)
    cluster.worker("w1", concurrency=SLOTS)
    runtime = make_runtime(sql_url, **config)
    wait_until(
        lambda: runtime.fair_store.depth().slots == SLOTS,
        timeout=15,
        what="the worker's slots registered",
    )
    return runtime


def submit(runtime: Runtime, tenant_id: str, message: str, priority: int = 5) -> str:
    new = NewRun(tenant_id, "echo", {"message": message}, priority=priority)
    return runtime.dispatcher.submit(new).id


def completed(runtime: Runtime, run_ids: list[str]) -> int:
    done = 0
    for run_id in run_ids:
        run = runtime.runs.get(run_id)
        assert run is not None
        if run.status in ENDED:
            assert run.status == "Completed", (run.status, run.error_message)
            done += 1
    return done


def test_another_tenants_backlog_delays_a_run_by_about_one_run_per_slot(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    paced: Callable[[float], tuple[StubProvider, Paced]],
) -> None:
    """Before: first come first served, B's 4 runs completed 10.2 s after they were
    submitted, behind all of A's 400."""
    stub, answers = paced(ANSWER_SECONDS)
    runtime = start(make_cluster, make_runtime, sqlite_url, config_for(stub))
    a = runtime.tenants.ensure_tenant("a")
    b = runtime.tenants.ensure_tenant("b")
    # Given tenant A's 400 runs queued (about 5 s of work for 4 slots at 50 ms a run; a loaded
    # machine works some of them off while the rest are submitted)
    a_runs = [submit(runtime, a, f"a-{n}") for n in range(400)]
    lined = runtime.fair_store.depth().lined
    assert lined > 150, lined  # A's backlog waits in its line, not in the run queue
    # When tenant B submits 4 runs
    a_before = len(answers.arrived())
    submitted = time.monotonic()
    b_runs = [submit(runtime, b, f"b-{n}") for n in range(4)]
    wait_until(lambda: completed(runtime, b_runs) == 4, timeout=30, what="B's runs completed")
    took = time.monotonic() - submitted
    # Then B's first call came after at most a few of A's per slot (what the worker was busy
    # with, what was on its way), not after A's backlog; and most of the backlog still waited
    arrived = answers.arrived()
    b_first = min(arrived.index(f"b-{n}") for n in range(4))
    assert b_first - a_before <= 4 * SLOTS, (b_first, a_before, lined)
    assert took < 4.0, f"B's runs took {took:.2f}s"  # not A's backlog's (2 s and more)
    assert runtime.fair_store.depth().lined > lined // 2
    wait_until(lambda: completed(runtime, a_runs) == 400, timeout=60, what="A's runs completed")


def test_weights_divide_the_slots_between_two_backlogs(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    paced: Callable[[float], tuple[StubProvider, Paced]],
    redis_client: redis.Redis,
) -> None:
    stub, answers = paced(0.1)
    runtime = start(make_cluster, make_runtime, sqlite_url, config_for(stub))
    heavy = runtime.tenants.ensure_tenant("heavy")
    light = runtime.tenants.ensure_tenant("light")
    runtime.tenants.set_weight(heavy, 3)
    runtime.fair_store.register("", 0, {heavy: 3})  # what `tracon-jobs tenants weight` does
    # Given two backlogs of 80, submitted in turns
    runs = []
    for n in range(80):
        runs.append(submit(runtime, heavy, f"heavy-{n}"))
        runs.append(submit(runtime, light, f"light-{n}"))
    # When 80 of them have reached the provider
    wait_until(lambda: len(answers.arrived()) >= 80, timeout=60, what="80 calls")
    # Then, past the first ones sent before both lines were long, heavy got about 3 in 4
    window = answers.arrived()[16:80]
    share = sum(m.startswith("heavy") for m in window) / len(window)
    assert 0.65 <= share <= 0.85, (share, window)
    wait_until(lambda: completed(runtime, runs) == 160, timeout=60, what="all runs completed")


def test_a_higher_priority_goes_first_within_a_tenants_share(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    paced: Callable[[float], tuple[StubProvider, Paced]],
) -> None:
    stub, answers = paced(ANSWER_SECONDS)
    runtime = start(make_cluster, make_runtime, sqlite_url, config_for(stub))
    tenant = runtime.tenants.ensure_tenant("acme")
    # Given 40 runs of priority 5, then 4 of priority 9
    runs = [submit(runtime, tenant, f"acme-normal{n}") for n in range(40)]
    runs += [submit(runtime, tenant, f"acme-urgent{n}", priority=9) for n in range(4)]
    wait_until(lambda: completed(runtime, runs) == 44, timeout=60, what="all runs completed")
    # Then the urgent ones reached the provider right after what was on its way already
    arrived = answers.arrived()
    urgent = sorted(arrived.index(f"acme-urgent{n}") for n in range(4))
    assert urgent[-1] < 4 * SLOTS, arrived


def test_a_tenants_max_concurrent_runs_holds_while_another_tenant_goes_on(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    paced: Callable[[float], tuple[StubProvider, Paced]],
) -> None:
    stub, answers = paced(0.3)
    runtime = start(make_cluster, make_runtime, sqlite_url, config_for(stub))
    limited = runtime.tenants.ensure_tenant("limited")
    other = runtime.tenants.ensure_tenant("other")
    runtime.tenants.set_max_concurrent_runs(limited, 2)
    # Given 8 runs of a tenant limited to 2 at once, and 4 of another tenant after them
    limited_runs = [submit(runtime, limited, f"limited-{n}") for n in range(8)]
    other_runs = [submit(runtime, other, f"other-{n}") for n in range(4)]
    # Then the other tenant's runs complete long before the limited ones can
    wait_until(lambda: completed(runtime, other_runs) == 4, timeout=10, what="other's runs")
    assert completed(runtime, limited_runs) < 8
    wait_until(lambda: completed(runtime, limited_runs) == 8, timeout=60, what="limited runs")
    # And never more than 2 of the limited tenant's calls were in flight at once
    assert answers.most["limited"] == 2, answers.most
    assert len(answers.arrived()) == 12


def test_a_tenant_back_from_idle_starts_on_the_reserve_thread_while_every_slot_is_busy(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    paced: Callable[[float], tuple[StubProvider, Paced]],
) -> None:
    """`Worker.FairReserve` (1 by default): the worker's pool is its 4 slots and a thread that
    lined runs never get. (Calls of 8 s: none ends while the test looks.)"""
    stub, answers = paced(8.0)
    runtime = start(make_cluster, make_runtime, sqlite_url, config_for(stub))
    busy = runtime.tenants.ensure_tenant("busy")
    quiet = runtime.tenants.ensure_tenant("quiet")
    # Given every slot busy with a long call of one tenant, and 2 more of its runs lined
    for n in range(SLOTS + 2):
        submit(runtime, busy, f"busy-{n}")
    wait_until(lambda: len(answers.arrived()) == SLOTS, timeout=15, what="the slots busy")
    depth = runtime.fair_store.depth()
    assert (depth.lined, depth.reserve) == (2, 1), depth
    # When another tenant, idle until now, submits two runs
    submit(runtime, quiet, "quiet-0")
    submit(runtime, quiet, "quiet-1")
    # Then the first reaches the provider at once, beside the 4 busy calls, on the reserve
    # thread; the second waits its turn in a line, as the reserve is taken
    wait_until(lambda: "quiet-0" in answers.arrived(), timeout=1.5, what="quiet-0's call")
    assert answers.arrived()[SLOTS:] == ["quiet-0"]
    assert answers.in_flight["busy"] == SLOTS  # no busy call ended to make room for it
    assert runtime.fair_store.lines() == {busy: 2, quiet: 1}
    depth = runtime.fair_store.depth()
    assert (depth.running, depth.sent) == (SLOTS + 1, 0), depth


def test_a_killed_workers_places_free_once_its_registration_ends_and_lined_runs_go_out(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    paced: Callable[[float], tuple[StubProvider, Paced]],
) -> None:
    """A worker killed mid-run never says `done`: its runs' places are freed when it stops
    naming them (`REGISTRATION_MS`), not held for good. (Calls of 120 s: no run ends while
    the test looks, so only the kill can make room.)"""
    stub, answers = paced(120.0)
    config = config_for(stub, Worker={"Concurrency": 2, "FairReserve": 0})
    cluster = make_cluster(sqlite_url, **config)
    doomed = cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    runtime = make_runtime(sqlite_url, **config)
    wait_until(lambda: runtime.fair_store.depth().slots == 4, timeout=15, what="4 slots")
    busy = runtime.tenants.ensure_tenant("busy")
    # Given two workers of 2 slots each busy with a long call each slot, and 2 runs lined
    for n in range(SLOTS + 2):
        submit(runtime, busy, f"busy-{n}")
    # (each worker takes a message only for an idle thread: two runs each)
    wait_until(lambda: len(answers.arrived()) == SLOTS, timeout=15, what="the slots busy")
    depth = runtime.fair_store.depth()
    assert (depth.running, depth.lined) == (SLOTS, 2), depth

    # When one worker is killed mid-call, and its registration runs out
    doomed.kill9()
    wait_until(lambda: runtime.fair_store.depth().slots == 2, timeout=25, what="w1 gone")

    # Then its two runs hold no place any more (the other worker's two still do)
    wait_until(lambda: runtime.fair_store.depth().running == 2, timeout=10, what="places freed")
    assert runtime.fair_store.depth().lined == 2
    # and a new worker's slots send the lined runs at once, and it starts them (the busy
    # worker takes no message it has no idle thread for)
    cluster.worker("w3", concurrency=2)
    wait_until(lambda: runtime.fair_store.depth().lined == 0, timeout=10, what="lined runs sent")
    depth = runtime.fair_store.depth()
    assert (depth.slots, depth.running + depth.sent) == (4, 4), depth
    wait_until(lambda: len(answers.arrived()) == SLOTS + 2, timeout=10, what="w3's two calls")
