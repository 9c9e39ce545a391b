"""RabbitMQ as Celery's broker (`Broker:Url`, `tracon_jobs.worker.brokers`), on a virtual host
of the session's own: a run's message goes by Celery's `send_task` to RabbitMQ (no fast path
pushes it to Redis, the fair lines included); a publish the broker refuses is an
`EnqueueError` and a run closed `enqueue_failed`, not a run lost in silence. Runs going through
it to real workers: `tests/e2e/test_rabbitmq_processes.py`."""

from __future__ import annotations

import subprocess

import pytest
import redis

from tests.helpers import MakeRuntime, scripted_agent, wait_until
from tests.rabbitmq import RABBITMQCTL_SECONDS, VirtualHost, queue_depth
from tracon_jobs.errors import EnqueueError
from tracon_jobs.runs.store import NewRun, RunFilter
from tracon_jobs.runtime import Runtime
from tracon_jobs.worker.envelope import RUNS_QUEUE

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def runtime(make_runtime: MakeRuntime, sqlite_url: str, amqp_url: str) -> Runtime:
    """A runtime whose Celery broker is RabbitMQ (the fast paths on, as by default)."""
    sections = scripted_agent([{"Text": "through RabbitMQ"}])
    return make_runtime(sqlite_url, Broker={"Url": amqp_url}, **sections)


def submit(runtime: Runtime) -> str:
    tenant = runtime.tenants.ensure_tenant("acme")
    return runtime.dispatcher.submit(NewRun(tenant, "demo", {"message": "hi"})).id


def test_the_message_waits_on_rabbitmq_not_in_redis(
    runtime: Runtime, redis_client: redis.Redis
) -> None:
    # Given the envelope fast path on (the default), and no worker
    assert not runtime.pushes_runs
    assert runtime.fair_store.queue is None  # the fair lines hand runs to the sender

    # When a run is submitted
    run_id = submit(runtime)

    # Then its message is in RabbitMQ's run queue, and nothing was pushed to a Redis list
    url = runtime.settings.broker.url
    assert url is not None
    assert queue_depth(url, RUNS_QUEUE) == (1, 0)
    assert redis_client.exists(RUNS_QUEUE) == 0
    run = runtime.runs.get(run_id)
    assert run is not None and run.status == "Queued" and run.enqueue_count == 1


def test_a_publish_the_broker_refuses_fails_the_send(
    runtime: Runtime, rabbitmq_vhost: VirtualHost
) -> None:
    # Given the run queue, full for RabbitMQ (a policy: no message accepted)
    with runtime.celery.connection_for_write() as connection:
        runtime.celery.amqp.queues[RUNS_QUEUE].bind(connection.default_channel).declare()
    policy = ["-p", rabbitmq_vhost.name, "tracon-full"]
    full = '{"max-length": 0, "overflow": "reject-publish"}'
    rabbitmqctl(rabbitmq_vhost, "set_policy", *policy, r"^tracon\.runs$", full)
    try:
        wait_until(lambda: refuses(runtime), timeout=10, what="the policy applied")

        # When a run is submitted, Then the broker's nack is the submission's error (publisher
        # confirms: without them the message would be dropped with no error anywhere), and
        # the run is closed as never sent
        with pytest.raises(EnqueueError, match="did not accept"):
            submit(runtime)
    finally:
        rabbitmqctl(rabbitmq_vhost, "clear_policy", *policy)
    tenant = runtime.tenants.ensure_tenant("acme")
    [run] = runtime.runs.page(tenant, RunFilter(), limit=10, before=None)
    assert (run.status, run.error_type) == ("Failed", "enqueue_failed")


def refuses(runtime: Runtime) -> bool:
    """Whether a publish to the full run queue is refused now (a policy applies soon after
    it is set)."""
    try:
        runtime.celery.send_task("tracon.nothing", queue=RUNS_QUEUE, retry=False)
    except Exception:  # kombu's nack
        return True
    return False


def rabbitmqctl(vhost: VirtualHost, *args: str) -> None:
    subprocess.run(
        [vhost.executable, *args], check=True, capture_output=True, timeout=RABBITMQCTL_SECONDS
    )
