"""Webhook endpoints over real processes: two gunicorn web workers take sixteen creations at
the same moment, each answered once with its own endpoint and secret, and each change is told
on Redis as the other processes hear it (a listener of this test's process, standing in for a
worker's subscriptions); a removal over HTTP cancels the endpoint's pending delivery. (That
rotations of one endpoint take turns is held by the store's own test on PostgreSQL: the row
lock is the database's, whichever process takes it.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest
import redis

from tests.e2e.cluster import Cluster, wait_until
from tests.helpers import MakeRuntime
from tests.webhook_rows import delivery, delivery_row, heard, subscribed
from tracon_jobs.webhooks.endpoints import EndpointStore
from tracon_jobs.webhooks.events import CHANGED_CHANNEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CLIENTS = 16


def test_concurrent_creations_over_two_web_processes_are_each_stored_and_told(
    make_cluster: Callable[..., Cluster],
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_client: redis.Redis,
) -> None:
    cluster = make_cluster(sql_url)
    web, base = cluster.web(workers=2)
    wait_until(lambda: web.text().count("Booting worker") == 2, timeout=30, what="two web workers")
    runtime = make_runtime(sql_url)
    tenant = runtime.tenants.ensure_tenant("acme")
    headers = {"Authorization": f"Bearer {runtime.tenants.issue_key(tenant).secret}"}
    listener = subscribed(redis_client, CHANGED_CHANNEL)

    # When sixteen clients create an endpoint at once, each on a connection of its own
    barrier = threading.Barrier(CLIENTS)
    answers: list[httpx.Response] = []

    def create(n: int) -> None:
        body = {"url": f"https://hooks.example.com/{n}", "events": ["run.completed"]}
        with httpx.Client(timeout=30) as client:
            barrier.wait()
            answers.append(client.post(f"{base}/api/webhooks", json=body, headers=headers))

    threads = [threading.Thread(target=create, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    # Then each got its own endpoint and secret, stored, and each creation was told
    assert sorted(a.status_code for a in answers) == [201] * CLIENTS, [a.text for a in answers]
    made = {a.json()["id"]: a.json()["secret"] for a in answers}
    assert len(made) == CLIENTS and len(set(made.values())) == CLIENTS
    store = EndpointStore(runtime.db)
    assert {e.id: e.secret for e in store.page(tenant, 50)} == made
    assert heard(listener, CLIENTS, timeout=10) == [CHANGED_CHANNEL] * CLIENTS

    # And a removal in a web process cancels the endpoint's pending delivery, and is told
    endpoint_id = next(iter(made))
    pending, _ = delivery(runtime.db, endpoint_id, tenant)
    removed = httpx.delete(f"{base}/api/webhooks/{endpoint_id}", headers=headers, timeout=10)
    assert removed.status_code == 204
    assert delivery_row(runtime.db, pending).status == "canceled"
    assert heard(listener, 1) == [CHANGED_CHANNEL]
