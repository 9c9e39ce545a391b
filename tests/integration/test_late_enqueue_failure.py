"""A submission whose send fails only after the run was sent again and taken: a partition
between the web and Redis makes the web's send take longer than `Runs.RequeueAfter`, and the
requeue scan (on a worker that still reaches Redis) sends the `Queued` run meanwhile.
tests/e2e/test_partition_processes.py shows it with real processes; this is the race alone."""

from __future__ import annotations

import pytest

from tests.helpers import MakeRuntime, claim_run, run_of, scripted_agent
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.store import NewRun


def test_a_send_failing_after_a_worker_took_the_run_accepts_the_run(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a send that fails only once another worker has claimed the run
    runtime = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))

    def taken_then_refused(run_id: str) -> None:
        assert claim_run(runtime, run_id, "the-other-worker") is not None
        raise EnqueueError(f"the broker did not accept run {run_id}: Timeout connecting")

    runtime.send_runs_with(taken_then_refused)
    tenant = runtime.tenants.ensure_tenant("acme")

    # When the run is submitted
    run = runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "x"}))

    # Then the submission is accepted (no 503 for a run that executes), and the run is the
    # worker's, not closed `enqueue_failed`
    taken = run_of(runtime, run.id)
    assert (taken.status, taken.error_type, taken.owner) == ("Running", None, "the-other-worker")


def test_a_send_refused_while_the_run_still_waits_fails_it(
    make_runtime: MakeRuntime, sql_url: str
) -> None:
    # Given a send that fails while the run is still Queued (nobody took it)
    runtime = make_runtime(sql_url, **scripted_agent([{"Text": "hi"}]))
    sent: list[str] = []

    def refused(run_id: str) -> None:
        sent.append(run_id)
        raise EnqueueError(f"the broker did not accept run {run_id}: down")

    runtime.send_runs_with(refused)
    tenant = runtime.tenants.ensure_tenant("acme")

    # When the run is submitted, the caller hears of it
    with pytest.raises(EnqueueError):
        runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "x"}))

    # Then the run is closed, and a message sent later (the requeue scan's) cannot claim it
    (run_id,) = sent
    assert run_of(runtime, run_id).error_type == "enqueue_failed"
    assert claim_run(runtime, run_id, "the-other-worker") is None
