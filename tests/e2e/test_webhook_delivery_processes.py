"""Webhook delivery across real processes: Celery workers started by the command, a receiver
in a process of its own (`tests.webhook_receiver`, so that it outlives the workers killed
here), every request checked with the `standardwebhooks` package.

What is held, on SQLite and PostgreSQL:

1. A worker killed -9 in the middle of an attempt loses nothing: its claim runs out
   (`2 * Webhooks.Timeout + 5 s`), another worker sends the same `webhook-id` and the same
   bytes, the delivery ends `delivered`, and nothing is sent after that 2xx.
2. A process killed right after the commit of a state change (no deliverer in it) loses
   nothing: the outbox message was committed with the change, not fanned out; the first
   worker started afterwards delivers it, once.
3. Two workers deliver each message to each endpoint exactly once when every answer is 2xx:
   twenty runs, two endpoints, forty requests, no duplicate.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.e2e.cluster import REPO, Cluster, wait_until
from tests.helpers import MakeRuntime, Script, run_of, scripted_agent
from tests.webhook_receiver import Received, logged, wait_logged
from tracon_jobs.db.models import WebhookAttempt, WebhookDelivery, WebhookMessage
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import DELIVERY_CLAIM_MARGIN, Runtime
from tracon_jobs.webhooks.endpoints import EndpointStore

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ANSWER: Script = [{"Text": "It shipped."}]
TIMEOUT_SECONDS = 3
CLAIM_SECONDS = 2 * TIMEOUT_SECONDS + DELIVERY_CLAIM_MARGIN.total_seconds()
"""How long a delivery's claim holds: a killed worker's runs out after this (9 s)."""
WEBHOOKS = {
    "AllowHttp": True,
    "AllowPrivateNetworks": True,
    "Timeout": TIMEOUT_SECONDS,
    "PollInterval": 0.2,
    "Backoff": [0.5, 0.5],
}
QUIET_SECONDS = 2.0
"""How long a test watches for a request that must not come (a duplicate after a 2xx)."""
RUNS = 20


def sections() -> dict[str, Any]:
    """The configuration of every process of a test: one scripted agent, quick webhooks."""
    return scripted_agent(ANSWER) | {"Webhooks": dict(WEBHOOKS)}


# -- the receiver, a process of its own -------------------------------------------------------


@dataclass(frozen=True)
class ReceiverProcess:
    port: int
    log: Path

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


StartReceiver = Callable[..., ReceiverProcess]


@pytest.fixture
def start_receiver(tmp_path: Path) -> Iterator[StartReceiver]:
    """`start(hold_first=None)`: a receiver process on a free port, answering 200 (its first
    request only after `hold_first` seconds); every one is killed after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(hold_first: float | None = None) -> ReceiverProcess:
        log = tmp_path / f"receiver-{len(started)}.jsonl"
        argv = [sys.executable, "-m", "tests.webhook_receiver", "0", str(log)]
        if hold_first is not None:
            argv.append(str(hold_first))
        child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        started.append(child)
        assert child.stdout is not None
        line = child.stdout.readline().strip()  # "listening on PORT", or '' if it died
        assert line.startswith("listening on "), f"the receiver did not start: {line!r}"
        return ReceiverProcess(int(line.rsplit(" ", 1)[1]), log)

    yield start
    for child in started:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()


# -- what SQL holds -------------------------------------------------------------------------


def endpoint(runtime: Runtime, url: str, tenant: str = "acme") -> tuple[str, str]:
    """(id, secret) of a new endpoint for `run.completed`, as the API creates it (and every
    process told)."""
    store = EndpointStore(runtime.db, runtime.redis)
    made, secret = store.create(runtime.tenants.ensure_tenant(tenant), url, ["run.completed"])
    return made.id, secret


def deliveries(runtime: Runtime) -> list[WebhookDelivery]:
    with runtime.db.read() as session:
        query = sa.select(WebhookDelivery).order_by(WebhookDelivery.created_at, WebhookDelivery.id)
        return list(session.scalars(query))


def messages(runtime: Runtime) -> list[WebhookMessage]:
    with runtime.db.read() as session:
        query = sa.select(WebhookMessage).order_by(WebhookMessage.created_at, WebhookMessage.id)
        return list(session.scalars(query))


def attempts(runtime: Runtime) -> list[WebhookAttempt]:
    with runtime.db.read() as session:
        return list(session.scalars(sa.select(WebhookAttempt).order_by(WebhookAttempt.id)))


def all_delivered(runtime: Runtime, count: int) -> Callable[[], bool]:
    def done() -> bool:
        found = deliveries(runtime)
        return len(found) == count and all(d.status == "delivered" for d in found)

    return done


def submit(runtime: Runtime, tenant: str = "acme") -> str:
    """A run sent to the workers through Celery, as the web sends one."""
    tenant_id = runtime.tenants.ensure_tenant(tenant)
    return runtime.dispatcher.submit(NewRun(tenant_id, "demo", {"message": "go"})).id


def nothing_more(log: Path, count: int) -> list[Received]:
    """The receiver's requests, once no more than `count` came for `QUIET_SECONDS`."""
    time.sleep(QUIET_SECONDS)
    found = logged(log)
    assert len(found) == count, [(r.path, r.webhook_id) for r in found]
    return found


# -- 1. a worker killed mid-delivery ----------------------------------------------------------


def test_a_worker_killed_mid_delivery_loses_nothing_and_the_next_sends_the_same_message(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    start_receiver: StartReceiver,
) -> None:
    # Given a receiver that holds its first request (it answers only after a minute), an
    # endpoint for it, and worker A
    receiver = start_receiver(hold_first=60)
    config = sections()
    cluster = make_cluster(sql_url, **config)
    runtime = make_runtime(sql_url, **config)
    hook, secret = endpoint(runtime, receiver.url())
    doomed = cluster.worker("a")

    # When a run completes and A's attempt is in the receiver's hands
    run_id = submit(runtime)
    [first] = wait_logged(receiver.log, 1, timeout=30)
    # And A is killed -9 before it hears the answer (well within its 2 s timeout)
    doomed.kill9()
    # (what A left: its claim, live, and no attempt recorded: it died mid-attempt)
    [held] = deliveries(runtime)
    assert (held.target, held.status, held.attempts) == (hook, "pending", 0)
    assert held.claimed_by is not None and held.claim_until is not None
    assert held.claimed_by.startswith(f"{socket.gethostname()}:{doomed.popen.pid}:")
    claim_ends = held.claim_until.replace(tzinfo=UTC).timestamp()
    assert CLAIM_SECONDS - 1 < claim_ends - first.at <= CLAIM_SECONDS, claim_ends - first.at
    assert attempts(runtime) == []
    # And then worker B starts
    survivor = cluster.worker("b")
    ready_at = time.time()

    # Then B sends it again once A's claim ran out: the same webhook-id, the same bytes
    first_payload = first.verified(secret)
    got = wait_logged(receiver.log, 2, timeout=CLAIM_SECONDS + 20)
    second = got[1]
    assert second.webhook_id == first.webhook_id == held.message_id
    assert second.body == first.body
    assert second.verified(secret) == first_payload
    assert first_payload["type"] == "run.completed" and first_payload["data"]["id"] == run_id
    assert run_of(runtime, run_id).status == "Completed"
    # not before the claim ran out, and soon after it did (and B was there)
    assert second.at > claim_ends, (second.at, claim_ends)
    assert second.at - max(claim_ends, ready_at) < 5, (second.at, claim_ends, ready_at)
    # And the delivery ends delivered, with B's attempt the only one recorded
    wait_until(all_delivered(runtime, 1), timeout=10, what="delivered", watch=[survivor])
    [done] = deliveries(runtime)
    assert (done.id, done.attempts, done.last_status) == (held.id, 1, 200)
    assert (done.claimed_by, done.claim_until) == (None, None)
    assert [(a.delivery_id, a.status) for a in attempts(runtime)] == [(held.id, 200)]
    # And nothing more is sent after the 2xx
    nothing_more(receiver.log, 2)
    assert [d.status for d in deliveries(runtime)] == ["delivered"]


# -- 2. a process killed between the state change and its delivery -----------------------------

COMMITTED_THEN_KILLED = """
import json, sys, time
from tracon_jobs.runs.store import NewRun
from tracon_jobs.runtime import Runtime
from tracon_jobs.settings import Settings
runtime = Runtime(Settings.model_validate(json.loads(sys.argv[1])), sender=lambda _run_id: None)
tenant = runtime.tenants.ensure_tenant("acme")
run_id = runtime.runs.create(NewRun(tenant, "demo", {"message": "go"})).id
outcome = runtime.executor.execute(run_id)
print(outcome, run_id, flush=True)
time.sleep(60)
"""
"""A process that is no worker (so starts no deliverer): it completes a run, whose final
write commits the run.completed message, says so, and waits to be killed -9."""


def test_a_process_killed_after_the_state_change_loses_no_delivery(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_url: str,
    start_receiver: StartReceiver,
) -> None:
    # Given an endpoint, and no worker anywhere
    receiver = start_receiver()
    config = sections()
    cluster = make_cluster(sql_url, **config)
    runtime = make_runtime(sql_url, **config)
    hook, secret = endpoint(runtime, receiver.url())

    # When a process completes a run and is killed -9 right after its commit
    settings = config | {"Database": {"Url": sql_url}, "Redis": {"Url": redis_url}}
    child = subprocess.Popen(
        [sys.executable, "-c", COMMITTED_THEN_KILLED, json.dumps(settings)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        said = child.stdout.readline().split()
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    assert len(said) == 2 and said[0] == "Completed", said
    run_id = said[1]

    # Then the change and its message are committed, the message not fanned out, nothing sent
    assert run_of(runtime, run_id).status == "Completed"
    [message] = messages(runtime)
    assert (message.type, message.subject_id, message.fanned_at) == ("run.completed", run_id, None)
    assert deliveries(runtime) == []
    assert logged(receiver.log) == []

    # And when a worker starts, it delivers the message once, signed, and records it
    worker = cluster.worker("w1")
    [got] = wait_logged(receiver.log, 1, timeout=20)
    payload = got.verified(secret)
    assert got.webhook_id == message.id
    assert payload["type"] == "run.completed"
    assert payload["data"]["id"] == run_id and payload["data"]["status"] == "Completed"
    wait_until(all_delivered(runtime, 1), timeout=10, what="delivered", watch=[worker])
    [done] = deliveries(runtime)
    assert (done.target, done.message_id, done.attempts, done.last_status) == (
        hook,
        message.id,
        1,
        200,
    )
    [fanned] = messages(runtime)
    assert fanned.fanned_at is not None and fanned.body == got.body.decode()
    nothing_more(receiver.log, 1)


# -- 3. two workers, every answer 2xx ---------------------------------------------------------


def test_two_workers_deliver_each_message_to_each_endpoint_once(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    start_receiver: StartReceiver,
) -> None:
    # Given two endpoints on one receiver, and two workers
    receiver = start_receiver()
    config = sections()
    cluster = make_cluster(sql_url, **config)
    runtime = make_runtime(sql_url, **config)
    hooks = {
        "/a": endpoint(runtime, receiver.url("/a")),
        "/b": endpoint(runtime, receiver.url("/b")),
    }
    workers = [cluster.worker("w1"), cluster.worker("w2")]

    # When twenty runs complete
    run_ids = {submit(runtime) for _ in range(RUNS)}
    wait_until(
        lambda: all(run_of(runtime, r).status == "Completed" for r in run_ids),
        timeout=60,
        what=f"{RUNS} runs Completed",
        watch=workers,
    )

    # Then the receiver gets each message once at each endpoint, each request signed
    wait_logged(receiver.log, 2 * RUNS, timeout=30)
    got = nothing_more(receiver.log, 2 * RUNS)
    pairs = Counter((r.webhook_id, r.path) for r in got)
    assert [pair for pair, n in pairs.items() if n > 1] == []
    assert len(pairs) == 2 * RUNS
    by_message: dict[str, set[str]] = {}
    ran: set[str] = set()
    for request in got:
        payload = request.verified(hooks[request.path][1])
        assert payload["type"] == "run.completed"
        ran.add(payload["data"]["id"])
        by_message.setdefault(request.webhook_id, set()).add(request.path)
    assert ran == run_ids
    assert len(by_message) == RUNS and all(p == {"/a", "/b"} for p in by_message.values())
    # And every delivery is delivered at its first attempt, one attempt recorded each
    wait_until(all_delivered(runtime, 2 * RUNS), timeout=10, what="all delivered", watch=workers)
    rows = deliveries(runtime)
    assert {(d.target, d.message_id) for d in rows} == {
        (hooks[r.path][0], r.webhook_id) for r in got
    }
    assert [d.attempts for d in rows] == [1] * (2 * RUNS)
    assert sorted(Counter(a.delivery_id for a in attempts(runtime)).values()) == [1] * (2 * RUNS)
    assert {m.id for m in messages(runtime)} == set(by_message)
