"""Parked runs: a run whose next model call would wait past `Runs.ParkAfter` for its
provider's rate limits is saved `Queued` with its conversation (`RunParked`), holds no
worker thread, and goes on when the limit has room (`RunResumed`, a new claim, the saved
turn); a parked run is canceled at once, and one whose process died is sent again by the
requeue scan. The real openai client against the stub, real Redis and SQL."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from tests.helpers import MakeRuntime, ThreadWorker, scripted_agent, wait_until
from tests.stub_provider import Reply, StubProvider, error, tool_call
from tracon_jobs.runs.cancel import cancel_tree
from tracon_jobs.runs.requeue import requeue_unclaimed
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime

WINDOW_MS = 1500  # the rules are those of 60 s windows, quicker


def limited(stub: StubProvider, requests: int) -> dict[str, Any]:
    config = scripted_agent([], ["lookup_order"])
    config["Providers"] = {
        "a": {"Kind": "openai", "BaseUrl": stub.base_url, "RequestsPerMinute": requests}
    }
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    config["Runs"] = {"ParkAfter": "00:00:00.200"}
    return config


def started(runtime: Runtime, sender: Any = None) -> Runtime:
    runtime.executor.rate_limits.window_ms = WINDOW_MS
    if sender is not None:
        runtime.send_runs_with(sender)
    return runtime


def submit(runtime: Runtime) -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "go"})).id


def status(runtime: Runtime, run_id: str) -> str | None:
    run = runtime.runs.get(run_id)
    return None if run is None else run.status


def types(runtime: Runtime, run_id: str) -> list[str]:
    return [event.type for event in runtime.runs.events(run_id)]


def test_a_run_over_the_rate_limit_parks_and_goes_on_from_its_saved_turn(
    make_runtime: MakeRuntime,
    sql_url: str,
    stub_provider: StubProvider,
    thread_worker: ThreadWorker,
) -> None:
    runtime = make_runtime(sql_url, **limited(stub_provider, requests=3))
    started(runtime, thread_worker.sender(runtime))
    # the first run takes two of the three calls a window, the second run one: its second
    # turn is parked
    stub_provider.enqueue(tool_call("lookup_order", {"order_id": "A-1"}), Reply("busy"))
    busy = submit(runtime)
    wait_until(lambda: status(runtime, busy) == "Completed", timeout=10, what="the first run")
    stub_provider.enqueue(tool_call("lookup_order", {"order_id": "A-2"}), Reply("shipped"))

    run_id = submit(runtime)

    wait_until(lambda: "RunParked" in types(runtime, run_id), timeout=10, what="parked")
    parked = runtime.runs.get(run_id)
    assert parked is not None and parked.status == "Queued" and parked.owner is None
    assert parked.heartbeat_at is None and parked.turns_completed == 1
    wait_until(lambda: status(runtime, run_id) == "Completed", timeout=10, what="resumed")
    done = runtime.runs.get(run_id)
    assert done is not None and done.output == {"text": "shipped"}
    seen = types(runtime, run_id)
    assert seen.index("RunParked") < seen.index("RunResumed") < seen.index("RunCompleted")
    assert seen.count("ToolCallStarted") == 1  # the saved turn is not done again
    assert seen.count("RunStarted") == 2 and done.fence == 2
    assert len(stub_provider.requests) == 4


def test_a_thousand_calls_over_the_limit_hold_no_worker_thread(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = started(make_runtime(sql_url, **limited(stub_provider, requests=1)))
    # a window no loaded machine outruns: 20 runs parked within 1.5 s was too tight for one
    runtime.executor.rate_limits.window_ms = 30_000
    runtime.send_runs_with(lambda _run_id: None)  # sent again: nobody takes it here
    stub_provider.enqueue(Reply("first"))
    first = submit(runtime)
    runtime.executor.execute(first)
    runs = [submit(runtime) for _ in range(20)]
    threads_before = {thread.ident for thread in threading.enumerate()}
    began = time.monotonic()

    outcomes = [runtime.executor.execute(run_id) for run_id in runs]

    assert time.monotonic() - began < 5  # none of them waited out the window
    assert outcomes == ["Queued"] * 20
    new_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
    assert set(new_threads) <= {"parked-runs", "timers"}  # no thread a run, none waiting
    assert runtime.resumer.pending() == 20
    assert len(stub_provider.requests) == 1


def test_a_parked_run_is_canceled_at_once_and_not_sent_again(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = started(make_runtime(sql_url, **limited(stub_provider, requests=1)))
    sent: list[str] = []
    runtime.send_runs_with(sent.append)
    stub_provider.enqueue(Reply("first"))
    runtime.executor.execute(submit(runtime))
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Queued"
    run = runtime.runs.get(run_id)
    assert run is not None

    cancel_tree(runtime.runs, runtime.cancel_bus, runtime.approval_store, run)

    canceled = runtime.runs.get(run_id)
    assert canceled is not None and canceled.status == "Canceled"
    assert runtime.resumer.resume(run_id) is False
    assert "RunResumed" not in types(runtime, run_id)


def test_a_parked_run_whose_process_died_is_sent_by_the_requeue_scan(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = started(make_runtime(sql_url, **limited(stub_provider, requests=1)))
    runtime.send_runs_with(lambda _run_id: None)
    stub_provider.enqueue(Reply("first"))
    runtime.executor.execute(submit(runtime))
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Queued"
    parked = runtime.runs.get(run_id)
    assert parked is not None and parked.enqueued_at is not None
    # (its process died: its resumer never sends it)
    requeue_after = timedelta(seconds=1)

    too_early = requeue_unclaimed(
        runtime.runs, runtime.dispatcher, requeue_after, parked.enqueued_at
    )
    late = requeue_unclaimed(
        runtime.runs,
        runtime.dispatcher,
        requeue_after,
        parked.enqueued_at + requeue_after + timedelta(seconds=1),
    )

    assert run_id not in too_early.resent  # not before the time it was parked for
    assert run_id in late.resent


def slot_limited(stub: StubProvider) -> dict[str, Any]:
    config = scripted_agent([])
    config["Providers"] = {"a": {"Kind": "openai", "BaseUrl": stub.base_url}}
    config["Agents"]["demo"]["Model"] = {"provider": "a", "model": "gpt-a"}
    config["ModelConcurrency"] = {"MaxConcurrentCallsPerProvider": 1}
    config["Runs"] = {"ParkAfter": "00:00:00.200"}
    return config


def test_a_run_that_waited_past_park_after_for_a_slot_parks_and_goes_on_later(
    make_runtime: MakeRuntime, sql_url: str, stub_provider: StubProvider
) -> None:
    runtime = make_runtime(sql_url, **slot_limited(stub_provider))
    resent: list[str] = []
    runtime.send_runs_with(resent.append)
    # Given the provider's one slot held by another process's call
    store = runtime.slots.store
    assert store.try_acquire("a", "another-call", 1, 60_000)
    stub_provider.enqueue(Reply("done"))
    run_id = submit(runtime)
    resent.clear()  # its first send
    began = time.monotonic()

    # When the run's call has waited Runs.ParkAfter for it
    outcome = runtime.executor.execute(run_id)

    # Then the run is parked (no event of a call started), its thread free
    assert outcome == "Queued"
    assert time.monotonic() - began < 10  # not the slot's 60 s
    parked = [e for e in runtime.runs.events(run_id) if e.type == "RunParked"]
    assert len(parked) == 1 and parked[0].data["reason"] == "concurrency_slot"
    assert "ModelCallStarted" not in types(runtime, run_id)
    assert len(stub_provider.requests) == 0
    # And once the slot is free it is sent again (at the expected wait) and completes
    store.release("a", "another-call")
    wait_until(lambda: run_id in resent, timeout=10, what="the parked run sent again")
    assert runtime.executor.execute(run_id) == "Completed"
    assert len(stub_provider.requests) == 1


def test_with_park_on_open_circuit_a_run_refused_by_every_link_parks_until_the_reopen(
    make_runtime: MakeRuntime, sqlite_url: str, stub_provider: StubProvider
) -> None:
    config = slot_limited(stub_provider)
    del config["ModelConcurrency"]
    config["CircuitBreaker"] = {"FailureThreshold": 1, "BreakDuration": "00:00:03"}
    config["Runs"] = {"ParkOnOpenCircuit": True}
    runtime = make_runtime(sqlite_url, **config)
    resent: list[str] = []
    runtime.send_runs_with(resent.append)
    stub_provider.enqueue(error(500))
    first = submit(runtime)
    assert runtime.executor.execute(first) == "Failed"  # it opened the circuit
    stub_provider.enqueue(Reply("after the break"))

    run_id = submit(runtime)
    resent.clear()  # its first send
    assert runtime.executor.execute(run_id) == "Queued"

    parked = [e for e in runtime.runs.events(run_id) if e.type == "RunParked"]
    assert len(parked) == 1 and parked[0].data["reason"] == "circuit_open"
    assert len(stub_provider.requests) == 1  # the refused run called nobody
    wait_until(lambda: run_id in resent, timeout=10, what="sent again at the reopen")
    outcome = runtime.executor.execute(run_id)
    assert outcome == "Completed", [(e.type, e.data) for e in runtime.runs.events(run_id)]
    done = runtime.runs.get(run_id)
    assert done is not None and done.output == {"text": "after the break"}


def test_without_park_on_open_circuit_a_refused_run_fails_fast_as_the_spec_says(
    make_runtime: MakeRuntime, sqlite_url: str, stub_provider: StubProvider
) -> None:
    config = slot_limited(stub_provider)
    del config["ModelConcurrency"]
    config["CircuitBreaker"] = {"FailureThreshold": 1, "BreakDuration": "00:01:00"}
    runtime = make_runtime(sqlite_url, **config)
    runtime.send_runs_with(lambda _run_id: None)
    stub_provider.enqueue(error(500))
    assert runtime.executor.execute(submit(runtime)) == "Failed"
    run_id = submit(runtime)
    assert runtime.executor.execute(run_id) == "Failed"
    run = runtime.runs.get(run_id)
    assert run is not None and run.error_type == "provider_unavailable"
