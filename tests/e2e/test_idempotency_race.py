"""`Idempotency-Key` across real processes: gunicorn with two web workers racing on one key,
and a web process killed between reservation and completion (the operator path)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import redis_db
from tests.e2e.cluster import Cluster, wait_for_log, wait_until
from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.idempotency import IdempotencyStore
from tracon_jobs.runs.store import RunFilter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BODY = b'{"message": "Prepare the customer-safe status for ticket 4182."}'
PATH = "/api/agents/demo/run"


@pytest.fixture
def cluster_redis_url(redis_url: str) -> Iterator[str]:
    """A Redis database of these tests' own, beside the session's: a worker of another test
    consuming from the session database's queue would drop our runs as unknown."""
    url = redis_db(redis_url, 2)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def make_cluster(
    tmp_path: Path,
    cluster_redis_url: str,
    redis_client: redis.Redis,
    broker_sections: dict[str, Any],
) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(sql_url: str, **sections: Any) -> Cluster:
        merged = {**broker_sections, **sections}  # RabbitMQ with TRACON_TEST_BROKER=amqp
        cluster = Cluster.create(tmp_path, sql_url, cluster_redis_url, **merged)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()


def headers(api_key: str, idem: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {api_key}",
        "Content-Type": "application/json",
        "Idempotency-Key": idem,
    }


def cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracon_jobs.cli", "idempotency", *args],
        env=cluster.env,
        cwd=cluster.directory,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_twenty_concurrent_duplicates_across_two_web_processes_execute_once(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sql_url: str
) -> None:
    sections = scripted_agent([{"Text": "ticket 4182 is on its way", "DelaySeconds": 1.0}])
    sections["Runs"] = {"BufferedWaitTimeout": 30}  # a lost run shows as a 202, not a hang
    cluster = make_cluster(sql_url, **sections)
    cluster.worker("w1")
    web, base = cluster.web(workers=2)
    wait_until(lambda: web.text().count("Booting worker") == 2, timeout=30, what="two web workers")
    runtime = make_runtime(sql_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    key = runtime.tenants.issue_key(tenant).secret

    # When 20 clients send the same request with the same key at the same moment
    barrier = threading.Barrier(20)
    answers: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(timeout=60) as client:  # a connection of its own
            barrier.wait()
            answers.append(client.post(base + PATH, content=BODY, headers=headers(key, "t-4182")))

    threads = [threading.Thread(target=send) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    # Then exactly one run executed, and every other client got 409 or the replay
    assert len(answers) == 20
    executed = [
        a for a in answers if a.status_code == 200 and "Idempotency-Replayed" not in a.headers
    ]
    others = [a for a in answers if a not in executed]
    assert len(executed) == 1, ([(a.status_code, a.text[:300]) for a in answers], cluster.logs())
    assert all(
        a.status_code == 409
        or (a.status_code == 200 and a.headers["Idempotency-Replayed"] == "true")
        for a in others
    )
    runs = runtime.runs.page(tenant, RunFilter(), limit=10, before=None)
    assert len(runs) == 1 and runs[0].status == "Completed"
    started = [e for e in runtime.runs.events(runs[0].id) if e.type == "RunStarted"]
    assert len(started) == 1
    assert executed[0].json()["id"] == runs[0].id

    # And a later retry is the byte-identical replay
    retry = httpx.post(base + PATH, content=BODY, headers=headers(key, "t-4182"), timeout=30)
    assert retry.status_code == 200 and retry.headers["Idempotency-Replayed"] == "true"
    assert retry.content == executed[0].content
    assert retry.headers["content-type"] == executed[0].headers["content-type"]
    assert len(runtime.runs.page(tenant, RunFilter(), limit=10, before=None)) == 1


@pytest.mark.long
def test_a_crash_after_reservation_leaves_in_progress_for_the_operator_to_release(
    make_cluster: Callable[..., Cluster], make_runtime: MakeRuntime, sql_url: str
) -> None:
    sections = scripted_agent([{"Text": "slow", "DelaySeconds": 5}])
    cluster = make_cluster(sql_url, **sections)
    cluster.worker("w1")
    web, base = cluster.web()
    runtime = make_runtime(sql_url, **sections)
    tenant = runtime.tenants.ensure_tenant("acme")
    key = runtime.tenants.issue_key(tenant).secret
    store = IdempotencyStore(runtime.db)

    # Given a buffered request whose web process dies while its run is going
    def doomed() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the connection dies with the process
            httpx.post(base + PATH, content=BODY, headers=headers(key, "crash-1"), timeout=30)

    caller = threading.Thread(target=doomed)
    caller.start()
    try:
        wait_until(
            lambda: any(r.run_id for r in store.list_in_progress(tenant)),
            timeout=20,
            what="the reservation to name its run",
        )
    except TimeoutError as exc:
        raise AssertionError(cluster.logs()) from exc
    web.kill9()
    caller.join(30)
    [record] = store.list_in_progress(tenant)

    # When the operator lists the in-progress records
    listed = cli(cluster, "list", "--in-progress")

    # Then the record is there, with its tenant, route and run
    assert listed.returncode == 0, listed.stderr
    assert "InProgress" in listed.stdout and "key=crash-1" in listed.stdout
    assert f"tenant={tenant}" in listed.stdout and f"run={record.run_id}" in listed.stdout
    assert f"POST {PATH}" in listed.stdout

    # And a retry is refused with 409 until the operator releases the key
    new_web, new_base = cluster.web(name="web2")
    refused = httpx.post(new_base + PATH, content=BODY, headers=headers(key, "crash-1"))
    assert refused.status_code == 409

    unknown = cli(cluster, "release", "nope", "--tenant", "acme")
    released = cli(cluster, "release", "crash-1", "--tenant", "acme")
    assert unknown.returncode == 1 and "no InProgress record" in unknown.stderr
    assert released.returncode == 0 and "released key 'crash-1'" in released.stdout, released.stderr
    assert (
        cli(cluster, "list", "--in-progress").stdout.strip() == "no InProgress idempotency records"
    )

    # Then the retry executes: a new run, stored and replayable
    retry = httpx.post(new_base + PATH, content=BODY, headers=headers(key, "crash-1"), timeout=30)
    assert retry.status_code == 200, (retry.text, cluster.logs())
    assert "Idempotency-Replayed" not in retry.headers
    assert retry.json()["id"] != record.run_id and retry.json()["status"] == "Completed"
    again = httpx.post(new_base + PATH, content=BODY, headers=headers(key, "crash-1"), timeout=30)
    assert again.headers["Idempotency-Replayed"] == "true" and again.content == retry.content
    wait_for_log(new_web, f"POST {PATH}", timeout=5)
