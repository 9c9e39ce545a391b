"""`Tenants.MaxConcurrentRuns`: the store's rules (in memory and in real Redis, the same
tests), and in runs: a tenant at its limit has its other runs wait `Queued` (no thread, no
write), in order, while another tenant's runs go on; each starts as the tenant's runs end."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import (
    MakeRuntime,
    ThreadWorker,
    as_the_command_line,
    scripted_agent,
    wait_until,
)
from tests.stub_provider import StubProvider, hang
from tracon_jobs.cli import main
from tracon_jobs.limits.tenant_runs import (
    MemoryTenantRunStore,
    RedisTenantRunStore,
    TenantRunStore,
)
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

LEASE = 60_000


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, redis_client: redis.Redis) -> TenantRunStore:
    return (
        MemoryTenantRunStore() if request.param == "memory" else RedisTenantRunStore(redis_client)
    )


def test_a_tenant_runs_its_most_and_the_others_wait_in_order(store: TenantRunStore) -> None:
    assert store.admit("t", "a", 2, LEASE) and store.admit("t", "b", 2, LEASE)
    assert not store.admit("t", "c", 2, LEASE)
    assert not store.admit("t", "d", 2, LEASE)
    assert store.admit("t", "a", 2, LEASE)  # a run that holds a place keeps it
    assert store.admit("other", "x", 2, LEASE)  # another tenant is not held back

    assert store.release("t", "a", 2, LEASE) == ["c"]  # the longest waiting, its place held
    assert not store.admit("t", "e", 2, LEASE)  # a newcomer does not take c's place
    assert store.admit("t", "c", 2, LEASE)
    assert store.release("t", "b", 2, LEASE) == ["d"]
    assert store.release("t", "c", 2, LEASE) == ["e"]


def test_a_waiting_run_sent_again_keeps_its_place_in_line(store: TenantRunStore) -> None:
    assert store.admit("t", "a", 1, LEASE)
    assert not store.admit("t", "b", 1, LEASE)
    assert not store.admit("t", "c", 1, LEASE)
    assert not store.admit("t", "c", 1, LEASE)  # its message again (the requeue scan)
    assert store.release("t", "a", 1, LEASE) == ["b"]


def test_a_place_whose_run_died_frees_itself_when_its_lease_ends(
    redis_client: redis.Redis,
) -> None:
    store = RedisTenantRunStore(redis_client)
    assert store.admit("t", "dead", 1, 200)
    assert not store.admit("t", "next", 1, 200)
    time.sleep(0.3)
    assert store.admit("t", "next", 1, 200)


def limited(stub: StubProvider, max_runs: int) -> dict[str, Any]:
    config = scripted_agent([])
    config["Providers"] = {"a": {"Kind": "openai", "BaseUrl": stub.base_url}}
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    config["Tenants"] = {"MaxConcurrentRuns": max_runs}
    return config


def submit(runtime: Runtime, tenant: str) -> str:
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    return runtime.dispatcher.submit(NewRun(tenant_id, "demo", {"message": "go"})).id


def test_a_busy_tenant_waits_its_turn_and_another_tenant_goes_on(
    make_runtime: MakeRuntime,
    sql_url: str,
    stub_provider: StubProvider,
    thread_worker: ThreadWorker,
) -> None:
    runtime = make_runtime(sql_url, **limited(stub_provider, max_runs=1))
    runtime.send_runs_with(thread_worker.sender(runtime))
    stub_provider.default = hang(0.4)

    busy = [submit(runtime, "acme") for _ in range(3)]
    time.sleep(0.1)
    other = submit(runtime, "globex")

    def status(run_id: str) -> str | None:
        run = runtime.runs.get(run_id)
        return None if run is None else run.status

    wait_until(lambda: status(other) == "Completed", timeout=5, what="the other tenant's run")
    assert [status(run_id) for run_id in busy].count("Running") <= 1
    wait_until(
        lambda: all(status(run_id) == "Completed" for run_id in busy), timeout=10, what="acme"
    )
    assert stub_provider.peak_in_progress <= 2  # globex's beside one of acme's, never two
    started = [
        next(e.at for e in runtime.runs.events(run_id) if e.type == "RunStarted") for run_id in busy
    ]
    ended = [
        next(e.at for e in runtime.runs.events(run_id) if e.type == "RunCompleted")
        for run_id in busy
    ]
    order = sorted(range(3), key=lambda i: started[i])
    for earlier, later in itertools.pairwise(order):
        assert ended[earlier] <= started[later]  # never two of acme's at once
    resumed = [e for run_id in busy for e in runtime.runs.events(run_id) if e.type == "RunResumed"]
    assert [e.data["after"] for e in resumed] == ["tenant_concurrency"] * 2
    other_ended = next(e.at for e in runtime.runs.events(other) if e.type == "RunCompleted")
    assert other_ended < max(ended)  # globex's run did not wait behind acme's line


def test_without_a_limit_no_run_waits(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    config = limited(stub_provider, max_runs=1)
    del config["Tenants"]
    runtime = make_runtime(sql_url, **config)
    assert runtime.executor.tenant_runs.limit is None


def test_a_tenants_own_limit_holds_over_the_default(
    make_runtime: MakeRuntime,
    sql_url: str,
    stub_provider: StubProvider,
    thread_worker: ThreadWorker,
) -> None:
    config = limited(stub_provider, max_runs=1)
    del config["Tenants"]  # no default: only acme's own limit holds
    runtime = make_runtime(sql_url, **config)
    runtime.send_runs_with(thread_worker.sender(runtime))
    acme = runtime.tenants.ensure_tenant("acme")
    runtime.tenants.set_max_concurrent_runs(acme, 1)
    stub_provider.default = hang(0.3)

    busy = [submit(runtime, "acme") for _ in range(2)]
    free = [submit(runtime, "globex") for _ in range(2)]

    def done(run_id: str) -> bool:
        run = runtime.runs.get(run_id)
        return run is not None and run.status == "Completed"

    wait_until(lambda: all(done(r) for r in busy + free), timeout=10, what="every run")
    resumed = [e for run_id in busy for e in runtime.runs.events(run_id) if e.type == "RunResumed"]
    assert len(resumed) == 1  # one of acme's waited for the other
    assert not any(e.type == "RunResumed" for r in free for e in runtime.runs.events(r))
    assert stub_provider.peak_in_progress <= 3  # globex's two beside one of acme's, never two


def test_tenants_concurrency_sets_shows_and_clears(
    make_runtime: MakeRuntime,
    sqlite_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config: dict[str, Any] = {"Tenants": {"MaxConcurrentRuns": 4}}
    path = write_config(Database={"Url": sqlite_url}, Redis={"Url": redis_url}, **config)
    as_the_command_line(monkeypatch, tmp_path, path)
    runtime = make_runtime(sqlite_url, **config)
    acme = runtime.tenants.ensure_tenant("acme")

    assert main(["tenants", "concurrency", "acme"]) == 0
    assert "4 runs at once (Tenants.MaxConcurrentRuns)" in capsys.readouterr().out
    assert main(["tenants", "concurrency", "acme", "2"]) == 0
    assert "2 runs at once (own)" in capsys.readouterr().out
    assert runtime.tenants.max_concurrent_runs(acme) == 2
    assert main(["tenants", "concurrency", "acme", "--clear"]) == 0
    assert runtime.tenants.max_concurrent_runs(acme) is None
    with pytest.raises(SystemExit):
        main(["tenants", "concurrency", "acme", "0"])
    assert main(["tenants", "concurrency", "acme", "3", "--clear"]) != 0
