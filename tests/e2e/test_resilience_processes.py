"""The circuit and the slots are cluster-wide: real worker processes share them in Redis."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
from celery.utils.nodenames import worker_direct

from tests.e2e.cluster import Cluster, Process, wait_until
from tests.helpers import MakeRuntime, scripted_agent
from tests.stub_provider import StubProvider, error, hang, reply
from tracon_jobs.db.models import Run
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.worker.envelope import EXECUTE_TASK

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
HOST = socket.gethostname()


def stub_agent(stub: StubProvider, **sections: Any) -> dict[str, Any]:
    config = scripted_agent([])
    config["Providers"] = {"a": {"Kind": "openai", "BaseUrl": stub.base_url, "TimeoutSeconds": 30}}
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    return config | sections


class Submitter:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.tenant = runtime.tenants.ensure_tenant("acme")

    def to(self, worker: str) -> str:
        """A run whose message goes to one worker's own queue."""
        run_id = self.runtime.runs.create(NewRun(self.tenant, "demo", {"message": "go"})).id
        self.runtime.celery.send_task(
            EXECUTE_TASK, args=[run_id], queue=worker_direct(f"{worker}@{HOST}")
        )
        return run_id

    def finished(self, run_id: str, timeout: float = 30) -> Run:
        def done() -> bool:
            run = self.runtime.runs.get(run_id)
            return run is not None and run.status in ("Completed", "Failed", "Canceled")

        wait_until(done, timeout=timeout, what=f"run {run_id} finished")
        run = self.runtime.runs.get(run_id)
        assert run is not None
        return run

    def owner_pid(self, run_id: str) -> int:
        started = [e for e in self.runtime.runs.events(run_id) if e.type == "RunStarted"]
        return int(started[0].data["owner"].split("/")[1])


def start_workers(cluster: Cluster, count: int, concurrency: int) -> list[Process]:
    workers = [
        cluster.start(f"w{i}", "worker", "-n", f"w{i}@%h", "-c", str(concurrency))
        for i in range(count)
    ]
    for worker in workers:
        wait_until(ready(worker), timeout=60, what=f"{worker.name}")
    return workers


def ready(worker: Process) -> Callable[[], bool]:
    return lambda: "ready." in worker.text()


def test_four_processes_share_one_circuit(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    sections = stub_agent(
        stub_provider, CircuitBreaker={"FailureThreshold": 3, "BreakDuration": "00:00:03"}
    )
    workers = start_workers(make_cluster(sqlite_url, **sections), 4, concurrency=2)
    runtime = make_runtime(sqlite_url, **sections)
    submit = Submitter(runtime)
    stub_provider.default = error(500)

    # When runs arrive one after another, each on the next worker
    failed = [submit.finished(submit.to(f"w{i % 4}")) for i in range(3)]
    rejected = [submit.finished(submit.to(f"w{i}")) for i in range(4)]

    # Then the provider saw exactly the threshold, and every process refused the rest
    assert [r.error_type for r in failed] == ["provider_error"] * 3
    assert [r.error_type for r in rejected] == ["provider_unavailable"] * 4
    assert {submit.owner_pid(r.id) for r in rejected} == {w.popen.pid for w in workers}
    assert len(stub_provider.requests) == 3

    # When the break is over and all four workers try at once
    wait_until(
        lambda: runtime.breaker.snapshot("a").state == "half_open",
        timeout=10,
        what="the break to end",
    )
    stub_provider.default = hang(1.0, error(500))
    probes = [submit.to(f"w{i}") for i in range(4)]
    outcomes = sorted(submit.finished(run_id).error_type or "" for run_id in probes)

    # Then exactly one probe reached the provider, and its failure reopened the circuit
    assert len(stub_provider.requests) == 4
    assert outcomes == ["provider_error"] + ["provider_unavailable"] * 3
    assert runtime.breaker.snapshot("a").state == "open"


def test_concurrent_runs_open_the_circuit_at_exactly_the_threshold(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    sections = stub_agent(
        stub_provider, CircuitBreaker={"FailureThreshold": 5, "BreakDuration": "00:01:00"}
    )
    start_workers(make_cluster(sqlite_url, **sections), 4, concurrency=3)
    runtime = make_runtime(sqlite_url, **sections)
    submit = Submitter(runtime)
    stub_provider.default = hang(0.3, error(500))

    run_ids = [submit.to(f"w{i % 4}") for i in range(16)]
    runs = [submit.finished(run_id) for run_id in run_ids]

    opened = [
        e.data
        for run in runs
        for e in runtime.runs.events(run.id)
        if e.type == "CircuitStateChanged" and e.data["to"] == "open"
    ]
    assert len(opened) == 1 and opened[0]["failures"] == 5
    admitted = [r for r in runs if r.error_type == "provider_error"]
    assert len(stub_provider.requests) == len(admitted) >= 5
    # the overshoot is only the calls admitted before the circuit opened
    assert len(runs) - len(admitted) == sum(r.error_type == "provider_unavailable" for r in runs)


def test_fifty_runs_on_two_processes_never_exceed_the_provider_limit(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    sections = stub_agent(stub_provider, ModelConcurrency={"MaxConcurrentCallsPerProvider": 3})
    start_workers(make_cluster(sqlite_url, **sections), 2, concurrency=8)
    runtime = make_runtime(sqlite_url, **sections)
    submit = Submitter(runtime)
    stub_provider.default = hang(0.1, reply("ok"))

    run_ids = [submit.to(f"w{i % 2}") for i in range(50)]
    runs = [submit.finished(run_id, timeout=60) for run_id in run_ids]

    assert {r.status for r in runs} == {"Completed"}
    assert len(stub_provider.requests) == 50
    assert stub_provider.peak_in_progress == 3
    assert runtime.slots.usage("a").in_use == 0


def test_a_killed_holder_frees_its_slots_within_the_lease(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    sections = stub_agent(
        stub_provider,
        ModelConcurrency={"MaxConcurrentCallsPerProvider": 2, "SlotLease": "00:00:02"},
    )
    cluster = make_cluster(sqlite_url, **sections)
    doomed, survivor = start_workers(cluster, 2, concurrency=4)
    runtime = make_runtime(sqlite_url, **sections)
    submit = Submitter(runtime)
    stub_provider.default = hang(60, reply("never"))

    # Given a process holding both slots, with its calls renewing them past the lease
    for _ in range(2):
        submit.to("w0")
    wait_until(lambda: runtime.slots.usage("a").in_use == 2, timeout=20, what="2 slots held")
    threading.Event().wait(2.5)
    assert runtime.slots.usage("a").in_use == 2, "live holders renew their leases"

    # When it is killed, a run on the other process waits, then gets a slot within the lease
    doomed.kill9()
    stub_provider.default = reply("after the crash")
    later = submit.to("w1")
    run = submit.finished(later, timeout=10)

    assert run.status == "Completed" and run.output == {"text": "after the crash"}
    assert survivor.popen.poll() is None


def test_a_worker_logs_at_tracon_log_level_without_a_line_per_http_request(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sqlite_url: str,
    stub_provider: StubProvider,
) -> None:
    sections = stub_agent(stub_provider)
    cluster = make_cluster(sqlite_url, **sections)
    submit = Submitter(make_runtime(sqlite_url, **sections))
    stub_provider.default = reply("ok")

    # A worker at the default level: the run's own lines, not the HTTP client's per call
    quiet = cluster.worker("quiet")
    assert submit.finished(submit.to("quiet")).status == "Completed"
    # One at TRACON_LOG_LEVEL=DEBUG: Celery's setup keeps that level, and the client's line shows
    cluster.env["TRACON_LOG_LEVEL"] = "DEBUG"
    loud = cluster.worker("loud")
    assert submit.finished(submit.to("loud")).status == "Completed"

    wait_until(lambda: "succeeded in" in loud.text(), timeout=10, what="loud's task line")
    assert "succeeded in" in quiet.text()
    assert "HTTP Request: POST" not in quiet.text() and " DEBUG " not in quiet.text()
    assert "HTTP Request: POST" in loud.text() and " DEBUG " in loud.text()
